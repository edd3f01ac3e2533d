"""Broken filesystem queues: FsQueue with exactly one protocol step left out or misplaced.

They show that crash exploration is sharp: each breaks the clause named in ``VARIANTS``,
and the explorer finds it with a short scenario.  ``backend_registry`` names them
``fs-broken-<name>``.  Never use them for mail.

Each class overrides one step of ``queue_ref.fsqueue.steps.FsSteps`` (or the one method
that holds the step) and otherwise runs FsQueue's code unchanged.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from conformance.crashexplore.workloads import LIFE, Workload, enqueue_call
from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.diskutil import if_exists, is_link_file, listdir_or_empty, lstat_or_none
from queue_ref.fsqueue.fs_records import Envelope, encode_schedule, trailer
from queue_ref.fsqueue.fs_recovery import Recovery
from queue_ref.fsqueue.layout import EntryName
from queue_ref.fsqueue.steps import MessageTx
from queue_ref.io import IO
from queue_ref.storage import (
    HeldMail,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    RecoveryReport,
    Schedule,
    StorageIOError,
)
from spec.model import Call, finish_call
from spec.states import Op

# ---- enqueue ------------------------------------------------------------------------------
#
# The variants run in ``fsync`` mode, where every step syncs its own files and directories,
# so that leaving one step out leaves exactly its change unsynced.  (In ``syncfs`` mode a
# later round covers an earlier forgotten one; the ``-syncfs`` variants below break that
# mode's own rounds.)


class _Fsync(FsQueue):
    default_sync = "fsync"


class NoBodyFsync(_Fsync):
    """The message file (body and envelope) is closed without fsync before the commit
    rename publishes it."""

    def _finish_body(self, tx: MessageTx) -> None:
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        self.io.close(fd)


class SwallowFsyncError(_Fsync):
    """A failed fsync of a file is logged and forgotten ("retry the fsync later"): the
    enqueue reports success for a body the disk may not hold (PostgreSQL before 2018)."""

    def _sync_file(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            self.io.fsync(fd)


class NoEnvelopeFsync(_Fsync):
    """The body is fsynced, then the envelope record is appended and never fsynced."""

    def _write_envelope(self, tx: MessageTx, env: Envelope) -> None:
        if not tx.started:
            self._begin_message(tx)
        assert tx.body_fd is not None
        body, tx.pending = bytes(tx.pending), bytearray()
        self.io.write(tx.body_fd, body)
        self._sync_file(tx.body_fd)
        record = env.encode()
        self.io.write(tx.body_fd, record + trailer(len(record)))

    def _finish_body(self, tx: MessageTx) -> None:
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        self.io.close(fd)


class NoLinksDirFsync(_Fsync):
    """With two recipients, the hard links and queue/ links are not fsynced before the
    commit rename: a committed message may lose some of its entries."""

    def _sync_published(self, tx: MessageTx) -> None:
        return None


class NoCommitDirFsync(_Fsync):
    """data/ and queue/ are not fsynced after the commit rename: commit returns before it
    is durable."""

    def _sync_committed(self, tx: MessageTx, links: bool) -> None:
        return None


class NoSyncAfterBody(_Fsync):
    """Commit fsyncs the message file, then creates every name (hard links, links, the
    commit rename) and returns without fsyncing any directory: an acknowledged message
    lives in the page cache only.  No crash inside the enqueue can show it (losing the
    message is the enqueue not having happened); a crash at rest after it does."""

    def _commit_message(self, tx: MessageTx, env: Envelope) -> None:
        n = len(env.rcpts)
        self._write_envelope(tx, env)
        self._finish_body(tx)
        if n > 1:
            self._create_refs(tx, n)
        self._publish_links(tx, n)
        self._commit_rename(tx)


class BodyAfterPublish(_Fsync):
    """The message file is fsynced only after the commit rename published it (maddy)."""

    def _commit_message(self, tx: MessageTx, env: Envelope) -> None:
        n = len(env.rcpts)
        self._write_envelope(tx, env)
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        if n > 1:
            self._create_refs(tx, n)
        self._publish_links(tx, n)
        self._sync_published(tx)
        self._commit_rename(tx)
        self._sync_committed(tx, links=False)
        try:
            self._sync_file(fd)
        finally:
            self.io.close(fd)


# ---- state changes ----------------------------------------------------------------------


class NoDoneDirFsync(_Fsync):
    """send_done renames the link to cleanup/ without fsyncing the directories."""

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        e = self._entry(h)
        with self._guard("send_done", h):
            if not self._move_link(self.layout.inflight_link(e, self.owner),
                                   self.layout.cleanup_link(e)):
                return None
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, h.schedule, h._extra)


class NoFinishDirFsync(_Fsync):
    """send_finish renames every link (to cleanup/, back to queue/) without fsyncing the
    directories: the batch's one round left out."""

    def _sync_finished(self, *dirs: str) -> None:
        return  # the broken step: no round, the renames stay in the page cache


class NoDropDirFsync(_Fsync):
    """drop renames the link to cleanup/ without fsyncing the directories."""

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        with self._guard("drop", h):
            if not self._move_link(self._queued_link(h, e), self.layout.cleanup_link(e)):
                return None
            h._extra = None
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, h.schedule)


class NoHoldDirFsync(_Fsync):
    """hold renames the link from queue/ to held/ without fsyncing the directories: a
    power cut after the hold was acknowledged may bring the entry back as queued."""

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        with self._guard("hold", h):
            if not self._move_link(self._queued_link(h, e), self.layout.held_link(e)):
                return None
            h._extra = None
        return self._issue(HeldMail, h.entry_id, h.message_id, h.schedule)


class NoScheduleFsync(_Fsync):
    """The new schedule record is renamed into place without having been fsynced."""

    def _write_schedule_temp(self, e: EntryName, schedule: Schedule, *,
                             round_after: bool = False) -> str:
        tmp = self.layout.sched_tmp(e, self.owner)
        if_exists(self.io.unlink, tmp)
        fd = self.io.open_create(tmp)
        try:
            self.io.write(fd, encode_schedule(e.entry_id, schedule))
        finally:
            self.io.close(fd)
        return tmp


class NoScheduleDirFsync(_Fsync):
    """The schedule record's rename is not made durable (data/ is not fsynced)."""

    def _write_schedule(self, e: EntryName, schedule: Schedule) -> None:
        tmp = self._write_schedule_temp(e, schedule)
        self._install_schedule(e, tmp)


class ReasonApart(_Fsync):
    """A schedule with a reason is written as two records: the new time and attempt
    count first, then the same with the reason ("the reason is only for operators").  A
    crash between them recovers the new time without the attempt's reason."""

    def _write_schedule(self, e: EntryName, schedule: Schedule) -> None:
        if schedule.reason:
            super()._write_schedule(e, replace(schedule, reason=""))
        super()._write_schedule(e, schedule)


class CleanupSharedData(_Fsync):
    """cleanup deletes the message file with its first entry, although other entries of
    the message still need it."""

    def _release_link(self, e: EntryName, link: str, *, single: bool | None = None,
                      keep: str | None = None, shared: bool = False) -> tuple[bool, bool]:
        if_exists(self.io.unlink, self.layout.ref(e))
        kept = self._free_message(e.msgid, keep)
        return self._unlink_link(link), kept


class CleanupAllLinkBeforeRef(_Fsync):
    """cleanup_all unlinks the cleanup/ link of an entry another of the batch still holds
    the file for before its reference: a crash in between leaves a reference no link
    names, which keeps the message file from being known as released."""

    def _release_link(self, e: EntryName, link: str, *, single: bool | None = None,
                      keep: str | None = None, shared: bool = False) -> tuple[bool, bool]:
        if not shared:
            return super()._release_link(e, link, single=single, keep=keep)
        removed = self._unlink_link(link)
        if_exists(self.io.unlink, self.layout.ref(e))
        return removed, False


class CleanupLinkFirst(_Fsync):
    """cleanup unlinks the cleanup/ link first and releases the message file afterwards,
    also when it is the file's last holder: a crash in between leaves a file no link
    names."""

    def _release_link(self, e: EntryName, link: str, *, single: bool | None = None,
                      keep: str | None = None, shared: bool = False) -> tuple[bool, bool]:
        if_exists(self.io.unlink, self.layout.ref(e))
        removed = self._unlink_link(link)
        st = lstat_or_none(self.io, self.layout.msg_file(e.msgid))
        if st is None or st.st_nlink > 1:
            return removed, False
        return removed, self._free_message(e.msgid, keep)


class SpareNotCut(_Fsync):
    """A spare file is rewritten from its start for a shorter message but not cut to its
    length: the file still ends with the old message's envelope and trailer."""

    def _cut_reused(self, tx: MessageTx) -> None:
        return None


# ---- the syncfs mode's own rounds ---------------------------------------------------------


class SyncfsNoCommitRound(FsQueue):
    """``syncfs`` mode: commit skips its round after the commit rename (the second of its
    pipelined rounds)."""

    default_sync = "syncfs"

    def _sync_committed(self, tx: MessageTx, links: bool) -> None:
        return None

    def _commit_pipelined(self, tx: MessageTx) -> None:
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        self.io.close(fd)
        self._sync_dirs()
        self._publish_links(tx, 1)
        self._commit_rename(tx)


class SyncfsNoDoneRound(NoDoneDirFsync):
    """``syncfs`` mode: send_done moves the link to cleanup/ and returns without a round."""

    default_sync = "syncfs"


class SyncfsNoFileRound(FsQueue):
    """``syncfs`` mode: the message file is not synced before the names that publish it
    are created; the round after the commit rename then covers both at once."""

    default_sync = "syncfs"

    def _finish_body(self, tx: MessageTx) -> None:
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        self.io.close(fd)

    def _commit_pipelined(self, tx: MessageTx) -> None:
        self._finish_body(tx)
        self._publish_links(tx, 1)
        self._commit_rename(tx)
        self._sync_dirs()


# ---- recovery -----------------------------------------------------------------------------


class _OwnRecovery(_Fsync):
    """FsQueue whose recovery is ``recovery_class`` (opened without FsQueue's, then run)."""

    recovery_class: type[Recovery] = Recovery

    def __init__(self, root: str, io: IO | None = None, *, recover: bool = True,
                 owner: str | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        super().__init__(root, io, recover=False, owner=owner, clock=clock)
        if recover:
            try:
                self.recover()
            except BaseException:
                self._release_owner()
                self._closed = True
                raise

    def _refuse_old_format(self) -> None:
        return None  # its own recovery, run next, converts it

    def recover(self) -> RecoveryReport:
        self._check_open()
        try:
            with self._rw.exclusive(), self._owners.gate():
                report = self.recovery_class(self).run()
        except OSError as e:
            raise StorageIOError(f"recovery failed: {e}") from e
        self.last_recovery = report
        return report


class _NoOrphanScan(Recovery):
    def remove_orphans(self) -> None:
        return None


class NoOrphanScan(_OwnRecovery):
    """Recovery never removes orphans (a schedule temp file of a crashed reschedule)."""

    recovery_class = _NoOrphanScan


class _UnlinkFirstRequeue(Recovery):
    def requeue(self) -> None:
        for e, links in sorted(self.inflight.items()):
            for owner, path in links:
                if owner == self.q.owner or self.alive(owner):
                    continue
                if not is_link_file(self.io, path):
                    continue
                self.io.unlink(path)
                self.q._sync_dirs(self.lay.inflight)
                self.io.link(self.lay.msg_file(e.msgid), self.lay.queue_link(e))
                self.q._sync_dirs(self.lay.queue)
                self.requeued += 1
                self.queue[e] = self.lay.queue_link(e)


class _ForgetHolds(Recovery):
    def scan_links(self) -> None:
        for name in listdir_or_empty(self.io, self.lay.held):
            self.q._move_link(os.path.join(self.lay.held, name),
                              os.path.join(self.lay.queue, name))
        self.q._sync_move(self.lay.held, self.lay.queue)
        super().scan_links()


class RecoveryForgetsHolds(_OwnRecovery):
    """Recovery puts held entries back in the queue ("a restart releases everything"): a
    hold is lost after any crash or restart, held mail is delivered."""

    recovery_class = _ForgetHolds


class _IndexNotRebuilt(Recovery):
    def _index(self, e: EntryName, address: str) -> None:
        return None


class IndexNotRebuilt(_OwnRecovery):
    """Recovery trusts the domain index as it finds it: the index is never synced, so
    after a power cut list_domain misses queued entries (ETRN would not deliver them)."""

    recovery_class = _IndexNotRebuilt


class RequeueUnlinkFirst(_OwnRecovery):
    """Recovery requeues an inflight entry by deleting its link and creating a new one in
    queue/, each durably, instead of one rename: a crash in between loses the entry."""

    recovery_class = _UnlinkFirstRequeue


# ---- the registry ---------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A broken queue, the clause it breaks ("" for a mistake FsQueue's other defences
    absorb, see ``note``), and the shortest workload that shows it (the *witness*; the
    explorer crashes it inside its last call and at rest after it)."""

    name: str
    cls: type[FsQueue]
    clause: str
    witness: Workload
    note: str = ""


_E1 = enqueue_call(0, 1)
_E2 = enqueue_call(0, 2)
_K = (0, 0)
_START = Call(Op.SEND_START, _K)
_RESCHED = Call(Op.RESCHEDULE, _K, Schedule(1100))

VARIANTS: tuple[Variant, ...] = (
    Variant("fs-broken-nofsync", NoBodyFsync, "C1", (_E1, _RESCHED)),
    Variant("fs-broken-nosync-envelope", NoEnvelopeFsync, "C1", (_E1, _RESCHED)),
    Variant("fs-broken-nosync-links", NoLinksDirFsync, "C2", (_E2,)),
    Variant("fs-broken-nosync-commit", NoCommitDirFsync, "C1", (_E1, _RESCHED)),
    Variant("fs-broken-nosync-after-body", NoSyncAfterBody, "C1", (_E1,)),
    Variant("fs-broken-swallow-eio", SwallowFsyncError, "C9", (_E1,)),
    Variant("fs-broken-nosync-done", NoDoneDirFsync, "C3",
            (_E1, _START, Call(Op.SEND_DONE, _K), Call(Op.CLEANUP, _K))),
    Variant("fs-broken-nosync-finish", NoFinishDirFsync, "C3",
            (_E2, _START, Call(Op.SEND_START, (0, 1)),
             finish_call([Call(Op.SEND_DONE, _K),
                          Call(Op.SEND_CANCEL, (0, 1), Schedule(1100, 1, "451 busy"))]),
             Call(Op.CLEANUP, _K))),
    Variant("fs-broken-nosync-drop", NoDropDirFsync, "C3",
            (_E1, Call(Op.DROP, _K), Call(Op.CLEANUP, _K))),
    Variant("fs-broken-nosync-schedule", NoScheduleFsync, "C1", (_E1, _RESCHED, _START)),
    Variant("fs-broken-nosync-schedule-dir", NoScheduleDirFsync, "C5",
            (_E1, _RESCHED, _START)),
    Variant("fs-broken-reason-apart", ReasonApart, "C5",
            (_E1, _START, Call(Op.SEND_CANCEL, _K, Schedule(1100, 1, "451 4.4.1 deferred")))),
    Variant("fs-broken-cleanup-shared", CleanupSharedData, "C1",
            (_E2, Call(Op.DROP, _K), Call(Op.CLEANUP, _K))),
    Variant("fs-broken-cleanup-all-link-first", CleanupAllLinkBeforeRef, "",
            (_E2, Call(Op.DROP, _K), Call(Op.DROP, (0, 1)),
             finish_call([Call(Op.CLEANUP, _K), Call(Op.CLEANUP, (0, 1))], Op.CLEANUP_ALL)),
            "absorbed: a reference left without its link is a name no link refers to, "
            "which recovery removes, and the message file then goes as the cleanup's "
            "orphan; an entry PENDING_CLEANUP is never sent again, so a crash inside a "
            "cleanup can only leak, and recovery finishes every cleanup"),
    Variant("fs-broken-spare-not-cut", SpareNotCut, "C1", (*LIFE, enqueue_call(1, 1))),
    Variant("fs-broken-noorphans", NoOrphanScan, "C8", (_E1, _RESCHED)),
    Variant("fs-broken-requeue-unlink-first", RequeueUnlinkFirst, "C10", (_E1, _START)),
    Variant("fs-broken-nosync-hold", NoHoldDirFsync, "C14", (_E1, Call(Op.HOLD, _K))),
    Variant("fs-broken-recovery-forgets-holds", RecoveryForgetsHolds, "C14",
            (_E1, Call(Op.HOLD, _K))),
    Variant("fs-broken-index-not-rebuilt", IndexNotRebuilt, "C10", (_E1,)),
    Variant("fs-broken-syncfs-nocommit", SyncfsNoCommitRound, "C1", (_E1, _RESCHED)),
    Variant("fs-broken-syncfs-nodone", SyncfsNoDoneRound, "C3",
            (_E1, _START, Call(Op.SEND_DONE, _K), Call(Op.CLEANUP, _K))),
    Variant("fs-broken-body-after-publish", BodyAfterPublish, "", (_E2,),
            "absorbed: the envelope holds the body's digest, so a body torn before its "
            "fsync fails the check on read, the message is quarantined, and that is the "
            "interrupted enqueue not having happened"),
    Variant("fs-broken-syncfs-nofile", SyncfsNoFileRound, "", (_E2,),
            "absorbed, as fs-broken-body-after-publish: the commit's round makes the file "
            "durable with its names, and a crash before that round ends is an enqueue "
            "that did not happen (a torn file fails its checksum)"),
    Variant("fs-broken-cleanup-link-first", CleanupLinkFirst, "",
            (_E1, Call(Op.DROP, _K), Call(Op.CLEANUP, _K)),
            "absorbed: recovery's orphan scan removes message files, hard links and "
            "schedule records no link names"),
)

BY_NAME = {v.name: v for v in VARIANTS}

__all__ = ["BY_NAME", "VARIANTS", "Variant"]
