"""A reserve of disk space that keeps a full KV queue drainable (CockroachDB's ballast).

A queue whose disk is full must still deliver and remove mail: ``send_done``, ``drop``,
``cleanup`` and reopening all write (small batches, and LevelDB writes its memtable to a
table when it opens).  So the queue keeps ``queue-ref.reserve``, a file of zeros, in its
directory.  The first write that fails for a full disk removes it: the space it held is
then there for draining, while new mail is refused (``enqueue`` raises ``NoSpaceError``)
until the reserve can be made again, which each later ``enqueue`` tries once the file
system has room for it and more (``statvfs``).  Opening a queue whose file system has
less free space than the reserve's size removes the reserve first, so recovery can write.

The reserve alone does not drain a full disk: every state change appends a record to the
engine's log, and the log engine's flush used to need room for a table of everything
live.  On a 24 MiB tmpfs filled with 2 KiB messages only 2,141 of 8,102 could be
delivered and cleaned up before ``send_done`` raised ``NoSpaceError`` (and the queue could
not even reopen).  So while the reserve is spent the queue asks the log engine, each
time another eighth of the reserve's size was used, to give back the room of what was
delivered (``LogEngine.reclaim``: its tables are written in pieces, and each piece is
written again without what nothing reads any more, one at a time, so it needs the room
of one piece, not of all the queue holds; ``KvQueue._make_room``).  With it all 8,076
messages of the same disk drain while it stays full, and 24.4 of its 25.1 MB are free
afterwards (``tests/test_kv_full_disk_drain.py``; a 4 MiB tmpfs of 16-byte messages:
4,311 of 4,311).  The reserve is the room the first reclaims and records take.  LevelDB
keeps what its compactions need free instead (``KV.compaction_headroom``), and declares
that it cannot drain a full disk (``Limits.drains_full_disk``).

The reserve is plain file I/O, outside the I/O seam: it is not part of the queue's state,
and queues opened on a fault-injecting seam keep none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

NAME = "queue-ref.reserve"
MIN_SIZE = 64 * 1024
MAX_SIZE = 8 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_ZEROS = bytes(64 * 1024)


def default_size(path: str) -> int:
    """1/16 of the file system the queue lives on, between 64 KiB and 8 MiB."""
    st = os.statvfs(path)
    return max(MIN_SIZE, min(MAX_SIZE, st.f_blocks * st.f_frsize // 16))


def leveldb_sizes(path: str) -> tuple[int, int]:
    """LevelDB's memtable size for a queue at ``path`` and the reserve that covers the
    table reopening writes from it: 1/32 of the file system (256 KiB to 4 MiB), and the
    larger of twice that and ``default_size``."""
    probe = path
    while not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    st = os.statvfs(probe)
    buffer = max(256 * 1024, min(4 << 20, st.f_blocks * st.f_frsize // 32))
    return buffer, max(2 * buffer, default_size(probe))


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Reserve:
    """The reserve file of the queue in ``directory`` (``size`` bytes)."""

    def __init__(self, directory: str, size: int) -> None:
        self.path = os.path.join(directory, NAME)
        self.directory = directory
        self.size = size
        self._mu = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether the reserve is in place (new mail is accepted)."""
        try:
            return os.stat(self.path).st_size >= self.size
        except FileNotFoundError:
            return False

    def ensure(self) -> bool:
        """Make the reserve if the file system has room for it and as much again; True
        if it is in place.  Never raises for a full disk."""
        with self._mu:
            if self.held:
                return True
            if free_bytes(self.directory) < 2 * self.size:
                return False
            tmp = self.path + ".tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
                try:
                    left = self.size
                    while left > 0:
                        left -= os.write(fd, _ZEROS[:min(left, len(_ZEROS))])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if e.errno in _NO_SPACE:
                    return False
                raise
            return True

    def release(self) -> bool:
        """Remove the reserve (its space is then free); True if it was there."""
        with self._mu:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + ".tmp")
            return True
