"""``LevelDBEngine``: the KV interface over real LevelDB (plyvel, which bundles LevelDB 1.22).

For production use.  It does not go through the I/O seam, so it is crash-tested by
killing a child process, not by the fault injector.  Every write is a ``WriteBatch``
with ``sync=True`` by default; LevelDB group-commits concurrent writers internally (one
log sync for all batches waiting behind the current writer).

Damage: LevelDB is opened with ``paranoid_checks`` (a damaged log record or manifest makes
the open fail instead of being skipped) and every read verifies block checksums, so a
damaged table is an error, never altered data.  LevelDB's ``Corruption`` becomes
``DatabaseCorruptError`` naming the repair command (``queue-ref repair``, which runs
LevelDB's own ``RepairDB``: ``queue_ref.kv.salvage``); an ``IOError`` for a full disk
becomes an ``OSError`` with ``ENOSPC`` (so the queue raises ``NoSpaceError``).

Names: LevelDB makes its data durable with ``fdatasync`` but does not sync the directory
after the ``rename`` that installs ``CURRENT`` or after creating a new log file, so a power
cut (under the weak model: a directory change is durable only once its directory is
synced) could lose the name and with it acknowledged writes.  The engine syncs the
directory after every open, and after every synced write that left a different set of
names in it (a new log, a new table), before the write returns; a rename over an
existing name (``CURRENT``) happens only while LevelDB opens.  The black-box power-loss
check (strace) found it.

Locking: LevelDB locks ``LOCK`` with ``fcntl``, which is per process, and a failed second
open in the same process closes a descriptor of that file, which drops the first open's
lock.  So the engine first takes an ``flock`` on ``queue-ref.lock`` in the database
directory: a second engine on the same directory, in this process or another, fails
with ``DatabaseLockedError`` before LevelDB is touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import threading
from collections.abc import Callable, Iterator

import plyvel  # type: ignore[import-untyped]

from queue_ref.kv.base import KV, WriteBatch
from queue_ref.kv.engine_errors import DatabaseCorruptError, DatabaseLockedError
from queue_ref.kv.leveldb_manifest import missing_log
from queue_ref.storage import ClosedError, InvalidInputError

LOCK_NAME = "queue-ref.lock"
#: ``compact`` covers the keys up to this one (keys starting with more 0xFF bytes are
#: compacted only by LevelDB's own background work).
COMPACT_HIGH = b"\xff" * 32
#: The backend name of this engine for ``queue-ref repair``.
BACKEND = "kv-leveldb"
#: LevelDB's options, for opening and for ``RepairDB``.
OPTIONS: dict[str, object] = {"paranoid_checks": True}


#: LevelDB's error for a read past the end of a table file (``PosixMmapReadableFile``).
_PAST_END = re.compile(r"IO error: (/.+?\.(?:ldb|sst)): Invalid argument")


def os_error(what: str, e: Exception, path: str, *, reading: bool = True) -> OSError:
    """The OSError for a plyvel error: ``DatabaseCorruptError`` for LevelDB's Corruption
    and, when ``reading``, for a read past the end of one of the database's tables (a
    table cut short; a write's EINVAL is the file system's, not damage), ``ENOSPC`` for a
    full disk, ``EIO`` otherwise."""
    text = str(e)
    if isinstance(e, plyvel.CorruptionError) or "Corruption" in text:
        return DatabaseCorruptError(path, f"{what}: {text}", repair=(path, BACKEND))
    short = _PAST_END.search(text) if reading else None
    if short and os.path.dirname(os.path.abspath(short.group(1))) == os.path.abspath(path):
        # LevelDB reads a table through mmap and answers a read past the file's end with
        # EINVAL: the table is shorter than the manifest says, the file is damaged
        return DatabaseCorruptError(
            short.group(1), f"{what}: {text} (the table is shorter than the database's "
            "manifest says: it was cut short)", repair=(path, BACKEND))
    if "No space left" in text or "Disk quota" in text:
        return OSError(errno.ENOSPC, f"{what}: {text}")
    return OSError(errno.EIO, f"{what}: {text}")


def _refuse_without_log(path: str) -> None:
    """LevelDB opens without the log its manifest names if that log is gone, and the
    writes acknowledged since its last table was written go with it, without a word (after
    a crash nothing recorded them elsewhere): refuse instead (``leveldb_manifest``)."""
    name = missing_log(path)
    if name is not None:
        raise DatabaseCorruptError(
            os.path.join(path, name), "missing: the store's manifest names it as the log "
            "of the writes made since its last table was written (LevelDB would open "
            "without them and say nothing)", repair=(path, BACKEND))


def _refuse_without_current(path: str) -> None:
    """LevelDB's ``create_if_missing`` makes a new, empty database when ``CURRENT`` is
    missing, beside (and then over) the files of the old one: refuse instead.  Unless
    those files are what a creation killed before its ``CURRENT`` leaves (LevelDB writes
    ``MANIFEST-000001``, then ``CURRENT``; the first open that follows writes a manifest
    of a higher number): no write was ever acknowledged there."""
    if os.path.exists(os.path.join(path, "CURRENT")):
        return
    data = sorted(n for n in os.listdir(path)
                  if n.endswith((".ldb", ".sst", ".log")) or n.startswith("MANIFEST-"))
    created = all(n == "MANIFEST-000001" or (n.endswith(".log")
                                               and os.path.getsize(os.path.join(path, n)) == 0)
                  for n in data)
    if data and not created:
        raise DatabaseCorruptError(
            os.path.join(path, "CURRENT"), f"missing, but {', '.join(data[:5])}"
            f"{' ...' if len(data) > 5 else ''} of a database are there",
            repair=(path, BACKEND))


class LevelDBEngine(KV):
    """LevelDB in directory ``path`` (created if missing).

    After an ``OSError`` from ``write`` the batch may or may not be durable (LevelDB
    decides at its next open); LevelDB itself refuses writes after a failed log sync.
    """

    #: A compaction writes its new tables before it frees the ones it merges, and a
    #: failed one stops later writes: on a disk its own data filled, LevelDB cannot
    #: delete (deliver) until space is freed (measured on a 4 MiB tmpfs; the reserve,
    #: released at the first NoSpaceError, covers a memtable flush, not a compaction).
    drains_full_disk = False
    #: A compaction of level 0 into level 1 rewrites up to all of both (level 1 holds
    #: 10 MB, level 0 up to 12 tables of ``max_file_size``): new mail is refused while
    #: less free space is left than that or than all the database holds, whichever is
    #: smaller, so that the mail taken can always be compacted and drained (on a 4 MiB
    #: disk its own mail filled, reopening and delivering failed one run in forty).
    compaction_headroom = 64 << 20

    def disk_bytes(self) -> int:
        total = 0
        with os.scandir(self.path) as it:
            for e in it:
                with contextlib.suppress(OSError):  # a table a compaction just removed
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
        return total

    def __init__(self, path: str, *, write_buffer_size: int | None = None) -> None:
        """``write_buffer_size``: LevelDB's memtable size (default: LevelDB's, 4 MiB);
        reopening writes up to that much, so a full disk's reserve must hold it."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidInputError(f"path must be a non-empty str without NUL, got {path!r}")
        if write_buffer_size is not None and (
                not isinstance(write_buffer_size, int) or write_buffer_size < 64 * 1024):
            raise InvalidInputError(f"write_buffer_size must be an int of at least 64 KiB, "
                                    f"got {write_buffer_size!r}")
        self._options = dict(OPTIONS)
        if write_buffer_size is not None:
            # Tables of the same size: a compaction then rewrites little at a time, which
            # keeps the room it needs on a nearly full disk small.
            self._options["write_buffer_size"] = write_buffer_size
            self._options["max_file_size"] = write_buffer_size
        self.path = os.path.abspath(path)
        os.makedirs(self.path, mode=0o750, exist_ok=True)
        self._lock_fd = os.open(
            os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DatabaseLockedError(self.path) from None
        try:
            _refuse_without_current(self.path)
            _refuse_without_log(self.path)
            self._open_db(create_if_missing=True)
        except plyvel.IOError as e:
            os.close(self._lock_fd)
            if "lock" in str(e):  # held by a LevelDB user outside this engine
                raise DatabaseLockedError(self.path) from e
            raise os_error(f"cannot open LevelDB at {self.path}", e, self.path) from e
        except plyvel.CorruptionError as e:
            os.close(self._lock_fd)
            raise os_error("opening", e, self.path) from e
        except DatabaseCorruptError:
            os.close(self._lock_fd)
            raise
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._closed = False
        # Counts running calls, so that close() waits for them instead of freeing LevelDB
        # under a call in another thread.
        self._active = 0
        self._writing = 0
        self._compacting = False  # compact() runs with writes held off
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._waiters = 0  # close() or compact() waiting for running calls to end
        # LevelDB refuses every write after one failed (its background error) until it is
        # reopened: the next write reopens it (``_revive``); if that fails too (the disk
        # is still full), LevelDB is closed (``_down``) and every call tries again.
        self._stale = False
        self._down: str | None = None
        self._failed: OSError | None = None

    def _revive(self, *, writes: bool) -> None:
        """Reopen LevelDB (in this process, under our lock) after a failed write, once no
        call runs; so a queue goes on without a restart once space is freed."""
        if not (self._down or (writes and self._stale)):
            return
        with self._cv:
            self._wait(lambda: not self._compacting or self._closed)
            if self._closed or not (self._down or (writes and self._stale)):
                return
            self._compacting = True  # holds off new writers
            try:
                self._wait(lambda: not self._active or self._closed)
                if self._is_closed():  # while we waited
                    return
                if self._down is None:
                    self._db.close()
                try:
                    self._open_db()
                except plyvel.Error as e:
                    err = os_error("reopening LevelDB after a failed write", e, self.path,
                                   reading=False)
                    self._down = str(err)
                    raise err from e
                except OSError as e:
                    self._down = f"syncing {self.path} after reopening LevelDB: {e}"
                    raise
                self._down = None
                self._stale = False
            finally:
                self._compacting = False
                self._cv.notify_all()

    def _is_closed(self) -> bool:
        return self._closed

    def _open_db(self, **options: bool) -> None:
        """Open LevelDB and sync its directory (closed again if that sync fails)."""
        self._db = plyvel.DB(self.path, **options, **self._options)
        try:
            self._names = self._sync_names()
        except OSError:
            self._db.close()
            raise

    def _refuse_if_failed(self) -> None:
        if self._failed is not None:
            raise OSError(errno.EIO, f"LevelDB at {self.path}: a directory sync failed "
                                     f"earlier ({self._failed}); reopen the queue")

    def _sync_names(self) -> frozenset[str]:
        """fsync the database's directory; the names it held when synced."""
        names = frozenset(os.listdir(self.path))
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return names

    def _names_synced(self) -> None:
        """After a synced write: if LevelDB created or removed a file since the directory
        was last synced (a new log at a memtable switch), sync it before acknowledging.
        A failed sync fails the engine: every later write is refused until it is reopened
        (a retried fsync proves nothing about what the failed one dropped)."""
        self._refuse_if_failed()
        try:
            if frozenset(os.listdir(self.path)) != self._names:
                self._names = self._sync_names()
        except OSError as e:
            self._failed = e
            raise

    @property
    def failed(self) -> BaseException | None:
        """The failed directory sync after which writes are refused, if any."""
        return self._failed

    def _begin(self, writes: bool = False) -> None:
        with self._mu:
            while writes and self._compacting and not self._closed:
                self._cv.wait()
            if self._closed:
                raise ClosedError(f"LevelDBEngine {self.path} is closed")
            if self._down is not None:
                raise OSError(errno.ENOSPC if "No space" in self._down else errno.EIO,
                              self._down)
            self._active += 1
            self._writing += writes

    def _end(self, writes: bool = False) -> None:
        with self._mu:
            self._active -= 1
            self._writing -= writes
            if self._waiters:
                self._cv.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait (holding ``_cv``) until ``done()``; calls ending meanwhile wake it."""
        self._waiters += 1
        try:
            while not done():
                self._cv.wait()
        finally:
            self._waiters -= 1

    def get(self, key: bytes) -> bytes | None:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, not {type(key).__name__}")
        self._revive(writes=False)
        self._begin()
        try:
            value: bytes | None = self._db.get(key, verify_checksums=True)
            return value
        except plyvel.Error as e:
            raise os_error("LevelDB get", e, self.path) from e
        finally:
            self._end()

    def write(self, batch: WriteBatch, *, sync: bool = True) -> None:
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, not {type(batch).__name__}")
        for key, value in batch.ops:
            if not isinstance(key, bytes) or not isinstance(value, bytes | None):
                raise TypeError("batch keys and values must be bytes")
        if not batch.ops:
            with self._cv:
                if self._closed:
                    raise ClosedError(f"LevelDBEngine {self.path} is closed")
            return
        self._refuse_if_failed()
        self._revive(writes=True)
        self._begin(writes=True)
        try:
            with self._db.write_batch(sync=sync, transaction=True) as wb:
                for key, value in batch.ops:
                    if value is None:
                        wb.delete(key)
                    else:
                        wb.put(key, value)
            if sync:
                self._names_synced()
        except plyvel.Error as e:
            err = os_error("LevelDB write failed", e, self.path, reading=False)
            if not isinstance(err, DatabaseCorruptError):
                self._stale = True
            raise err from e
        finally:
            self._end(writes=True)

    def iterate(
        self, start: bytes = b"", stop: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Ascending pairs with ``start <= key < stop`` from a LevelDB snapshot taken now."""
        if not isinstance(start, bytes) or not isinstance(stop, bytes | None):
            raise TypeError("start and stop must be bytes")
        self._revive(writes=False)
        self._begin()
        try:
            it = self._db.iterator(start=start, stop=stop, verify_checksums=True)
        finally:
            self._end()
        return self._drain(it)

    def _drain(self, it: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        try:
            while True:
                self._begin()
                try:
                    item = next(it, None)
                except plyvel.Error as e:
                    raise os_error("LevelDB iteration", e, self.path) from e
                except RuntimeError as e:  # LevelDB was reopened under this iterator
                    raise OSError(errno.EIO, f"LevelDB iteration: {e}") from e
                finally:
                    self._end()
                if item is None:
                    return
                yield item
        finally:
            with self._cv:
                if not self._closed:
                    with contextlib.suppress(RuntimeError):  # of a LevelDB since reopened
                        it.close()  # type: ignore[attr-defined]

    def compact(self) -> None:
        """Compact every key up to ``COMPACT_HIGH`` (drops deleted keys and shadowed values).

        LevelDB's ``CompactRange`` decides how deep to go before it flushes the memtable
        and never compacts its deepest level further, so a single flush of puts and
        deletes would stay on disk.  So: compact once (this flushes), then write a marker
        at both ends of the range (a delete of an absent key, or a rewrite of a present
        key with its own value: no change, as writes are held off meanwhile), whose
        flush overlaps every table, and compact again, which merges all tables into the
        deepest level and drops the deleted entries.
        """
        with self._cv:
            self._wait(lambda: not self._compacting or self._closed)
            self._compacting = True
        try:
            with self._cv:
                self._wait(lambda: not self._writing or self._closed)
            with self._running():
                stop = COMPACT_HIGH + b"\xff"
                self._db.compact_range(start=b"", stop=stop)
                with self._db.write_batch(sync=True, transaction=True) as wb:
                    for key in (b"", COMPACT_HIGH):
                        value = self._db.get(key)
                        if value is None:
                            wb.delete(key)
                        else:
                            wb.put(key, value)
                self._db.compact_range(start=b"", stop=stop)
                self._names_synced()  # new tables, old logs and tables gone
        finally:
            with self._cv:
                self._compacting = False
                self._cv.notify_all()

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        self._begin()
        try:
            yield
        finally:
            self._end()

    def disk_usage(self) -> int:
        with self._running():
            total = 0
            for entry in os.scandir(self.path):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_size
            return total

    def close(self) -> None:
        """Waits for running calls, then closes LevelDB (its iterators too) and the lock."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()  # writers waiting for a compaction give up
            self._wait(lambda: not self._active)
            self._db.close()
            os.close(self._lock_fd)
