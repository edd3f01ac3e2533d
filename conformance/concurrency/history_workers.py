"""Callers that do random operations on one small queue and record a history of them.

A ``Worker`` is one caller (a thread of the parent, or a child process with a Storage of
its own).  Its choices come from its plan's seed: which operation next, which of the
entries it holds a handle for, and the mail's data.  It acts only through handles it
holds (from its listings, its enqueues and its transitions), stale ones included, so
callers collide on the few entries of the queue.  Every call is recorded with its
invocation and return times (``time.monotonic_ns``: one clock for every process on
Linux) as a ``Recorded`` of ``conformance.concurrency.linearizability``.

The data is mail's (``conformance.harness.mail_data``, drawn with the plan's seeded
random, no Hypothesis engine): senders and recipients as RFC 5321 and RFC 6531 allow
them (cut to the backend's ``Limits.max_address``), bodies with and without a final
CRLF, dot lines, bare CR and LF, schedules in the past, now and far in the future with
reasons.  An enqueue records what it committed, a ``read_inflight`` what it read (the
sender, the recipient, its index, the body's size and SHA-256): the linearizability
check compares the two.  With ``domains`` (``Capability.DOMAIN_INDEX``) a worker also
calls ``list_domain`` of a domain it committed to or of a drawn address, in a case
drawn too.

Besides the history a worker reports what no model step shows (``problems``): a read
that fails, or whose metadata is another entry's or of another size than the body
read (C6), a commit whose handles do not carry the schedules committed (C5), a schedule whose fields
are not plain ints and a str (C5).

``worker_process`` is the body of a child process: it serves one round after another
(open the queue named, wait at the start line, run, finish, close) over its channel.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from conformance.concurrency.linearizability import READ, Recorded, Sched, body_token
from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Channel
from conformance.harness.field_compare import schedule_diff
from conformance.harness.mail_data import (
    draw_address,
    draw_body,
    draw_schedule,
    draw_sender,
    fit_address,
)
from queue_ref.storage import (
    Capability,
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
DOMAIN_WEIGHTS: dict[str, int] = {"list_domain": 1}
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
LISTING_CALLS = frozenset({"list_queue", "find_pending_cleanup", "list_held", "list_domain"})


@dataclass(frozen=True)
class Mail:
    """What one enqueue commits: the sender, the recipients' addresses, the body."""

    mail_from: str
    rcpts: tuple[str, ...]
    body: bytes


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    seed: int
    ops: int
    hold: bool = False
    domains: bool = False  # the backend declares Capability.DOMAIN_INDEX

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
        self.limit = store.limits.max_address
        self.domains: list[str] = []  # domains of the recipients it committed
        ops = dict(WEIGHTS, **(HOLD_WEIGHTS if plan.hold else {}),
                   **(DOMAIN_WEIGHTS if plan.domains else {}))
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

    def _sched(self, s: Schedule, where: str) -> Sched:
        """``s`` as the history records it; a schedule whose fields are not a plain int,
        int and str (a bool, a float, a subclass) is a problem of its own (C5)."""
        at, attempts, reason = s.at, s.attempts, s.reason
        if not (type(at) is int and type(attempts) is int and type(reason) is str):
            self.problems.append(("C5", f"{self.plan.name}: {where} gave a schedule of "
                                        f"{type(at).__name__}, {type(attempts).__name__}, "
                                        f"{type(reason).__name__}: {s!r}"[:600]))
            return (int(at), int(attempts), str(reason))
        return (at, attempts, reason)

    # ---- the data ----------------------------------------------------------------------------

    def draw_mail(self, n_rcpts: int) -> Mail:
        """A message of mail's data, addresses cut to the backend's limit."""
        rng = self.rng
        return Mail(fit_address(draw_sender(rng), self.limit),
                    tuple(fit_address(draw_address(rng), self.limit) for _ in range(n_rcpts)),
                    draw_body(rng))

    def draw_domain(self) -> str:
        """A domain to ask ``list_domain`` for: of a recipient it committed, or of a drawn
        address; as it is, upper- or lower-cased (domains compare lower-cased)."""
        rng = self.rng
        if self.domains and rng.random() < 0.6:
            domain = rng.choice(self.domains)
        else:
            domain = draw_address(rng).rpartition("@")[2]
        form = rng.randrange(3)
        return domain if form == 0 else domain.upper() if form == 1 else domain.lower()

    # ---- the calls -----------------------------------------------------------------------------

    def enqueue(self, n_rcpts: int, schedules: Sequence[Schedule],
                mail: Mail | None = None) -> list[QueuedMail]:
        """Commit ``mail`` (drawn when None) to its first ``n_rcpts`` recipients with
        ``schedules``; the body is written in pieces."""
        if mail is None:
            mail = self.draw_mail(n_rcpts)
        rcpts = [Recipient(mail.rcpts[i], schedules[i]) for i in range(n_rcpts)]
        body = mail.body
        piece = max(self.rng.choice((1, 7, 512, 65536)), len(body) // 64, 1)

        def commit() -> list[QueuedMail]:
            with self.store.enqueue(mail.mail_from) as enq:
                for k in range(0, len(body), piece):
                    enq.write(body[k:k + piece])
                return enq.commit(rcpts)

        got, err, t0, t1 = self._record(commit)
        if err is not None:
            self._error("enqueue", err, t0, t1)
            return []
        self.history.append(Recorded(
            self.plan.name, "enqueue", t0, t1, "moved", entries=tuple(h.entry_id for h in got),
            schedules=tuple(self._sched(r.schedule, "the caller") for r in rcpts),
            mail_from=mail.mail_from, rcpts=tuple(r.address for r in rcpts),
            body=body_token(body)))
        self.domains.extend(r.address.rpartition("@")[2] for r in rcpts)
        if len(got) != len(rcpts):
            self.problems.append(("C2", f"{self.plan.name}: a commit of {len(rcpts)} recipients "
                                        f"returned {len(got)} handles"))
        for i, (h, r) in enumerate(zip(got, rcpts, strict=False)):
            diff = schedule_diff(h.schedule, r.schedule)
            if diff is not None:
                self.problems.append(("C5", f"{self.plan.name}: commit returned for recipient "
                                            f"{i} ({h.entry_id}) a handle whose {diff}"))
        for h in got:
            self._keep(h)
        return list(got)

    def listing(self, call: str, arg: str | None = None) -> list[Handle]:
        fn = getattr(self.store, call)
        got, err, t0, t1 = self._record(lambda: list(fn() if arg is None else fn(arg)))
        if err is not None:
            self._error(call, err, t0, t1)
            return []
        self.history.append(Recorded(self.plan.name, call, t0, t1, "listed",
                                     entries=tuple(h.entry_id for h in got),
                                     schedules=tuple(self._sched(h.schedule, call) for h in got),
                                     arg=arg or ""))
        for h in got:
            self._keep(h)
        return list(got)

    def transition(self, call: str, h: Handle, schedule: Schedule | None = None) -> Any:
        self.held[type(h)].pop(h.entry_id, None)
        fn = getattr(self.store, call)
        arg = None if schedule is None else self._sched(schedule, "the caller")
        got, err, t0, t1 = self._record(lambda: fn(h) if schedule is None else fn(h, schedule))
        if err is not None:
            self._error(call, err, t0, t1, h.entry_id, arg)
            return None
        moved = got is not None and got is not False
        self.history.append(Recorded(
            self.plan.name, call, t0, t1, "moved" if moved else "vanished", h.entry_id, arg,
            self._sched(got.schedule, call) if isinstance(got, Handle) else None))
        if isinstance(got, Handle):
            self._keep(got)
        return got

    def read(self, h: InflightMail) -> None:
        """Read the entry back: what it read goes into the history (compared there with
        what its enqueue committed); a failure, or metadata of another entry or of another
        body size than read, is a problem here.  (``meta.schedule`` is not compared: a
        transition that wrongly succeeded beside the claim, C7, may have changed it.)"""
        t0 = time.monotonic_ns()
        try:
            with self.store.read_inflight(h) as r:
                body, meta = r.read_all(), r.meta
        except Exception as e:
            self.problems.append(("C6", f"{self.plan.name}: read_inflight of {h.entry_id}, "
                                        f"which it holds, raised {type(e).__name__}: {e}"))
            return
        t1 = time.monotonic_ns()
        who = f"{self.plan.name}: read_inflight of {h.entry_id}"
        if meta.entry_id != h.entry_id:
            self.problems.append(("C6", f"{who} gave the metadata of entry {meta.entry_id}"))
        if meta.body_size != len(body):
            self.problems.append(("C6", f"{who} gave meta.body_size {meta.body_size} with a "
                                        f"body of {len(body)} octets"))
        self.history.append(Recorded(
            self.plan.name, READ, t0, t1, "read", h.entry_id,
            mail_from=meta.mail_from, rcpts=(meta.rcpt,), body=body_token(bytes(body)),
            index=meta.rcpt_index))

    def read_back(self, handles: Sequence[QueuedMail]) -> None:
        """Claim each entry, read it back and put it back with the schedule it had: what
        its commit kept is judged (C6) whatever the callers' race does with it later (a
        drop before any read would leave it unread)."""
        for h in handles:
            got = self.transition("send_start", h)
            if isinstance(got, InflightMail):
                self.read(got)
                self.transition("send_cancel", got, h.schedule)

    # ---- the plan ------------------------------------------------------------------------------

    def draw_schedule(self) -> Schedule:
        """A schedule of mail's data (``mail_data.draw_schedule``), with a reason."""
        return draw_schedule(self.rng)

    def step(self) -> None:
        """One drawn operation (or the listing that gets a handle it needs)."""
        name = self.rng.choices(self._names, self._weights)[0]
        slot = self.rng.randrange(1 << 16)
        schedule = self.draw_schedule()
        if name == "enqueue":
            n = 1 + self.rng.randrange(2)
            self.enqueue(n, [schedule, self.draw_schedule()])
            return
        if name == "list_domain":
            self.listing(name, self.draw_domain())
            return
        if name in LISTING_CALLS:
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
        """Give back what it holds: claims read back, then sent or put back; retired
        entries cleaned up."""
        start = len(self.history)
        for entry in sorted(self.held[InflightMail]):
            h = self.held[InflightMail][entry]
            assert isinstance(h, InflightMail)
            self.read(h)
            if self.rng.random() < 0.5:
                self.transition("send_done", h)
            else:
                self.transition("send_cancel", h, self.draw_schedule())
        for entry in sorted(self.held[PendingCleanupMail]):
            self.transition("cleanup", self.held[PendingCleanupMail][entry])
        return self.history[start:]


def drain(store: Storage, hold: bool, domains: Iterable[str] = ()) -> Worker:
    """List each of ``domains`` (as committed and upper-cased) where the backend declares
    a domain index, then deliver everything left, reading each entry back (claim, read,
    ``send_done``), retire what is held, and clean up (recorded by a worker named
    ``drain``); then list once more: every listing must be empty."""
    w = Worker(store, WorkerPlan("drain", 0, 0, hold))
    if Capability.DOMAIN_INDEX in store.capabilities:
        for form in dict.fromkeys(f for d in domains for f in (d, d.upper())):
            w.listing("list_domain", form)
    for h in w.listing("list_queue"):
        assert isinstance(h, QueuedMail)
        f = w.transition("send_start", h)
        if isinstance(f, InflightMail):
            w.read(f)
            w.transition("send_done", f)
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
