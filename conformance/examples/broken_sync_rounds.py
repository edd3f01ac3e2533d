"""Broken variants whose group commit lets a late caller ride a sync already running: its
change came after the round's sync began, yet that round acknowledges it.  One bug each,
in each backend that groups its syncs; only the sync-rounds check (a caller stopped inside
the leader's sync while another makes its change) and the sync-cover rule it judges by
catch them, on C1 (commit), C3 (send_done, drop) or C9.  Never use them for mail.

    queue-ref certify conformance.examples.broken_sync_rounds:fs_rides_running_sync \\
        --only sync-rounds

LevelDB's own writer queue (``kv_leveldb``) is out of reach: plyvel goes to its C++ code,
not through the I/O seam, so no variant of it can be stopped inside its fdatasync.

``fs_commit_syncs_data_early`` rides a sync it started itself, in a thread of its own,
before its change: one caller is enough, so the single-threaded checks that run the
sync-cover rule (the lockstep, crash exploration) catch it too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from queue_ref.fsqueue.groupsync import GroupSync
from queue_ref.io import IO
from queue_ref.storage import Storage

if TYPE_CHECKING:
    from queue_ref.fsqueue import FsQueue


class RidingGroupSync(GroupSync):
    """A group commit in which a caller that finds a round's sync running, and whose
    directories that round syncs (every one, in ``syncfs`` mode), waits for that sync to
    end and takes it for its own (the bug: its change may have come after the sync began).
    A step (``then``) still gets a round of its own after it."""

    def __init__(self, io: IO, mode: str, anchor: str) -> None:
        super().__init__(io, mode, anchor)
        self._ended = threading.Condition(self._lock)
        self._syncing: frozenset[str] | None = None  # the paths of the sync running
        self._syncs_ended = 0

    def _round(self, batch: list[Any]) -> None:
        with self._lock:
            self._syncing = frozenset(p for w in batch for p in w.paths)
        try:
            super()._round(batch)
        finally:
            with self._lock:
                self._syncing = None
                self._syncs_ended += 1
                self._ended.notify_all()

    def sync(self, paths: Iterable[str] = (), *,
             then: Callable[[], object] | None = None) -> None:
        paths = tuple(paths)
        with self._lock:
            running = self._syncing
            rides = running is not None and (self.mode == "syncfs" or running >= set(paths))
            if rides:  # the bug: "the round syncing now will do for me too"
                seen = self._syncs_ended
                while self._syncs_ended == seen:
                    self._ended.wait()
        if not rides:
            super().sync(paths, then=then)
            return
        if self.failed is not None:
            raise self.failed
        if then is not None:
            then()
            super().sync()


def _riding_fs(mode: str, root: str, io: IO | None) -> Storage:
    from conformance.crashexplore.explored_backends import open_fs_mode
    from queue_ref.fsqueue import FsQueue

    store = FsQueue(root, sync=mode) if io is None else open_fs_mode(mode)(root, io)
    assert isinstance(store, FsQueue)
    store._group = RidingGroupSync(store.io, mode, store.layout.data)
    return store


class _EarlySync:
    """``io.fsync_dir(path)`` in a thread of its own; the constructor returns once that
    sync is under way: once the seam counts it begun (``FaultyIO.sync_count``; a disk's
    fsync outlasts a rename, the seam's only when held open), else after a millisecond."""

    def __init__(self, io: IO, path: str) -> None:
        self.error: BaseException | None = None
        begun = getattr(io, "sync_count", None)
        self.thread = threading.Thread(target=self._run, args=(io, path), daemon=True)
        self.thread.start()
        if begun is None:
            time.sleep(0.001)
            return
        deadline = time.monotonic() + 1.0
        while (getattr(io, "sync_count", begun) == begun and self.thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.0001)

    def _run(self, io: IO, path: str) -> None:
        try:
            io.fsync_dir(path)
        except BaseException as e:  # raised in the caller's thread, by ``wait``
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _early_data_sync_queue() -> type[FsQueue]:
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.steps import MessageTx

    class EarlyDataSync(FsQueue):
        """``fsync`` mode; the commit starts the fsync of ``data/`` in a thread of its own
        right before its commit rename (the disk works while it renames), waits for that
        fsync after the rename, and leaves ``data/`` out of the fsyncs that follow (the
        bug: that fsync began before the rename, so it may have missed it)."""

        default_sync = "fsync"
        _early = threading.local()

        def _commit_rename(self, tx: MessageTx) -> None:
            early = _EarlySync(self.io, self.layout.data)
            try:
                super()._commit_rename(tx)
            except BaseException:
                early.thread.join()
                raise
            self._early.sync = early

        def _sync_committed(self, tx: MessageTx, links: bool) -> None:
            early: _EarlySync | None = getattr(self._early, "sync", None)
            self._early.sync = None
            if early is None:
                super()._sync_committed(tx, links)
                return
            early.wait()
            dirs = [self.layout.tmp_owner(self.owner)]
            if links:
                dirs.append(self.layout.queue)
            self._sync_dirs(*dirs)

    return EarlyDataSync


def fs_commit_syncs_data_early(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue in ``fsync`` mode whose commit starts the fsync of ``data/``
    in a thread of its own before its commit rename, and acknowledges the commit once that
    fsync (and the others after the rename) ended: the rename came after the fsync began,
    so a power cut right after the acknowledgement may undo the commit.  One caller rides
    its own early sync: the sync-cover rule catches it on C1 in every check that runs it
    (lockstep, crash exploration, threads, group-commit, sync-rounds); crash exploration's
    power cuts at rest after a commit see the loss too."""
    cls = _early_data_sync_queue()
    if io is None:
        return cls(root)
    from conformance.crashexplore.explored_backends import deterministic_fs

    return deterministic_fs(cls)(root, io)


def fs_rides_running_sync(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``syncfs`` mode) whose caller rides a running ``syncfs``
    round (``RidingGroupSync``): a commit's body written during the leader's syncfs, a
    drop's or release's rename, is acknowledged by it.  Today's single-caller checks never
    find a round running; the sync-rounds check catches it on C1, C3 and C9."""
    return _riding_fs("syncfs", root, io)


def fs_fsync_rides_running_sync(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue in ``fsync`` mode whose caller rides a running round of
    directory fsyncs that names its directories (``RidingGroupSync``): a rename into
    ``queue/`` made while the leader fsyncs ``queue/`` is acknowledged by that fsync.
    Caught by the sync-rounds check."""
    return _riding_fs("fsync", root, io)


def kv_log_rides_running_sync(root: str, io: IO | None = None) -> Storage:
    """The KV queue over the log engine whose group-commit leader appends its group before
    it waits for the running fdatasync, and whose fdatasync marks the log durable up to
    its size when the sync *ended*: a group appended while another group's fdatasync ran
    finds itself covered by it, skips its own sync and is acknowledged.  (Either change
    alone is harmless.)  Caught by the sync-rounds check."""
    import contextlib

    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine
    from queue_ref.kv.logengine.groupcommit import Group
    from queue_ref.kv.logengine.wal import LogWriter

    class AppendsFirst(LogEngine):
        def __init__(self, path: str, io: IO | None = None) -> None:
            super().__init__(path, io=io)
            self._sync_turn = self._sync_mu
            # the first change: ``_commit`` forms and appends its group without waiting
            # for the running fdatasync (only the fdatasync itself waits, in ``_sync``)
            self._sync_mu = contextlib.nullcontext()  # type: ignore[assignment]

        def _sync(self, group: Group, log: LogWriter) -> None:
            with self._sync_turn:
                with self._append_mu:
                    if group.writers[0].done or self._durable >= group.end:
                        return
                super()._sync(group, log)
                if self._failed is None:
                    with self._append_mu:  # the second: the size after the sync
                        self._durable = max(self._durable, log.size)

    return KvQueue.open_log(root, io, engine=lambda p, i: AppendsFirst(p, io=i))

