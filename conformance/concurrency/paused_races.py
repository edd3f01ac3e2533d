"""Targeted races: one caller stopped inside its transition while another acts on the entry.

For a backend whose disk calls go through the I/O seam, caller A starts an operation and
is stopped before its k-th mutating call (``FaultyIO.pause_at``), for every k until A's
operation makes no more calls; caller B then runs its competing operation on the same
entry (or on the other recipient of the same message) to its end, or for a short while
if it waits for A; A is let go.  Both answers, and the queue drained afterwards, are
judged against the model by the linearizability search: whatever order the two calls
took effect in, their answers and the final state must be the model's for that order.

Syncs are held open ``SYNC_HOLD`` seconds (``FaultyIO.sync_hold``), so that once A is let
go its syncs and B's changes may overlap, and A's and B's operations are judged by the
sync-cover rule too (``conformance.harness.sync_cover``): neither may return on a sync
that began before its change.

Each race is named ``<a>-vs-<b>`` (``<a>-two-recipients`` when A and B act on the two
recipients of one message); its scenario id is ``linearizable:race:<name>:<k>``.  For a
backend that declares ``Capability.MULTI_PROCESS`` each race is run a second time with B
in a Storage of its own opened on the same directory (``<name>+other-storage``): another
owner, sharing none of A's in-process locks, as a second process would.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

from conformance.concurrency.history_workers import Worker, WorkerPlan, drain
from conformance.concurrency.linearizability import Recorded, Verdict, check_history
from conformance.crashexplore.traced_runs import ScratchIO, scratch_base
from conformance.harness.backend_factory import Backend
from conformance.harness.sync_cover import uncovered_acks
from faultinject.fault_errors import ModelError
from faultinject.seam import FaultyIO
from queue_ref.storage import (
    Handle,
    HeldMail,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    Schedule,
    Storage,
)


@dataclass(frozen=True)
class Race:
    name: str
    setup: str  # queued | inflight | pending | two-inflight | two-pending | held
    a: str  # the operation stopped inside
    b: str  # the competing operation
    hold: bool = False  # needs Capability.HOLD
    other: bool = False  # B has a Storage of its own, as another process (MULTI_PROCESS)


RACES: tuple[Race, ...] = (
    Race("reschedule-vs-send_start", "queued", "reschedule", "send_start"),
    Race("send_start-vs-reschedule", "queued", "send_start", "reschedule"),
    Race("send_start-vs-send_start", "queued", "send_start", "send_start"),
    Race("reschedule-vs-reschedule", "queued", "reschedule", "reschedule"),
    Race("drop-vs-send_start", "queued", "drop", "send_start"),
    Race("send_start-vs-drop", "queued", "send_start", "drop"),
    Race("reschedule-vs-drop", "queued", "reschedule", "drop"),
    Race("reschedule-vs-list_queue", "queued", "reschedule", "list_queue"),
    Race("send_cancel-vs-send_start", "inflight", "send_cancel", "send_start"),
    Race("send_done-vs-send_start", "inflight", "send_done", "send_start"),
    Race("send_done-two-recipients", "two-inflight", "send_done", "send_done"),
    Race("cleanup-two-recipients", "two-pending", "cleanup", "cleanup"),
    Race("cleanup-vs-cleanup", "pending", "cleanup", "cleanup"),
    Race("hold-vs-send_start", "queued", "hold", "send_start", hold=True),
    Race("send_start-vs-hold", "queued", "send_start", "hold", hold=True),
    Race("release-vs-drop_held", "held", "release", "drop_held", hold=True),
)
#: The same races with B in a Storage of its own on the same directory: another owner,
#: none of A's in-process locks, as a second process would be (backends that declare
#: Capability.MULTI_PROCESS).
OTHER_STORAGE = "+other-storage"
RACES = RACES + tuple(Race(r.name + OTHER_STORAGE, r.setup, r.a, r.b, r.hold, True)
                      for r in RACES)
BY_NAME = {r.name: r for r in RACES}

#: How long B may wait for A (stopped) before A is let go anyway.
B_GRACE = 0.3
#: How long a caller may take once both run (longer: it hangs, which is an error).
HANG = 30.0
#: How long each sync call is held open, seconds.
SYNC_HOLD = 0.0005


@dataclass
class RaceRun:
    race: Race
    k: int
    reached: bool  # A stopped at its k-th mutating call (else it made fewer)
    paused_call: str
    b_waited: bool  # B had not returned when A was let go
    verdict: Verdict
    problems: list[tuple[str, str]]
    history: list[Recorded]

    @property
    def scenario(self) -> str:
        return f"linearizable:race:{self.race.name}:{self.k}"


class NotApplicable(RuntimeError):
    """The backend gives no second handle the race needs (e.g. ``find_pending_cleanup``
    leaves out an entry whose handle a live caller holds, which the contract allows)."""


def _entry(w: Worker, t: type[Handle], entry: str) -> Handle:
    h = w.held[t].get(entry)
    if h is None:
        raise NotApplicable(f"{w.plan.name} holds no {t.__name__} of {entry}")
    return h


def _prepare(race: Race, a: Worker, b: Worker, entries: list[str]) -> tuple[str, str]:
    """Bring the entries to the race's state; the entries A and B act on."""
    e0, e1 = entries
    a.listing("list_queue")
    b.listing("list_queue")  # B's handles: stale ones once A moves the entry
    if race.setup in ("inflight", "pending", "two-inflight", "two-pending"):
        a.transition("send_start", _entry(a, QueuedMail, e0))
    if race.setup in ("two-inflight", "two-pending"):
        b.transition("send_start", _entry(b, QueuedMail, e1))
    if race.setup in ("pending", "two-pending"):
        a.transition("send_done", _entry(a, InflightMail, e0))
    if race.setup == "two-pending":
        b.transition("send_done", _entry(b, InflightMail, e1))
    if race.setup == "pending":
        b.listing("find_pending_cleanup")
    if race.setup == "held":
        a.transition("hold", _entry(a, QueuedMail, e0))
        b.listing("list_held")
    return e0, (e1 if race.setup.startswith("two-") else e0)


_TAKES: dict[str, type[Handle]] = {
    "send_start": QueuedMail, "reschedule": QueuedMail, "drop": QueuedMail, "hold": QueuedMail,
    "send_cancel": InflightMail, "send_done": InflightMail, "cleanup": PendingCleanupMail,
    "release": HeldMail, "drop_held": HeldMail,
}


def _act(w: Worker, call: str, entry: str, io: FaultyIO) -> Callable[[], object]:
    if call == "list_queue":
        return lambda: w.listing("list_queue")
    h = _entry(w, _TAKES[call], entry)
    # A's and B's schedules differ in every field, the reason too: one with A's time
    # and B's reason (or none) is no schedule either set (C5)
    sched = (Schedule(777, 3, "A: 421 4.7.0 try later\r\n") if w.plan.name == "A"
             else Schedule(555, 2, "B: 451 \u212b"))
    arg = sched if call in ("reschedule", "send_cancel") else None

    def act() -> object:
        with io.operation(call) as span:
            got = w.transition(call, h, arg)
        if w.history[-1].outcome != "moved":  # failed or found nothing: no acknowledgement
            span.outcome = w.history[-1].outcome
        return got

    return act


def _sync_cover(io: FaultyIO) -> list[tuple[str, str]]:
    """The sync-cover rule's findings on the race's trace."""
    try:
        found = uncovered_acks(io.initial, io.events, io.operations)
    except ModelError as e:
        return [("C9", f"the race's trace cannot be replayed for the sync-cover rule: {e}")]
    return [(u.clause, f"{u.detail()}: {' / '.join(u.excerpt)}") for u in found]


def _thread(fn: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except BaseException as e:  # the harness's own failure: reported as an error
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def run_race(backend: Backend, race: Race, k: int, bound: int) -> RaceRun:
    """Race ``race`` with A stopped before its ``k``-th mutating call."""
    root = tempfile.mkdtemp(prefix="queue-ref-race-", dir=scratch_base())
    io = FaultyIO(root, inner=ScratchIO(), sync_hold=SYNC_HOLD)
    store = backend.open(root, io)
    store_b: Storage | None = None
    errors: list[BaseException] = []
    try:
        setup = Worker(store, WorkerPlan("setup", 0, 0, race.hold))
        mails = setup.enqueue(2, [Schedule(100, 0, "first Pe\u0301rez"),
                                  Schedule(200, 1, "452 4.2.2 full\r\n")])
        if len(mails) != 2:
            raise RuntimeError(f"race setup: the enqueue failed: {setup.history[-1].error}")
        a = Worker(store, WorkerPlan("A", 1, 0, race.hold))
        if race.other:
            store_b = backend.open(root)
        b = Worker(store_b or store, WorkerPlan("B", 2, 0, race.hold))
        ea, eb = _prepare(race, a, b, [m.entry_id for m in mails])
        run_a, run_b = _act(a, race.a, ea, io), _act(b, race.b, eb, io)
        gate = io.pause_at(io.mutating_count + k)
        ta = _thread(run_a, errors)
        while not gate.wait_reached(0.005) and ta.is_alive():
            pass
        reached = gate.reached
        if not reached:
            gate.release()  # A made fewer calls: B must not stop at the gate instead
        tb = _thread(run_b, errors)
        tb.join(B_GRACE if reached else HANG)
        b_waited = tb.is_alive()
        gate.release()
        for t in (ta, tb):
            t.join(HANG)
            if t.is_alive():
                raise RuntimeError(f"race {race.name} at call {k}: a caller still runs after "
                                   f"{HANG:.0f} s (deadlock)")
        if errors:
            raise errors[0]
        a.finish()
        b.finish()
        if store_b is not None:
            store_b.close()
        left = drain(store, race.hold)
        fp = store.footprint()
        problems = setup.problems + a.problems + b.problems + left.problems
        if not race.other:  # B's own Storage works outside the seam: no whole trace
            problems += _sync_cover(io)
        if fp.objects or fp.bytes:
            problems.append(("C8", f"after the race and a full drain {fp.objects} objects, "
                                   f"{fp.bytes} bytes remain"))
        history = setup.history + a.history + b.history + left.history
        verdict = check_history(history, bound)
        return RaceRun(race, k, reached, gate.call, b_waited, verdict, problems, history)
    finally:
        if store_b is not None:
            store_b.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def races_for(hold: bool, multi: bool = False) -> list[Race]:
    return [r for r in RACES if (hold or not r.hold) and (multi or not r.other)]


def run_all(backend: Backend, hold: bool, bound: int, max_k: int = 40,
            multi: bool = False) -> list[RaceRun]:
    """Every race at every mutating call of A's operation (at most ``max_k`` each)."""
    runs: list[RaceRun] = []
    for race in races_for(hold, multi):
        for k in range(max_k):
            try:
                run = run_race(backend, race, k, bound)
            except NotApplicable:
                break
            runs.append(run)
            if not run.reached:
                break
    return runs
