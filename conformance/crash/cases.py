"""Crash cases as pure, picklable function calls.

``run_case(CaseInput) -> CaseOutcome`` rebuilds one crash state from plain data (backend
name, workload, crash point, persistence model, state key) and judges what recovery makes
of it; it needs no state of the caller, so a cluster can spread cases over machines.
``build_case`` does the same and keeps the pieces a report shows.

Judging (``judge_recovered``): the recovered entries, mapped to the model's numbering,
must be the restart view of the state before the interrupted call or after it
(``spec.crash.judge``), or, after a crash at rest (between calls, ``when == "rest"``),
exactly the restart view of the state the returned calls left (``call`` None); problems
met while reading them back and draining the queue to zero objects (C6, C8, C10) are
added.  A violation seen only after a second crash, inside recovery, is reported as C10
with the first clause in its detail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.crash.backends import BackendSpec, resolve
from conformance.crash.recovered import Recovered, inspect, to_views
from conformance.crash.runner import (
    OPEN,
    Run,
    ScratchIO,
    image_digest,
    recover_image,
    recovery_trace,
    run_workload,
    scratch_dir,
)
from conformance.crash.scenario import AT_REST, NO_CRASH, WHENS, ScenarioId, decode_workload
from conformance.crash.workloads import Workload
from faultinject.errors import ModelError
from faultinject.models import CrashState, crash_state
from faultinject.seam import FaultPlan
from faultinject.trace import SYNC_CALLS, TraceEvent
from queue_ref.storage import StorageIOError
from spec.crash import CLAUSES, allowed_views, judge
from spec.model import Call, EntryView, Model

Violations = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CaseInput:
    """One crash state, as plain data (see ``scenario`` for the meaning of the fields)."""

    backend: str
    workload_id: str
    workload: Workload
    kind: str = "crash"  # "crash", "recovery", "eio" or "rest"
    model: str = NO_CRASH
    index: int = -1  # mutating call that crashed (or failed, for "eio"); at rest: calls
    when: str = "after"  # "before", "after", or AT_REST: between calls, ``index`` returned
    state_key: str = ""
    recovery_index: int = -1
    recovery_key: str = ""
    seed: int = 0  # of the state sampler that chose the state (the key alone rebuilds it)

    @property
    def scenario(self) -> ScenarioId:
        return ScenarioId(self.backend, self.model, self.workload_id, self.kind, self.index,
                          self.when, self.state_key, self.recovery_index, self.recovery_key)

    @classmethod
    def from_scenario(cls, sid: ScenarioId) -> CaseInput:
        return cls(sid.backend, sid.workload_id, decode_workload(sid.workload_id), sid.kind,
                   sid.model, sid.index, sid.when, sid.key, sid.recovery_index,
                   sid.recovery_key)


@dataclass(frozen=True)
class CaseOutcome:
    case: CaseInput
    scenario: str
    violations: Violations
    trace_hash: str = ""  # of the workload's run (FaultyIO.trace_hash)
    image: str = ""  # digest of the judged disk
    description: str = ""  # what the crash kept, dropped and tore
    error: str = ""  # the case could not be built (not a violation of the backend)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.error

    @property
    def clauses(self) -> tuple[str, ...]:
        return tuple(sorted({c for c, _ in self.violations}, key=_clause_order))


def _clause_order(c: str) -> tuple[int, str]:
    return (int(c[1:]), c) if c[1:].isdigit() else (99, c)


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


def rest_check(backend: BackendSpec, workload: Workload
                     ) -> tuple[Run, Violations, str, Recovered | None]:
    """Run without faults, close, reopen: the restart view of the final model, and
    draining everything must leave zero objects (C8)."""
    with scratch_dir() as d:
        run = run_workload(backend, workload, root=d)
        if run.divergence is not None:
            return run, ((run.divergence.clause, str(run.divergence)),), "", None
        if run.error is not None:
            return run, (), (f"call {run.stopped_in} raised {type(run.error).__name__}: "
                             f"{run.error}"), None
        rec = inspect(lambda: backend.open(d, ScratchIO()))
    return run, judge_recovered(rec, run, run.models[-1], None), "", rec


def sync_points(run: Run, call: int) -> list[int]:
    """Mutating indexes of the fsyncs (file or directory) made during ``call``."""
    out, m = [], 0
    for e in run.events:
        if e.mutating:
            if e.name in SYNC_CALLS and run.op_starts[call] <= m < run.op_ends[call]:
                out.append(m)
            m += 1
    return out


def eio_run(backend: BackendSpec, workload: Workload, index: int
             ) -> tuple[Run, int, Violations, str]:
    """Fail mutating call ``index`` (a sync) with EIO.  Returns the run, the call that
    contained it, the C9 violation if that call still succeeded, and how many events the
    power cut after the call sees."""
    run = run_workload(backend, workload, FaultPlan(fail_at=index))
    injected = next((e for e in run.events if e.injected), None)
    if injected is None:
        raise ValueError(f"the run made no mutating call #{index}")
    call = run.call_of_event(injected.index)
    if call in (OPEN, len(workload)):
        raise ValueError(f"mutating call #{index} is not inside a call of the workload")
    if run.stopped_in == call and run.error is not None:
        if isinstance(run.error, StorageIOError):
            return run, call, (), ""
        return run, call, (("C9", f"call {call} {workload[call].describe()} raised "
                                  f"{type(run.error).__name__} ({run.error}), not "
                                  "StorageIOError, when its fsync failed"),), ""
    if run.divergence is not None:
        return run, call, ((run.divergence.clause, str(run.divergence)),), ""
    c9 = (("C9", f"call {call} {workload[call].describe()} succeeded although its "
                 f"{injected.short()} failed with EIO"),)
    return run, call, c9, ""


def events_through(run: Run, call: int) -> int:
    """How many events precede the end of ``call`` (a later call's events excluded)."""
    m = 0
    for pos, e in enumerate(run.events):
        if e.mutating:
            if m >= run.op_ends[call]:
                return pos
            m += 1
    return len(run.events)


@dataclass
class Built:
    """A case rebuilt, with what a report needs besides the outcome."""

    outcome: CaseOutcome
    run: Run | None = None
    call: int | None = None  # the interrupted (or failing) call; OPEN for opening
    state: CrashState | None = None
    second: CrashState | None = None  # the state left by the crash inside recovery
    recovery_events: list[TraceEvent] = field(default_factory=list)
    recovered: Recovered | None = None
    at_rest: int | None = None  # a crash at rest: how many calls had returned


def rest_run(backend: BackendSpec, workload: Workload, calls: int) -> tuple[Run, int]:
    """Run ``workload`` without faults; the run and how many of its events a crash at rest
    after ``calls`` returned calls keeps (``ValueError`` if the run stopped earlier)."""
    run = run_workload(backend, workload)
    what = run.divergence if run.divergence is not None else run.error
    if what is not None and run.returned() < calls:
        raise ValueError(f"call {run.stopped_in} stopped the run before {calls} calls "
                         f"returned: {type(what).__name__}: {what}")
    return run, run.rest_cut(calls)


def run_case(case: CaseInput) -> CaseOutcome:
    """Rebuild and judge one crash state.  Deterministic; touches only scratch dirs."""
    return build_case(case).outcome


def build_case(case: CaseInput) -> Built:
    """``run_case`` keeping the run, the states and the recovered entries."""
    sid = str(case.scenario)
    try:
        return _build(case, sid)
    except (ModelError, ValueError) as e:
        return Built(CaseOutcome(case, sid, (), error=f"{type(e).__name__}: {e}"))


def _build(case: CaseInput, sid: str) -> Built:
    backend = resolve(case.backend)
    if case.kind == "rest":
        run, found, err, rec = rest_check(backend, case.workload)
        return Built(CaseOutcome(case, sid, found, run.trace_hash, error=err), run,
                     recovered=rec)
    if case.kind == "eio":
        run, failed, c9, _ = eio_run(backend, case.workload, case.index)
        cut = events_through(run, failed) if c9 else len(run.events)
        state = crash_state(run.initial, run.events[:cut], case.model, case.state_key)
        rec = recover_image(backend, state.image)
        found = c9 + judge_recovered(rec, run, run.models[failed], case.workload[failed])
        return Built(CaseOutcome(case, sid, found, run.trace_hash, image_digest(state.image),
                                 state.description), run, failed, state, recovered=rec)
    if case.kind not in ("crash", "recovery"):
        raise ValueError(f"unknown case kind {case.kind!r}")
    if case.when not in WHENS:
        raise ValueError(f"unknown crash moment {case.when!r}; known: {', '.join(WHENS)}")
    call: Call | None
    interrupted: int | None
    at_rest: int | None = None
    if case.when == AT_REST:
        run, cut = rest_run(backend, case.workload, case.index)
        at_rest, interrupted = case.index, None
        before, call = run.models[case.index], None
    else:
        run = run_workload(backend, case.workload,
                           FaultPlan(crash_at=case.index, crash_when=case.when))
        if not run.crashed:
            return Built(CaseOutcome(case, sid, (), run.trace_hash, error=(
                f"no crash: the run made only {run.mutating_total} mutating calls")), run)
        cut, interrupted = len(run.events), run.stopped_in
        before, call = run.interrupted()
    state = crash_state(run.initial, run.events[:cut], case.model, case.state_key)
    rec = recover_image(backend, state.image)
    if case.kind == "crash":
        found = judge_recovered(rec, run, before, call)
        return Built(CaseOutcome(case, sid, found, run.trace_hash, image_digest(state.image),
                                 state.description), run, interrupted, state,
                     recovered=rec, at_rest=at_rest)
    initial, events, crashed = recovery_trace(
        backend, state.image, FaultPlan(crash_at=case.recovery_index, crash_when="after"))
    if not crashed:
        return Built(CaseOutcome(case, sid, (), run.trace_hash, error=(
            f"recovery made fewer than {case.recovery_index + 1} mutating calls")), run,
            interrupted, state, at_rest=at_rest)
    second = crash_state(initial, events, case.model, case.recovery_key)
    rec2 = recover_image(backend, second.image)
    found = as_recovery_violations(judge_recovered(rec2, run, before, call),
                                   case.recovery_index)
    return Built(CaseOutcome(case, sid, found, run.trace_hash, image_digest(second.image),
                             f"first crash: {state.description}; crash in recovery: "
                             f"{second.description}"),
                 run, interrupted, state, second, events, rec2, at_rest)
