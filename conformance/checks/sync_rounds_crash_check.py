"""Power cuts inside forced interleavings of sync rounds (``Capability.IO_SEAM``), judged
for every operation that had returned.

The runs are sync-rounds' (``sync_rounds_check.interleave``): for every pair (A, B) of
operations and every sync call A makes, A is stopped inside that sync, B makes its change
and waits, A is let go, both return.  The recorded trace is one list in the order the calls
began (a sync held open sits where it began).  The power is cut before each of its mutating
calls from A's start on (the disk after ``events[:i]``; a sync still open then covered
nothing: ``group_commit_check.syncs_ended_by``) and at rest after both returned (before the
close).  Each cut's disks are built under the check's crash model (``crash_states``, at most
``EXHAUSTIVE_LIMIT`` pending operations enumerated, else targeted states and
``RANDOM_STATES`` random ones), the backend is opened on each (recovery) and read back
(``disk_recovery.recover_image``), and the entries are judged per caller:

* an operation that **returned** before the cut must show its new state after recovery
  (``spec.crash.judge`` with no call in flight): a commit all its entries (C1), a
  ``send_done`` or ``drop`` its entry never back (C3), a ``send_cancel`` or ``reschedule``
  the new schedule (C5), a ``hold`` or ``release`` the new state (C14);
* one **in flight** (begun, not returned; or failed) the old or the new state, whole
  (``spec.crash.judge`` with it as the interrupted call: C2, C5, ...);
* one **not begun** the old state.

A and B change different messages, so each caller is judged on its own message with the
other's entries as the other's status allows.  What reading back found (C6, C8, C10) is a
finding too.  The first cut of a case that breaks a rule is reported; the case stops there.

Scenario ``sync-rounds-crash:<A>-vs-<B>:<j>:<model>:<cut>`` (``cut``: the mutating call's
trace index, or ``rest``): the same interleaving run again and that cut's disks judged (up
to ``REPLAY_TRIES`` runs, until one shows a finding).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from conformance.checks.blackbox_power_loss_check import pick_states
from conformance.checks.group_commit_check import syncs_ended_by
from conformance.checks.sync_rounds_check import (
    CANCELLED,
    FIRST,
    MAX_SYNCS,
    OPERATIONS,
    RESCHEDULED,
    Interleaved,
    interleave,
    mail,
    pairs,
)
from conformance.crashexplore.disk_recovery import recover_image
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.recovered_queue import Recovered, to_views
from conformance.crashexplore.traced_runs import Limits
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.suite_profiles import THOROUGH, Profile
from faultinject.disk import DiskImage
from faultinject.fault_errors import ModelError
from faultinject.models import MODELS, crash_states
from faultinject.trace import TraceEvent
from queue_ref.storage import Capability
from spec.crash import judge
from spec.model import Call, EntryKey, EntryView, Model
from spec.states import Op

OP_OF = {"commit": Op.ENQUEUE, "send_done": Op.SEND_DONE, "send_cancel": Op.SEND_CANCEL,
         "reschedule": Op.RESCHEDULE, "hold": Op.HOLD, "release": Op.RELEASE, "drop": Op.DROP}
NEW_SCHEDULE = {"send_cancel": CANCELLED, "reschedule": RESCHEDULED}
RETURNED, IN_FLIGHT, NOT_BEGUN = "returned", "in flight", "not begun"
HEAD = "sync-rounds-crash"
#: Runs of a replayed scenario until one shows a finding: B let go before it made its
#: change (a loaded machine) misses the interleaving, and that run finds nothing.
REPLAY_TRIES = 3


@dataclass(frozen=True)
class _Caller:
    tag: str  # "a" or "b"
    op: str
    mid: int  # its message's number in the model
    call: Call

    @property
    def who(self) -> str:
        return f"{self.op} ({self.tag.upper()})"


@dataclass(frozen=True)
class _Expected:
    """The model before A and B (their prepared entries; the numbers of the messages
    their commits make kept free), the callers, and the run's ids in model terms."""

    base: Model
    callers: tuple[_Caller, ...]
    message_ids: Mapping[str, int]
    entry_keys: Mapping[str, EntryKey]

    def with_applied(self, applied: Mapping[str, bool]) -> Model:
        m = self.base
        for c in self.callers:
            if not applied[c.tag]:
                continue
            if c.call.op is Op.ENQUEUE:
                made = replace(m, next_id=c.mid).enqueue(c.call.mail_from, c.call.body,
                                                         c.call.rcpts)[0]
                m = replace(made, next_id=self.base.next_id)
            else:
                assert c.call.key is not None
                m = m.apply(c.call.op, c.call.key, c.call.schedule)[0]
        return m


def expected(run: Interleaved) -> _Expected:
    """The run in model terms: the messages prepared for A and B (numbered in the order
    they were made), then the numbers their commits take, and each caller's call."""
    m = Model()
    message_ids: dict[str, int] = {}
    entry_keys: dict[str, EntryKey] = {}
    callers: list[_Caller] = []
    commits: list[str] = []
    for tag, op in (("a", run.a), ("b", run.b)):
        if op == "commit":
            commits.append(tag)
            continue
        sender, body, rcpt = mail(tag)
        m, mid = m.enqueue(sender, body, [(rcpt, FIRST)])
        key = (mid, 0)
        if op in ("send_done", "send_cancel"):
            m = m.apply(Op.SEND_START, key)[0]
        elif op == "release":
            m = m.apply(Op.HOLD, key)[0]
        callers.append(_Caller(tag, op, mid, Call(OP_OF[op], key, NEW_SCHEDULE.get(op))))
    for tag in commits:
        sender, body, rcpt = mail(tag)
        mid = m.next_id
        m = replace(m, next_id=mid + 1)
        callers.append(_Caller(tag, "commit", mid, Call(Op.ENQUEUE, mail_from=sender,
                                                         body=body, rcpts=((rcpt, FIRST),))))
    for c in callers:
        if c.tag in run.ids:
            message, entry = run.ids[c.tag]
            message_ids[message] = c.mid
            entry_keys[entry] = (c.mid, 0)
    return _Expected(m, tuple(sorted(callers, key=lambda c: c.tag)), message_ids, entry_keys)


def status_at(run: Interleaved, tag: str, seq: int | None) -> str:
    """A caller's status when the power went at counter ``seq`` (None: at rest)."""
    span = run.spans.get(tag)
    if span is None or (seq is not None and span.began > seq):
        return NOT_BEGUN
    if (run.outcome.get(tag) == "ok" and span.outcome == "ok" and span.ended >= 0
            and (seq is None or span.ended < seq)):
        return RETURNED
    return IN_FLIGHT


def _part(views: frozenset[EntryView], mid: int) -> frozenset[EntryView]:
    return frozenset(v for v in views if v.msg == mid)


def _fits(exp: _Expected, applied: Mapping[str, bool], mid: int,
          views: frozenset[EntryView]) -> bool:
    """Whether message ``mid``'s entries are as the model with ``applied`` leaves them."""
    return _part(exp.with_applied(applied).restart().view(), mid) == _part(views, mid)


def judge_views(exp: _Expected, status: Mapping[str, str], views: frozenset[EntryView]
                ) -> list[tuple[str, str]]:
    """Each caller judged on its own message: (clause, detail) of every violation."""
    options = {c.tag: (True,) if status[c.tag] == RETURNED else
               (False,) if status[c.tag] == NOT_BEGUN else (False, True) for c in exp.callers}
    allowed = {exp.with_applied(dict(zip(options, ch, strict=True))).restart().view()
               for ch in itertools.product(*options.values())}
    if views in allowed:
        return []
    mids = {c.mid for c in exp.callers}
    out: list[tuple[str, str]] = []
    for c in exp.callers:
        others = [o for o in exp.callers if o is not c]

        applied = {o.tag: next((x for x in options[o.tag]
                                if _fits(exp, {c.tag: False, o.tag: x}, o.mid, views)),
                               options[o.tag][0])
                   for o in others}
        st = status[c.tag]
        before = exp.with_applied({**applied, c.tag: st == RETURNED})
        call = c.call if st == IN_FLIGHT else None
        if call is not None and call.op is Op.ENQUEUE:
            before = replace(before, next_id=c.mid)
        rest = frozenset(v for v in before.restart().view() if v.msg != c.mid)
        spliced = _part(views, c.mid) | rest
        if c is exp.callers[0]:
            spliced |= frozenset(v for v in views if v.msg not in mids)
        out += [(v.clause, f"{c.who}, {st} at the cut: {v.detail}")
                for v in judge(before, call, spliced)]
    return out or [("C5", "a mixture of the callers' old and new states was recovered")]


def cuts(run: Interleaved, every_call: bool = True) -> list[int]:
    """Where the power goes, as trace indexes (the disk after ``events[:i]``): before
    every mutating call from A's start on, or (``every_call`` false) only before the first
    one after each acknowledgement; then at rest (``at_rest``)."""
    events = run.io.events[:run.at_rest]
    start = min(s.began for s in run.spans.values())
    mutating = [i for i, e in enumerate(events) if e.mutating and e.began > start]
    if not every_call:
        acks = [s.ended for s in run.spans.values() if s.outcome == "ok" and s.ended >= 0]
        mutating = sorted({next(i for i in (*mutating, len(events))
                                if i == len(events) or events[i].began > ack)
                           for ack in acks} - {len(events)})
    return [*mutating, len(events)]


def _excerpt(run: Interleaved, events: Sequence[TraceEvent], cut: int) -> tuple[str, ...]:
    """The calls around the cut, with each one's caller and counters."""
    who = {s.thread: tag.upper() for tag, s in run.spans.items()}
    low = max(0, cut - 8)
    lines = [f"{'>' if i == cut else ' '} [{e.began}..{e.ended}] "
             f"{who.get(e.thread, 'setup')}: {e.short()}"
             for i, e in enumerate(events[low:cut + 3], low)]
    return ("the trace around the cut (> the call the power went before):", *lines)


@dataclass
class CaseResult:
    reached: bool
    findings: list[Finding]
    cuts: int = 0
    states: int = 0


def _cut_name(events: Sequence[TraceEvent], cut: int) -> str:
    return "rest" if cut >= len(events) else str(cut)


def run_case(backend: Backend, a: str, b: str, j: int, model: str, limits: Limits,
             only_cut: str | None = None, every_call: bool = True,
             max_states: int = 0) -> CaseResult:
    """A stopped in its ``j``-th sync while B runs; the power cut at each of ``cuts``
    (or only at ``only_cut``: a trace index, or ``rest``) under ``model``, at most
    ``max_states`` states judged per cut (0: every one built)."""
    run = interleave(backend, a, b, j)
    if run is None:
        return CaseResult(False, [])
    return judge_run(backend, run, model, limits, only_cut, every_call, max_states)


def judge_run(backend: Backend, run: Interleaved, model: str, limits: Limits,
              only_cut: str | None = None, every_call: bool = True,
              max_states: int = 0) -> CaseResult:
    """``run_case`` on an interleaving already run."""
    a, b, j = run.a, run.b, run.j
    spec = BackendSpec(backend.name, backend.open, f"certified factory {backend.name}")
    exp = expected(run)
    events = run.io.events[:run.at_rest]
    points = cuts(run, every_call or only_cut is not None)
    if only_cut is not None:
        points = [p for p in points if _cut_name(events, p) == only_cut]
        if not points:
            raise ValueError(f"{HEAD}:{a}-vs-{b}:{j}: no mutating call at trace index "
                             f"{only_cut} from A's start on (cuts: "
                             f"{', '.join(_cut_name(events, p) for p in cuts(run))})")
    result = CaseResult(True, [], len(points))
    judged: set[tuple[DiskImage, tuple[str, ...]]] = set()
    for cut in points:
        seq = events[cut].began if cut < len(events) else None
        status = {c.tag: status_at(run, c.tag, seq) for c in exp.callers}
        prefix = events if seq is None else syncs_ended_by(events[:cut], seq)
        name = _cut_name(events, cut)
        scenario = f"{HEAD}:{a}-vs-{b}:{j}:{model}:{name}"
        where = ("at rest, after both returned" if seq is None else
                 f"before mutating call #{cut} of the trace ({events[cut].short()})")
        steps = (*run.steps, f"power cut {where}: "
                 + "; ".join(f"{c.who} {status[c.tag]}" for c in exp.callers))
        try:
            states = crash_states(run.io.initial, prefix, model,
                                  exhaustive_limit=limits.exhaustive_limit,
                                  random_states=limits.random_states, seed=limits.seed)
        except ModelError as e:
            result.findings.append(Finding("C9", f"the trace cannot be replayed for a power cut "
                                                 f"{where}: {e}", scenario, model, steps))
            return result
        key = tuple(status[c.tag] for c in exp.callers)
        for st in pick_states(states, max_states, random.Random(f"{limits.seed}:{scenario}")):
            if (st.image, key) in judged:
                continue
            judged.add((st.image, key))
            result.states += 1
            bad = _judge_recovered(exp, status, recover_image(spec, st.image))
            if bad:
                result.findings += [
                    Finding(clause, f"{detail} (power cut {where}, {model}: {st.description}; "
                                    f"state {st.key})", scenario, model,
                            (*steps, *_excerpt(run, events, cut)))
                    for clause, detail in bad]
                return result
    return result


def _judge_recovered(exp: _Expected, status: Mapping[str, str], rec: Recovered
                     ) -> list[tuple[str, str]]:
    views = to_views(rec, exp.message_ids, exp.entry_keys, exp.base, None)
    found = judge_views(exp, status, views)
    return found + [p for p in rec.problems if p not in found]


def limits_of(profile: Profile, seed: int = 0) -> Limits:
    """The crash states built per cut in ``profile`` (the random ones drawn by ``seed``)."""
    return Limits(profile.rounds_crash_exhaustive_limit, profile.rounds_crash_random_states,
                  seed)


def replay(backend: Backend, scenario: str, profile: Profile = THOROUGH) -> list[Finding]:
    """Run ``sync-rounds-crash:<A>-vs-<B>:<j>:<model>:<cut>`` again."""
    usage = f"{HEAD}:<A>-vs-<B>:<sync call>:<model>:<trace index or rest>"
    try:
        head, names, j, model, cut = scenario.split(":")
        a, b = names.split("-vs-")
        number = int(j)
        if cut != "rest":
            int(cut)
    except ValueError:
        raise ValueError(f"not a {HEAD} scenario: {scenario!r} ({usage})") from None
    if head != HEAD or a not in OPERATIONS or b not in OPERATIONS or number < 0:
        raise ValueError(f"not a {HEAD} scenario: {scenario!r} ({usage}; operations: "
                         f"{', '.join(OPERATIONS)})")
    if model not in MODELS:
        raise ValueError(f"{scenario}: unknown crash model {model!r}; known: {sorted(MODELS)}")
    for _ in range(REPLAY_TRIES):
        got = run_case(backend, a, b, number, model, limits_of(profile), cut)
        if not got.reached:
            raise ValueError(f"{scenario}: {a} makes fewer than {number + 1} sync calls here")
        if got.findings:
            break
    return got.findings


def run_all(backend: Backend, models: Sequence[str], profile: Profile, seed: int,
            capabilities: frozenset[Capability]) -> list[CheckResult]:
    """The check under every crash model of ``models``, each interleaving run once."""
    start = time.perf_counter()
    findings: dict[str, list[Finding]] = {m: [] for m in models}
    seconds = dict.fromkeys(models, 0.0)
    points, states = dict.fromkeys(models, 0), dict.fromkeys(models, 0)
    cases = 0
    failing = dict.fromkeys(models, 0)
    for a, b in pairs(capabilities):
        for j in range(MAX_SYNCS):
            run = interleave(backend, a, b, j)
            if run is None:
                break
            cases += 1
            for model in models:
                t = time.perf_counter()
                got = judge_run(backend, run, model, limits_of(profile, seed),
                                every_call=profile.rounds_crash_every_call,
                                max_states=profile.rounds_crash_max_states)
                seconds[model] += time.perf_counter() - t
                points[model] += got.cuts
                states[model] += got.states
                findings[model] += got.findings
                failing[model] += bool(got.findings)
    runs = time.perf_counter() - start - sum(seconds.values())
    return [finished(HEAD, m, findings[m], seconds=seconds[m] + runs / len(models), seed=seed,
                     stats={"cases": cases, "cuts": points[m], "states": states[m],
                            "failing_cases": failing[m]})
            for m in models]


def run(backend: Backend, model: str, profile: Profile, seed: int,
        capabilities: frozenset[Capability]) -> CheckResult:
    """The check under one crash model."""
    (res,) = run_all(backend, [model], profile, seed, capabilities)
    return res
