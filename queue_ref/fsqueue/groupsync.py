"""Group commit: concurrent callers share the syncs that make their changes durable.

A caller that changed something (wrote a file, created, renamed or unlinked a name) needs
a sync that *started after* its change; one already running when it arrives may have
missed it.  Callers therefore form rounds, run one at a time: a caller arriving while
round ``r`` runs waits for round ``r + 1``, which covers every caller that arrived by the
time it starts.  One of those callers, the *leader*, runs it for all of them; the others
sleep, each on its own lock, and are woken one by one when their round ended, so a round
wakes exactly the callers it served.  When a round ends and callers are waiting, the
oldest of them is woken to lead the next one.

What a round does depends on the mode (``SYNC_MODES``):

* ``"syncfs"``: one ``syncfs(2)`` of the queue's file system.  It makes every caller's
  file data and directory entries durable at once, whatever they were: one device flush
  for the whole round.  Callers need not name anything.
* ``"fsync"``: an fsync of each directory the round's callers named (each once).  File
  data is not shared in this mode: each caller fsyncs its own files itself
  (``FsSteps._sync_file``), in its own thread.

After a failed round every caller it served gets the error; a later round that succeeds
does not make up for it (the kernel may have dropped the dirty state with the error,
"fsyncgate"), so nobody is told its change is durable on the strength of a retry.  A
``BaseException`` in the leader (a simulated crash) propagates in the leader, and the
callers it served get EIO.
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from collections.abc import Iterable

from queue_ref.io import IO

SYNC_MODES = ("syncfs", "fsync")


class _Waiter:
    """One caller: what it needs synced, and the lock it sleeps on until served."""

    __slots__ = ("error", "lead", "paths", "wake")

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.paths = paths
        self.wake: threading.Lock | None = None
        self.lead = False  # woken to lead a round, not served
        self.error: OSError | None = None


class GroupSync:
    """Shared sync rounds through one I/O seam.  Thread-safe.

    ``anchor`` is a path on the queue's file system (``syncfs`` mode syncs the file system
    that holds it).  ``rounds`` and ``requests`` count rounds run and callers served.
    """

    def __init__(self, io: IO, mode: str, anchor: str) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode must be one of {SYNC_MODES}, not {mode!r}")
        self.io = io
        self.mode = mode
        self.anchor = anchor
        self._lock = threading.Lock()
        self._waiting: deque[_Waiter] = deque()
        self._leading = False
        self.rounds = 0
        self.requests = 0

    @property
    def covers_files(self) -> bool:
        """Whether a round makes file data durable too (``syncfs``), so that callers need
        not fsync their files themselves."""
        return self.mode == "syncfs"

    def sync(self, paths: Iterable[str] = ()) -> None:
        """Return once a round that started after this call has covered ``paths`` (the
        directories whose entries the caller changed; in ``syncfs`` mode, everything).

        Raises the OSError of that round if it failed.
        """
        me = _Waiter(tuple(dict.fromkeys(paths)))
        with self._lock:
            self.requests += 1
            if self._leading:
                me.wake = threading.Lock()
                me.wake.acquire()
                self._waiting.append(me)
            else:
                self._leading = True
                me.lead = True
        if not me.lead:
            assert me.wake is not None
            me.wake.acquire()  # released by the leader that served us, or to make us lead
            if not me.lead:
                if me.error is not None:
                    raise me.error
                return
        self._lead(me)
        if me.error is not None:
            raise me.error

    def _lead(self, me: _Waiter) -> None:
        """Run one round for ``me`` and everyone waiting, wake them, and hand the lead to
        the oldest caller that arrived meanwhile (or give it up)."""
        with self._lock:
            batch = [me, *self._waiting]
            self._waiting.clear()
        served = False
        try:
            self._round(batch)
            served = True
        finally:
            if not served:  # a BaseException in this thread: the others cannot know
                for w in batch:
                    w.error = OSError(errno.EIO, "the sync round was interrupted")
            for w in batch:
                if w is not me:
                    w.lead = False
                    assert w.wake is not None
                    w.wake.release()
            with self._lock:
                self.rounds += 1
                nxt = self._waiting.popleft() if self._waiting else None
                if nxt is None:
                    self._leading = False
            if nxt is not None:
                nxt.lead = True
                assert nxt.wake is not None
                nxt.wake.release()

    def _round(self, batch: list[_Waiter]) -> None:
        """The syncs of one round; records each caller's error on it."""
        if self.mode == "syncfs":
            try:
                self.io.syncfs(self.anchor)
            except OSError as e:
                for w in batch:
                    w.error = e
            return
        failed: dict[str, OSError] = {}
        for path in dict.fromkeys(p for w in batch for p in w.paths):
            try:
                self.io.fsync_dir(path)
            except OSError as e:
                failed[path] = e
        if failed:
            for w in batch:
                w.error = next((failed[p] for p in w.paths if p in failed), None)
