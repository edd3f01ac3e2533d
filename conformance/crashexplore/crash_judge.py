"""Judging a recovered queue: the crash condition of ``spec.crash``, plus what reading it
back showed.

``judge_recovered``: the recovered entries, mapped to the model's numbering, must be the
restart view of the state before the interrupted call or after it
(``spec.crash.judge``), or, after a crash at rest (between calls), exactly the restart
view of the state the returned calls left (``call`` None); problems met while reading
them back and draining the queue to zero objects (C6, C8, C10) are added.  A violation
seen only after a second crash, inside recovery, is reported as C10 with the first
clause in its detail (``as_recovery_violations``).

``overstated_counts`` (``judge_crashed`` runs it on a state the crash condition allows):
the recovery report of a crash in a workload with no failed call says no more than the
crash can have left (C10): at most one enqueue removed uncommitted
(the interrupted call's, if it was an enqueue) and at most the model's INFLIGHT entries
and the interrupted call's entry requeued.
"""

from __future__ import annotations

from conformance.crashexplore.recovered_queue import Recovered, to_views
from conformance.crashexplore.traced_runs import Run
from spec.crash import CLAUSES, allowed_views, judge
from spec.model import Call, EntryView, Model, keys_of, run
from spec.states import EntryState, Op

Violations = tuple[tuple[str, str], ...]

_allowed: dict[tuple[object, Call | None], tuple[frozenset[EntryView], ...]] = {}


def judge_recovered(rec: Recovered, run: Run, before: Model, call: Call | None) -> Violations:
    views = to_views(rec, run.message_ids, run.entry_keys, before, call)
    ak = (before.canonical(), call)
    allowed = _allowed.get(ak)
    if allowed is None:
        if len(_allowed) > 4096:
            _allowed.clear()
        allowed = _allowed[ak] = allowed_views(before, call)
    if views in allowed and not rec.problems:
        return ()
    found = [(v.clause, v.detail) for v in judge(before, call, views)]
    for p in rec.problems:
        if p not in found:
            found.append(p)
    return tuple(found)


def as_recovery_violations(found: Violations, index: int) -> Violations:
    """Violations seen after recovery itself crashed (after its call ``index``): C10."""
    return tuple(("C10", f"after a crash inside recovery (its mutating call #{index}): "
                         f"{c} ({CLAUSES.get(c, '?')}): {d}") for c, d in found)


def judge_crashed(rec: Recovered, run: Run, before: Model, call: Call | None) -> Violations:
    """``judge_recovered``, then, for a recovered state it allows, ``overstated_counts``
    (a crash of a workload whose calls all succeeded until it).  A state already wrong
    is not judged by its counts: an acknowledged enqueue a crash took back is removed as
    uncommitted, and saying so is no second finding."""
    return judge_recovered(rec, run, before, call) or overstated_counts(rec, before, call)


def overstated_counts(rec: Recovered, before: Model, call: Call | None) -> Violations:
    """A recovery report that counts more than the crash left to do (C10: recovery
    "reports nothing done" when nothing was).  Only for workloads where no call failed
    and no enqueue was abandoned: the one enqueue that can be left uncommitted is the
    interrupted call, and the entries a dead owner can leave claimed are the ones the
    model holds INFLIGHT before or after that call, and that call's entry (a transition
    may claim its entry while it moves it).  Backends that keep no report (or
    none of these counts) are not judged."""
    report = rec.report
    if report is None:
        return ()
    found = []
    enqueues = int(call is not None and call.op is Op.ENQUEUE)
    if report.uncommitted_removed > enqueues:
        found.append(("C10", f"recovery reports {report.uncommitted_removed} uncommitted "
                             f"enqueue(s) removed; at most {enqueues} can have been in "
                             f"progress ({_interrupted(call)})"))
    models = [before] if call is None else [before, run(before, call)[0]]
    held = {k for m in models for k in m.keys_in(EntryState.INFLIGHT)}
    if call is not None:
        held.update(keys_of(call))  # a transition may claim its entry while it moves it
    if report.requeued > len(held):
        found.append(("C10", f"recovery reports {report.requeued} entries requeued; the "
                             f"dead owner held at most {len(held)} claimed or in a "
                             f"transition ({_interrupted(call)})"))
    return tuple(found)


def _interrupted(call: Call | None) -> str:
    return "no call was interrupted" if call is None else f"interrupted: {call.describe()}"
