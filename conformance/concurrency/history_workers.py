"""Callers that do random operations on one small queue and record a history of them.

A ``Worker`` is one caller (a thread of the parent, or a child process with a Storage of
its own).  Its choices come from its plan's seed: which operation next, which of the
entries it holds a handle for, which schedule.  It acts only through handles it holds
(from its listings, its enqueues and its transitions), stale ones included, so callers
collide on the few entries of the queue.  Every call is recorded with its invocation and
return times (``time.monotonic_ns``: one clock for every process on Linux) as a
``Recorded`` of ``conformance.concurrency.linearizability``.

Besides the history a worker reports what no model step shows: a body read back through
``read_inflight`` that is not the one committed (C6).

``worker_process`` is the body of a child process: it serves one round after another
(open the queue named, wait at the start line, run, finish, close) over its channel.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from conformance.concurrency.linearizability import Recorded, Sched
from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Channel
from queue_ref.storage import (
    Handle,
    HeldMail,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
    StorageIOError,
)

#: Operations a worker draws, with their weights (hold ones only with Capability.HOLD).
WEIGHTS: dict[str, int] = {
    "send_start": 5, "reschedule": 3, "drop": 1, "send_cancel": 2, "send_done": 2,
    "cleanup": 2, "list_queue": 2, "find_pending_cleanup": 1, "enqueue": 1, "read": 1,
}
HOLD_WEIGHTS: dict[str, int] = {"hold": 1, "release": 1, "list_held": 1, "drop_held": 1}
TAKES: dict[str, type[Handle]] = {
    "send_start": QueuedMail, "reschedule": QueuedMail, "drop": QueuedMail, "hold": QueuedMail,
    "send_cancel": InflightMail, "send_done": InflightMail, "read": InflightMail,
    "cleanup": PendingCleanupMail, "release": HeldMail, "drop_held": HeldMail,
}
#: Where a worker holding no handle of the needed type gets one.
REFILL: dict[type[Handle], str] = {
    QueuedMail: "list_queue", InflightMail: "send_start", PendingCleanupMail: "find_pending_cleanup",
    HeldMail: "list_held",
}
CHANGES_SCHEDULE = frozenset({"reschedule", "send_cancel"})


def body_for(mail_from: str) -> bytes:
    """The body every message of these checks carries, told by its sender."""
    return f"Subject: race\r\n\r\nfrom {mail_from}\r\n".encode() * 3


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    seed: int
    ops: int
    hold: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sched(s: Schedule) -> Sched:
    return (s.at, s.attempts)


class Worker:
    """One caller of ``store``: see the module docstring."""

    def __init__(self, store: Storage, plan: WorkerPlan) -> None:
        self.store = store
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.history: list[Recorded] = []
        self.problems: list[tuple[str, str]] = []  # (clause, detail) seen outside the model
        self.held: dict[type[Handle], dict[str, Handle]] = {
            t: {} for t in (QueuedMail, InflightMail, PendingCleanupMail, HeldMail)}
        self._enqueued = 0
        ops = dict(WEIGHTS, **(HOLD_WEIGHTS if plan.hold else {}))
        self._names = list(ops)
        self._weights = list(ops.values())

    # ---- recording ---------------------------------------------------------------------------

    @staticmethod
    def _record(fn: Callable[[], Any]) -> tuple[Any, Exception | None, int, int]:
        t0 = time.monotonic_ns()
        try:
            got, err = fn(), None
        except Exception as e:  # every error is recorded; the check names it (C9)
            got, err = None, e
        t1 = time.monotonic_ns()
        return got, err, t0, t1

    def _error(self, call: str, err: Exception, t0: int, t1: int, entry: str = "",
               schedule: Sched | None = None) -> None:
        self.history.append(Recorded(self.plan.name, call, t0, t1, "error", entry, schedule,
                                     error=f"{type(err).__name__}: {err}"))
        if isinstance(err, StorageIOError) and isinstance(err.handle, Handle):
            self._keep(err.handle)

    def _keep(self, h: Handle) -> None:
        self.held[type(h)][h.entry_id] = h

    # ---- the calls -----------------------------------------------------------------------------

    def enqueue(self, n_rcpts: int, schedules: list[Schedule]) -> list[QueuedMail]:
        mail_from = f"{self.plan.name}.{self._enqueued}@example.org"
        self._enqueued += 1

        def commit() -> list[QueuedMail]:
            with self.store.enqueue(mail_from) as enq:
                enq.write(body_for(mail_from))
                return enq.commit([Recipient(f"r{i}@example.net", schedules[i])
                                   for i in range(n_rcpts)])

        got, err, t0, t1 = self._record(commit)
        if err is not None:
            self._error("enqueue", err, t0, t1)
            return []
        self.history.append(Recorded(self.plan.name, "enqueue", t0, t1, "moved",
                                     entries=tuple(h.entry_id for h in got),
                                     schedules=tuple(_sched(s) for s in schedules[:n_rcpts])))
        for h in got:
            self._keep(h)
        return list(got)

    def listing(self, call: str) -> list[Handle]:
        got, err, t0, t1 = self._record(lambda: list(getattr(self.store, call)()))
        if err is not None:
            self._error(call, err, t0, t1)
            return []
        self.history.append(Recorded(self.plan.name, call, t0, t1, "listed",
                                     entries=tuple(h.entry_id for h in got),
                                     schedules=tuple(_sched(h.schedule) for h in got)))
        for h in got:
            self._keep(h)
        return list(got)

    def transition(self, call: str, h: Handle, schedule: Schedule | None = None) -> Any:
        self.held[type(h)].pop(h.entry_id, None)
        fn = getattr(self.store, call)
        arg = None if schedule is None else _sched(schedule)
        got, err, t0, t1 = self._record(lambda: fn(h) if schedule is None else fn(h, schedule))
        if err is not None:
            self._error(call, err, t0, t1, h.entry_id, arg)
            return None
        moved = got is not None and got is not False
        self.history.append(Recorded(
            self.plan.name, call, t0, t1, "moved" if moved else "vanished", h.entry_id, arg,
            _sched(got.schedule) if isinstance(got, Handle) else None))
        if isinstance(got, Handle):
            self._keep(got)
        return got

    def read(self, h: InflightMail) -> None:
        """Read the body back (not part of the history): it must be the one committed."""
        try:
            with self.store.read_inflight(h) as r:
                body, sender = r.read_all(), r.meta.mail_from
        except Exception as e:
            self.problems.append(("C6", f"{self.plan.name}: read_inflight of {h.entry_id}, "
                                        f"which it holds, raised {type(e).__name__}: {e}"))
            return
        if body != body_for(sender):
            self.problems.append(("C6", f"{self.plan.name}: read_inflight of {h.entry_id} gave "
                                        f"{len(body)} bytes that are not the body committed"))

    # ---- the plan ------------------------------------------------------------------------------

    def _schedule(self) -> Schedule:
        return Schedule(self.rng.randrange(1, 10**6), self.rng.randrange(0, 5))

    def step(self) -> None:
        """One drawn operation (or the listing that gets a handle it needs)."""
        name = self.rng.choices(self._names, self._weights)[0]
        slot = self.rng.randrange(1 << 16)
        schedule = self._schedule()
        if name == "enqueue":
            n = 1 + self.rng.randrange(2)
            self.enqueue(n, [schedule, self._schedule()])
            return
        if name in ("list_queue", "find_pending_cleanup", "list_held"):
            self.listing(name)
            return
        want = TAKES[name]
        pool = self.held[want]
        if not pool:
            refill = REFILL[want]
            if refill == "send_start" and self.held[QueuedMail]:
                queued = sorted(self.held[QueuedMail])
                self.transition("send_start", self.held[QueuedMail][queued[slot % len(queued)]])
            else:
                self.listing("list_queue" if refill == "send_start" else refill)
            return
        entry = sorted(pool)[slot % len(pool)]
        h = pool[entry]
        if name == "read":
            assert isinstance(h, InflightMail)
            self.read(h)
            return
        self.transition(name, h, schedule if name in CHANGES_SCHEDULE else None)

    def run(self) -> list[Recorded]:
        self.listing("list_queue")
        for _ in range(self.plan.ops):
            time.sleep(0)  # let the other threads in: a caller's steps interleave with theirs
            self.step()
        return self.history

    def finish(self) -> list[Recorded]:
        """Give back what it holds: claims sent or put back, retired entries cleaned up."""
        start = len(self.history)
        for entry in sorted(self.held[InflightMail]):
            h = self.held[InflightMail][entry]
            if self.rng.random() < 0.5:
                self.transition("send_done", h)
            else:
                self.transition("send_cancel", h, self._schedule())
        for entry in sorted(self.held[PendingCleanupMail]):
            self.transition("cleanup", self.held[PendingCleanupMail][entry])
        return self.history[start:]


def drain(store: Storage, hold: bool) -> Worker:
    """Retire and clean up everything left (recorded by a worker named ``drain``), then
    list once more: every listing must be empty."""
    w = Worker(store, WorkerPlan("drain", 0, 0, hold))
    for h in w.listing("list_queue"):
        assert isinstance(h, QueuedMail)
        w.transition("drop", h)
    if hold:
        for h in w.listing("list_held"):
            w.transition("drop_held", h)
    w.listing("find_pending_cleanup")
    for entry in sorted(w.held[PendingCleanupMail]):
        w.transition("cleanup", w.held[PendingCleanupMail][entry])
    w.listing("list_queue")
    w.listing("find_pending_cleanup")
    if hold:
        w.listing("list_held")
    return w


def _send_history(ch: Channel, recs: list[Recorded], tag: str) -> None:
    for i in range(0, len(recs), 8):
        ch.send({"ops": [r.to_json() for r in recs[i:i + 8]]})
    ch.send({tag: True})


def worker_process(ch: Channel, backend: Backend) -> None:
    """A child process serving rounds: ``{"root", "plan"}``, then ``go``, then ``finish``."""
    while True:
        line = ch.recv()
        if not line or line == "stop":
            return
        job = json.loads(line)
        store = backend.open(job["root"])
        try:
            w = Worker(store, WorkerPlan(**job["plan"]))
            ch.send({"ready": True})
            if ch.recv() != "go":
                return
            _send_history(ch, w.run(), "ran")
            if ch.recv() != "finish":
                return
            _send_history(ch, w.finish(), "finished")
            ch.send({"problems": w.problems})
        finally:
            store.close()
        ch.send({"closed": True})
