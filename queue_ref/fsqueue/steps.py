"""The on-disk protocol of the filesystem queue, one small overridable method per step.

Persistence model assumed (the weakest useful one): unsynced file data may be lost or
garbage; each unsynced directory change (create, unlink, symlink, mkdir, rmdir, and a
rename as one change) may or may not persist, independently of the others; fsync of a file
does not persist its name; a rename across directories is durable once both parents are
fsynced.  Every step below says which of these it relies on.  The orchestrating methods
(``_commit_message``, ``_write_schedule``, ``_cleanup_entry``) fix the order; a subclass
that overrides one step to skip or reorder it breaks exactly the clause that step's
docstring names, which is how the crash explorer is shown to find real bugs.

Steps, in protocol order (each a method; the orchestrators only call these):

=====================  ===============================================================
enqueue                ``_begin_message`` -> ``_write_body``* -> commit:
                       ``_write_envelope`` (``_sync_file``) -> ``_finish_body``
                       (``_sync_file``) -> ``_create_rcpt_files`` -> ``_sync_message_dirs``
                       -> ``_publish_links`` -> ``_sync_published`` -> ``_commit_rename``
                       (COMMIT POINT) -> ``_sync_committed``; abort: ``_discard_message``
send_start             ``_claim`` (not synced)
reschedule             ``_claim`` -> ``_write_schedule`` -> ``_move_link`` -> ``_sync_move``
send_cancel            ``_write_schedule`` -> ``_move_link`` -> ``_sync_move``
send_done / drop       ``_move_link`` -> ``_sync_move``
schedule record        ``_write_schedule_temp`` (``_sync_file``) -> ``_install_schedule``
                       -> ``_sync_schedule``
cleanup                ``_unlink_rcpt`` -> ``_remove_rcpts_dir`` -> [last entry:
                       ``_delete_message_data`` -> ``_sync_teardown``] -> ``_unlink_link``
                       -> ``_sync_cleanup_link``
=====================  ===============================================================

Truth of an entry's state is which link exists: ``queue/<e>`` (QUEUED),
``inflight/<e>@<owner>`` (INFLIGHT), ``cleanup/<e>`` (PENDING_CLEANUP).  A link whose target
is missing belongs to an uncommitted enqueue or to a finished cleanup; listers skip it.
"""

from __future__ import annotations

import errno
import hashlib
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from queue_ref.fsqueue.diskutil import if_exists, listdir_or_empty, remove_tree, write_whole
from queue_ref.fsqueue.groupsync import GroupSync
from queue_ref.fsqueue.layout import EntryName, Layout
from queue_ref.fsqueue.records import Envelope, encode_schedule
from queue_ref.io import IO
from queue_ref.storage import Schedule


@dataclass
class MessageTx:
    """A message being built under ``tmp/<owner>/<msgid>/`` by one Enqueuer."""

    msgid: str
    base: str  # tmp/<owner>/<msgid>
    mail_from: str
    params: dict[str, str]
    body_fd: int | None = None
    sha: Any = field(default_factory=hashlib.sha256)
    size: int = 0
    started: bool = False  # the tmp directory exists
    rcpt_files: int = 0  # rcpts/<i> files created
    links: int = 0  # queue/<msgid>.<i> links created
    committed: bool = False  # renamed into data/: the commit point was passed


class FsSteps:
    """Protocol steps.  FsQueue provides the attributes."""

    io: IO
    layout: Layout
    owner: str
    _group: GroupSync
    _poisoned: str | None

    # ---- durability primitives -------------------------------------------------------

    def _sync_file(self, fd: int) -> None:
        """fsync a file this owner wrote, before any name that makes it reachable is made
        durable (C1, C6: without it a committed body or record may be garbage)."""
        self.io.fsync(fd)

    def _sync_dirs(self, *paths: str) -> None:
        """fsync shared directories after changing names in them, through group commit.

        Needed after every create/rename/unlink that must survive power loss (C1, C3, C5).
        A failure poisons the queue: the changes it covered are not trusted, and later
        mutating calls fail until the queue is reopened (reopening runs recovery).
        """
        try:
            self._group.sync_all(paths)
        except OSError as e:
            self._poisoned = f"fsync of a queue directory failed ({e}); reopen the queue"
            raise

    def _sync_move(self, src_dir: str, dst_dir: str) -> None:
        """Make a rename from ``src_dir`` to ``dst_dir`` durable: fsync both directories
        (a cross-directory rename is durable only then; C1, C3, C5)."""
        self._sync_dirs(dst_dir, src_dir)

    def _sync_private_dirs(self, *paths: str) -> None:
        """fsync directories only this owner uses (a message under tmp/).  No group commit:
        nobody else waits on them.  A failure fails the enqueue, nothing else."""
        for p in paths:
            self.io.fsync_dir(p)

    # ---- enqueue ---------------------------------------------------------------------

    def _begin_message(self, tx: MessageTx) -> None:
        """Create ``tmp/<owner>/<msgid>/``, its ``rcpts/`` and an empty body file."""
        self.io.mkdir(tx.base)
        tx.started = True
        self.io.mkdir(self.layout.rcpts(tx.base))
        tx.body_fd = self.io.open_create(self.layout.body(tx.base))

    def _write_body(self, tx: MessageTx, chunk: bytes) -> None:
        """Append a chunk to the body file and to its running sha256 (bounded memory)."""
        assert tx.body_fd is not None
        self.io.write(tx.body_fd, chunk)
        tx.sha.update(chunk)
        tx.size += len(chunk)

    def _finish_body(self, tx: MessageTx) -> None:
        """fsync and close the body: it must be durable before the commit rename (C1, C6)."""
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        try:
            self._sync_file(fd)
        finally:
            self.io.close(fd)

    def _write_envelope(self, tx: MessageTx, env: Envelope) -> None:
        """Write the checksummed envelope record and fsync it (C1, C6)."""
        write_whole(self.io, self.layout.envelope(tx.base), env.encode(), self._sync_file)

    def _create_rcpt_files(self, tx: MessageTx, count: int) -> None:
        """Create the empty ``rcpts/<i>`` files (the links' targets)."""
        for i in range(tx.rcpt_files, count):
            self.io.close(self.io.open_create(self.layout.rcpt(tx.base, i)))
            tx.rcpt_files = i + 1

    def _sync_message_dirs(self, tx: MessageTx) -> None:
        """fsync ``rcpts/`` and the message directory, so that every name inside the message
        survives once the commit rename does (C1)."""
        self._sync_private_dirs(self.layout.rcpts(tx.base), tx.base)

    def _publish_links(self, tx: MessageTx, count: int) -> None:
        """Create every ``queue/<msgid>.<i> -> ../data/<msgid>/rcpts/<i>``.  They dangle (and
        listers skip them) until the commit rename.  Must be made durable (``_sync_dirs`` of
        queue/) before the commit rename, or a committed message could lose entries (C1, C2)."""
        for i in range(tx.links, count):
            e = EntryName(tx.msgid, i)
            self.io.symlink(e.target, self.layout.queue_link(e))
            tx.links = i + 1

    def _commit_rename(self, tx: MessageTx) -> None:
        """THE COMMIT POINT: rename ``tmp/<owner>/<msgid>`` to ``data/<msgid>``.  All entries
        appear at once (C2).  Durable only after data/ and tmp/<owner>/ are fsynced."""
        dst = self.layout.msg_dir(tx.msgid)
        try:
            self.io.rename(tx.base, dst)
        except OSError:
            if self.io.exists(dst):
                tx.committed = True
            raise
        tx.committed = True

    def _sync_published(self, tx: MessageTx) -> None:
        """fsync queue/ after the links were created, before the commit rename: a committed
        message always has durable links (C1, C2)."""
        self._sync_dirs(self.layout.queue)

    def _sync_committed(self, tx: MessageTx) -> None:
        """fsync data/ and tmp/<owner>/ after the commit rename: only then is the message
        durable and may commit return (C1)."""
        self._sync_dirs(self.layout.data, self.layout.tmp_owner(self.owner))

    def _commit_message(self, tx: MessageTx, env: Envelope) -> None:
        """The whole commit, in the only safe order."""
        n = len(env.rcpts)
        self._write_envelope(tx, env)
        self._finish_body(tx)
        self._create_rcpt_files(tx, n)
        self._sync_message_dirs(tx)
        self._publish_links(tx, n)
        self._sync_published(tx)
        self._commit_rename(tx)
        self._sync_committed(tx)

    def _discard_message(self, tx: MessageTx) -> None:
        """Undo an uncommitted message: its links first, then its tmp tree.  Not synced: a
        leftover after a crash belongs to a dead owner and recovery removes it (C2, C8)."""
        if tx.body_fd is not None:
            fd, tx.body_fd = tx.body_fd, None
            self.io.close(fd)
        for i in range(tx.links):
            if_exists(self.io.unlink, self.layout.queue_link(EntryName(tx.msgid, i)))
        tx.links = 0
        if tx.started:
            remove_tree(self.io, tx.base)
            tx.started = False

    # ---- moving links ----------------------------------------------------------------

    def _claim(self, e: EntryName) -> bool:
        """Claim a queued entry: rename ``queue/<e>`` to ``inflight/<e>@<owner>``.

        The kernel's rename is atomic, so of several processes renaming the same link one
        wins and the others get ENOENT (False) (C7).  Not synced: an INFLIGHT entry becomes
        QUEUED after a restart anyway, so losing the rename in a crash is allowed."""
        return self._move_link(self.layout.queue_link(e), self.layout.inflight_link(e, self.owner))

    def _move_link(self, src: str, dst: str) -> bool:
        """Rename a link; False if ``src`` is gone (the entry vanished).  The caller syncs
        both directories when the move must be durable."""
        try:
            self.io.rename(src, dst)
        except FileNotFoundError:
            return False
        return True

    # ---- schedule records ------------------------------------------------------------

    def _write_schedule_temp(self, e: EntryName, schedule: Schedule) -> str:
        """Write the new schedule record to ``rcpts/<i>.<owner>.tmp`` and fsync it (C5)."""
        tmp = self.layout.rcpt_tmp(e, self.owner)
        if_exists(self.io.unlink, tmp)  # left by an earlier failed attempt of ours
        try:
            write_whole(self.io, tmp, encode_schedule(e.entry_id, schedule), self._sync_file)
        except OSError:
            with suppress(OSError):  # else recovery removes it once this owner is dead
                self.io.unlink(tmp)
            raise
        return tmp

    def _install_schedule(self, e: EntryName, tmp: str) -> None:
        """Rename the temp record over ``rcpts/<i>``: old or new record, never a mix (C5)."""
        self.io.rename(tmp, self.layout.rcpt_file(e))

    def _sync_schedule(self, e: EntryName) -> None:
        """fsync ``rcpts/`` after the rename of a schedule record, before the entry's link
        moves on (C5)."""
        self._sync_dirs(self.layout.rcpts(self.layout.msg_dir(e.msgid)))

    def _write_schedule(self, e: EntryName, schedule: Schedule) -> None:
        """Replace the entry's schedule durably: temp, fsync, rename, fsync ``rcpts/``."""
        tmp = self._write_schedule_temp(e, schedule)
        self._install_schedule(e, tmp)
        self._sync_schedule(e)

    # ---- cleanup ---------------------------------------------------------------------

    def _unlink_rcpt(self, e: EntryName) -> None:
        """Remove ``data/<msgid>/rcpts/<i>`` (missing is fine: a retry or a recovery)."""
        if_exists(self.io.unlink, self.layout.rcpt_file(e))

    def _remove_rcpts_dir(self, msgid: str) -> bool:
        """``rmdir data/<msgid>/rcpts``.  True if the message must now be torn down: we
        emptied it, or it is gone already (a teardown was started by someone).  False
        (ENOTEMPTY) while other entries of the message remain."""
        try:
            self.io.rmdir(self.layout.rcpts(self.layout.msg_dir(msgid)))
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True

    def _delete_message_data(self, msgid: str) -> None:
        """Delete body and envelope, then ``rmdir data/<msgid>``.  Only after ``rcpts/`` is
        gone (no entry can need them any more, C1).  Missing names are fine (idempotent)."""
        base = self.layout.msg_dir(msgid)
        if_exists(self.io.unlink, self.layout.body(base))
        if_exists(self.io.unlink, self.layout.envelope(base))
        try:
            self.io.rmdir(base)
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Something that is not ours is inside: the orphan scan quarantines it.

    def _unlink_link(self, path: str) -> bool:
        """Remove a link; False if it was gone already."""
        return if_exists(self.io.unlink, path)

    def _sync_teardown(self) -> None:
        """fsync data/ after a message directory was removed (C8)."""
        self._sync_dirs(self.layout.data)

    def _sync_cleanup_link(self) -> None:
        """fsync cleanup/ after a cleanup link was removed: cleanup is then durable (C9)."""
        self._sync_dirs(self.layout.cleanup)

    def _cleanup_entry(self, e: EntryName) -> bool:
        """Release a PENDING_CLEANUP entry's bytes, then its ``cleanup/`` link.

        Order: the data goes first and durably (rcpts file; and when the ``rmdir`` of
        ``rcpts/`` shows this was the last entry, body, envelope and the message
        directory), the link last.  Until the link is gone a crash leaves the entry
        PENDING_CLEANUP and recovery repeats these steps, which tolerate missing names;
        once it is gone nothing of the entry remains to leak (C3, C8).  When other entries
        remain, ``rcpts/`` is not synced: if power loss keeps the rcpts file but not its
        unlink while the link's unlink persists, the file is an orphan (no link names it)
        and the first recovery after the power loss, which is exclusive because every
        process died, removes it.  Returns True if this call removed the link.
        """
        self._unlink_rcpt(e)
        if self._remove_rcpts_dir(e.msgid):
            self._delete_message_data(e.msgid)
            self._sync_teardown()
        removed = self._unlink_link(self.layout.cleanup_link(e))
        self._sync_cleanup_link()
        return removed

    # ---- small shared helpers --------------------------------------------------------

    def _links_of_message(self, directory: str, msgid: str) -> list[str]:
        """Names in a link directory that belong to ``msgid``."""
        prefix = msgid + "."
        return [n for n in listdir_or_empty(self.io, directory) if n.startswith(prefix)]
