"""What the peer re-creations share: the Storage API over a few protocol steps.

Each peer (``kannader``, ``maddy``, ``chasquid``) keeps its own files in its own way
through the I/O seam; this base class turns its steps into the Storage interface:
handles, the in-memory claims of peers that do not persist INFLIGHT, errors.  Bodies
are small in these examples and are held in memory while received.

Ids are deterministic (messages numbered from the largest on disk), so a workload run
twice makes the same calls, as crash exploration needs.  Entry ids are
``<message>.<recipient index>``.

What holds after a failure: an ``OSError`` from the seam is raised as
``StorageIOError`` with the handle given back; what the disk holds then is whatever
the peer's protocol left, which is the point of these examples.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from queue_ref.io import IO, OsIO, read_file
from queue_ref.storage import (
    BufferedEnqueuer,
    BytesReader,
    Capability,
    ClosedError,
    Enqueuer,
    EntryMeta,
    Footprint,
    Handle,
    InflightMail,
    MailReader,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    RecoveryReport,
    Schedule,
    Storage,
    StorageIOError,
    validate_address,
    validate_params,
)

T = TypeVar("T")
QUEUED, INFLIGHT, CLEANUP = "queued", "inflight", "cleanup"


@dataclass(frozen=True)
class Entry:
    """One entry as the peer's files show it."""

    mid: int
    index: int
    state: str  # QUEUED, INFLIGHT (peers that persist it) or CLEANUP
    schedule: Schedule

    @property
    def id(self) -> str:
        return f"{self.mid}.{self.index}"


@dataclass(frozen=True)
class Stored:
    """A committed message as the peer reads it back."""

    mail_from: str
    params: dict[str, str]
    rcpts: list[tuple[str, str]]  # (address, zone)
    body: bytes


class PeerQueue(Storage):
    """A Storage whose disk protocol is given by the subclass's steps."""

    capabilities = frozenset({Capability.IO_SEAM})
    #: True when INFLIGHT is a state on disk; else claims live in memory only.
    persists_inflight = False

    def __init__(self, root: str, io: IO | None = None) -> None:
        super().__init__()
        self.root = os.path.abspath(root)
        self.io = io if io is not None else OsIO()
        self._lock = threading.RLock()
        self._claimed: set[str] = set()
        self._guard("opening the queue", self._setup)
        mids = self._guard("listing messages", self._message_ids)
        self._next = max(mids, default=-1) + 1
        self.recover()

    # ---- the protocol: provided by each peer ------------------------------------------

    @abc.abstractmethod
    def _setup(self) -> None:
        """Create the queue's directories."""

    @abc.abstractmethod
    def _message_ids(self) -> list[int]:
        """Numbers of every message with anything on disk."""

    @abc.abstractmethod
    def _store(self, mid: int, mail_from: str, params: dict[str, str], body: bytes,
               rcpts: list[Recipient]) -> None:
        """The commit: make the message and its entries visible."""

    @abc.abstractmethod
    def _entries(self) -> list[Entry]:
        """Every entry the files show, in (message, index) order."""

    @abc.abstractmethod
    def _set(self, e: Entry, state: str, schedule: Schedule) -> None:
        """Move ``e`` to ``state`` with ``schedule`` on disk."""

    @abc.abstractmethod
    def _release(self, e: Entry) -> None:
        """Cleanup of a CLEANUP entry: remove it (and the message with its last entry)."""

    @abc.abstractmethod
    def _load(self, mid: int) -> Stored:
        """Read a committed message."""

    @abc.abstractmethod
    def _recover(self) -> RecoveryReport:
        """What the peer does when it starts."""

    @abc.abstractmethod
    def _usage(self) -> Footprint:
        """Objects and bytes on disk."""

    # ---- plumbing --------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _guard(self, what: str, fn: Callable[[], T], handle: Handle | None = None) -> T:
        try:
            return fn()
        except OSError as e:
            raise StorageIOError(f"{what}: {e}",
                                 None if handle is None else self._give_back(handle)) from e

    def _find(self, entry_id: str) -> Entry | None:
        for e in self._entries():
            if e.id == entry_id:
                if e.state == QUEUED and entry_id in self._claimed:
                    return Entry(e.mid, e.index, INFLIGHT, e.schedule)
                return e
        return None

    def _listing(self, state: str) -> list[Entry]:
        self._check_open()
        with self._lock:
            out = []
            for e in self._guard("listing", self._entries):
                claimed = e.id in self._claimed
                if e.state == state and not (state == QUEUED and claimed):
                    out.append(e)
            return out

    def _move(self, h: Handle, src: str, dst: str, schedule: Schedule | None) -> Entry | None:
        def go() -> Entry | None:
            e = self._find(h.entry_id)
            if e is None or e.state != src:
                return None
            sched = schedule if schedule is not None else e.schedule
            if dst == INFLIGHT and not self.persists_inflight:
                self._claimed.add(e.id)
            elif src == INFLIGHT and not self.persists_inflight:
                if dst != QUEUED or sched != e.schedule:
                    self._set(e, dst, sched)
                self._claimed.discard(e.id)
            else:
                self._set(e, dst, sched)
            return Entry(e.mid, e.index, dst, sched)

        with self._lock:
            return self._guard(f"moving {h.entry_id} to {dst}", go, h)

    # ---- the Storage interface -------------------------------------------------------

    def list_queue(self) -> Iterator[QueuedMail]:
        return iter([self._issue(QueuedMail, e.id, str(e.mid), e.schedule)
                     for e in self._listing(QUEUED)])

    def find_inflight(self) -> Iterator[InflightMail]:
        self._check_open()
        return iter(())  # one process per queue: every owner of an inflight entry is alive

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        return iter([self._issue(PendingCleanupMail, e.id, str(e.mid), e.schedule)
                     for e in self._listing(CLEANUP)])

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        self._check_open()
        validate_address(mail_from, "mail_from", allow_empty=True)
        return BufferedEnqueuer(self._commit, mail_from, validate_params(params))

    def _commit(self, enq: BufferedEnqueuer, rcpts: list[Recipient]) -> list[QueuedMail]:
        with self._lock:
            self._check_open()
            mid = self._next
            self._next += 1
            self._guard("committing", lambda: self._store(mid, enq.mail_from, enq.params,
                                                          enq.body, rcpts))
        return [self._issue(QueuedMail, f"{mid}.{i}", str(mid), r.schedule)
                for i, r in enumerate(rcpts)]

    def read_inflight(self, mail: InflightMail) -> MailReader:
        h = self._peek(mail, InflightMail)
        with self._lock:
            e = self._guard("reading", lambda: self._find(h.entry_id))
            if e is None or e.state != INFLIGHT:
                raise ClosedError(f"entry {h.entry_id} is no longer inflight")
            m = self._guard("reading", lambda: self._load(e.mid))
        addr, zone = m.rcpts[e.index]
        meta = EntryMeta(str(e.mid), e.id, m.mail_from, addr, e.index, zone, m.params,
                         e.schedule, len(m.body))
        return BytesReader(meta, m.body)

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h, QUEUED, QUEUED, schedule)
        return None if e is None else self._issue(QueuedMail, h.entry_id, h.message_id,
                                                  schedule)

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h, QUEUED, INFLIGHT, None)
        return None if e is None else self._issue(InflightMail, h.entry_id, h.message_id,
                                                  e.schedule)

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        e = self._move(h, INFLIGHT, CLEANUP, None)
        return None if e is None else self._issue(PendingCleanupMail, h.entry_id,
                                                  h.message_id, e.schedule)

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        h = self._take(mail, InflightMail)
        e = self._move(h, INFLIGHT, QUEUED, schedule)
        return None if e is None else self._issue(QueuedMail, h.entry_id, h.message_id,
                                                  schedule)

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        e = self._move(h, QUEUED, CLEANUP, None)
        return None if e is None else self._issue(PendingCleanupMail, h.entry_id,
                                                  h.message_id, e.schedule)

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        h = self._take(mail, PendingCleanupMail)

        def go() -> bool:
            e = self._find(h.entry_id)
            if e is None or e.state != CLEANUP:
                return False
            self._release(e)
            return True

        with self._lock:
            return self._guard(f"cleaning up {h.entry_id}", go, h)

    def recover(self) -> RecoveryReport:
        self._check_open()
        with self._lock:
            return self._guard("recovering", self._recover)

    def footprint(self) -> Footprint:
        self._check_open()
        with self._lock:
            return self._guard("measuring", self._usage)



def write_file(io: IO, path: str, data: bytes, *, sync: bool) -> None:
    """Create (or replace) ``path`` with ``data``; fsync the file when ``sync``."""
    fd = io.open_create(path, exclusive=False)
    try:
        io.ftruncate(fd, 0)
        io.write(fd, data)
        if sync:
            io.fsync(fd)
    finally:
        io.close(fd)


def read_all(io: IO, path: str) -> bytes:
    """The whole file at ``path``, through the seam."""
    return read_file(io, path, limit=1 << 40)
