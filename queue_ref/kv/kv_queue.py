"""The KV mail queue: the Storage interface over seed 000's key layout.

The layout is in ``queue_ref.kv.keys``, the records in ``queue_ref.kv.kv_records``, what is
synced and why in ``queue_ref.kv.core``.  Each state change is one atomic write batch:

=============  ===============================================================  ======
operation      batch                                                            synced
=============  ===============================================================  ======
commit         chunks left, ``#``, ``*``, live count, zone and domain keys      yes
send_start     zone and domain keys -> ``inflight <id> <idx>``                  no
reschedule     zone key rewritten with the new schedule                         yes
send_cancel    ``inflight`` -> zone and domain keys, new schedule               yes
send_done      ``inflight`` -> ``cleanup <id> <idx>``                           yes
drop           zone and domain keys -> ``cleanup``                              yes
cleanup        ``cleanup`` deleted; live count - 1, or every message key        no
=============  ===============================================================  ======

One process owns a KV database at a time (the engines lock it), so claims are
exclusive through in-process locks, and an INFLIGHT entry found when the queue is
opened has no live owner: recovery puts it back in the queue.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import TypeVar

from queue_ref.io import IO, OsIO, first_of
from queue_ref.kv import atrest, keys, kv_records, lostids, salvage
from queue_ref.kv import claims as cl
from queue_ref.kv.base import KV, WriteBatch
from queue_ref.kv.claims import Held
from queue_ref.kv.core import Core, io_error
from queue_ref.kv.engine_errors import DatabaseCorruptError
from queue_ref.kv.kv_records import BadRecord, EntryRec, Stored
from queue_ref.kv.reserve import NAME as RESERVE_NAME
from queue_ref.kv.reserve import Reserve, default_size, free_bytes
from queue_ref.kv.streams import KvEnqueuer, KvReader
from queue_ref.storage import (
    Capability,
    ClosedError,
    CorruptionError,
    DamagedStoreError,
    Enqueuer,
    EntryMeta,
    Finished,
    Footprint,
    Handle,
    HeldMail,
    InflightMail,
    InvalidInputError,
    Limits,
    MailReader,
    MisuseError,
    NoSpaceError,
    PendingCleanupMail,
    QueuedMail,
    RecoveryReport,
    Schedule,
    Storage,
    StorageIOError,
    validate_address,
    validate_params,
    validate_schedule,
)

H = TypeVar("H", bound=Handle)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

_CAPS = frozenset({Capability.ZONE_LISTING, Capability.DOMAIN_INDEX,
                   Capability.GROUP_COMMIT, Capability.STREAMING_BODIES, Capability.HOLD})


def _is_log_engine(kv: KV) -> bool:
    try:
        from queue_ref.kv.logengine import LogEngine
    except ImportError:
        return False
    return isinstance(kv, LogEngine)


def _check_path(path: object) -> None:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidInputError(f"path must be a non-empty str without NUL, got {path!r}")


#: Seconds between the counts of what it holds a queue short of headroom makes, to
#: decide whether a compaction would give room back (_check_headroom).
COMPACT_EVERY = 10.0

class KvQueue(Storage):
    """A durable mail queue over an ordered KV engine (which it owns and closes).

    ``recover=True`` runs ``recover()`` when opened.  ``sync_all=True`` syncs every batch,
    for engines that do not keep unsynced batches in log order (see ``core``).  ``owner``
    (default ``pid <n>``) is written into inflight records for operators; ``clock`` (ns)
    stamps creation times (pass a fixed one for byte-identical replays).  After
    any failure the guarantees of ``queue_ref.storage`` hold; when a synced write fails
    the engine refuses writes until the queue is reopened.
    """

    def __init__(self, kv: KV, *, recover: bool = True, sync_all: bool = False,
                 owner: str | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        super().__init__()
        caps = set(_CAPS)
        if _is_log_engine(kv):
            caps.add(Capability.IO_SEAM)
        self.capabilities = frozenset(caps)
        self._kv = kv
        self._at: tuple[IO, str] | None = None  # see close()
        self._reserve: Reserve | None = None  # see reserve.py
        #: The reserve is spent: the disk filled, and the queue is being drained
        #: (``_make_room``); the free space after the engine last reclaimed room.
        self._draining = False
        self._room_after = 1 << 62
        self._cleanups = 0  # entries cleaned up since the open
        #: _check_headroom's last count of what the queue holds: when (time.monotonic()),
        #: the cleanups made by then, the keys counted
        self._measured = (-COMPACT_EVERY, 0, 0)
        try:
            self._core = Core(kv, sync_all=sync_all, clock=clock,
                              owner=owner if owner is not None else f"pid {os.getpid()}")
            self.last_recovery = self.recover() if recover else RecoveryReport()
        except OSError as e:
            raise io_error("opening the queue", e, None) from e

    @classmethod
    def open_log(cls, path: str, io: IO | None = None, *, recover: bool = True,
                 sync_all: bool = False, clock: Callable[[], int] = time.time_ns,
                 reserve: int | None = None,
                 engine: Callable[[str, IO | None], KV] | None = None) -> KvQueue:
        """A queue over the log-structured engine at ``path`` (every byte through ``io``).

        ``reserve``: bytes of disk kept free for draining a full disk (``reserve.py``);
        None: 1/16 of the file system (64 KiB to 8 MiB) when ``io`` is None, else none.
        ``engine(path, io)``: the engine to open instead of ``LogEngine`` (a subclass)."""
        from queue_ref.kv.logengine import LogEngine
        make = engine or (lambda p, i: LogEngine(p, io=i))
        return cls._open(lambda: make(path, io), recover=recover, sync_all=sync_all,
                         clock=clock, at=(io or OsIO(), path, "kv-log"),
                         reserve=reserve if reserve is not None else (-1 if io is None else 0))

    @classmethod
    def open_leveldb(cls, path: str, *, recover: bool = True, sync_all: bool = True,
                     clock: Callable[[], int] = time.time_ns,
                     reserve: int | None = None) -> KvQueue:
        """A queue over real LevelDB (plyvel) at ``path``.

        Every batch is synced by default: LevelDB does not fsync a log file when it
        switches to a new one, so an unsynced batch (a body chunk) could be lost by a
        power cut while a later synced batch (the commit that points at it) survives.

        LevelDB writes its memtable to a table when it opens, so its memtable is sized to
        the file system (1/32 of it, 256 KiB to LevelDB's 4 MiB) and the disk reserve
        holds twice that (``reserve.leveldb_sizes``; ``reserve=0`` keeps none).
        """
        from queue_ref.kv.leveldb import LevelDBEngine
        from queue_ref.kv.reserve import leveldb_sizes

        _check_path(path)
        buffer, auto = leveldb_sizes(path)
        return cls._open(lambda: LevelDBEngine(path, write_buffer_size=buffer), recover=recover,
                         sync_all=sync_all, clock=clock, at=(OsIO(), path, "kv-leveldb"),
                         reserve=auto if reserve is None else reserve)

    @staticmethod
    def _release_reserve_for_recovery(path: str, reserve: int) -> None:
        """Before opening on a full disk (another file filled it), remove the reserve:
        recovery needs the room to write."""
        if os.path.exists(os.path.join(path, RESERVE_NAME)):
            size = reserve if reserve > 0 else default_size(path)
            if free_bytes(path) < size:
                Reserve(path, size).release()

    @classmethod
    def _open(cls, make: Callable[[], KV], *, recover: bool, sync_all: bool,
              clock: Callable[[], int], at: tuple[IO, str, str], reserve: int) -> KvQueue:
        """Open the engine ``make`` gives, in directory ``at[1]`` (through ``at[0]``, for
        the record of a clean close: ``atrest.py``; ``at[2]`` is the backend's name), with
        a reserve of ``reserve`` bytes (-1: the default size; 0: none)."""
        io, path, backend = at
        _check_path(path)
        if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < -1:
            raise InvalidInputError(f"reserve must be a size in bytes, got {reserve!r}")
        if reserve:
            cls._release_reserve_for_recovery(path, reserve)
        try:
            rest, problems, kept = atrest.take(io, path)
        except OSError as e:
            raise io_error("opening the queue: checking it at rest", e, None) from e
        try:
            kv = make()
        except DatabaseCorruptError as e:
            raise cls._repairable(io_error("opening the KV engine", e.with_repair(path, backend),
                                           None), io, path, backend) from e
        except OSError as e:
            raise io_error("opening the KV engine", e, None) from e
        try:
            q = cls(kv, recover=recover, sync_all=sync_all, clock=clock)
            q._at = (io, path)
            if reserve:
                q._reserve = Reserve(path, reserve if reserve > 0 else default_size(path))
                with contextlib.suppress(OSError):
                    q._reserve.ensure()
                q._draining = not q._reserve.held
            try:
                q.last_recovery = lostids.merge(
                    q.last_recovery or RecoveryReport(), kv, path,
                    list(getattr(kv, "damage", [])), rest, problems, kept)
                if rest is not None:
                    q._finish_resurrected(atrest.resurrected(rest, atrest.entries_of(kv)))
                atrest.forget(io, path)
            except OSError as e:
                raise io_error("opening the queue: reporting damage", e, None) from e
            return q
        except StorageIOError as e:
            kv.close()
            cause = e.__cause__
            if isinstance(cause, DatabaseCorruptError):
                raise cls._repairable(io_error("opening the queue",
                                               cause.with_repair(path, backend), None),
                                      io, path, backend) from cause
            raise
        except BaseException:
            kv.close()
            raise

    @classmethod
    def _repairable(cls, error: StorageIOError, io: IO, path: str,
                    backend: str) -> StorageIOError:
        """``error`` carrying the repair its message names (``DamagedStoreError.repair``):
        ``queue-ref repair`` of this store, which returns what it could not save."""
        if isinstance(error, DamagedStoreError) and error.repair is None:
            def repair() -> RecoveryReport:
                done = (cls.repair_leveldb(path) if backend == "kv-leveldb"
                        else cls.repair_log(path, io))
                return done.report

            error.repair = repair
        return error

    @classmethod
    def repair_log(cls, path: str, io: IO | None = None) -> salvage.Repaired:
        """``queue-ref repair`` of a log-engine store (``salvage.repair_log``), the queue
        opened over the salvaged store with ``open_log``."""
        seam = io if io is not None else OsIO()
        return salvage.repair_log(path, seam, lambda: cls.open_log(path, seam))

    @classmethod
    def repair_leveldb(cls, path: str) -> salvage.Repaired:
        """``queue-ref repair`` of a LevelDB store (``salvage.repair_leveldb``)."""
        return salvage.repair_leveldb(path, lambda: cls.open_leveldb(path))

    @property
    def kv(self) -> KV:
        return self._kv

    # ---- helpers --------------------------------------------------------------------

    def _io(self, what: str, handle: Handle | None = None) -> _IoGuard:
        """Turns an OSError in its block into StorageIOError (re-arming ``handle``)."""
        return _IoGuard(self, what, handle)

    def _locate(self, h: Handle) -> tuple[int, int, Stored]:
        ref = h._extra
        if not isinstance(ref, Stored):
            raise MisuseError(f"handle of entry {h.entry_id} was not issued by a KvQueue")
        return ref.rec.mid, ref.rec.idx, ref

    def _entry_op(self, h: Handle, what: str, mid: int, idx: int, *more: str) -> _IoGuard:
        """Holds the entry's claim (and ``more``) and maps OSError, around one operation."""
        return _IoGuard(self, what, h, self._core.claims.hold(
            excl=(cl.entry(mid, idx), *more), shared=(cl.EVERYTHING, cl.message(mid))))

    @staticmethod
    def _schedule(schedule: object) -> Schedule:
        return validate_schedule(schedule)

    @property
    def limits(self) -> Limits:
        """Recipients per message: what the keys' index field holds; whether the engine
        drains a full disk (LevelDB does not)."""
        return Limits(max_recipients=keys.MAX_RCPTS + 1,
                      drains_full_disk=self._kv.drains_full_disk)

    # ---- listing --------------------------------------------------------------------

    def _queued(self, start: bytes, stop: bytes) -> Iterator[QueuedMail]:
        with self._io("listing the queue"):
            for key, raw in self._kv.iterate(start, stop):
                ref = self._listed(key, raw, kv_records.QUEUED)
                if ref is not None:
                    rec = ref.rec
                    yield self._issue(QueuedMail, keys.entry_id(rec.mid, rec.idx),
                                      str(rec.mid), rec.schedule, ref)

    def _listed(self, key: bytes, raw: bytes, state: str) -> Stored | None:
        """Decode a listed record; quarantine it (None) if it fails."""
        try:
            if state == kv_records.QUEUED:
                zone, mid, idx = keys.parse_indexed(key)
            else:
                mid, idx = keys.parse_entry(key)
                zone = None
        except keys.BadKey:
            return None  # not an entry key; recovery deals with it
        try:
            rec = EntryRec.decode(raw, mid, idx, state)
            if zone is None or rec.zone == zone:
                return Stored(raw, rec)
        except BadRecord:
            pass
        with self._core.claims.hold(excl=[cl.entry(mid, idx), cl.count(mid)],
                                    shared=[cl.EVERYTHING, cl.message(mid)]):
            now = self._kv.get(key)
            if now == raw:
                self._core.quarantine_entry(key, raw, mid, idx)
                self._note_set_aside(keys.entry_id(mid, idx), str(mid),
                                     f"its {state} record is damaged (quarantined)")
        return None

    def list_queue(self) -> Iterator[QueuedMail]:
        self._check_open()
        return self._queued(keys.ZONE, keys.end_of(keys.ZONE))

    def list_zone(self, zone: str) -> Iterator[QueuedMail]:
        self._check_open()
        validate_address(zone, "zone")
        p = keys.zone_prefix(zone)
        return self._queued(p, keys.end_of(p))

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        self._check_open()
        validate_address(domain, "domain", allow_empty=True)
        return self._by_domain(domain.lower())

    def _by_domain(self, domain: str) -> Iterator[QueuedMail]:
        p = keys.domain_prefix(domain)
        with self._io("listing a domain"):
            for key, raw in self._kv.iterate(p, keys.end_of(p)):
                try:
                    _, mid, idx = keys.parse_indexed(key)
                    zone = kv_records.decode_domain(raw, mid, idx)
                except (keys.BadKey, BadRecord):
                    continue  # derived data: recovery rebuilds it
                zkey = keys.zone(zone, mid, idx)
                zraw = self._kv.get(zkey)
                if zraw is None:
                    continue  # no longer queued
                ref = self._listed(zkey, zraw, kv_records.QUEUED)
                if ref is not None and keys.domain_of(ref.rec.address) == domain:
                    yield self._issue(QueuedMail, keys.entry_id(mid, idx), str(mid),
                                      ref.rec.schedule, ref)

    def find_inflight(self) -> Iterator[InflightMail]:
        self._check_open()
        return self._adopt()

    def _adopt(self) -> Iterator[InflightMail]:
        with self._io("listing inflight entries"):
            for key, raw in self._kv.iterate(keys.INFLIGHT, keys.end_of(keys.INFLIGHT)):
                ref = self._listed(key, raw, kv_records.INFLIGHT)
                if ref is None:
                    continue
                rec = ref.rec
                with self._core.mu:
                    if (rec.mid, rec.idx) in self._core.inflight:
                        continue  # a live owner in this process holds it
                    self._core.inflight.add((rec.mid, rec.idx))
                yield self._issue(InflightMail, keys.entry_id(rec.mid, rec.idx),
                                  str(rec.mid), rec.schedule, ref)

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        self._check_open()
        return self._pending_cleanup()

    def list_held(self) -> Iterator[HeldMail]:
        self._check_open()
        return self._held()

    def scan_queue(self) -> Iterator[QueuedMail | HeldMail]:
        """Every QUEUED and HELD entry in message order: each delivery zone's entries (in
        message order within the zone) and the held ones, merged as they are read, so a
        message's entries come together whatever their zone and state and nothing of the
        queue is kept (one iterator a zone)."""
        self._check_open()
        streams: list[Iterator[QueuedMail | HeldMail]] = [
            self._queued(p, keys.end_of(p)) for p in self._zone_prefixes()]
        streams.append(self._held())
        return heapq.merge(*streams, key=lambda h: keys.parse_entry_id(h.entry_id))

    def _zone_prefixes(self) -> list[bytes]:
        """The key prefix of every delivery zone that holds a QUEUED entry, as its keys
        spell it (``delivery-zone <escaped zone> ``: one look a zone, each past the zone
        before it).  Taken from the key found, not escaped again from its name: a
        damaged key spelling its zone another way still moves the look on."""
        out: list[bytes] = []
        start = keys.ZONE
        with self._io("listing the queue"):
            while True:
                found = first_of(self._kv.iterate(start, keys.end_of(keys.ZONE)))
                if found is None:
                    return out
                field = found[0][len(keys.ZONE):].split(b" ", 1)[0]
                prefix = keys.ZONE + field + b" "
                if not field or not found[0].startswith(prefix):
                    # no zone field: not an entry key (recovery deals with it); look past it
                    start = found[0] + b"\x00"
                    continue
                out.append(prefix)
                start = keys.end_of(prefix)

    def _held(self) -> Iterator[HeldMail]:
        with self._io("listing held entries"):
            for key, raw in self._kv.iterate(keys.HELD, keys.end_of(keys.HELD)):
                ref = self._listed(key, raw, kv_records.HELD)
                if ref is not None:
                    rec = ref.rec
                    yield self._issue(HeldMail, keys.entry_id(rec.mid, rec.idx),
                                      str(rec.mid), rec.schedule, ref)

    def _pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        with self._io("listing pending cleanups"):
            for key, raw in self._kv.iterate(keys.CLEANUP, keys.end_of(keys.CLEANUP)):
                ref = self._listed(key, raw, kv_records.CLEANUP)
                if ref is not None:
                    rec = ref.rec
                    yield self._issue(PendingCleanupMail, keys.entry_id(rec.mid, rec.idx),
                                      str(rec.mid), rec.schedule, ref)

    # ---- mail -----------------------------------------------------------------------

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        """Start a message.  NoSpaceError while the disk is full (the reserve is spent and
        cannot be made again): delivering, dropping and cleaning up still work."""
        self._check_open()
        validate_address(mail_from, "mail_from", allow_empty=True)
        checked = validate_params(params)
        r = self._reserve
        if r is not None and not r.held:
            try:
                ok = r.ensure()
                if not ok and callable(getattr(self._kv, "compact", None)):
                    # Drained mail still takes room until it is compacted away.
                    with contextlib.suppress(OSError, StorageIOError):
                        self.compact()
                    ok = r.ensure()
            except OSError as e:
                raise io_error("enqueue: making the disk reserve again", e, None) from e
            self._draining = not ok
            if not ok:
                raise NoSpaceError(
                    f"the disk of {r.directory} is full: new mail is refused until space is "
                    "freed (delivering, dropping and cleaning up queued mail still work)")
        self._check_headroom()
        return KvEnqueuer(self, mail_from, checked)

    def _check_headroom(self) -> None:
        """NoSpaceError while less space is free than the engine's compactions may need
        (``KV.compaction_headroom``, or all it holds if that is less)."""
        headroom = self._kv.compaction_headroom
        if not headroom or self._at is None:
            return
        path = self._at[1]
        try:
            free = free_bytes(path)
            if free >= headroom:
                return
            need = min(headroom, self._kv.disk_bytes())
            if free < need and self._may_measure():
                # Delivered mail takes room until compacted away; a compaction writes
                # what is live, so it is tried only with room for that twice over.
                live = self.footprint()
                self._measured = (time.monotonic(), self._cleanups, live.objects)
                if 2 * live.bytes < free:
                    with contextlib.suppress(OSError, StorageIOError):
                        self.compact()
                    free, need = free_bytes(path), min(headroom, self._kv.disk_bytes())
        except OSError as e:
            raise io_error("enqueue: measuring free space", e, None) from e
        if free < need:
            raise NoSpaceError(
                f"the disk of {path} is nearly full: {free} bytes free, less than the "
                f"{need} the queue's database may need to compact what it holds; new mail "
                "is refused until space is freed (delivering still works)")

    def _may_measure(self) -> bool:
        """Whether a queue short of headroom counts what it holds again (it iterates every
        key): every ``COMPACT_EVERY`` seconds, or sooner once cleanups since the last count
        could have taken most of what it counted (a key in eight)."""
        at, cleanups, objects = self._measured
        return (time.monotonic() - at >= COMPACT_EVERY
                or self._cleanups - cleanups >= max(1, objects // 8))

    def _out_of_space(self) -> None:
        """A write failed for a full disk: release the reserve, for draining."""
        if self._reserve is not None:
            self._draining = True
            with contextlib.suppress(OSError):
                self._reserve.release()

    def _make_room(self) -> None:
        """While a full disk is drained (the reserve spent), before each state change, each
        time another eighth of the reserve's size was used since the last time: the engine
        gives back the room of what was delivered and cleaned up (``LogEngine.reclaim``, a
        table piece at a time), so draining never meets a disk with no room at all for
        the records it writes, and the space comes back as the queue empties."""
        r = self._reserve
        if not self._draining or r is None:
            return
        reclaim = getattr(self._kv, "reclaim", None)
        if not callable(reclaim):
            return
        try:
            free = free_bytes(r.directory)
            if free > self._room_after - r.size // 8:
                return
            reclaim()
            self._room_after = free_bytes(r.directory)
        except OSError:
            pass  # the state change meets the failure, and reports it

    def read_inflight(self, mail: InflightMail) -> MailReader:
        h = self._peek(mail, InflightMail)
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "read_inflight", mid, idx):
            rec = self._core.entry(keys.inflight(mid, idx), mid, idx, kv_records.INFLIGHT, ref)
            if rec is None:
                raise ClosedError(f"entry {h.entry_id} is no longer inflight")
            try:
                meta = self._core.meta(mid)
                why = "" if meta is not None else "metadata record is missing"
            except BadRecord as e:
                meta, why = None, f"metadata: {e}"
            if meta is not None and (idx >= len(meta.rcpts)
                                     or meta.rcpts[idx] != (rec.address, rec.zone)):
                why = "entry record disagrees with the metadata"
        if meta is None or why:
            with self._io("read_inflight: quarantine", h), self._core.message_exclusive(mid):
                self._core.quarantine_message(mid, why)
            raise CorruptionError(f"message {mid}: {why}", h.entry_id,
                                  keys.quarantine(keys.message_prefix(mid)).decode())
        em = EntryMeta(str(mid), h.entry_id, meta.mail_from, rec.address, idx, rec.zone,
                       dict(meta.params), rec.schedule, meta.size)
        return KvReader(self, em, meta)

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        held = isinstance(mail, HeldMail)
        h = self._peek(mail, HeldMail if held else QueuedMail)
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "inspect_entry", mid, idx):
            key = keys.held(mid, idx) if held else keys.zone(ref.rec.zone, mid, idx)
            rec = self._core.entry(key, mid, idx, kv_records.HELD if held else kv_records.QUEUED,
                                   ref)
            if rec is None:
                return None
            try:
                meta = self._core.meta(mid)
            except BadRecord:
                meta = None
            if meta is None or idx >= len(meta.rcpts) or meta.rcpts[idx] != (rec.address,
                                                                                rec.zone):
                return None  # recovery or a reader quarantines a damaged message
        em = EntryMeta(str(mid), h.entry_id, meta.mail_from, rec.address, idx, rec.zone,
                       dict(meta.params), rec.schedule, meta.size, meta.created)
        return KvReader(self, em, meta)

    # ---- state changes --------------------------------------------------------------

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        self._check_open()
        sched = self._schedule(schedule)
        h = self._take(mail, QueuedMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "reschedule", mid, idx):
            zkey = keys.zone(ref.rec.zone, mid, idx)
            rec = self._core.entry(zkey, mid, idx, kv_records.QUEUED, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.QUEUED, schedule=sched))
            b = WriteBatch()
            b.put(zkey, new.raw)
            self._core.write(b, sync=True)
        return self._issue(QueuedMail, h.entry_id, h.message_id, sched, new)

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "send_start", mid, idx):
            zkey = keys.zone(ref.rec.zone, mid, idx)
            rec = self._core.entry(zkey, mid, idx, kv_records.QUEUED, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.INFLIGHT, owner=self._core.owner))
            b = WriteBatch()
            b.delete(zkey)
            b.delete(keys.domain(keys.domain_of(rec.address), mid, idx))
            b.put(keys.inflight(mid, idx), new.raw)
            self._core.write(b, sync=False)
            with self._core.mu:
                self._core.inflight.add((mid, idx))
        return self._issue(InflightMail, h.entry_id, h.message_id, rec.schedule, new)

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "send_done", mid, idx):
            ikey = keys.inflight(mid, idx)
            rec = self._core.entry(ikey, mid, idx, kv_records.INFLIGHT, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.CLEANUP))
            b = WriteBatch()
            b.delete(ikey)
            b.put(keys.cleanup(mid, idx), new.raw)
            self._core.write(b, sync=True)
            with self._core.mu:
                self._core.inflight.discard((mid, idx))
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, rec.schedule, new)

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        self._check_open()
        sched = self._schedule(schedule)
        h = self._take(mail, InflightMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "send_cancel", mid, idx):
            ikey = keys.inflight(mid, idx)
            rec = self._core.entry(ikey, mid, idx, kv_records.INFLIGHT, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.QUEUED, schedule=sched))
            b = WriteBatch()
            b.delete(ikey)
            b.put(keys.zone(rec.zone, mid, idx), new.raw)
            b.put(keys.domain(keys.domain_of(rec.address), mid, idx),
                  kv_records.domain_value(mid, idx, rec.zone))
            self._core.write(b, sync=True)
            with self._core.mu:
                self._core.inflight.discard((mid, idx))
        return self._issue(QueuedMail, h.entry_id, h.message_id, sched, new)

    def send_finish(self, done: Sequence[InflightMail] = (),
                    cancel: Sequence[tuple[InflightMail, Schedule]] = ()) -> Finished:
        """Every move in one synced batch (C15): all the entries' claims held at once,
        each entry's records moved as its own call would, one ``write(sync=True)``.  An
        entry found corrupt is quarantined and answers None."""
        self._check_open()
        dones, cancels = self._take_batch(done, cancel)
        self._make_room()
        every = [*dones, *(h for h, _ in cancels)]
        located = [self._locate(h) for h in every]
        hold = self._core.claims.hold(
            excl=[cl.entry(mid, idx) for mid, idx, _ in located],
            shared=(cl.EVERYTHING, *dict.fromkeys(cl.message(mid) for mid, _, _ in located)))
        b = WriteBatch()
        out: list[Handle | None] = []
        left: list[tuple[int, int]] = []
        try:
            with _IoGuard(self, "send_finish", None, hold):
                for i, (h, (mid, idx, ref)) in enumerate(zip(every, located, strict=True)):
                    ikey = keys.inflight(mid, idx)
                    try:
                        rec = self._core.entry(ikey, mid, idx, kv_records.INFLIGHT, ref)
                    except CorruptionError:
                        rec = None  # quarantined: no longer INFLIGHT
                    if rec is None:
                        out.append(None)
                        continue
                    b.delete(ikey)
                    left.append((mid, idx))
                    if i < len(dones):
                        new = Stored.of(rec.moved(kv_records.CLEANUP))
                        b.put(keys.cleanup(mid, idx), new.raw)
                        out.append(self._issue(PendingCleanupMail, h.entry_id, h.message_id,
                                               rec.schedule, new))
                        continue
                    sched = cancels[i - len(dones)][1]
                    new = Stored.of(rec.moved(kv_records.QUEUED, schedule=sched))
                    b.put(keys.zone(rec.zone, mid, idx), new.raw)
                    b.put(keys.domain(keys.domain_of(rec.address), mid, idx),
                          kv_records.domain_value(mid, idx, rec.zone))
                    out.append(self._issue(QueuedMail, h.entry_id, h.message_id, sched, new))
                self._core.write(b, sync=True)
                with self._core.mu:
                    self._core.inflight.difference_update(left)
        except StorageIOError as e:
            for issued in out:
                if issued is not None:
                    issued._live = False  # never handed out: the batch failed
            raise self._batch_failed(e, dones, cancels) from None
        return Finished(out[:len(dones)], out[len(dones):])  # type: ignore[arg-type]

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        self._make_room()
        got = self._move_queued(h, "drop", kv_records.CLEANUP, keys.cleanup)
        return None if got is None else self._issue(PendingCleanupMail, h.entry_id,
                                                    h.message_id, got[0], got[1])

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        """Move the entry's record from its delivery-zone key (and its domain-index key)
        to ``held <id> <idx>`` in one synced batch: no listing of the queue shows it, so
        nothing claims it, and its schedule is kept (C14)."""
        h = self._take(mail, QueuedMail)
        self._make_room()
        got = self._move_queued(h, "hold", kv_records.HELD, keys.held)
        return None if got is None else self._issue(HeldMail, h.entry_id, h.message_id,
                                                    got[0], got[1])

    def _move_queued(self, h: QueuedMail, what: str, state: str,
                     key: Callable[[int, int], bytes]) -> tuple[Schedule, Stored] | None:
        """Move a QUEUED entry's record from its delivery-zone and domain-index keys to
        ``key(mid, idx)`` in state ``state``, in one synced batch; None if it is no longer
        QUEUED."""
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, what, mid, idx):
            zkey = keys.zone(ref.rec.zone, mid, idx)
            rec = self._core.entry(zkey, mid, idx, kv_records.QUEUED, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(state))
            b = WriteBatch()
            b.delete(zkey)
            b.delete(keys.domain(keys.domain_of(rec.address), mid, idx))
            b.put(key(mid, idx), new.raw)
            self._core.write(b, sync=True)
        return rec.schedule, new

    def release(self, mail: HeldMail) -> QueuedMail | None:
        """Put a held entry back under its delivery-zone and domain keys (one synced
        batch), with the schedule it had."""
        h = self._take(mail, HeldMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "release", mid, idx):
            hkey = keys.held(mid, idx)
            rec = self._core.entry(hkey, mid, idx, kv_records.HELD, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.QUEUED))
            b = WriteBatch()
            b.delete(hkey)
            b.put(keys.zone(rec.zone, mid, idx), new.raw)
            b.put(keys.domain(keys.domain_of(rec.address), mid, idx),
                  kv_records.domain_value(mid, idx, rec.zone))
            self._core.write(b, sync=True)
        return self._issue(QueuedMail, h.entry_id, h.message_id, rec.schedule, new)

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        h = self._take(mail, HeldMail)
        self._make_room()
        mid, idx, ref = self._locate(h)
        with self._entry_op(h, "drop_held", mid, idx):
            hkey = keys.held(mid, idx)
            rec = self._core.entry(hkey, mid, idx, kv_records.HELD, ref)
            if rec is None:
                return None
            new = Stored.of(rec.moved(kv_records.CLEANUP))
            b = WriteBatch()
            b.delete(hkey)
            b.put(keys.cleanup(mid, idx), new.raw)
            self._core.write(b, sync=True)
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, rec.schedule, new)

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        """Delete the entry; with its message's last entry, the whole message.

        Unsynced: if a crash loses it, the entry is found PENDING_CLEANUP again and
        recovery finishes it, which is where a restart takes it anyway.
        """
        h = self._take(mail, PendingCleanupMail)
        self._make_room()
        mid, idx, _ = self._locate(h)
        with self._entry_op(h, "cleanup", mid, idx, cl.count(mid)):
            ckey = keys.cleanup(mid, idx)
            if self._kv.get(ckey) is None:
                return False
            b = WriteBatch()
            self._core.release(b, mid)
            b.delete(ckey)
            self._core.write(b, sync=False)
        self._cleanups += 1
        return True

    # ---- lifecycle ------------------------------------------------------------------

    def _finish_resurrected(self, back: Mapping[str, str]) -> None:
        """Take out of the queue, through ``drop`` and ``cleanup``, the entries damage at
        rest brought back (``atrest.resurrected``), and say so in the recovery report:
        they were delivered or dropped before the last clean close (C3).  A crash in
        between leaves the record of that close, so the next open finishes the rest."""
        if not back:
            return
        for h in list(self.list_queue()):
            if h.entry_id in back:
                done = self.drop(h)
                if done is not None:
                    self.cleanup(done)
        report = self.last_recovery or RecoveryReport()
        notes = tuple(f"entry {e} was {was} at the last clean close and came back after "
                      "damage at rest: finished again, not delivered twice"
                      for e, was in back.items())
        self.last_recovery = replace(report, problems=report.problems + notes)

    def recover(self) -> RecoveryReport:
        from queue_ref.kv.kv_recovery import recover
        self._check_open()
        with self._io("recovery"), self._core.claims.hold(excl=[cl.EVERYTHING]):
            return recover(self._core)

    def footprint(self) -> Footprint:
        """Keys of messages and entries (message, live, delivery-zone, domain, inflight,
        cleanup) and their key + value bytes.  Not counted: ``seq`` and the quarantine."""
        self._check_open()
        n = size = 0
        with self._io("footprint"):
            for fam in keys.DATA_FAMILIES:
                for k, v in self._kv.iterate(fam, keys.end_of(fam)):
                    n += 1
                    size += len(k) + len(v)
        return Footprint(n, size)

    def quarantined(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) moved aside as corrupt, for operators and tests."""
        self._check_open()
        with self._io("listing the quarantine"):
            return list(self._kv.iterate(keys.QUARANTINE, keys.end_of(keys.QUARANTINE)))

    def disk_usage(self) -> int:
        """Bytes the engine's files take on disk (the disk reserve not counted)."""
        self._check_open()
        with self._io("disk usage"):
            used = self._kv.disk_usage()
            if self._reserve is not None:
                with contextlib.suppress(FileNotFoundError):
                    used -= os.stat(self._reserve.path).st_size
            return used

    def compact(self) -> bool:
        """Ask the engine to drop deleted keys from its files; False if it cannot."""
        self._check_open()
        compact = getattr(self._kv, "compact", None)
        if not callable(compact):
            return False
        with self._io("compact"):
            compact()
        return True

    def close(self) -> None:
        """Close the engine.  A queue opened by ``open_log`` or ``open_leveldb`` then
        records what it holds (``atrest.py``), so that damage at rest is found at the next
        open; if that record cannot be written (a full disk), there is none.  Nor is there
        after a failed write or sync: what the engine holds in memory may then differ
        from its files either way (a record written whose sync failed is not applied), and
        a record of it would report the difference as damage at the next open."""
        if self._closed:
            return
        super().close()
        if self._at is None:
            self._kv.close()
            return
        io, path = self._at
        with self._core.claims.hold(excl=[cl.EVERYTHING]):
            try:
                rest: atrest.AtRest | None = (atrest.entries_of(self._kv)
                                              if self._kv.failed is None else None)
            except (OSError, ClosedError):
                rest = None
            self._kv.close()
            if rest is not None:
                with contextlib.suppress(OSError):
                    atrest.write(io, path, rest)


class _IoGuard:
    """The context of one queue call: holds ``held`` (claims, if any) and turns an
    ``OSError`` into ``StorageIOError``, re-arming ``handle`` so the caller can retry."""

    __slots__ = ("_handle", "_held", "_queue", "_what")

    def __init__(self, queue: KvQueue, what: str, handle: Handle | None,
                 held: Held | None = None) -> None:
        self._queue = queue
        self._what = what
        self._handle = handle
        self._held = held

    def __enter__(self) -> None:
        if self._held is not None:
            self._held.__enter__()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._held is not None:
            self._held.__exit__(et, ev, tb)
        if isinstance(ev, OSError) and ev.errno in _NO_SPACE:
            self._queue._out_of_space()
        if isinstance(ev, OSError):
            if self._handle is not None:
                self._queue._give_back(self._handle)
            raise io_error(self._what, ev, self._handle,
                           reopen=self._queue.kv.failed is not None) from ev
