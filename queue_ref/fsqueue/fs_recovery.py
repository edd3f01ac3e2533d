"""Recovery of the filesystem queue: from whatever a crash left to a state of the contract.

Runs when a queue is opened and on ``recover()``, always holding ``owners/gate.lock`` (see
owners.py).  It is *exclusive* when every other owner is dead: no other process has the
queue open and none can open it meanwhile.  Steps, in order:

0. **The old format** (a queue without ``queue-ref.format``, whose entries were
   symlinks): converted when exclusive (each symlink of a committed message replaced by
   a hard link renamed over it, then the marker written); beside a live process,
   refused with a ``StorageIOError`` naming ``queue-ref repair``.
1. **Junk**: anything in queue/, inflight/, cleanup/, held/ that is not one of our links (a
   name we never create, a directory, a symlink, a file that is not the same inode as
   its message file ``data/<msgid>`` when that exists) is moved to quarantine/ and
   reported.  Links are never followed.  Except, when exclusive: a file with the same
   bytes as its message file is a copy of a link (a queue copied by ``cp -r`` or
   ``rsync`` without ``-H``), made a hard link of the file again (a new link renamed
   over it) and reported; so is a copy of a reference link, in step 7.  A message
   whose own name ``data/<msgid>`` is not a regular file (a FIFO, a directory, a
   symlink) has that name moved to quarantine instead: its links then dangle, and step 4
   reports it lost (whether or not its owner lives: no enqueue makes such a name),
   keeping what they hold for ``queue-ref repair``.
2. **Duplicates** (an entry linked twice, possible after power loss because a rename
   persists in one directory before the other): cleanup wins over queue, held and
   inflight; held wins over queue and a dead owner's inflight (only an interrupted hold or
   release links an entry in held/ and queue/ at once, and either state is allowed then;
   an inflight link beside a held one is a claim renamed back by an interrupted cancel);
   queue wins over inflight.  Only links of dead owners and queue links of retired entries are
   removed, so a live process's claim is never undone.
3. **Interrupted cleanups**: every cleanup/ link is cleaned up (steps tolerate missing data).
4. **Uncommitted enqueues** of dead owners: the dangling links of their messages (a link
   whose message file is missing, of a message whose file is still under
   ``tmp/<owner>/``), then those files and the hard links those messages had already
   made.  A dangling link of a quarantined message goes to quarantine.  A dangling link
   of a dead owner's message that is neither in ``tmp/`` nor quarantined belongs to a
   committed message whose file name was removed:
   the message is lost, its content (which its links still hold) is kept as
   ``quarantine/<msgid>.unlinked``, its links go to quarantine with a note, and the
   report names it (``lost``), never silently.
5. **Requeue**: inflight links of dead owners go back to queue/ (INFLIGHT -> QUEUED).
6. **Orphans** (exclusive only; otherwise only the schedule temp files of dead owners):
   under data/, every name of a message no link names (its reference links, schedule
   records), reference links and schedule records of entries no link names, schedule
   temp files, and unknown names (quarantined).  A message file no link names whose
   entries were all cleaned up (2+ recipients, no reference left: sibling cleanups cut
   short just before the last frees the file) is removed too.  Any other committed message
   file no link names is moved to quarantine (``<msgid>.unlinked``) and reported lost:
   its links were removed, or (after a power cut) its cleanup or an unacknowledged
   commit was cut short; ``queue-ref repair`` puts an intact one back in the queue.  A
   reference link of an entry no link names is reported too (the entry's link was
   removed: it is lost), then removed.
7. **Verification**: the metadata of every queued and held entry is checked; corrupt entries and
   messages are quarantined.  Exclusive recoveries give an entry of a message of 2+
   recipients its reference link back if damage took it (the link count is the
   reference count: without it the other entries' cleanup would free the file; step 1
   made sure each entry link is that file too).  Every queued and
   held entry gets its domain index link back if a power cut lost it (the index is never
   synced); exclusive recoveries also remove index links of entries no link names
   (cleaned up, quarantined, uncommitted).
8. Exclusive only: lock files of dead owners are removed.  A recovery beside a live
   owner leaves them: they tell the next opening that a process died whose orphans no
   exclusive recovery has swept yet (``FsQueue.dead_owners``).

Every step is idempotent and leaves a state the next run accepts, so a crash inside
recovery followed by another recovery keeps every clause (C10).  Directory changes are
fsynced before the next step relies on them (duplicates before cleanups and requeues).
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from os.path import join

from queue_ref.fsqueue.diskutil import (
    if_exists,
    is_link_file,
    listdir_or_empty,
    lstat_or_none,
    readlink_or_none,
    remove_tree,
    same_inode,
)
from queue_ref.fsqueue.layout import (
    DATA_RE,
    DOMAIN_ANCHOR,
    DOMAIN_DIR_RE,
    LINK_DIRS,
    MSGID_RE,
    OWNER_RE,
    EntryName,
    domain_of,
    owner_of_msgid,
    parse_inflight,
)
from queue_ref.fsqueue.metadata import Corrupt, FsMetadata
from queue_ref.storage import RecoveryReport, StorageIOError

Inflight = dict[EntryName, list[tuple[str, str]]]  # entry -> [(owner, link path)]


#: bytes compared at a time when a link that is not a hard link may be a copy of its file
COMPARE_CHUNK = 1 << 20

class Recovery:
    def __init__(self, q: FsMetadata) -> None:
        self.q = q
        self.io = q.io
        self.lay = q.layout
        self.exclusive = False
        self.requeued = self.cleaned = self.uncommitted = 0
        self.orphans = self.quarantined = 0
        self.problems: list[str] = []
        self.lost: set[str] = set()
        self.damaged: list[str] = []
        self.queue: dict[EntryName, str] = {}
        self.inflight: Inflight = {}
        self.cleanup: dict[EntryName, str] = {}
        self.held: dict[EntryName, str] = {}
        self.index_paths: dict[str, str] = {}  # entry id -> its index link (verified entries)
        self.msg_stats: dict[str, os.stat_result | None] = {}  # message id -> its file's
        self.relinked: set[str] = set()  # directories where a copied link was relinked
        #: messages whose name in data/ this run found replaced (no regular file) and
        #: moved to quarantine: lost whoever owns them (no enqueue makes such a name)
        self.replaced: set[str] = set()

    def alive(self, owner: str) -> bool:
        return self.q._owners.alive(owner)

    def run(self) -> RecoveryReport:
        self.exclusive = not self.q._owners.others_alive()
        if self.q.old_format:
            self.convert_old_format()
        self.scan_links()
        self.resolve_duplicates()
        self.finish_cleanups()
        self.remove_uncommitted()
        self.requeue()
        if self.exclusive:
            self.remove_orphans()
        else:
            self.remove_dead_temps()
        self.verify_queued()
        if self.exclusive:
            self.prune_index()
            for o in self.q._owners.on_disk():
                if not self.alive(o):
                    self.q._owners.forget_dead(o)
        return RecoveryReport(self.requeued, self.cleaned, self.uncommitted, self.orphans,
                              self.quarantined, tuple(self.problems),
                              lost=tuple(sorted(self.lost)), damaged_files=tuple(self.damaged))

    # ---- 1. links and junk -------------------------------------------------------------

    def junk(self, path: str, reason: str) -> None:
        self.problems.append(self.q._quarantine_junk(path, reason))

    def _link_ok(self, path: str, e: EntryName) -> bool:
        """Is ``path`` a link of ``e``: a hard link to its message file, or one that
        dangles (its message file is missing: an uncommitted enqueue, a finished cleanup,
        or a lost message; steps 3 and 4 decide)?  Quarantines anything else.  An
        old-format symlink whose message file is missing is taken as dangling too; one
        whose file is there was converted by ``convert_old_format`` (exclusive) or made
        opening refuse."""
        st = lstat_or_none(self.io, path)
        if st is None:
            return False
        if stat.S_ISLNK(st.st_mode):
            target = readlink_or_none(self.io, path)
            if target == e.legacy_target and self._msg_stat(e.msgid) is None:
                return True
            self.junk(path, f"a symlink to {target!r}, not a hard link to its message file")
            return False
        if not stat.S_ISREG(st.st_mode):
            self.junk(path, "not a regular file")
            return False
        msg = self._msg_stat(e.msgid)
        if msg is not None and not stat.S_ISREG(msg.st_mode):
            # the message's own name was replaced (a FIFO, a directory, a symlink): that
            # name is the junk, and the message's file is gone from data/; its links are
            # dangling, and step 4 reports the message lost and keeps what they hold
            self.junk(self.lay.msg_file(e.msgid), "not a regular file, in place of the file "
                                                  f"of message {e.msgid}")
            self.msg_stats[e.msgid] = None
            self.replaced.add(e.msgid)
            return True
        if msg is not None and not same_inode(msg, st):
            if self.exclusive and self._a_copy(path, st, e.msgid, msg):
                self._relink(path, e.msgid)
                return True
            self.junk(path, f"not a hard link to its message file data/{e.msgid}")
            return False
        return True

    def _a_copy(self, path: str, st: os.stat_result, msgid: str,
                msg: os.stat_result) -> bool:
        """Whether ``path`` (a regular file, not ``data/<msgid>``'s inode) holds the same
        bytes as ``data/<msgid>``: a link the queue made, copied by a tool that does not
        keep hard links (``cp -r``, ``rsync`` without ``-H``)."""
        if st.st_size != msg.st_size or not stat.S_ISREG(msg.st_mode):
            return False  # a FIFO would block the open, a directory fail the reads
        try:
            a = self.io.open_read(path)
        except OSError:
            return False
        try:
            b = self.io.open_read(self.lay.msg_file(msgid))
        except OSError:
            self.io.close(a)
            return False
        try:
            offset = 0
            while offset < st.st_size:
                chunk = self.io.pread(a, COMPARE_CHUNK, offset)
                if not chunk or chunk != self.io.pread(b, COMPARE_CHUNK, offset):
                    return False
                offset += len(chunk)
            return True
        except OSError:  # unreadable: not shown to be a copy, so junk as before
            return False
        finally:
            self.io.close(a)
            self.io.close(b)

    def _link_over(self, path: str, msgid: str) -> None:
        """Exclusive only: make ``path`` a hard link of ``data/<msgid>``: a new link made
        under this owner's ``tmp/`` and renamed over it (the name never goes missing; a
        crash in between leaves the old name, which the next recovery replaces again,
        and a name in ``tmp/`` of a dead owner, which it removes).  Its directory is
        synced by the caller."""
        fresh = join(self.lay.tmp_owner(self.q.owner),
                     f"convert.{os.path.basename(path).split('@')[0]}")
        if_exists(self.io.unlink, fresh)
        self.io.link(self.lay.msg_file(msgid), fresh)
        self.io.rename(fresh, path)

    def _relink(self, path: str, msgid: str) -> None:
        """Exclusive only: make ``path``, a copy of ``data/<msgid>``, a hard link of it
        again (``_link_over``), and report it."""
        self._link_over(path, msgid)
        self.relinked.add(os.path.dirname(path))
        self.problems.append(
            f"{os.path.relpath(path, self.lay.root)}: a copy of its message file data/{msgid} "
            "(the queue was copied without its hard links); made a hard link of it again")

    def _msg_stat(self, msgid: str) -> os.stat_result | None:
        """``lstat`` of ``data/<msgid>``, once per message per scan."""
        if msgid not in self.msg_stats:
            self.msg_stats[msgid] = lstat_or_none(self.io, self.lay.msg_file(msgid))
        return self.msg_stats[msgid]

    # ---- 0. the old format -------------------------------------------------------------

    def _old_format_links(self) -> list[tuple[str, EntryName]]:
        """The old format's entry links: symlinks ``-> ../data/<msgid>`` of committed
        messages in the link directories."""
        links: list[tuple[str, EntryName]] = []
        for d in (join(self.lay.root, d) for d in LINK_DIRS):
            for name in listdir_or_empty(self.io, d):
                e = EntryName.parse(name.split("@")[0])
                path = join(d, name)
                if (e is not None and readlink_or_none(self.io, path) == e.legacy_target
                        and self._msg_stat(e.msgid) is not None):
                    links.append((path, e))
        return links

    def convert_old_format(self) -> None:
        """Turn a queue of the old format into the current one (exclusive only, and first,
        so that every later step sees hard links): every symlink of a committed message
        is replaced by a hard link to its file, made under this owner's ``tmp/`` and
        renamed over the symlink (the entry is never without its link), then the
        directories are synced and ``queue-ref.format`` written.  The reference links
        ``data/<msgid>.<i>`` stay as they are: the format keeps them.  A crash in between
        leaves a mix the next recovery finishes.  Beside a live process this refuses,
        naming ``queue-ref repair``: only a queue no one else uses may change format."""
        links = self._old_format_links()
        if links and not self.exclusive:
            raise StorageIOError(
                f"the queue at {self.lay.root} is in the old format (its entries are "
                f"symlinks, {len(links)} of them), and another process has it open: stop "
                "every process that uses it and run "
                f"`queue-ref repair --queue {self.lay.root}` (or open it alone), which "
                "converts it")
        staging = self.lay.tmp_owner(self.q.owner)
        changed: set[str] = set()
        for path, e in links:
            self._link_over(path, e.msgid)
            changed.add(os.path.dirname(path))
        if changed:
            self.q._sync_dirs(*sorted(changed), staging)
        self.q._mark_format()
        self.q._sync_dirs(self.lay.root)
        if links:
            self.problems.append(f"converted from the old format: {len(links)} entry "
                                 "symlinks made hard links to their message files")
        self.msg_stats.clear()

    def scan_links(self) -> None:
        self._scan_links()
        if self.relinked:
            self.q._sync_dirs(*sorted(self.relinked), self.lay.tmp_owner(self.q.owner))
            self.relinked.clear()

    def _scan_links(self) -> None:
        for name in listdir_or_empty(self.io, self.lay.queue):
            self._scan_one(self.lay.queue, name, self.queue)
        for name in listdir_or_empty(self.io, self.lay.cleanup):
            self._scan_one(self.lay.cleanup, name, self.cleanup)
        for name in listdir_or_empty(self.io, self.lay.held):
            self._scan_one(self.lay.held, name, self.held)
        for name in listdir_or_empty(self.io, self.lay.inflight):
            path = join(self.lay.inflight, name)
            parsed = parse_inflight(name)
            if parsed is None:
                self.junk(path, "not an inflight entry name")
            elif self._link_ok(path, parsed[0]):
                self.inflight.setdefault(parsed[0], []).append((parsed[1], path))

    def _scan_one(self, directory: str, name: str, into: dict[EntryName, str]) -> None:
        path = join(directory, name)
        e = EntryName.parse(name)
        if e is None:
            self.junk(path, "not an entry name")
        elif self._link_ok(path, e):
            into[e] = path

    # ---- 2. duplicates -----------------------------------------------------------------

    def resolve_duplicates(self) -> None:
        changed: set[str] = set()

        def drop(path: str, directory: str) -> None:
            if if_exists(self.io.unlink, path):
                self.orphans += 1
                changed.add(directory)

        for e in self.cleanup:
            if e in self.queue:
                drop(self.queue.pop(e), self.lay.queue)
            if e in self.held:
                drop(self.held.pop(e), self.lay.held)
        for e in self.held:
            if e in self.queue:
                drop(self.queue.pop(e), self.lay.queue)
        for e, links in list(self.inflight.items()):
            keep = [(o, p) for o, p in links if self.alive(o)]
            dead = [(o, p) for o, p in links if not self.alive(o)]
            if (not keep and dead and e not in self.cleanup and e not in self.queue
                    and e not in self.held):
                keep.append(dead.pop(0))  # one dead claim survives, to be requeued
            for _, p in dead:
                drop(p, self.lay.inflight)
            if keep:
                self.inflight[e] = keep
            else:
                del self.inflight[e]
        if changed:
            self.q._sync_dirs(*sorted(changed))

    # ---- 3. cleanups -------------------------------------------------------------------

    def finish_cleanups(self) -> None:
        for e in sorted(self.cleanup):
            if self.q._cleanup_entry(e):
                self.cleaned += 1
        self.cleanup.clear()

    # ---- 4. uncommitted enqueues -------------------------------------------------------

    def remove_uncommitted(self) -> None:
        removed: set[str] = set()
        changed: set[str] = set()
        dead: list[str] = []
        building: set[str] = set()  # messages still under a dead owner's tmp/
        for owner in listdir_or_empty(self.io, self.lay.tmp):
            path = self.lay.tmp_owner(owner)
            if not OWNER_RE.match(owner) or not self.io.is_dir(path):
                self.junk(path, "not an owner's tmp directory")
            elif not self.alive(owner):
                dead.append(owner)
                building |= {m for m in listdir_or_empty(self.io, path) if MSGID_RE.match(m)}
        for e, path in sorted(self.queue.items()):
            if self._dangling(e, path, building):
                del self.queue[e]
                changed.add(self.lay.queue)
        for e, path in sorted(self.held.items()):
            if self._dangling(e, path, building):
                del self.held[e]
                changed.add(self.lay.held)
        for e, links in list(self.inflight.items()):
            for owner, path in list(links):
                if not self.alive(owner) and self._dangling(e, path, building):
                    links.remove((owner, path))
                    changed.add(self.lay.inflight)
            if not links:
                del self.inflight[e]
        if changed:
            self.q._sync_dirs(*sorted(changed))
        # Their links are gone first, then the hard links their commits had made, then
        # the files: a crash at any point leaves what the next run finds again by the
        # files under tmp/ (hard links removed after the files would be found by nothing
        # but the orphan sweep, which waits for an exclusive recovery: C8).
        building_ids = {m for owner in dead for m in self._uncommitted_of(owner)}
        if self._remove_refs_of(building_ids):
            self.q._sync_dirs(self.lay.data)
        for owner in dead:
            removed |= self._remove_tmp_of(owner)
            changed.add(self.lay.tmp)
        self.uncommitted += len(removed)
        if changed:
            self.q._sync_dirs(*sorted(changed))

    def _uncommitted_of(self, owner: str) -> set[str]:
        """Ids of a dead owner's messages under construction (not also ``data/<msgid>``)."""
        out = set()
        base = self.lay.tmp_owner(owner)
        for m in listdir_or_empty(self.io, base):
            if not MSGID_RE.match(m):
                continue
            committed = lstat_or_none(self.io, self.lay.msg_file(m))
            mine = lstat_or_none(self.io, join(base, m))
            if mine is None or (committed is not None and (
                    (committed.st_dev, committed.st_ino) == (mine.st_dev, mine.st_ino))):
                continue
            out.add(m)
        return out

    def _remove_tmp_of(self, owner: str) -> set[str]:
        """Remove a dead owner's message files under construction; returns their ids.  A
        file that is also ``data/<msgid>`` (a commit rename that persisted at its
        destination only) loses just its extra name, which would count as a reference."""
        out = set()
        base = self.lay.tmp_owner(owner)
        for m in listdir_or_empty(self.io, base):
            path = join(base, m)
            committed = lstat_or_none(self.io, self.lay.msg_file(m))
            mine = lstat_or_none(self.io, path)
            if mine is None:
                continue
            if committed is not None and (
                    (committed.st_dev, committed.st_ino) == (mine.st_dev, mine.st_ino)):
                if_exists(self.io.unlink, path)
                continue
            remove_tree(self.io, path)
            if MSGID_RE.match(m):
                out.add(m)
        try:
            if_exists(self.io.rmdir, base)
        except OSError as e:
            self.problems.append(f"tmp/{owner} could not be removed: {e}")
        return out

    def _remove_refs_of(self, msgids: set[str]) -> bool:
        """Unlink the hard links that uncommitted messages ``msgids`` left under data/."""
        if not msgids:
            return False
        changed = False
        for n in listdir_or_empty(self.io, self.lay.data):
            m = DATA_RE.match(n)
            if m is not None and m["index"] is not None and m["msgid"] in msgids and (
                    not self.io.exists(self.lay.msg_file(m["msgid"]))):
                changed |= if_exists(self.io.unlink, join(self.lay.data, n))
        return changed

    def _dangling(self, e: EntryName, path: str, building: set[str]) -> bool:
        """Handle a link whose message file is missing; True if the link was taken away.
        ``building``: messages whose file is still under a dead owner's ``tmp/``."""
        if lstat_or_none(self.io, self.lay.msg_file(e.msgid)) is not None:
            return False
        if self.io.exists(self.lay.quarantined(f"{e.msgid}.msg")):
            self.q._quarantine_links_of(e.msgid)
            return True
        if e.msgid in self.replaced:  # committed: an enqueue never makes such a name
            if e.msgid not in self.lost:  # its first link: every link goes aside then
                self._lost_message(e.msgid)
            return True
        if self.alive(owner_of_msgid(e.msgid)):
            return False  # an enqueue in progress: its owner commits or discards it
        if e.msgid in building or self.io.exists(self.lay.quarantined(f"{e.msgid}.lost.note")):
            if e.msgid not in building:  # a message found lost before: its last links
                self.q._quarantine_links_of(e.msgid)
                return True
            if_exists(self.io.unlink, path)  # an uncommitted enqueue
            return True
        self._lost_message(e.msgid)
        return True

    def _lost_message(self, msgid: str) -> None:
        """A committed message whose file is gone: note it, move its links aside, report
        it with its entries (never deleted silently)."""
        links = sorted(set(self.q._links_of_message(self.lay.queue, msgid))
                       | set(self.q._links_of_message(self.lay.held, msgid))
                       | set(self.q._links_of_message(self.lay.inflight, msgid)))
        entries = sorted({n.split("@")[0] for n in links})
        self.q._write_note(f"{msgid}.lost", f"message {msgid}: its file data/{msgid} is "
                                 f"missing; entries {', '.join(entries)} lost; their links "
                                 "are kept here")
        kept = self._keep_a_hard_link(msgid)
        self.q._quarantine_links_of(msgid)
        self.lost.add(msgid)
        self.damaged.append(f"quarantine/{msgid}.lost.note")
        self.problems.append(f"message {msgid} lost: its file data/{msgid} is missing; "
                             f"entries {', '.join(entries)}; links moved to quarantine/"
                             + (f"; its content, still linked as {kept}, kept as "
                                f"quarantine/{msgid}.unlinked (`queue-ref repair` re-queues "
                                "it if intact)" if kept else ""))

    def _keep_a_hard_link(self, msgid: str) -> str | None:
        """Keep the content of a message whose own name is gone as
        ``quarantine/<msgid>.unlinked``: a new name for one of its links (its entries'
        links are hard links to the same file), or an old-format reference link moved
        there.  A failed enqueue cut by a power cut can leave this too, so nothing is put
        back here."""
        dest = self.lay.quarantined(f"{msgid}.unlinked")
        if self.io.exists(dest):
            return None
        found: list[tuple[int, str]] = []  # (names of its file, path) of each link
        for d in (self.lay.queue, self.lay.held, self.lay.inflight):
            for n in sorted(self.q._links_of_message(d, msgid)):
                st = lstat_or_none(self.io, join(d, n))
                if st is not None and stat.S_ISREG(st.st_mode):
                    found.append((st.st_nlink, join(d, n)))
        # the file most names share first (a stable sort keeps the order found among
        # equals): the message's own, not a file someone put in one entry's place
        found.sort(key=lambda f: -f[0])
        for _, path in found:
            try:
                self.io.link(path, dest)
            except (FileNotFoundError, FileExistsError):
                continue
            self.q._sync_dirs(self.lay.quarantine)
            return os.path.relpath(path, self.lay.root)
        for n in sorted(listdir_or_empty(self.io, self.lay.data)):
            m = DATA_RE.match(n)
            if (m is None or m["msgid"] != msgid or m["index"] is None or m["sched"]
                    or m["owner"]):
                continue
            if self.q._move_link(join(self.lay.data, n), dest):
                self.q._sync_dirs(self.lay.data, self.lay.quarantine)
                return f"data/{n}"
        return None

    # ---- 5. requeue --------------------------------------------------------------------

    def requeue(self) -> None:
        for e, links in sorted(self.inflight.items()):
            for owner, path in links:
                if owner == self.q.owner or self.alive(owner):
                    continue
                if self.q._move_link(path, self.lay.queue_link(e)):
                    self.requeued += 1
                    self.queue[e] = self.lay.queue_link(e)
        if self.requeued:
            self.q._sync_move(self.lay.inflight, self.lay.queue)

    # ---- 6. orphans --------------------------------------------------------------------

    def _referenced(self) -> set[str]:
        """Entry ids that a link in queue/, held/, inflight/ or cleanup/ names, read afresh."""
        refs: set[str] = set()
        for d in (self.lay.queue, self.lay.held, self.lay.cleanup):
            refs.update(n for n in listdir_or_empty(self.io, d) if EntryName.parse(n))
        for n in listdir_or_empty(self.io, self.lay.inflight):
            parsed = parse_inflight(n)
            if parsed is not None:
                refs.add(parsed[0].entry_id)
        return refs

    def remove_dead_temps(self) -> None:
        """Not exclusive: the schedule records dead owners were writing
        (``data/<msgid>.<i>.<owner>.tmp``; the orphan sweep, which removes them, runs only
        when no other owner is alive, so a process killed inside a reschedule beside a
        live one would leave its temp file until every process restarted: C8).  A temp
        is never renamed into place after its owner died, so it holds nothing."""
        changed = False
        for n in listdir_or_empty(self.io, self.lay.data):
            m = DATA_RE.match(n)
            if m is None or m["owner"] is None or self.alive(m["owner"]):
                continue
            st = lstat_or_none(self.io, join(self.lay.data, n))
            if st is None or not stat.S_ISREG(st.st_mode):
                continue  # not a file we wrote: the exclusive sweep quarantines it
            if if_exists(self.io.unlink, join(self.lay.data, n)):
                changed = True
                self.orphans += 1
        if changed:
            self.q._sync_dirs(self.lay.data)

    def remove_orphans(self) -> None:
        """Exclusive only: remove every name under data/ that no link needs.  The message
        file goes last, so a crash in between leaves it, still an orphan, for the next run."""
        refs = self._referenced()
        live_msgs = {r.rsplit(".", 1)[0] for r in refs}
        names: dict[str, list[tuple[str, str | None, bool]]] = defaultdict(list)
        for n in listdir_or_empty(self.io, self.lay.data):
            path = join(self.lay.data, n)
            m = DATA_RE.match(n)
            st = lstat_or_none(self.io, path)
            if st is None:
                continue
            if m is None or not stat.S_ISREG(st.st_mode):
                self.junk(path, "not a name the queue creates under data/")
                continue
            names[m["msgid"]].append((n, m["index"], m["owner"] is not None))
        changed = False
        for msgid, group in sorted(names.items()):
            dead = msgid not in live_msgs
            removed = finished = False
            if dead and any(index is None and not temp for _, index, temp in group):
                finished = self._cleaned_up(msgid, group)
                if not finished:
                    changed |= self._unlinked_message(msgid)
                    removed = True
            for n, index, temp in sorted(group, key=lambda g: g[1] is None):
                entry = f"{msgid}.{index}"
                if not (dead or temp or (index is not None and entry not in refs)):
                    continue
                if index is None and not temp and not finished:
                    continue  # the message file: moved to quarantine above
                if not dead and not temp and index is not None and not n.endswith(".sched"):
                    if self._beyond_envelope(msgid, int(index)):
                        changed |= if_exists(self.io.unlink, join(self.lay.data, n))
                        self.problems.append(
                            f"data/{n}: a name of message {msgid}'s file for an entry the "
                            "message does not have (not one the queue made); removed")
                        continue
                    self.lost.add(msgid)
                    copy = self.q._copy_body_aside(EntryName(msgid, int(index)))
                    self.problems.append(
                        f"entry {entry} lost: its hard link data/{n} is left but no link "
                        "names the entry (its link was removed, or a power cut cut its "
                        "cleanup short: then it was delivered); removed" + (
                            f"; the body, which its message's other entries still hold, "
                            f"copied to quarantine/{os.path.basename(copy)} in case it was "
                            "not delivered" if copy else ""))
                path = join(self.lay.data, n)
                if n.endswith(".sched") and (
                        self.io.exists(self.lay.quarantined(f"{entry}.note"))
                        or self.io.exists(self.lay.quarantined(f"{msgid}.note"))):
                    changed |= self.q._move_link(path, self.lay.quarantined(n))
                    continue  # the record of a half-done quarantine: kept there
                if if_exists(self.io.unlink, path):
                    changed = removed = True
                    if not dead:
                        self.orphans += 1
            if dead and removed:
                self.orphans += 1
        if changed:
            self.q._sync_dirs(self.lay.data, self.lay.quarantine)

    def _cleaned_up(self, msgid: str, group: list[tuple[str, str | None, bool]]) -> bool:
        """Whether a message file no link names is one every entry's cleanup has released:
        a message of 2+ recipients none of whose references is left (cleanup unlinks an
        entry's reference before its link, and nothing else unlinks one but a quarantine
        of the entry, which leaves a note, or a recovery that reported the message lost,
        whose note is written before it unlinks the references and whose move of the
        file a power cut may undo).  Sibling entries cleaned up at once each
        unlink their link before the last of them, seeing the count at one, frees the
        file: a crash in between leaves it so, and it is an orphan, not lost mail.  A
        message of one recipient (no reference), or whose envelope cannot be read, is
        not known to be finished."""
        if any(index is not None and not temp and not n.endswith(".sched")
               for n, index, temp in group):
            return False
        try:
            env = self.q._read_envelope(self.lay.msg_file(msgid), msgid)
        except (Corrupt, OSError):
            return False
        if len(env.rcpts) < 2 or any(
                self.io.exists(self.lay.quarantined(f"{msgid}{kind}.note"))
                for kind in ("", ".unlinked", ".lost")):
            return False  # a quarantine, or a report of loss whose move a power cut undid
        return not any(self.io.exists(self.lay.quarantined(f"{msgid}.{i}.note"))
                       for i in range(len(env.rcpts)))

    def _beyond_envelope(self, msgid: str, index: int) -> bool:
        """Whether the message's intact envelope has no recipient ``index`` (a name that
        claims an entry the message never had); False when it cannot be read."""
        try:
            env = self.q._load_envelope(msgid)
        except (Corrupt, OSError):
            return False
        return env is not None and index >= len(env.rcpts)

    def _unlinked_message(self, msgid: str) -> bool:
        """A message file no link names: moved to ``quarantine/<msgid>.unlinked`` with a
        note, reported lost (``queue-ref repair`` re-queues an intact one)."""
        src = self.lay.msg_file(msgid)
        try:
            env = self.q._read_envelope(src, msgid)
            what = (f"intact, {len(env.rcpts)} recipient(s): {', '.join(r.address for r in env.rcpts)}")
        except Corrupt as c:
            what = f"damaged too: {c.reason}"
        except FileNotFoundError:
            return False
        dest = self.lay.quarantined(f"{msgid}.unlinked")
        self.q._write_note(f"{msgid}.unlinked", f"message {msgid}: no link names it ({what}); "
                           "its links were removed, or a power cut cut its cleanup or an "
                           "unacknowledged commit short; `queue-ref repair` re-queues it")
        if not self.q._move_link(src, dest):
            return False
        self.lost.add(msgid)
        self.damaged.append(f"quarantine/{msgid}.unlinked")
        self.problems.append(f"message {msgid} lost: no link names its file ({what}); moved "
                             f"to quarantine/{msgid}.unlinked")
        return True

    # ---- 7. verification and the domain index -------------------------------------------

    def _index(self, e: EntryName, address: str) -> None:
        """Put back the index link of a queued or held entry if it is missing."""
        path = self.lay.domain_link(domain_of(address), e)
        self.index_paths[e.entry_id] = path
        if lstat_or_none(self.io, path) is None:
            self.q._add_to_index(e, address)

    def prune_index(self) -> None:
        """Exclusive only: remove index links of entries no link names (an anchor being
        replaced when its process died too), and links of
        verified entries under another domain's directory (unsynced: a link a power cut
        brings back is removed again by the next recovery)."""
        refs = self._referenced()
        for d in listdir_or_empty(self.io, self.lay.domains):
            path = join(self.lay.domains, d)
            if not DOMAIN_DIR_RE.match(d) or not self.io.is_dir(path):
                self.junk(path, "not a directory of the domain index")
                continue
            for n in listdir_or_empty(self.io, path):
                link = join(path, n)
                if n == DOMAIN_ANCHOR:
                    continue
                if n not in refs or self.index_paths.get(n, link) != link:
                    if_exists(self.io.unlink, link)

    def verify_queued(self) -> None:
        relinked = False
        for e, path in sorted([*self.queue.items(), *self.held.items()]):
            try:
                got = self.q._load_entry(e)
                if got is not None and e.index < len(got[0].rcpts):
                    self._index(e, got[0].rcpts[e.index].address)
                    if self.exclusive and len(got[0].rcpts) > 1:
                        relinked |= self._restore_ref(e)
            except Corrupt as c:
                if not is_link_file(self.io, path):
                    continue  # taken and cleaned up by a live process meanwhile
                where = self.q._quarantine_corrupt(e, path, c)
                self.quarantined += 1
                self.problems.append(f"entry {e.entry_id}: {c.reason}; quarantined to {where}")
                if not c.stray:  # a stray link was no entry: nothing of the message is lost
                    self.lost.add(e.msgid)
                    rel = os.path.relpath(where, self.q.root)
                    if rel not in self.damaged:
                        self.damaged.append(rel)
        if relinked:
            self.q._sync_dirs(self.lay.data, self.lay.tmp_owner(self.q.owner))
            self.relinked.clear()

    def _restore_ref(self, e: EntryName) -> bool:
        """Exclusive only: give a verified entry of a message of 2+ recipients its hard
        link ``data/<msgid>.<i>`` back if it is missing (or is another file, which goes
        to quarantine).  The message's link count counts the entries that still need its
        file; without the entry's link, the cleanup of the last other entry would free
        the file while this one is queued (C1).  Nothing else removes the link of an
        entry a link names, so a missing one is damage at rest: reported, and mended.
        True if a link was made."""
        ref, msg = self.lay.ref(e), self.lay.msg_file(e.msgid)
        if e.msgid not in self.msg_stats:  # one lstat per message, not per entry
            self.msg_stats[e.msgid] = lstat_or_none(self.io, msg)
        have, want = lstat_or_none(self.io, ref), self.msg_stats[e.msgid]
        if want is None or (have is not None and (have.st_dev, have.st_ino)
                            == (want.st_dev, want.st_ino)):
            return False
        if have is not None and stat.S_ISREG(have.st_mode) and self._a_copy(
                ref, have, e.msgid, want):
            self._relink(ref, e.msgid)
            return True
        if have is not None:
            self.junk(ref, "not a hard link of its message file")
        try:
            self.io.link(msg, ref)
        except (FileExistsError, FileNotFoundError):  # mended or gone meanwhile
            return False
        self.problems.append(f"entry {e.entry_id}: its hard link data/{e.entry_id} was "
                             "missing (its message's link count was one short); restored")
        return True
