"""Power cuts inside sync-rounds' forced interleavings (the sync-rounds-crash check): each
caller judged by its status at the cut; the riding variants caught under the persistence
models, the project's seam backends passing; a scenario replays."""

from __future__ import annotations

import pytest

from conformance.checks import sync_rounds_crash_check as crash_check
from conformance.checks.sync_rounds_check import interleave
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK, THOROUGH

RIDING = "conformance.examples.broken_sync_rounds"
FS = "conformance.examples.backends:fs"
MODELS = ["process-kill", "weak", "ext4-ordered"]
R, F, N = crash_check.RETURNED, crash_check.IN_FLIGHT, crash_check.NOT_BEGUN


@pytest.mark.parametrize(("b", "clause"), [
    ("commit", "C1"), ("send_done", "C3"), ("drop", "C3"), ("send_cancel", "C5"),
    ("reschedule", "C5"), ("hold", "C14"), ("release", "C14"),
])
def test_a_returned_operation_undone_names_its_clause_one_in_flight_may_be(
        b: str, clause: str) -> None:
    """B's old state recovered (A's new): a finding when B had returned, none while it was
    in flight or had not begun; A undone while it returned is A's finding."""
    run = interleave(Backend.from_factory(FS), "commit", b, 0)
    assert run is not None
    exp = crash_check.expected(run)
    views = exp.with_applied({"a": True, "b": False}).restart().view()
    found = crash_check.judge_views(exp, {"a": R, "b": R}, views)
    assert [c for c, _ in found] == [clause], found
    assert found[0][1].startswith(f"{b} (B), returned at the cut")
    assert crash_check.judge_views(exp, {"a": R, "b": F}, views) == []
    assert crash_check.judge_views(exp, {"a": F, "b": N}, views) == []
    lost_a = crash_check.judge_views(exp, {"a": R, "b": N},
                                     exp.with_applied({"a": False, "b": False}).restart().view())
    assert [c for c, _ in lost_a] == ["C1"] and lost_a[0][1].startswith("commit (A)")


def test_cuts_fall_before_every_mutating_call_or_at_acknowledgements() -> None:
    run = interleave(Backend.from_factory(FS), "reschedule", "drop", 0)
    assert run is not None
    events = run.io.events[:run.at_rest]
    start = min(s.began for s in run.spans.values())
    every = crash_check.cuts(run)
    assert every == [i for i, e in enumerate(events) if e.mutating and e.began > start] + [
        len(events)]
    acks = crash_check.cuts(run, every_call=False)
    assert set(acks) <= set(every) and acks[-1] == len(events) and len(acks) < len(every)
    for cut in acks[:-1]:  # each the first mutating call after some caller returned
        seq = events[cut].began
        assert crash_check.RETURNED in {crash_check.status_at(run, t, seq) for t in "ab"}


@pytest.mark.parametrize("factory", ["fs", "fs_fsync", "kv_log"])
def test_the_projects_seam_backends_pass(factory: str) -> None:
    backend = Backend.from_factory(f"conformance.examples.backends:{factory}")
    for res in crash_check.run_all(backend, MODELS, QUICK, 1, backend.probe().capabilities):
        assert res.status is Status.PASS, [f.detail for f in res.findings]
        assert res.stats["cuts"] > res.stats["cases"] > 0 and res.stats["states"] > 0


def test_every_mutating_call_of_one_interleaving_passes_on_the_filesystem_queue() -> None:
    backend = Backend.from_factory(FS)
    for model in MODELS:
        got = crash_check.run_case(backend, "commit", "commit", 0, model,
                                   crash_check.limits_of(THOROUGH))
        assert got.reached and got.findings == [] and got.cuts > 10


@pytest.mark.parametrize(("variant", "clauses"), [
    ("fs_rides_running_sync", {"C3", "C14"}),
    ("fs_fsync_rides_running_sync", {"C1", "C3", "C5", "C14"}),
    ("kv_log_rides_running_sync", {"C1", "C3", "C5", "C14"}),
])
def test_a_caller_riding_a_running_sync_loses_a_returned_operation(
        variant: str, clauses: set[str]) -> None:
    backend = Backend.from_factory(f"{RIDING}:{variant}")
    (res,) = crash_check.run_all(backend, ["weak"], QUICK, 1, backend.probe().capabilities)
    assert res.status is Status.FAIL
    assert clauses <= {f.clause for f in res.findings}
    for f in res.findings:
        assert f.model == "weak" and f.scenario.startswith("sync-rounds-crash:")
        assert f.scenario.split(":")[3] == "weak" and "power cut" in f.detail
    assert any("returned at the cut" in f.detail for f in res.findings)


def test_a_scenario_replays_and_a_bad_one_is_refused() -> None:
    backend = Backend.from_factory(f"{RIDING}:kv_log_rides_running_sync")
    found = crash_check.replay(backend, "sync-rounds-crash:commit-vs-commit:1:weak:rest")
    assert [f.clause for f in found] == ["C1"] and "commit (B), returned" in found[0].detail
    assert crash_check.replay(backend, "sync-rounds-crash:commit-vs-commit:1:process-kill:rest"
                              ) == []
    for bad in ("sync-rounds-crash:commit-vs-flush:0:weak:rest",
                "sync-rounds-crash:commit-vs-commit:0:weak", "sync-rounds:commit-vs-commit:0",
                "sync-rounds-crash:commit-vs-commit:99:weak:rest",
                "sync-rounds-crash:commit-vs-commit:0:weak:x",
                "sync-rounds-crash:commit-vs-commit:0:weak:0"):
        with pytest.raises(ValueError, match="sync-rounds-crash"):
            crash_check.replay(backend, bad)
    with pytest.raises(ValueError, match="unknown crash model"):
        crash_check.replay(backend, "sync-rounds-crash:commit-vs-commit:0:tmpfs:rest")


def test_the_suite_runs_it_once_for_every_model_and_replays_its_scenario() -> None:
    from conformance.certify.scenario_replay import replay
    from conformance.certify.suite_runner import certify

    cert = certify(f"{RIDING}:kv_log_rides_running_sync", only=["sync-rounds-crash"], seed=1)
    by_model = {r.model: r for r in cert.results}
    assert set(by_model) == set(MODELS)
    assert by_model["process-kill"].status is Status.PASS
    assert cert.certified_models() == ["process-kill"]
    lost = by_model["weak"].findings[0]
    assert lost.model == "weak" and lost.scenario.startswith("sync-rounds-crash:")
    # this variant rides a sync that is already running: whether a replayed caller meets
    # the other's sync still running depends on thread timing (about one replay in three
    # missed it, on the code before send_finish too), so the scenario is replayed five
    # times: it must show the clause at least once and nothing else ever
    broken = Backend.from_factory(f"{RIDING}:kv_log_rides_running_sync")
    replays = [[f.clause for f in replay(broken, lost.scenario)] for _ in range(5)]
    assert [lost.clause] in replays, replays
    assert all(r in ([], [lost.clause]) for r in replays), replays
