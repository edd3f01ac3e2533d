"""Crash coverage: every operation crashed at every one of its mutating calls, per model."""

from __future__ import annotations

from dataclasses import replace

from conformance.certify.certificate_report import markdown
from conformance.certify.suite_runner import certify
from conformance.checks import crash_exploration_check
from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.exploration import ExploreConfig, explore
from conformance.crashexplore.workloads import hold_workloads, targeted_workloads
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK
from spec.states import HOLD_OPS, Op

FS = "conformance.examples.backends:fs"


def test_targeted_workloads_end_with_every_operation() -> None:
    ends = {(wl[-1].op, len(wl)) for wl in targeted_workloads()}
    assert {op for op, _ in ends} == set(Op) - HOLD_OPS
    assert {c.op for wl in hold_workloads() for c in wl} >= HOLD_OPS
    assert (Op.SEND_DONE, 3) in ends and (Op.CLEANUP, 3) in ends


def test_the_quick_bound_crashes_inside_every_operation_under_every_model() -> None:
    s = explore(ExploreConfig(backend="fs", models=("weak", "ext4-ordered"), bound=1,
                              recovery=False, eio=False, jobs=2))
    for m in ("weak", "ext4-ordered"):
        assert s.uncovered(m) == []
        done = s.coverage[m]["send_done"]
        assert done[0] > 0 and done[0] == done[1] and done[2] >= 1
    without = explore(ExploreConfig(backend="fs", models=("weak",), bound=1, targeted=False,
                                    recovery=False, eio=False))
    assert set(without.uncovered("weak")) == {op.value for op in Op} - {"enqueue"}


def test_incomplete_coverage_withholds_the_model() -> None:
    backend = Backend.from_factory(FS)
    narrow = replace(QUICK, crash_bound=1, crash_random=0, crash_targeted=False)
    (res,) = crash_exploration_check.run_all(backend, ["weak"], narrow, 0, 2)
    assert res.status is Status.ERROR and "incomplete coverage under weak" in res.note
    assert "send_done" in res.note
    cert = certify(backend, models=["weak"], profile=narrow, only=["crash-exploration"],
                   jobs=2)
    assert cert.certified_models() == []
    full = certify(backend, models=["weak"], profile=replace(narrow, crash_targeted=True),
                   only=["crash-exploration"], jobs=2)
    assert full.certified_models() == ["weak"]
    md = markdown(full)
    assert "## Crash coverage: operation x crash model" in md
    table = md.split("## Crash coverage")[1].split("## Checks")[0]
    assert "| send_done | " in table and " incomplete |" not in table


def test_a_missing_fsync_in_send_done_is_caught_at_the_quick_profile() -> None:
    # Before the targeted workloads, the quick bound (2 calls) never reached send_done.
    broken = Backend.from_factory(resolve("fs-broken-nosync-done").open, "nosync-done")
    cert = certify(broken, models=["weak"], profile="quick", only=["crash-exploration"],
                   jobs=2)
    assert "C3" in {f.clause for r in cert.results for f in r.findings}
