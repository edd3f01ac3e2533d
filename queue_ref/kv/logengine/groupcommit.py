"""Group commit: writers queue up; the one at the head leads and commits a whole group.

LevelDB's writer queue.  A writer appends itself and waits until either a leader has
committed its batch for it (it is ``done``) or it reaches the head of the queue and leads.
A leader takes the run of batch writers behind it (up to ``GROUP_LIMIT`` bytes), writes
them with one append and at most one fdatasync, then marks them done: nobody returns
before the sync that covers its batch.  Exclusive turns (flush, compaction, close) queue
the same way but never join a group, so they run alone, between groups.
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from queue_ref.kv.logengine.format import Op
from queue_ref.storage import ClosedError

GROUP_LIMIT = 1 << 20


class Writer:
    __slots__ = ("done", "error", "exclusive", "ops", "record", "sync")

    def __init__(self, record: bytes, ops: list[Op], sync: bool, *, exclusive: bool = False):
        self.record = record
        self.ops = ops
        self.sync = sync
        self.exclusive = exclusive
        self.done = False
        self.error: BaseException | None = None


def _member_error(e: BaseException) -> BaseException:
    """A fresh exception for a group member whose leader failed with ``e``."""
    if isinstance(e, ClosedError):
        return ClosedError(str(e))
    err = OSError(errno.EIO, f"group commit failed in its leader: {e!r}")
    err.__cause__ = e
    return err


class WriterQueue:
    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[Writer] = deque()

    def join(self, w: Writer) -> list[Writer] | None:
        """Queue ``w`` and wait.  None: another leader committed it (re-raises its error).
        Otherwise ``w`` leads: the group to commit, ``w`` first."""
        with self._cv:
            self._queue.append(w)
            while not w.done and self._queue[0] is not w:
                self._cv.wait()
            if w.done:
                if w.error is not None:
                    raise w.error
                return None
            group: list[Writer] = []
            size = 0
            for x in self._queue:
                if x.exclusive or (group and size + len(x.record) > GROUP_LIMIT):
                    break
                group.append(x)
                size += len(x.record)
            return group

    def finish(self, group: list[Writer], error: BaseException | None, *, keep_lead: bool) -> None:
        """Mark the group done (with ``error`` for the members other than the leader).

        With ``keep_lead`` the leader stays at the head of the queue, so it can run an
        exclusive turn (a flush) before anyone else leads; it must call ``release``.
        """
        with self._cv:
            for _ in group:
                self._queue.popleft()
            for x in group[1:]:
                x.error = None if error is None else _member_error(error)
                x.done = True
            group[0].done = True
            if keep_lead:
                self._queue.appendleft(group[0])
            self._cv.notify_all()

    def release(self) -> None:
        """End the exclusive turn of the writer at the head."""
        with self._cv:
            self._queue.popleft()
            self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run the body alone: after every group queued before it, before any queued after."""
        w = Writer(b"", [], False, exclusive=True)
        with self._cv:
            self._queue.append(w)
            while self._queue[0] is not w:
                self._cv.wait()
        try:
            yield
        finally:
            self.release()
