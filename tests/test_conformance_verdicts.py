"""No false verdicts: findings judged by outcome against the model, replayable by id."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace

import pytest

from conformance.certify.scenario_replay import replay
from conformance.checks import crash_exploration_check, io_errors_check, process_kill_check
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.recovered_queue import inspect, to_views
from conformance.crashexplore.traced_runs import run_workload
from conformance.crashexplore.workload_driver import model_before
from conformance.crashexplore.workloads import enqueue_call
from conformance.harness.backend_factory import Backend
from conformance.harness.suite_profiles import QUICK
from queue_ref.memory import MemoryStorage
from queue_ref.storage import QueuedMail
from spec.model import Call
from spec.states import Op

FS = "conformance.examples.backends:fs"
BROKEN = "conformance.examples.broken_backends"
FIRST = "0"  # MemoryStorage numbers messages from 0


@pytest.mark.parametrize("scenario", ["io-errors:46:8", "io-errors:106:0"])
def test_a_fault_the_queue_recovers_from_is_no_finding(scenario: str) -> None:
    # Each of these fails the creation of a spare file (an optional step): the enqueue
    # succeeds, and the queue, reopened and after a power cut, holds exactly the model's
    # state.  Demanding an exception here was a false verdict.
    assert replay(Backend.from_factory(FS), scenario) == []


def test_a_success_whose_fsync_failed_is_a_c9_finding_that_replays() -> None:
    backend = Backend.from_factory("conformance.examples.broken_backends:swallow_eio")
    res = io_errors_check.run(backend, QUICK, 0)
    assert res.findings and {f.clause for f in res.findings} == {"C9"}
    first = res.findings[0]
    assert "returned success although" in first.detail and "power cut" in first.detail
    again = replay(backend, first.scenario)
    assert [(f.clause, f.detail) for f in again] == [
        (f.clause, f.detail) for f in res.findings if f.scenario == first.scenario]


def test_the_real_queues_pass_io_errors() -> None:
    for name in ("fs", "fs_fsync", "kv_log"):
        res = io_errors_check.run(Backend.from_factory(f"conformance.examples.backends:{name}"),
                                  QUICK, 46)
        assert res.findings == [], (name, res.findings)


def copy_queue(src: str, dst: str) -> str:
    """Copy a queue's tree as it is: symlinks as symlinks, and the names of a file of
    several names (a message file and its entries' hard links) as names of one copy."""
    first: dict[tuple[int, int], str] = {}

    def copy(s: str, d: str) -> str:
        st = os.lstat(s)
        if (st.st_dev, st.st_ino) in first:
            os.link(first[(st.st_dev, st.st_ino)], d)
            return d
        shutil.copy2(s, d)
        first[(st.st_dev, st.st_ino)] = d
        return d

    return shutil.copytree(src, dst, symlinks=True, copy_function=copy)


def test_a_process_kill_trial_lands_on_the_same_call_every_time() -> None:
    backend = Backend.from_factory(FS)
    trial = next(t for n in range(40)
                 if (t := process_kill_check.make_trial("process-kill", 5, n, 40)).kill_event)
    seen = []
    for _ in range(2):
        root = tempfile.mkdtemp(prefix="queue-ref-test-kill-")
        state = process_kill_check._crash_child(backend, root, trial)
        before = model_before(trial.workload, state.acked)
        pending = trial.workload[state.acked] if state.begun >= state.acked else None
        copy = copy_queue(root, root + ".copy")
        assert process_kill_check.judge_trial(backend, root, trial, state) == []
        rec = inspect(lambda copy=copy: backend.open(copy))
        seen.append((state.acked, state.begun,
                     to_views(rec, state.message_ids, state.entry_keys, before, pending)))
        shutil.rmtree(root)
        shutil.rmtree(copy)
    assert seen[0] == seen[1]
    assert seen[0][1] == trial.kill_during  # killed inside the drawn call


class HidesFromListing(MemoryStorage):
    """list_queue misses every entry of the first message (a listing bug)."""

    def list_queue(self) -> Iterator[QueuedMail]:
        return iter([h for h in super().list_queue() if h.message_id != FIRST])


def test_a_listing_that_misses_an_entry_is_a_divergence_not_an_error() -> None:
    spec = BackendSpec("hides", lambda root, io: HidesFromListing())
    start = Call(Op.SEND_START, (0, 0))
    # the second send_start goes through a handle listed after the enqueue (stale)
    run = run_workload(spec, (enqueue_call(0, 1), start, start))
    assert run.error is None and run.divergence is not None
    assert run.divergence.clause == "API" and "does not list" in run.divergence.detail


def test_the_lockstep_listing_reads_every_listed_entry_back() -> None:
    # The entry is listed with its schedule, so only reading it back shows the loss;
    # the other no-crash checks pass this variant.
    from conformance.certify.suite_runner import certify
    from conformance.harness.check_catalog import NO_CRASH
    from tests.conformance_support import RescheduleLosesBody

    # the lockstep's random walk reaches a reschedule and a read-back within a few seeds
    # (which seed depends on the draws of the checks before it in the process)
    for seed in (3, 4, 5, 6):
        cert = certify(RescheduleLosesBody, models=["process-kill"], only=[
            "lockstep", "bad-input", "many-recipients", "limits", "threads"], seed=seed)
        failed = {(r.check, f.clause) for r in cert.results for f in r.findings}
        if failed:
            break
    assert failed == {("lockstep", "C6")}
    finding = next(f for r in cert.results for f in r.findings)
    assert finding.model == NO_CRASH and "reads back" in finding.detail
    assert replay(Backend.from_factory(RescheduleLosesBody), finding.scenario)


def test_recover_at_any_step_must_leave_a_live_queue_alone() -> None:
    from conformance.lockstep import run_lockstep
    from tests.conformance_support import RecoverRequeuesLive

    # A random walk finds it within a few seeds (the machine's rules, hold included,
    # change which steps a seed draws); every finding must be this bug.
    founds = [run_lockstep(Backend.from_factory(RecoverRequeuesLive), QUICK, seed)
              for seed in range(2, 8)]
    assert any(founds)
    for found in filter(None, founds):
        assert [f.clause for f in found] == ["C10"] and "recover()" in found[0].detail
    assert run_lockstep(Backend.from_factory("queue_ref.memory:MemoryStorage"), QUICK, 3) == []


def test_the_restart_check_restarts_with_an_enqueue_open() -> None:
    from conformance.lockstep import run_lockstep

    for name in ("fs", "kv_log"):
        backend = Backend.from_factory(f"conformance.examples.backends:{name}")
        assert run_lockstep(backend, QUICK, 11, check="restart", restarts=True) == []


def test_every_odd_io_error_trial_fails_a_sync() -> None:
    """Half the trials aim at the calls that make data durable, so a backend that swallows
    a failed sync is met on every seed, whatever else its operations do."""
    backend = Backend.from_factory(FS)
    for n in range(12):
        wseed = io_errors_check.make_trial(7, n, io_errors_check.CallCount(1)).workload_seed
        workload = io_errors_check.random_workload(wseed, io_errors_check.WORKLOAD_LENGTH)
        calls = io_errors_check._count_calls(backend, workload)
        trial = io_errors_check.make_trial(7, n, calls)
        assert calls.syncs and 0 <= trial.fail_at < calls.total
        assert (trial.fail_at in calls.syncs) if n % 2 else True
        inside = {m for _, ms in calls.transitions for m in ms}
        assert (trial.fail_at in inside) if n % 4 == 2 and inside else True


HIDES = f"{BROKEN}:fs_reschedule_hides_entry"


@pytest.mark.parametrize("seed", [0, 5])
def test_a_failed_reschedule_must_not_hide_its_entry_until_a_restart(seed: int) -> None:
    """A queue whose failed ``reschedule`` keeps the entry claimed (in inflight/, out of
    every listing) passes the restart and power-cut judges: recovery requeues it.  The
    open queue's listing right after the error shows neither the old state nor the new
    one, a C9 finding that replays; the real queues list the entry."""
    _live_finding_replays(HIDES, seed, "C9", "right after reschedule(", "its old state lists")


def _live_finding_replays(variant: str, seed: int, clause: str, start: str, text: str) -> None:
    """io-errors fails ``variant`` on ``clause`` only, with a finding judged in the open
    queue right after the error (``start``, ``text``) that replays to the same findings;
    the real queue passes the same seed."""
    res = io_errors_check.run(Backend.from_factory(variant), QUICK, seed)
    assert res.findings and {f.clause for f in res.findings} == {clause}
    first = res.findings[0]
    assert first.detail.startswith(start)
    assert text in first.detail
    again = replay(Backend.from_factory(variant), first.scenario)
    assert [(f.clause, f.detail) for f in again] == [
        (f.clause, f.detail) for f in res.findings if f.scenario == first.scenario]
    assert io_errors_check.run(Backend.from_factory(FS), QUICK, seed).findings == []


KEEPS_REFS = f"{BROKEN}:fs_failed_commit_keeps_refs"


@pytest.mark.parametrize("seed", [1, 2])
def test_a_failed_commit_must_leave_nothing_in_the_open_queue(seed: int) -> None:
    """A queue whose undo of a failed commit forgets the per-recipient hard links passes
    the restart and power-cut judges (recovery sweeps the orphans); the open queue's
    footprint right after the error is larger than before the enqueue: a C8 finding that
    replays.  One trial in eight fails a call of a two-recipient enqueue, so every seed
    meets it; the real queue leaves nothing."""
    _live_finding_replays(KEEPS_REFS, seed, "C8", "right after enqueue(",
                          "the failed enqueue left storage behind")


def test_one_trial_in_eight_fails_a_call_of_a_shared_enqueue() -> None:
    """Trials 0, 8, 16... fail a call (not a sync) of an enqueue of two or more
    recipients whenever the workload has one."""
    backend = Backend.from_factory(FS)
    met = 0
    for n in range(0, 64, 8):
        wseed = io_errors_check.make_trial(7, n, io_errors_check.CallCount(1)).workload_seed
        workload = io_errors_check.random_workload(wseed, io_errors_check.WORKLOAD_LENGTH)
        calls = io_errors_check._count_calls(backend, workload)
        trial = io_errors_check.make_trial(7, n, calls)
        if calls.shared_enqueues:
            met += 1
            assert trial.fail_at in calls.shared_enqueues
            assert trial.fail_at not in calls.syncs
    assert met >= 4


def test_the_sweep_fails_every_call_of_a_wide_enqueue_and_replays() -> None:
    """The sweep fails each mutating call of a three-recipient enqueue in turn, EIO and
    ENOSPC alternately, on every seed: the queue that undoes a failed commit's hard links
    only when all were made leaves one behind exactly when the fault lands between two of
    them, a C8 finding of the sweep alone whose id replays it; the real queue passes."""
    fs = Backend.from_factory(FS)
    trials = io_errors_check.sweep_trials(fs)
    for w, workload in enumerate(io_errors_check.SWEEPS):
        inside, unfaulted = io_errors_check._last_call_calls(fs, workload)
        assert unfaulted == ("", "") and len(inside) >= 10
        mine = [t for t, _ in trials if t.sweep is not None and t.sweep[0] == w]
        assert [t.fail_at for t in mine] == list(inside)
        assert {t.errno_ for t in mine} == {errno.EIO, errno.ENOSPC}
    assert all(io_errors_check.run_trial(fs, t, wl) == [] for t, wl in trials)
    broken = Backend.from_factory(f"{BROKEN}:fs_failed_commit_links_kept")
    found = [f for t, wl in io_errors_check.sweep_trials(broken)
             for f in io_errors_check.run_trial(broken, t, wl)]
    assert {f.clause for f in found} == {"C8"}
    assert {f.scenario.split(":")[2] for f in found} == {"0", "1"}, found
    res = io_errors_check.run(broken, QUICK, 1)  # seed 1 draws no trial that finds it
    assert {f.clause for f in res.findings} == {"C8"}
    assert all(f.scenario.startswith("io-errors:sweep:") for f in res.findings), res.findings
    first = found[0]
    assert "the failed enqueue left storage behind" in first.detail
    again = replay(broken, first.scenario)
    assert [(f.clause, f.detail) for f in again] == [(first.clause, first.detail)]
    with pytest.raises(ValueError, match="mutating calls on this backend"):
        replay(fs, "io-errors:sweep:0:999")


IDS_REPEAT = "conformance.examples.broken_backends:fs_ids_repeat_on_a_stalled_clock"


def test_a_call_that_fails_with_no_fault_injected_is_a_finding_not_a_note() -> None:
    """Message ids made of the clock alone repeat when the clock stalls or steps back: the
    seam opener's clock does both (``jumpy_clock``), the repeated id's commit fails with
    EEXIST although the disk is fine, and crash exploration reports it on C9 (it once
    filed such runs under "cases that could not be built" and certified the backend)."""
    from dataclasses import replace

    from conformance.checks import crash_exploration_check
    from conformance.crashexplore.explored_backends import jumpy_clock

    clock = jumpy_clock()
    readings = [clock() for _ in range(12)]
    assert any(b < a for a, b in itertools.pairwise(readings))  # it steps back
    assert len(set(readings)) < len(readings)  # and stalls
    narrow = replace(QUICK, crash_bound=2, crash_random=0)
    results = crash_exploration_check.run_all(Backend.from_factory(IDS_REPEAT),
                                              ["process-kill"], narrow, 3, 2)
    findings = [f for r in results for f in r.findings]
    assert findings and {f.clause for f in findings} == {"C9"}
    assert "no fault was injected" in findings[0].detail
    assert "File exists" in findings[0].detail
    real = crash_exploration_check.run_all(Backend.from_factory(FS), ["process-kill"],
                                           narrow, 3, 2)
    assert [f for r in real for f in r.findings] == []


def test_a_recovery_report_counts_no_more_than_the_crash_left() -> None:
    """After a crash with no failed call, at most the interrupted enqueue is removed
    uncommitted, and at most the model's INFLIGHT entries and the interrupted call's
    entry are requeued (C10); more is a report that sends an operator looking for mail
    that never was in progress."""
    from conformance.crashexplore.crash_judge import overstated_counts
    from conformance.crashexplore.recovered_queue import Recovered
    from queue_ref.storage import RecoveryReport
    from spec.model import Model, Schedule

    def counted(report: RecoveryReport, before: Model, call: Call | None) -> list[str]:
        return [d for _, d in overstated_counts(Recovered((), report=report), before, call)]

    empty = Model()
    one = enqueue_call(0, 2)
    queued, _ = empty.enqueue(one.mail_from, one.body, one.rcpts)
    claimed, _ = queued.apply(Op.SEND_START, (0, 0), None)
    assert counted(RecoveryReport(), empty, None) == []
    assert counted(RecoveryReport(), empty, one) == []  # a backend may keep no report
    assert counted(RecoveryReport(uncommitted_removed=1), empty, one) == []
    assert "at most 1 can have" in counted(RecoveryReport(uncommitted_removed=2), empty, one)[0]
    assert "at most 0 can have" in counted(RecoveryReport(uncommitted_removed=1), queued,
                                           None)[0]
    assert counted(RecoveryReport(requeued=1), claimed, None) == []
    assert "at most 1 claimed" in counted(RecoveryReport(requeued=2), claimed, None)[0]
    move = Call(Op.RESCHEDULE, (0, 1), schedule=Schedule(at=900))  # may claim its entry
    assert counted(RecoveryReport(requeued=2), claimed, move) == []
    assert counted(RecoveryReport(requeued=3), claimed, move)
    assert Recovered((), report=RecoveryReport(requeued=5)) == Recovered(())


def test_spares_counted_as_uncommitted_fail_crash_exploration_and_replay() -> None:
    """The queue whose recovery counts a dead owner's spare files as uncommitted
    enqueues fails crash exploration on C10 under every model and process-kill too; the
    real queue passes the same exploration."""
    narrow = replace(QUICK, crash_bound=2, crash_random=0)
    broken = Backend.from_factory(f"{BROKEN}:fs_spares_counted_uncommitted")
    results = crash_exploration_check.run_all(broken, ["process-kill", "weak"], narrow, 3, 2)
    assert [r.status.value for r in results] == ["fail", "fail"]
    findings = [f for r in results for f in r.findings]
    assert {f.clause for f in findings} == {"C10"}
    first = findings[0]
    assert "uncommitted enqueue(s) removed; at most" in first.detail
    again = crash_exploration_check.replay(broken, first.scenario)
    assert [(f.clause, f.detail) for f in again] == [(first.clause, first.detail)]
    killed = process_kill_check.run_check(broken, "process-kill", 26, 8, 40)
    assert {f.clause for f in killed.findings} == {"C10"}, killed.findings
    real = crash_exploration_check.run_all(Backend.from_factory(FS), ["process-kill", "weak"],
                                           narrow, 3, 2)
    assert [f for r in real for f in r.findings] == []


ORPHANS_LIVE = "conformance.examples.broken_backends:fs_orphans_live_claims"


@pytest.mark.parametrize("seed", [1, 25])
def test_a_live_recovery_under_held_claims_is_checked_on_every_seed(seed: int) -> None:
    """A recovery whose orphan scan forgets inflight/ quarantines, under the sender, the
    file of a message whose entries are all claimed.  The restart check starts about half
    its examples at that edge (claims held across a live ``recover()``), so it fails the
    variant on any seed; random rules alone met it on some seeds only.  The real queue
    passes the same seeds."""
    from conformance.lockstep import run_lockstep

    found = run_lockstep(Backend.from_factory(ORPHANS_LIVE), QUICK, seed, check="restart",
                         restarts=True)
    assert [f.clause for f in found] == ["C9"]
    assert "claimed across a live recover()" in found[0].detail
    assert "message file is missing" in found[0].detail
    assert any("edge: claims held across a live recover()" in line for line in found[0].steps)
    assert run_lockstep(Backend.from_factory(FS), QUICK, seed, check="restart",
                        restarts=True) == []


@pytest.mark.parametrize("seed", [1, 25])
def test_every_read_back_takes_the_next_piece_size(seed: int) -> None:
    """A reader answering ``read()`` with nothing: lockstep's read-back takes every piece
    size in turn (``read()`` first), so any seed finds it; the real queue passes."""
    from conformance.lockstep import run_lockstep

    found = run_lockstep(Backend.from_factory(f"{BROKEN}:fs_read_all_returns_nothing"),
                         QUICK, seed)
    assert [f.clause for f in found] == ["C6"]
    # found by the read-back of a listed entry, or first by the read_inflight rule
    # when it draws read() (which seed meets which depends on the rules' draws)
    assert ("read in pieces of -1" in found[0].detail
            or found[0].steps[-1].endswith("in reads of -1")), found[0]
    assert run_lockstep(Backend.from_factory(FS), QUICK, seed) == []


def test_a_declared_recipient_limit_is_committed_in_full() -> None:
    """A limit declared one above what a commit can take is found by committing exactly
    the declared number; the real queue commits its own limit."""
    from conformance.checks import limits_check

    res = limits_check.run(Backend.from_factory(f"{BROKEN}:fs_recipient_limit_off_by_one"))
    (f,) = res.findings
    assert f.clause == "C9" and "within the declared limit" in f.detail
    assert f.scenario == f"limits:recipients-{int(f.scenario.split('-')[1])}"
    real = limits_check.run(Backend.from_factory(FS))
    assert real.findings == []
    limit = real.stats["max_recipients"]
    assert f"recipients-{limit}_seconds" in real.stats  # committed in full, and listed


def test_damage_is_judged_per_entry_and_the_domain_index_after_it() -> None:
    """One recipient of a two-recipient message dropped without a word, and a domain
    index recovery does not mend: damage at rest sees both (C6 per entry, C13)."""
    from conformance.checks import damage_at_rest_check

    silent = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:fs_entry_lost_silently"),
                                      QUICK, 3)
    assert {f.clause for f in silent.findings} == {"C6"}
    assert all("acknowledged entries of messages delivered" in f.detail
               for f in silent.findings)
    index = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:fs_index_not_rebuilt"),
                                     QUICK, 3)
    assert {f.clause for f in index.findings} == {"C13"}


def test_the_listing_right_after_a_failed_call_is_judged_against_old_and_new() -> None:
    """The live judge alone, on a run made by hand: a failed enqueue of two recipients
    may show none or both of its entries (their ids were never returned, so they are
    counted), never one; a failed reschedule must show its entry at the old or the new
    schedule; a listing that raised something other than a QueueError is C9."""
    from conformance.crashexplore.traced_runs import Run
    from conformance.crashexplore.workloads import enqueue_call
    from spec.model import Model, run
    from spec.model import Schedule as ModelSchedule

    def judged(before: Model, call: Call, listed: dict[str, ModelSchedule] | None,
               keys: dict[str, tuple[int, int]], error: str | None = None) -> list[str]:
        r = Run((call,), {}, [], "", [before], [0], [0], entry_keys=keys,  # type: ignore[arg-type]
                live_queued=listed, live_listing_error=error)
        return [c for c, _ in io_errors_check._live_judge(r, before, call)]

    enq = enqueue_call(0, 2)
    empty = Model()
    assert judged(empty, enq, {}, {}) == []
    assert judged(empty, enq, {"a": ModelSchedule(100), "b": ModelSchedule(101)}, {}) == []
    assert judged(empty, enq, {"a": ModelSchedule(100)}, {}) == ["C9"]
    assert judged(empty, enq, None, {}) == []  # the queue refused to list: not judged
    assert judged(empty, enq, None, {}, "KeyError: 'x'") == ["C9"]

    one, _ = run(Model(), enqueue_call(0, 1))
    resched = Call(Op.RESCHEDULE, (0, 0), ModelSchedule(999))
    keys = {"e": (0, 0)}
    assert judged(one, resched, {"e": ModelSchedule(100)}, keys) == []  # old
    assert judged(one, resched, {"e": ModelSchedule(999)}, keys) == []  # new
    assert judged(one, resched, {}, keys) == ["C9"]  # hidden
    assert judged(one, resched, {"e": ModelSchedule(5)}, keys) == ["C9"]  # neither


FULL_AS_EIO = f"{BROKEN}:fs_full_disk_as_eio"
KV = "conformance.examples.backends:kv_log"


def _same_on_replay(variant: str, first_scenario: str, findings: list) -> None:  # type: ignore[type-arg]
    again = replay(Backend.from_factory(variant), first_scenario)
    assert [(f.clause, f.detail) for f in again] == [
        (f.clause, f.detail) for f in findings if f.scenario == first_scenario]


@pytest.mark.parametrize("seed", [1, 5])
def test_a_full_disk_must_say_no_space_error(seed: int) -> None:
    """A queue over a disk layer that reports ENOSPC as EIO keeps every state right, so
    only the error's class shows it: a full disk must raise NoSpaceError (a relay answers
    452, an operator frees space), and a failing disk must not.  The real queue, on the
    same seeds, raises NoSpaceError for every ENOSPC it meets outside a sync."""
    res = io_errors_check.run(Backend.from_factory(FULL_AS_EIO), QUICK, seed)
    assert res.findings and {f.clause for f in res.findings} == {"C9"}
    assert all("expected NoSpaceError: the disk is full" in f.detail for f in res.findings)
    _same_on_replay(FULL_AS_EIO, res.findings[0].scenario, res.findings)
    assert io_errors_check.run(Backend.from_factory(FS), QUICK, seed).findings == []


def test_one_trial_in_eight_streams_large_bodies_in_pieces() -> None:
    """Trials 4, 12, 20... give the first two enqueues 1.6 MB bodies, written in pieces
    of 100-300 KB, and fail a call of the last of them (trials 12, 28...: its last call,
    the commit); the other trials keep small bodies."""
    from conformance.crashexplore.workload_driver import PIECES, body_pieces

    backend = Backend.from_factory(KV)
    for n in (4, 12, 20, 28):
        workload = io_errors_check.workload_of(7, n)
        large = [c for c in workload if len(c.body) > io_errors_check.LARGE_BODY]
        enqueues = [c for c in workload if c.op.value == "enqueue"]
        assert large == enqueues[:io_errors_check.LARGE_ENQUEUES] and large
        pieces = body_pieces(large[0].body)
        assert b"".join(pieces) == large[0].body and len(pieces[0]) == PIECES[0]
        calls = io_errors_check._count_calls(backend, workload)
        trial = io_errors_check.make_trial(7, n, calls)
        assert calls.large_body and trial.fail_at in calls.large_body
        assert trial.fail_at not in calls.syncs
        if n % 16 == 12:
            assert trial.fail_at == calls.large_body[-1]
    for n in (0, 2, 3, 8):
        assert max(len(c.body) for c in io_errors_check.workload_of(7, n)) < 64 * 1024


KEEPS_CHUNKS = f"{BROKEN}:kv_failed_commit_keeps_chunks"


@pytest.mark.parametrize("seed", [2, pytest.param(4, marks=pytest.mark.thorough)])
def test_a_large_commit_refused_for_a_full_disk_must_leave_nothing(seed: int) -> None:
    """The KV queue once kept a large body's chunks after its commit failed for a full
    disk (the engine had cut the log back: nothing of the commit was written) until the
    next open.  The large-body trials find it on C8 and the finding replays; the real KV
    queue (it drops them at once now) passes the same seed."""
    res = io_errors_check.run(Backend.from_factory(KEEPS_CHUNKS), QUICK, seed)
    assert res.findings and {f.clause for f in res.findings} == {"C8"}
    first = res.findings[0]
    assert "the failed enqueue left storage behind" in first.detail
    assert "body=16" in first.detail  # a large body's enqueue
    _same_on_replay(KEEPS_CHUNKS, first.scenario, res.findings)
    assert io_errors_check.run(Backend.from_factory(KV), QUICK, seed).findings == []


DROPS_CARRY = f"{BROKEN}:kv_drops_rest_after_carry"


def test_a_body_that_loses_bytes_between_pieces_is_found_by_the_large_trials() -> None:
    """An enqueuer that drops the rest of a write once it completes the chunk the last
    write left stores a body written in one piece, or in whole chunks, as it is; a body
    in pieces of 100-300 KB is acknowledged and then fails its digest.  The first large
    body of a large-body trial is read back after the restart: lost."""
    res = io_errors_check.run(Backend.from_factory(DROPS_CARRY), QUICK, 3)
    assert res.findings
    assert {int(f.scenario.rsplit(":", 1)[1]) % 8 for f in res.findings} == {4}
    assert any("(0, 0)" in f.detail and "was lost" in f.detail for f in res.findings)
    _same_on_replay(DROPS_CARRY, res.findings[0].scenario, res.findings)


def test_a_workload_that_fails_with_no_fault_is_an_io_errors_finding() -> None:
    """A call that fails when no fault was injected (ids repeated on a stalled clock:
    EEXIST on a fine disk) is reported by io-errors too, on C9, with the failing call:
    it was once passed over as a trial whose fault never took place."""
    res = io_errors_check.run(Backend.from_factory(IDS_REPEAT), QUICK, 3)
    unfaulted = [f for f in res.findings if "with no fault injected" in f.detail]
    raised = [f for f in unfaulted if "File exists" in f.detail]
    assert raised and {f.clause for f in raised} == {"C9"}
    assert raised[0].steps[0].endswith("no fault injected")
    # a divergence with no fault keeps its own clause (a repeated id answers wrongly)
    assert all(f.clause != "C9" for f in unfaulted if "diverged from the model" in f.detail)


def test_large_bodies_stay_within_the_declared_body_limit() -> None:
    """A backend that declares ``Limits.max_body_bytes`` below the large bodies gets them
    cut to its limit (and none when that is below 128 KiB): refusing a body over a
    declared limit is right, never a finding."""
    big = io_errors_check.LARGE_BODY
    assert max(len(c.body) for c in io_errors_check.workload_of(7, 4)) > big
    capped = io_errors_check.workload_of(7, 4, 1_000_000)
    padded = [c.body for c in capped if len(c.body) > 64 * 1024]
    assert padded and all(b.endswith(b"L" * (1_000_000 - 4096)) and len(b) <= 1_000_000
                          for b in padded)
    assert max(len(c.body) for c in io_errors_check.workload_of(7, 4, 100_000)) < 64 * 1024
    assert Backend.from_factory(KV).probe().limits.max_body_bytes is None


def test_a_sync_that_fails_for_a_full_disk_may_say_any_storage_error() -> None:
    """ENOSPC from an fsync reports writeback the kernel lost: the caller must reopen or
    retry, and the error need not be NoSpaceError; EIO is never NoSpaceError; ENOSPC from
    a write is NoSpaceError."""
    from queue_ref.storage import NoSpaceError, StorageIOError

    check = io_errors_check._error_class
    assert check(StorageIOError("x"), "fsync", "ENOSPC", "call 0", "here") == ()
    assert check(StorageIOError("x"), "write", "ENOSPC", "call 0", "here")
    assert check(NoSpaceError("x"), "fsync", "EIO", "call 0", "here")
    assert check(NoSpaceError("x"), "write", "ENOSPC", "call 0", "here") == ()


def test_a_failed_read_must_raise_storage_io_error_and_change_nothing() -> None:
    """io-errors fails read calls too (a bad sector fails ``readdir`` and ``pread``): each
    read operation, at up to six of its read calls.  The filesystem queue passes (it let
    a failed ``listdir`` out of its listings as a bare OSError until these trials); the
    variant that still does fails on C9, the finding replays by id, and the real queue
    passes the replay."""
    from conformance.checks import read_faults

    trials, found = read_faults.run_reads(Backend.from_factory(FS))
    assert trials >= 20 and found == []
    broken = Backend.from_factory(f"{BROKEN}:fs_listing_raw_oserror")
    trials, found = read_faults.run_reads(broken)
    ops = {f.scenario.split(":")[2] for f in found}
    assert ops == {"list_queue", "find_inflight", "find_pending_cleanup", "list_domain"}
    assert {f.clause for f in found} == {"C9"}
    assert all("raised OSError" in f.detail for f in found)
    assert [f.clause for f in replay(broken, "io-errors:read:list_queue:0")] == ["C9"]
    assert replay(Backend.from_factory(FS), "io-errors:read:list_queue:0") == []


def test_a_read_fault_io_fails_exactly_the_read_call_it_is_armed_for(tmp_path) -> None:
    from conformance.checks.read_faults import ReadFaultIO
    from queue_ref.io import OsIO

    io = ReadFaultIO(OsIO())
    (tmp_path / "a").write_bytes(b"x")
    io.arm(1)
    assert io.listdir(str(tmp_path)) == ["a"]  # read call #0
    with pytest.raises(OSError, match="read call #1"):
        io.lstat(str(tmp_path / "a"))
    io.mkdir(str(tmp_path / "d"))  # a mutating call is never counted nor failed
    assert io.reads == 2 and io.failed.startswith("lstat")
    io.disarm()
    assert io.is_dir(str(tmp_path / "d")) and io.reads == 2


@pytest.mark.parametrize("seed", [1, 26])
def test_a_restart_after_a_failed_call_names_nothing_lost(seed: int) -> None:
    """A failed call is no damage.  A KV queue that writes its clean-close record from
    memory after a failed sync (the project's did) makes the next open name the entry
    whose write the sync covered lost to damage at rest; io-errors fails it on C6, the
    finding replays, and the real queue (no record after a failure) passes the replay."""
    broken = Backend.from_factory(f"{BROKEN}:kv_records_rest_after_failed_sync")
    res = io_errors_check.run(broken, QUICK, seed)
    named = [f for f in res.findings if "lost to damage" in f.detail]
    assert named and {f.clause for f in named} == {"C6"}
    assert all("nothing was damaged" in f.detail for f in named)
    assert [f.clause for f in replay(broken, named[0].scenario)] == ["C6"]
    assert replay(Backend.from_factory(KV), named[0].scenario) == []
