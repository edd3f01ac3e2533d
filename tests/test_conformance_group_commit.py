"""The group-commit check: commits of several threads share sync rounds, one sync fails;
the project's seam backends pass; a group commit that tells only its leader, or that
acknowledges a caller who arrived while its sync ran, fails C1."""

from __future__ import annotations

import pytest

from conformance.checks import group_commit_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK


@pytest.mark.parametrize("factory", ["fs", "fs_fsync", "kv_log"])
def test_the_projects_seam_backends_pass(factory: str) -> None:
    res = group_commit_check.run(Backend.from_factory(f"conformance.examples.backends:{factory}"),
                                 QUICK, 1)
    assert res.status is Status.PASS, [f.detail for f in res.findings]


def test_rounds_are_shared_and_faults_land_in_them() -> None:
    """The check tests what it claims: commits do share rounds under its load, and the
    failing sync makes some commits fail and others (before it) succeed."""
    backend = Backend.from_factory("conformance.examples.backends:fs")
    seen_failed = seen_acked = False
    for fail_sync in (3, 5, 7):
        commits = [group_commit_check._Commit(t, k) for t in range(group_commit_check.THREADS)
                   for k in range(group_commit_check.PER_THREAD)]
        import threading

        from conformance.crashexplore.traced_runs import scratch_dir
        with scratch_dir("queue-ref-group-test-") as root:
            io = group_commit_check._SyncFaultIO(root, fail_sync)
            store = backend.open(root, io)
            start = threading.Barrier(group_commit_check.THREADS)
            ts = [threading.Thread(target=group_commit_check._enqueuer,
                                   args=(store, io, [c for c in commits if c.t == t], start))
                  for t in range(group_commit_check.THREADS)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            sizes = store._group.round_sizes  # type: ignore[attr-defined]
            store.close()
        seen_failed |= any(c.outcome == "failed" for c in commits)
        seen_acked |= any(c.outcome == "acked" for c in commits)
        assert any(n >= 2 for n in sizes), f"no round served two callers: {sizes}"
    assert seen_failed and seen_acked


def test_a_round_that_tells_only_its_leader_is_c1() -> None:
    res = group_commit_check.run(
        Backend.from_factory("conformance.examples.broken_backends:fs_round_error_to_leader"),
        QUICK, 1)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C1"}
    # every finding is the lost message itself, or a commit acknowledged on a round whose
    # sync began before its change (that round's failure was hidden from it)
    assert any("was acknowledged but 0 of its" in f.detail for f in res.findings)
    assert all("was acknowledged but 0 of its" in f.detail or "though no sync covering"
               in f.detail for f in res.findings)


def test_a_round_that_tells_only_its_leader_passes_every_single_caller_check() -> None:
    """Only a check with several callers in one round can see the bug."""
    from conformance.checks import io_errors_check
    res = io_errors_check.run(
        Backend.from_factory("conformance.examples.broken_backends:fs_round_error_to_leader"),
        QUICK, 46)
    assert res.status is Status.PASS, [f.detail for f in res.findings]


def test_a_caller_acknowledged_by_a_round_that_began_before_it_is_c1() -> None:
    """The sync-cover rule names the sync it rode, whatever the power cuts saw."""
    res = group_commit_check.run(
        Backend.from_factory("conformance.examples.broken_backends:fs_late_joiner_acked"),
        QUICK, 1)
    assert res.status is Status.FAIL, "the late joiner was not caught"
    assert {f.clause for f in res.findings} == {"C1"}
    assert any("it rode" in f.detail for f in res.findings)


def test_a_late_joiner_passes_every_single_caller_check() -> None:
    from conformance.checks import io_errors_check
    res = io_errors_check.run(
        Backend.from_factory("conformance.examples.broken_backends:fs_late_joiner_acked"),
        QUICK, 46)
    assert res.status is Status.PASS, [f.detail for f in res.findings]
