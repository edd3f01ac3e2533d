"""Broken variants of the project's backends, one bug each, as ``queue-ref certify`` takes
them.  Each is caught by the check named in ``docs/certify.md`` with the clause it breaks;
the project's own backends pass the same checks.  Never use them for mail.

    queue-ref certify conformance.examples.broken_backends:swallow_eio --only io-errors
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from conformance.harness.few_names_io import FewNamesIO
from queue_ref.io import IO, OsIO
from queue_ref.storage import Storage


def swallow_eio(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) that logs and forgets a failed fsync and
    reports success: the io-errors check fails it on C9 (a power cut right after the
    success loses what it acknowledged)."""
    from conformance.crashexplore.broken_fs_variants import SwallowFsyncError
    from conformance.crashexplore.explored_backends import deterministic_fs

    return deterministic_fs(SwallowFsyncError)(root, io if io is not None else OsIO())


def _fs_variant(cls: Any, root: str, io: IO | None) -> Storage:
    """The FsQueue subclass ``cls`` at ``root``: on the real disk with a random owner
    token when no I/O seam is given, else opened as crash exploration opens it (owner
    and message ids from the directory: ``deterministic_fs``)."""
    from conformance.crashexplore.explored_backends import deterministic_fs

    return cls(root) if io is None else deterministic_fs(cls)(root, io)


# ---- limits -----------------------------------------------------------------------------

#: Names per file of the small file system the limits variants run on.
SMALL_LINKS = 200


class FullDiskAsEIO(IO):
    """A disk layer that reports every failure as EIO, ``ENOSPC`` included (as a layer
    that raises one error for any failed call does).  Each call goes to ``inner``."""

    def __init__(self, inner: IO) -> None:
        self.inner = inner


def _as_eio(name: str) -> Callable[..., object]:
    def call(self: FullDiskAsEIO, *args: object, **kwargs: object) -> object:
        try:
            return getattr(self.inner, name)(*args, **kwargs)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(errno.EIO, f"I/O error ({e})", e.filename) from e
            raise
    return call


for _name, _fn in vars(IO).items():
    if callable(_fn) and not _name.startswith("_"):
        setattr(FullDiskAsEIO, _name, _as_eio(_name))


def fs_full_disk_as_eio(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue over a disk layer that reports a full disk
    as EIO: every operation on a full disk raises a plain ``StorageIOError`` (the disk
    failed) instead of ``NoSpaceError``.  A relay then answers 451 instead of 452 and
    an operator looks for a failing disk instead of freeing space; the queue's states
    are all right.  Only io-errors' rule that ENOSPC must read as ``NoSpaceError``
    fails it (C9)::

        queue-ref certify conformance.examples.broken_backends:fs_full_disk_as_eio \\
            --only io-errors
    """
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue import FsQueue

    if io is None:
        return FsQueue(root, FullDiskAsEIO(OsIO()))
    return deterministic_fs(FsQueue)(root, FullDiskAsEIO(io))


def fs_listing_raw_oserror(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose listings read their directory outside the guard that
    turns a disk error into ``StorageIOError``: on a failing disk ``list_queue``,
    ``find_inflight``, ``find_pending_cleanup`` and ``list_domain`` raise a bare
    ``OSError``, which a relay's scheduler does not expect (the project's queue did this
    until io-errors failed read calls).  Only io-errors' read trials fail it (C9)::

        queue-ref certify conformance.examples.broken_backends:fs_listing_raw_oserror \\
            --only io-errors
    """
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.diskutil import listdir_or_empty

    class RawListing(FsQueue):
        def _listdir(self, directory: str, *, ordered: bool = True) -> list[str]:
            # the bug: no storage_error
            return listdir_or_empty(self.io, directory, ordered=ordered)

    if io is None:
        return RawListing(root, OsIO())
    return deterministic_fs(RawListing)(root, io)


def kv_records_rest_after_failed_sync(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that writes its clean-close record (``atrest.py``) after
    a failed sync too, from what its memory holds: a write whose sync failed is in the log
    but not applied, so the next open finds the log ahead of the record and names the
    entry lost to damage at rest, though nothing was damaged (the project's KV queue did
    this until io-errors judged what recovery names).  Only io-errors' rule that a
    restart after a failed call names nothing lost fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_records_rest_after_failed_sync \\
            --only io-errors
    """
    from queue_ref.kv import atrest
    from queue_ref.kv.kv_queue import KvQueue

    class RecordsAnyway(KvQueue):
        def close(self) -> None:
            if self._closed or self._at is None:
                return super().close()
            at, rest = self._at, atrest.entries_of(self._kv)  # the bug: even after a failure
            super().close()
            atrest.write(*at, rest)

    return RecordsAnyway.open_log(root, io)


#: The lock files this process holds with ``_posix_lock`` (fd -> path).
_POSIX_HELD: dict[int, str] = {}


def _posix_lock(path: str, *, blocking: bool = False) -> int | None:
    """A liveness lock as LevelDB takes its ``LOCK``: a POSIX record lock (``lockf``), and
    a set of the paths this process holds, since record locks do not exclude the
    process's own second open.  A second open of a held path opens the file, finds the
    path in the set and closes its descriptor, which drops the process's record lock
    (POSIX drops them all when any descriptor of the file is closed)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    if path in _POSIX_HELD.values():
        os.close(fd)  # the bug: this close lets go of the first open's lock
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    _POSIX_HELD[fd] = path
    return fd


def _posix_unlock(fd: int) -> None:
    _POSIX_HELD.pop(fd, None)
    os.close(fd)


def kv_posix_lock_dropped(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose one-owner lock is a POSIX record lock, as
    LevelDB's ``LOCK`` is: a second open in the same process is refused, as it should
    be, but refusing closes a descriptor of the lock file, which drops the first open's
    lock; another process then opens the queue beside it and its recovery requeues the
    entries the first open is delivering (mutant ``7816f97f`` of the mutation run lost
    the project's own flock on the LevelDB queue the same way).  Only the second-open
    check fails it (C4)::

        queue-ref certify conformance.examples.broken_backends:kv_posix_lock_dropped \\
            --only second-open
    """
    from queue_ref.kv.kv_queue import KvQueue

    seam = io if io is not None else OsIO()
    seam.lock_exclusive = _posix_lock  # type: ignore[method-assign]
    seam.unlock = _posix_unlock  # type: ignore[method-assign]
    return KvQueue.open_log(root, seam)


def fs_small_links(root: str) -> Storage:
    """The filesystem queue on a file system of 200 names per file: it declares 99
    recipients per message (two names each, and the message's own) and refuses more
    before anything is stored."""
    from queue_ref.fsqueue import FsQueue

    return FsQueue(root, FewNamesIO(SMALL_LINKS))


def fs_unchecked_recipients(root: str) -> Storage:
    """As ``fs_small_links``, without the up-front recipient count check: a commit beyond
    the limit fails on EMLINK halfway through its links (StorageIOError, not
    InvalidInputError).  The limits check fails it on C9."""
    from queue_ref.fsqueue import FsQueue

    class UncheckedRecipients(FsQueue):
        def _check_recipient_count(self, n: int) -> None:
            return None

    return UncheckedRecipients(root, FewNamesIO(SMALL_LINKS))


def kv_unchecked_schedule(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) accepting any ``Schedule`` instance as it comes: a forged
    one with a NaN or negative time is stored or fails deep inside (a bare ValueError).
    The limits check fails it on C9."""
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.storage import InvalidInputError, Schedule

    class UncheckedSchedule(KvQueue):
        @staticmethod
        def _schedule(schedule: object) -> Schedule:
            if not isinstance(schedule, Schedule):
                raise InvalidInputError("schedule must be a Schedule")
            return schedule

    store = UncheckedSchedule.open_log(root, io)
    assert isinstance(store, UncheckedSchedule)
    return store


# ---- crash coverage ------------------------------------------------------------------------

def fs_done_outside_seam(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose ``send_done`` renames and fsyncs with
    ``os`` directly instead of through its I/O seam, while declaring ``io-seam``.  Nothing
    it does is wrong on a real disk, but the disks crash exploration rebuilds from the
    seam's trace never see it: a crash at rest after ``send_done`` brings the entry back
    (crash-exploration, C3), which is what a backend hiding I/O from the seam earns."""
    from os.path import dirname

    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue import FsQueue
    from queue_ref.storage import InflightMail, PendingCleanupMail

    class DoneOutsideSeam(FsQueue):
        default_sync = "fsync"

        def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
            h = self._take(mail, InflightMail)
            e = self._entry(h)
            src, dst = self.layout.inflight_link(e, self.owner), self.layout.cleanup_link(e)
            with self._guard("send_done", h):
                try:
                    os.rename(src, dst)
                except FileNotFoundError:
                    return None
                for d in {dirname(src), dirname(dst)}:
                    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            return self._issue(PendingCleanupMail, h.entry_id, h.message_id, h.schedule,
                               h._extra)

    return deterministic_fs(DoneOutsideSeam)(root, io if io is not None else OsIO())


# ---- damage at rest ------------------------------------------------------------------------

def fs_unverified_bodies(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose reader hands out a body without checking it against the
    digest in its envelope: a bit flipped in a committed body is delivered altered.  No
    crash or fault check alters committed bytes; the damage-at-rest check fails it on C6."""
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.reader import FsMailReader
    from queue_ref.storage import InflightMail, MailReader

    class UnverifiedBodies(FsQueue):
        def read_inflight(self, mail: InflightMail) -> MailReader:
            reader = super().read_inflight(mail)
            assert isinstance(reader, FsMailReader)
            reader._expect = ""

            def trust() -> None:
                reader._verified = True

            reader._verify_end = trust  # type: ignore[method-assign]
            return reader

    return UnverifiedBodies(root, io if io is not None else OsIO())


def kv_resurrecting(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that does not compare the entries it holds after a
    damaged open with those it held at its last clean close: a log cut short drops the
    records that finished delivered entries, and they are delivered again.  The
    damage-at-rest check fails it on C3."""
    from collections.abc import Mapping

    from queue_ref.kv.kv_queue import KvQueue

    class Resurrecting(KvQueue):
        def _finish_resurrected(self, back: Mapping[str, str]) -> None:
            return None

    store = Resurrecting.open_log(root, io)
    assert isinstance(store, Resurrecting)
    return store


def kv_damage_as_disk_error(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that refuses to open over a damaged ``CURRENT``,
    manifest or log, as it must, but says so with a plain ``StorageIOError`` (the disk
    failed: retry later) instead of ``DamagedStoreError`` (the store's files are damaged:
    repair it), as the project's KV queue once did.  An operator, or a relay that
    retries its open, waits for a disk that is fine.  The damage-at-rest check fails it
    on C9::

        queue-ref certify conformance.examples.broken_backends:kv_damage_as_disk_error \\
            --only damage-at-rest
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.storage import DamagedStoreError, StorageIOError

    try:
        return KvQueue.open_log(root, io)
    except DamagedStoreError as e:
        raise StorageIOError(str(e)) from e  # the bug: the cause is lost


def kv_mid_log_damage_as_torn_tail(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that reads its log up to the first damaged record and
    takes the rest for a torn tail: after a flipped bit in the middle of the log, every
    later message is named lost (the clean-close record names them), although its records
    are intact.  Nothing is lost silently, so only the damage-at-rest rule that a flip
    takes out no message whose body lies whole after it fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_mid_log_damage_as_torn_tail \\
            --only damage-at-rest
    """

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine, wal

    def up_to_damage(io: IO, path: str, apply: Callable[[list[wal.Op]], None]) -> wal.Replayed:
        fd = io.open_read(path)
        try:
            reader = wal._Reader(io, fd, io.fsize(fd))
            out = wal.Replayed(0, reader.size)
            while out.valid < reader.size:
                got = wal._intact_at(reader, out.valid)
                if got is None:
                    break  # the bug: damage in the middle read as a torn tail
                apply(got[0])
                out.valid = got[1]
            return out
        finally:
            io.close(fd)

    class TornTailEngine(LogEngine):
        _replay = staticmethod(up_to_damage)

    return KvQueue.open_log(root, io, engine=TornTailEngine)


def kv_last_record_as_torn_tail(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that takes a damaged last record of its log for a torn
    tail, whole in length or not, and cuts it off without a word (the project's log
    engine did until damage-at-rest's killed template): after a crash no clean-close
    record names what it held, so a flipped bit in the last, acknowledged commit loses
    that message silently, body and all.  Only the killed template fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_last_record_as_torn_tail \\
            --only damage-at-rest
    """

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine, wal

    def tail_as_torn(io: IO, path: str, apply: Callable[[list[wal.Op]], None]) -> wal.Replayed:
        out = wal.replay(io, path, apply)
        out.bad = [r for r in out.bad if not r.last]  # the bug: a whole last record is torn
        return out

    class TornLastEngine(LogEngine):
        _replay = staticmethod(tail_as_torn)

    return KvQueue.open_log(root, io, engine=TornLastEngine)


def kv_damage_sample_cut(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that keeps only the first 20 bytes of a damaged region of
    its log for its report (the record's header and the start of its first key), so no
    message id is read out of it: the region is counted in ``lost_unknown`` and the
    messages whose commit it held, their ids plain in the damaged bytes, go unnamed.
    After a clean close the clean-close record names them anyway; after a crash nothing
    does.  Only damage-at-rest's rule that a flipped bit names the messages whose ids it
    leaves readable fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_damage_sample_cut \\
            --only damage-at-rest
    """
    import dataclasses

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine, wal

    def cut_samples(io: IO, path: str, apply: Callable[[list[wal.Op]], None]) -> wal.Replayed:
        out = wal.replay(io, path, apply)
        out.bad = [dataclasses.replace(r, sample=r.sample[:20]) for r in out.bad]  # the bug
        return out

    class CutSampleEngine(LogEngine):
        _replay = staticmethod(cut_samples)

    return KvQueue.open_log(root, io, engine=CutSampleEngine)


def kv_footer_unchecked(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that never checks its tables' footer checksum.  The
    magic, the index's place and its checksum are checked apart, so only the entry and
    tombstone counts go unchecked, and they only steer compaction: a count flipped high
    keeps the table out of every merge, so a drained queue holds its dead messages on
    the disk for good.  Nothing is lost or altered; only damage-at-rest's rule that a
    store served over damage it did not see drains as the undamaged one does fails it
    (C8, after a flip near a table's end)::

        queue-ref certify conformance.examples.broken_backends:kv_footer_unchecked \\
            --only damage-at-rest
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine
    from queue_ref.kv.logengine.table import FOOTER_SIZE, Table

    class UncheckedFooter(Table):
        def _footer_fields(self) -> bytes:
            return self._read(self.size - FOOTER_SIZE, FOOTER_SIZE)[:-4]  # the bug: no crc

    class UncheckedFooterEngine(LogEngine):
        _table = UncheckedFooter

    return KvQueue.open_log(root, io, engine=UncheckedFooterEngine)


def kv_fresh_over_missing_current(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that, finding no ``CURRENT``, creates a new database in
    the directory, as LevelDB does with ``create_if_missing`` (its log and manifest
    numbers start again, and the old log is replaced).  Its clean-close record still
    names every message lost, so nothing is lost silently; only damage-at-rest's rule
    that a store keeps the damaged files it cannot serve (every body that lay whole on
    the disk before the open still lies whole there after it) fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_fresh_over_missing_current \\
            --only damage-at-rest
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine

    class FreshOverData(LogEngine):
        def _holds_data(self) -> bool:
            return False  # the bug: the old log and manifest are taken for a crashed creation

    return KvQueue.open_log(root, io, engine=FreshOverData)


def kv_repair_keeps_its_mark(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose repair writes the salvaged store but skips removing
    its ``REPAIR`` mark (the one step after the new store is in place): the store it
    leaves refuses every open as a repair still under way, so every message it salvaged
    is out of reach.  Its queue is the project's: only damage-at-rest's judging of the
    repair a refusal declares (``DamagedStoreError.repair``) fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_repair_keeps_its_mark \\
            --only damage-at-rest
    """
    from queue_ref.kv import salvage
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.storage import DamagedStoreError, RecoveryReport

    class KeepsMark(OsIO):
        def unlink(self, path: str) -> None:
            if os.path.basename(path) != salvage.MARK:  # the bug
                super().unlink(path)

    def repair() -> RecoveryReport:
        return KvQueue.repair_log(root, KeepsMark()).report

    try:
        return KvQueue.open_log(root, io)
    except DamagedStoreError as e:
        raise DamagedStoreError(str(e), repair=repair) from e


def kv_flush_drops_tombstones(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose every flush drops deletions, as only a merge down
    to the oldest table may (mutant ``37a6da74`` of the mutation run): once a flush leaves
    an older table out of its merge, the entries delivered since come back from it.  Its
    clean close recorded them as done, so the next open finishes them again: nothing is
    delivered twice, but that open names their message lost with nothing damaged.  Only
    damage-at-rest's rule that a trial with nothing damaged names nothing lost fails it
    (C6; the deep template's undamaged trial)::

        queue-ref certify conformance.examples.broken_backends:kv_flush_drops_tombstones \\
            --only damage-at-rest
    """
    from collections.abc import Iterator

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine
    from queue_ref.kv.logengine import format as fmt
    from queue_ref.kv.logengine.merge import drop_tombstones
    from queue_ref.kv.logengine.table import Table

    class DropsTombstones(LogEngine):
        def _write_tables(self, entries: Iterator[fmt.Op]) -> list[Table]:
            return super()._write_tables(drop_tombstones(entries))  # the bug: at every flush

    return KvQueue.open_log(root, io, engine=DropsTombstones)


def kv_log_never_spills(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose engine ignores the hint of an enqueue streaming a
    big body in (``KV.spill``): the body stays in the memtable up to its whole limit
    (32 MiB, room for a relay's mail in flight), so a 100 MB body takes 32 MiB of heap
    while it is written.  Only the streaming check fails it (the heap under 16 MiB)::

        queue-ref certify conformance.examples.broken_backends:kv_log_never_spills \\
            --only streaming
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine

    class NeverSpills(LogEngine):
        def spill(self) -> None:
            """The bug: the hint is ignored."""

    return KvQueue.open_log(root, io, engine=NeverSpills)


def kv_failed_commit_keeps_chunks(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that keeps a large body's chunks after its commit failed
    for a full disk, although the engine cut the log back and knows nothing of the commit
    was written (as the project's KV queue did until io-errors streamed large bodies):
    they stay until the next open's recovery, megabytes at every retry of a large message
    on a full disk.  io-errors fails it on C8 in its large-body trials (one in eight: a
    1.6 MB body written in 100-300 KB pieces, a call failed while it streams in)::

        queue-ref certify conformance.examples.broken_backends:kv_failed_commit_keeps_chunks \\
            --only io-errors
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine

    class KeepsChunks(LogEngine):
        def left_nothing(self, error: OSError) -> bool:
            return False  # the bug: a failed write is always taken for a maybe-written one

    return KvQueue.open_log(root, io, engine=KeepsChunks)


def kv_drops_rest_after_carry(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose enqueuer, when a write completes the partial
    64 KiB chunk the previous write left, stores that chunk and drops the rest of the
    write.  A body written in one piece, or in pieces of whole chunks (the streaming
    check's 64 KiB), is stored whole; one written in pieces of other sizes (a relay's
    DATA phase) is acknowledged and then fails its digest when read: the message is
    lost.  io-errors' large-body trials (1.6 MB bodies in 100-300 KB pieces) fail it::

        queue-ref certify conformance.examples.broken_backends:kv_drops_rest_after_carry \\
            --only io-errors
    """
    from collections.abc import Mapping

    from queue_ref.kv.core import CHUNK
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.streams import KvEnqueuer
    from queue_ref.storage import Enqueuer

    class DropsRest(KvEnqueuer):
        def write(self, data: bytes) -> None:
            fill = CHUNK - len(self._pending) if self._pending else len(data)
            super().write(data[:fill])
            rest = memoryview(data)[fill:]
            # the bug: the rest is hashed and counted, as if written, and dropped
            self._hash.update(rest)
            self._size += len(rest)

    class DropsRestQueue(KvQueue):
        def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None
                    ) -> Enqueuer:
            enq = super().enqueue(mail_from, params)
            enq.__class__ = DropsRest
            return enq

    return DropsRestQueue.open_log(root, io)


def kv_table_miss_as_tombstone(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose table lookup answers "deleted" for a key inside the
    table's key range that the table does not hold, instead of "not here": once a newer
    table's range spans keys that only an older table holds, those keys vanish, and the
    messages they belong to with them.  Nothing is damaged, so only damage-at-rest's deep
    template (two tables whose key ranges overlap, read back undamaged) shows it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_table_miss_as_tombstone \
            --only damage-at-rest
    """
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine
    from queue_ref.kv.logengine.table import Table

    class MissIsTombstone(Table):
        def get(self, key: bytes) -> tuple[bool, bytes | None]:
            found, value = super().get(key)
            inside = bool(self.last_keys) and self.first_key <= key <= self.last_keys[-1]
            return (True, None) if inside and not found else (found, value)  # the bug

    class MissIsTombstoneEngine(LogEngine):
        _table = MissIsTombstone

    return KvQueue.open_log(root, io, engine=MissIsTombstoneEngine)


def kv_table_checksum_half_checked(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose table blocks are refused only when the stored CRC
    is above the one computed (``>`` where ``!=`` belongs): about half the damaged blocks
    are read as good.  Damage to a body is still caught by the queue's own digests, so
    only flips in the table's own structure (keys, lengths), which damage-at-rest's deep
    template aims at, show it: an entry's key read wrong makes it vanish silently or fail
    as a disk error (C6, C9)::

        queue-ref certify conformance.examples.broken_backends:kv_table_checksum_half_checked \
            --only damage-at-rest
    """
    import zlib

    from queue_ref.kv.engine_errors import DatabaseCorruptError
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine, table

    class HalfChecked(table.Table):
        def _block(self, i: int) -> tuple[list[bytes], list[bytes | None]]:
            offset, length = self._blocks[i]
            raw = self._read(offset, length)
            data = raw[:-4]
            if table._U32.unpack(raw[-4:])[0] > zlib.crc32(data):  # the bug: not !=
                raise DatabaseCorruptError(self.path, f"block checksum mismatch at {offset}")
            return table._parse_block(self.path, data)

    class HalfCheckedEngine(LogEngine):
        _table = HalfChecked

    return KvQueue.open_log(root, io, engine=HalfCheckedEngine)


def fs_envelope_length_unbounded(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) that bounds the envelope length its trailer
    gives by the largest envelope, but not by the file's size: a damaged digit in the
    trailer makes it read at a negative offset (EINVAL), and opening the whole queue fails
    with a ``StorageIOError`` (the disk failed) over one damaged message, instead of
    quarantining that message and serving the rest.  The damage-at-rest check, by a
    framing flip (a low bit of a digit in the last bytes of a file), fails it on C9::

        queue-ref certify conformance.examples.broken_backends:fs_envelope_length_unbounded \\
            --only damage-at-rest
    """
    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.fsqueue.metadata import MAX_ENVELOPE

    class LengthUnbounded(_Fsync):
        @staticmethod
        def _envelope_fits(n: int, size: int) -> bool:
            return n <= MAX_ENVELOPE  # the bug: not bounded by the file's size

    return _fs_variant(LengthUnbounded, root, io)


def fs_recipient_limit_off_by_one(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue declaring one recipient more than a commit can take (every
    recipient is a name of the message file, and the file system allows only so many):
    a commit of exactly the declared ``max_recipients`` is refused with
    ``InvalidInputError``.  Only a commit at the limit shows it: the limits check fails it
    on C9::

        queue-ref certify conformance.examples.broken_backends:fs_recipient_limit_off_by_one \\
            --only limits
    """
    from dataclasses import replace as _replace

    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.storage import Limits

    class OffByOne(_Fsync):
        @property
        def limits(self) -> Limits:
            lim = super().limits
            assert lim.max_recipients is not None
            return _replace(lim, max_recipients=lim.max_recipients + 1)

    return _fs_variant(OffByOne, root, io)


def fs_read_all_returns_nothing(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose reader answers ``read()`` (all that remains, the
    default) with ``b""`` as if the body were over: a sender that reads that way sends an
    empty message, and no error says so.  Readers in fixed pieces (``read_all``, 64 KiB)
    are right.  The lockstep checks read every entry back in turn with every piece size
    (-1 among them) and fail it on C6::

        queue-ref certify conformance.examples.broken_backends:fs_read_all_returns_nothing \\
            --only lockstep
    """
    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.fsqueue.reader import FsMailReader
    from queue_ref.storage import InflightMail, MailReader

    class EmptyReadAll(FsMailReader):
        def read(self, n: int = -1) -> bytes:
            return b"" if n < 0 else super().read(n)  # the bug: -1 read as "nothing"

    class ReadAllEmpty(_Fsync):
        def read_inflight(self, mail: InflightMail) -> MailReader:
            r = super().read_inflight(mail)
            assert isinstance(r, FsMailReader)
            r.__class__ = EmptyReadAll
            return r

    return _fs_variant(ReadAllEmpty, root, io)


def fs_entry_lost_silently(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery, finding the hard link of an entry that no
    link in queue/, inflight/ or cleanup/ names any more (damage removed it), removes the
    hard link without naming the message in ``RecoveryReport.lost``: one recipient of a
    message to several is dropped without a word while the others are delivered.  Damage
    at rest, judged per entry, fails it on C6::

        queue-ref certify conformance.examples.broken_backends:fs_entry_lost_silently \\
            --only damage-at-rest
    """
    from conformance.crashexplore.broken_fs_variants import _OwnRecovery
    from queue_ref.fsqueue.fs_recovery import Recovery

    class _Silent(Recovery):
        def remove_orphans(self) -> None:
            before = set(self.lost)
            super().remove_orphans()
            live = {e.msgid for e in (*self.queue, *self.held, *self.inflight)}
            # the bug: an entry lost from a message whose other entries live goes unnamed
            self.lost -= {m for m in self.lost - before if m in live}

    class EntryLostSilently(_OwnRecovery):
        recovery_class = _Silent

    return _fs_variant(EntryLostSilently, root, io)


def fs_index_not_rebuilt(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose recovery does not put back a domain
    index link that is missing (it never syncs the index, counting on recovery to mend
    it): after a power cut, or damage that removed one, ``list_domain`` (ETRN, ``flush
    --domain``) misses a queued entry.  Crash exploration fails it (as
    ``fs-broken-index-not-rebuilt``, on C10), and damage at rest on C13::

        queue-ref certify conformance.examples.broken_backends:fs_index_not_rebuilt \\
            --only damage-at-rest
    """
    from conformance.crashexplore.broken_fs_variants import IndexNotRebuilt

    return _fs_variant(IndexNotRebuilt, root, io)


def kv_leveldb_names_unsynced(root: str) -> Storage:
    """The KV queue on LevelDB as LevelDB alone makes it durable: its data is
    fdatasynced, but the directory is never synced after the rename that installs
    ``CURRENT`` or after a new log file is created.  A process kill loses nothing (every
    other check passes it); a power cut under the weak model can lose the names, and with
    them acknowledged mail.  The black-box power-loss check fails it under weak (C1)::

        queue-ref certify conformance.examples.broken_backends:kv_leveldb_names_unsynced \\
            --only blackbox-power-loss
    """
    import os as _os

    from queue_ref.kv import leveldb
    from queue_ref.kv.kv_queue import KvQueue

    class NamesUnsynced(leveldb.LevelDBEngine):
        def _sync_names(self) -> frozenset[str]:
            return frozenset(_os.listdir(self.path))  # the bug: no directory fsync

    real = leveldb.LevelDBEngine
    leveldb.LevelDBEngine = NamesUnsynced  # type: ignore[misc]
    try:
        return KvQueue.open_leveldb(root)
    finally:
        leveldb.LevelDBEngine = real  # type: ignore[misc]


def kv_leveldb_log_trusted(root: str) -> Storage:
    """The KV queue on LevelDB that opens whatever logs LevelDB finds, as LevelDB alone
    does (the project's queue did this until the killed templates of damage-at-rest): a
    log removed after a crash, when no clean close recorded what the store held, takes
    every message acknowledged since the last table with it, and nothing names one.  A
    cleanly closed store is still judged against its clean-close record, so only
    damage-at-rest's killed template fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:kv_leveldb_log_trusted \\
            --only damage-at-rest
    """
    from queue_ref.kv import leveldb
    from queue_ref.kv.kv_queue import KvQueue

    real = leveldb._refuse_without_log
    leveldb._refuse_without_log = lambda path: None  # the bug: the manifest is not read
    try:
        return KvQueue.open_leveldb(root)
    finally:
        leveldb._refuse_without_log = real


# ---- message ids --------------------------------------------------------------------------

def fs_ids_repeat_on_a_stalled_clock(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose message ids are the clock's time and nothing else (no
    counter): unique only while the clock moves on.  A wall clock stalls and steps back
    (NTP), and a repeated id renames the new message over a live one's file, which is then
    delivered with another body, to another recipient (C6, C12).  The checks that open the
    queue through the seam run it on a clock that stalls and steps back
    (``explored_backends.jumpy_clock``)::

        queue-ref certify conformance.examples.broken_backends:fs_ids_repeat_on_a_stalled_clock
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import MessageIds

    class ClockOnlyIds(MessageIds):
        def next(self) -> str:
            with self._lock:
                now = max(self.clock(), self._last)
                self._last = now
                return f"{now % (1 << 64):016x}{0:06x}{self.owner}"  # the bug: no counter

    class IdsRepeat(FsQueue):
        def __init__(self, root: str, io: IO | None = None, **kw: Any) -> None:
            super().__init__(root, io, **kw)
            self.ids = ClockOnlyIds(self.owner, self.ids.clock)

    if io is None:
        return IdsRepeat(root)
    from conformance.crashexplore.explored_backends import deterministic_fs

    return deterministic_fs(IdsRepeat)(root, io)


# ---- hold ---------------------------------------------------------------------------------

def fs_forgets_holds(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery puts every held entry back in the queue: a hold
    is lost after any crash or restart (C14).  The hold check fails it::

        queue-ref certify conformance.examples.broken_backends:fs_forgets_holds --only hold
    """
    from conformance.crashexplore.broken_fs_variants import RecoveryForgetsHolds
    from conformance.crashexplore.explored_backends import deterministic_fs

    return deterministic_fs(RecoveryForgetsHolds)(root, io if io is not None else OsIO())


# ---- group commit ------------------------------------------------------------------------

def fs_round_error_to_leader(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose group commit tells only the round's leader that the
    shared sync failed: every other caller the round covered is acknowledged, and a power
    cut loses its message.  Each caller alone sees the error (one caller, one round), so
    only a check with several callers in one round catches it: group-commit, on C1."""
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.groupsync import GroupSync

    class ErrorToLeader(GroupSync):
        def _round(self, batch: list) -> None:  # type: ignore[type-arg]
            super()._round(batch)
            for w in batch[1:]:
                w.error = None  # the bug: the others never hear of it

    store = FsQueue(root, io if io is not None else OsIO())
    group = ErrorToLeader(store.io, store._group.mode, store.layout.data)
    store._group = group
    return store


def fs_late_joiner_acked(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose group commit lets a caller that arrives while a round's
    sync is running ride on that round: it waits for the sync to end and is acknowledged
    by it (and its step, the link that makes the message visible, runs after it with no
    sync of its own), though its data was written after the sync began.  One caller never
    finds a round running, so only power cuts at the acknowledgements of several callers
    sharing rounds see the loss: group-commit, on C1."""
    import time as time_mod
    from collections.abc import Iterable

    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.groupsync import GroupSync

    class LateJoinerAcked(GroupSync):
        def sync(self, paths: Iterable[str] = (), *,
                 then: Callable[[], object] | None = None) -> None:
            with self._lock:
                running, seen = self._leading, self.rounds
            if not running:
                super().sync(paths, then=then)
                return
            while True:  # the bug: the running round "will do" for this caller too
                with self._lock:
                    if self.rounds > seen or not self._leading:
                        break
                time_mod.sleep(0.0002)
            if self.failed is not None:
                raise self.failed
            if then is not None:
                then()

    store = FsQueue(root, io if io is not None else OsIO())
    store._group = LateJoinerAcked(store.io, store._group.mode, store.layout.data)
    return store


# ---- concurrent callers on one entry -----------------------------------------------------

def fs_unclaimed_reschedule(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose ``reschedule`` checks that the entry's link is in
    ``queue/`` and then writes the new schedule record, without claiming the entry first
    (Kannader's reschedule, seed 001).  Alone it is right, and crash-safe (the record is
    written durably); but a ``send_start`` between the check and the write claims the
    entry, and both calls succeed: two transitions out of one QUEUED state (the sender
    delivers with the old schedule while the rescheduler is told it is queued with the new
    one; the claimed entry's cleanup then misses the record).  Only a check that races the
    two catches it: linearizable, on C7::

        queue-ref certify conformance.examples.broken_backends:fs_unclaimed_reschedule \\
            --only linearizable
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.fs_queue import _check_schedule
    from queue_ref.storage import QueuedMail, Schedule

    class UnclaimedReschedule(FsQueue):
        def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
            _check_schedule(schedule)
            h = self._take(mail, QueuedMail)
            e = self._entry(h)
            with self._guard("reschedule", h):
                if not self.io.exists(self._queued_link(h, e)):  # check ...
                    return None
                self._write_schedule(e, schedule)  # ... then act: the entry may be claimed
            return self._issue(QueuedMail, h.entry_id, h.message_id, schedule)

    return _fs_variant(UnclaimedReschedule, root, io)


# ---- lifecycle edges -------------------------------------------------------------------

def fs_requeues_live_claims(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose recovery at open puts every inflight
    entry of another owner back in the queue without asking whether that owner is alive
    (it does not try the owner's flock): a sender in the middle of a delivery, or of a
    reschedule, has its entry taken and sent by the next process that opens the queue.
    Only another process opening the queue while the first holds claims shows it: the
    lifecycle-edges check fails it on C4 and C7::

        queue-ref certify conformance.examples.broken_backends:fs_requeues_live_claims \\
            --only lifecycle-edges
    """
    from conformance.crashexplore.broken_fs_variants import _OwnRecovery
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue.fs_recovery import Recovery

    class _RequeueLive(Recovery):
        def requeue(self) -> None:
            for e, links in sorted(self.inflight.items()):
                for owner, path in links:
                    if owner == self.q.owner:
                        continue  # the bug: a live owner's claim is requeued too
                    if self.q._move_link(path, self.lay.queue_link(e)):
                        self.requeued += 1
                        self.queue[e] = self.lay.queue_link(e)
            if self.requeued:
                self.q._sync_move(self.lay.inflight, self.lay.queue)

    class RequeuesLiveClaims(_OwnRecovery):
        recovery_class = _RequeueLive

    if io is None:  # a random owner token, as FsQueue draws: processes open it at once
        return RequeuesLiveClaims(root)
    return deterministic_fs(RequeuesLiveClaims)(root, io)


def fs_reschedule_hides_entry(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose failed ``reschedule`` leaves the entry
    it had claimed in inflight/, remembered only by the caller's handle: the handle still
    works, and a restart requeues the entry, but until then no listing shows it and a
    caller that drops the handle leaves the mail undelivered (C9: after an error the
    entry is in its old or its new state).  The io-errors check lists the open queue right
    after each failed call and fails it on C9::

        queue-ref certify conformance.examples.broken_backends:fs_reschedule_hides_entry \\
            --only io-errors
    """
    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.fsqueue.fs_queue import _CLAIMED
    from queue_ref.fsqueue.layout import EntryName
    from queue_ref.storage import QueuedMail

    class HidesEntry(_Fsync):
        def _put_back(self, h: QueuedMail, e: EntryName) -> None:
            h._extra = _CLAIMED  # the bug: the claim stays, out of every listing

    return _fs_variant(HidesEntry, root, io)


def fs_orphans_live_claims(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose recovery, looking for orphan message
    files, counts the names in queue/, held/ and cleanup/ but forgets inflight/: a
    ``recover()`` run while this process holds claims on every entry of a message takes
    that message's file for an orphan and moves it to quarantine, under the sender that is
    reading it (C4, C9).  At open nothing is inflight (a dead owner's claims are requeued
    first), so only a live recovery with claims held shows it: the restart check's edge
    sequence fails it on every seed::

        queue-ref certify conformance.examples.broken_backends:fs_orphans_live_claims \\
            --only restart
    """
    from conformance.crashexplore.broken_fs_variants import _OwnRecovery
    from queue_ref.fsqueue.diskutil import listdir_or_empty
    from queue_ref.fsqueue.fs_recovery import Recovery
    from queue_ref.fsqueue.layout import EntryName

    class _ForgetsInflight(Recovery):
        def _referenced(self) -> set[str]:
            refs: set[str] = set()
            for d in (self.lay.queue, self.lay.held, self.lay.cleanup):  # the bug: no inflight/
                refs.update(n for n in listdir_or_empty(self.io, d) if EntryName.parse(n))
            return refs

    class OrphansLiveClaims(_OwnRecovery):
        recovery_class = _ForgetsInflight

    return _fs_variant(OrphansLiveClaims, root, io)


def fs_quarantine_drops_body(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue as it was until damage-at-rest rescheduled entries in its
    template: an entry whose schedule record fails its checksum is quarantined (right:
    it is not delivered with a schedule nobody wrote), and releasing it deletes the
    message file when it was the message's last entry: an intact body that nothing can
    salvage any more.  The message is named lost, so only the rule that a store keeps
    what it cannot serve sees it (C6)::

        queue-ref certify conformance.examples.broken_backends:fs_quarantine_drops_body \\
            --only damage-at-rest
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import EntryName

    class DropsBody(FsQueue):
        def _body_keeper(self, e: EntryName) -> str | None:
            return None  # the bug: the last entry's release deletes the body

    return _fs_variant(DropsBody, root, io)


def fs_stray_link_trusted(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue that takes the recipient index a queue link's name gives on
    trust: a link the queue never wrote (``queue/<m>.8`` beside a message of two
    recipients: damage that adds a name) makes every listing raise ``IndexError``, and so
    every open of the queue, instead of setting that one link aside (mutant ``1008369f``
    of the mutation run).  Only damage-at-rest's stray links fail it (C9)::

        queue-ref certify conformance.examples.broken_backends:fs_stray_link_trusted \\
            --only damage-at-rest
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.fs_records import Envelope
    from queue_ref.fsqueue.layout import EntryName
    from spec.model import Schedule

    class TrustsLinks(FsQueue):
        def _entry_schedule(self, e: EntryName, env: Envelope) -> tuple[Schedule, bool]:
            env.rcpts[e.index]  # the bug: the index a link's name gives, unchecked
            return super()._entry_schedule(e, env)

    return _fs_variant(TrustsLinks, root, io)


def fs_damaged_body_released(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue that, finding a body whose checksum fails, quarantines the
    entry being read instead of the message (mutant ``2096cd95`` of the mutation run): the
    ``CorruptionError`` says the damaged bytes went to ``quarantine/<entry>.sched``, which
    does not exist, and releasing the entry throws the damaged message file away (a spare
    file, or unlinked), so nothing is left for salvage or for the operator to look at.
    Only damage-at-rest's rule that a ``CorruptionError``'s ``quarantined_to`` holds the
    damaged bytes fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:fs_damaged_body_released \\
            --only damage-at-rest
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import EntryName
    from queue_ref.fsqueue.metadata import Corrupt
    from queue_ref.storage import CorruptionError

    class ReleasesBody(FsQueue):
        def _body_corrupt(self, e: EntryName, link: str, why: str) -> CorruptionError:
            with self._rw.shared():
                return self._corruption(e, link, Corrupt(why, False))  # the bug: the entry

    return _fs_variant(ReleasesBody, root, io)


def fs_ref_count_trusted(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery trusts the link count of a message of two or
    more recipients (the per-recipient hard links ``data/<m>.<i>`` count the entries that
    still need the file): when damage removes one, the cleanup of the message's other
    entry frees the file while the damaged entry is still queued, whose read then says
    the bytes went to ``quarantine/<m>.msg``, which does not exist.  Only damage-at-rest's
    removal of a hard link failed it (C6).  Since entries are hard links to their message
    file (2026-11-28) the queued entry's own link holds the file: the variant is absorbed
    and passes (``tests/test_conformance_damage_at_rest.py``)::

        queue-ref certify conformance.examples.broken_backends:fs_ref_count_trusted \\
            --only damage-at-rest
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.fs_recovery import Recovery
    from queue_ref.fsqueue.layout import EntryName

    class TrustsCount(Recovery):
        def _restore_ref(self, e: EntryName) -> bool:
            return False  # the bug: a missing hard link is left missing

    class TrustingQueue(FsQueue):
        recovery = TrustsCount

    return _fs_variant(TrustingQueue, root, io)


def fs_shared_body_not_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue that, setting aside one entry of a message of two or more
    recipients (its link is gone, or its schedule record is damaged), keeps no copy of
    the body while the message's other entries hold the file: their cleanup then frees
    it, and the entry named lost has nothing left to be sent from or repaired with.  Only
    damage-at-rest's rule that a body lying whole before the open still lies whole after
    it, unless delivered to every recipient, fails it (C6)::

        queue-ref certify conformance.examples.broken_backends:fs_shared_body_not_kept \\
            --only damage-at-rest
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import EntryName

    class DropsCopy(FsQueue):
        def _copy_body_aside(self, e: EntryName, link: str | None = None) -> str | None:
            return None  # the bug: the shared body goes with the other entries' cleanup

    return _fs_variant(DropsCopy, root, io)


def fs_spare_reused_under_reader(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose readers of queued mail take no shared lock and whose
    spare files are written into without an exclusive one (mutant ``207dc6f4``'s class of
    the mutation run): an operator's ``queue-ref show`` in another process reads a message
    while the relay delivers it and writes the next message into its file; the reader gets
    the other message's bytes, or a CorruptionError for intact mail and a false note in
    quarantine/.  Its own process's readers are still guarded.  Only the reader-elsewhere
    check fails it (C9, C13)::

        queue-ref certify conformance.examples.broken_backends:fs_spare_reused_under_reader \\
            --only reader-elsewhere
    """
    from queue_ref.fsqueue import FsQueue

    class Unlocked(FsQueue):
        def _hold_for_reading(self, fd: int, path: str) -> bool:
            return True  # the bug: no shared lock, the file is not checked

        def _exclusive_spare(self, fd: int) -> bool:
            return True  # the bug: written into whoever reads it

    return _fs_variant(Unlocked, root, io)


def fs_live_commit_refs_swept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery, finding a dead owner's message under
    construction, removes every per-recipient hard link whose message file is missing,
    not only that message's (mutant ``8d5cdbe6``'s class of the mutation run): a live
    owner's commit has made its hard links and not yet renamed its file into place, so
    a process that opens the queue then takes them; the commit returns with a link count
    of one, and delivering its first entry frees the file the second still needs.  An
    exclusive recovery later would give the links back, so only a delivery beside the
    live owner shows it: the lifecycle-edges check, whose observer delivers what is left
    while the actor still has the queue open (C1).  Since entries are hard links to their
    message file (2026-11-28), made before the rename too, they hold it: the variant is
    absorbed and passes::

        queue-ref certify conformance.examples.broken_backends:fs_live_commit_refs_swept \\
            --only lifecycle-edges
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.diskutil import if_exists, listdir_or_empty
    from queue_ref.fsqueue.fs_recovery import Recovery
    from queue_ref.fsqueue.layout import DATA_RE

    class SweepsRefs(Recovery):
        def _remove_refs_of(self, msgids: set[str]) -> bool:
            if not msgids:
                return False
            changed = False
            for n in listdir_or_empty(self.io, self.lay.data):
                m = DATA_RE.match(n)
                # the bug: any hard link whose message file is missing, a live commit's too
                if m is not None and m["index"] is not None and not m["sched"] and (
                        not self.io.exists(self.lay.msg_file(m["msgid"]))):
                    changed |= if_exists(self.io.unlink, os.path.join(self.lay.data, n))
            return changed

    class Sweeping(FsQueue):
        recovery = SweepsRefs

    return _fs_variant(Sweeping, root, io)


def fs_spares_counted_uncommitted(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery counts every file it removes from a dead
    owner's ``tmp/<owner>/`` as an uncommitted enqueue, its spare files (kept for reuse
    from delivered messages) too (mutant ``63f9bdd0``'s class of the mutation run): the
    report of a restart after a crash says enqueues were lost in progress that never
    were, and an operator goes looking for mail that was delivered.  Crash exploration
    and process-kill bound the report by what the crash can have left (C10)::

        queue-ref certify conformance.examples.broken_backends:fs_spares_counted_uncommitted \\
            --only crash-exploration
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.diskutil import listdir_or_empty
    from queue_ref.fsqueue.fs_recovery import Recovery

    class CountsSpares(Recovery):
        def _remove_tmp_of(self, owner: str) -> set[str]:
            names = set(listdir_or_empty(self.io, self.lay.tmp_owner(owner)))
            super()._remove_tmp_of(owner)
            return names  # the bug: spare files counted as messages under construction

    class Counting(FsQueue):
        recovery = CountsSpares

    return _fs_variant(Counting, root, io)


def fs_failed_commit_links_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue counting a commit's per-recipient hard links ``data/<m>.<i>``
    only once all of them are made (mutant ``bae744b6``'s class of the mutation run): a
    commit that fails between two of them (EIO, a full disk) undoes none, and the open
    queue keeps a hard link, a whole message file, for every such failure until the next
    restart's recovery.  Only io-errors' sweep, which fails a three-recipient enqueue at
    each of its calls, meets the failure between two links on every seed (C8)::

        queue-ref certify conformance.examples.broken_backends:fs_failed_commit_links_kept \\
            --only io-errors
    """
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.steps import MessageTx

    class CountsAtEnd(FsQueue):
        def _create_refs(self, tx: MessageTx, count: int) -> None:
            start = tx.refs
            try:
                super()._create_refs(tx, count)
            except OSError:
                tx.refs = start  # the bug: the links made before the failure are forgotten
                raise

    return _fs_variant(CountsAtEnd, root, io)


def fs_adopted_schedule_reset(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose ``find_inflight`` hands a dead owner's
    entry back with a fresh schedule (due now, no attempt counted) instead of the stored
    one: a relay that defers it again restarts its backoff, and a message that keeps
    failing in a process that keeps dying never expires (C11: a handle carries the
    entry's stored schedule).  Only an entry adopted from another process shows it: the
    multi-process check fails it on C11::

        queue-ref certify conformance.examples.broken_backends:fs_adopted_schedule_reset \\
            --only multi-process
    """
    from collections.abc import Iterator

    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.storage import InflightMail, Schedule

    class ResetsAdopted(_Fsync):
        def find_inflight(self) -> Iterator[InflightMail]:
            for f in super().find_inflight():  # the bug: the stored schedule is dropped
                yield self._issue(InflightMail, f.entry_id, f.message_id, Schedule(0),
                                  f._extra)

    return _fs_variant(ResetsAdopted, root, io)


def fs_failed_commit_keeps_refs(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose undo of a failed commit removes the
    links and the message file's name but forgets its per-recipient hard links
    (``data/<msgid>.<i>``): the body stays on disk, owned by no entry, until the next
    recovery that sweeps orphans, which a queue that stays open for months never runs
    (C8: a failed enqueue leaves nothing once it has raised).  A restart hides it; the
    io-errors check compares the open queue's footprint with the one before the enqueue
    and fails it on C8::

        queue-ref certify conformance.examples.broken_backends:fs_failed_commit_keeps_refs \\
            --only io-errors
    """
    from conformance.crashexplore.broken_fs_variants import _Fsync
    from queue_ref.fsqueue.steps import MessageTx

    class KeepsRefs(_Fsync):
        def _discard_message(self, tx: MessageTx) -> None:
            tx.refs = 0  # the bug: the hard links are forgotten, not removed
            super()._discard_message(tx)

    return _fs_variant(KeepsRefs, root, io)


def fs_dead_commit_refs_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose recovery removes a dead owner's message
    files under construction but not the per-recipient hard links their commits had
    already made: the orphan sweep removes those, but it runs only when no other owner
    is alive, so a relay worker killed inside a commit beside live workers leaves a body
    on disk until every worker restarts (C8).  Only a reopening beside a live owner shows
    it: process-kill, whose every other trial keeps the queue open in another Storage,
    fails it on C8::

        queue-ref certify conformance.examples.broken_backends:fs_dead_commit_refs_kept \\
            --only process-kill
    """
    from conformance.crashexplore.broken_fs_variants import _OwnRecovery
    from queue_ref.fsqueue.fs_recovery import Recovery

    class _KeepsRefs(Recovery):
        def _uncommitted_of(self, owner: str) -> set[str]:
            return set()  # the bug: the messages' hard links are not looked for

    class DeadCommitRefsKept(_OwnRecovery):
        recovery_class = _KeepsRefs

    return _fs_variant(DeadCommitRefsKept, root, io)


def sqlite_unchecked_root(root: str) -> Storage:
    """The SQLite example without its check of the queue path (as it was until the
    bad-input check tried bad paths): ``""`` makes a queue in the working directory and
    opens it, a path with NUL raises ``ValueError`` from the OS, a regular file
    ``NotADirectoryError``.  Only bad-input's ``bad-root`` case fails it (C12, C9)::

        queue-ref certify conformance.examples.broken_backends:sqlite_unchecked_root \\
            --only bad-input
    """
    from conformance.examples.sqlite_backend import SqliteStorage

    class UncheckedRoot(SqliteStorage):
        @staticmethod
        def _check_root(root: object) -> None:
            return None  # the bug

        def __init__(self, root: str) -> None:
            # as it was: the owner directory made, and a bare OSError let through
            os.makedirs(os.path.join(root, "owners"), exist_ok=True)
            super().__init__(root, journal="wal")

    return UncheckedRoot(root)


def sqlite_sync_off(root: str) -> Storage:
    """The SQLite example with ``PRAGMA synchronous=OFF``: ``COMMIT`` returns before
    anything reached the disk, so a power cut loses acknowledged mail (C1).  A process
    kill loses nothing (the kernel holds the writes): only the black-box power-loss check
    (strace) sees it."""
    from conformance.examples.sqlite_backend import SqliteStorage

    return SqliteStorage(root, journal="wal", synchronous="OFF")


# ---- a full disk ------------------------------------------------------------------------

def kv_log_reserve_too_small(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose disk reserve is 4 KiB, whatever the file system:
    on a disk its own mail filled, releasing the reserve frees too little for the log
    records and the table flush that delivering writes, so a full queue cannot be
    drained (mutant ``aebf07b4`` of the mutation run shrank the reserve's size).  With the
    I/O seam (crash exploration) the queue keeps no reserve either way.  Only the
    full-disk check fails it (C9)::

        queue-ref certify conformance.examples.broken_backends:kv_log_reserve_too_small \\
            --only full-disk
    """
    from queue_ref.kv.kv_queue import KvQueue

    return KvQueue.open_log(root, io, reserve=None if io is not None else 4096)


def kv_log_reserve_kept_at_open(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that keeps its disk reserve when it opens on a disk
    another file filled: recovery and delivering then have no room, and the queue
    cannot be drained until the operator frees space (mutant ``c0851f7a`` of the
    mutation run removed the release at the open).  Only the full-disk check fails it
    (C9)::

        queue-ref certify conformance.examples.broken_backends:kv_log_reserve_kept_at_open \\
            --only full-disk
    """
    from queue_ref.kv.kv_queue import KvQueue

    class ReserveKept(KvQueue):
        @staticmethod
        def _release_reserve_for_recovery(path: str, reserve: int) -> None:
            return None  # the bug: the reserve stays however full the disk is

    return ReserveKept.open_log(root, io)


def kv_leveldb_reserve_spent_for_good(root: str) -> Storage:
    """The KV queue over LevelDB that, once its disk reserve was given up for a full disk
    (at an open on a disk another file filled, or at a write refused), marks it spent on
    disk and never makes it again: however much space is freed, and after a restart and
    the queue drained, new mail is refused for a full disk.  Only the full-disk check
    fails it (C9)::

        queue-ref certify conformance.examples.broken_backends:kv_leveldb_reserve_spent_for_good \\
            --only full-disk
    """
    import os
    from pathlib import Path

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.reserve import NAME, Reserve

    def mark(directory: str) -> None:
        Path(directory, NAME + ".spent").touch()  # an empty marker

    class SpentForGood(Reserve):
        def ensure(self) -> bool:
            if os.path.exists(self.path + ".spent"):
                return self.held  # the bug: a spent reserve is never made again
            return super().ensure()

        def release(self) -> bool:
            mark(self.directory)
            return super().release()

    class Queue(KvQueue):
        @staticmethod
        def _release_reserve_for_recovery(path: str, reserve: int) -> None:
            had = os.path.exists(os.path.join(path, NAME))
            KvQueue._release_reserve_for_recovery(path, reserve)
            if had and not os.path.exists(os.path.join(path, NAME)):
                mark(path)

    q = Queue.open_leveldb(root)
    if q._reserve is not None:
        q._reserve = SpentForGood(q._reserve.directory, q._reserve.size)
    return q
