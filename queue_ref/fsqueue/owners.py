"""Owners: which open queues (processes, or several FsQueue objects of one process) are alive.

Each open FsQueue has an owner token (random, or given fresh) and holds an exclusive ``flock`` on
``owners/<token>.lock`` for as long as it is open; the kernel drops the lock when the
process dies, whatever the way.  Another queue tests an owner by trying to take that lock
(``IO.lock_exclusive``, non-blocking): if it gets it, or the file does not exist, the owner
is dead.  A dead owner stays dead (tokens are never reused), so deaths are cached;
``register`` refuses a token that is held, or that a dead owner left on disk.

``owners/gate.lock`` is taken (blocking) around registering a new owner and around every
recovery.  A recovery that holds the gate and finds every other owner dead therefore runs
alone: no other process has the queue open, and none can open it until the gate is
released.  Only such an *exclusive* recovery does the destructive parts (orphan removal,
see fs_recovery.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from queue_ref.fsqueue.diskutil import if_exists, listdir_or_empty
from queue_ref.fsqueue.layout import OWNER_LOCK_RE, Layout
from queue_ref.io import IO
from queue_ref.storage import MisuseError


class OwnerInUseError(MisuseError):
    """The owner token asked for is held by another open queue, or was used before."""


class Owners:
    def __init__(self, io: IO, layout: Layout, me: str) -> None:
        self.io = io
        self.layout = layout
        self.me = me
        self._dead: set[str] = set()

    @contextmanager
    def gate(self) -> Iterator[None]:
        """Hold ``owners/gate.lock`` (blocking) for the duration of the block."""
        fd = self.io.lock_exclusive(self.layout.gate, blocking=True)
        if fd is None:  # blocking lock_exclusive only returns None if the seam says so
            raise OSError(f"could not take {self.layout.gate}")
        try:
            yield
        finally:
            self.io.unlock(fd)

    def register(self) -> int:
        """Take our own liveness lock; returns the fd that holds it.  Call with the gate held.

        OwnerInUseError if another open queue holds the token, or if a queue that died
        used it (its lock file or ``tmp/<token>`` is still there): a token is never
        reused.  Nothing is then held, and nothing of the dead owner's is removed (that is
        recovery's work).
        """
        path = self.layout.owner_lock(self.me)
        existed = self.io.exists(path)
        fd = self.io.lock_exclusive(path)
        if fd is None:
            raise OwnerInUseError(f"owner token {self.me} is held by another open queue on "
                                  f"{self.layout.root}")
        if existed or self.io.exists(self.layout.tmp_owner(self.me)):
            if existed:
                self.io.unlock(fd)
            else:
                self.release(fd)  # the lock file is ours: leave nothing behind
            raise OwnerInUseError(f"owner token {self.me} was used before on "
                                  f"{self.layout.root} by a queue that is gone; owner tokens "
                                  "must never be reused")
        return fd

    def alive(self, owner: str) -> bool:
        """Is ``owner`` (a token) an open queue right now?  Ours is alive by definition."""
        if owner == self.me:
            return True
        if owner in self._dead:
            return False
        path = self.layout.owner_lock(owner)
        if not self.io.exists(path):
            self._dead.add(owner)
            return False
        fd = self.io.lock_exclusive(path)
        if fd is None:
            return True
        self.io.unlock(fd)
        self._dead.add(owner)
        return False

    def on_disk(self) -> list[str]:
        """Tokens that have a lock file."""
        out = []
        for name in listdir_or_empty(self.io, self.layout.owners):
            m = OWNER_LOCK_RE.match(name)
            if m is not None:
                out.append(m["owner"])
        return out

    def others_alive(self) -> list[str]:
        return [o for o in self.on_disk() if o != self.me and self.alive(o)]

    def forget_dead(self, owner: str) -> bool:
        """Remove a dead owner's lock file (taking its lock first).  True if removed."""
        if owner == self.me:
            return False
        path = self.layout.owner_lock(owner)
        fd = self.io.lock_exclusive(path)
        if fd is None:
            return False
        try:
            return if_exists(self.io.unlink, path)
        finally:
            self.io.unlock(fd)

    def release(self, fd: int) -> None:
        """Give up our own lock at close: unlink the lock file, then drop the lock."""
        try:
            if_exists(self.io.unlink, self.layout.owner_lock(self.me))
        finally:
            self.io.unlock(fd)
