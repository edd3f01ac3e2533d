"""MultiRootQueue: one queue over several roots, each a queue of its own (seed 002).

"The MTA is going to be limited by the rate that it can fsync the main queue. You can raise
this limit if you have two parallel queues on different disks, and spread the load of
incoming messages between them."  Each root is a Storage of its own (the filesystem queue
for ``MultiRootQueue.open_fs``), on its own file system, with its own sync rounds; this
class is the one Storage over all of them.

* **Ids name their root.**  A root's ids are prefixed ``r<k>-``, ``k`` the root's index
  (roots are ordered by their absolute path, so the order they are given in does not
  matter): ``r1-<msgid>.<i>``.  ``r`` and ``-`` are in no id of the filesystem queue
  (hex digits and dots), so a prefixed id collides with none of them.  Every call that
  takes a handle goes straight to the root its id names.
* **New mail goes to the least busy healthy root**: the one with the fewest enqueues in
  progress (from ``enqueue`` to its commit or abort), ties broken round robin.  A root
  whose last enqueue, commit or state change failed with StorageIOError (EIO, a full
  disk) takes no new mail for ``retry_after`` seconds; one that raised
  ReopenRequiredError takes none until it is reopened (``reopen_failed()``, which
  ``recover()`` runs).  When no root is healthy, ``enqueue`` raises the error of the
  root that failed last, of its type.  A commit that fails is not moved to another root
  (its body is on the failed one): it fails, as on one root, and the next message goes
  elsewhere.
* **Listings see every root**: ``list_queue``, ``list_domain``, ``list_held`` and
  ``inflight_entries`` merge the roots' listings oldest message first (by the roots' own
  ids); ``find_inflight``, ``find_pending_cleanup`` and ``scan_queue`` chain them.  ``footprint`` and the
  recovery reports are sums; lost ids and damaged files are named with their root.
* **Capabilities** are those every root declares; limits the tightest of every root's
  (spare files: the sum).
* **Opening** opens every root (each runs its own recovery) or fails with the error of
  the first that cannot be opened, closing the others: a queue is never served with
  part of its mail missing from its listings.

Every clause of spec/CONTRACT.md holds per root, hence for the whole: an entry lives in
one root for its whole life, and each operation on it is that root's operation.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

from queue_ref.io import IO
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
    SetAside,
    Storage,
    StorageIOError,
    validate_schedule,
)

__all__ = ["MultiRootQueue", "root_prefix", "share_a_file_system", "split_id"]

H = TypeVar("H", bound=Handle)
Opener = Callable[[], Storage]

#: Seconds a root whose disk failed takes no new mail (``MultiRootQueue(retry_after=)``).
DEFAULT_RETRY_AFTER = 30.0


def root_prefix(index: int) -> str:
    """The prefix of every id of root ``index``: ``r<index>-``."""
    return f"r{index}-"


def split_id(composite_id: str, roots: int) -> tuple[int, str] | None:
    """(root index, the root's own id) of an id ``r<k>-<id>``; None if it names no root
    of ``roots``."""
    head, sep, rest = composite_id.partition("-")
    if (not sep or not rest or len(head) < 2 or head[0] != "r" or not head[1:].isdigit()
            or (len(head) > 2 and head[1] == "0")):
        return None
    k = int(head[1:])
    return (k, rest) if k < roots else None


@dataclass(frozen=True)
class _Inner:
    """A composite handle's ``_extra``: the root's own handle, and the opening of the root
    that issued it (handles of a root reopened since are void)."""

    root: int
    generation: int
    handle: Handle


class _Root:
    """One root: its opener, the Storage open on it, and its health."""

    def __init__(self, index: int, name: str, opener: Opener) -> None:
        self.index = index
        self.name = name
        self.opener = opener
        self.store: Storage | None = None
        self.generation = 0
        self.enqueuing = 0  # enqueues in progress (the load new mail is spread by)
        self.failed_at: float | None = None  # monotonic time of the last disk failure
        self.last_error: StorageIOError | None = None  # that failure
        self.failures = 0  # the queue's failure count at that failure (which failed last)
        self.needs_reopen: str | None = None  # why, after a ReopenRequiredError


class MultiRootQueue(Storage):
    """One queue over several roots (see the module docstring)."""

    def __init__(self, roots: Mapping[str, Opener], *, retry_after: float = DEFAULT_RETRY_AFTER,
                 clock: Callable[[], float] = time.monotonic, part: int | None = None) -> None:
        """Open every root: ``roots`` maps each root's name (its directory, as errors and
        damaged files name it) to a callable that opens it.  Roots are ordered by name.

        ``part``: open and serve root ``part`` alone (0-based, in that order), under the
        ids it has in the whole queue (``r<part>-``): one process of a relay whose
        backend cannot be shared serves one root, and names its mail as the commands that
        open every root do (``relay_master``).  A handle of another root is refused.

        Raises InvalidInputError for fewer than one root, a bad ``retry_after`` or
        ``part``, before opening anything; the error of the first root that fails to open
        (the others are closed again)."""
        Storage.__init__(self)
        if not isinstance(roots, Mapping) or not roots:
            raise InvalidInputError("a multi-root queue needs at least one root")
        if (not isinstance(retry_after, (int, float)) or isinstance(retry_after, bool)
                or not retry_after >= 0):
            raise InvalidInputError(f"retry_after must be seconds >= 0, got {retry_after!r}")
        for name, opener in roots.items():
            if not isinstance(name, str) or not name or not callable(opener):
                raise InvalidInputError(f"root {name!r}: expected a name and a callable "
                                        "that opens it")
        if part is not None and (not isinstance(part, int) or isinstance(part, bool)
                                 or not 0 <= part < len(roots)):
            raise InvalidInputError(f"part must be the index of one of the {len(roots)} "
                                    f"roots, got {part!r}")
        self._count = len(roots)  # the roots of the whole queue (ids name one of them)
        self._roots = [_Root(i, n, roots[n]) for i, n in enumerate(sorted(roots))
                       if part is None or i == part]
        self._by_index = {r.index: r for r in self._roots}
        self.retry_after = float(retry_after)
        self._clock = clock
        self._lock = threading.Lock()
        self._turn = 0
        self._failures = 0
        try:
            for r in self._roots:
                r.store = r.opener()
                if not isinstance(r.store, Storage):
                    raise InvalidInputError(f"root {r.name}: the opener returned a "
                                            f"{type(r.store).__name__}, not a Storage")
        except BaseException:
            self._closed = True
            self._close_roots()
            raise
        self.capabilities = frozenset.intersection(
            *(frozenset(self._store(r).capabilities) for r in self._roots))
        self.last_recovery = self._merged_reports(
            [self._store(r).last_recovery for r in self._roots])

    @classmethod
    def open_fs(cls, roots: Sequence[str], io: IO | None = None, *, sync: str | None = None,
                retry_after: float = DEFAULT_RETRY_AFTER,
                part: int | None = None) -> MultiRootQueue:
        """The filesystem queue (``FsQueue(root, io, sync=sync)``) on each directory of
        ``roots``.  Raises InvalidInputError for no roots or a directory given twice.

        ``sync=None`` is FsQueue's default (``syncfs``) when every root is on a file system
        of its own, and ``"fsync"`` when two share one (``share_a_file_system``): a failed
        ``syncfs`` of one root may have dropped the other's data too, which that root
        would not know of, and their ``syncfs`` calls would flush each other's changes."""
        from queue_ref.fsqueue import FsQueue

        if sync is None and isinstance(roots, Sequence) and not isinstance(roots, str) \
                and share_a_file_system([r for r in roots if isinstance(r, str) and r]):
            sync = "fsync"
        return cls.over(roots, lambda path: FsQueue(path, io, sync=sync),
                        retry_after=retry_after, part=part)

    @classmethod
    def over(cls, roots: Sequence[str], open_root: Callable[[str], Storage], *,
             retry_after: float = DEFAULT_RETRY_AFTER,
             part: int | None = None) -> MultiRootQueue:
        """``open_root(directory)`` on each directory of ``roots`` (made absolute), or on
        the one ``part`` names (see ``__init__``).  Raises
        InvalidInputError for no roots, a path that is empty or holds NUL, or a directory
        given twice."""
        if isinstance(roots, (str, bytes)) or not isinstance(roots, Sequence) or not roots:
            raise InvalidInputError("roots must be a non-empty list of directories")
        openers: dict[str, Opener] = {}
        for root in roots:
            if not isinstance(root, str) or not root or "\x00" in root:
                raise InvalidInputError(f"a root must be a non-empty path, got {root!r}")
            path = os.path.abspath(root)
            if path in openers or os.path.realpath(path) in map(os.path.realpath, openers):
                raise InvalidInputError(f"the root {path} is given twice")
            openers[path] = partial(open_root, path)
        return cls(openers, retry_after=retry_after, part=part)

    # ---- roots -------------------------------------------------------------------------

    @property
    def root_names(self) -> list[str]:
        """Each root's name (directory), in index order (``r<index>-`` ids)."""
        return [r.name for r in self._roots]

    def own_meta(self, name: str, meta: EntryMeta) -> EntryMeta | None:
        """``meta`` of this queue (``r<k>-`` ids) as the root ``name`` lists it itself (its
        own ids); None when it is another root's entry."""
        got = split_id(meta.entry_id, self._count)
        index = next((r.index for r in self._roots if r.name == name), None)
        if got is None or index is None or got[0] != index:
            return None
        p = root_prefix(index)
        return replace(meta, message_id=meta.message_id.removeprefix(p), entry_id=got[1])

    def set_aside(self) -> list[SetAside]:
        """Every root's (``Storage.set_aside``), under this queue's ids."""
        out = super().set_aside()
        for r in self._roots:
            if r.store is not None:
                p = root_prefix(r.index)
                out += [SetAside(p + x.entry_id, p + x.message_id, x.reason)
                        for x in r.store.set_aside()]
        return out

    def root_stores(self) -> list[Storage]:
        """The Storage open on each root now, in index order (for tools and tests)."""
        self._check_open()
        return [self._store(r) for r in self._roots]

    def healthy(self) -> list[bool]:
        """Per root: whether it takes new mail now."""
        with self._lock:
            return [self._healthy(r) for r in self._roots]

    def _store(self, r: _Root) -> Storage:
        if r.store is None:
            raise ClosedError(f"root {r.name} is not open")
        return r.store

    def _healthy(self, r: _Root) -> bool:
        if r.needs_reopen is not None or getattr(r.store, "poisoned", None) is not None:
            return False
        return r.failed_at is None or self._clock() - r.failed_at >= self.retry_after

    def _failed(self, r: _Root, e: StorageIOError) -> None:
        with self._lock:
            r.failed_at = self._clock()
            r.last_error = e
            self._failures += 1
            r.failures = self._failures
            if isinstance(e, ReopenRequiredError):
                r.needs_reopen = str(e)

    def _choose(self) -> list[_Root]:
        """The healthy roots in the order a new message tries them: least busy first, ties
        round robin from the root after the last one chosen.  None healthy: the error of
        the root that failed last, of its type (NoSpaceError, ReopenRequiredError...)."""
        with self._lock:
            n = len(self._roots)
            start = self._turn
            order = sorted((r for r in self._roots if self._healthy(r)),
                           key=lambda r: (r.enqueuing, (r.index - start) % n))
            if not order:
                last = max(self._roots, key=lambda r: r.failures)
                e = last.last_error
                raise (type(e) if e is not None else StorageIOError)(
                    f"no root of this queue takes new mail; the last to fail, {last.name}: "
                    f"{e if e is not None else 'it must be reopened'}")
            self._turn = (order[0].index + 1) % n
            return order

    def reopen_failed(self) -> list[str]:
        """Close and open again every root that raised ReopenRequiredError (its recovery
        decides from the disk what survived): the names of the roots reopened.  Handles
        of such a root issued before are void (ClosedError).  A root that fails to open
        stays failed (its error is raised after the others were tried)."""
        self._check_open()
        done: list[str] = []
        last: BaseException | None = None
        for r in self._roots:
            if r.needs_reopen is None and getattr(r.store, "poisoned", None) is None:
                continue
            old, r.store = r.store, None
            if old is not None:
                old.close()
            try:
                r.store = r.opener()
            except StorageIOError as e:
                last = e
                continue
            with self._lock:
                r.generation += 1
                r.needs_reopen = None
                r.failed_at = r.last_error = None
            done.append(r.name)
        if last is not None:
            raise last
        return done

    # ---- handles -----------------------------------------------------------------------

    def _wrap(self, r: _Root, inner: H) -> H:
        p = root_prefix(r.index)
        return self._issue(type(inner), p + inner.entry_id, p + inner.message_id,
                           inner.schedule, _Inner(r.index, r.generation, inner))

    def _route(self, h: Handle) -> tuple[_Root, Handle]:
        """The root of a handle just taken, and its own handle there."""
        inner = h._extra
        parsed = split_id(h.entry_id, self._count)
        if not isinstance(inner, _Inner) or parsed is None or parsed[0] != inner.root:
            raise InvalidInputError(f"entry id {h.entry_id!r} names no root of this queue")
        r = self._by_index.get(inner.root)
        if r is None:
            raise InvalidInputError(f"entry id {h.entry_id!r} names root {inner.root}, "
                                    "which this queue does not serve (part)")
        if inner.generation != r.generation or r.store is None:
            raise ClosedError(f"root {r.name} was reopened since entry {h.entry_id} was "
                              "listed: list it again")
        return r, inner.handle

    def _call(self, h: H, call: Callable[[Storage, Handle], Handle | None]) -> Handle | None:
        """Run a state change on the handle's root; a StorageIOError marks the root failed
        and hands back this queue's handle, re-armed, carrying the root's."""
        r, inner = self._route(h)
        try:
            got = call(self._store(r), inner)
        except StorageIOError as e:
            self._failed(r, e)
            if e.handle is not None:
                h._extra = _Inner(r.index, r.generation, e.handle)
                e.handle = self._give_back(h)
            raise
        except CorruptionError as e:
            raise self._corruption(r, e) from e
        except Exception:
            if inner._live:  # refused before the root took its handle: ours stays live too
                self._give_back(h)
            raise
        return None if got is None else self._wrap(r, got)

    def _corruption(self, r: _Root, e: CorruptionError) -> CorruptionError:
        return CorruptionError(str(e), root_prefix(r.index) + e.entry_id, e.quarantined_to)

    # ---- listing -----------------------------------------------------------------------

    def _merged(self, listing: Callable[[Storage], Iterable[H]]) -> Iterator[H]:
        """Every root's listing, merged oldest message first (each root's own order)."""
        self._check_open()
        roots = list(self._roots)

        def one(r: _Root) -> Iterator[tuple[str, H]]:
            for inner in listing(self._store(r)):
                yield inner.message_id, self._wrap(r, inner)

        for _, h in heapq.merge(*(one(r) for r in roots), key=lambda t: t[0]):
            yield h

    def list_queue(self) -> Iterator[QueuedMail]:
        return self._merged(lambda s: s.list_queue())

    def scan_queue(self) -> Iterator[QueuedMail | HeldMail]:
        """Each root's own scan, one root after another (no merge: nothing is kept)."""
        self._check_open()
        for r in list(self._roots):
            for inner in self._store(r).scan_queue():
                yield self._wrap(r, inner)

    def list_zone(self, zone: str) -> Iterator[QueuedMail]:
        if Capability.ZONE_LISTING not in self.capabilities:
            return super().list_zone(zone)
        return self._merged(lambda s: s.list_zone(zone))

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        if Capability.DOMAIN_INDEX not in self.capabilities:
            return super().list_domain(domain)
        return self._merged(lambda s: s.list_domain(domain))

    def list_held(self) -> Iterator[HeldMail]:
        if Capability.HOLD not in self.capabilities:
            return super().list_held()
        return self._merged(lambda s: s.list_held())

    def find_inflight(self) -> Iterator[InflightMail]:
        self._check_open()
        for r in list(self._roots):
            for inner in self._store(r).find_inflight():
                yield self._wrap(r, inner)

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        self._check_open()
        for r in list(self._roots):
            for inner in self._store(r).find_pending_cleanup():
                yield self._wrap(r, inner)

    def inflight_entries(self) -> Iterator[EntryMeta]:
        self._check_open()

        def one(r: _Root) -> Iterator[tuple[str, EntryMeta]]:
            for meta in self._store(r).inflight_entries():
                yield meta.message_id, _meta(r.index, meta)

        for _, meta in heapq.merge(*(one(r) for r in self._roots), key=lambda t: t[0]):
            yield meta

    # ---- writing and reading mail ------------------------------------------------------

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        """Start a message on the least busy healthy root (see the module docstring)."""
        self._check_open()
        last: StorageIOError | None = None
        for r in self._choose():
            try:
                inner = self._store(r).enqueue(mail_from, params)
            except StorageIOError as e:
                self._failed(r, e)
                last = e
                continue
            with self._lock:
                r.enqueuing += 1
            return _RootEnqueuer(self, r, inner)
        assert last is not None
        raise last

    def _enqueue_ended(self, r: _Root, error: StorageIOError | None, committed: bool) -> None:
        """An enqueue on ``r`` ended: a commit clears the root's last disk failure."""
        with self._lock:
            r.enqueuing -= 1
            if committed:
                r.failed_at = r.last_error = None
        if error is not None:
            self._failed(r, error)

    def read_inflight(self, mail: InflightMail) -> MailReader:
        h = self._peek(mail, InflightMail)
        r, inner = self._route(h)
        try:
            return _RootReader(r.index, self._store(r).read_inflight(inner))  # type: ignore[arg-type]
        except CorruptionError as e:
            raise self._corruption(r, e) from e

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        h = self._peek(mail, type(mail) if isinstance(mail, (QueuedMail, HeldMail))
                       else QueuedMail)
        r, inner = self._route(h)
        try:
            got = self._store(r).inspect_entry(inner)  # type: ignore[arg-type]
        except CorruptionError as e:
            raise self._corruption(r, e) from e
        return None if got is None else _RootReader(r.index, got)

    # ---- state changes -----------------------------------------------------------------

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        validate_schedule(schedule)  # before the handle is taken, as on one root
        h = self._take(mail, QueuedMail)
        return self._call(h, lambda s, i: s.reschedule(i, schedule))  # type: ignore[return-value,arg-type]

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        return self._call(h, lambda s, i: s.send_start(i))  # type: ignore[return-value,arg-type]

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        h = self._take(mail, InflightMail)
        return self._call(h, lambda s, i: s.send_done(i))  # type: ignore[return-value,arg-type]

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        validate_schedule(schedule)  # before the handle is taken, as on one root
        h = self._take(mail, InflightMail)
        return self._call(h, lambda s, i: s.send_cancel(i, schedule))  # type: ignore[return-value,arg-type]

    def send_finish(self, done: Sequence[InflightMail] = (),
                    cancel: Sequence[tuple[InflightMail, Schedule]] = ()) -> Finished:
        """Each root's entries in one ``send_finish`` of that root (its one durable step,
        C15), the roots in turn.  On ``StorageIOError`` from a root: the roots before it
        moved their entries durably (in ``finished``), that root's error says which of
        its own did, the roots after it moved nothing; every handle of the batch is
        handed back live (a retry moves what did not move and answers None for the
        rest)."""
        dones, cancels = self._take_batch(done, cancel)
        every = [*dones, *(h for h, _ in cancels)]
        routed, order = self._routed(every)
        got: list[Handle | None] = [None] * len(every)
        schedules = [s for _, s in cancels]
        n = len(dones)
        for index, positions in order.items():
            r = self._by_index[index]
            inner_d = [routed[p][1] for p in positions if p < n]
            inner_c = [(routed[p][1], schedules[p - n]) for p in positions if p >= n]
            try:
                res = self._store(r).send_finish(inner_d, inner_c)  # type: ignore[arg-type]
            except StorageIOError as e:
                self._failed(r, e)
                raise self._finish_failed(e, r, positions, every, routed, got, n) from None
            for p, x in zip(positions, [*res.done, *res.cancelled], strict=True):
                got[p] = None if x is None else self._wrap(r, x)
        return Finished(got[:n], got[n:])  # type: ignore[arg-type]

    def _routed(self, every: Sequence[Handle]
                ) -> tuple[list[tuple[_Root, Handle]], dict[int, list[int]]]:
        """The root and own handle of each handle of a batch just taken, and each root's
        positions in the batch (root index -> positions, the roots in the order they
        first appear).  A handle no served root owns gives every handle back."""
        try:
            routed = [self._route(h) for h in every]
        except Exception:
            for h in every:
                self._give_back(h)
            raise
        order: dict[int, list[int]] = {}
        for pos, (r, _) in enumerate(routed):
            order.setdefault(r.index, []).append(pos)
        return routed, order

    def _hand_back(self, every: Sequence[Handle], routed: Sequence[tuple[_Root, Handle]],
                   finished: set[int], failed: _Root, kept: set[int] | None
                   ) -> tuple[Handle, ...]:
        """After ``failed``'s batch raised: every handle of the roots not done, re-armed;
        of ``failed``'s, those whose own handle its error gave back (``kept``: their ids;
        None: all)."""
        return tuple(self._give_back(h) for p, h in enumerate(every)
                     if p not in finished and (kept is None or routed[p][0] is not failed
                                               or id(routed[p][1]) in kept))

    def _finish_failed(self, e: StorageIOError, failed: _Root, positions: list[int],
                       every: list[InflightMail], routed: list[tuple[_Root, Handle]],
                       got: list[Handle | None], n_done: int) -> StorageIOError:
        """``send_finish``'s error: this queue's handles, each re-armed over a live handle
        of its root (the failing root's from its error; the others' own, re-armed), and
        what moved durably (``got``: the roots before; the failing root's ``finished``)."""
        mine = dict(zip(positions, e.handles or (), strict=False))
        theirs = [*e.finished.done, *e.finished.cancelled] if e.finished is not None else []
        for p, x in zip(positions, theirs, strict=False):
            if x is not None:
                got[p] = self._wrap(failed, x)
        handles = []
        for p, h in enumerate(every):
            r, inner = routed[p]
            live = mine.get(p, inner) if r is failed else inner
            if not live._live:  # moved by its root's send_finish: a retry answers None
                self._store(r)._give_back(live)
            h._extra = _Inner(r.index, r.generation, live)
            handles.append(self._give_back(h))
        e.handle = None
        e.handles = tuple(handles)
        e.finished = (Finished(got[:n_done], got[n_done:])  # type: ignore[arg-type]
                      if any(x is not None for x in got) else None)
        return e

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        h = self._take(mail, QueuedMail)
        return self._call(h, lambda s, i: s.drop(i))  # type: ignore[return-value,arg-type]

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        h = self._take(mail, QueuedMail)
        return self._call(h, lambda s, i: s.hold(i))  # type: ignore[return-value,arg-type]

    def release(self, mail: HeldMail) -> QueuedMail | None:
        h = self._take(mail, HeldMail)
        return self._call(h, lambda s, i: s.release(i))  # type: ignore[return-value,arg-type]

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        h = self._take(mail, HeldMail)
        return self._call(h, lambda s, i: s.drop_held(i))  # type: ignore[return-value,arg-type]

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        h = self._take(mail, PendingCleanupMail)
        r, inner = self._route(h)
        try:
            return self._store(r).cleanup(inner)  # type: ignore[arg-type]
        except StorageIOError as e:
            self._failed(r, e)
            if e.handle is not None:
                h._extra = _Inner(r.index, r.generation, e.handle)
                e.handle = self._give_back(h)
            raise

    def cleanup_all(self, mails: Sequence[PendingCleanupMail]) -> list[bool]:
        """Each root's entries in one ``cleanup_all`` of that root (C16), the roots in
        turn.  On ``StorageIOError`` from a root, the roots before it released theirs and
        the roots after it nothing: the error hands back a live handle of every entry
        that may not be released (the failing root's say which of its own); on another
        error every handle of the roots not done is given back."""
        every = self._take_all(mails, PendingCleanupMail, "cleanup_all")
        routed, order = self._routed(every)
        released = [False] * len(every)
        finished: set[int] = set()
        for index, positions in order.items():
            r = self._by_index[index]
            try:
                res = self._store(r).cleanup_all(
                    [routed[p][1] for p in positions])  # type: ignore[misc]
            except StorageIOError as e:
                self._failed(r, e)
                e.handle = None
                e.handles = self._hand_back(every, routed, finished, r,
                                            {id(x) for x in e.handles})
                raise
            except Exception:
                self._hand_back(every, routed, finished, r, None)
                raise
            for p, x in zip(positions, res, strict=True):
                released[p] = x
                finished.add(p)
        return released

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        """The tightest of every root's limits; spare files: their sum."""
        self._check_open()
        every = [self._store(r).limits for r in self._roots]

        def least(values: list[int | None]) -> int | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        return Limits(max_recipients=least([lim.max_recipients for lim in every]),
                      max_address=min(lim.max_address for lim in every),
                      max_body_bytes=least([lim.max_body_bytes for lim in every]),
                      pool_files=sum(lim.pool_files for lim in every),
                      drains_full_disk=all(lim.drains_full_disk for lim in every))

    def recover(self) -> RecoveryReport:
        """Reopen the roots that need it (``reopen_failed``), then recover every other
        root; the reports summed."""
        self._check_open()
        before = set(self.reopen_failed())
        reports = [self._store(r).last_recovery if r.name in before
                   else self._store(r).recover() for r in self._roots]
        merged = self._merged_reports(reports)
        self.last_recovery = merged if merged is not None else RecoveryReport()
        return self.last_recovery

    def _merged_reports(self, reports: Sequence[RecoveryReport | None]) -> RecoveryReport | None:
        if all(rep is None for rep in reports):
            return None
        out = RecoveryReport()
        for r, rep in zip(self._roots, reports, strict=True):
            if rep is None:
                continue
            p = root_prefix(r.index)
            out = RecoveryReport(
                requeued=out.requeued + rep.requeued, cleaned=out.cleaned + rep.cleaned,
                uncommitted_removed=out.uncommitted_removed + rep.uncommitted_removed,
                orphans_removed=out.orphans_removed + rep.orphans_removed,
                quarantined=out.quarantined + rep.quarantined,
                problems=out.problems + tuple(f"{r.name}: {x}" for x in rep.problems),
                lost=out.lost + tuple(p + x for x in rep.lost),
                lost_unknown=out.lost_unknown + rep.lost_unknown,
                damaged_files=out.damaged_files + tuple(
                    os.path.join(r.name, x) for x in rep.damaged_files))
        return out

    def footprint(self) -> Footprint:
        self._check_open()
        parts = [self._store(r).footprint() for r in self._roots]
        return Footprint(sum(f.objects for f in parts), sum(f.bytes for f in parts))

    def close(self) -> None:
        """Close every root."""
        if self._closed:
            return
        self._closed = True
        self._close_roots()

    def _close_roots(self) -> None:
        last: BaseException | None = None
        for r in self._roots:
            store, r.store = r.store, None
            if store is not None:
                try:
                    store.close()
                except Exception as e:  # close the others all the same
                    last = e
        if last is not None:
            raise last


def share_a_file_system(roots: Sequence[str]) -> bool:
    """Whether two of the directories ``roots`` are (or, where missing, will be made) on
    one file system: the device of each, or of its nearest existing parent."""
    devices = []
    for root in roots:
        path = os.path.abspath(root)
        while True:
            try:
                devices.append(os.stat(path).st_dev)
                break
            except OSError:
                parent = os.path.dirname(path)
                if parent == path:
                    return False  # nothing to stat: no claim either way
                path = parent
    return len(set(devices)) < len(devices)


def _meta(index: int, meta: EntryMeta) -> EntryMeta:
    p = root_prefix(index)
    return replace(meta, message_id=p + meta.message_id, entry_id=p + meta.entry_id)


class _RootEnqueuer(Enqueuer):
    """A root's Enqueuer whose ids name the root; its end is counted in the root's load."""

    def __init__(self, q: MultiRootQueue, r: _Root, inner: Enqueuer) -> None:
        self._q = q
        self._root = r
        self._inner = inner
        self._counted = True

    def _end(self, error: StorageIOError | None, committed: bool = False) -> None:
        if self._counted:
            self._counted = False
            self._q._enqueue_ended(self._root, error, committed)
        elif error is not None:
            self._q._failed(self._root, error)

    @property
    def message_id(self) -> str | None:
        try:
            got = self._inner.message_id
        except StorageIOError as e:
            self._end(e)
            raise
        return None if got is None else root_prefix(self._root.index) + got

    def write(self, data: bytes) -> None:
        try:
            self._inner.write(data)
        except StorageIOError as e:
            self._end(e)
            raise

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        try:
            got = self._inner.commit(rcpts)
        except StorageIOError as e:
            self._end(e)
            raise
        except InvalidInputError:
            raise  # the Enqueuer stays usable
        except BaseException:
            self._end(None)
            raise
        self._end(None, committed=True)
        return [self._q._wrap(self._root, m) for m in got]

    def abort(self) -> None:
        try:
            self._inner.abort()
        finally:
            self._end(None)


class _RootReader(MailReader):
    """A root's MailReader whose metadata names the root."""

    def __init__(self, index: int, inner: MailReader) -> None:
        self._index = index
        self._inner = inner
        self.meta = _meta(index, inner.meta)

    def read(self, n: int = -1) -> bytes:
        try:
            return self._inner.read(n)
        except CorruptionError as e:
            raise CorruptionError(str(e), root_prefix(self._index) + e.entry_id,
                                  e.quarantined_to) from e

    def close(self) -> None:
        self._inner.close()
