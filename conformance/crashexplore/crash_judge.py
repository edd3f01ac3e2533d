"""Judging a recovered queue: the crash condition of ``spec.crash``, plus what reading it
back showed.

``judge_recovered``: the recovered entries, mapped to the model's numbering, must be the
restart view of the state before the interrupted call or after it
(``spec.crash.judge``), or, after a crash at rest (between calls), exactly the restart
view of the state the returned calls left (``call`` None); problems met while reading
them back and draining the queue to zero objects (C6, C8, C10) are added.  A violation
seen only after a second crash, inside recovery, is reported as C10 with the first
clause in its detail (``as_recovery_violations``).
"""

from __future__ import annotations

from conformance.crashexplore.recovered_queue import Recovered, to_views
from conformance.crashexplore.traced_runs import Run
from spec.crash import CLAUSES, allowed_views, judge
from spec.model import Call, EntryView, Model

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
