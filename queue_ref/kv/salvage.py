"""Salvage of a damaged KV store (``queue-ref repair`` for the two KV engines).

Log engine (``repair_log``), in steps that a rerun after a kill repeats to the same end:

1. the record of the last clean close is taken (``atrest.take``: changed files are
   copied aside, its entries kept for the comparison at the end);
2. ``REPAIR`` is written in the store's directory (phase ``moving``, and the folder
   ``quarantine/repair-<n>/``): while it exists no engine opens the store;
3. every file of the engine (logs, tables, manifests, ``CURRENT``) is moved into that
   folder, where it stays: damaged or not, nothing is deleted;
4. ``REPAIR`` says ``building``; files of the engine in the store's directory are now
   leftovers of a build a kill interrupted, and are removed;
5. the originals are read: the tables and the log the manifest names (every table and
   log, oldest first, if no manifest can be read), each table block by block (a block
   that fails its CRC is skipped and reported), each log record by record with
   resynchronisation after damage; later files override earlier ones, as in the engine;
6. a new store is written: one table with every intact key, an empty log, a manifest,
   ``CURRENT`` (each synced before the next is published); ``REPAIR`` is removed;
7. the queue is opened: its recovery quarantines what fails the queue's own checksums,
   and the report names every message lost (``lostids``: read from damaged bytes,
   quarantined by recovery, or missing against the record of the last clean close).

LevelDB (``repair_leveldb``): LevelDB's own ``RepairDB`` (through plyvel), which turns
every log into tables, keeps every intact table block and moves what it cannot use to
``lost/``; then the queue is opened as above.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from queue_ref.io import IO, OsIO, read_file, write_file_durable
from queue_ref.kv import atrest, lostids
from queue_ref.kv.base import KV
from queue_ref.kv.engine_errors import Damage, DatabaseCorruptError, DatabaseLockedError
from queue_ref.kv.logengine import format as fmt
from queue_ref.kv.logengine.table import FOOTER_SIZE, Table, write_entries
from queue_ref.kv.logengine.wal import replay
from queue_ref.storage import InvalidInputError, QueuedMail, RecoveryReport

MARK = fmt.REPAIR
_ENTRY = struct.Struct("<II")
_TOMBSTONE = 0xFFFFFFFF
_U32 = struct.Struct("<I")
_BATCH = 1 << 20


@dataclass
class Repaired:
    """What a repair did: the report of the queue's recovery afterwards (lost ids, files
    kept aside, problems), the steps taken, and the messages the queue holds."""

    report: RecoveryReport
    actions: list[str] = field(default_factory=list)
    messages: int = 0
    entries: int = 0


# ---- reading damaged files ------------------------------------------------------------


def _parse_entries(data: bytes, pos: int, end: int) -> Iterator[tuple[int, bytes, bytes | None]]:
    """Entries of a block (``data[pos:end]``): (end offset, key, value or None)."""
    while pos < end:
        if pos + 8 > end:
            raise ValueError("short entry")
        klen, vlen = _ENTRY.unpack_from(data, pos)
        p = pos + 8
        if p + klen > end:
            raise ValueError("key past the block")
        key = data[p:p + klen]
        p += klen
        value: bytes | None = None
        if vlen != _TOMBSTONE:
            if p + vlen > end:
                raise ValueError("value past the block")
            value = data[p:p + vlen]
            p += vlen
        pos = p
        yield pos, key, value


def _scan_blocks(data: bytes) -> tuple[list[fmt.Op], list[tuple[int, int]]]:
    """Without an index: read blocks from the start, each ending where the CRC of the
    entries so far follows them.  Returns the entries and the unreadable byte ranges."""
    ops: list[fmt.Op] = []
    bad: list[tuple[int, int]] = []
    end = max(0, len(data) - FOOTER_SIZE)
    start = 0
    while start < end:
        crc = 0
        pos = start
        block: list[fmt.Op] = []
        closed = False
        try:
            for nxt, key, value in _parse_entries(data, start, end):
                crc = zlib.crc32(data[pos:nxt], crc)
                pos = nxt
                block.append((key, value))
                if data[pos:pos + 4] == _U32.pack(crc):
                    closed = True
                    break
        except ValueError:
            pass
        if not closed:
            bad.append((start, end))
            break
        ops += block
        start = pos + 4
    return ops, bad


def salvage_table(io: IO, path: str) -> tuple[list[fmt.Op], list[tuple[str, bytes]]]:
    """Every entry of intact blocks (tombstones included), and (detail, bytes) for each
    damaged part."""
    fd = io.open_read(path)
    name = os.path.basename(path)
    try:
        try:
            table = Table(io, path, 0, fd)
        except DatabaseCorruptError as e:
            size = io.fsize(fd)
            data = io.pread(fd, size, 0)
            ops, bad = _scan_blocks(data)
            return ops, [(f"table {name}: {e.detail}; bytes {a} to {b} unreadable", data[a:b])
                         for a, b in bad] or [(f"table {name}: {e.detail}", b"")]
        ops = []
        damage: list[tuple[str, bytes]] = []
        for i, (offset, length) in enumerate(table._blocks):
            try:
                keys, values = table._block(i)
            except DatabaseCorruptError as e:
                damage.append((f"table {name}: block at {offset}: {e.detail}",
                               io.pread(fd, length, offset)))
                continue
            ops += zip(keys, values, strict=True)
        return ops, damage
    finally:
        io.close(fd)


# ---- the log engine -------------------------------------------------------------------


def _engine_files(io: IO, path: str) -> list[str]:
    out = []
    for n in io.listdir(path):
        if n in (fmt.CURRENT, fmt.CURRENT + ".tmp") or fmt.parse_name(n) is not None:
            out.append(n)
    return sorted(out)


def _sources(io: IO, folder: str) -> tuple[list[str], list[str], list[str]]:
    """The files to read, oldest first, problems met choosing them, and the files the
    manifest names that are missing (what they held is lost, its ids unknown)."""
    names = set(io.listdir(folder))
    problems: list[str] = []
    manifests: list[str] = []
    if fmt.CURRENT in names:
        cur = read_file(io, os.path.join(folder, fmt.CURRENT)).decode("ascii", "replace").strip()
        if cur in names:
            manifests.append(cur)
        else:
            problems.append(f"CURRENT names {cur!r}, which is missing")
    else:
        problems.append("CURRENT is missing")
    numbered = sorted((p[1], n) for n in names if (p := fmt.parse_name(n)) and p[0] == "manifest")
    manifests += [n for _, n in reversed(numbered) if n not in manifests]
    for m in manifests:
        try:
            man = fmt.Manifest.decode(m, read_file(io, os.path.join(folder, m), 1 << 30))
        except DatabaseCorruptError as e:
            problems.append(f"{m}: {e.detail}")
            continue
        files = [fmt.table_name(n) for n, _ in man.tables] + [fmt.log_name(man.log_number)]
        missing = [f for f in files if f not in names]
        problems += [f"{f}, named by {m}, is missing" for f in missing]
        return [f for f in files if f in names], problems, missing
    problems.append("no manifest can be read: every table and log is read, oldest first")
    rest = sorted((p[1], n) for n in names
                  if (p := fmt.parse_name(n)) and p[0] in ("tbl", "log"))
    return [n for _, n in rest], problems, []


def _read_mark(io: IO, path: str) -> dict[str, str] | None:
    p = os.path.join(path, MARK)
    if not io.exists(p):
        return None
    try:
        obj = json.loads(read_file(io, p))
        return {"phase": str(obj["phase"]), "dir": str(obj["dir"])}
    except (ValueError, KeyError, TypeError):
        return None  # torn while written: the rename makes that impossible, but be safe


def _write_mark(io: IO, path: str, phase: str, folder: str) -> None:
    write_file_durable(io, os.path.join(path, MARK),
                       json.dumps({"phase": phase, "dir": folder}).encode())


def _new_folder(io: IO, path: str) -> str:
    qdir = os.path.join(path, atrest.QUARANTINE)
    taken = set(io.listdir(qdir)) if io.is_dir(qdir) else set()
    n = 1
    while f"repair-{n}" in taken:
        n += 1
    return os.path.join(atrest.QUARANTINE, f"repair-{n}")


def _mkdirs(io: IO, path: str, rel: str) -> None:
    here = path
    for part in rel.split(os.sep):
        nxt = os.path.join(here, part)
        if not io.is_dir(nxt):
            with contextlib.suppress(FileExistsError):
                io.mkdir(nxt)
            io.fsync_dir(here)
        here = nxt


def _build(io: IO, path: str, entries: dict[bytes, bytes]) -> None:
    """Write a new store holding ``entries``: table 1, log 2, manifest 3, CURRENT."""
    tables: tuple[tuple[int, int], ...] = ()
    if entries:
        table = os.path.join(path, fmt.table_name(1))
        fd = io.open_create(table + ".tmp")
        try:
            write_entries(io, fd, iter(sorted(entries.items())))
            io.fsync(fd)
            size = io.fsize(fd)
        finally:
            io.close(fd)
        io.rename(table + ".tmp", table)
        tables = ((1, size),)
    io.close(io.open_create(os.path.join(path, fmt.log_name(2))))
    manifest = fmt.Manifest(4, 2, tables)
    fd = io.open_create(os.path.join(path, fmt.manifest_name(3)))
    try:
        io.write(fd, manifest.encode())
        io.fsync(fd)
    finally:
        io.close(fd)
    io.fsync_dir(path)
    write_file_durable(io, os.path.join(path, fmt.CURRENT), f"{fmt.manifest_name(3)}\n".encode())


def salvage_log_files(io: IO, path: str, actions: list[str]) -> list[Damage]:
    """Steps 2 to 6 of the module docstring, holding the engine's lock."""
    mark = _read_mark(io, path)
    if mark is None:
        folder = _new_folder(io, path)
        _write_mark(io, path, "moving", folder)
        mark = {"phase": "moving", "dir": folder}
    else:
        actions.append(f"finishing the repair a kill interrupted ({mark['phase']})")
    folder = mark["dir"]
    full = os.path.join(path, folder)
    if mark["phase"] == "moving":
        _mkdirs(io, path, folder)
        moved = _engine_files(io, path)
        for n in moved:
            io.rename(os.path.join(path, n), os.path.join(full, n))
        io.fsync_dir(full)
        io.fsync_dir(path)
        actions.append(f"moved {len(moved)} files of the store to {folder}/ (kept there)")
        _write_mark(io, path, "building", folder)
    for n in _engine_files(io, path):  # a build a kill interrupted
        io.unlink(os.path.join(path, n))
    files, problems, missing = _sources(io, full)
    actions += problems
    entries: dict[bytes, bytes | None] = {}
    found: list[tuple[int, str, bytes]] = []  # (source index, detail, bytes)
    touched: list[set[bytes]] = []
    for i, name in enumerate(files):
        p = os.path.join(full, name)
        keys: set[bytes] = set()
        if name.endswith(".tbl"):
            ops, bad = salvage_table(io, p)
            for k, v in ops:
                entries[k] = v
                keys.add(k)
            found += [(i, d, b) for d, b in bad]
        else:
            def apply(batch: list[fmt.Op], keys: set[bytes] = keys) -> None:
                for k, v in batch:
                    entries[k] = v
                    keys.add(k)

            got = replay(io, p, apply)
            found += [(i, f"log {name}: bytes {r.start} to {r.end} hold no intact record",
                       r.sample) for r in got.bad]
            if got.valid < got.size and not any(r.last for r in got.bad):
                actions.append(f"log {name}: a torn tail of {got.size - got.valid} bytes "
                               "(the last write, cut short) was left out")
        touched.append(keys)
        actions.append(f"read {name}: {len(keys)} keys")
    live = {k: v for k, v in entries.items() if v is not None}
    _build(io, path, live)
    io.unlink(os.path.join(path, MARK))
    io.fsync_dir(path)
    actions.append(f"wrote a new store of {len(live)} keys")
    # a file the manifest names is gone: whatever it held is lost, ids unknown (counted
    # in ``lost_unknown``; the old store is kept in ``folder``)
    damage = [Damage(full, f"{f}, which the store's manifest names, is missing") for f in missing]
    for i, detail, data in found:
        later = frozenset().union(*touched[i + 1:]) if i + 1 < len(touched) else frozenset()
        damage.append(Damage(os.path.join(full, files[i]), detail, data, frozenset(later)))
    return damage


class Reopened(Protocol):
    """What the repair reads from the queue it opens over the salvaged store (a
    ``KvQueue``; the queue's module passes its opener in, as it imports this one)."""

    last_recovery: RecoveryReport | None

    @property
    def kv(self) -> KV: ...

    def list_queue(self) -> Iterator[QueuedMail]: ...

    def close(self) -> None: ...


def _finish(reopen: Callable[[], Reopened], path: str, damage: list[Damage],
            rest_problems: list[str], kept: list[str], actions: list[str]) -> Repaired:
    q = reopen()
    try:
        report = lostids.merge(q.last_recovery or RecoveryReport(), q.kv, path, damage, None,
                               rest_problems, kept)
        entries = list(q.list_queue())
        return Repaired(report, actions, len({e.message_id for e in entries}), len(entries))
    finally:
        q.close()


def repair_log(path: str, io: IO | None, reopen: Callable[[], Reopened]) -> Repaired:
    """Salvage a log-engine store (see the module docstring), then open the queue with
    ``reopen`` (``KvQueue.repair_log`` passes ``KvQueue.open_log``).  Raises
    ``DatabaseLockedError`` if a queue has it open."""
    io = io if io is not None else OsIO()
    if not io.is_dir(path):
        raise InvalidInputError(f"{path} is not a directory")
    lock = io.lock_exclusive(os.path.join(path, fmt.LOCK))
    if lock is None:
        raise DatabaseLockedError(path)
    actions: list[str] = []
    try:
        rest, problems, kept = atrest.take(io, path)
        if rest is not None:
            actions.append("compared with the record of the last clean close")
        damage = salvage_log_files(io, path, actions)
    finally:
        io.unlock(lock)
    return _finish(reopen, path, damage, problems, kept, actions)


def repair_leveldb(path: str, reopen: Callable[[], Reopened]) -> Repaired:
    """Salvage a LevelDB store with LevelDB's ``RepairDB``, then open the queue with
    ``reopen`` (``KvQueue.repair_leveldb`` passes ``KvQueue.open_leveldb``)."""
    import fcntl

    import plyvel  # type: ignore[import-untyped]

    from queue_ref.kv.leveldb import LOCK_NAME, OPTIONS, os_error
    from queue_ref.kv.leveldb_manifest import missing_log

    io = OsIO()
    if not os.path.isdir(path):
        raise InvalidInputError(f"{path} is not a directory")
    actions: list[str] = []
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatabaseLockedError(path) from None
        rest, problems, kept = atrest.take(io, path)
        if rest is not None:
            actions.append("compared with the record of the last clean close")
        # a log the manifest names that is gone: what it held is lost, ids unknown.
        # RepairDB writes a manifest that names no log, so a repair killed after it would
        # not see the loss again: it is recorded first, and forgotten once reported
        gone = missing_log(path) or _recorded_lost_log(path)
        if gone is not None:
            write_file_durable(io, os.path.join(path, LOST_LOG), gone.encode("ascii") + b"\n")
        damage = [] if gone is None else [Damage(
            os.path.join(path, gone), f"{gone}, which the store's manifest names as its "
            "log, is missing")]
        lost_dir = os.path.join(path, "lost")
        before = set(os.listdir(lost_dir)) if os.path.isdir(lost_dir) else set()
        try:
            plyvel.repair_db(path, **OPTIONS)
        except plyvel.Error as e:
            raise os_error("RepairDB", e, path) from e
        after = set(os.listdir(lost_dir)) if os.path.isdir(lost_dir) else set()
        archived = sorted(after - before)
        actions.append("ran LevelDB's RepairDB" + (
            "; the files it replaced or could not use are kept in lost/: "
            + ", ".join(archived) if archived else ""))
        kept = kept + [os.path.join("lost", n) for n in archived]
    finally:
        os.close(fd)
    done = _finish(reopen, path, damage, problems, kept, actions)
    with contextlib.suppress(FileNotFoundError):
        io.unlink(os.path.join(path, LOST_LOG))
        io.fsync_dir(path)
    return done


#: Names the log a LevelDB repair found missing, from before ``RepairDB`` until reported.
LOST_LOG = "queue-ref.lost-log"


def _recorded_lost_log(path: str) -> str | None:
    try:
        with open(os.path.join(path, LOST_LOG), encoding="ascii") as f:
            name = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if re.fullmatch(r"[0-9]{6,}\.log", name) else None
