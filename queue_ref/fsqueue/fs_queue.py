"""FsQueue: the crash-safe filesystem queue (seed 001's layout with a full fsync discipline).

The on-disk protocol is in ``steps.py`` (one overridable method per step), metadata and
quarantine in ``metadata.py``, recovery in ``fs_recovery.py``.  This module maps the Storage
interface onto them.

What holds after failures, beyond ``queue_ref.storage``:

* **send_start is not synced.**  A claim that a crash loses leaves the entry QUEUED, which
  is where recovery puts an INFLIGHT entry anyway (spec rule 5).
* **reschedule claims the entry** (as send_start would) while it writes the new schedule,
  then puts it back in the queue.  Meanwhile a send_start of the same entry by another
  worker returns None, as if that worker had lost the race to a sender; no worker can ever
  take the entry with its old schedule after reschedule returned (Kannader's race).
* **A failed shared sync poisons the queue** (a ``syncfs``, or a directory fsync): the
  changes it covered are not trusted, so every later state change raises StorageIOError
  until the queue is reopened, whose recovery re-derives everything from the disk.  In
  ``fsync`` mode a failed file fsync (message file, schedule record) fails only its
  operation; a retry writes a new file.
* **Sync modes.**  ``syncfs`` (the default where ``syncfs(2)`` reports writeback errors,
  Linux 5.8 and later) shares one ``syncfs`` per group round between every caller, for
  files and directories alike: the fastest way to make many small files durable, but it
  also flushes whatever else is dirty on the same file system, so give the queue a file
  system of its own or choose ``fsync``.  ``fsync`` fsyncs each file in its writer's
  thread and shares directory fsyncs.  Both keep every clause (see docs/fs-queue.md).
* **Errors carry the handle back** re-armed, for the state the entry had before the call;
  a retry either completes the transition or returns None.
* **Spare files.**  Cleanup keeps the files of small one-recipient messages (up to
  ``spares`` of them) in ``tmp/<owner>/`` and enqueue writes new messages into them, so a
  message allocates no inode and no blocks (``spares.py``).  ``close()`` removes them;
  ``footprint()`` does not count them.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType

from queue_ref.fsqueue.diskutil import (
    if_exists,
    is_link_file,
    listdir_or_empty,
    storage_error,
    tree_usage,
)
from queue_ref.fsqueue.enqueue import FsEnqueuer
from queue_ref.fsqueue.fs_records import Envelope
from queue_ref.fsqueue.fs_recovery import Recovery
from queue_ref.fsqueue.groupsync import SYNC_MODES, GroupSync
from queue_ref.fsqueue.layout import (
    OWNER_LEN,
    EntryName,
    Layout,
    MessageIds,
    domain_of,
    is_owner_token,
    new_owner,
    parse_inflight,
)
from queue_ref.fsqueue.metadata import Corrupt, EnvelopeCache, FsMetadata
from queue_ref.fsqueue.owners import Owners
from queue_ref.fsqueue.reader import FsMailReader
from queue_ref.fsqueue.rwlock import SharedExclusive
from queue_ref.fsqueue.spares import DEFAULT_SPARES, SPARE_MAX_BODY, SPARE_RE, Spares
from queue_ref.fsqueue.steps import MessageTx
from queue_ref.io import IO, OsIO, close_iterator, first_of, syncfs_reports_errors
from queue_ref.storage import (
    Capability,
    ClosedError,
    CorruptionError,
    Enqueuer,
    EntryMeta,
    Finished,
    Footprint,
    Handle,
    HeldMail,
    InflightMail,
    InvalidInputError,
    Limits,
    MailReader,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    RecoveryReport,
    ReopenRequiredError,
    Schedule,
    Storage,
    StorageIOError,
    validate_address,
    validate_params,
    validate_schedule,
)

_CLAIMED = "claimed"  # QueuedMail._extra: a failed reschedule left the entry claimed by us


@dataclass(frozen=True)
class _Held:
    """What this queue learnt of an entry when it claimed it (InflightMail._extra, passed
    on to PendingCleanupMail._extra): whether its message has one recipient (so no hard
    links), and whether it had a schedule record.  Nobody else writes a schedule record
    while we hold the entry, so cleanup can skip the names that cannot exist."""

    single: bool
    record: bool


def default_sync_mode() -> str:
    """``"syncfs"`` where it reports writeback errors, else ``"fsync"``."""
    return "syncfs" if syncfs_reports_errors() else "fsync"


class FsQueue(FsMetadata, Storage):
    """A mail queue in a directory.  Several processes may open one root at once."""

    capabilities = frozenset({Capability.GROUP_COMMIT, Capability.STREAMING_BODIES,
                              Capability.MULTI_PROCESS, Capability.IO_SEAM, Capability.HOLD,
                              Capability.DOMAIN_INDEX})

    #: The sync mode when the constructor is given none (None: ``default_sync_mode()``).
    default_sync: str | None = None
    #: The recovery run at opening and by ``recover()`` (``fs_recovery.Recovery``).
    recovery: type[Recovery] = Recovery

    def __init__(self, root: str, io: IO | None = None, *, recover: bool = True,
                 owner: str | None = None, clock: Callable[[], int] = time.time_ns,
                 sync: str | None = None, spares: int = DEFAULT_SPARES) -> None:
        """Open (creating it durably if missing) the queue at ``root``.

        Takes an owner token and its liveness lock, and with ``recover`` runs ``recover()``
        before returning.

        ``owner``: the token naming this open queue in inflight links, temporary
        directories and message ids (``OWNER_LEN`` lowercase hex digits); default a random
        one.  A given token must be fresh: never used on this root before.  Other queues
        take a token whose liveness lock is free for a dead owner's, for good, so a reused
        token would let them requeue or adopt this queue's entries.  ``clock``: nanoseconds
        for message ids (default ``time.time_ns``), called once per enqueue; ids stay
        ordered and unique if it stalls or goes back.  A fixed owner and a counting clock
        make every run of a workload issue the same calls (crash exploration replays them).
        ``sync``: ``"syncfs"`` or ``"fsync"`` (see the module docstring); default
        ``default_sync`` of the class, else ``default_sync_mode()``.  ``spares``: how many
        spent message files to keep for reuse (0: none; see ``spares.py``).

        Raises InvalidInputError for a malformed ``owner``, a ``clock`` that is not
        callable, an unknown ``sync`` mode or a ``spares`` that is not a count (before
        touching the disk); OwnerInUseError
        (a MisuseError) if another open queue holds ``owner``, or if the token's lock file
        or temporary directory is left on disk by a queue that died; StorageIOError if the
        disk fails.  After any failure nothing is held open.
        """
        Storage.__init__(self)
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root or "\x00" in root:
            raise InvalidInputError(f"root must be a non-empty path without NUL, got {root!r}")
        if owner is None:
            owner = new_owner()
        elif not is_owner_token(owner):
            raise InvalidInputError(f"owner must be {OWNER_LEN} lowercase hex digits, "
                                    f"got {owner!r}")
        if not callable(clock):
            raise InvalidInputError(f"clock must be a callable returning nanoseconds, "
                                    f"got {clock!r}")
        mode = sync if sync is not None else (self.default_sync or default_sync_mode())
        if mode not in SYNC_MODES:
            raise InvalidInputError(f"sync must be one of {SYNC_MODES}, got {mode!r}")
        if not isinstance(spares, int) or isinstance(spares, bool) or spares < 0:
            raise InvalidInputError(f"spares must be a count of files (an int >= 0), "
                                    f"got {spares!r}")
        self.io: IO = io if io is not None else OsIO()
        self.root = os.path.abspath(root)
        self.layout = Layout(self.root)
        self.owner = owner
        self.ids = MessageIds(self.owner, clock)
        self._group = GroupSync(self.io, mode, self.layout.data)
        self._poisoned: str | None = None
        self._rw = SharedExclusive()
        self._envelopes = EnvelopeCache()
        self._owners = Owners(self.io, self.layout, self.owner)
        self._owner_fd: int | None = None
        self._pinned: list[str] = []
        self._link_max = 2 ** 31 - 1
        self._spares = Spares(self.layout.tmp_owner(owner), spares)
        self._reading: Counter[str] = Counter()  # open MailReaders by message id
        self._reading_lock = threading.Lock()
        self.last_recovery: RecoveryReport | None = None
        self._made_tmp = False
        try:
            self._create_layout()
            with self._owners.gate():
                self._owner_fd = self._owners.register()
                self.io.mkdir(self.layout.tmp_owner(self.owner))
                self._made_tmp = True
                self._sync_dirs(self.layout.tmp)
                self._pin_dirs()
                self._link_max = self.io.link_max(self.layout.data)
                if recover:
                    self.last_recovery = self.recovery(self).run()
                else:
                    self._refuse_old_format()
        except OSError as e:
            self._abandon_open()
            raise storage_error(f"opening the queue at {self.root}", e) from e
        except BaseException:
            self._abandon_open()
            raise

    def _create_layout(self) -> None:
        """mkdir the root and its directories that are missing; fsync each parent."""
        parent = os.path.dirname(self.root)
        fresh = not self.io.is_dir(self.layout.data)
        if not self.io.is_dir(self.root):
            with suppress(FileExistsError):
                self.io.mkdir(self.root)
            self.io.fsync_dir(parent)
        created = False
        for d in self.layout.dirs():
            if not self.io.is_dir(d):
                try:
                    self.io.mkdir(d)
                except FileExistsError:
                    continue
                created = True
        if fresh:
            self._mark_format()
        if created:
            self.io.fsync_dir(self.root)

    @property
    def limits(self) -> Limits:
        """Recipients per message: half of one fewer than the file system's names per
        file (each recipient gives the message file two names); the
        spare files kept for reuse (``spares``)."""
        return Limits(max_recipients=self._max_recipients, pool_files=self._spares.capacity)

    @property
    def sync_mode(self) -> str:
        """``"syncfs"`` or ``"fsync"``: how group commit makes changes durable."""
        return self._group.mode

    def _pin_dirs(self) -> None:
        """Hold the directories that group commit syncs open (see ``IO.pin_dir``): they
        stay in place while the queue is open."""
        dirs = [self.layout.data]
        if self.sync_mode == "fsync":
            dirs += [self.layout.queue, self.layout.inflight, self.layout.cleanup,
                     self.layout.held, self.layout.tmp_owner(self.owner)]
        for d in dirs:
            self.io.pin_dir(d)
            self._pinned.append(d)

    def _refuse_old_format(self) -> None:
        """An opening without recovery cannot convert the old format (its entries, as
        symlinks, would not be seen): it refuses, naming the repair."""
        if self.old_format:
            raise StorageIOError(
                f"the queue at {self.root} is in the old format (entries as symlinks): it "
                "is converted by the recovery of an opening while no other process has it "
                f"open; run `queue-ref repair --queue {self.root}` with the queue stopped")

    def _abandon_open(self) -> None:
        """A failed opening leaves no trace of its owner: its empty ``tmp/<owner>/``
        (else taken for a dead process's, see ``dead_owners``) and its lock."""
        if self._made_tmp:
            with suppress(OSError):
                if_exists(self.io.rmdir, self.layout.tmp_owner(self.owner))
        self._release_owner()
        self._closed = True

    def _release_owner(self) -> None:
        while self._pinned:
            with suppress(OSError):
                self.io.unpin_dir(self._pinned.pop())
        fd, self._owner_fd = self._owner_fd, None
        if fd is not None:
            self._owners.release(fd)

    def close(self) -> None:
        """Release the owner lock.  Entries this queue holds inflight become a dead owner's
        and are requeued by the next recovery (or adopted by ``find_inflight``)."""
        if self._closed:
            return
        self._closed = True
        with self._rw.exclusive():  # operations still running end first
            with suppress(OSError):  # else recovery removes them once we are gone
                for spare in self._spares.drain():
                    if_exists(self.io.unlink, spare)
            with suppress(OSError):  # enqueues still open: recovery removes them once we are gone
                if_exists(self.io.rmdir, self.layout.tmp_owner(self.owner))
            self._release_owner()

    # ---- guards ----------------------------------------------------------------------

    def _guard(self, what: str, handle: Handle | None, *, writes: bool = True) -> _Guard:
        """Shared lock, poison check (for state changes), and OSError -> StorageIOError
        carrying the handle back, re-armed."""
        if writes and self._poisoned is not None:
            raise ReopenRequiredError(self._poisoned,
                                      self._give_back(handle) if handle else None)
        return _Guard(self, what, handle)

    def _entry(self, h: Handle) -> EntryName:
        e = EntryName.parse(h.entry_id)
        if e is None:
            raise InvalidInputError(f"malformed entry id {h.entry_id!r}")
        return e

    # ---- listing ---------------------------------------------------------------------

    def _listdir(self, directory: str, *, ordered: bool = True) -> list[str]:
        """The names in ``directory`` (none if it is gone), sorted unless ``ordered`` is
        False; StorageIOError if the disk fails to read it."""
        try:
            return listdir_or_empty(self.io, directory, ordered=ordered)
        except OSError as e:
            raise storage_error(f"listing {directory}", e) from e

    def _sorted_names(self, directory: str) -> list[EntryName]:
        """Entries named in a link directory, oldest message first (junk left out)."""
        out = [e for e in map(EntryName.parse, self._listdir(directory)) if e]
        out.sort()
        return out

    def _names_in_order(self, directory: str) -> Iterator[EntryName]:
        """``_sorted_names`` for a big directory: the names come out in their order as
        strings, which orders messages as their ids and keeps each message's names
        together (a message id ends where ``.`` comes, which sorts before every digit),
        and only one message's names are parsed at a time, each name dropped once given:
        a million queued entries cost their names' strings, not a million objects more.
        The names are a heap (``heapify`` in place: about 2n comparisons), not sorted
        first (n log n): the first entry comes after one pass over the names, and each
        next one costs log n (``mailq``'s first line at a million queued)."""
        names = self._listdir(directory, ordered=False)  # not sorted: heaped here
        heapq.heapify(names)
        group: list[EntryName] = []
        while names:
            e = EntryName.parse(heapq.heappop(names))
            if e is None:
                continue
            if group and group[0].msgid != e.msgid:
                group.sort()
                yield from group
                group = []
            group.append(e)
        group.sort()
        yield from group

    def _verified(self, e: EntryName, link: str, *, check_link: bool = True
                  ) -> tuple[Envelope, Schedule] | None:
        """Metadata of the entry linked at ``link``; None if the link is not (or no longer)
        a committed link of ``e``.  Corrupt metadata is quarantined (None).
        ``check_link=False`` when the caller has just renamed the link there itself (its
        text was checked when it was listed, created, or found by recovery).

        With ``check_link`` the link is read again after the metadata: an entry claimed,
        sent and cleaned up by another caller in between has lost its schedule record,
        and the envelope's first schedule read then must not be listed as its schedule
        (a listing gives each entry as it was at one moment of the call)."""
        if check_link and not is_link_file(self.io, link):
            return None
        try:
            got = self._load_entry(e)
        except Corrupt as c:
            if is_link_file(self.io, link):  # not just cleaned up meanwhile
                where = self._quarantine_corrupt(e, link, c)
                self._note_set_aside(e.entry_id, e.msgid, f"{c.reason} (quarantined to "
                                                          f"{where})")
            return None
        if check_link and not is_link_file(self.io, link):
            return None  # moved meanwhile: what was read may be of another state
        return got

    def list_queue(self) -> Iterator[QueuedMail]:
        """Every QUEUED entry, oldest message first.  Dangling links (uncommitted enqueues)
        and junk are skipped; entries with corrupt metadata are quarantined and skipped."""
        self._check_open()
        for e in self._names_in_order(self.layout.queue):
            self._check_open()
            with self._guard("listing the queue", None, writes=False):
                got = self._verified(e, self.layout.queue_link(e))
            if got is not None:
                yield self._issue(QueuedMail, e.entry_id, e.msgid, got[1])

    def find_inflight(self) -> Iterator[InflightMail]:
        """INFLIGHT entries of dead owners, adopted: renamed to ``<e>@<our owner>``.  The
        adoption is not synced: after a crash the entry is requeued anyway."""
        self._check_open()
        for name in self._listdir(self.layout.inflight):
            parsed = parse_inflight(name)
            if parsed is None:
                continue
            e, owner = parsed
            self._check_open()
            with self._guard("adopting an inflight entry", None):
                if owner == self.owner or self._owners.alive(owner):
                    continue
                mine = self.layout.inflight_link(e, self.owner)
                if not self._move_link(os.path.join(self.layout.inflight, name), mine):
                    continue
                got = self._verified(e, mine)
            if got is not None:
                yield self._issue(InflightMail, e.entry_id, e.msgid, got[1])

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        """QUEUED entries whose recipient is at ``domain`` (case-insensitive), oldest
        message first, read from the domain index ``domains/<h>/`` without a scan of the
        queue: each index link is only a hint, checked against ``queue/<e>`` (its link
        text) and the entry's verified envelope (its recipient's domain), so a stale or
        foreign name in the index is never listed (C13)."""
        self._check_open()
        validate_address(domain, "domain", allow_empty=True)
        d = domain.lower()
        for e in self._sorted_names(self.layout.domain_dir(d)):
            self._check_open()
            with self._guard("listing a domain", None, writes=False):
                got = self._verified(e, self.layout.queue_link(e))
            if got is not None and domain_of(got[0].rcpts[e.index].address) == d:
                yield self._issue(QueuedMail, e.entry_id, e.msgid, got[1])

    def list_held(self) -> Iterator[HeldMail]:
        """Every HELD entry (a link in held/), oldest message first; corrupt ones are
        quarantined and skipped, like ``list_queue``."""
        self._check_open()
        for e in self._names_in_order(self.layout.held):
            self._check_open()
            with self._guard("listing held entries", None, writes=False):
                got = self._verified(e, self.layout.held_link(e))
            if got is not None:
                yield self._issue(HeldMail, e.entry_id, e.msgid, got[1])

    def scan_queue(self) -> Iterator[QueuedMail | HeldMail]:
        """Every QUEUED entry (queue/), then every HELD one (held/), in the directories'
        own order, read a buffer of names at a time: the first entry comes after one
        buffer whatever the queue holds (``mailq`` at a million queued), and no name is
        kept.  A message's entries come together, the held ones with its queued ones,
        when the first of its names met is its lowest in queue/ (``_scan_message``): so
        ``mailq`` shows a message partly held once.  As Postfix's ``showq`` may miss a
        message moving between its queues, an entry whose message changes state
        meanwhile may be left out or given twice: a name passed over because a lower
        entry of its message was there is not given if that entry moves before the scan
        meets it, and a held message found with a queued entry is given with that."""
        self._check_open()
        # the held siblings of queued entries are looked for only when something is held;
        # the messages whose held entries the queue/ pass gave are skipped in held/
        # (kept: as many as messages with held entries, not as the queue holds)
        held = self._has_names(self.layout.held)
        with_held: set[str] = set()
        yield from self._scan_dir(self.layout.queue, queued=True, held=held,
                                  with_held=with_held)
        yield from self._scan_dir(self.layout.held, queued=False, held=True,
                                  with_held=with_held)

    def _has_names(self, directory: str) -> bool:
        try:
            return first_of(self.io.iter_names(directory)) is not None
        except FileNotFoundError:
            return False
        except OSError as err:
            raise storage_error(f"listing {directory}", err) from err

    def _scan_dir(self, directory: str, *, queued: bool, held: bool, with_held: set[str]
                  ) -> Iterator[QueuedMail | HeldMail]:
        names: Iterator[str] = iter(())
        given: set[str] = set()  # messages given although their lowest link failed
        what = "listing the queue" if queued else "listing held entries"
        try:
            names = self.io.iter_names(directory)
            for name in names:
                e = EntryName.parse(name)
                if e is None or e.msgid in given or (not queued and e.msgid in with_held):
                    continue
                self._check_open()
                with self._guard(what, None, writes=False):
                    found = self._scan_message(e, queued, held, given)
                if queued and any(kind is HeldMail for _, _, kind in found):
                    with_held.add(e.msgid)
                for sibling, schedule, kind in found:
                    yield self._issue(kind, sibling.entry_id, sibling.msgid, schedule)
        except FileNotFoundError:
            return  # the directory is gone (a queue being removed): nothing in it
        except OSError as err:
            raise storage_error(f"listing {directory}", err) from err
        finally:  # not left open by an error kept with its traceback
            close_iterator(names)

    def _scan_message(self, e: EntryName, queued: bool, held: bool, given: set[str]
                      ) -> list[tuple[EntryName, Schedule, type[QueuedMail | HeldMail]]]:
        """The entries of ``e``'s message linked in ``e``'s directory (queue/ if
        ``queued``, else held/), when ``e`` is the lowest of them (none otherwise: the
        lowest gives them when it is met); in queue/, with ``held``, also the message's
        held entries.  The message's envelope bounds the looks: a name that is no link,
        of no message, or past its recipients gives nothing (junk, which recovery
        quarantines), and a lower entry is looked for from the next index down, so an
        entry costs one look past the gap below it: about one per entry of a message, not
        one per pair (with ``held``, one more in held/ per recipient not in queue/).  The
        entries from ``e`` up are each verified as ``list_queue`` does: a corrupt one is
        quarantined and left out, the others still given; if ``e`` itself fails, its
        message goes in ``given`` (the scan skips its later names, which would find no
        lower link and give the others again)."""
        link_of = self.layout.queue_link if queued else self.layout.held_link
        if not is_link_file(self.io, link_of(e)):
            return []
        try:
            env = self._envelopes.peek(e.msgid) or self._load_envelope(e.msgid)
        except Corrupt:
            self._verified(e, link_of(e))  # quarantined there, as list_queue does
            return []
        if env is None or e.index >= len(env.rcpts):
            return []
        for lower in range(e.index - 1, -1, -1):
            if is_link_file(self.io, link_of(EntryName(e.msgid, lower))):
                return []
        n = len(env.rcpts)
        kind: type[QueuedMail | HeldMail] = QueuedMail if queued else HeldMail
        out: list[tuple[EntryName, Schedule, type[QueuedMail | HeldMail]]] = []
        for index in range(n):
            sibling = EntryName(e.msgid, index)
            got = None if index < e.index else self._verified(sibling, link_of(sibling))
            if got is not None:
                out.append((sibling, got[1], kind))
                continue
            if sibling == e:
                given.add(e.msgid)
            if queued and held:
                got = self._verified(sibling, self.layout.held_link(sibling))
                if got is not None:
                    out.append((sibling, got[1], HeldMail))
        return out

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        """Every link in cleanup/ (its data may be partly released already)."""
        self._check_open()
        for e in self._sorted_names(self.layout.cleanup):
            self._check_open()
            with self._guard("listing cleanups", None, writes=False):
                try:
                    got = self._load_entry(e)
                except Corrupt:
                    got = None
            sched = got[1] if got is not None else Schedule(0)
            yield self._issue(PendingCleanupMail, e.entry_id, e.msgid, sched)

    def inflight_entries(self) -> Iterator[EntryMeta]:
        """Every link in inflight/, whichever process holds it, as its metadata (read
        only: an entry that moves or fails its checks meanwhile is left out, and damage
        stays for recovery to quarantine)."""
        self._check_open()
        for name in sorted(listdir_or_empty(self.io, self.layout.inflight)):
            parsed = parse_inflight(name)
            if parsed is None:
                continue
            e = parsed[0]
            try:
                with self._rw.shared():
                    got = self._load_entry(e)
            except (OSError, Corrupt):
                continue
            if got is None or e.index >= len(got[0].rcpts):
                continue
            env, sched = got
            r = env.rcpts[e.index]
            yield EntryMeta(e.msgid, e.entry_id, env.mail_from, r.address, e.index, r.zone,
                            dict(env.params), sched, env.body_size, int(e.msgid[:16], 16))

    # ---- enqueue ---------------------------------------------------------------------

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        """Start a message.  Nothing is created until the first write or the commit."""
        self._check_open()
        validate_address(mail_from, "mail_from", allow_empty=True)
        checked = validate_params(params)
        try:
            msgid = self.ids.next()
        except ValueError as e:  # the clock given at opening misbehaves
            raise InvalidInputError(str(e)) from e
        tx = MessageTx(msgid, self.layout.tmp_msg(self.owner, msgid), mail_from, checked)
        return FsEnqueuer(self, tx)

    def _enqueue_write(self, tx: MessageTx, data: bytes) -> None:
        try:
            self._write_body(tx, data)
        except OSError as e:
            self._enqueue_discard(tx)
            raise storage_error("writing the body", e) from e

    def _check_recipient_count(self, n: int) -> None:
        """A message of 2+ recipients gives its file two names per recipient (the entry's
        link and its reference) and one more: refuse, before anything changes, a count
        the file system cannot link."""
        if n > 1 and n > self._max_recipients:
            raise InvalidInputError(
                f"{n} recipients: a message may have at most {self._max_recipients} on "
                "this file system (two names per recipient, within its limit of names "
                "per file); split the recipient list")

    @property
    def _max_recipients(self) -> int:
        return max(1, (self._link_max - 1) // 2)

    def _enqueue_commit(self, tx: MessageTx, rcpts: list[Recipient]) -> list[QueuedMail]:
        try:
            with self._guard("commit", None):
                try:
                    env = Envelope(tx.msgid, tx.mail_from, tx.params, tx.size,
                                   tx.digest.value(), tuple(rcpts))
                    self._commit_message(tx, env)
                    self._envelopes.put(tx.msgid, None, env, tx.written)
                except OSError:
                    if not tx.committed:
                        self._enqueue_discard(tx)
                    raise
        except StorageIOError:
            if not tx.committed:
                self._enqueue_discard(tx)
            raise
        return [self._issue(QueuedMail, f"{tx.msgid}.{i}", tx.msgid, r.schedule)
                for i, r in enumerate(rcpts)]

    def _enqueue_discard(self, tx: MessageTx) -> None:
        with suppress(OSError):  # this owner's leftovers: recovery removes them once it is dead
            self._discard_message(tx)

    # ---- reading ---------------------------------------------------------------------

    def read_inflight(self, mail: InflightMail) -> MailReader:
        """Open an inflight entry of ours; see ``Storage.read_inflight``.  ClosedError if the
        entry is no longer ours (another process quarantined it).

        The message file is opened when the body is first read: the relay opens each of
        a message's entries for its recipient and reads one body, and a hundred
        recipients need not cost a hundred opens.  An entry claimed here without a
        schedule record (``_Held``) has none while we hold it (nobody else writes one),
        so none is looked for."""
        h = self._peek(mail, InflightMail)
        e = self._entry(h)
        link = self.layout.inflight_link(e, self.owner)
        held = h._extra
        fresh = isinstance(held, _Held) and not held.record
        try:
            with self._rw.shared():
                if not is_link_file(self.io, link):
                    raise self._gone(e)
                try:
                    env = self._live_envelope(e.msgid)  # we hold the entry
                    if env is None:
                        raise Corrupt("message file is missing", True)
                    sched = h.schedule if fresh else self._entry_schedule(e, env)[0]
                except Corrupt as c:
                    raise self._corruption(e, link, c) from None
        except OSError as err:
            raise storage_error("opening the mail", err, h) from err
        path = self.layout.msg_file(e.msgid)

        def open_body() -> int:
            """The message file, when the body is first read.  Gone with our link: the
            entry was taken from us meanwhile (quarantined: its note says why); gone
            under our link: damage (FileNotFoundError: the reader quarantines it)."""
            with self._rw.shared():
                try:
                    return self.io.open_read(path)
                except FileNotFoundError:
                    if not is_link_file(self.io, link):
                        raise self._gone(e) from None
                    raise

        r = env.rcpts[e.index]
        meta = EntryMeta(e.msgid, e.entry_id, env.mail_from, r.address, e.index, r.zone,
                         dict(env.params), sched, env.body_size)
        with self._reading_lock:  # its file is not made a spare while a reader has it open
            self._reading[e.msgid] += 1
        return FsMailReader(self.io, open_body, meta, env.body_digest, h,
                            lambda why: self._body_corrupt(e, link, why),
                            lambda: self._reader_closed(e.msgid))

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        """Open a QUEUED or HELD entry's metadata and body without claiming it; None if
        its link is no longer where the handle says (claimed, held, dropped meanwhile).
        The message file stays readable while it is open even if the entry is delivered
        and cleaned up meanwhile, by this process or another: it is never made a spare
        while a reader of this queue has it, and never reused while a reader of any
        process holds its shared lock (``_hold_for_reading``)."""
        h: HeldMail | QueuedMail = (self._peek(mail, HeldMail) if isinstance(mail, HeldMail)
                                    else self._peek(mail, QueuedMail))
        e = self._entry(h)
        link = (self.layout.held_link(e) if isinstance(h, HeldMail)
                else self._queued_link(h, e))
        try:
            with self._rw.shared():
                with self._reading_lock:
                    self._reading[e.msgid] += 1
                try:
                    got = self._verified(e, link)
                    if got is None:
                        self._reader_closed(e.msgid)
                        return None
                    env, sched = got
                    path = self.layout.msg_file(e.msgid)
                    try:
                        fd = self.io.open_read(path)
                    except FileNotFoundError:  # cleaned up since the link was read
                        self._reader_closed(e.msgid)
                        return None
                    if not self._hold_for_reading(fd, path):
                        self._reader_closed(e.msgid)
                        return None
                except BaseException:
                    self._reader_closed(e.msgid)
                    raise
        except OSError as err:
            raise storage_error("inspecting an entry", err) from err
        r = env.rcpts[e.index]
        meta = EntryMeta(e.msgid, e.entry_id, env.mail_from, r.address, e.index, r.zone,
                         dict(env.params), sched, env.body_size, int(e.msgid[:16], 16))
        return FsMailReader(self.io, fd, meta, env.body_digest, None,
                            lambda why: self._body_corrupt(e, link, why),
                            lambda: self._reader_closed(e.msgid))

    def _hold_for_reading(self, fd: int, path: str) -> bool:
        """Take a shared lock on the message file open as ``fd`` and check that ``path``
        still names it; else close ``fd``: False.  Another process may have delivered the
        message meanwhile and kept its file as a spare (``spares.py``); it writes a new
        message into a spare only under an exclusive lock, which it does not get while
        this one is held, and it waits for none: it takes a new file instead.  A file
        whose exclusive lock is held is a spare being written into: no longer the
        message's file (False at once)."""
        try:
            # without waiting: only a writer of a spare holds it exclusively, and a spare
            # is no message's file any more (waiting would wait on a slow client's body)
            if self.io.lock_file(fd, shared=True) and self.io.same_file(fd, path):
                return True
        except BaseException:
            self.io.close(fd)
            raise
        self.io.close(fd)
        return False

    def _reader_closed(self, msgid: str) -> None:
        with self._reading_lock:
            self._reading[msgid] -= 1
            if not self._reading[msgid]:
                del self._reading[msgid]

    def _file_is_small(self, msgid: str) -> bool:
        """Up to ``SPARE_MAX_BODY`` bytes (unlinking 64 KiB took 80 us here, a MiB 0.35 ms:
        only the large ones are worth a GIL hand-over, ``IO.unlink_large``)."""
        size = self._envelopes.file_size(msgid)
        return size is not None and size <= SPARE_MAX_BODY

    def _spare_for(self, msgid: str) -> tuple[str, int] | None:
        """Keep the file of a message being released as a spare (see ``spares.py``) if it
        had one recipient, a body of at most ``SPARE_MAX_BODY`` bytes and no reader of
        ours has it open, and the pool has room: the name to rename it to and the file's
        size, else None."""
        env = self._envelopes.peek(msgid)
        size = self._envelopes.file_size(msgid)
        if (env is None or size is None or len(env.rcpts) != 1
                or env.body_size > SPARE_MAX_BODY):
            return None
        with self._reading_lock:
            if msgid in self._reading:
                return None
        name = self._spares.reserve()
        return None if name is None else (name, size)

    def _gone(self, e: EntryName) -> CorruptionError | ClosedError:
        """The error for an inflight entry of ours whose link is gone: CorruptionError if
        it was quarantined (by another process, or by another handle's reader)."""
        for name in (e.msgid, e.entry_id):
            note = self.layout.quarantined(f"{name}.note")
            if self.io.exists(note):
                return CorruptionError(f"entry {e.entry_id} was quarantined", e.entry_id,
                                       note[:-len(".note")])
        return ClosedError(f"entry {e.entry_id} is no longer inflight here")

    def _body_corrupt(self, e: EntryName, link: str, why: str) -> CorruptionError:
        with self._rw.shared():
            return self._corruption(e, link, Corrupt(why, True))

    def _corruption(self, e: EntryName, link: str, c: Corrupt) -> CorruptionError:
        """Quarantine and build the error to raise (quarantine failures are reported in it)."""
        try:
            where: str | None = self._quarantine_corrupt(e, link, c)
        except OSError:
            where = None
        return CorruptionError(f"entry {e.entry_id}: {c.reason}", e.entry_id, where)

    # ---- state changes ---------------------------------------------------------------

    def _queued_link(self, h: QueuedMail, e: EntryName) -> str:
        if h._extra == _CLAIMED:
            return self.layout.inflight_link(e, self.owner)
        return self.layout.queue_link(e)

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        with self._guard("send_start", h):
            if h._extra == _CLAIMED:
                if not self.io.exists(self.layout.inflight_link(e, self.owner)):
                    return None
            elif not self._claim(e):
                return None
            # The stored schedule, not the handle's: another handle may have rescheduled it.
            got = self._claimed(e, check_link=h._extra == _CLAIMED)
        if got is None:  # cleaned up meanwhile, or its metadata was corrupt (quarantined)
            return None
        return self._issue(InflightMail, h.entry_id, h.message_id, got[0], got[1])

    def _claimed(self, e: EntryName, *, check_link: bool) -> tuple[Schedule, _Held] | None:
        """Schedule of an entry we have just claimed, and what we know of it.  The message
        is live (its link was in queue/), so an envelope this queue cached serves as it
        is.  None if the link is gone (``check_link``) or the metadata is corrupt (then
        quarantined)."""
        link = self.layout.inflight_link(e, self.owner)
        if check_link and not is_link_file(self.io, link):
            return None
        try:
            env = self._live_envelope(e.msgid)
            if env is None:
                return None
            sched, record = self._entry_schedule(e, env)
        except Corrupt as c:
            if is_link_file(self.io, link):
                where = self._quarantine_corrupt(e, link, c)
                self._note_set_aside(e.entry_id, e.msgid, f"{c.reason} (quarantined to "
                                                          f"{where})")
            return None
        return sched, _Held(len(env.rcpts) == 1, record)

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        _check_schedule(schedule)
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        mine = self.layout.inflight_link(e, self.owner)
        with self._guard("reschedule", h):
            if h._extra == _CLAIMED:
                if not self.io.exists(mine):
                    return None
            elif not self._claim(e):
                return None
            try:
                self._write_schedule(e, schedule)
                moved = self._move_link(mine, self.layout.queue_link(e))
            except OSError:
                self._put_back(h, e)
                raise
            h._extra = None
            if not moved:
                return None  # quarantined by another process meanwhile
            self._sync_move(self.layout.inflight, self.layout.queue)
        return self._issue(QueuedMail, h.entry_id, h.message_id, schedule)

    def _put_back(self, h: QueuedMail, e: EntryName) -> None:
        """After a failed reschedule: return the claimed entry to queue/ (not synced: after
        a crash it is requeued anyway).  If even that fails, the handle remembers it."""
        mine = self.layout.inflight_link(e, self.owner)
        try:
            if not self.io.exists(mine) or self._move_link(mine, self.layout.queue_link(e)):
                h._extra = None
                return
        except OSError:
            pass
        h._extra = _CLAIMED

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        e = self._entry(h)
        with self._guard("send_done", h):
            if not self._move_link(self.layout.inflight_link(e, self.owner),
                                   self.layout.cleanup_link(e)):
                return None
            self._sync_move(self.layout.inflight, self.layout.cleanup)
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, h.schedule, h._extra)

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        _check_schedule(schedule)
        h = self._take(mail, InflightMail)
        e = self._entry(h)
        mine = self.layout.inflight_link(e, self.owner)
        with self._guard("send_cancel", h):
            if not is_link_file(self.io, mine):
                return None
            self._write_schedule(e, schedule)
            if not self._move_link(mine, self.layout.queue_link(e)):
                return None
            self._sync_move(self.layout.inflight, self.layout.queue)
        return self._issue(QueuedMail, h.entry_id, h.message_id, schedule)

    def send_finish(self, done: Sequence[InflightMail] = (),
                    cancel: Sequence[tuple[InflightMail, Schedule]] = ()) -> Finished:
        """Every move in three shared sync rounds at most, whatever the batch holds (C15):
        the cancelled entries' schedule records written, one round (``syncfs``; each
        fsynced in ``fsync`` mode); renamed into place, ``data/`` synced; then every link
        renamed (to ``cleanup/`` or back to ``queue/``) and the directories synced once.
        The order of each entry's steps is its single call's, so a crash leaves each
        entry as its own call would."""
        dones, cancels = self._take_batch(done, cancel)
        lay = self.layout
        moved_back: list[bool] = []
        moved_done: list[bool] = []
        synced = False

        def sync_moved() -> None:
            nonlocal synced
            if any(moved_done) or any(moved_back):
                self._sync_finished(*([lay.cleanup] if any(moved_done) else []),
                                    *([lay.queue] if any(moved_back) else []), lay.inflight)
                synced = True

        try:
            if self._poisoned is not None:
                raise ReopenRequiredError(self._poisoned)
            with self._guard("send_finish", None):
                try:
                    for e in self._cancel_records(cancels):
                        moved_back.append(e is not None and self._move_link(
                            lay.inflight_link(e, self.owner), lay.queue_link(e)))
                    for h in dones:
                        e = self._entry(h)
                        moved_done.append(self._move_link(lay.inflight_link(e, self.owner),
                                                          lay.cleanup_link(e)))
                except Exception:
                    # the links moved before the failure are made durable all the same: a
                    # retry through the handle given back would answer None and sync
                    # nothing (C3); a failed sync poisons the queue (ReopenRequiredError)
                    sync_moved()
                    raise
                sync_moved()
        except StorageIOError as e:
            err = self._batch_failed(e, dones, cancels)
            if synced:
                err.finished = self._finished(dones, cancels, moved_done, moved_back)
            raise err from None
        return self._finished(dones, cancels, moved_done, moved_back)

    def _finished(self, dones: Sequence[InflightMail],
                  cancels: Sequence[tuple[InflightMail, Schedule]],
                  moved_done: list[bool], moved_back: list[bool]) -> Finished:
        """The new handles of the entries whose links moved (None for the others)."""
        moved_done = moved_done + [False] * (len(dones) - len(moved_done))
        moved_back = moved_back + [False] * (len(cancels) - len(moved_back))
        return Finished(
            [self._issue(PendingCleanupMail, h.entry_id, h.message_id, h.schedule, h._extra)
             if ok else None for h, ok in zip(dones, moved_done, strict=True)],
            [self._issue(QueuedMail, h.entry_id, h.message_id, s) if ok else None
             for (h, s), ok in zip(cancels, moved_back, strict=True)])

    def _sync_finished(self, *dirs: str) -> None:
        """The one round after a batch's links moved: every move durable (C1, C3)."""
        self._sync_dirs(*dirs)

    def _cancel_records(self, cancels: Sequence[tuple[InflightMail, Schedule]]
                        ) -> list[EntryName | None]:
        """The new schedule record of every cancelled entry still claimed here, durable
        and in place (temps, a round, renames, ``data/`` synced): each entry's name, None
        for one no longer ours."""
        out: list[EntryName | None] = []
        temps = []
        for h, schedule in cancels:
            e = self._entry(h)
            if not is_link_file(self.io, self.layout.inflight_link(e, self.owner)):
                out.append(None)
                continue
            out.append(e)
            temps.append((e, self._write_schedule_temp(e, schedule, round_after=True)))
        if temps:
            if self._group.covers_files:
                self._sync_dirs()
            for e, tmp in temps:
                self._install_schedule(e, tmp)
            self._sync_dirs(self.layout.data)
        return out

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        with self._guard("drop", h):
            src = self._queued_link(h, e)
            if not self._move_link(src, self.layout.cleanup_link(e)):
                return None
            h._extra = None
            self._sync_move(os.path.dirname(src), self.layout.cleanup)
            try:
                got = self._load_entry(e)
            except Corrupt:
                got = None
        sched = got[1] if got is not None else h.schedule
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, sched)

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        """Rename ``queue/<e>`` to ``held/<e>`` and sync both directories: no claim can
        take the entry from held/, and its schedule record is not touched (C14)."""
        h = self._take(mail, QueuedMail)
        e = self._entry(h)
        dst = self.layout.held_link(e)
        with self._guard("hold", h):
            src = self._queued_link(h, e)
            if not self._move_link(src, dst):
                return None
            h._extra = None
            self._sync_move(os.path.dirname(src), self.layout.held)
            got = self._verified(e, dst, check_link=False)
        if got is None:  # its metadata was corrupt: quarantined
            return None
        return self._issue(HeldMail, h.entry_id, h.message_id, got[1])

    def release(self, mail: HeldMail) -> QueuedMail | None:
        """Rename ``held/<e>`` back to ``queue/<e>`` (synced), with the schedule it had."""
        h = self._take(mail, HeldMail)
        e = self._entry(h)
        dst = self.layout.queue_link(e)
        with self._guard("release", h):
            if not self._move_link(self.layout.held_link(e), dst):
                return None
            self._sync_move(self.layout.held, self.layout.queue)
            got = self._verified(e, dst, check_link=False)
        if got is None:
            return None
        return self._issue(QueuedMail, h.entry_id, h.message_id, got[1])

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        """Rename ``held/<e>`` to ``cleanup/<e>`` (synced): never sent (C3)."""
        h = self._take(mail, HeldMail)
        e = self._entry(h)
        with self._guard("drop_held", h):
            if not self._move_link(self.layout.held_link(e), self.layout.cleanup_link(e)):
                return None
            self._sync_move(self.layout.held, self.layout.cleanup)
            try:
                got = self._load_entry(e)
            except Corrupt:
                got = None
        sched = got[1] if got is not None else h.schedule
        return self._issue(PendingCleanupMail, h.entry_id, h.message_id, sched)

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        h = self._take(mail, PendingCleanupMail)
        with self._guard("cleanup", h):
            return self._release_entry(h)

    def _release_entry(self, h: PendingCleanupMail, *, shared: bool = False) -> bool:
        """``_cleanup_entry`` of a taken handle's entry, with what its claim learnt.  No
        check of the link first: releasing an entry is idempotent, so a cleanup that
        someone else (a recovery) finished already changes nothing and is told so by the
        missing link."""
        held = h._extra if isinstance(h._extra, _Held) else None
        if held is None:
            return self._cleanup_entry(self._entry(h), shared=shared)
        return self._cleanup_entry(self._entry(h), single=held.single, record=held.record,
                                   shared=shared)

    def cleanup_all(self, mails: Sequence[PendingCleanupMail]) -> list[bool]:
        """See ``Storage.cleanup_all``: a message's entries released together.  Every
        entry of a message in the batch but its last gives up its names without a look
        at the message file's link count: the last still holds its own names, so none of
        the others can be the file's last holder.  The last is released as ``cleanup``
        releases an entry (C8), looking at the count once the others' names are gone.
        On any error the handles of the entries not released are given back (with a
        StorageIOError, in its ``handles``)."""
        handles = self._take_all(mails, PendingCleanupMail, "cleanup_all")
        released = [False] * len(handles)
        by_message: dict[str, list[int]] = {}
        for k, h in enumerate(handles):
            by_message.setdefault(h.message_id, []).append(k)
        finished: set[int] = set()
        try:
            with self._guard("cleanup", None):
                for ks in by_message.values():
                    for k in ks:
                        released[k] = self._release_entry(handles[k], shared=k != ks[-1])
                        finished.add(k)
        except Exception as err:
            back = tuple(self._give_back(h) for k, h in enumerate(handles)
                         if k not in finished)
            if isinstance(err, StorageIOError):
                err.handle = None
                err.handles = back
            raise
        return released

    # ---- lifecycle -------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """See ``recovery.Recovery``.  Waits for this queue's running operations."""
        self._check_open()
        try:
            with self._rw.exclusive(), self._owners.gate():
                report = self.recovery(self).run()
        except OSError as e:
            raise storage_error("recovery", e) from e
        self.last_recovery = report
        return report

    def footprint(self) -> Footprint:
        """Names and bytes under data/ and tmp/ (the owners' own tmp directories and the
        spare files in them not counted): (0, 0) once every message is cleaned up and no
        enqueue is open."""
        self._check_open()
        try:
            objects, size = tree_usage(self.io, self.layout.data)
            for name in listdir_or_empty(self.io, self.layout.tmp):
                path = os.path.join(self.layout.tmp, name)
                if self.io.is_dir(path):
                    o, s = tree_usage(self.io, path, skip=SPARE_RE)
                    objects, size = objects + o, size + s
                else:
                    objects += 1
        except OSError as e:
            raise storage_error("footprint", e) from e
        return Footprint(objects, size)

    @property
    def spare_files(self) -> int:
        """Spent message files this queue keeps for reuse now (at most ``spares``)."""
        return len(self._spares)

    @property
    def poisoned(self) -> str | None:
        """Why state changes are refused until reopening (after a failed fsync), or None."""
        return self._poisoned

    def dead_owners(self) -> list[str]:
        """Owners that left a lock file or a ``tmp/<owner>/`` directory and are not
        alive: queues that were not closed (their process died, or a power cut took
        them) and that no exclusive recovery has finished since.  None when every owner
        closed: then what a recovery beside this open queue (not exclusive) skips, the
        orphan sweep and the mending of the domain index and of hard links, has nothing
        of a crash's to do (only damage at rest)."""
        self._check_open()
        try:
            with self._owners.gate():
                seen = set(self._owners.on_disk())
                seen.update(o for o in listdir_or_empty(self.io, self.layout.tmp)
                            if is_owner_token(o))
                return sorted(o for o in seen if not self._owners.alive(o))
        except OSError as e:
            raise storage_error("listing the owners", e) from e


class _Guard:
    """The body of ``FsQueue._guard``: holds the queue's lock shared, and turns an OSError
    into a StorageIOError that hands the (re-armed) handle back."""

    __slots__ = ("handle", "q", "what")

    def __init__(self, q: FsQueue, what: str, handle: Handle | None) -> None:
        self.q = q
        self.what = what
        self.handle = handle

    def __enter__(self) -> None:
        self.q._rw.shared().__enter__()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.q._rw.shared().__exit__(et, ev, tb)
        if isinstance(ev, OSError):
            h = self.handle
            raise storage_error(self.what, ev, self.q._give_back(h) if h else None,
                                reopen=self.q._poisoned is not None) from ev


def _check_schedule(schedule: object) -> None:
    validate_schedule(schedule)


__all__ = ["FsQueue"]
