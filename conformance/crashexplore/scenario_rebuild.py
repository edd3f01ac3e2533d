"""Rebuilding one crash state from its scenario id, as a pure, picklable function call.

``run_case(CaseInput) -> CaseOutcome`` rebuilds one crash state from plain data (backend
name, workload, crash point, persistence model, state key) and judges what recovery makes
of it; it needs no state of the caller, so a cluster can spread cases over machines.
``build_case`` does the same and keeps the pieces a report shows
(``reproduction.explain``).  It runs the same steps as ``crash_task.explore_task`` for
the one state the id names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.crash_judge import as_recovery_violations, judge_crashed
from conformance.crashexplore.crash_scenario import AT_REST, WHENS, CaseInput, CaseOutcome
from conformance.crashexplore.crash_task import eio_judge, eio_run, rest_check
from conformance.crashexplore.disk_recovery import recover_image, recovery_trace
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.recovered_queue import Recovered
from conformance.crashexplore.traced_runs import Run, events_through, image_digest, run_workload
from conformance.crashexplore.workloads import Workload
from faultinject.fault_errors import ModelError
from faultinject.models import CrashState, crash_state
from faultinject.seam import FaultPlan
from faultinject.trace import TraceEvent
from spec.model import Call


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
        run, failed, problems, succeeded = eio_run(backend, case.workload, case.index)
        cut = events_through(run, failed) if succeeded else len(run.events)
        state = crash_state(run.initial, run.events[:cut], case.model, case.state_key)
        rec = recover_image(backend, state.image)
        found = problems + eio_judge(rec, run, failed, succeeded)
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
        found = judge_crashed(rec, run, before, call)
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
    found = as_recovery_violations(judge_crashed(rec2, run, before, call),
                                   case.recovery_index)
    return Built(CaseOutcome(case, sid, found, run.trace_hash, image_digest(second.image),
                             f"first crash: {state.description}; crash in recovery: "
                             f"{second.description}"),
                 run, interrupted, state, second, events, rec2, at_rest)
