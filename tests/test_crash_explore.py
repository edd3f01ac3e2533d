"""Crash exploration of the filesystem queue: no violations, determinism, reproduction.

The exhaustive pass runs at bound 2 here (bound 3 under QUEUE_REF_PROFILE=thorough);
``queue-ref crash explore --backend fs --model all --bound 3`` is the full run.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

import pytest

from conformance.cli import main
from conformance.crashexplore.crash_scenario import (
    CaseInput,
    CaseOutcome,
    ScenarioError,
    ScenarioId,
    decode_workload,
    encode_workload,
    parse,
    workload_id,
)
from conformance.crashexplore.crash_task import explore_task, task_for
from conformance.crashexplore.disk_recovery import recover_image, recovery_crash_points
from conformance.crashexplore.exploration import ExploreConfig, explore, plan
from conformance.crashexplore.reproduction import reproduce
from conformance.crashexplore.scenario_rebuild import build_case, run_case
from conformance.crashexplore.traced_runs import Run, run_workload
from conformance.crashexplore.workloads import (
    LIFE,
    enqueue_call,
    enumerate_steps,
    outcomes,
    random_workload,
    workload_at,
)
from faultinject.models import MODELS, crash_states
from faultinject.seam import FaultPlan
from spec.model import Call, Schedule
from spec.states import HOLD_OPS, Op, Outcome
from tests.conftest import thorough

ALL_MODELS = tuple(MODELS)
BOUND = 3 if thorough() else 2
E1 = enqueue_call(0, 1)
START = Call(Op.SEND_START, (0, 0))


# ---- workloads -----------------------------------------------------------------------

def test_enumeration_is_exhaustive_and_deterministic() -> None:
    steps = list(enumerate_steps(3))
    assert [len(list(enumerate_steps(b))) for b in range(4)] == [1, 3, 16, len(steps)]
    assert [s.workload for s in steps] == [s.workload for s in enumerate_steps(3)]
    assert len({s.workload for s in steps}) == len(steps)
    # every prefix of a workload is itself enumerated (crashes inside earlier calls)
    seen = {s.workload for s in steps}
    assert all(s.workload[:-1] in seen for s in steps if s.workload)
    for s in steps:
        for (before, result), call in zip(outcomes(s.workload), s.workload, strict=True):
            if result is Outcome.VANISHED:  # only stale send_start / reschedule
                assert call.op in (Op.SEND_START, Op.RESCHEDULE)
            assert before.next_id <= 2
    ops = {c.op for s in steps for c in s.workload}
    # the hold operations: workloads.hold_workloads; send_finish needs two INFLIGHT
    # entries first and cleanup_all two PENDING_CLEANUP ones, so they appear at bound 4
    assert ops == set(Op) - HOLD_OPS - {Op.SEND_FINISH, Op.CLEANUP_ALL}
    for batch in (Op.SEND_FINISH, Op.CLEANUP_ALL):
        four = [s.workload for s in enumerate_steps(4) if s.workload
                and s.workload[-1].op is batch]
        assert four and all(len(w) == 4 for w in four), batch
    # two recipients at most, bodies distinct per message
    enq = [c for s in steps for c in s.workload if c.op is Op.ENQUEUE]
    assert {len(c.rcpts) for c in enq} == {1, 2}
    assert len({c.body for c in enq}) == 2


def test_the_enumeration_after_a_whole_life_starts_with_it() -> None:
    steps = list(enumerate_steps(2, after=LIFE))
    assert steps[0].workload == LIFE and not steps[0].after.messages
    assert all(s.workload[:len(LIFE)] == LIFE for s in steps)
    assert {len(s.workload) - len(LIFE) for s in steps} == {0, 1, 2}
    # two more messages, each shorter than the first: a reused file always shrinks
    enq = [c for s in steps for c in s.workload[len(LIFE):] if c.op is Op.ENQUEUE]
    assert {c.body for c in enq} == {enqueue_call(1, 1).body, enqueue_call(2, 1).body}
    assert all(len(c.body) < len(LIFE[0].body) for c in enq)
    assert workload_at(2, 9, after=LIFE) == steps[9].workload
    assert decode_workload("a2w9") == steps[9].workload


def test_random_workloads_are_seeded() -> None:
    a, b = random_workload(7, 30), random_workload(7, 30)
    assert a == b and len(a) == 30
    assert random_workload(8, 30) != a
    outcomes(a)  # every call is one the model accepts


@pytest.mark.parametrize("workload", [
    (), (E1,), random_workload(3, 9),
    (E1, Call(Op.RESCHEDULE, (0, 0), Schedule(5, 1)), Call(Op.DROP, (0, 0))),
])
def test_workload_ids_round_trip(workload: tuple[Call, ...]) -> None:
    wid = workload_id(workload)
    assert decode_workload(wid) == workload
    assert decode_workload(encode_workload(workload)) == workload


def test_scenario_ids_round_trip() -> None:
    for sid in (
        ScenarioId("fs", "weak", "b3w17", "crash", 9, "before", "d12.14~16-t3:512"),
        ScenarioId("fs-broken-nosync-drop", "ext4-ordered", "r5n20", "recovery", 3, "after",
                   "all", 4, "g7"),
        ScenarioId("pkg.mod:make", "process-kill", "b1w1", "eio", 16, "after", "all"),
        ScenarioId("fs", "none", "b2w3", "rest"),
        ScenarioId("fs", "weak", "b3w17", "crash", 3, "rest", "d12.14~16"),
        ScenarioId("fs", "weak", "r5n20", "recovery", 0, "rest", "all", 4, "g7"),
        ScenarioId("fs", "weak", "a2w9", "crash", 30, "after", "all"),
    ):
        text = str(sid)
        assert " " not in text
        assert parse(text, ALL_MODELS) == sid
    assert str(ScenarioId("fs", "weak", "b3w17", "crash", 9, "before", "d12")) == \
        "fs-weak-b3w17-c9b-sd12"
    assert str(ScenarioId("fs", "weak", "b3w17", "crash", 3, "rest", "all")) == \
        "fs-weak-b3w17-rest3-sall"
    for bad in ("", "fs-weak", "fs-nomodel-b3w1-c1b-sall", "fs-weak-b3w1-c1x-sall"):
        with pytest.raises(ScenarioError):
            parse(bad, ALL_MODELS)


# ---- the filesystem queue has no violations ------------------------------------------

@pytest.mark.parametrize("model", ALL_MODELS)
def test_fs_exhaustive_has_no_violations(model: str) -> None:
    cfg = ExploreConfig(backend="fs", models=(model,), bound=BOUND,
                        recovery_sample=3 if thorough() else 1)
    s = explore(cfg)
    exhaustive = len(list(enumerate_steps(BOUND)))
    assert len(plan(replace(cfg, targeted=False))) == exhaustive
    # the targeted workloads add the operations the bound does not reach
    assert s.workloads == len(plan(cfg)) > exhaustive
    st = s.per_model[model]
    assert st.points > 100 and st.states >= st.points and st.recovery_states > 0
    assert st.eio_states > 0
    assert not s.errors
    assert not s.failures, [f"{f.scenario}: {f.violations}" for f in s.failures[:5]]


@pytest.mark.parametrize("backend", ["fs-syncfs", "fs-fsync"])
def test_fs_after_a_whole_life_has_no_violations(backend: str) -> None:
    """Every workload that writes into a spare file, crashed inside its last call, at rest
    after it, and in its recovery, under every model (the queue holds one spare)."""
    cfg = ExploreConfig(backend=backend, models=ALL_MODELS, bound=0,
                        after_life=BOUND, recovery_sample=1, targeted=False)
    s = explore(cfg)
    assert s.workloads == 1 + len(list(enumerate_steps(BOUND, after=LIFE)))
    reused = [t for t in plan(cfg) if t.workload_id.startswith("a")
              and any(c.op is Op.ENQUEUE for c in t.workload[len(LIFE):])]
    assert len(reused) >= 10
    assert all(s.per_model[m].points > 100 for m in ALL_MODELS)
    assert not s.errors
    assert not s.failures, [f"{f.scenario}: {f.violations}" for f in s.failures[:5]]


def test_fs_random_workload_has_no_violations() -> None:
    s = explore(ExploreConfig(backend="fs", models=("weak",), bound=0, random=1,
                              random_length=8 if not thorough() else 25, seed=11,
                              recovery_sample=1, targeted=False))
    assert s.workloads == 2 and s.crash_points > 50
    # at rest: after opening (the empty workload), and after every call of the random one
    assert s.rest_points == 1 + (8 if not thorough() else 25)
    assert not s.failures and not s.errors


# ---- determinism, reproduction, distribution -----------------------------------------

def test_same_seed_same_trace_hash() -> None:
    wl = random_workload(5, 12)
    first = run_workload_hash(wl)
    assert first == run_workload_hash(wl)
    assert first != run_workload_hash(random_workload(6, 12))
    case = CaseInput("fs", "r5n12", wl, "crash", "weak", 30, "before", "all")
    a, b = run_case(case), run_case(case)
    assert a.trace_hash == b.trace_hash and a.image == b.image and a.ok and b.ok


def run_workload_hash(wl: tuple[Call, ...]) -> str:
    from conformance.crashexplore.backend_registry import resolve

    run = run_workload(resolve("fs"), wl)
    assert not run.crashed and run.error is None
    return run.trace_hash


def test_reproduce_round_trip() -> None:
    """Every state a task judged can be rebuilt from its id alone, with the same result."""
    r = explore_task(task_for("fs-broken-nosync-commit", (E1, START), ("weak",),
                              recovery=False, eio=False))
    assert r.failures
    for f in r.failures[:3]:
        case = CaseInput.from_scenario(parse(f.scenario, ALL_MODELS))
        assert case == f.case
        again = run_case(case)
        assert again.violations == f.violations
        assert (again.trace_hash, again.image) == (f.trace_hash, f.image)
    rep = reproduce(r.failures[0].scenario)
    assert rep.outcome.clauses == ("C1",)
    assert re.search(r" at queue_ref/fsqueue/\w+\.py:\d+ in \w+$", rep.crash), rep.crash
    assert rep.dropped and any("[call 0]" in d for d in rep.dropped)
    assert rep.operations[1].endswith("<-- crashed inside")


def test_cases_pickle_and_run_in_other_processes() -> None:
    wl = (E1, START)
    cases = [CaseInput("fs", workload_id(wl), wl, "crash", m, i, w, "all")
             for m in ALL_MODELS for i in (10, 15) for w in ("before", "after")]
    for c in cases:
        assert pickle.loads(pickle.dumps(c)) == c
    here = [run_case(c) for c in cases]
    for o in here:
        assert pickle.loads(pickle.dumps(o)) == o
        assert o.ok, o
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        there = list(pool.map(run_case, cases))
    assert [(o.violations, o.trace_hash, o.image) for o in there] == \
        [(o.violations, o.trace_hash, o.image) for o in here]


def test_parallel_exploration_agrees() -> None:
    cfg = ExploreConfig(backend="fs-broken-nosync-commit", models=("ext4-ordered",),
                        bound=2, recovery=False, eio=False)
    one = explore(cfg)
    two = explore(ExploreConfig(**{**cfg.__dict__, "jobs": 2}))
    assert one.to_json() | {"seconds": 0} == two.to_json() | {"seconds": 0}
    assert one.violations.get("C1")


# ---- crashes inside recovery, and EIO ---------------------------------------------------

def test_recovery_crash_path() -> None:
    from conformance.crashexplore.backend_registry import resolve

    backend = resolve("fs")
    claim = run_workload(backend, (E1, START)).op_starts[1]  # the rename of send_start
    run = run_workload(backend, (E1, START), FaultPlan(crash_at=claim, crash_when="after"))
    assert run.crashed and run.stopped_in == 1
    state = crash_states(run.initial, run.events, "weak")[0]
    assert recovery_crash_points(backend, state.image) > 3  # requeue, lock cleanup...
    r = explore_task(task_for("fs", (E1, START), ("weak",), recovery_sample=0, eio=False))
    assert r.per_model["weak"].recovery_states > 20 and not r.failures
    case = CaseInput("fs", "b2w5", (E1, START), "recovery", "weak", claim, "after", "all",
                     2, "all")
    built = build_case(case)
    assert built.outcome.ok and built.second is not None, built.outcome
    assert recover_image(backend, built.second.image).entries


@pytest.mark.parametrize(("backend", "syncs"), [("fs-syncfs", 2), ("fs-fsync", 4)])
def test_eio_path(backend: str, syncs: int) -> None:
    r = explore_task(task_for(backend, (E1,), ALL_MODELS, recovery=False))
    assert r.eio_points == syncs and not r.failures  # the enqueue raised each time
    assert all(r.per_model[m].eio_states > 0 for m in ALL_MODELS)
    # Judged by outcome: a success whose fsync failed must survive a power cut; under
    # process-kill the page cache keeps the data, so only a power-loss model shows it.
    bad = explore_task(task_for("fs-broken-swallow-eio", (E1,), ("process-kill", "weak"),
                                recovery=False))
    assert {(f.case.model, c) for f in bad.failures for c in f.clauses} == {("weak", "C9")}
    assert all("returned success although" in d for f in bad.failures for _, d in f.violations)


# ---- the command ----------------------------------------------------------------------

def test_cli_explore_and_reproduce(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["crash", "explore", "--backend", "fs-broken-nosync-commit", "--model",
                 "process-kill,ext4-ordered", "--bound", "2", "--no-recovery", "--json"])
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 1
    cfg = ExploreConfig(backend="fs-broken-nosync-commit", models=("process-kill",), bound=2)
    assert summary["violations"]["C1"] > 0 and summary["workloads"] == len(plan(cfg))
    assert set(summary["by_model"]) == {"process-kill", "ext4-ordered"}
    assert summary["by_model"]["process-kill"]["violations"] == {}
    sid = summary["minimal"]["C1"]
    code = main(["crash", "reproduce", sid, "--json"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and rep["scenario"] == sid and rep["clauses"] == ["C1"]
    assert main(["crash", "reproduce", "nonsense"]) == 2
    assert main(["crash", "explore", "--backend", "nope", "--bound", "0"]) == 2


def test_cli_clean_run_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crash", "explore", "--backend", "fs", "--model", "all", "--bound", "1",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["violations"] == {} and summary["states"] > summary["crash_points"]
    assert summary["rest_points"] == summary["workloads"]  # one per workload at bound 1
    assert isinstance(CaseOutcome, type)


# ---- crashes at rest ----------------------------------------------------------------------

ZONEMTA = "conformance.examples.peers.zonemta:factory"


def test_at_rest_point_catches_what_in_call_points_cannot() -> None:
    """A commit that returns before its names are durable: every crash inside the enqueue
    may lose the message (the enqueue did not happen), but once commit returned, a power
    cut must not.  Only the crash at rest after the call shows it."""
    name = "fs-broken-nosync-after-body"
    blind = explore_task(task_for(name, (E1,), ALL_MODELS, at_rest=False))
    assert blind.points >= 10 and blind.rest_points == 0
    assert not blind.failures and not blind.errors  # vacuously certified
    r = explore_task(task_for(name, (E1,), ALL_MODELS))
    assert r.points == blind.points + 1 and r.rest_points == 1
    assert r.failures and not r.errors
    assert {f.case.when for f in r.failures} == {"rest"}
    assert {c for f in r.failures for c in f.clauses} == {"C1"}
    assert not r.per_model["process-kill"].violations  # the kernel had every name
    first = r.failures[0]
    assert re.fullmatch(rf"{name}-(weak|ext4-ordered)-b1w1-rest1-s\S+", first.scenario)
    case = CaseInput.from_scenario(parse(first.scenario, ALL_MODELS))
    assert case == first.case
    again = run_case(case)
    assert (again.violations, again.trace_hash, again.image) == \
        (first.violations, first.trace_hash, first.image)
    rep = reproduce(first.scenario)
    assert rep.outcome.clauses == ("C1",)
    assert rep.crash.startswith("at rest: the process died after 1 call(s) returned")
    assert rep.operations[0].endswith("<-- returned; then the process died (at rest)")
    assert len(rep.allowed) == 1 and rep.allowed[0] and not rep.recovered
    assert any(line.startswith("  at rest: m0[0] ") for line in rep.lines())


def test_buffered_backend_loses_acknowledged_data_even_on_process_kill() -> None:
    """The ZoneMTA re-creation keeps unsynced log records in its memory: its enqueue makes
    no mutating call at all, so only the point at rest exists, and there even a process
    kill (the kernel keeps what reached it; the process's buffers die) loses the message."""
    r = explore_task(task_for(ZONEMTA, (E1,), ("process-kill",), recovery=False, eio=False))
    assert (r.points, r.rest_points) == (1, 1) and not r.errors
    assert [(f.case.when, f.clauses) for f in r.failures] == [("rest", ("C1",))]
    assert r.failures[0].scenario == f"{ZONEMTA}-process-kill-b1w1-rest1-sall"
    assert reproduce(r.failures[0].scenario).outcome.violations == r.failures[0].violations


def test_at_rest_after_every_call_and_inside_recovery() -> None:
    """A task over every call crashes at rest after opening and after each call; a crash
    at rest followed by a crash inside recovery replays from its id too."""
    wl = (E1, START)
    r = explore_task(task_for("fs", wl, ("weak",), whole=True, recovery=False, eio=False))
    assert r.rest_points == 3 and not r.failures and not r.errors
    run = run_workload_for_rest(wl)
    assert [run.rest_cut(n) for n in range(3)] == [run.open_events, *run.event_ends]
    assert run.rest_cut(2) == run.workload_end
    with pytest.raises(ValueError):
        run.rest_cut(3)
    case = CaseInput("fs", workload_id(wl), wl, "recovery", "weak", 2, "rest", "all", 0,
                     "all")
    assert CaseInput.from_scenario(parse(str(case.scenario), ALL_MODELS)) == case
    built = build_case(case)
    assert built.outcome.ok and built.at_rest == 2 and built.second is not None, built.outcome
    assert built.recovered is not None and built.recovered.entries  # requeued, not lost
    bad = run_case(CaseInput("fs", workload_id(wl), wl, "crash", "weak", 3, "rest", "all"))
    assert bad.error and "no rest point after 3 calls" in bad.error


def run_workload_for_rest(wl: tuple[Call, ...]) -> Run:
    from conformance.crashexplore.backend_registry import resolve

    run = run_workload(resolve("fs"), wl)
    assert not run.crashed and run.returned() == len(wl)
    return run


@pytest.mark.parametrize("backend", ["fs-syncfs", "fs-fsync", "kv"])
def test_exploration_leaks_no_file_descriptors(backend: str) -> None:
    """Every simulated process death closes what that process held, directories pinned by
    the filesystem queue included: a long exploration must not run out of descriptors."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    explore(ExploreConfig(backend=backend, models=("process-kill",), bound=0, random=1,
                          seed=3))  # warm: imports, caches
    before = open_fds()
    s = explore(ExploreConfig(backend=backend, models=("process-kill",), bound=0, random=2,
                              seed=59))
    assert s.states > 100 and not s.violations
    assert open_fds() == before
