"""The Storage interface: a synchronous port of Kannader's ``Storage`` trait with typed handles.

A mail moves through typed handles, each transition consuming one and returning the next::

    enqueue(...).commit(rcpts) -> [QueuedMail]
    QueuedMail   --send_start-->  InflightMail     (None: another worker took it)
    QueuedMail   --reschedule-->  QueuedMail       (None: it is no longer queued)
    QueuedMail   --drop------->   PendingCleanupMail
    InflightMail --send_cancel->  QueuedMail       (with its new schedule, atomically)
    InflightMail --send_done--->  PendingCleanupMail
    PendingCleanupMail --cleanup-> True            (False: already cleaned up)

With ``Capability.HOLD`` (C14) an operator may set a queued entry aside::

    QueuedMail   --hold------->   HeldMail         (never claimed; schedule kept)
    HeldMail     --release---->   QueuedMail       (the schedule it had)
    HeldMail     --drop_held-->   PendingCleanupMail

``send_finish(done, cancel)`` makes the ``send_done`` and ``send_cancel`` transitions of
many entries (a delivery's outcomes) in one call and, where the backend can, one durable
step (C15): each entry moves as its own call would, and on return all are durable.

What every method guarantees (the clauses are in ``spec/CONTRACT.md``):

* **On success** the effect is durable: it survives a crash, power loss included (C1, C9).
* **On ``None``** nothing changed: the mail is no longer in the state the handle claims.
* **On ``StorageIOError``** the operation may or may not have taken effect on disk; after a
  restart the entry is in its old or its new state, never a mixture (C2, C5).  The error
  carries a live handle for the state the entry had before the call, so the caller can
  retry; a retried transition either completes or returns ``None``.
* **On ``CorruptionError``** the entry's bytes failed their checksum; it has been moved
  aside (quarantined) and will never be delivered altered (C6).
* **After a crash** inside any method, opening the queue again runs recovery, which
  leaves each entry in its state before or after the interrupted call (C10).
* A handle is used once.  Passing a consumed handle, one from another Storage, or one
  of the wrong type raises ``MisuseError`` and changes nothing.
"""

from __future__ import annotations

import abc
import enum
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from spec import MAX_REASON, Schedule
from spec.contract_errors import InvalidInputError, MisuseError, QueueError, ScheduleError

__all__ = [
    "MAX_ADDRESS",
    "MAX_REASON",
    "BufferedEnqueuer",
    "BytesReader",
    "Capability",
    "ClosedError",
    "CorruptionError",
    "DamagedStoreError",
    "Enqueuer",
    "EntryMeta",
    "Finished",
    "Footprint",
    "Handle",
    "HeldMail",
    "InflightMail",
    "InvalidInputError",
    "Limits",
    "MailReader",
    "MisuseError",
    "NoSpaceError",
    "PendingCleanupMail",
    "QueueError",
    "QueuedMail",
    "Recipient",
    "RecoveryReport",
    "ReopenRequiredError",
    "Schedule",
    "ScheduleError",
    "SetAside",
    "Storage",
    "StorageIOError",
    "UnsupportedError",
    "validate_address",
    "validate_schedule",
]

MAX_ADDRESS = 1024
MAX_PARAMS_BYTES = 64 * 1024
#: The largest schedule time and attempt count any backend must store (64-bit signed).
MAX_SCHEDULE = 2**63 - 1


# ---- errors, split by cause -----------------------------------------------------------
# QueueError, MisuseError, InvalidInputError and ScheduleError (a caller's mistakes) are
# the contract's own (spec/contract_errors.py): Schedule(-1) raises one.


class StorageIOError(QueueError):
    """The disk failed (EIO, ENOSPC, EACCES...).  Retry later with ``handle``.

    After it, the entry is in its old or its new state (never a mixture) and ``handle``
    is a live handle for the old state (``None`` for enqueue, which left no entry).
    """

    def __init__(self, message: str, handle: Handle | None = None) -> None:
        super().__init__(message)
        self.handle = handle
        #: From ``send_finish``: a live handle for the old state of every entry of the
        #: batch, in its order (``done``, then ``cancel``); each entry is in its old or its
        #: new state, so a retry with them moves it or returns None (C15).
        self.handles: tuple[Handle, ...] = ()
        #: From ``send_finish``, when some moves were made durable before the failure:
        #: their new handles (None for every other entry, which is old or new).
        self.finished: Finished | None = None


class NoSpaceError(StorageIOError):
    """The disk is full (ENOSPC or EDQUOT)."""


class DamagedStoreError(StorageIOError):
    """The store's own files are damaged (a checksum failed, a file it needs is missing
    or cut short) so that it cannot tell what it holds.  Retrying cannot help: opening
    refuses, leaves every file as it was, and the message names the repair (for the
    project's KV queue, ``queue-ref repair``, which salvages every intact message).  A
    damaged *message* is not this: it is quarantined and named (``CorruptionError``,
    ``RecoveryReport.lost``) while the rest of the queue is served.

    ``repair``, when the store has one, salvages this very store in place (the queue
    closed everywhere): it keeps the damaged files aside, returns the report of what it
    could not save (``RecoveryReport.lost``, ``lost_unknown``, ``damaged_files``), and
    leaves a store that opens and serves every intact message.  The certifier's
    ``damage-at-rest`` check runs it after each refusal and judges what it left."""

    def __init__(self, message: str, handle: Handle | None = None, *,
                 repair: Callable[[], RecoveryReport] | None = None) -> None:
        super().__init__(message, handle)
        self.repair = repair


class ReopenRequiredError(StorageIOError):
    """A sync of the store failed, now or earlier: the kernel may have dropped what it
    covered while its page cache still shows it ("fsyncgate"), so the store refuses every
    state change until it is closed and opened again (recovery then decides from the disk
    what survived).  Retrying on this Storage cannot succeed; what was acknowledged before
    the failed sync is not affected.  ``handle`` is live for the old state, as for any
    ``StorageIOError``, until the Storage is closed."""


class CorruptionError(QueueError):
    """Stored bytes failed their checksum; the entry was quarantined, never delivered."""

    def __init__(self, message: str, entry_id: str, quarantined_to: str | None) -> None:
        super().__init__(message)
        self.entry_id = entry_id
        self.quarantined_to = quarantined_to


class ClosedError(QueueError):
    """The Storage (or the Enqueuer, or the MailReader) was closed."""


class UnsupportedError(QueueError):
    """The backend does not declare the capability this call needs."""


# ---- values ---------------------------------------------------------------------------


class Capability(enum.Enum):
    ZONE_LISTING = "zone-listing"  # list_zone(zone) in oldest-first order
    DOMAIN_INDEX = "domain-index"  # list_domain(domain) without a full scan (ETRN)
    GROUP_COMMIT = "group-commit"  # concurrent producers share fsyncs
    STREAMING_BODIES = "streaming-bodies"  # bodies of any size in bounded memory
    MULTI_PROCESS = "multi-process"  # several processes may open one queue at once
    IO_SEAM = "io-seam"  # every disk call goes through a queue_ref.io.IO (crash-explorable)
    HOLD = "hold"  # hold/release/drop_held/list_held: the HELD state (C14)


@dataclass(frozen=True)
class Limits:
    """What one message may hold in a backend (``Storage.limits``); beyond it, ``commit``
    raises InvalidInputError before anything is stored.  None: no limit of its own.

    ``pool_files``: how many files of released storage one open queue may keep for reuse
    after its messages are cleaned up (C8: the filesystem queue's spare files); a drained
    queue holds no more than that beyond what it held with nothing queued.

    ``drains_full_disk``: whether delivering and cleaning up work while the disk is full
    (C9).  False for a store whose every change needs free space first (LevelDB's
    compactions write new tables before freeing the old ones): delivering then raises
    ``NoSpaceError``, loses nothing, and works again once space is freed."""

    max_recipients: int | None = None
    max_address: int = MAX_ADDRESS
    max_body_bytes: int | None = None
    pool_files: int = 0
    drains_full_disk: bool = True


@dataclass(frozen=True)
class Recipient:
    address: str
    schedule: Schedule
    zone: str = "default"


@dataclass(frozen=True)
class EntryMeta:
    """What ``read_inflight`` returns besides the body."""

    message_id: str
    entry_id: str
    mail_from: str
    rcpt: str
    rcpt_index: int
    zone: str
    params: Mapping[str, str]
    schedule: Schedule
    body_size: int
    #: When the message was committed (ns since the epoch; 0 where a backend keeps none).
    arrival_ns: int = 0


@dataclass(frozen=True)
class Footprint:
    """Stored objects and bytes.  After everything is cleaned up both are zero (C8)."""

    objects: int
    bytes: int


@dataclass(frozen=True)
class RecoveryReport:
    requeued: int = 0  # inflight entries of dead owners put back in the queue
    cleaned: int = 0  # interrupted cleanups finished
    uncommitted_removed: int = 0  # enqueues that never committed, removed
    orphans_removed: int = 0  # stray files, temp files, dangling links
    quarantined: int = 0  # entries whose bytes failed their checksum
    problems: tuple[str, ...] = ()
    #: Ids of the messages damage took out of the queue (bytes that failed their checksum,
    #: a missing file, a record of the store that could not be read), each explained in
    #: ``problems``.  Nothing acknowledged leaves the queue without its id here, or a
    #: count in ``lost_unknown``.
    lost: tuple[str, ...] = ()
    #: Damaged records whose message ids could not be read ("unknown ids, N records").
    lost_unknown: int = 0
    #: Files (relative to the queue's directory) moved aside because they are damaged;
    #: never deleted.
    damaged_files: tuple[str, ...] = ()

    @property
    def damage_found(self) -> bool:
        """Whether recovery met damage (anything lost or kept aside)."""
        return bool(self.lost or self.lost_unknown or self.damaged_files)


def validate_address(value: object, what: str, *, allow_empty: bool = False) -> str:
    """An address is a str of at most MAX_ADDRESS chars with no NUL, CR or LF."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidInputError(f"{what} must not be empty")
    if len(value) > MAX_ADDRESS:
        raise InvalidInputError(f"{what} is longer than {MAX_ADDRESS} characters")
    if "\x00" in value or "\r" in value or "\n" in value:
        bad = next(c for c in value if c in "\x00\r\n")
        raise InvalidInputError(f"{what} contains the forbidden character {bad!r}")
    return value


def validate_params(params: object) -> dict[str, str]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInputError("params must be a mapping of str to str")
    out: dict[str, str] = {}
    size = 0
    for k, v in params.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidInputError("params must map str to str")
        if "\x00" in k or "\x00" in v:
            raise InvalidInputError("params must not contain NUL")
        size += len(k) + len(v)
        out[k] = v
    if size > MAX_PARAMS_BYTES:
        raise InvalidInputError(f"params are larger than {MAX_PARAMS_BYTES} characters")
    return out


def validate_schedule(value: object, what: str = "schedule") -> Schedule:
    """A Schedule whose time and attempt count are ints in 0..MAX_SCHEDULE and whose
    reason is a str of at most MAX_REASON octets of UTF-8 (a Schedule forged past its own
    checks, with a negative, float or NaN field, is refused too)."""
    if not isinstance(value, Schedule):
        raise InvalidInputError(f"{what} must be a Schedule, got {type(value).__name__}")
    for name in ("at", "attempts"):
        v = getattr(value, name, None)
        if type(v) is not int or not 0 <= v <= MAX_SCHEDULE:
            raise InvalidInputError(f"{what}: {name} must be an int from 0 to {MAX_SCHEDULE}, "
                                    f"got {v!r}")
    reason = getattr(value, "reason", None)
    if type(reason) is not str:
        raise InvalidInputError(f"{what}: reason must be a str, got {type(reason).__name__}")
    try:
        size = len(reason.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"{what}: reason is not encodable as UTF-8: {e}") from None
    if size > MAX_REASON:
        raise InvalidInputError(f"{what}: reason is {size} octets of UTF-8, more than "
                                f"{MAX_REASON}")
    return value


def validate_recipients(rcpts: object) -> list[Recipient]:
    if isinstance(rcpts, (str, bytes)) or not isinstance(rcpts, Sequence):
        raise InvalidInputError("recipients must be a sequence of Recipient")
    if not rcpts:
        raise InvalidInputError("a message needs at least one recipient")
    out = []
    for i, r in enumerate(rcpts):
        if not isinstance(r, Recipient):
            raise InvalidInputError(f"recipient {i} is not a Recipient")
        validate_address(r.address, f"recipient {i}")
        validate_address(r.zone, f"zone of recipient {i}")
        validate_schedule(r.schedule, f"schedule of recipient {i}")
        out.append(r)
    return out


# ---- handles --------------------------------------------------------------------------


@dataclass(eq=False)
class Handle:
    """A claim on one entry in one state.  Used once; see the module docstring."""

    entry_id: str
    message_id: str
    schedule: Schedule
    _owner: object = field(repr=False, compare=False)
    _live: bool = field(default=True, repr=False, compare=False)
    _extra: object = field(default=None, repr=False, compare=False)  # backend-private


@dataclass(eq=False)
class QueuedMail(Handle):
    pass


@dataclass(eq=False)
class HeldMail(Handle):
    pass


@dataclass(eq=False)
class InflightMail(Handle):
    pass


@dataclass(eq=False)
class PendingCleanupMail(Handle):
    pass


H = TypeVar("H", bound=Handle)


@dataclass(frozen=True)
class Finished:
    """What ``send_finish`` returns: each entry's result, as its own call would return it,
    in the order given (None: the entry was no longer INFLIGHT, and nothing changed)."""

    done: list[PendingCleanupMail | None]
    cancelled: list[QueuedMail | None]


# ---- streams --------------------------------------------------------------------------


class Enqueuer(abc.ABC):
    """Receives one message's body in pieces, then commits it with its recipients.

    Nothing of the message is visible to any lister until ``commit`` returns; after a
    crash before that, recovery removes every trace of it (C2).  Used as a context
    manager, leaving the block without commit aborts.
    """

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        """Append body bytes.  Raises StorageIOError (the enqueue must then be aborted)."""

    @abc.abstractmethod
    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        """Make the message durable and queued, one entry per recipient, in order.

        On success every entry survives any crash (C1).  On StorageIOError nothing is
        queued after a restart or everything is (never part); the Enqueuer is closed.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the uncommitted message.  Idempotent."""

    @property
    def message_id(self) -> str | None:
        """The id ``commit`` will give the message, where the backend fixes it before
        commit (the filesystem and KV queues), so that the message can name it (a
        ``Received:`` header's ``id``); None where it is known only at commit.  Asking
        may take an id (and raise StorageIOError as ``write`` does); an id taken by an
        enqueue that is aborted is never given to another message."""
        return None

    def __enter__(self) -> Enqueuer:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if et is None or issubclass(et, Exception):
            self.abort()


class MailReader(abc.ABC):
    """The metadata and streamed body of an inflight entry.

    The body's checksum is verified as it is read; a mismatch raises CorruptionError at
    the latest when the end is reached, before the last byte is handed out, so a sender
    that finishes the SMTP DATA only at end of stream never delivers altered mail.
    """

    meta: EntryMeta

    @abc.abstractmethod
    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all remaining if -1); b"" at the end."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the file; idempotent."""

    def __iter__(self) -> Iterator[bytes]:
        while True:
            b = self.read(65536)
            if not b:
                return
            yield b

    def read_all(self) -> bytes:
        return b"".join(self)

    def __enter__(self) -> MailReader:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BufferedEnqueuer(Enqueuer):
    """An Enqueuer that keeps the body in memory and hands itself to ``on_commit``.

    For backends that store a body in one piece (small bodies only: it does not declare
    Capability.STREAMING_BODIES).  ``on_commit(enqueuer, checked_rcpts)`` reads
    ``mail_from``, ``params`` and ``body``.  An InvalidInputError from commit leaves the
    Enqueuer usable; after commit or abort every call raises ClosedError.
    """

    def __init__(
        self,
        on_commit: Callable[[BufferedEnqueuer, list[Recipient]], list[QueuedMail]],
        mail_from: str,
        params: dict[str, str],
    ) -> None:
        self._on_commit = on_commit
        self.mail_from = mail_from
        self.params = params
        self._chunks: list[bytes] = []
        self._done = False

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)

    def write(self, data: bytes) -> None:
        if self._done:
            raise ClosedError("this Enqueuer was committed or aborted")
        self._chunks.append(bytes(data))

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        if self._done:
            raise ClosedError("this Enqueuer was committed or aborted")
        checked = validate_recipients(rcpts)
        self._done = True
        return self._on_commit(self, checked)

    def abort(self) -> None:
        self._done = True
        self._chunks = []


class BytesReader(MailReader):
    """A MailReader over a body already in memory (and already verified)."""

    def __init__(self, meta: EntryMeta, body: bytes) -> None:
        self.meta = meta
        self._body = body
        self._pos = 0
        self._closed = False

    def read(self, n: int = -1) -> bytes:
        if self._closed:
            raise ClosedError("this MailReader is closed")
        end = len(self._body) if n < 0 else min(len(self._body), self._pos + n)
        out = self._body[self._pos:end]
        self._pos = end
        return out

    def close(self) -> None:
        self._closed = True


# ---- the interface --------------------------------------------------------------------


_owner_ids = itertools.count()


@dataclass(frozen=True)
class SetAside:
    """An entry a call found damaged and quarantined without raising (``set_aside``)."""

    entry_id: str
    message_id: str
    reason: str


class Storage(abc.ABC):
    """A durable mail queue.  See the module docstring for what holds after failures."""

    capabilities: frozenset[Capability] = frozenset()
    #: The report of the recovery that ran when the queue was opened (None if none ran).
    #: Damage at rest is named here (``lost``, ``lost_unknown``): C6.
    last_recovery: RecoveryReport | None = None

    @property
    def limits(self) -> Limits:
        """What one message may hold here (recipients, address and body sizes)."""
        return Limits()

    def __init__(self) -> None:
        self._token = object()
        self._closed = False
        self._handle_lock = threading.Lock()
        self._set_aside: list[SetAside] = []

    def set_aside(self) -> list[SetAside]:
        """What calls of this Storage quarantined without raising since the last call of
        this one (a listing skips an entry it finds damaged and sets it aside, C6): for
        the caller to say, so that no damage passes in silence (the relay logs each, an
        operator command prints each).  Emptied as it is read; any thread."""
        with self._handle_lock:
            got, self._set_aside = self._set_aside, []
        return got

    def _note_set_aside(self, entry_id: str, message_id: str, reason: str) -> None:
        """For backends: a damaged entry (or message) was quarantined and skipped."""
        with self._handle_lock:
            self._set_aside.append(SetAside(entry_id, message_id, reason))

    # -- listing (recovery and scheduling) --

    @abc.abstractmethod
    def list_queue(self) -> Iterator[QueuedMail]:
        """Every QUEUED entry, each once.  Corrupt entries are quarantined and skipped."""

    @abc.abstractmethod
    def find_inflight(self) -> Iterator[InflightMail]:
        """INFLIGHT entries whose owner died, adopted by this Storage.

        Opening a queue already requeues those of owners that were dead then; this finds
        the ones whose owner died since (another process of a shared queue).
        """

    @abc.abstractmethod
    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        """Every PENDING_CLEANUP entry not being cleaned up by a live owner."""

    def list_zone(self, zone: str) -> Iterator[QueuedMail]:
        """QUEUED entries of one zone, oldest message first (Capability.ZONE_LISTING)."""
        raise UnsupportedError(f"{type(self).__name__} does not support zone listing")

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        """QUEUED entries whose recipient is at ``domain`` (Capability.DOMAIN_INDEX)."""
        raise UnsupportedError(f"{type(self).__name__} does not support a domain index")

    def list_held(self) -> Iterator[HeldMail]:
        """Every HELD entry, each once (Capability.HOLD)."""
        raise UnsupportedError(f"{type(self).__name__} does not support holding mail")

    def scan_queue(self) -> Iterator[QueuedMail | HeldMail]:
        """Every QUEUED and HELD entry, each once, in the order the backend finds them
        cheapest: for operators' listings (``mailq``, ``qshape``), whose first line should
        not wait for the whole queue to be read.  The default is ``list_queue``, then
        ``list_held`` where the backend holds mail; a backend whose ordered listing must
        read every name first (the filesystem queue) lists in its directory order
        instead.  A backend should give a message's entries together whatever their
        state and zone (the filesystem and KV queues do), so that ``mailq`` shows it
        once.  An entry that changes state while the scan runs may be given in either
        state, in both, or left out, and so may the other entries of its message (C13)."""
        yield from self.list_queue()
        if Capability.HOLD in self.capabilities:
            yield from self.list_held()

    def inflight_entries(self) -> Iterator[EntryMeta]:
        """Every INFLIGHT entry now, whichever sender holds it (a live one included), as
        its metadata: for operators' tools (``mailq`` marks them ``*``).  No handle, so
        nothing can take an entry from its sender; an entry that moves meanwhile may be
        left out.  UnsupportedError where a backend cannot list them."""
        raise UnsupportedError(f"{type(self).__name__} cannot list entries in delivery")

    # -- writing and reading mail --

    @abc.abstractmethod
    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        """Start a new message.  ``mail_from`` may be "" (the null sender of bounces)."""

    @abc.abstractmethod
    def read_inflight(self, mail: InflightMail) -> MailReader:
        """Open the metadata and body of an entry this Storage holds inflight.

        Does not consume the handle.  Raises CorruptionError (entry quarantined) when the
        metadata fails its checksum now, or the body does while it is read.
        """

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        """The metadata and body of a QUEUED or HELD entry, without claiming it (for
        operators' tools: ``mailq``, ``show``).  Does not consume the handle; None when the
        entry is no longer in the handle's state.  Raises CorruptionError (quarantined)
        like ``read_inflight``.  The entry may be claimed, held or dropped meanwhile: what
        is read is its state when the call was made (C13)."""
        raise UnsupportedError(f"{type(self).__name__} cannot inspect queued entries")

    # -- state changes: each consumes its handle --

    @abc.abstractmethod
    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        """Give a QUEUED entry a new schedule, atomically (C5).  ``schedule.reason``
        replaces the reason stored with the old one (pass the old reason to keep it)."""

    @abc.abstractmethod
    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        """Claim a QUEUED entry.  At most one claim succeeds, across processes (C7)."""

    @abc.abstractmethod
    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        """The entry was delivered or bounced; it is never sent again (C3)."""

    @abc.abstractmethod
    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        """Put an INFLIGHT entry back in the queue with its new schedule, atomically.
        ``schedule.reason`` is why the attempt failed; it is stored with the schedule in
        the same durable step (C5) and every listing hands it back in ``handle.schedule``."""

    def send_finish(self, done: Sequence[InflightMail] = (),
                    cancel: Sequence[tuple[InflightMail, Schedule]] = ()) -> Finished:
        """``send_done`` of every entry of ``done`` and ``send_cancel`` of every pair of
        ``cancel``, in one call (C15): the relay's outcomes of one delivery.

        Each entry moves exactly as its own call would (None where it was no longer
        INFLIGHT), and when the call returns every move is durable.  A backend may make
        them in one durable step (one sync for all); this default makes the calls one by
        one.  After a crash inside it, each entry is in its old or its new state, each on
        its own.  Every handle and schedule is checked before anything changes: a
        misused handle (or one entry twice) raises ``MisuseError``, a bad schedule
        ``InvalidInputError``, and nothing moves.  On ``StorageIOError`` its ``handles`` are
        live handles for the old state of every entry of the batch (``handle`` is None):
        retrying with them completes each move or returns None; its ``finished``, when
        not None, holds the new handle of every entry whose move was made durable before
        the failure (a retry through its old handle would answer None).  An entry found corrupt is
        quarantined (as its own call would) and answers None, and the others move."""
        dones, cancels = self._take_batch(done, cancel)
        for h in (*dones, *(h for h, _ in cancels)):
            self._give_back(h)  # each call below takes its own
        got_done: list[PendingCleanupMail | None] = []
        got_cancel: list[QueuedMail | None] = []
        try:
            for h in dones:
                got_done.append(_or_none(self.send_done, h))
            for h, s in cancels:
                got_cancel.append(_or_none(self.send_cancel, h, s))
        except StorageIOError as e:
            err = self._batch_failed(e, dones, cancels)
            if any(got_done) or any(got_cancel):  # those calls returned: durable
                err.finished = Finished(
                    got_done + [None] * (len(dones) - len(got_done)),
                    got_cancel + [None] * (len(cancels) - len(got_cancel)))
            raise err from None
        return Finished(got_done, got_cancel)

    @abc.abstractmethod
    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        """Remove a QUEUED entry without sending it; it is never sent (C3)."""

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        """Set a QUEUED entry aside: never claimed until released; its schedule is kept.
        Atomic and durable like every transition (C14; Capability.HOLD)."""
        raise UnsupportedError(f"{type(self).__name__} does not support holding mail")

    def release(self, mail: HeldMail) -> QueuedMail | None:
        """Put a HELD entry back in the queue with the schedule it had (C14)."""
        raise UnsupportedError(f"{type(self).__name__} does not support holding mail")

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        """Remove a HELD entry without sending it; it is never sent (C3, C14)."""
        raise UnsupportedError(f"{type(self).__name__} does not support holding mail")

    @abc.abstractmethod
    def cleanup(self, mail: PendingCleanupMail) -> bool:
        """Release the entry's bytes, and the message's when it was the last (C8)."""

    def cleanup_all(self, mails: Sequence[PendingCleanupMail]) -> list[bool]:
        """``cleanup`` of every entry of ``mails``, in one call (C16): the relay's
        delivered entries of one message released together.

        Each entry is released exactly as its own call would release it, and its result
        (in the order given) is what that call returns.  Every handle is checked before
        anything is released: a misused handle, or one entry twice, raises
        ``MisuseError`` and nothing changes.  After a crash inside it, each entry is
        PENDING_CLEANUP or GONE, each on its own (recovery finishes it: rule 5).  On
        ``StorageIOError`` its ``handles`` are live handles of every entry of the batch
        that may not be released (``handle`` is None): a retry with one releases it, or
        answers False where it was released meanwhile.  This default makes the calls one
        by one; a backend may release a message's entries together (the filesystem
        queue looks at the message file's link count for a message's last entry of the
        batch alone, not twice for each entry)."""
        handles = self._take_all(mails, PendingCleanupMail, "cleanup_all")
        for h in handles:
            self._give_back(h)  # each call below takes its own
        released: list[bool] = []
        try:
            for h in handles:
                released.append(self.cleanup(h))
        except StorageIOError as e:
            e.handle = None
            e.handles = tuple(self._give_back(h) for h in handles[len(released):])
            raise
        return released

    # -- lifecycle --

    @abc.abstractmethod
    def recover(self) -> RecoveryReport:
        """Bring the queue to a state of the contract after a crash.  Idempotent (C10).

        Requeues entries inflight with dead owners, finishes interrupted cleanups,
        removes uncommitted enqueues and stray files, quarantines corrupt entries.
        Backends run it when opened.
        """

    @abc.abstractmethod
    def footprint(self) -> Footprint:
        """Objects and bytes stored for messages (for the no-leak check, C8)."""

    def close(self) -> None:
        """Release files and locks.  Further calls raise ClosedError.  Idempotent."""
        self._closed = True

    def __enter__(self) -> Storage:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- helpers for implementations --

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    def _issue(
        self, cls: type[H], entry_id: str, message_id: str, schedule: Schedule,
        extra: object = None,
    ) -> H:
        """A new live handle owned by this Storage."""
        return cls(entry_id, message_id, schedule, self._token, True, extra)

    def _take(self, handle: object, cls: type[H]) -> H:
        """Check a handle passed in and consume it.  Raises MisuseError or ClosedError."""
        self._check_open()
        if not isinstance(handle, cls) or type(handle) is not cls:
            raise MisuseError(
                f"expected a {cls.__name__}, got {type(handle).__name__}")
        if handle._owner is not self._token:
            raise MisuseError("this handle belongs to another Storage")
        with self._handle_lock:
            if not handle._live:
                raise MisuseError(
                    f"this {cls.__name__} for entry {handle.entry_id} was used already")
            handle._live = False
        return handle

    def _peek(self, handle: object, cls: type[H]) -> H:
        """Check a handle passed in without consuming it."""
        self._check_open()
        if not isinstance(handle, cls) or type(handle) is not cls:
            raise MisuseError(f"expected a {cls.__name__}, got {type(handle).__name__}")
        if handle._owner is not self._token:
            raise MisuseError("this handle belongs to another Storage")
        if not handle._live:
            raise MisuseError(f"this {cls.__name__} for entry {handle.entry_id} was used already")
        return handle

    def _take_batch(self, done: Sequence[InflightMail],
                    cancel: Sequence[tuple[InflightMail, Schedule]]
                    ) -> tuple[list[InflightMail], list[tuple[InflightMail, Schedule]]]:
        """Check every handle and schedule of a ``send_finish``, then consume all the
        handles at once; on any misuse nothing is consumed (C11)."""
        dones = [self._peek(h, InflightMail) for h in done]
        cancels = []
        for pair in cancel:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise MisuseError("cancel takes (InflightMail, Schedule) pairs")
            cancels.append((self._peek(pair[0], InflightMail), validate_schedule(pair[1])))
        self._consume_all([*dones, *(h for h, _ in cancels)], "send_finish")
        return dones, cancels

    def _take_all(self, handles: Sequence[object], cls: type[H], what: str) -> list[H]:
        """Check every handle of a batch call, then consume them all at once; on any
        misuse nothing is consumed (C11)."""
        if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence):
            raise MisuseError(f"{what} takes a sequence of {cls.__name__}")
        every = [self._peek(h, cls) for h in handles]
        self._consume_all(every, what)
        return every

    def _consume_all(self, every: Sequence[Handle], what: str) -> None:
        if len({id(h) for h in every}) != len(every) or \
                len({h.entry_id for h in every}) != len(every):
            raise MisuseError(f"{what} names one entry more than once")
        with self._handle_lock:
            if not all(h._live for h in every):
                raise MisuseError("a handle of this batch was used already")
            for h in every:
                h._live = False

    def _batch_failed(self, e: StorageIOError, dones: Sequence[InflightMail],
                      cancels: Sequence[tuple[InflightMail, Schedule]]) -> StorageIOError:
        """``e``, handing back a live handle for the old state of every entry of the
        batch (each entry is in its old or its new state)."""
        e.handle = None
        e.handles = tuple(self._give_back(h) for h in (*dones, *(h for h, _ in cancels)))
        return e

    def _give_back(self, handle: H) -> H:
        """Re-arm a consumed handle, to hand back with a StorageIOError."""
        handle._live = True
        return handle


R = TypeVar("R")


def _or_none(call: Callable[..., R], *args: object) -> R | None:
    """One call of a batch: a corrupt entry (quarantined by the call) answers None."""
    try:
        return call(*args)
    except CorruptionError:
        return None
