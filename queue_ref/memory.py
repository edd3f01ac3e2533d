"""A plain in-memory Storage: no durability, but every rule of the handles and states.

It is the simplest correct reading of the interface (a crash loses everything, so it
declares no durability and is never crash-tested); the lockstep tests run it beside the
model and the durable backends, and it is a template for backend authors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from queue_ref.storage import (
    BufferedEnqueuer,
    BytesReader,
    Capability,
    ClosedError,
    Enqueuer,
    EntryMeta,
    Footprint,
    HeldMail,
    InflightMail,
    MailReader,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    RecoveryReport,
    Schedule,
    Storage,
    validate_address,
    validate_params,
    validate_schedule,
)


@dataclass
class _Msg:
    mail_from: str
    params: dict[str, str]
    body: bytes
    rcpts: list[Recipient]
    live: set[str] = field(default_factory=set)


@dataclass
class _Entry:
    message_id: str
    index: int
    state: str  # "queued" | "held" | "inflight" | "cleanup"
    schedule: Schedule
    arrival_ns: int = 0


class MemoryStorage(Storage):
    capabilities = frozenset({Capability.ZONE_LISTING, Capability.DOMAIN_INDEX,
                              Capability.HOLD})

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._msgs: dict[str, _Msg] = {}
        self._entries: dict[str, _Entry] = {}
        self._next = 0

    # -- listing --

    def _list(self, state: str) -> list[tuple[str, _Entry]]:
        self._check_open()
        with self._lock:
            return sorted(
                ((k, e) for k, e in self._entries.items() if e.state == state),
                key=lambda kv: (int(kv[1].message_id), kv[1].index),
            )

    def list_queue(self) -> Iterator[QueuedMail]:
        for k, e in self._list("queued"):
            yield self._issue(QueuedMail, k, e.message_id, e.schedule)

    def list_held(self) -> Iterator[HeldMail]:
        for k, e in self._list("held"):
            yield self._issue(HeldMail, k, e.message_id, e.schedule)

    def find_inflight(self) -> Iterator[InflightMail]:
        # Every owner of a memory queue lives in this process: none ever dies.
        self._check_open()
        return iter(())

    def inflight_entries(self) -> Iterator[EntryMeta]:
        for k, e in self._list("inflight"):
            m = self._msgs[e.message_id]
            r = m.rcpts[e.index]
            yield EntryMeta(e.message_id, k, m.mail_from, r.address, e.index, r.zone,
                            dict(m.params), e.schedule, len(m.body), e.arrival_ns)

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        for k, e in self._list("cleanup"):
            yield self._issue(PendingCleanupMail, k, e.message_id, e.schedule)

    def list_zone(self, zone: str) -> Iterator[QueuedMail]:
        for k, e in self._list("queued"):
            if self._msgs[e.message_id].rcpts[e.index].zone == zone:
                yield self._issue(QueuedMail, k, e.message_id, e.schedule)

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        d = domain.lower()
        for k, e in self._list("queued"):
            addr = self._msgs[e.message_id].rcpts[e.index].address
            if addr.rpartition("@")[2].lower() == d:
                yield self._issue(QueuedMail, k, e.message_id, e.schedule)

    # -- mail --

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        self._check_open()
        validate_address(mail_from, "mail_from", allow_empty=True)
        return BufferedEnqueuer(self._commit, mail_from, validate_params(params))

    def _commit(self, enq: BufferedEnqueuer, rcpts: list[Recipient]) -> list[QueuedMail]:
        with self._lock:
            self._check_open()
            mid = str(self._next)
            self._next += 1
            msg = _Msg(enq.mail_from, enq.params, enq.body, rcpts)
            self._msgs[mid] = msg
            out = []
            for i, r in enumerate(rcpts):
                eid = f"{mid}.{i}"
                self._entries[eid] = _Entry(mid, i, "queued", r.schedule, time.time_ns())
                msg.live.add(eid)
                out.append(self._issue(QueuedMail, eid, mid, r.schedule))
            return out

    def read_inflight(self, mail: InflightMail) -> MailReader:
        self._peek(mail, InflightMail)
        with self._lock:
            e = self._entries.get(mail.entry_id)
            if e is None or e.state != "inflight":
                raise ClosedError(f"entry {mail.entry_id} is no longer inflight")
            m = self._msgs[e.message_id]
            r = m.rcpts[e.index]
            meta = EntryMeta(e.message_id, mail.entry_id, m.mail_from, r.address, e.index,
                             r.zone, dict(m.params), e.schedule, len(m.body))
            return BytesReader(meta, m.body)

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        state = "held" if isinstance(mail, HeldMail) else "queued"
        self._peek(mail, HeldMail if state == "held" else QueuedMail)
        with self._lock:
            e = self._entries.get(mail.entry_id)
            if e is None or e.state != state:
                return None
            m = self._msgs[e.message_id]
            r = m.rcpts[e.index]
            meta = EntryMeta(e.message_id, mail.entry_id, m.mail_from, r.address, e.index,
                             r.zone, dict(m.params), e.schedule, len(m.body), e.arrival_ns)
            return BytesReader(meta, m.body)

    def _move(self, entry_id: str, src: str, dst: str, sched: Schedule | None) -> _Entry | None:
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None or e.state != src:
                return None
            e.state = dst
            if sched is not None:
                e.schedule = sched
            return e

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        validate_schedule(schedule)
        h = self._take(mail, QueuedMail)
        e = self._move(h.entry_id, "queued", "queued", schedule)
        return None if e is None else self._issue(QueuedMail, h.entry_id, e.message_id, schedule)

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h.entry_id, "queued", "inflight", None)
        return None if e is None else self._issue(
            InflightMail, h.entry_id, e.message_id, e.schedule)

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        e = self._move(h.entry_id, "inflight", "cleanup", None)
        return None if e is None else self._issue(
            PendingCleanupMail, h.entry_id, e.message_id, e.schedule)

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        validate_schedule(schedule)
        h = self._take(mail, InflightMail)
        e = self._move(h.entry_id, "inflight", "queued", schedule)
        return None if e is None else self._issue(QueuedMail, h.entry_id, e.message_id, schedule)

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h.entry_id, "queued", "cleanup", None)
        return None if e is None else self._issue(
            PendingCleanupMail, h.entry_id, e.message_id, e.schedule)

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h.entry_id, "queued", "held", None)
        return None if e is None else self._issue(HeldMail, h.entry_id, e.message_id, e.schedule)

    def release(self, mail: HeldMail) -> QueuedMail | None:
        h = self._take(mail, HeldMail)
        e = self._move(h.entry_id, "held", "queued", None)
        return None if e is None else self._issue(QueuedMail, h.entry_id, e.message_id,
                                                  e.schedule)

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        h = self._take(mail, HeldMail)
        e = self._move(h.entry_id, "held", "cleanup", None)
        return None if e is None else self._issue(
            PendingCleanupMail, h.entry_id, e.message_id, e.schedule)

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        h = self._take(mail, PendingCleanupMail)
        with self._lock:
            e = self._entries.get(h.entry_id)
            if e is None or e.state != "cleanup":
                return False
            del self._entries[h.entry_id]
            m = self._msgs[e.message_id]
            m.live.discard(h.entry_id)
            if not m.live:
                del self._msgs[e.message_id]
            return True

    def recover(self) -> RecoveryReport:
        self._check_open()
        return RecoveryReport()

    def footprint(self) -> Footprint:
        self._check_open()
        with self._lock:
            return Footprint(len(self._msgs) + len(self._entries),
                             sum(len(m.body) for m in self._msgs.values()))

