"""Reading and verifying an entry's metadata, and moving corrupt things to quarantine/.

Quarantine layout:

* ``<msgid>.note`` / ``<msgid>.msg``: a message whose envelope or body failed its checksum
  (the message file ``data/<msgid>``, moved), its schedule records as ``<entry>.sched``,
  and every queue/inflight link of it as ``<link name>.link`` (hard links to the same
  file).  Its reference links ``data/<msgid>.<i>`` are unlinked.
* ``<entry>.note`` / ``<entry>.sched`` / ``<entry>.msg``: an entry whose schedule record
  failed its checksum; the rest of its message stays in service.  Its link is unlinked
  (a hard link kept would hold the message file for good), or moved beside the file
  as ``<link name>.link`` when the entry was the file's last holder.
* ``junk.<owner>.<n>.<where>.<name>``: something in our directories that is not ours (a
  file in a link directory that is not a hard link to its message file, a name we never
  create).  Never followed, never deleted; reported by recovery.

Each quarantine writes its note durably first, then moves things with renames whose
directories are fsynced, so a crash leaves either the old place or quarantine/ for each
piece; recovery finishes a half-done quarantine (see fs_recovery.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import stat
import threading
import time
from collections import OrderedDict
from os.path import basename, join

from queue_ref.fsqueue.diskutil import (
    copy_whole,
    if_exists,
    listdir_or_empty,
    lstat_or_none,
    write_whole,
)
from queue_ref.fsqueue.fs_records import (
    TRAILER_LEN,
    Envelope,
    RecordError,
    decode_schedule,
    parse_trailer,
)
from queue_ref.fsqueue.layout import DATA_RE, EntryName
from queue_ref.fsqueue.owners import Owners
from queue_ref.fsqueue.steps import FsSteps
from queue_ref.io import read_file
from queue_ref.storage import Schedule

MAX_ENVELOPE = 1 << 28
MAX_SCHEDULE = 1 << 16
_junk_numbers = itertools.count()


class Corrupt(Exception):
    """Metadata of an entry failed verification; ``whole_message`` says what is affected.
    ``stray``: the link names an entry its (intact) message does not have; only the link
    is quarantined."""

    def __init__(self, reason: str, whole_message: bool, *, stray: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.whole_message = whole_message
        self.stray = stray


class EnvelopeCache:
    """Verified envelopes by message id, least recently used evicted first.

    An entry read from disk is keyed by (inode, size, mtime) of the message file and is a
    hit for ``get`` only while the file still has them.  An entry ``put`` with key None was
    written by this queue itself (at commit): ``get`` ignores it, ``peek`` returns it.
    Message files are never rewritten while the message exists, so what this queue wrote
    stays true for as long as it does; ``peek`` and ``file_size`` serve callers that know
    the message is live.  Each entry also holds the size of the message file.

    The cache holds at most ``messages`` envelopes and ``recipients`` recipients in all,
    so that memory stays bounded whatever the size of the recipient lists; an envelope
    with more recipients than that is not kept.
    """

    def __init__(self, messages: int = 1024, recipients: int = 65536) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[tuple[int, int, int] | None, Envelope, int]] = (
            OrderedDict())
        self._messages = messages
        self._recipients = recipients
        self._held = 0  # recipients of the cached envelopes

    def get(self, msgid: str, key: tuple[int, int, int]) -> Envelope | None:
        with self._lock:
            hit = self._items.get(msgid)
            if hit is None or hit[0] != key:
                return None
            self._items.move_to_end(msgid)
            return hit[1]

    def peek(self, msgid: str) -> Envelope | None:
        """The cached envelope of ``msgid`` whatever its key; None if not cached."""
        hit = self._items.get(msgid)
        return None if hit is None else hit[1]

    def file_size(self, msgid: str) -> int | None:
        """The size of the message file of ``msgid``, if its envelope is cached."""
        hit = self._items.get(msgid)
        return None if hit is None else hit[2]

    def put(self, msgid: str, key: tuple[int, int, int] | None, env: Envelope,
            size: int) -> None:
        """Cache ``env``, from a message file of ``size`` bytes."""
        with self._lock:
            self._pop(msgid)
            if len(env.rcpts) > self._recipients:
                return
            self._items[msgid] = (key, env, size)
            self._held += len(env.rcpts)
            while len(self._items) > self._messages or self._held > self._recipients:
                self._pop(next(iter(self._items)))

    def drop(self, msgid: str) -> None:
        with self._lock:
            self._pop(msgid)

    def _pop(self, msgid: str) -> None:
        old = self._items.pop(msgid, None)
        if old is not None:
            self._held -= len(old[1].rcpts)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def recipients(self) -> int:
        """Recipients of the envelopes held now."""
        return self._held


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class FsMetadata(FsSteps):
    """Metadata loading and quarantine steps.  FsQueue provides the attributes."""

    root: str
    _envelopes: EnvelopeCache
    _owners: Owners

    # ---- loading ---------------------------------------------------------------------

    def _load_envelope(self, msgid: str) -> Envelope | None:
        """The verified envelope of a committed message; None if its file is missing (not
        committed, or cleaned up).  Raises Corrupt (whole message) or OSError."""
        path = self.layout.msg_file(msgid)
        st = lstat_or_none(self.io, path)
        if st is None:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise Corrupt(f"message file of {msgid} is not a regular file", True)
        key = _stat_key(st)
        env = self._envelopes.get(msgid, key)
        if env is None:
            try:
                env = self._read_envelope(path, msgid)
            except FileNotFoundError:
                return None
            self._envelopes.put(msgid, key, env, st.st_size)
        return env

    def _entry_address(self, e: EntryName) -> str | None:
        """The recipient of ``e``: from the envelope cache, else read (None if the message
        file is gone or damaged)."""
        try:
            env = self._envelopes.peek(e.msgid) or self._load_envelope(e.msgid)
        except (Corrupt, OSError):
            return None
        if env is None or e.index >= len(env.rcpts):
            return None
        return env.rcpts[e.index].address

    def _live_envelope(self, msgid: str) -> Envelope | None:
        """The envelope of a message the caller knows is live (it holds one of its
        entries): the one this queue cached (committed or verified here) as it is, else
        read and verified.  Raises as ``_load_envelope``."""
        return self._envelopes.peek(msgid) or self._load_envelope(msgid)

    @staticmethod
    def _envelope_fits(n: int, size: int) -> bool:
        """Whether an envelope of ``n`` bytes (as a trailer says, maybe damaged) can lie in
        a message file of ``size`` bytes: a damaged length must be refused here, before
        it becomes an offset (C6, C9)."""
        return n <= min(MAX_ENVELOPE, size - TRAILER_LEN)

    def _read_envelope(self, path: str, msgid: str) -> Envelope:
        """Read the envelope from the end of a message file and check that the body it
        describes fills the rest exactly.  Raises Corrupt or OSError."""
        fd = self.io.open_read(path)
        try:
            size = self.io.fsize(fd)
            if size < TRAILER_LEN:
                raise Corrupt(f"message {msgid} is shorter than its trailer", True)
            n = parse_trailer(self.io.pread(fd, TRAILER_LEN, size - TRAILER_LEN))
            if not self._envelope_fits(n, size):
                raise Corrupt(f"envelope of {msgid} is larger than its message", True)
            raw = self.io.pread(fd, n, size - TRAILER_LEN - n)
            env = Envelope.decode(raw, msgid)
        except RecordError as e:
            raise Corrupt(f"envelope of {msgid}: {e}", True) from e
        finally:
            self.io.close(fd)
        if env.body_size != size - TRAILER_LEN - n:
            raise Corrupt(f"message {msgid}: body is not the {env.body_size} bytes its "
                          "envelope says", True)
        return env

    def _load_entry(self, e: EntryName) -> tuple[Envelope, Schedule] | None:
        """Envelope and current schedule of a committed entry; None if its message file is
        gone (the link dangles: uncommitted, or cleaned up).  Raises Corrupt or OSError."""
        env = self._load_envelope(e.msgid)
        if env is None:
            return None
        return env, self._entry_schedule(e, env)[0]

    def _entry_schedule(self, e: EntryName, env: Envelope) -> tuple[Schedule, bool]:
        """The entry's current schedule, and whether it comes from a schedule record (else
        from the envelope).  Raises Corrupt or OSError."""
        if e.index >= len(env.rcpts):
            raise Corrupt(f"entry {e.entry_id} is not in its envelope (a stray link)", False,
                          stray=True)
        try:
            raw = read_file(self.io, self.layout.sched(e), MAX_SCHEDULE)
        except FileNotFoundError:
            return env.rcpts[e.index].schedule, False
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EFBIG):  # a symlink, or far too large
                raise Corrupt(f"schedule of {e.entry_id}: {err}", False) from err
            raise
        try:
            return decode_schedule(raw, e.entry_id), True
        except RecordError as err:
            raise Corrupt(f"schedule of {e.entry_id}: {err}", False) from err

    def _single_recipient(self, msgid: str) -> bool:
        env = self._envelopes.peek(msgid)
        return env is not None and len(env.rcpts) == 1

    # ---- quarantine ------------------------------------------------------------------

    def _write_note(self, name: str, text: str) -> None:
        """Durably write ``quarantine/<name>.note`` (temp, fsync, rename, fsync dir)."""
        final = self.layout.quarantined(f"{name}.note")
        tmp = f"{final}.{self.owner}.tmp"
        if_exists(self.io.unlink, tmp)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_whole(self.io, tmp, f"{stamp} {text}\n".encode(), self._sync_file)
        self.io.rename(tmp, final)
        self._sync_dirs(self.layout.quarantine)

    def _names_of_message(self, msgid: str) -> list[str]:
        """Names under data/ that belong to ``msgid`` besides its message file."""
        return self._links_of_message(self.layout.data, msgid)

    def _quarantine_message(self, msgid: str, reason: str) -> str:
        """Move a corrupt message (file, schedule records, every queue/inflight link) to
        quarantine/.

        Note first, then ``data/<msgid>`` (one rename), then its schedule records, its
        hard links (unlinked: they name the moved file), and the links, which now dangle
        and would be skipped by listers anyway; recovery moves dangling links of a
        quarantined message.  Cleanup links are left to cleanup, which tolerates missing
        data.  Returns the quarantined file."""
        self._envelopes.drop(msgid)
        self._write_note(msgid, f"message {msgid}: {reason}")
        dest = self.layout.quarantined(f"{msgid}.msg")
        src = self.layout.msg_file(msgid)
        if self.io.exists(src) and not self.io.exists(dest):
            try:
                self.io.rename(src, dest)
            except FileNotFoundError:
                pass  # another thread or process quarantined it first
            else:
                self._sync_dirs(self.layout.data, self.layout.quarantine)
        self._quarantine_names_of(msgid)
        self._quarantine_links_of(msgid)
        return dest

    def _quarantine_names_of(self, msgid: str) -> None:
        """Schedule records of a quarantined message to quarantine/, its hard links and
        temp records unlinked."""
        changed = False
        for n in self._names_of_message(msgid):
            m = DATA_RE.match(n)
            path = join(self.layout.data, n)
            if m is not None and m["sched"]:
                changed |= self._move_link(path, self.layout.quarantined(n))
            else:
                changed |= if_exists(self.io.unlink, path)
        if changed:
            self._sync_dirs(self.layout.data, self.layout.quarantine)

    def _move_aside(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst`` in quarantine/ (``_move_link``).  When ``dst`` already
        names the same file (a power cut kept both names of an earlier move), rename(2)
        would do nothing and succeed: ``src`` is unlinked instead."""
        there = lstat_or_none(self.io, dst)
        if there is not None and self._names_file(src, there):
            return self._unlink_link(src)
        return self._move_link(src, dst)

    def _quarantine_links_of(self, msgid: str) -> int:
        """Move the queue/, held/ and inflight/ links of ``msgid`` to quarantine/."""
        moved = 0
        for d in (self.layout.queue, self.layout.held, self.layout.inflight):
            names = self._links_of_message(d, msgid)
            for n in names:
                moved += self._move_aside(join(d, n), self.layout.quarantined(f"{n}.link"))
            if names:
                self._sync_dirs(d, self.layout.quarantine)
        return moved

    def _quarantine_entry(self, e: EntryName, link: str, reason: str) -> str:
        """Move an entry with a corrupt schedule record to quarantine/: note, a copy of the
        body if other entries still hold it, the link, then the record; the entry's hold
        on the message is then released as in cleanup.  Returns the quarantined record's
        path.

        The link is a hard link to the message file, so one kept in quarantine/ would
        count as a holder for good: it is moved there only when the entry holds the file
        alone (the file follows it, ``_body_keeper``); otherwise it is unlinked, and the
        note names it."""
        self._write_note(e.entry_id, f"entry {e.entry_id}: {reason}")
        dest = self.layout.quarantined(f"{e.entry_id}.sched")
        self._copy_body_aside(e, link)  # kept even if the link moved on meanwhile: another
        # quarantiner of the entry may have found this copy there and made none of its own
        alone = self._holds_alone(e, link)
        if alone:
            moved = self._move_aside(link, self.layout.quarantined(f"{basename(link)}.link"))
        else:
            moved = self._unlink_link(link)
        if not moved:
            return dest  # the entry moved on meanwhile: whoever holds it now sees the same
        self._sync_dirs(os.path.dirname(link), self.layout.quarantine)
        if self._move_link(self.layout.sched(e), dest):
            self._sync_dirs(self.layout.data, self.layout.quarantine)
        if_exists(self.io.unlink, self.layout.ref(e))
        st = lstat_or_none(self.io, self.layout.msg_file(e.msgid))
        if st is not None and (alone or st.st_nlink == 1) and self._free_message(
                e.msgid, self._body_keeper(e)):
            self._sync_dirs(self.layout.data, self.layout.quarantine)
        else:
            self._sync_dirs(self.layout.data)
        return dest

    def _holds_alone(self, e: EntryName, link: str) -> bool:
        """Whether the entry is its message file's only holder: no name of the file is
        left but ``data/<msgid>``, ``link`` and the entry's reference."""
        return self._other_holders(e, link) == 0

    def _other_holders(self, e: EntryName, link: str | None) -> int:
        """Names of the entry's message file other than ``data/<msgid>`` and the entry's
        own (``link``, its reference ``data/<msgid>.<i>``); -1 if the file is gone."""
        st = lstat_or_none(self.io, self.layout.msg_file(e.msgid))
        if st is None:
            return -1
        n = st.st_nlink - 1
        for p in ([link] if link is not None else []) + [self.layout.ref(e)]:
            n -= self._names_file(p, st)
        return n

    def _copy_body_aside(self, e: EntryName, link: str | None = None) -> str | None:
        """Copy the intact body of a quarantined entry to ``quarantine/<entry>.msg`` while
        other entries still hold its message file (their cleanup frees it later, and the
        entry's recipient would have nothing left to be sent from): durably, before the
        entry's link moves, so that a crash in between leaves the entry to quarantine
        again.  Another entry of the message set aside before has its copy there already:
        this one is a hard link to it.  ``link``: the entry's own link, which (with its
        reference ``data/<msgid>.<i>``) is not another holder.  The path of
        the copy made, or None (this entry is the file's last holder: its release keeps
        the file itself, see ``_body_keeper``; a copy is there; or the copy failed, a
        full disk, which leaves things as they were without one, and the report says
        so)."""
        src, dest = self.layout.msg_file(e.msgid), self._body_keeper(e)
        if dest is None or self.io.exists(dest) or self._other_holders(e, link) < 1:
            return None
        tmp = f"{dest}.{self.owner}.tmp"
        try:
            if_exists(self.io.unlink, tmp)
            earlier = self._copy_of(e.msgid)
            if earlier is not None:
                self.io.link(earlier, tmp)
            else:
                copy_whole(self.io, src, tmp, self._sync_file)
            self.io.rename(tmp, dest)
            self._sync_dirs(self.layout.quarantine)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if_exists(self.io.unlink, tmp)
            return None  # freed meanwhile: the entry moved on
        except OSError:
            with contextlib.suppress(OSError):
                if_exists(self.io.unlink, tmp)
            return None
        return dest

    def _copy_of(self, msgid: str) -> str | None:
        """A body copy an earlier entry of ``msgid`` left in quarantine/, if any."""
        prefix = msgid + "."
        for n in sorted(listdir_or_empty(self.io, self.layout.quarantine)):
            if n.startswith(prefix) and n.endswith(".msg") and n.count(".") == 2:
                return self.layout.quarantined(n)
        return None

    def _body_keeper(self, e: EntryName) -> str | None:
        """Where the message file goes when the quarantined entry ``e`` was the last to
        hold it: quarantine/, under the entry's name.  The body is intact (only the
        entry's schedule record failed), and deleting it would leave salvage nothing
        (C6: damaged files are kept aside, never deleted)."""
        return self.layout.quarantined(f"{e.entry_id}.msg")

    def _quarantine_corrupt(self, e: EntryName, link: str, c: Corrupt) -> str:
        """Quarantine what ``c`` says is corrupt; returns where it went."""
        if c.whole_message:
            return self._quarantine_message(e.msgid, c.reason)
        if c.stray:
            return self._quarantine_stray(e, link, c.reason)
        return self._quarantine_entry(e, link, c.reason)

    def _quarantine_stray(self, e: EntryName, link: str, reason: str) -> str:
        """Take a link that names an entry its message does not have out of service, with
        a note; the message and its real entries are not touched.  A hard link to the
        message file is unlinked (kept, it would hold the file for good); anything else
        is moved to quarantine/."""
        self._write_note(e.entry_id, f"link {basename(link)}: {reason}")
        dest = self.layout.quarantined(f"{basename(link)}.link")
        st = lstat_or_none(self.io, self.layout.msg_file(e.msgid))
        ours = st is not None and self._names_file(link, st)
        if self._unlink_link(link) if ours else self._move_link(link, dest):
            self._sync_dirs(os.path.dirname(link), self.layout.quarantine)
        return dest

    def _quarantine_junk(self, path: str, reason: str) -> str:
        """Move something that is not ours out of the way (one rename, then fsync both
        directories).  Never followed, never deleted.  Returns a line for the report."""
        where = basename(os.path.dirname(path))
        name = basename(path)
        tag = f"junk.{self.owner}.{next(_junk_numbers)}.{where}."
        safe = name if len(tag) + len(name) <= 255 else hashlib.sha256(
            name.encode("utf-8", "surrogateescape")).hexdigest()
        dest = self.layout.quarantined(tag + safe)
        if not self._move_link(path, dest):
            return f"{where}/{name!r}: {reason}; vanished before it could be moved"
        self._sync_dirs(os.path.dirname(path), self.layout.quarantine)
        return f"{where}/{name!r}: {reason}; moved to quarantine/{basename(dest)}"
