"""The linearizable check: the history search on hand-made histories, the pause gate of
the fault injector, the check on the project's backends, and the broken variants it
catches (a check-then-act reschedule, racing a claim: C7)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import linearizability_check
from conformance.concurrency.linearizability import Recorded, check_history
from conformance.concurrency.paused_races import BY_NAME, run_race
from conformance.crashexplore.traced_runs import ScratchIO, scratch_dir
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK
from faultinject.seam import FaultyIO
from queue_ref.memory import MemoryStorage
from queue_ref.storage import Capability, QueuedMail, Recipient, Schedule
from spec.model import Model
from spec.states import BATCHES, EntryState, Op, Outcome
from tests.conformance_support import DoubleClaim

ENQ = Recorded("setup", "enqueue", 0, 10, "moved", entries=("a", "b"),
               schedules=((5, 0), (6, 0)))


def R(worker: str, call: str, t0: int, t1: int, outcome: str, entry: str = "", **kw: object) -> Recorded:
    return Recorded(worker, call, t0, t1, outcome, entry, **kw)  # type: ignore[arg-type]


# ---- the search ----------------------------------------------------------------------------

def test_concurrent_claims_one_wins_is_linearizable() -> None:
    h = [ENQ, R("t0", "send_start", 20, 40, "moved", "a", got_schedule=(5, 0)),
         R("t1", "send_start", 25, 45, "vanished", "a"),
         R("t0", "send_done", 50, 60, "moved", "a", got_schedule=(5, 0))]
    v = check_history(h)
    assert v.linearizable is True and v.parts == 2 and v.steps > 0


def test_a_claim_that_loses_to_a_later_returning_claim_is_still_linearizable() -> None:
    """The winner may return after the loser: only the order of effects matters."""
    h = [ENQ, R("t0", "send_start", 20, 90, "moved", "a", got_schedule=(5, 0)),
         R("t1", "send_start", 25, 30, "vanished", "a")]
    assert check_history(h).linearizable is True


def test_two_claims_of_one_entry_are_c7() -> None:
    h = [ENQ, R("t0", "send_start", 20, 40, "moved", "a", got_schedule=(5, 0)),
         R("t1", "send_start", 25, 45, "moved", "a", got_schedule=(5, 0))]
    v = check_history(h)
    assert v.linearizable is False and v.clause == "C7" and v.entry == "a"
    assert any("send_start(a)" in line for line in v.lines)


def test_a_reschedule_and_a_claim_both_succeeding_is_c7() -> None:
    """Kannader's race: the sender got the old schedule, the rescheduler was told queued."""
    h = [ENQ, R("t0", "reschedule", 20, 40, "moved", "a", schedule=(9, 1), got_schedule=(9, 1)),
         R("t1", "send_start", 25, 45, "moved", "a", got_schedule=(5, 0))]
    v = check_history(h)
    assert v.linearizable is False and v.clause == "C7"


def test_a_claim_after_send_done_returned_is_c3() -> None:
    h = [ENQ, R("t0", "send_start", 20, 30, "moved", "a", got_schedule=(5, 0)),
         R("t0", "send_done", 31, 35, "moved", "a", got_schedule=(5, 0)),
         R("t1", "send_start", 40, 45, "moved", "a", got_schedule=(5, 0))]
    assert check_history(h).clause == "C3"


def test_a_wrong_schedule_on_the_returned_handle_is_c5() -> None:
    h = [ENQ, R("t0", "reschedule", 20, 30, "moved", "a", schedule=(9, 1), got_schedule=(9, 1)),
         R("t1", "send_start", 40, 45, "moved", "a", got_schedule=(5, 0))]
    assert check_history(h).clause == "C5"


def test_a_drop_cleaned_up_by_another_holder_before_it_returned_may_carry_any_schedule() -> None:
    """The filesystem queue reads a dropped entry's schedule back after its move; another
    holder (find_pending_cleanup) may have cleaned the entry up by then: the schedule on
    that PendingCleanupMail is not the model's, and the entry is gone, so it is allowed.
    Without the cleanup the same answer is C5."""
    pre = [ENQ, R("t1", "reschedule", 11, 12, "moved", "a", schedule=(9, 1), got_schedule=(9, 1))]
    drop = R("t2", "drop", 20, 60, "moved", "a", got_schedule=(5, 0))
    raced = [*pre, drop,
             R("t0", "find_pending_cleanup", 30, 32, "listed", entries=("a",),
               schedules=((9, 1),)),
             R("t0", "cleanup", 40, 45, "moved", "a")]
    assert check_history(raced).linearizable is True
    v = check_history([*pre, drop])
    assert v.linearizable is False and v.clause == "C5"


def test_none_with_no_competitor_is_an_api_finding() -> None:
    h = [ENQ, R("t0", "send_start", 20, 30, "vanished", "a")]
    v = check_history(h)
    assert v.linearizable is False and v.clause == "API"


def test_none_while_another_call_moves_the_entry_is_allowed() -> None:
    """A reschedule that claims the entry while it writes hides it from a claim (and from a
    listing) at that moment; the model allows the None only because they overlap."""
    h = [ENQ, R("t0", "reschedule", 20, 60, "moved", "a", schedule=(9, 1), got_schedule=(9, 1)),
         R("t1", "send_start", 30, 40, "vanished", "a"),
         R("t2", "list_queue", 30, 40, "listed", entries=("b",), schedules=((6, 0),))]
    assert check_history(h).linearizable is True
    late = [*h, R("t1", "list_queue", 70, 80, "listed", entries=("b",), schedules=((6, 0),))]
    v = check_history(late)
    assert v.linearizable is False and v.clause == "API" and "left out" in v.detail


def test_a_listing_is_judged_entry_by_entry_not_as_a_snapshot() -> None:
    """b is claimed and a cancelled during one listing: the listing may show both queued
    (a after its cancel, b before its claim), which no single moment had."""
    h = [ENQ, R("t0", "send_start", 11, 12, "moved", "a", got_schedule=(5, 0)),
         R("t1", "list_queue", 20, 60, "listed", entries=("a", "b"),
           schedules=((7, 0), (6, 0))),
         R("t0", "send_cancel", 25, 30, "moved", "a", schedule=(7, 0), got_schedule=(7, 0)),
         R("t2", "send_start", 40, 45, "moved", "b", got_schedule=(6, 0))]
    assert check_history(h).linearizable is True


def test_listed_while_claimed_or_twice_or_unknown() -> None:
    claimed = [ENQ, R("t0", "send_start", 20, 30, "moved", "a", got_schedule=(5, 0)),
               R("t1", "list_queue", 40, 50, "listed", entries=("a", "b"),
                 schedules=((5, 0), (6, 0)))]
    assert check_history(claimed).clause == "C7"
    twice = [ENQ, R("t1", "list_queue", 40, 50, "listed", entries=("a", "a", "b"),
                    schedules=((5, 0), (5, 0), (6, 0)))]
    assert check_history(twice).clause == "API"
    unknown = [ENQ, R("t1", "list_queue", 40, 50, "listed", entries=("a", "b", "zz"),
                      schedules=((5, 0), (6, 0), (1, 0)))]
    assert check_history(unknown).clause == "C2"


def test_a_call_that_raised_may_or_may_not_have_taken_effect() -> None:
    for later in ("moved", "vanished"):
        h = [ENQ, R("t0", "send_start", 20, 30, "error", "a", error="StorageIOError: x"),
             R("t1", "send_start", 40, 50, later, "a",
               got_schedule=(5, 0) if later == "moved" else None)]
        assert check_history(h).linearizable is True


def test_two_cleanups_of_one_entry_both_true_is_c7() -> None:
    pre = [ENQ, R("t0", "send_start", 11, 12, "moved", "a", got_schedule=(5, 0)),
           R("t0", "send_done", 13, 14, "moved", "a", got_schedule=(5, 0))]
    ok = [*pre, R("t0", "cleanup", 20, 30, "moved", "a"), R("t1", "cleanup", 21, 31, "vanished", "a")]
    assert check_history(ok).linearizable is True
    bad = [*pre, R("t0", "cleanup", 20, 30, "moved", "a"), R("t1", "cleanup", 21, 31, "moved", "a")]
    assert check_history(bad).clause == "C7"


def test_the_search_bound_gives_unknown_not_a_pass() -> None:
    calls = [R(f"t{k}", "list_queue", 20, 90, "listed", entries=("a", "b"),
               schedules=((5, 0), (6, 0))) for k in range(6)]
    v = check_history([ENQ, *calls], bound=5)
    assert v.linearizable is None and "model steps" in v.detail


_OPS = [op for op in Op if op is not Op.ENQUEUE and op not in BATCHES]


@given(st.lists(st.tuples(st.sampled_from([*_OPS, "list_queue", "list_held"]),
                          st.integers(0, 1), st.integers(0, 150), st.integers(0, 150),
                          st.integers(0, 9)), max_size=14))
def test_every_history_of_a_sequential_run_is_linearizable(
        steps: list[tuple[object, int, int, int, int]]) -> None:
    """Calls answered by the model one after the other, each given an interval around its
    moment (overlapping its neighbours'): the search must always find the order."""
    rcpts = (("r0", Schedule(5)), ("r1", Schedule(6)))
    model, _ = Model().enqueue("", b"", rcpts)
    names = ("a", "b")
    h = [ENQ]
    for n, (what, e, before, after, at) in enumerate(steps):
        t = 200 * (n + 1)
        t0, t1 = max(11, t - before), t + after
        if isinstance(what, str):
            want = EntryState.QUEUED if what == "list_queue" else EntryState.HELD
            listed = [k for k in model.keys_in(want)]
            h.append(R("w", what, t0, t1, "listed", entries=tuple(names[k[1]] for k in listed),
                       schedules=tuple((model.entries[k].schedule.at,
                                        model.entries[k].schedule.attempts) for k in listed)))
            continue
        assert isinstance(what, Op)
        sched = Schedule(at) if what in (Op.RESCHEDULE, Op.SEND_CANCEL) else None
        model, outcome = model.apply(what, (0, e), sched)
        got = model.entries.get((0, e))
        moved = outcome is Outcome.MOVED
        h.append(R("w", what.value, t0, t1, "moved" if moved else "vanished", names[e],
                   schedule=None if sched is None else (sched.at, 0),
                   got_schedule=(got.schedule.at, got.schedule.attempts)
                   if moved and got is not None else None))
    v = check_history(h)
    assert v.linearizable is True, (v.clause, v.detail, v.lines)


def test_histories_round_trip_through_json() -> None:
    r = R("p1", "send_cancel", 1, 2, "moved", "a", schedule=(3, 4), got_schedule=(3, 4))
    assert Recorded.from_json(r.to_json()) == r
    assert Recorded.from_json(ENQ.to_json()) == ENQ


# ---- the pause gate --------------------------------------------------------------------------

def test_the_pause_gate_stops_one_caller_while_others_go_on() -> None:
    with scratch_dir("queue-ref-pause-test-") as root:
        io = FaultyIO(root, inner=ScratchIO())
        io.mkdir(f"{root}/d")
        gate = io.pause_at(io.mutating_count)
        a = threading.Thread(target=lambda: io.mkdir(f"{root}/a"))
        a.start()
        assert gate.wait_reached(5) and gate.call == "mkdir"
        io.mkdir(f"{root}/b")  # another caller is not held up by the stopped one
        time.sleep(0.05)
        assert a.is_alive() and not io.exists(f"{root}/a")
        gate.release()
        a.join(5)
        assert not a.is_alive() and io.exists(f"{root}/a")
        made = [e.args[0] for e in io.events if e.name == "mkdir"]
        assert made == ["d", "b", "a"]  # the stopped call took its place when it ran


def test_a_gate_released_early_never_stops_anyone() -> None:
    with scratch_dir("queue-ref-pause-test-") as root:
        io = FaultyIO(root, inner=ScratchIO())
        gate = io.pause_at(0)
        gate.release()
        io.mkdir(f"{root}/x")
        assert gate.reached and io.exists(f"{root}/x")
        with pytest.raises(ValueError):
            io.pause_at(-1)


# ---- the check on real backends ----------------------------------------------------------

SMALL = replace(QUICK, linearizable_rounds=4)


@pytest.mark.parametrize("factory", [
    "conformance.examples.backends:fs", "conformance.examples.backends:fs_fsync",
    "conformance.examples.backends:kv_log", "conformance.examples.backends:kv_leveldb",
    "conformance.examples.sqlite_backend:factory",
])
def test_the_projects_backends_pass(factory: str) -> None:
    backend = Backend.from_factory(factory)
    caps = backend.probe().capabilities
    res = linearizability_check.run(backend, SMALL, 11, caps)
    assert res.status is Status.PASS, [(f.clause, f.detail, f.steps) for f in res.findings] or res.note
    assert res.stats["rounds"] == 4 and res.stats["calls"] > 100
    if Capability.MULTI_PROCESS in caps:
        assert res.stats["processes"] == 2
    if Capability.IO_SEAM in caps:
        assert res.stats["races"] >= 13 and res.stats["race_calls_paused"] >= 13


def test_a_paused_race_judges_both_answers_and_the_final_state() -> None:
    run = run_race(Backend.from_factory("conformance.examples.backends:fs"),
                   BY_NAME["reschedule-vs-send_start"], 2, 10_000)
    assert run.reached and run.verdict.linearizable is True
    got = {r.worker: r.outcome for r in run.history if r.call in ("reschedule", "send_start")
           and r.worker in ("A", "B")}
    assert got == {"A": "moved", "B": "vanished"}  # the claim found the entry claimed
    assert any(r.worker == "drain" for r in run.history)


UNCLAIMED = "conformance.examples.broken_backends:fs_unclaimed_reschedule"


def test_a_check_then_act_reschedule_is_c7_and_replays() -> None:
    backend = Backend.from_factory(UNCLAIMED)
    run = run_race(backend, BY_NAME["reschedule-vs-send_start"], 0, 10_000)
    assert run.verdict.linearizable is False and run.verdict.clause == "C7"
    found = linearizability_check.replay(backend, run.scenario)
    assert found and {f.clause for f in found} == {"C7"}
    assert found[0].scenario == "linearizable:race:reschedule-vs-send_start:0"
    assert linearizability_check.replay(
        Backend.from_factory("conformance.examples.backends:fs"), run.scenario) == []
    with pytest.raises(ValueError):
        linearizability_check.replay(backend, "linearizable:race:nope:0")


def test_the_command_replays_a_race_by_its_id(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from conformance.cli import main

    code = main(["certify", UNCLAIMED, "--scenario",
                 "linearizable:race:reschedule-vs-send_start:3", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code != 0 and {f["clause"] for f in out["findings"]} == {"C7"}


def test_the_check_fails_the_variant_on_c7_only() -> None:
    backend = Backend.from_factory(UNCLAIMED)
    res = linearizability_check.run(backend, replace(SMALL, linearizable_rounds=1), 3,
                                    backend.probe().capabilities)
    assert res.status is Status.FAIL
    clauses = {f.clause for f in res.findings}
    # two reschedules at once also trip over each other's schedule record: StorageIOError
    assert "C7" in clauses and clauses <= {"C7", "C9"}
    assert all(f.scenario.startswith("linearizable:") for f in res.findings)


class RacyReschedule(MemoryStorage):
    """A reschedule that checks the entry is queued, lets go of the lock, then writes."""

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        h = self._take(mail, QueuedMail)
        with self._lock:
            e = self._entries.get(h.entry_id)
            if e is None or e.state != "queued":
                return None
        time.sleep(0.002)
        with self._lock:
            e.schedule = schedule
        return self._issue(QueuedMail, h.entry_id, e.message_id, schedule)


def test_a_listing_never_gives_an_entry_cleaned_up_while_it_was_read(tmp_path: object) -> None:
    """The filesystem queue's listing reads an entry's link, then its metadata: another
    caller may claim, send and clean up the entry in between (its schedule record goes),
    and the envelope's first schedule must then not be listed: found by this check
    (seed 2008, round 5), fixed by reading the link again."""
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import EntryName

    root = str(tmp_path)
    other = FsQueue(root)

    class Interrupted(FsQueue):
        armed = False  # armed once open (its recovery reads entries too)

        def _load_entry(self, e: EntryName) -> object:
            if self.armed:
                self.armed = False
                (h,) = [q for q in other.list_queue() if q.entry_id == e.entry_id]
                f = other.send_start(h)
                assert f is not None
                p = other.send_done(f)
                assert p is not None and other.cleanup(p)
            return super()._load_entry(e)

    with other.enqueue("a@example.org") as enq:
        enq.write(b"x")
        (q0, _) = enq.commit([Recipient("b@example.net", Schedule(5)),
                              Recipient("c@example.net", Schedule(6))])
    (q0,) = [q for q in other.list_queue() if q.entry_id == q0.entry_id]
    assert other.reschedule(q0, Schedule(9, 1)) is not None
    store = Interrupted(root)
    store.armed = True
    try:
        listed = {h.entry_id: h.schedule for h in store.list_queue()}
        assert not store.armed, "the listing read no entry"
        assert q0.entry_id not in listed and list(listed.values()) == [Schedule(6)]
    finally:
        store.close()
        other.close()


def test_random_rounds_of_threads_find_a_racy_reschedule() -> None:
    """Without any pause gate (the backend has no seam): the threads' own collisions."""
    backend = Backend.from_factory(RacyReschedule)
    res = linearizability_check.run(backend, replace(QUICK, linearizable_rounds=30), 5,
                                    frozenset())
    assert res.status is Status.FAIL and {f.clause for f in res.findings} <= {"C7", "C5"}
    f = res.findings[0]
    assert f.scenario.startswith("linearizable:quick:5:") and f.steps


def test_memory_storage_passes_and_a_double_claim_fails() -> None:
    ok = linearizability_check.run(Backend.from_factory(MemoryStorage), SMALL, 2, frozenset())
    assert ok.status is Status.PASS, [f.detail for f in ok.findings]
    bad = linearizability_check.run(Backend.from_factory(DoubleClaim), SMALL, 2, frozenset())
    assert bad.status is Status.FAIL and "C7" in {f.clause for f in bad.findings}


def test_a_round_replays_by_its_id() -> None:
    """A round's id names its profile, seed and round: the same callers with the same
    plans run again (a few times, the interleaving being the machine's)."""
    memory = Backend.from_factory(MemoryStorage)
    assert linearizability_check.replay(memory, "linearizable:quick:5:0") == []
    double = linearizability_check.replay(Backend.from_factory(DoubleClaim),
                                          "linearizable:quick:2:1")
    assert double and "C7" in {f.clause for f in double}
    assert all(f.scenario == "linearizable:quick:2:1" for f in double)
    for bad in ("linearizable:5:0", "linearizable:nope:1:2", "linearizable:quick:x:0"):
        with pytest.raises(ValueError):
            linearizability_check.replay(memory, bad)


def test_a_search_bound_too_small_is_an_error_never_a_pass() -> None:
    res = linearizability_check.run(Backend.from_factory(MemoryStorage),
                                    replace(SMALL, linearizable_bound=3), 2, frozenset())
    assert res.status is Status.ERROR and "bound" in res.note
