"""Queues several processes share: the multi-process check (processes race for the
entries, one is killed holding claims, the entries adopted from it must carry their stored
schedules) and process-kill's trials that reopen beside a live owner."""

from __future__ import annotations

import pytest

from conformance.checks import multi_process_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK

VARIANT = "conformance.examples.broken_backends:fs_adopted_schedule_reset"


@pytest.mark.parametrize("factory", ["conformance.examples.backends:fs",
                                     "conformance.examples.backends:fs_fsync",
                                     "conformance.examples.sqlite_backend:factory"])
def test_the_projects_shared_backends_pass_and_the_killed_process_held_claims(factory):
    for seed in (1, 2):
        res = multi_process_check.run(Backend.from_factory(factory), QUICK, seed)
        assert res.status is Status.PASS, [f.detail for f in res.findings]
        # the killed process always dies holding claims (at least the two reserved
        # messages), and half of what is adopted is put back with send_cancel
        assert res.stats["claimed_by_killed"] >= 4
        assert res.stats["put_back"] >= 2


def test_an_adopted_handle_with_a_fresh_schedule_is_c11_on_every_seed():
    for seed in (1, 2, 3):
        res = multi_process_check.run(Backend.from_factory(VARIANT), QUICK, seed)
        assert res.status is Status.FAIL
        assert {f.clause for f in res.findings} == {"C11"}
        assert "carry a schedule other than the stored one" in res.findings[0].detail


KEEPS_REFS = "conformance.examples.broken_backends:fs_dead_commit_refs_kept"


def test_process_kill_reopens_beside_a_live_owner_in_odd_trials():
    """Every other process-kill trial keeps the queue open in another Storage and kills
    the child inside an enqueue of two recipients.  A recovery that leaves a dead owner's
    hard links to the orphan sweep (which only runs when no one else has the queue open)
    leaves a body behind after the drain: C8, on the trials whose kill landed after the
    hard links were made; the real queue leaves nothing on the same trials."""
    from conformance.checks import process_kill_check as pk

    trials = [pk.make_trial("process-kill", seed, 1, 40, shared=True) for seed in (3, 12, 17)]
    for t in trials:
        call = t.workload[t.kill_during]
        assert call.op.value == "enqueue" and len(call.rcpts) >= 2
        found = pk.run_trial(Backend.from_factory(KEEPS_REFS), t)
        assert [f.clause for f in found] == ["C8"], (t.scenario, found)
        assert "after draining everything" in found[0].detail
        assert pk.run_trial(Backend.from_factory("conformance.examples.backends:fs"), t) == []


def test_only_shared_backends_run_trials_beside_a_live_owner():
    """A backend one process at a time keeps every trial's kill where it was drawn, so its
    crash coverage of every operation is not traded for enqueues."""
    from conformance.checks import process_kill_check as pk

    for n in range(8):
        alone = pk.make_trial("process-kill", 5, n, 40, shared=False)
        shared = pk.make_trial("process-kill", 5, n, 40, shared=True)
        assert not alone.beside_live
        assert shared.beside_live == (n % 2 == 1)
        if n % 2 == 0:
            assert (alone.kill_during, alone.kill_event) == (shared.kill_during,
                                                             shared.kill_event)


def test_a_seam_backend_beside_a_live_owner_is_killed_at_a_disk_call():
    """With the I/O seam, a trial beside a live owner kills the child right after a
    mutating disk call of its wide enqueue, drawn uniformly over the first KILL_CALLS:
    the window between a commit's hard links and its rename (8 of a filesystem queue's 12
    to 14 calls) is met in about half of those trials, where a Python call count met it
    in few.  The kill is inside the call (the next call never starts), so the trial
    replays, and the real queues pass the same trials."""
    from conformance.checks import process_kill_check as pk

    trials = [pk.make_trial("process-kill", 7, n, 40, shared=True, seam=True)
              for n in range(1, 24, 2)]
    assert all(1 <= t.kill_call <= pk.KILL_CALLS and t.kill_event == 0 for t in trials)
    assert len({t.kill_call for t in trials}) > 4
    assert pk.make_trial("process-kill", 7, 2, 40, shared=True, seam=True).kill_call == 0
    broken, caught = Backend.from_factory(KEEPS_REFS), []
    for t in trials:
        found = pk.run_trial(broken, t)
        if found:
            assert [f.clause for f in found] == ["C8"]
            assert f"right after its mutating disk call #{t.kill_call}" in found[0].steps[0]
            assert pk.replay(broken, t.scenario) == found
            caught.append(t)
    assert len(caught) >= 2, [t.kill_call for t in trials]
    for t in caught:
        assert pk.run_trial(Backend.from_factory("conformance.examples.backends:fs"), t) == []
        assert pk.run_trial(Backend.from_factory(
            "conformance.examples.backends:fs_fsync"), t) == []
