"""Exploring every crash point of one workload: the unit of work of the explorer.

``explore_task(Task) -> TaskResult`` runs the workload once without faults (and checks an
orderly restart and a drain to zero), then for each mutating call of the calls it covers
reruns the workload crashing before and after that call, builds every crash state each
persistence model allows (``faultinject.models.crash_states``), recovers and judges each.
Then it crashes *at rest*: after each call it covers returned (the last one at least),
with no operation in flight, the process dies without closing the queue; the states are
built from the fault-free run's trace up to that moment and must recover to exactly the
restart view of the model there.  Only these points show a backend that acknowledges
operations without writing them (kept in its memory, or written but never synced): it
may make no mutating call after its last acknowledgement, or none at all.
Recoveries are cached per disk image, so states that several crash points share cost one
recovery.  States that pass are then crashed again inside their recovery (a sample of
them per crash point, see ``Task.recovery_sample``), and the last call's fsyncs are each
failed with EIO once (C9).  Only failing states are kept as ``CaseOutcome``s; the others
are counted.  Tasks and results are picklable (worker processes run them).

A big task can be split by crash point: ``Task.shard = (i, n)`` explores only the crash
points whose ordinal (inside calls, then at rest, then EIO, in that order) is ``i``
modulo ``n``; the fault-free run and its restart check are recorded by shard 0 alone, so
the shards of a task add up to the whole task.  With ``Task.log_points`` the result also
keeps what each crash point found (``point_log.PointLog``), the rows of a campaign.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.crash_judge import (
    as_recovery_violations,
    judge_crashed,
    judge_recovered,
)
from conformance.crashexplore.crash_scenario import (
    AT_REST,
    NO_CRASH,
    CaseInput,
    CaseOutcome,
    Violations,
    workload_id,
)
from conformance.crashexplore.disk_recovery import (
    recover_image,
    recovery_crash_points,
    recovery_crash_states,
)
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.point_log import PointLog
from conformance.crashexplore.recovered_queue import Recovered, inspect
from conformance.crashexplore.traced_runs import (
    OPEN,
    Limits,
    Run,
    ScratchIO,
    events_through,
    image_digest,
    run_workload,
    scratch_dir,
    sync_points,
    uncovered,
)
from conformance.crashexplore.workloads import Workload
from faultinject.disk import DiskImage
from faultinject.fault_errors import ModelError
from faultinject.models import CrashState, crash_states, is_exhaustive
from faultinject.seam import FaultPlan
from queue_ref.storage import StorageIOError
from spec.crash import CLAUSES
from spec.model import Call, Model

DEFAULT_LIMITS = Limits()
#: States per crash inside recovery: fewer, since every passing first state has its own.
RECOVERY_LIMITS = Limits(exhaustive_limit=4, random_states=4)


@dataclass(frozen=True)
class Task:
    """Every crash point of ``workload`` from call ``first_call`` on (OPEN: opening the
    queue too), under each of ``models``."""

    backend: str
    workload_id: str
    workload: Workload
    first_call: int
    models: tuple[str, ...]
    limits: Limits = DEFAULT_LIMITS
    recovery: bool = True  # also crash inside recovery (C10)
    recovery_limits: Limits = RECOVERY_LIMITS
    recovery_sample: int = 3  # first-level states per crash point and model (0: all)
    eio: bool = True  # also fail each fsync of the last call with EIO (C9)
    at_rest: bool = True  # also crash at rest, after each call covered returned
    shard: tuple[int, int] = (0, 1)  # (i, n): only the crash points numbered i modulo n
    log_points: bool = False  # keep a PointLog per crash point (TaskResult.log)

    def owns(self, ordinal: int) -> bool:
        """Whether crash point number ``ordinal`` of the workload belongs to this shard."""
        return ordinal % self.shard[1] == self.shard[0]


def task_for(backend: str, workload: Workload, models: tuple[str, ...], *,
             whole: bool = False, **kw: Any) -> Task:
    """A task for one given workload: crash points inside its last call (or, with
    ``whole``, inside every call and the opening of the queue)."""
    first = OPEN if whole or not workload else len(workload) - 1
    return Task(backend, workload_id(workload), tuple(workload), first, models, **kw)


@dataclass
class ModelStats:
    points: int = 0
    states: int = 0
    recovery_states: int = 0
    eio_states: int = 0
    images: set[str] = field(default_factory=set)
    violations: dict[str, int] = field(default_factory=dict)

    def count(self, digest: str, kind: str = "crash") -> None:
        """One more state judged without violation."""
        if kind == "recovery":
            self.recovery_states += 1
        elif kind == "eio":
            self.eio_states += 1
        else:
            self.states += 1
        self.images.add(digest)

    def merge(self, other: ModelStats) -> None:
        self.points += other.points
        self.states += other.states
        self.recovery_states += other.recovery_states
        self.eio_states += other.eio_states
        self.images |= other.images
        for c, n in other.violations.items():
            self.violations[c] = self.violations.get(c, 0) + n


@dataclass
class TaskResult:
    workload_id: str
    points: int = 0  # crash points (each mutating call, before and after; and at rest)
    rest_points: int = 0  # of which at rest (between calls, nothing in flight)
    eio_points: int = 0  # fsyncs failed with EIO
    per_model: dict[str, ModelStats] = field(default_factory=dict)
    failures: list[CaseOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: model -> operation -> [crash points inside it, of which crashed and judged,
    #: instances of it crashed at every one of their points]
    coverage: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    #: one entry per crash point, when the task asked for it (``Task.log_points``)
    log: list[PointLog] | None = None

    def cover(self, model: str, op: str, points: int, crashed: int, whole: bool = True
              ) -> None:
        """``whole``: the task saw every crash point of the operation (not a shard)."""
        row = self.coverage.setdefault(model, {}).setdefault(op, [0, 0, 0])
        row[0] += points
        row[1] += crashed
        row[2] += int(whole and crashed == points)  # no mutating call: vacuously

    def begin_point(self, kind: str, index: int, when: str, models: tuple[str, ...]) -> None:
        """A new crash point starts (only noted when points are logged)."""
        if self.log is None:
            return
        self.end_point()
        entry = PointLog(kind, index, when, errors_from=len(self.errors))
        for m in models:
            entry.model(m)
        self.log.append(entry)

    def end_point(self) -> None:
        if self.log and not self.log[-1].seconds:
            self.log[-1].close(self.errors)

    def judged(self, model: str, exhaustive: bool) -> None:
        """The current crash point's states were built under ``model``."""
        self.stats(model).points += 1
        if self.log:
            at = self.log[-1].model(model)
            at.judged = True
            at.exhaustive = exhaustive

    def count(self, model: str, digest: str, kind: str = "crash") -> None:
        """One more state judged without violation."""
        self.stats(model).count(digest, kind)
        if self.log:
            at = self.log[-1].model(model)
            at.count(kind)
            at.images.add(digest)

    def stats(self, model: str) -> ModelStats:
        return self.per_model.setdefault(model, ModelStats())

    def record(self, model: str, outcome: CaseOutcome, *, kind: str = "crash") -> None:
        st = self.stats(model)
        if kind == "recovery":
            st.recovery_states += 1
        elif kind == "eio":
            st.eio_states += 1
        else:
            st.states += 1
        if outcome.image:
            st.images.add(outcome.image)
        for c in outcome.clauses:
            st.violations[c] = st.violations.get(c, 0) + 1
        if outcome.violations:
            self.failures.append(outcome)
        if outcome.error:
            self.errors.append(f"{outcome.scenario}: {outcome.error}")
        if self.log:
            at = self.log[-1].model(model)
            at.count(kind)
            if outcome.image:
                at.images.add(outcome.image)
            if outcome.violations:
                at.failures.append((outcome.scenario, outcome.clauses,
                                    outcome.violations[0][1]))


def explore_task(task: Task) -> TaskResult:
    """Explore every crash point of one workload (see ``Task``)."""
    t0 = time.perf_counter()
    out = TaskResult(task.workload_id, log=[] if task.log_points else None)
    backend = resolve(task.backend)
    base = CaseInput(task.backend, task.workload_id, task.workload, seed=task.limits.seed)
    # 1. run the workload without faults; an orderly restart must show the model's state
    out.begin_point("rest-check", -1, "", ())
    ref, found, err, _ = rest_check(backend, task.workload)
    if task.shard[0] == 0:
        rest = replace(base, kind="rest")
        out.record(NO_CRASH, CaseOutcome(rest, str(rest.scenario), found, ref.trace_hash,
                                         error=err))
    if task.shard[0] != 0 and out.log:
        out.log.pop()  # the other shards' fault-free runs repeat shard 0's
    if ref.divergence is not None or ref.error is not None:
        out.end_point()
        out.seconds = time.perf_counter() - t0
        return out
    _explore_points(task, backend, base, ref, out)
    out.end_point()
    out.seconds = time.perf_counter() - t0
    return out


def _explore_points(task: Task, backend: BackendSpec, base: CaseInput, ref: Run,
                    out: TaskResult) -> None:
    """Steps 2 to 4 of ``explore_task``, for the crash points of the task's shard."""
    judge = _Judge(backend, task, base, out)
    # 2. crash before and after each mutating call, build every state each model allows,
    #    recover, judge, record (and count which operation each point was inside)
    per_op: dict[str, dict[str, list[int]]] = {
        model: {c.op.value: [0, 0] for c in task.workload[max(task.first_call, 0):]}
        for model in task.models}
    ordinal = -1
    for m in _crash_points(ref, task.first_call):
        op = _op_at(ref, m)
        for when in ("before", "after"):
            ordinal += 1
            if not task.owns(ordinal):
                continue
            out.begin_point("crash", m, when, task.models)
            out.points += 1
            run = run_workload(backend, task.workload, FaultPlan(crash_at=m, crash_when=when))
            judged: set[str] = set()
            if not run.crashed:
                out.errors.append(f"{task.workload_id}: no crash at mutating call #{m} "
                                  "(the rerun made fewer calls than the first run)")
            else:
                before, call = run.interrupted()
                judged = judge.point(run, len(run.events), before, call, m, when,
                                     f"crash {when} #{m}")
            for model in task.models:
                row = per_op.setdefault(model, {}).setdefault(op, [0, 0])
                row[0] += 1
                row[1] += model in judged
    for model, ops in per_op.items():
        for op, (points, crashed) in ops.items():
            out.cover(model, op, points, crashed, whole=task.shard[1] == 1)
    # 3. crash at rest after each call covered, and (in judge.point) again inside the
    #    recovery of a sample of the passing states
    if task.at_rest:
        # The process dies between calls, without closing the queue: the disk is what
        # reached the seam, as each model keeps it (buffered data is lost even under
        # process-kill), and recovery must show exactly the state after those calls.
        for n in rest_points(ref, task.first_call):
            ordinal += 1
            if not task.owns(ordinal):
                continue
            out.begin_point("rest", n, AT_REST, task.models)
            out.points += 1
            out.rest_points += 1
            judge.point(ref, ref.rest_cut(n), ref.models[n], None, n, AT_REST,
                        f"crash at rest after {n} calls")
    # 4. fail each fsync of the last call with EIO, then cut the power
    if task.eio and task.workload:
        last = len(task.workload) - 1
        if task.first_call == OPEN or task.first_call <= last:
            for m in sync_points(ref, last):
                ordinal += 1
                if task.owns(ordinal):
                    out.begin_point("eio", m, "after", task.models)
                    _explore_eio(backend, task, base, m, out)


# ---- the steps of the pipeline, in the order explore_task runs them ----------------

def rest_check(backend: BackendSpec, workload: Workload
                     ) -> tuple[Run, Violations, str, Recovered | None]:
    """Run without faults, close, reopen: the restart view of the final model, and
    draining everything must leave zero objects (C8); the run's trace is judged by the
    sync-cover rule (``traced_runs.uncovered``: an acknowledgement that rode a sync begun
    before its change; a trace it cannot replay is an error, as for a crash point)."""
    with scratch_dir() as d:
        run = run_workload(backend, workload, root=d)
        if run.divergence is not None:
            return run, ((run.divergence.clause, str(run.divergence)),), "", None
        if run.error is not None:  # no fault was injected: the model says every call works
            i = run.stopped_in
            what = ("opening the queue" if i is None or i < 0
                    else f"call {i} {workload[i].describe()}")
            return run, (("C9", f"{what} raised {type(run.error).__name__}: {run.error}, "
                                "although no fault was injected (the model has it succeed)"),
                         ), "", None
        rec = inspect(lambda: backend.open(d, ScratchIO()))
    try:
        rode, err = tuple(uncovered(run)), ""
    except ModelError as e:
        rode, err = (), f"the trace cannot be replayed for the sync-cover rule: {e}"
    return run, judge_crashed(rec, run, run.models[-1], None) + rode, err, rec


def _op_at(ref: Run, m: int) -> str:
    """The operation during which mutating call ``m`` of the run was made."""
    for c in range(len(ref.op_starts)):
        if ref.op_starts[c] <= m < ref.op_ends[c]:
            return ref.workload[c].op.value
    return "open"


def _crash_points(ref: Run, first_call: int) -> Iterator[int]:
    start = 0 if first_call == OPEN else ref.op_starts[first_call]
    end = ref.op_ends[-1] if ref.op_ends else ref.open_end
    return iter(range(start, end))


def rest_points(ref: Run, first_call: int) -> list[int]:
    """The crash points at rest of a task: how many calls had returned at each (after
    every call it covers; with OPEN, right after opening too)."""
    first = 0 if first_call == OPEN else first_call + 1
    return list(range(first, ref.returned() + 1))


@dataclass
class _Judge:
    """Builds, recovers and judges the states of one crash point under each model, and
    crashes a sample of the passing ones again inside their recovery."""

    backend: BackendSpec
    task: Task
    base: CaseInput
    out: TaskResult
    recovery_cache: dict[tuple[str, object], list[_Second]] = field(default_factory=dict)

    def point(self, run: Run, cut: int, before: Model, call: Call | None, index: int,
              when: str, label: str) -> set[str]:
        """The crash point that keeps ``run.events[:cut]``: the interrupted ``call`` met
        ``before`` (``call`` None: at rest, or while opening).  Returns the models under
        which its states were built and judged."""
        task, out, lim = self.task, self.out, self.task.limits
        judged: set[str] = set()
        for model in task.models:
            try:
                states = crash_states(run.initial, run.events[:cut], model,
                                      exhaustive_limit=lim.exhaustive_limit,
                                      random_states=lim.random_states, seed=lim.seed)
            except ModelError as e:
                out.judged(model, True)
                out.errors.append(f"{task.workload_id} {label} under {model}: "
                                  f"the trace cannot be replayed: {e}")
                continue
            out.judged(model, out.log is None or is_exhaustive(
                run.initial, run.events[:cut], model, exhaustive_limit=lim.exhaustive_limit))
            judged.add(model)
            sampled = _sample(len(states), task.recovery_sample)
            for pos, st in enumerate(states):
                digest = image_digest(st.image)
                found = judge_crashed(recover_image(self.backend, st.image), run, before,
                                      call)
                if found:
                    case = replace(self.base, kind="crash", model=model, index=index,
                                   when=when, state_key=st.key)
                    out.record(model, CaseOutcome(case, str(case.scenario), found,
                                                  run.trace_hash, digest, st.description))
                    continue
                out.count(model, digest)
                if task.recovery and pos in sampled:
                    self._in_recovery(run, before, call, model, st, index, when)
        return judged

    def _in_recovery(self, run: Run, before: Model, call: Call | None, model: str,
                     st: CrashState, index: int, when: str) -> None:
        task, out = self.task, self.out
        ck = (model, st.image)
        if ck not in self.recovery_cache:
            try:
                self.recovery_cache[ck] = _recovery_states(self.backend, st.image, model,
                                                           task.recovery_limits)
            except ModelError as e:
                out.errors.append(f"{task.workload_id}: a crash inside recovery "
                                  f"cannot be replayed: {e}")
                self.recovery_cache[ck] = []
        for second in self.recovery_cache[ck]:
            found2 = judge_crashed(second.recovered, run, before, call)
            if not found2:
                out.count(model, second.digest, "recovery")
                continue
            c2 = replace(self.base, kind="recovery", model=model, index=index, when=when,
                         state_key=st.key, recovery_index=second.index,
                         recovery_key=second.key)
            out.record(model, CaseOutcome(
                c2, str(c2.scenario), as_recovery_violations(found2, second.index),
                run.trace_hash, second.digest, second.description), kind="recovery")


def _sample(n: int, k: int) -> set[int]:
    """``k`` positions spread over ``range(n)``, the first and the last included (all if
    ``k`` is 0 or at least ``n``)."""
    if k <= 0 or k >= n:
        return set(range(n))
    if k == 1:
        return {0}
    return {round(i * (n - 1) / (k - 1)) for i in range(k)}


@dataclass(frozen=True)
class _Second:
    """A disk left by a crash inside recovery, and what the next recovery made of it."""

    index: int
    key: str
    digest: str
    description: str
    recovered: Recovered


def _recovery_states(backend: BackendSpec, image: DiskImage, model: str, limits: Limits
                     ) -> list[_Second]:
    out = []
    for r in range(recovery_crash_points(backend, image)):
        states, _ = recovery_crash_states(backend, image, r, model, limits)
        for st in states:
            out.append(_Second(r, st.key, image_digest(st.image), st.description,
                               recover_image(backend, st.image)))
    return out


def eio_run(backend: BackendSpec, workload: Workload, index: int
            ) -> tuple[Run, int, Violations, str]:
    """Fail mutating call ``index`` (a sync) with EIO.  Returns the run, the call that
    contained it, the violations its answer shows by itself (another exception than
    StorageIOError, an answer the model does not give), and, when the call returned
    success anyway, what failed (then every power cut after it must keep its effect:
    ``eio_judge``; "" when the call raised)."""
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
    if run.divergence is not None and run.stopped_in == call:
        return run, call, (("C9", f"{run.divergence} after its {injected.short()} failed "
                                  "with EIO"),), ""
    return run, call, (), f"{injected.short()} at {injected.site}"


def eio_judge(rec: Recovered, run: Run, call: int, succeeded: str) -> Violations:
    """A power cut after call ``call`` met an EIO: if it raised, the state before or after
    it; if it returned success although ``succeeded`` failed, exactly the state after it
    (an acknowledged effect must be durable), else C9."""
    if not succeeded:
        return judge_recovered(rec, run, run.models[call], run.workload[call])
    found = judge_recovered(rec, run, run.models[call + 1], None)
    return tuple(("C9", f"call {call} {run.workload[call].describe()} returned success "
                        f"although {succeeded} failed with EIO, and a power cut right after "
                        f"it shows {c} ({CLAUSES.get(c, '?')}): {d}") for c, d in found)


def _explore_eio(backend: BackendSpec, task: Task, base: CaseInput, m: int,
                 out: TaskResult) -> None:
    try:
        run, call, problems, succeeded = eio_run(backend, task.workload, m)
    except ValueError as e:
        out.errors.append(f"{task.workload_id} EIO at #{m}: {e}")
        if out.log:
            out.log[-1].counted = False
        return
    cut = events_through(run, call) if succeeded else len(run.events)
    out.eio_points += 1
    for model in task.models:
        try:
            states = crash_states(run.initial, run.events[:cut], model,
                                  exhaustive_limit=task.limits.exhaustive_limit,
                                  random_states=task.limits.random_states,
                                  seed=task.limits.seed)
        except ModelError as e:
            out.errors.append(f"{task.workload_id} EIO at #{m} under {model}: {e}")
            continue
        if out.log:  # not a crash point of the model's count: only whether it was sampled
            out.log[-1].model(model).exhaustive = is_exhaustive(
                run.initial, run.events[:cut], model,
                exhaustive_limit=task.limits.exhaustive_limit)
        for st in states:
            digest = image_digest(st.image)
            found = problems + eio_judge(recover_image(backend, st.image), run, call,
                                         succeeded)
            if not found:
                out.count(model, digest, "eio")
                continue
            case = replace(base, kind="eio", model=model, index=m, when="after",
                           state_key=st.key)
            out.record(model, CaseOutcome(case, str(case.scenario), found, run.trace_hash,
                                          digest, st.description), kind="eio")
