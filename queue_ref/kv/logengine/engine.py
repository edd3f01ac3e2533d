"""``LogEngine``: a small log-structured KV engine whose every disk call goes through ``IO``.

Write path: a batch is framed (length + CRC32) and appended to the log with the rest of
its group by the group-commit leader; one fdatasync covers the whole group, then the group
enters the memtable, so a synced batch becomes visible only once it is durable (see
``groupcommit``).  An unsynced batch does not queue behind a group's fdatasync: it is
appended to the log and enters the memtable at once, unless it touches a key of a group
that is appended but not yet in the memtable (then it queues behind that group).  So the
log order and the memtable order agree on every key, the log stays one ordered sequence
(a synced batch makes every batch appended before it durable), and a thread's unsynced
write never waits for another thread's fsync.  Once the memtable passes
``memtable_limit`` bytes or the log ``log_limit``, the writer that noticed flushes (below)
in an exclusive turn (a writer streaming a big body in asks for a flush past the smaller
``spill_limit``: ``spill``); flushes and compactions run in the writers' path, never in a
background thread, so a single-threaded run's sequence of disk calls is deterministic.

Flush (and ``compact()``, which merges everything): merge the memtable with the tables the
policy picks (``merge.py``) into ``<n>.tbl.tmp``, fsync it, rename it to ``<n>.tbl`` (a
table past ``table_limit`` bytes is cut into pieces, each such a file: a *run*, which the
policy counts as one table and a scan reads piece after piece);
create a new empty log; write ``MANIFEST-<m>`` (live tables with their runs, the new log)
and fsync it;
fsync the directory, so every name the manifest uses is durable; then publish by writing
``CURRENT.tmp``, fsync, rename to ``CURRENT``, fsync the directory.  Only then are the
old log, the old manifest and the merged tables deleted.  A crash anywhere leaves
``CURRENT`` naming either the old manifest (whose log still holds everything) or the new
one (whose tables do); recovery deletes the files that neither names.

Open table files: at most ``max_open_tables`` (``table.FdCache``), the least recently
read closed first and opened again by path at the next read; a table that leaves the live
list while a read holds it keeps its file until the read ends (``Table.retire``).

Recovery reads ``CURRENT``, the manifest, each live table (every block's CRC is checked),
and replays the one live log, which is at most about ``log_limit`` bytes: reopening
costs time in proportion to live data, not history.  A torn log tail (short, bad CRC,
unparseable, with no intact record after it) is dropped and the log is truncated there
durably.  Damage in the middle of the log (intact records after a bad one) is survived:
every intact record is kept, the damage is reported in ``damage`` (with the bad bytes,
from which the queue reads the ids they named), the memtable is flushed to a table and
the damaged log is moved to ``quarantine/``, never deleted, so the next open is clean.
A damaged table or manifest, or a missing ``CURRENT``, manifest, table or log, makes the
open fail with ``DatabaseCorruptError`` naming the repair command
(``queue_ref.kv.salvage``); an engine never creates a new database over old files.

Failure: after an I/O error while logging, flushing or compacting, the engine refuses
further writes with ``OSError`` until it is reopened (data after a failed fsync is not
trusted; recovery keeps exactly what the log and tables hold).  Reads keep working.  A
full disk (``ENOSPC`` from a write, before anything was synced or published) is not such
a failure: the log is cut back to where it was, a flush's half-made files are removed,
the write fails with ``ENOSPC``, and writing goes on once there is space again.

Full disk, drained: a flush whose merge finds no room flushes the memtable alone, and the
next try waits for another sixteenth of the log limit.  ``reclaim()`` gives back the room
of what no read returns any more while needing little: each table piece in turn is
written again without the entries a newer table or the memtable hides (the log synced
first, so what hides them is durable), a manifest naming the new piece and the same log
is published, and the old piece deleted; then the memtable is flushed alone and the
pieces gone over again (after a reclaim that went through, only those a key written
since falls in).  A write refused for a full disk (nothing of it written)
reclaims once and is tried again; the KV queue also asks for a reclaim while it drains
a full disk (``kv_queue.KvQueue._make_room``).  A crash anywhere in it leaves ``CURRENT``
naming the manifest before or after a step, each of which holds the same contents.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

from queue_ref.io import IO, OsIO, read_file, write_file_durable
from queue_ref.kv.base import KV, WriteBatch
from queue_ref.kv.engine_errors import Damage, DatabaseCorruptError, DatabaseLockedError
from queue_ref.kv.logengine import format as fmt
from queue_ref.kv.logengine.groupcommit import Group, Writer, WriterQueue
from queue_ref.kv.logengine.memtable import Memtable
from queue_ref.kv.logengine.merge import drop_tombstones, merge_newest, merge_start
from queue_ref.kv.logengine.table import FdCache, Table, TableWriter
from queue_ref.kv.logengine.wal import LogWriter, Replayed, replay
from queue_ref.storage import ClosedError, InvalidInputError


@dataclass(frozen=True)
class RecoveryStats:
    """What the last open read: the live log and the live tables (indexes only)."""

    log_bytes: int
    log_records: int
    truncated_bytes: int
    tables: int
    table_bytes: int
    garbage_files: int


def _check_key(key: object, what: str = "key") -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"{what} must be bytes, not {type(key).__name__}")
    return key


#: Unsynced records kept in memory before they are written to the log on their own.
BUFFER_LIMIT = 64 * 1024
#: Table files an engine keeps open at most (``table.FdCache``), whatever the store's size.
MAX_OPEN_TABLES = 64
#: The backend name of this engine for ``queue-ref repair``.
BACKEND = "kv-log"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


#: The bytes of live writes the memtable holds before a flush, by default: room for the
#: bodies of a relay's mail in flight (megabytes each), so that they die in memory.
MEMTABLE_LIMIT = 32 << 20
#: The memtable's limit while a writer streams a body past ``KV.spill``'s threshold in, by
#: default: what such a body holds in memory at most.
SPILL_LIMIT = 4 << 20
#: The largest default log limit: the log is replayed whole at the next open.
LOG_LIMIT_MAX = 64 << 20


def default_log_limit(memtable_limit: int, fs_bytes: int | None) -> int:
    """Eight memtables of log, at most ``LOG_LIMIT_MAX``, and at most a sixteenth of the
    file system the store is on (when its size is known), and at least 64 KiB: a log
    holds the bytes of deleted values too until its flush, and on a small disk those
    filled it while little mail was queued (a 24 MiB file system refused new mail with a
    64 MiB limit)."""
    limit = min(8 * memtable_limit, LOG_LIMIT_MAX)
    if fs_bytes is not None and fs_bytes > 0:
        limit = min(limit, max(64 * 1024, fs_bytes // 16))
    return limit


def default_table_limit(fs_bytes: int | None) -> int:
    """The size past which a table being written is cut into a new file (a *piece*):
    a sixty-fourth of the file system (when its size is known), between 64 KiB and
    8 MiB.  A full disk is drained one piece at a time (``reclaim``), so a piece must be
    small next to the room a full disk has (the queue's reserve is a sixteenth)."""
    if fs_bytes is None or fs_bytes <= 0:
        return 8 << 20
    return max(64 * 1024, min(8 << 20, fs_bytes // 64))


def _fs_bytes(path: str) -> int | None:
    """The size of the file system ``path`` is (or would be created) on; None if unknown."""
    probe = os.path.abspath(path) if isinstance(path, str) and "\x00" not in path else ""
    while probe:
        try:
            st = os.statvfs(probe)
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
            continue
        return st.f_blocks * st.f_frsize
    return None


def _runs(tables: Sequence[Table]) -> tuple[list[int], list[int]]:
    """The runs of ``tables`` (oldest first): the pieces of one table written, as the
    manifest records them (``Table.run``; tables next to each other).  The index of each
    run's first table, and the entries each run holds.  (The runs were once guessed from
    key order alone: tables of separate flushes of ascending keys were then taken for one
    run and never merged: 264 tables after 8,000 ascending puts with a 4 KiB memtable,
    instead of 4.)"""
    starts: list[int] = []
    entries: list[int] = []
    for i, t in enumerate(tables):
        if i and t.run == tables[i - 1].run:
            entries[-1] += t.entries
        else:
            starts.append(i)
            entries.append(t.entries)
    return starts, entries


def _scans(tables: Sequence[Table], start: bytes, stop: bytes | None) -> list[Iterator[fmt.Op]]:
    """The entries of ``tables`` with ``start <= key < stop``: one ascending source per
    run, newest first.  A run's pieces hold ascending key ranges apart from each other,
    so their scans follow one another, and a piece is read only once its turn comes."""
    bounds = [*_runs(tables)[0], len(tables)]
    return [_chained(tables[a:b], start, stop) for a, b in reversed(list(pairwise(bounds)))]


def _chained(pieces: Sequence[Table], start: bytes, stop: bytes | None) -> Iterator[fmt.Op]:
    for t in pieces:
        yield from t.scan(start, stop)


def _any_within(keys: list[bytes], table: Table) -> bool:
    """Whether a key of ``keys`` (sorted) falls in the range of ``table``'s keys."""
    if not table.last_keys:
        return False
    i = bisect.bisect_left(keys, table.first_key)
    return i < len(keys) and keys[i] <= table.last_keys[-1]


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_ops(ops: Sequence[tuple[object, object]]) -> None:
    for key, value in ops:
        if not isinstance(key, bytes):
            _check_key(key)
        if value is not None and not isinstance(value, bytes):
            _check_key(value, "value")


class LogEngine(KV):
    """A crash-safe ordered KV store in one directory (see the module docstring)."""

    #: How the live log is read back at open (``wal.replay``: every intact record, past
    #: damage in the middle).
    _replay = staticmethod(replay)
    #: The class of a table file opened for reading (a class attribute, as ``_replay``).
    _table: type[Table] = Table

    def __init__(self, path: str, io: IO | None = None, *,
                 memtable_limit: int = MEMTABLE_LIMIT, spill_limit: int | None = None,
                 log_limit: int | None = None, table_limit: int | None = None,
                 max_open_tables: int = MAX_OPEN_TABLES) -> None:
        """Open (or create) the store at ``path``.  ``memtable_limit``: the bytes of live
        writes held in memory before a flush; ``spill_limit``: the same while a writer
        streams a big body in (``spill``; default: the smaller of ``SPILL_LIMIT`` and
        ``memtable_limit``); ``log_limit``: the size of the live log that
        forces a flush (default: ``default_log_limit``), which bounds the replay at the next
        open; ``table_limit``: the size of a table file past which a table is cut into
        pieces (default: ``default_table_limit``); ``max_open_tables``: the table files kept
        open at most (``table.FdCache``).  A message body put and deleted between
        two flushes is never
        written to a table: the log's limit lets a relay's bodies in flight (megabytes each)
        live and die between flushes while the memtable has room for them."""
        if log_limit is None or table_limit is None:
            fs_bytes = _fs_bytes(path)
            if log_limit is None:
                log_limit = (default_log_limit(memtable_limit, fs_bytes)
                             if _is_size(memtable_limit) else 0)
            if table_limit is None:
                table_limit = default_table_limit(fs_bytes)
        if spill_limit is None:
            spill_limit = (min(SPILL_LIMIT, memtable_limit) if _is_size(memtable_limit)
                           else 0)
        for name, value in (("memtable_limit", memtable_limit), ("spill_limit", spill_limit),
                            ("log_limit", log_limit),
                            ("table_limit", table_limit), ("max_open_tables", max_open_tables)):
            if not _is_size(value):
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidInputError(f"path must be a non-empty str without NUL, got {path!r}")
        self.path = os.path.abspath(path)
        self.io: IO = io if io is not None else OsIO()
        self.memtable_limit = memtable_limit
        self.spill_limit = spill_limit
        self.log_limit = log_limit
        self.table_limit = table_limit
        self._mu = threading.Lock()  # guards _mem and _tables for readers
        self._writers = WriterQueue()
        # Guards appending to the log, the order of memtable updates, _pending (groups
        # appended but not yet in the memtable, in log order) and _durable (a log offset
        # up to which a finished fdatasync made the current log durable).
        self._append_mu = threading.Lock()
        self._pending: deque[Group] = deque()
        self._durable = 0
        # Unsynced records not yet written to the log (see the module docstring).
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._drained = threading.Condition(self._append_mu)
        self._sync_mu = threading.Lock()  # held through each fdatasync of the log
        self._mem = Memtable()
        self._tables: list[Table] = []
        #: The open files of the tables, a fixed number at most.
        self._fds = FdCache(self.io, max_open_tables)
        #: Tables that left ``_tables`` while a read held them: their files are deleted
        #: with the last reference (``Table.retire``), and kept until then.
        self._retired: list[Table] = []
        self._log: LogWriter | None = None
        self._log_number = 0
        #: Operations written since the last ``reclaim`` (none: it would free nothing).
        self._since_reclaim = 1
        #: After a flush failed for a full disk: the log size before which no write
        #: tries it again (each try writes until the disk refuses).
        self._flush_at = 0
        #: The tables after the last reclaim that went through (None: none since the open,
        #: or the last one stopped): nothing in one hides anything in another, so the next
        #: reclaim reads again only the pieces whose keys a newer write may hide.
        self._clean: set[int] | None = None
        self._manifest_no = 0
        self._next_file = 1
        self._closed = False
        self._failed: BaseException | None = None
        self.recovery = RecoveryStats(0, 0, 0, 0, 0, 0)
        #: Damage the last open met and survived (see the module docstring).
        self.damage: list[Damage] = []
        self._lock_fd = self._take_lock()
        try:
            if self.io.exists(self._p(fmt.REPAIR)):
                raise DatabaseCorruptError(self._p(fmt.REPAIR), "a repair of this store was "
                                           "interrupted (its originals are kept in quarantine/)")
            if self.io.exists(self._p(fmt.CURRENT)):
                self._recover()
            elif self._holds_data():
                raise DatabaseCorruptError(
                    self._p(fmt.CURRENT), "missing, but the directory holds the files of a "
                    "database (tables, a log with records, or a manifest naming tables)")
            else:
                self._create()
        except DatabaseCorruptError as e:
            self._release_files()
            raise e.with_repair(self.path, BACKEND) from None
        except BaseException:
            self._release_files()
            raise

    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _alloc(self) -> int:
        n = self._next_file
        self._next_file += 1
        return n

    # ---- open, create, recover ---------------------------------------------------

    def _take_lock(self) -> int:
        io = self.io
        if not io.is_dir(self.path):
            try:
                io.mkdir(self.path)
            except FileExistsError:
                pass
            else:
                io.fsync_dir(os.path.dirname(self.path))
        fd = io.lock_exclusive(self._p(fmt.LOCK))
        if fd is None:
            raise DatabaseLockedError(self.path)
        return fd

    def _scan_dir(self, keep: set[str]) -> int:
        """Delete our files not in ``keep``; raise ``_next_file`` past every number seen."""
        removed = 0
        for name in self.io.listdir(self.path):
            parsed = fmt.parse_name(name)
            if parsed is not None:
                self._next_file = max(self._next_file, parsed[1] + 1)
            if (parsed is not None or name == fmt.CURRENT + ".tmp") and name not in keep:
                self.io.unlink_large(self._p(name))
                removed += 1
        return removed

    def _holds_data(self) -> bool:
        """Whether files of ours hold data (without a CURRENT naming them).  A creation
        that crashed before its CURRENT leaves only an empty log and a manifest naming no
        table (or torn): no write was ever acknowledged there (the first CURRENT is
        durable before the first write)."""
        io = self.io
        for name in io.listdir(self.path):
            parsed = fmt.parse_name(name)
            if parsed is None or parsed[0] == "tmp":
                continue
            path = self._p(name)
            if parsed[0] == "tbl":
                return True
            if parsed[0] == "log":
                if io.lstat(path).st_size > 0:
                    return True
                continue
            try:
                if fmt.Manifest.decode(path, read_file(io, path)).tables:
                    return True
            except DatabaseCorruptError:
                continue  # torn by a crash while it was first written
        return False

    def _create(self) -> None:
        """A new database.  No CURRENT means no write was ever acknowledged (the first
        CURRENT is durable before the first write), so leftovers of ours are garbage."""
        garbage = self._scan_dir(set())
        log_number = self._alloc()
        self._log = LogWriter.create(self.io, self._p(fmt.log_name(log_number)))
        self._log_number = log_number
        self._publish(log_number, [])
        self.recovery = RecoveryStats(0, 0, 0, 0, 0, garbage)

    def _recover(self) -> None:
        io = self.io
        current = read_file(io, self._p(fmt.CURRENT)).decode("ascii", "replace").strip()
        parsed = fmt.parse_name(current)
        if parsed is None or parsed[0] != "manifest" or not io.exists(self._p(current)):
            raise DatabaseCorruptError(self._p(fmt.CURRENT), f"names no manifest: {current!r}")
        manifest = fmt.Manifest.decode(self._p(current), read_file(io, self._p(current)))
        self._manifest_no = parsed[1]
        self._next_file = manifest.next_file
        for (number, size), run in zip(manifest.tables, manifest.run_ids(), strict=True):
            table = self._open_table(number)
            before = self._tables[-1] if self._tables else None
            self._tables.append(table)
            table.run = run
            if table.size != size:
                raise DatabaseCorruptError(table.path, f"size {table.size}, manifest says {size}")
            if (before is not None and before.run == run and before.last_keys
                    and table.last_keys and table.first_key <= before.last_keys[-1]):
                raise DatabaseCorruptError(table.path, "keys not after the piece before it")
            table.verify()
        log_path = self._p(fmt.log_name(manifest.log_number))
        if not io.exists(log_path):
            raise DatabaseCorruptError(log_path, "live log is missing")
        records = 0

        def apply(ops: list[fmt.Op]) -> None:
            nonlocal records
            records += 1
            self._mem.apply(ops)

        replayed = self._replay(io, log_path, apply)
        valid, size = replayed.valid, replayed.size
        fd = io.open_create(log_path, exclusive=False, append=True)
        self._log = LogWriter(io, log_path, fd, valid)
        self._log_number = manifest.log_number
        if valid < size and not replayed.bad:
            io.ftruncate(fd, valid)  # a torn tail (damage is kept: the log is set aside)
            io.fsync(fd)
        keep = {current, fmt.log_name(manifest.log_number)}
        keep |= {fmt.table_name(n) for n, _ in manifest.tables}
        garbage = self._scan_dir(keep)
        self.recovery = RecoveryStats(
            valid, records, size - valid, len(self._tables),
            sum(t.size for t in self._tables), garbage,
        )
        if replayed.bad:
            self._set_aside_log(replayed)
        elif self._over_limit():
            try:
                self._delete(self._maintain(full=False))
            except OSError as e:  # a full disk: the store opens as it is (what it can
                if not self._survives_no_space(e):  # reclaim, reclaimed), and a later
                    raise                           # write flushes once there is room
                self._reclaim()

    def _set_aside_log(self, replayed: Replayed) -> None:
        """After damage in the middle of the live log: flush what it holds intact into a
        table under a new log, and move the damaged log to ``quarantine/`` (never deleted),
        so the next open does not meet (and report) the same damage again."""
        assert self._log is not None
        damaged = self._log.path
        doomed = self._maintain(full=False, force=True)
        kept = self._keep_aside(damaged)
        self._delete([p for p in doomed if p != damaged])
        for region in replayed.bad:
            self.damage.append(Damage(
                kept, f"log {os.path.basename(damaged)}: bytes {region.start} to {region.end} "
                + ("are its last record, whole in length but failing its checksum "
                   "(damaged at rest, or a write a power cut tore)" if region.last else
                   "hold no intact record (intact records follow them and were kept)"),
                region.sample, frozenset(replayed.later_keys)))

    def _keep_aside(self, path: str) -> str:
        """Move a damaged file of ours to ``quarantine/`` (durably); returns its new path."""
        io = self.io
        qdir = self._p(fmt.QUARANTINE)
        if not io.is_dir(qdir):
            with contextlib.suppress(FileExistsError):
                io.mkdir(qdir)
            io.fsync_dir(self.path)
        base = os.path.join(qdir, os.path.basename(path))
        dest, n = base, 0
        while io.exists(dest):
            n += 1
            dest = f"{base}.{n}"
        io.rename(path, dest)
        io.fsync_dir(qdir)
        io.fsync_dir(self.path)
        return dest

    def _open_table(self, number: int) -> Table:
        path = self._p(fmt.table_name(number))
        if not self.io.exists(path):
            raise DatabaseCorruptError(path, "live table is missing")
        fd = self.io.open_read(path)
        try:
            return self._table(self.io, path, number, fd, self._fds)
        except BaseException:
            self.io.close(fd)
            raise

    def _release_files(self) -> None:
        for table in self._tables:
            table.release()
        self._tables = []
        self._fds.shut()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.io.unlock(self._lock_fd)

    # ---- publishing a new state ----------------------------------------------------

    def _publish(self, log_number: int, tables: list[Table]) -> int:
        """Make (log ``log_number``, ``tables``) the durable state; returns the number of
        the manifest it replaced.

        Raises before the CURRENT rename: the old state stands.  Raises in or after it: it
        is unknown which state is durable (the engine then refuses writes).
        """
        io = self.io
        number = self._alloc()
        manifest = fmt.Manifest(
            self._next_file, log_number, tuple((t.number, t.size) for t in tables),
            tuple(t.run for t in tables),
        )
        name = fmt.manifest_name(number)
        fd = io.open_create(self._p(name))
        try:
            io.write(fd, manifest.encode())
            io.fsync(fd)
        finally:
            io.close(fd)
        io.fsync_dir(self.path)
        write_file_durable(io, self._p(fmt.CURRENT), f"{name}\n".encode())
        old, self._manifest_no = self._manifest_no, number
        return old

    def _write_tables(self, entries: Iterator[fmt.Op]) -> list[Table]:
        """New durable-content tables of ``entries`` (their names are made durable by
        ``_publish``): one file, cut into pieces of about ``table_limit`` bytes, each a
        table of its own whose keys all sort after the piece before it, and all of one
        run (the first piece's number, which the manifest records); none if ``entries``
        is empty."""
        io = self.io
        out: list[Table] = []
        try:
            while (first := next(entries, None)) is not None:
                number = self._alloc()
                final = self._p(fmt.table_name(number))
                tmp = final + ".tmp"
                fd = io.open_create(tmp)
                try:
                    writer = TableWriter(io, fd)
                    writer.add(*first)
                    for key, value in entries:
                        writer.add(key, value)
                        if writer.size >= self.table_limit:
                            break
                    writer.finish()
                    io.fsync(fd)
                finally:
                    io.close(fd)
                io.rename(tmp, final)
                out.append(self._open_table(number))
                out[-1].run = out[0].run
        except BaseException:
            for t in out:
                t.release()
            raise
        return out

    def _over_limit(self, memtable_limit: int | None = None) -> bool:
        log = self._log
        if log is None:  # closed
            return False
        return (self._mem.approx_bytes > (memtable_limit or self.memtable_limit)
                or log.size + self._buffered > self.log_limit)

    @staticmethod
    def _merge_start(tables: list[Table], memtable_entries: int) -> int:
        """The merge policy (``merge.merge_start``) over runs (``_runs``)."""
        starts, entries = _runs(tables)
        run = merge_start(entries, memtable_entries)
        return starts[run] if run < len(starts) else len(tables)

    def _maintain(self, *, full: bool, force: bool = False, merge: bool = True) -> list[str]:
        """Flush the memtable merged with the tables the policy picks (all if ``full``,
        none unless ``merge``).

        Runs in an exclusive turn: no writer touches the memtable or the log meanwhile.
        Returns the files it made garbage (the old log and manifest, the merged tables),
        for the caller to delete after the turn (``_delete``): unlinking a log of
        megabytes takes long, and the next open deletes what is left anyway.
        """
        mem, old = self._mem, list(self._tables)
        if not (len(mem) or force) and not (
                full and (len(_runs(old)[0]) > 1 or any(t.tombstones for t in old))):
            return []
        start = (0 if full else self._merge_start(old, len(mem)) if merge else len(old))
        inputs = old[start:]
        sources = [iter(mem.range(b"", None)), *_scans(inputs, b"", None)]
        merged = merge_newest(sources)
        made = self._write_tables(drop_tombstones(merged) if start == 0 else merged)
        tables = old[:start] + made
        log = None
        try:
            log_number = self._alloc()
            log = LogWriter.create(self.io, self._p(fmt.log_name(log_number)))
            old_manifest = self._publish(log_number, tables)
        except BaseException:
            for t in made:
                t.release()
            if log is not None:
                log.close()
            raise
        with self._mu:
            self._tables = tables
            self._mem = Memtable()
            old_log, self._log = self._log, log
            self._log_number = log_number
            self._flush_at = 0
            self._durable = 0
            self._buffer.clear()  # its batches are in the new table
            self._buffered = 0
        assert old_log is not None
        old_log.close()
        doomed = [old_log.path, self._p(fmt.manifest_name(old_manifest))]
        doomed += self._retire(inputs)
        return doomed

    def _retire(self, tables: list[Table]) -> list[str]:
        """Release ``tables``, gone from ``_tables``: the paths of those to delete now
        (the others are deleted with their last reader, ``Table.retire``)."""
        self._retired = [t for t in self._retired if t.held]
        doomed = []
        for t in tables:
            path = t.retire()
            if path is None:
                self._retired.append(t)
            else:
                doomed.append(path)
        return doomed

    def _delete(self, doomed: list[str]) -> None:
        for path in doomed:
            with contextlib.suppress(OSError):  # garbage: the next open deletes it
                self.io.unlink_large(path)

    # ---- the KV interface ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"LogEngine {self.path} is closed")

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def left_nothing(self, error: OSError) -> bool:
        """A write that failed for a full disk while the engine goes on (``_append`` cut
        the log back to its size before it) left nothing."""
        return self._failed is None and error.errno in _NO_SPACE

    def _check_writable(self) -> None:
        self._check_open()
        if self._failed is not None:
            raise OSError(
                errno.EIO, f"LogEngine {self.path} failed earlier ({self._failed!r}); reopen it"
            ) from self._failed

    def get(self, key: bytes) -> bytes | None:
        _check_key(key)
        self._check_open()
        with self._mu:
            found, value = self._mem.lookup(key)
            if found:
                return value
            tables = list(self._tables)
            for t in tables:
                t.acquire()
        try:
            for t in reversed(tables):
                found, value = t.get(key)
                if found:
                    return value
            return None
        finally:
            for t in tables:
                t.release()

    def write(self, batch: WriteBatch, *, sync: bool = True) -> None:
        """Atomic; durable on return when ``sync``.  On ``OSError`` the batch may or may not
        be in the log (recovery decides), and the engine refuses writes until reopened."""
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, not {type(batch).__name__}")
        _check_ops(batch.ops)
        self._check_writable()
        if not batch.ops:
            return
        record = fmt.encode_batch(batch.ops)
        ops = list(batch.ops)
        try:
            if sync or not self._append_now(record, ops):
                self._commit(Writer(record, ops, sync))
        except OSError as e:
            # A full disk, the log as before: what the store no longer needs is given
            # back (``reclaim``) and the write is tried once more.
            if not self.left_nothing(e) or not self._since_reclaim or self.reclaim() <= 0:
                raise
            if sync or not self._append_now(record, ops):
                self._commit(Writer(record, ops, sync))
        self._since_reclaim += len(ops)
        if self._over_limit() and self._log_size() >= self._flush_at:
            self._flush()

    def _log_size(self) -> int:
        log = self._log
        return log.size + self._buffered if log is not None else 0

    def _append_now(self, record: bytes, ops: list[fmt.Op]) -> bool:
        """Append an unsynced batch and apply it at once; False if it touches a key of a
        pending group (it must then queue behind it)."""
        with self._append_mu:
            if self._pending:
                touched = [k for k, _ in ops]
                if any(not g.keys.isdisjoint(touched) for g in self._pending):
                    return False
            self._check_writable()
            self._buffer.append(record)
            self._buffered += len(record)
            if self._buffered >= BUFFER_LIMIT:
                try:
                    self._append([])
                except OSError:
                    if self._failed is None:  # a full disk: nothing written, this batch refused
                        self._buffer.pop()
                        self._buffered -= len(record)
                    raise
            with self._mu:
                self._mem.apply(ops)
        return True

    def _append(self, records: list[bytes]) -> LogWriter:
        """Append the buffered unsynced records, then ``records``, with one write (the
        caller holds ``_append_mu``).  On error the engine refuses further writes, except
        for a full disk: then what the write left is cut off again and the buffered
        records stay buffered, so the log is as before and writing goes on once there is
        space."""
        log = self._log
        assert log is not None
        data = b"".join(self._buffer + records) if records else b"".join(self._buffer)
        try:
            log.append(data)
        except OSError as e:
            if not (e.errno in _NO_SPACE and self._cut_back(log)):
                self._failed = e
            raise
        except BaseException as e:
            self._failed = e
            raise
        self._buffer.clear()
        self._buffered = 0
        return log

    def _cut_back(self, log: LogWriter) -> bool:
        """Cut the log back to its size before a failed append; False if that fails."""
        try:
            self.io.ftruncate(log.fd, log.size)
        except OSError:
            return False
        return True

    def _survives_no_space(self, e: BaseException) -> bool:
        """After a flush or compaction failed: True if it failed for a full disk before it
        published anything (``CURRENT`` still names our manifest); its half-made files are
        then removed, and the engine goes on as before it."""
        if not isinstance(e, OSError) or e.errno not in _NO_SPACE or self._log is None:
            return False
        try:
            current = read_file(self.io, self._p(fmt.CURRENT)).decode("ascii", "replace")
            if current.strip() != fmt.manifest_name(self._manifest_no):
                return False
            keep = {fmt.CURRENT, current.strip(), os.path.basename(self._log.path)}
            keep |= {os.path.basename(t.path) for t in self._tables + self._retired if t.held}
            self._scan_dir(keep)
        except OSError:
            return False
        return True

    def _commit(self, w: Writer) -> None:
        """Commit ``w`` in a group (see ``groupcommit``); raises its group's error."""
        if not self._writers.join(w):
            return
        with self._sync_mu if w.sync else contextlib.nullcontext():
            writers = self._writers.group()
            try:
                with self._append_mu:
                    self._check_writable()
                    log = self._append([x.record for x in writers])
                    group = Group(writers, log.size)
                    self._pending.append(group)
            except BaseException as e:
                self._writers.handoff(writers)
                Group(writers, 0).finish(e)
                raise
            self._writers.handoff(writers)
            if group.sync:
                self._sync(group, log)
        with self._append_mu:
            self._apply_ready()
            if not w.done:
                group.leader_waits = True
        if group.leader_waits:
            w.wake.acquire()
        if w.error is not None:
            raise w.error

    def _sync(self, group: Group, log: LogWriter) -> None:
        """Make the log durable up to ``group.end`` unless a finished sync covers it (the
        caller holds ``_sync_mu``)."""
        with self._append_mu:
            if group.writers[0].done or self._durable >= group.end:
                return
            size = log.size
        started = time.monotonic()
        try:
            log.sync()
        except BaseException as e:
            with self._append_mu:
                self._failed = e
                self._fail_pending(e)
            return
        self._writers.note_sync(time.monotonic() - started)
        with self._append_mu:
            self._durable = max(self._durable, size)

    def _apply_ready(self) -> None:
        """Apply, in log order, the pending groups that may become visible (the caller
        holds ``_append_mu``)."""
        pending = self._pending
        while pending and (not pending[0].sync or pending[0].end <= self._durable):
            group = pending.popleft()
            with self._mu:
                for x in group.writers:
                    self._mem.apply(x.ops)
            group.finish(None)
        if not pending:
            self._drained.notify_all()

    def _fail_pending(self, e: BaseException) -> None:
        """Fail every pending group (an fdatasync failed; the caller holds ``_append_mu``)."""
        while self._pending:
            self._pending.popleft().finish(e)
        self._drained.notify_all()

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """An exclusive turn: no group pending or forming, no unsynced write appending."""
        with self._writers.exclusive(), self._append_mu:
            while self._pending:
                self._drained.wait()
            yield

    def spill(self) -> None:
        """See ``KV.spill``: flush now if the memtable holds more than ``spill_limit``."""
        self._check_open()
        if self._over_limit(self.spill_limit) and self._log_size() >= self._flush_at:
            self._flush(self.spill_limit)

    def _flush(self, memtable_limit: int | None = None) -> None:
        """Flush in an exclusive turn if still over the limit (``memtable_limit``, when
        given, instead of the engine's own)."""
        doomed: list[str] = []
        with self._turn():
            if (self._closed or self._failed is not None
                    or not self._over_limit(memtable_limit)):
                return
            try:
                doomed = self._maintain(full=False)
            except Exception as e:
                # The batches are in the log; the failure stops later writes (a full disk
                # does not: the memtable is flushed alone, which needs room for it only,
                # and else the flush is tried again by a later write).
                if not self._survives_no_space(e):
                    self._failed = e
                else:
                    doomed = self._flush_alone()
        self._delete(doomed)

    def _flush_alone(self) -> list[str]:
        """Flush the memtable with no merge (after a merge failed for a full disk)."""
        try:
            return self._maintain(full=False, merge=False)
        except Exception as e:
            if not self._survives_no_space(e):
                self._failed = e
            self._flush_at = self._log_size() + self.log_limit // 16
            return []

    # ---- a full disk -----------------------------------------------------------------

    def reclaim(self) -> int:
        """Give back the room of what no read can return any more, needing little free
        space to do it (for draining a full disk); returns the bytes freed (negative if
        the store grew).

        Each table piece, oldest first, is written again without the entries a newer
        table or the memtable hides (and without tombstones that hide nothing older),
        the manifest names the new piece, and the old one is deleted: one piece at a
        time, so the room needed is one piece's live entries, never all the store's.
        Then the memtable is flushed alone (no merge) and the old log deleted, and the
        pieces are gone over again (the flush's tombstones often hide nothing older by
        then).  The memtable counts as newer only once every batch in it is durable in
        the log (the log is synced first; its records stay until the flush's new
        manifest is durable), so a crash anywhere leaves a state the log replays to the
        same contents.  A full disk stops it where it is (the half-made files are
        removed); another I/O error makes the engine refuse writes until reopened, as a
        failed flush does."""
        self._check_writable()
        with self._turn():
            self._check_writable()
            return self._reclaim()

    def _reclaim(self) -> int:
        """``reclaim`` in an exclusive turn (or while opening)."""
        self._since_reclaim = 0
        before = self._bytes()
        clean, self._clean = self._clean, None
        try:
            self._collect(clean)
            self._delete(self._maintain(full=False, merge=False))
            self._collect(clean)
        except Exception as e:
            if not self._survives_no_space(e):
                self._failed = e
                raise
        else:
            self._clean = {t.number for t in self._tables}
        return before - self._bytes()

    def _bytes(self) -> int:
        """The bytes of the live tables and log."""
        log = self._log
        return sum(t.size for t in self._tables) + (log.size if log is not None else 0)

    def _settle_log(self) -> bool:
        """Write the buffered unsynced batches to the log and sync it (in an exclusive
        turn), so that every batch the memtable holds is durable; False if a full disk
        keeps the buffered ones out of the log (they stay buffered)."""
        log = self._log
        assert log is not None
        if self._buffer:
            try:
                self._append([])
            except OSError:
                if self._failed is not None:
                    raise
                return False
        try:
            log.sync()
        except BaseException as e:
            self._failed = e
            raise
        self._durable = log.size
        return True

    def _collect(self, clean: set[int] | None) -> None:
        """Write each table piece again without what nothing reads (see ``reclaim``).  With
        ``clean`` (the tables after the last reclaim that went through), a piece of those
        is read only if a key of the memtable or of a table made since falls in its range:
        so a reclaim costs in proportion to what was written since the last one, not to
        all the store holds."""
        mem = self._mem if self._settle_log() else None
        fresh: list[bytes] | None = None
        if clean is not None:
            keys = {k for k, _ in mem.range(b"", None)} if mem is not None else set()
            for t in self._tables:
                if t.number not in clean:
                    keys.update(k for k, _ in t.scan(b"", None))
            fresh = sorted(keys)
        i = 0
        while i < len(self._tables):
            tables = list(self._tables)
            piece = tables[i]
            if (fresh is not None and clean is not None and piece.number in clean
                    and not _any_within(fresh, piece)):
                i += 1
                continue
            kept = self._still_read(piece, mem, tables[i + 1:], tables[:i])
            if len(kept) == piece.entries:
                i += 1
                continue
            made = self._write_tables(iter(kept))
            for t in made:
                t.run = piece.run  # still a piece of the table it was
            now = tables[:i] + made + tables[i + 1:]
            try:
                old_manifest = self._publish(self._log_number, now)
            except BaseException:
                for t in made:
                    t.release()
                raise
            with self._mu:
                self._tables = now
            self._delete([*self._retire([piece]), self._p(fmt.manifest_name(old_manifest))])
            i += len(made)

    @staticmethod
    def _still_read(piece: Table, mem: Memtable | None, newer: list[Table],
                    older: list[Table]) -> list[fmt.Op]:
        """The entries of ``piece`` a read can still meet: not hidden by the same key in
        a newer source (``mem``, if given, is the newest), and, for a tombstone, hiding a
        value in an older table.  Walks each side merged, in key order, once."""
        if not piece.last_keys:
            return []
        lo, stop = piece.first_key, piece.last_keys[-1] + b"\x00"
        above: list[Iterator[fmt.Op]] = [t.scan(lo, stop) for t in reversed(newer)]
        if mem is not None:
            above.insert(0, iter(mem.range(lo, stop)))
        hidden = (k for k, _ in merge_newest(above)) if above else iter(())
        below = (merge_newest([t.scan(lo, stop) for t in reversed(older)])
                 if piece.tombstones and older else iter(()))
        next_hidden = next(hidden, None)
        next_below = next(below, None)
        kept: list[fmt.Op] = []
        for key, value in piece.scan(lo, stop):
            while next_hidden is not None and next_hidden < key:
                next_hidden = next(hidden, None)
            if next_hidden == key:
                continue
            if value is None:
                while next_below is not None and next_below[0] < key:
                    next_below = next(below, None)
                if next_below is None or next_below[0] != key or next_below[1] is None:
                    continue  # nothing older to hide
            kept.append((key, value))
        return kept

    def iterate(
        self, start: bytes = b"", stop: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Ascending pairs with ``start <= key < stop``, as of the first ``next()``."""
        _check_key(start, "start")
        if stop is not None:
            _check_key(stop, "stop")
        self._check_open()
        return self._iterate(start, stop)

    def _iterate(self, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        self._check_open()
        with self._mu:
            mem = self._mem.range(start, stop)
            tables = list(self._tables)
            for t in tables:
                t.acquire()
        try:
            sources = [iter(mem), *_scans(tables, start, stop)]
            for key, value in merge_newest(sources):
                if value is not None:
                    self._check_open()
                    yield key, value
        finally:
            for t in tables:
                t.release()

    def compact(self) -> None:
        """Flush the memtable and merge every table into one, dropping deleted keys and
        shadowed values.  On ``OSError`` the contents are unchanged and the engine refuses
        writes until reopened."""
        self._check_writable()
        with self._turn():
            self._check_writable()
            try:
                doomed = self._maintain(full=True)
            except Exception as e:
                if not self._survives_no_space(e):
                    self._failed = e
                raise
        self._delete(doomed)

    def disk_usage(self) -> int:
        self._check_open()
        total = 0
        for name in self.io.listdir(self.path):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                total += self.io.lstat(self._p(name)).st_size
        return total

    def close(self) -> None:
        """Release the files and the lock; waits for a running group or compaction."""
        if self._closed:
            return
        with self._turn():
            if not self._closed:
                if self._buffer and self._failed is None:
                    # Unsynced batches promise nothing: losing them to an error is allowed.
                    with contextlib.suppress(OSError):
                        self._append([])
                self._closed = True
                with self._mu:
                    self._release_files()
