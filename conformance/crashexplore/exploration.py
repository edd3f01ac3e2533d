"""The exploration: every workload's task, run here or in worker processes, summed up.

``plan(config)`` lists the tasks: one per workload of the exhaustive enumeration (crash
points inside its last call and at rest after it; the empty workload covers opening a new
queue); the targeted workloads (``workloads.targeted_workloads``: every operation after a
prefix that reaches its source state, so every operation is crashed at every one of its
mutating calls whatever the bound); one per workload of the enumeration after one
message's whole life when ``after_life`` is set (``workloads.LIFE``: the queue then holds
what a backend keeps of a finished message); and one per random workload (crash points
inside every call and at rest after each).  ``explore(config)`` runs them, with ``jobs``
worker processes when asked, and returns a ``Summary`` with the coverage: operation x
crash points x model.
"""

from __future__ import annotations

import functools
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.crash_scenario import AT_REST, NO_CRASH, CaseOutcome, workload_id
from conformance.crashexplore.crash_task import (
    DEFAULT_LIMITS,
    RECOVERY_LIMITS,
    ModelStats,
    Task,
    TaskResult,
    explore_task,
)
from conformance.crashexplore.traced_runs import OPEN, Limits
from conformance.crashexplore.workloads import (
    LIFE,
    enumerate_steps,
    hold_workloads,
    random_workload,
    targeted_workloads,
)
from faultinject.models import MODELS
from queue_ref.io import OsIO
from queue_ref.storage import Capability
from spec.states import HOLD_OPS, Op

KIND_ORDER = {"rest": 0, "crash": 1, "eio": 2, "recovery": 3}


@dataclass(frozen=True)
class ExploreConfig:
    backend: str = "fs"
    models: tuple[str, ...] = ("weak",)
    bound: int = 3
    after_life: int = -1  # bound of the enumeration after LIFE (-1: none)
    random: int = 0  # how many random workloads
    random_length: int = 12
    seed: int = 0  # first random workload's seed (then seed+1, ...)
    jobs: int = 1
    limits: Limits = DEFAULT_LIMITS
    recovery: bool = True
    recovery_sample: int = 3
    recovery_limits: Limits = RECOVERY_LIMITS
    eio: bool = True
    at_rest: bool = True  # also crash at rest, after the calls (see ``crash_task``)
    targeted: bool = True  # also every operation after a prefix that reaches its state
    #: the hold workloads (``workloads.hold_workloads``); None: when the backend declares
    #: Capability.HOLD
    hold: bool | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown or not self.models:
            raise ValueError(f"unknown persistence model(s) {unknown}; known: "
                             f"{', '.join(MODELS)}")
        if self.bound < 0 or self.random < 0 or self.random_length < 1 or self.jobs < 1:
            raise ValueError("bound and random must be >= 0; random_length and jobs >= 1")
        if self.after_life < -1:
            raise ValueError("after_life must be >= 0 (or -1: none)")
        resolve(self.backend)  # fails early with the known names


@functools.cache
def _declares_hold(backend: str) -> bool:
    """Whether the backend named ``backend`` declares Capability.HOLD (opened once, in a
    scratch directory, to read its capabilities)."""
    spec = resolve(backend)
    with tempfile.TemporaryDirectory(prefix="queue-ref-probe-") as d:
        store = spec.open(d, OsIO())  # an empty directory, as every factory is given
        try:
            return Capability.HOLD in store.capabilities
        finally:
            store.close()


def explores_hold(cfg: ExploreConfig) -> bool:
    return cfg.hold if cfg.hold is not None else _declares_hold(cfg.backend)


def plan(cfg: ExploreConfig) -> list[Task]:
    def task(wid: str, workload: tuple[Any, ...], first: int) -> Task:
        return Task(cfg.backend, wid, workload, first, cfg.models, cfg.limits, cfg.recovery,
                    cfg.recovery_limits, cfg.recovery_sample, cfg.eio, cfg.at_rest)

    out = [task(f"b{cfg.bound}w{s.index}", s.workload, len(s.workload) - 1 if s.workload
                else OPEN) for s in enumerate_steps(cfg.bound)]
    if cfg.targeted:
        planned = {(t.workload, t.first_call) for t in out}
        for wl in targeted_workloads():
            if (wl, len(wl) - 1) not in planned:
                planned.add((wl, len(wl) - 1))
                out.append(task(workload_id(wl), wl, len(wl) - 1))
    if cfg.targeted and explores_hold(cfg):
        # each prefix crashed inside its last call: every call of every hold workload
        planned = {(t.workload, t.first_call) for t in out}
        for whole in hold_workloads():
            for n in range(2, len(whole) + 1):
                wl = whole[:n]
                if (wl, n - 1) not in planned:
                    planned.add((wl, n - 1))
                    out.append(task(workload_id(wl), wl, n - 1))
    if cfg.after_life >= 0:
        out += [task(f"a{cfg.after_life}w{s.index}", s.workload, len(s.workload) - 1)
                for s in enumerate_steps(cfg.after_life, after=LIFE)]
    for seed in range(cfg.seed, cfg.seed + cfg.random):
        out.append(task(f"r{seed}n{cfg.random_length}",
                        random_workload(seed, cfg.random_length), 0))
    return out


@dataclass
class Summary:
    config: ExploreConfig
    workloads: int = 0
    crash_points: int = 0  # at rest included
    rest_points: int = 0
    eio_points: int = 0
    per_model: dict[str, ModelStats] = field(default_factory=dict)
    failures: list[CaseOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: model -> operation -> [crash points inside it, crashed and judged, instances crashed
    #: at every one of their points] (see ``crash_task.TaskResult.coverage``)
    coverage: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def add(self, r: TaskResult) -> None:
        for m, ops in r.coverage.items():
            for op, row in ops.items():
                mine = self.coverage.setdefault(m, {}).setdefault(op, [0, 0, 0])
                for i, v in enumerate(row):
                    mine[i] += v
        self.workloads += 1
        self.crash_points += r.points
        self.rest_points += r.rest_points
        self.eio_points += r.eio_points
        for m, st in r.per_model.items():
            self.per_model.setdefault(m, ModelStats()).merge(st)
        self.failures.extend(r.failures)
        self.errors.extend(r.errors)

    @property
    def states(self) -> int:
        return sum(s.states + s.recovery_states + s.eio_states for m, s in
                   self.per_model.items() if m != NO_CRASH) + sum(
                       1 for f in self.failures if f.case.model != NO_CRASH)

    @property
    def violating(self) -> int:
        return len(self.failures)

    @property
    def distinct_states(self) -> int:
        images: set[str] = set()
        for m, s in self.per_model.items():
            images |= {f"{m}:{i}" for i in s.images}
        images |= {f"{f.case.model}:{f.image}" for f in self.failures if f.image}
        return len(images)

    @property
    def violations(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.failures:
            for c in f.clauses:
                out[c] = out.get(c, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: int(kv[0][1:]) if kv[0][1:].isdigit()
                           else 99))

    def uncovered(self, model: str) -> list[str]:
        """Operations of the transition table (and enqueue) that no task ran and crashed at
        every one of its mutating calls under ``model`` (an operation that makes no
        mutating call through the seam is covered by running it: the crashes at rest
        around it see the whole of what it did)."""
        ops = self.coverage.get(model, {})
        skip = () if explores_hold(self.config) else HOLD_OPS
        return [op.value for op in Op
                if op not in skip and ops.get(op.value, [0, 0, 0])[2] == 0]

    def minimal(self) -> dict[str, CaseOutcome]:
        """The shortest failing scenario of each clause."""
        out: dict[str, CaseOutcome] = {}
        for f in sorted(self.failures, key=minimal_key):
            for c in f.clauses:
                out.setdefault(c, f)
        return out

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "backend": c.backend, "models": list(c.models), "bound": c.bound,
            "after_life": c.after_life,
            "random": c.random, "random_length": c.random_length, "seed": c.seed,
            "workloads": self.workloads, "crash_points": self.crash_points,
            "rest_points": self.rest_points, "eio_points": self.eio_points,
            "states": self.states, "distinct_states": self.distinct_states,
            "violations": self.violations, "violating_states": self.violating,
            "minimal": {k: v.scenario for k, v in self.minimal().items()},
            "by_model": {
                m: {"crash_points": s.points, "states": s.states,
                    "recovery_states": s.recovery_states, "eio_states": s.eio_states,
                    "distinct_states": len(s.images),
                    "violations": {f"{k}": n for k, n in sorted(s.violations.items())}}
                for m, s in self.per_model.items() if m != NO_CRASH},
            "coverage": {m: {op: {"points": row[0], "crashed": row[1], "complete": row[2]}
                             for op, row in sorted(ops.items())}
                         for m, ops in self.coverage.items()},
            "uncovered": {m: self.uncovered(m) for m in c.models},
            "errors": self.errors[:20], "error_count": len(self.errors),
            "seconds": round(self.seconds, 2),
        }


def minimal_key(f: CaseOutcome) -> tuple[int, int, int, int, int, str]:
    """Shortest workload first; then a crash inside a call before one at rest (it shows
    where the process died) of the same kind, then the fewest dropped or torn writes."""
    c = f.case
    return (len(c.workload), KIND_ORDER.get(c.kind, 9), int(c.when == AT_REST),
            len(c.state_key), c.index, f.scenario)


def _results(tasks: list[Task], jobs: int) -> Iterator[TaskResult]:
    if jobs <= 1 or len(tasks) <= 1:
        yield from map(explore_task, tasks)
        return
    # The longest workloads first, so that no worker is left with one big task at the end.
    order = sorted(tasks, key=lambda t: -len(t.workload))
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap_unordered(explore_task, order, chunksize=1)


def explore(cfg: ExploreConfig, *, progress: Callable[[TaskResult], None] | None = None,
            tasks: Iterable[Task] | None = None) -> Summary:
    """Run every task of ``cfg`` (or ``tasks``); ``progress`` is called after each."""
    todo = list(tasks) if tasks is not None else plan(cfg)
    t0 = time.perf_counter()
    summary = Summary(cfg)
    for r in _results(todo, cfg.jobs):
        summary.add(r)
        if progress is not None:
            progress(r)
    summary.failures.sort(key=minimal_key)
    summary.seconds = time.perf_counter() - t0
    return summary
