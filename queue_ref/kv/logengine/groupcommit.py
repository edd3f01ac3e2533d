"""Group commit: writers queue up; the one at the head appends a whole group.

LevelDB's writer queue, with the head handed on before the sync.  A writer appends itself
to the queue and waits until either its batch was committed for it (it is ``done``) or it
reaches the head and leads.  An unsynced leader takes the unsynced writers behind it and
never syncs.  A leader of a synced batch first takes the engine's sync lock, that is,
waits for the running fdatasync to end (writers keep queuing behind it meanwhile: that is
where groups grow), may wait a little longer for more (``_gather_more``), then takes the
run of batch writers behind it (up to ``GROUP_LIMIT`` bytes), appends their records to
the log with one write, records the group as *pending*, hands the head on, and syncs.
The next leader can form and append its group while this one syncs, but its own sync
waits: one fdatasync at a time.

(Concurrent fdatasyncs through one open file would let the kernel merge their journal
commits, but a writeback error is then reported to only one of them: Linux's errseq keeps
one error cursor per open file, so the other caller could see success for data the
failed writeback lost.)

A pending group enters the memtable, and its writers return, only when every group
appended before it has, and (if one of its batches asked for a sync) once an fdatasync
begun after its append returned.  So groups become visible in log order, a synced batch
only once durable, and nobody returns before the sync that covers its batch.  If an
fdatasync fails, every pending group fails.  Exclusive turns (flush, compaction, close)
queue like writers, never join a group, and wait for the pending groups to drain.

Each writer sleeps on its own wake-up lock (LevelDB's per-writer condition variable):
it is released once when the writer reaches the head, and once when its group is done,
never both before the writer has taken it.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from queue_ref.kv.logengine.format import Op
from queue_ref.storage import ClosedError

GROUP_LIMIT = 1 << 20
GATHER_HISTORY = 8  # groups whose synced-writer counts a leader gathers towards
GATHER_MAX = 0.002  # longest a leader waits for companions, seconds


class Writer:
    __slots__ = ("done", "error", "exclusive", "ops", "record", "sync", "wake")

    def __init__(self, record: bytes, ops: list[Op], sync: bool, *, exclusive: bool = False):
        self.record = record
        self.ops = ops
        self.sync = sync
        self.exclusive = exclusive
        self.done = False
        self.error: BaseException | None = None
        self.wake = threading.Lock()  # held until the writer is woken
        self.wake.acquire()


class Group:
    """Writers whose records were appended with one write, ``end`` the log offset after."""

    __slots__ = ("end", "keys", "leader_waits", "sync", "writers")

    def __init__(self, writers: list[Writer], end: int) -> None:
        self.writers = writers
        self.end = end
        self.sync = any(x.sync for x in writers)
        self.keys = frozenset(k for x in writers for k, _ in x.ops)
        self.leader_waits = False  # the leader sleeps on its wake lock until done

    def finish(self, error: BaseException | None) -> None:
        """Mark every writer done (members get a copy of ``error``) and wake the sleepers."""
        lead = self.writers[0]
        lead.error = error
        lead.done = True
        for x in self.writers[1:]:
            x.error = None if error is None else member_error(error)
            x.done = True
            x.wake.release()
        if self.leader_waits:
            lead.wake.release()


def member_error(e: BaseException) -> BaseException:
    """A fresh exception for a group member whose leader failed with ``e``."""
    if isinstance(e, ClosedError):
        return ClosedError(str(e))
    code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    err = OSError(code, f"group commit failed in its leader: {e!r}")
    err.__cause__ = e
    return err


class WriterQueue:
    """The queue in which groups form; it hands the head on in order."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._queue: deque[Writer] = deque()
        self._gather = threading.Condition(self._mu)
        self._gathering = False
        self._recent: deque[int] = deque(maxlen=GATHER_HISTORY)  # synced writers per group
        self._sync_time = 0.0  # moving average of the fdatasync time, seconds

    def _enter(self, w: Writer) -> None:
        """Queue ``w``; return once it is done or at the head of the queue."""
        with self._mu:
            self._queue.append(w)
            head = self._queue[0] is w
            if self._gathering and w.sync:
                self._gather.notify()
        if not head:
            w.wake.acquire()

    def note_sync(self, seconds: float) -> None:
        """Record how long a group's fdatasync took (it bounds the gathering wait)."""
        with self._mu:
            self._sync_time += (seconds - self._sync_time) / 8

    def _synced_queued(self, enough: int) -> int:
        n = 0
        for x in self._queue:
            if x.exclusive:
                break
            n += x.sync
            if n >= enough:
                break
        return n

    def _gather_more(self) -> None:
        """As a synced leader, wait a little for as many synced writers as recent groups
        had (the caller holds ``_mu``).

        Without it a leader that finds the queue empty (its usual companions are busy
        between two writes) syncs alone while they queue behind it, and groups alternate
        between one writer and all the others, which doubles the fdatasyncs.  The wait is
        at most half a recent fdatasync and ``GATHER_MAX``, and none while groups are
        single writers (one producer, or a deterministic single-threaded run).
        """
        want = max(self._recent, default=1)
        delay = min(GATHER_MAX, self._sync_time / 2)
        if want <= 1 or delay <= 0 or self._synced_queued(want) >= want:
            return
        deadline = time.monotonic() + delay
        self._gathering = True
        try:
            while self._synced_queued(want) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._gather.wait(left)
        finally:
            self._gathering = False

    def join(self, w: Writer) -> bool:
        """Queue ``w`` and wait.  False: its group was committed by another leader
        (re-raises that group's error).  True: ``w`` is at the head and leads; it calls
        ``group`` (when it is ready: writers keep queuing behind it meanwhile), appends
        the records and calls ``handoff``."""
        self._enter(w)
        if w.done:
            if w.error is not None:
                raise w.error
            return False
        return True

    def group(self) -> list[Writer]:
        """The run of batch writers from the head (the leader first), up to GROUP_LIMIT;
        an unsynced leader takes unsynced writers only (it never syncs)."""
        with self._mu:
            synced = self._queue[0].sync
            if synced:
                self._gather_more()
            group: list[Writer] = []
            size = n_synced = 0
            for x in self._queue:
                if (x.exclusive or (x.sync and not synced)
                        or (group and size + len(x.record) > GROUP_LIMIT)):
                    break
                group.append(x)
                size += len(x.record)
                n_synced += x.sync
            if synced:
                self._recent.append(n_synced)
            return group

    def handoff(self, group: list[Writer]) -> None:
        """Take the group off the queue and wake the writer now at the head."""
        with self._mu:
            for _ in group:
                self._queue.popleft()
            if self._queue:
                self._queue[0].wake.release()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the head: after every group queued before it, before any queued after."""
        w = Writer(b"", [], False, exclusive=True)
        self._enter(w)
        try:
            yield
        finally:
            self.handoff([w])
