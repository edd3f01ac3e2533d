"""The record a KV queue leaves when it closes cleanly, checked when it is next opened.

A store at rest can still be damaged: a flipped bit, a file cut short or removed.  Most
of that the engines see (every record and block carries a CRC), but not all: a log cut
at a record boundary, or cut inside its last record, looks exactly like the torn tail a
crash leaves, which recovery must drop without a word.  So ``KvQueue.close`` writes
``queue-ref.closed`` into the store's directory: the size and CRC32 of each of the
engine's files that has no whole-file check of its own (logs, manifest, ``CURRENT``;
tables only by size, their blocks are checked), and every entry the queue held (QUEUED
or INFLIGHT, with its schedule; PENDING_CLEANUP ones by id).  The files are synced
first, the record is written by temp, fsync, rename, directory fsync, and it is a
sealed record (``kv_records.seal``: it carries its own checksum).

The next open, before the engine touches anything, compares the files: each that
changed is copied to ``quarantine/`` (the engine may rewrite it) and reported; then it
renames the record to ``queue-ref.closed.opened`` (durably), so the files are compared
once only: a record under its first name means no write happened since it was made.
After recovery the open compares the entries: an entry the queue held at close and no
longer holds was lost to damage and is reported with its message id
(``RecoveryReport.lost``); then the record is removed.  Recovery never takes a queued or
inflight entry out of the queue but for damage, so the comparison holds also after an
open that failed or crashed (and after ``queue-ref repair``), until one succeeds.  After
a crash of the queue itself there is no record, and only the engines' checks apply.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass, field

from queue_ref.io import IO, read_file, write_file_durable
from queue_ref.kv import keys, kv_records
from queue_ref.kv.base import KV
from queue_ref.kv.engine_errors import DatabaseLockedError
from queue_ref.kv.kv_records import BadRecord, EntryRec

NAME = "queue-ref.closed"
OPENED = f"{NAME}.opened"  # the record, once an open has checked the files against it
QUARANTINE = "quarantine"
#: Files of the engines' that are not part of their data.
_SKIP = frozenset({"LOCK", "LOG", "LOG.old", "queue-ref.lock", "relay.pid"})
_TABLE_SUFFIXES = (".tbl", ".ldb", ".sst")
_CHUNK = 1 << 20


@dataclass
class AtRest:
    """What a clean close recorded: files (name -> size, CRC32 or None for a table),
    entries held (message id -> index -> (time, attempts)), entries pending cleanup."""

    files: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    live: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    retired: dict[int, set[int]] = field(default_factory=dict)


def entries_of(kv: KV) -> AtRest:
    """The entries the store holds now (files left empty)."""
    out = AtRest()
    for prefix, state in ((keys.ZONE, kv_records.QUEUED), (keys.INFLIGHT, kv_records.INFLIGHT),
                          (keys.HELD, kv_records.HELD)):
        for k, v in kv.iterate(prefix, keys.end_of(prefix)):
            try:
                mid, idx = (keys.parse_indexed(k)[1:] if state == kv_records.QUEUED
                            else keys.parse_entry(k))
                rec = EntryRec.decode(v, mid, idx, state)
            except (keys.BadKey, BadRecord):
                continue
            out.live.setdefault(mid, {})[idx] = (rec.schedule.at, rec.schedule.attempts)
    for k, _ in kv.iterate(keys.CLEANUP, keys.end_of(keys.CLEANUP)):
        try:
            mid, idx = keys.parse_entry(k)
        except keys.BadKey:
            continue
        out.retired.setdefault(mid, set()).add(idx)
    return out


def _crc(io: IO, path: str) -> tuple[int, int]:
    fd = io.open_read(path)
    try:
        size = io.fsize(fd)
        crc = pos = 0
        while pos < size:
            b = io.pread(fd, min(_CHUNK, size - pos), pos)
            if not b:
                break
            crc = zlib.crc32(b, crc)
            pos += len(b)
        return pos, crc
    finally:
        io.close(fd)


def _engine_files(io: IO, path: str) -> list[str]:
    return sorted(n for n in io.listdir(path)
                  if n not in _SKIP and not n.startswith("queue-ref.") and not n.endswith(".tmp")
                  and not io.is_dir(
                      os.path.join(path, n)))


def write(io: IO, path: str, rest: AtRest) -> None:
    """Sync the engine's files and record them with ``rest``'s entries (the engine is
    closed: nothing changes them meanwhile)."""
    files: dict[str, tuple[int, int | None]] = {}
    for name in _engine_files(io, path):
        p = os.path.join(path, name)
        if name.endswith(_TABLE_SUFFIXES):
            files[name] = (io.lstat(p).st_size, None)
            continue
        fd = io.open_read(p)
        try:
            io.fsync(fd)
        finally:
            io.close(fd)
        files[name] = _crc(io, p)
    io.fsync_dir(path)
    obj = {"k": "closed", "v": 1,
           "files": {n: [s, c] for n, (s, c) in files.items()},
           "live": {str(m): {str(i): list(s) for i, s in sorted(e.items())}
                    for m, e in sorted(rest.live.items())},
           "retired": {str(m): sorted(e) for m, e in sorted(rest.retired.items())}}
    write_file_durable(io, os.path.join(path, NAME), kv_records.seal(obj))


def read(io: IO, path: str, name: str = NAME) -> AtRest | str | None:
    """The record of the last clean close; None if there is none; a reason if it is
    damaged (then nothing can be compared)."""
    p = os.path.join(path, name)
    if not io.exists(p):
        return None
    try:
        obj = kv_records.unseal(read_file(io, p, 1 << 30), "closed")
        out = AtRest()
        for n, (s, c) in obj["files"].items():
            out.files[str(n)] = (int(s), None if c is None else int(c))
        for m, e in obj["live"].items():
            out.live[int(m)] = {int(i): (int(s[0]), int(s[1])) for i, s in e.items()}
        for m, e in obj["retired"].items():
            out.retired[int(m)] = {int(i) for i in e}
    except (BadRecord, KeyError, TypeError, ValueError, AttributeError) as e:
        return f"the record of the last clean close ({NAME}) is damaged: {e}"
    return out


def check_files(io: IO, path: str, rest: AtRest) -> tuple[list[str], list[str]]:
    """Compare the engine's files with the record; copy each changed one to
    ``quarantine/``.  Returns (problems, files kept aside relative to ``path``)."""
    problems: list[str] = []
    kept: list[str] = []
    for name, (size, crc) in sorted(rest.files.items()):
        p = os.path.join(path, name)
        if not io.exists(p):
            problems.append(f"{name} is missing (it was {size} bytes at the last clean close)")
            continue
        if crc is None:
            now = io.lstat(p).st_size
            if now == size:
                continue
            what = f"{name} is {now} bytes, {size} at the last clean close"
        else:
            now, now_crc = _crc(io, p)
            if (now, now_crc) == (size, crc):
                continue
            what = (f"{name} changed at rest ({now} bytes, {size} at the last clean close"
                    f"{'' if now != size else ', another CRC'})")
        kept.append(keep_copy(io, path, name))
        problems.append(f"{what}; a copy is kept in {kept[-1]}")
    return problems, kept


def keep_copy(io: IO, path: str, name: str) -> str:
    """Copy ``path/name`` to ``path/quarantine/`` durably; returns the copy's path
    relative to ``path``."""
    qdir = os.path.join(path, QUARANTINE)
    if not io.is_dir(qdir):
        with contextlib.suppress(FileExistsError):
            io.mkdir(qdir)
        io.fsync_dir(path)
    dest, n = f"{name}.at-rest", 0
    while io.exists(os.path.join(qdir, dest)):
        n += 1
        dest = f"{name}.at-rest.{n}"
    src = io.open_read(os.path.join(path, name))
    out = io.open_create(os.path.join(qdir, dest))
    try:
        size = io.fsize(src)
        pos = 0
        while pos < size:
            b = io.pread(src, min(_CHUNK, size - pos), pos)
            if not b:
                break
            io.write(out, b)
            pos += len(b)
        io.fsync(out)
    finally:
        io.close(out)
        io.close(src)
    io.fsync_dir(qdir)
    return os.path.join(QUARANTINE, dest)


def compare(rest: AtRest, now: AtRest) -> tuple[dict[int, list[int]], list[str]]:
    """Entries held at the last clean close and not now (message id -> indexes), and
    problems (schedules changed at rest, retired entries deliverable again)."""
    lost: dict[int, list[int]] = {}
    problems: list[str] = []
    for mid, entries in sorted(rest.live.items()):
        have = now.live.get(mid, {})
        for idx, sched in sorted(entries.items()):
            if idx not in have:
                lost.setdefault(mid, []).append(idx)
            elif have[idx] != sched:
                problems.append(f"entry {keys.entry_id(mid, idx)}: schedule {have[idx]} "
                                f"after damage at rest, {sched} at the last clean close")
    return lost, problems


def resurrected(rest: AtRest, now: AtRest) -> dict[str, str]:
    """Entries deliverable now that were not at the last clean close (entry id -> what
    they were then).  Nothing creates an entry between a close and the next open, so
    each came back from damage (a log cut short drops the records that finished it):
    C3 says it must not be delivered again."""
    back: dict[str, str] = {}
    for mid, entries in sorted(now.live.items()):
        held = rest.live.get(mid, {})
        for idx in sorted(entries):
            if idx not in held:
                was = "pending cleanup" if idx in rest.retired.get(mid, set()) else "gone"
                back[keys.entry_id(mid, idx)] = was
    return back


def take(io: IO, path: str) -> tuple[AtRest | None, list[str], list[str]]:
    """At an open, before the engine touches its files: the record of the last clean close
    (None if there is none), the problems found comparing the files with it, and the
    copies kept of changed files.  The record is renamed to ``OPENED`` (durably): the
    files are compared only once, but its entries serve until an open has compared them
    (``forget``), also if this open fails and ``queue-ref repair`` runs next."""
    if not io.is_dir(path):
        return None, [], []
    got = read(io, path)
    problems: list[str] = []
    kept: list[str] = []
    if got is None:
        again = read(io, path, OPENED)
        return (again if isinstance(again, AtRest) else None), [], []
    if isinstance(got, str):
        problems.append(got)
        kept.append(keep_copy(io, path, NAME))
        rest = None
    else:
        problems, kept = check_files(io, path, got)
        rest = got
    try:
        io.rename(os.path.join(path, NAME), os.path.join(path, OPENED))
    except FileNotFoundError:
        # another process opening the queue took the record between our read and now:
        # it compared the files first and holds them, and what this open took for
        # changes may be its writes, so the copies made of them are no evidence
        for copy in kept:
            with contextlib.suppress(OSError):
                io.unlink(os.path.join(path, copy))
        raise DatabaseLockedError(path) from None
    io.fsync_dir(path)
    return rest, problems, kept


def forget(io: IO, path: str) -> None:
    """Remove the record durably, once an open has compared the entries with it."""
    for name in (NAME, OPENED):
        p = os.path.join(path, name)
        if io.exists(p):
            io.unlink(p)
            io.fsync_dir(path)
