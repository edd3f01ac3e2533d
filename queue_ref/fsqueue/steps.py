"""The on-disk protocol of the filesystem queue, one small overridable method per step.

Persistence model assumed (the weakest useful one): unsynced file data may be lost or
garbage; each unsynced directory change (create, link, unlink, symlink, mkdir, rmdir, and a
rename as one change) may or may not persist, independently of the others; fsync of a file
does not persist its name; a rename across directories is durable once both parents are
fsynced; ``syncfs`` makes everything on the file system durable.  Every step below says
which of these it relies on.  The orchestrating methods (``_commit_message``,
``_write_schedule``, ``_cleanup_entry``) fix the order; a subclass that overrides one step
to skip or reorder it breaks exactly the clause that step's docstring names, which is how
the crash explorer is shown to find real bugs.

Steps, in protocol order (each a method; the orchestrators only call these):

=====================  ===============================================================
enqueue                ``_begin_message`` (a new file, or a spare one) ->
                       ``_write_body``* -> commit: ``_write_envelope`` (and
                       ``_cut_reused``) -> ``_finish_body`` (``_sync_file``) ->
                       [2+ recipients: ``_create_refs`` -> ``_publish_links`` ->
                       ``_sync_published``; 1 recipient: ``_publish_links``] ->
                       ``_commit_rename`` (COMMIT POINT) -> ``_sync_committed``;
                       1 recipient in syncfs mode: the same, its two rounds
                       pipelined (``_commit_pipelined``); abort: ``_discard_message``
send_start             ``_claim`` (not synced)
reschedule             ``_claim`` -> ``_write_schedule`` -> ``_move_link`` -> ``_sync_move``
send_cancel            ``_write_schedule`` -> ``_move_link`` -> ``_sync_move``
send_done / drop       ``_move_link`` -> ``_sync_move``
schedule record        ``_write_schedule_temp`` (``_sync_file``) -> ``_install_schedule``
                       -> ``_sync_schedule``
cleanup                schedule record -> ``_release_link`` (the last holder: the message
                       file, ``_delete_message_data``, which keeps a small one as a
                       spare, then ``_unlink_link``; another: ``_unlink_link``, then the
                       file if the count fell to one meanwhile) (not synced)
=====================  ===============================================================

Truth of an entry's state is which link exists: ``queue/<e>`` (QUEUED),
``inflight/<e>@<owner>`` (INFLIGHT), ``cleanup/<e>`` (PENDING_CLEANUP).  A link whose
message file is missing belongs to an uncommitted enqueue or to a finished cleanup;
listers skip it.

Every sync goes through group commit (``groupsync.py``).  In ``syncfs`` mode a sync is a
share of one ``syncfs`` that covers files and directories alike; in ``fsync`` mode files
are fsynced by their writer and directories in shared rounds.  A one-recipient message's
whole life costs three shared rounds (the message file before it is published, the names
that commit it, the move to cleanup/) and ten other system calls; none of them
allocates or frees an inode or blocks once the queue has spare files (``spares.py``):
an entry's link is a hard link to its message file, not a symlink of its own.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

from queue_ref.body_digest import BodyDigest
from queue_ref.fsqueue.diskutil import (
    if_exists,
    listdir_or_empty,
    lstat_or_none,
    same_inode,
    write_whole,
)
from queue_ref.fsqueue.fs_records import Envelope, encode_schedule, trailer
from queue_ref.fsqueue.groupsync import GroupSync
from queue_ref.fsqueue.layout import FORMAT_TEXT, EntryName, Layout, domain_of
from queue_ref.fsqueue.spares import Spares
from queue_ref.io import IO
from queue_ref.storage import Schedule

BODY_BUFFER = 1 << 16


@dataclass
class MessageTx:
    """A message being written under ``tmp/<owner>/`` by one Enqueuer.

    Body bytes are held back up to ``BODY_BUFFER`` and written in one call; a message
    smaller than that is written whole, with its envelope, at commit."""

    msgid: str
    path: str  # tmp/<owner>/<msgid>, or the spare file the message is written into
    mail_from: str
    params: dict[str, str]
    body_fd: int | None = None
    digest: BodyDigest = field(default_factory=BodyDigest)
    size: int = 0
    started: bool = False  # the tmp file exists
    refs: int = 0  # data/<msgid>.<i> hard links created
    links: int = 0  # queue/<msgid>.<i> links created
    committed: bool = False  # renamed into data/: the commit point was passed
    pending: bytearray = field(default_factory=bytearray)  # body bytes not yet written
    written: int = 0  # bytes written to the file
    reused: int = -1  # the size of the spare file written into (-1: a new file)
    indexed: list[str] = field(default_factory=list)  # domain index links created


class FsSteps:
    """Protocol steps.  FsQueue provides the attributes."""

    io: IO
    layout: Layout
    owner: str
    _group: GroupSync
    _poisoned: str | None
    _spares: Spares

    # ---- durability primitives -------------------------------------------------------

    def _sync_file(self, fd: int) -> None:
        """Make a file this owner wrote durable, before any name that makes it reachable is
        (C1, C6: without it a committed body or record may be garbage).  ``fsync`` mode:
        fsync it here; ``syncfs`` mode: a share of the next group round."""
        if self._group.covers_files:
            self._sync_dirs()
        else:
            self.io.fsync(fd)

    def _sync_dirs(self, *paths: str, then: Callable[[], object] | None = None) -> None:
        """Make changes to names in ``paths`` durable, through group commit; with
        ``then``, run it after that round and make its changes durable in the next one
        (``GroupSync.sync``; syncfs mode).

        Needed after every create/rename/unlink that must survive power loss (C1, C3, C5).
        A failure poisons the queue: the changes it covered are not trusted, and later
        mutating calls fail until the queue is reopened (reopening runs recovery).
        """
        try:
            self._group.sync(paths, then=then)
        except OSError as e:
            self._poisoned = f"a sync of the queue failed ({e}); reopen the queue"
            raise

    def _sync_move(self, src_dir: str, dst_dir: str) -> None:
        """Make a rename from ``src_dir`` to ``dst_dir`` durable: both directories (a
        cross-directory rename is durable only then; C1, C3, C5)."""
        self._sync_dirs(dst_dir, src_dir)

    # ---- the format ------------------------------------------------------------------

    def _mark_format(self) -> None:
        """Write ``queue-ref.format`` (the queue's entries are hard links), durably: on a
        queue made now, or once recovery converted an old one (its directory is synced by
        the caller)."""
        with suppress(FileExistsError):  # another process made the queue at once
            write_whole(self.io, self.layout.format_marker, FORMAT_TEXT, self.io.fsync)

    @property
    def old_format(self) -> bool:
        """Whether the queue may be in the format before entries were hard links (it has
        no ``queue-ref.format``): recovery converts it, exclusively."""
        return not self.io.exists(self.layout.format_marker)

    # ---- enqueue ---------------------------------------------------------------------

    def _begin_message(self, tx: MessageTx) -> None:
        """Open the file the message is written into: a spare file if the queue has one
        (overwritten from its start; ``_cut_reused`` cuts what is left of its old content),
        else a new ``tmp/<owner>/<msgid>``.  Either lies in this owner's ``tmp/``, where
        nothing refers to it, until the commit rename publishes it after it is durable.
        A spare with another name (the ``cleanup/`` link of its last message, when
        unlinking it failed) is given up: that name would hold the next message's file
        after its last cleanup."""
        spare = self._spares.take()
        if spare is not None:
            path, size = spare
            try:
                st = self.io.lstat(path)
                if st.st_nlink > 1:  # a name a failed cleanup left (its link): it would
                    raise FileExistsError(path)  # count as a holder of the next message
                fd = self.io.open_create(path, exclusive=False)
            except OSError:  # unusable: forget it (recovery removes it once we are dead)
                with suppress(OSError):
                    self.io.unlink(path)
            else:
                if self._exclusive_spare(fd):
                    tx.path, tx.body_fd, tx.reused, tx.started = path, fd, size, True
                    return
                with suppress(OSError):  # another process still reads its old message:
                    self.io.unlink(path)  # leave the file to it and take a new one
        tx.body_fd = self.io.open_create(tx.path)
        tx.started = True

    def _exclusive_spare(self, fd: int) -> bool:
        """Lock a spare file opened for writing, exclusively and without waiting: False
        (``fd`` closed) if a reader in another process still holds its shared lock on
        the delivered message the file held (``FsQueue.inspect_entry``).  The lock goes
        when the message file is closed, before its commit publishes it."""
        try:
            locked = self.io.lock_file(fd, shared=False)
        except OSError:  # no lock to be had: the spare is given up as if a reader held it
            locked = False
        if not locked:
            with suppress(OSError):
                self.io.close(fd)
        return locked

    def _write_body(self, tx: MessageTx, chunk: bytes) -> None:
        """Append a chunk to the message and to its running digest.  Bytes are held back
        up to ``BODY_BUFFER`` and written in one call (memory stays bounded)."""
        tx.digest.update(chunk)
        tx.size += len(chunk)
        tx.pending += chunk
        if len(tx.pending) >= BODY_BUFFER:
            if not tx.started:
                self._begin_message(tx)
            assert tx.body_fd is not None
            data, tx.pending = bytes(tx.pending), bytearray()
            self.io.write(tx.body_fd, data)
            tx.written += len(data)

    def _write_envelope(self, tx: MessageTx, env: Envelope) -> None:
        """Append what is held back of the body, the checksummed envelope record and its
        trailer, in one write.  Made durable by ``_finish_body`` (C1, C6)."""
        if not tx.started:
            self._begin_message(tx)
        assert tx.body_fd is not None
        record = env.encode()
        data, tx.pending = bytes(tx.pending) + record + trailer(len(record)), bytearray()
        self.io.write(tx.body_fd, data)
        tx.written += len(data)
        self._cut_reused(tx)

    def _cut_reused(self, tx: MessageTx) -> None:
        """A spare file longer than the message written into it loses the rest of its old
        content, before the file is synced: the trailer is read from the end of the file
        (without the cut, the message would read as the old one's, and be quarantined for
        its mismatched id; C6)."""
        if tx.reused > tx.written:
            assert tx.body_fd is not None
            self.io.ftruncate(tx.body_fd, tx.written)

    def _finish_body(self, tx: MessageTx) -> None:
        """Make the message file durable, then close it: body and envelope must be durable
        before any name that publishes them is (C1, C6)."""
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        try:
            self._sync_file(fd)
        finally:
            self.io.close(fd)

    def _create_refs(self, tx: MessageTx, count: int) -> None:
        """Hard-link ``data/<msgid>.<i>`` to the message file for every recipient (2+
        recipients only): the entry's reference, which its cleanup removes first.  A
        link removed by damage leaves the reference behind, so recovery can tell (and
        report) an entry lost from one cleaned up; a reference removed by damage is put
        back from the link.  Must be durable before the commit rename
        (``_sync_published``), or a crash could leave a committed message whose count is
        too low (C1).

        A message written into a spare file is first renamed to ``tmp/<owner>/<msgid>``,
        so that recovery, which knows uncommitted messages by their names there, also
        removes the hard links of one whose owner died before publishing its links."""
        own = self.layout.tmp_msg(self.owner, tx.msgid)
        if tx.path != own:
            self.io.rename(tx.path, own)
            tx.path = own
        for i in range(tx.refs, count):
            self.io.link(tx.path, self.layout.ref(EntryName(tx.msgid, i)))
            tx.refs = i + 1

    def _publish_links(self, tx: MessageTx, count: int) -> None:
        """Create every ``queue/<msgid>.<i>``, a hard link to the message file still under
        ``tmp/``: the file's link count then counts its entries' links (and their
        references, 2+ recipients), and stays so (a move renames a link; only cleanup
        unlinks one).  The links dangle (their
        message file ``data/<msgid>`` is missing, and listers skip them) until the commit
        rename.  With 2+ recipients they must be durable (``_sync_published``) before the
        commit rename, or a committed message could lose some entries but not others
        (C1, C2).  A hard link to an existing inode allocates none (a symlink did)."""
        for i in range(tx.links, count):
            self.io.link(tx.path, self.layout.queue_link(EntryName(tx.msgid, i)))
            tx.links = i + 1

    def _sync_published(self, tx: MessageTx) -> None:
        """Sync data/ and queue/ after the hard links and links were created, before the
        commit rename (2+ recipients): a committed message has all its names (C1, C2)."""
        self._sync_dirs(self.layout.data, self.layout.queue)

    def _commit_rename(self, tx: MessageTx) -> None:
        """THE COMMIT POINT: rename ``tmp/<owner>/<msgid>`` to ``data/<msgid>``.  Every
        entry's link stops dangling at once (C2).  Durable once data/ and tmp/<owner>/
        are synced."""
        dst = self.layout.msg_file(tx.msgid)
        try:
            self.io.rename(tx.path, dst)
        except OSError:
            if self.io.exists(dst):
                tx.committed = True
            raise
        tx.committed = True

    def _sync_committed(self, tx: MessageTx, links: bool) -> None:
        """Sync data/ and tmp/<owner>/ after the commit rename, and queue/ too when the
        links were not synced before (one recipient: a crash may then keep the link
        without the message, a dangling link recovery removes, or the message without
        the link, an orphan recovery removes; either is "not enqueued").  Only then may
        commit return (C1)."""
        dirs = [self.layout.data, self.layout.tmp_owner(self.owner)]
        if links:
            dirs.append(self.layout.queue)
        self._sync_dirs(*dirs)

    def _index_message(self, tx: MessageTx, env: Envelope) -> None:
        """Add every entry to the domain index (``domains/<h>/<msgid>.<i>``) before any of
        its links can be published, so a running queue never lists a QUEUED entry its
        index lacks.  Not synced: after a power cut recovery adds what the index lost
        (it reads every queued entry's envelope anyway), and removes what it holds of
        entries no link names (C13)."""
        for i, r in enumerate(env.rcpts):
            tx.indexed.append(self._add_to_index(EntryName(tx.msgid, i), r.address))

    def _add_to_index(self, e: EntryName, address: str) -> str:
        """Create the index link of ``e``, a hard link to its domain's anchor (and the
        domain's directory and anchor when missing); existing is fine.  An anchor with
        as many names as the file system allows (EMLINK) is replaced by a fresh one: the
        links already made keep the old inode, and readers only look at names."""
        domain = domain_of(address)
        path = self.layout.domain_link(domain, e)
        anchor = self.layout.domain_anchor(domain)
        for _ in range(3):
            try:
                self.io.link(anchor, path)
                return path
            except FileExistsError:
                return path
            except FileNotFoundError:
                self._new_anchor(domain, anchor, replace=False)
            except OSError as err:
                if err.errno != errno.EMLINK:
                    raise
                self._new_anchor(domain, anchor, replace=True)
        self.io.link(anchor, path)  # a third miss in a row: let its error say why
        return path

    def _new_anchor(self, domain: str, anchor: str, *, replace: bool) -> None:
        """Make ``anchor`` (empty, unsynced: the index is rebuilt by recovery).  Replacing
        goes through ``anchor.<owner>`` and a rename, so no caller ever sees it missing."""
        with suppress(FileExistsError):
            self.io.mkdir(self.layout.domain_dir(domain))
        if not replace:
            with suppress(FileExistsError):
                self.io.close(self.io.open_create(anchor))
            return
        fresh = f"{anchor}.{self.owner}"
        if_exists(self.io.unlink, fresh)
        self.io.close(self.io.open_create(fresh))
        self.io.rename(fresh, anchor)

    def _entry_address(self, e: EntryName) -> str | None:
        """The recipient of ``e`` if its envelope can be had (FsMetadata reads it)."""
        return None

    def _drop_from_index(self, e: EntryName) -> None:
        """Remove the index link of an entry that leaves the queue for good (unsynced: a
        leftover is a stale hint, skipped by listings and removed by recovery)."""
        address = self._entry_address(e)
        if address is not None:
            if_exists(self.io.unlink, self.layout.domain_link(domain_of(address), e))

    def _commit_message(self, tx: MessageTx, env: Envelope) -> None:
        """The whole commit, in the only safe order."""
        n = len(env.rcpts)
        self._write_envelope(tx, env)
        self._index_message(tx, env)
        if n == 1 and self._group.covers_files:
            self._commit_pipelined(tx)
            return
        self._finish_body(tx)
        if n > 1:
            self._create_refs(tx, n)
            self._publish_links(tx, n)
            self._sync_published(tx)
        else:
            self._publish_links(tx, n)
        self._commit_rename(tx)
        self._sync_committed(tx, links=n == 1)

    def _commit_pipelined(self, tx: MessageTx) -> None:
        """One recipient in syncfs mode: the steps above in the same order, with their two
        rounds pipelined (``GroupSync.sync(then=...)``): a round makes the file durable,
        then the leader of the next round creates the link and makes the commit rename,
        and that round makes them durable.  The caller sleeps through both, and the names
        never wait for the caller's thread to wake up and miss a round (C1, C2, C6)."""
        assert tx.body_fd is not None
        fd, tx.body_fd = tx.body_fd, None
        self.io.close(fd)  # a syncfs covers the file whether or not it is open
        failed: list[OSError] = []

        def publish() -> None:  # in the leader's thread, while we sleep
            try:
                self._publish_links(tx, 1)
                self._commit_rename(tx)
            except OSError as e:
                failed.append(e)

        self._sync_dirs(then=publish)
        if failed:
            raise failed[0]

    def _discard_message(self, tx: MessageTx) -> None:
        """Undo an uncommitted message: links, hard links, then the file.  Not synced: a
        leftover after a crash belongs to a dead owner and recovery removes it (C2, C8)."""
        if tx.body_fd is not None:
            fd, tx.body_fd = tx.body_fd, None
            self.io.close(fd)
        for i in range(tx.links):
            if_exists(self.io.unlink, self.layout.queue_link(EntryName(tx.msgid, i)))
        for path in tx.indexed:
            if_exists(self.io.unlink, path)
        tx.links = 0
        for i in range(tx.refs):
            if_exists(self.io.unlink, self.layout.ref(EntryName(tx.msgid, i)))
        tx.refs = 0
        if tx.started:
            if_exists(self.io.unlink_large, tx.path)
            tx.started = False
        tx.pending = bytearray()

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

    def _write_schedule_temp(self, e: EntryName, schedule: Schedule, *,
                             round_after: bool = False) -> str:
        """Write the new schedule record to ``data/<msgid>.<i>.<owner>.tmp`` and make it
        durable (C5).  ``round_after``: in ``syncfs`` mode the caller makes it durable
        with one round after writing several (``send_finish``)."""
        tmp = self.layout.sched_tmp(e, self.owner)
        if_exists(self.io.unlink, tmp)  # left by an earlier failed attempt of ours
        sync = _no_sync if round_after and self._group.covers_files else self._sync_file
        try:
            write_whole(self.io, tmp, encode_schedule(e.entry_id, schedule), sync)
        except OSError:
            with suppress(OSError):  # else recovery removes it once this owner is dead
                self.io.unlink(tmp)
            raise
        return tmp

    def _install_schedule(self, e: EntryName, tmp: str) -> None:
        """Rename the temp record over ``data/<msgid>.<i>.sched``: old or new record, never
        a mix (C5)."""
        self.io.rename(tmp, self.layout.sched(e))

    def _sync_schedule(self, e: EntryName) -> None:
        """Sync data/ after the rename of a schedule record, before the entry's link moves
        on (C5)."""
        self._sync_dirs(self.layout.data)

    def _write_schedule(self, e: EntryName, schedule: Schedule) -> None:
        """Replace the entry's schedule durably: temp, sync, rename, sync data/."""
        tmp = self._write_schedule_temp(e, schedule)
        self._install_schedule(e, tmp)
        self._sync_schedule(e)

    # ---- cleanup ---------------------------------------------------------------------

    def _release_link(self, e: EntryName, link: str, *, single: bool | None = None,
                      keep: str | None = None, shared: bool = False) -> tuple[bool, bool]:
        """Remove an entry's ``link`` and its hold on the message file (its reference
        ``data/<msgid>.<i>`` first, 2+ recipients): the file goes (renamed to ``keep``
        instead, when given: a quarantined entry's intact body stays for salvage) when no
        other entry holds it.  Missing names are fine (a
        retry, or recovery).  Returns (whether this call removed the link, whether the
        file went to ``keep``).

        The file's link count counts its holders: ``data/<msgid>``, then each entry's link
        and (2+ recipients) reference.  The last holder takes the file away first
        and its link last, so a crash in between leaves the link, and whoever finishes
        the entry (recovery included, beside live processes) finds nothing more to free.
        A holder that sees other links unlinks its own first and then looks again: of
        several entries released at once, the last to unlink sees the count at one and
        frees the file, without a shared counter (C8).  ``single``: the message is known
        to have one recipient (its link is the only one: no count is read).  ``shared``:
        the caller holds another entry of the message until after this call, so this is
        not the last holder (no count is read either)."""
        path = self.layout.msg_file(e.msgid)
        if single is None:
            single = self._single_recipient(e.msgid)
        if shared:
            if_exists(self.io.unlink, self.layout.ref(e))
            return self._unlink_link(link), False
        if not single:
            if_exists(self.io.unlink, self.layout.ref(e))
            st = lstat_or_none(self.io, path)
            if st is None:
                return self._unlink_link(link), False
            if st.st_nlink > 2 or not self._names_file(link, st):
                removed = self._unlink_link(link)
                st = lstat_or_none(self.io, path)
                if st is None or st.st_nlink > 1:
                    return removed, False
                return removed, self._free_message(e.msgid, keep)
        kept = self._free_message(e.msgid, keep)
        return self._unlink_link(link), kept

    def _names_file(self, path: str, st: os.stat_result) -> bool:
        """Whether ``path`` names the file ``st`` describes."""
        mine = lstat_or_none(self.io, path)
        return mine is not None and same_inode(mine, st)

    def _free_message(self, msgid: str, keep: str | None) -> bool:
        """Take a message file no entry holds out of ``data/``: renamed to ``keep`` (True)
        or released (``_delete_message_data``)."""
        if keep is None:
            self._delete_message_data(msgid)
            return False
        try:
            self.io.rename(self.layout.msg_file(msgid), keep)
        except FileNotFoundError:
            return False
        return True

    def _single_recipient(self, msgid: str) -> bool:
        """Whether the message is known, without reading the disk, to have one recipient
        (so no hard links).  FsMetadata answers from its envelope cache."""
        return False

    def _spare_for(self, msgid: str) -> tuple[str, int] | None:
        """A name under ``tmp/<owner>/`` to keep the message's file under as a spare, and
        the file's size; or None to unlink it (FsQueue decides; see ``spares.py``)."""
        return None

    def _file_is_small(self, msgid: str) -> bool:
        """Whether the message file of ``msgid`` is known to be small enough to unlink
        with the GIL kept (``IO.unlink``; else ``unlink_large``).  FsQueue knows sizes."""
        return False

    def _delete_message_data(self, msgid: str) -> None:
        """Take the message file out of ``data/`` (missing is fine), only once no entry
        needs it (C1): renamed to a spare name in this owner's ``tmp/`` if the queue keeps
        it for reuse, else unlinked.  Not synced, like the rest of cleanup: after a crash
        either name is one recovery removes (an orphan, or a dead owner's tmp file)."""
        path = self.layout.msg_file(msgid)
        spare = self._spare_for(msgid)
        unlink = self.io.unlink if self._file_is_small(msgid) else self.io.unlink_large
        if spare is None:
            if_exists(unlink, path)
            return
        name, size = spare
        kept = False
        try:
            self.io.rename(path, name)
            kept = True
        except FileNotFoundError:  # gone already; or the spare's directory is, then unlink
            if_exists(unlink, path)
        finally:
            self._spares.put(name, size if kept else None)

    def _unlink_link(self, path: str) -> bool:
        """Remove a link; False if it was gone already."""
        return if_exists(self.io.unlink, path)

    def _cleanup_entry(self, e: EntryName, *, single: bool | None = None,
                       record: bool = True, shared: bool = False) -> bool:
        """Release a PENDING_CLEANUP entry: its schedule record, then its ``cleanup/`` link
        and the message file if no other entry holds it (``_release_link``).

        Nothing is synced, and nothing needs to be: a PENDING_CLEANUP entry is GONE after
        any restart (spec rule 5), because recovery finishes every ``cleanup/`` link it
        finds.  Until the link is gone a crash leaves the entry PENDING_CLEANUP and any
        recovery (even one that runs while other processes live) repeats these steps.
        Power loss may keep the link's unlink and lose an earlier unlink: the leftover is
        then a name no link refers to, which the first recovery after the power loss
        (exclusive, since every process died) removes (C3, C8).  Returns True if this
        call removed the link.  ``shared``: another entry of the message, released
        after this one by the same caller, holds the file meanwhile (``cleanup_all``).
        """
        self._drop_from_index(e)
        if record:
            if_exists(self.io.unlink, self.layout.sched(e))
        return self._release_link(e, self.layout.cleanup_link(e), single=single,
                                  shared=shared)[0]

    # ---- small shared helpers --------------------------------------------------------

    def _links_of_message(self, directory: str, msgid: str) -> list[str]:
        """Names in a link directory that belong to ``msgid``."""
        prefix = msgid + "."
        return [n for n in listdir_or_empty(self.io, directory) if n.startswith(prefix)]


def _no_sync(fd: int) -> None:
    """A file a later ``syncfs`` round makes durable."""
