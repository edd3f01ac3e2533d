"""Spent message files kept for reuse, so that a message costs no new inode and no new blocks.

Creating a file allocates an inode and blocks and deleting it frees them again; with online
discard the free is a device round trip, and on ext4 without a journal each new inode is
found only after skipping every inode freed in the last seconds (``recently_deleted`` in
``ialloc.c``), a scan that grows with the queue's own turnover.  A queue turns over one file
per message, so it keeps up to ``capacity`` spent message files in its own ``tmp/<owner>/``
as ``spare.<n>`` and writes the next messages into them: the same inode and blocks,
overwritten from the start, cut to the new length, and synced before any name publishes
them, exactly as a new file would be (``FsSteps._begin_message``).  RocksDB recycles its
write-ahead logs for the same reason (``recycle_log_file_num``).

Which files become spares (``FsQueue._spare_for``): those of messages with one recipient
(this queue then held the only entry, so no other process can have the file open through
``read_inflight``), a body of at most ``SPARE_MAX_BODY`` bytes, and no MailReader of this
queue open on them.  What holds:

* A spare is never reachable from a link: it is renamed out of ``data/`` only once no entry
  needs the message, and back in only by a commit rename after its new content is durable.
* Spares live under ``tmp/<owner>/``: ``close()`` removes the queue's own, and after a crash
  recovery removes them with the rest of the dead owner's directory.  They are bounded by
  ``capacity`` per open queue and are not counted by ``footprint()``.

The pool itself is memory only; every disk call is the caller's.
"""

from __future__ import annotations

import itertools
import re
import threading

SPARE_RE = re.compile(r"spare\.(?:0|[1-9][0-9]*)\Z")
SPARE_MAX_BODY = 1 << 16  # bodies up to this many bytes leave their file as a spare
DEFAULT_SPARES = 64


class Spares:
    """The spare files of one open queue, in ``directory`` (its ``tmp/<owner>/``).

    Thread-safe.  A name is first ``reserve``d (counted against the capacity while the
    caller renames a file to it), then ``put`` back with the file's size, or None if no
    file has the name; ``take`` hands out the most recently added spare (its blocks are the
    likeliest to be cached) and its size.
    """

    def __init__(self, directory: str, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self._lock = threading.Lock()
        self._free: list[tuple[str, int]] = []
        self._reserved = 0
        self._numbers = itertools.count()

    def take(self) -> tuple[str, int] | None:
        """A spare file's path and size, now the caller's; None if there is none."""
        with self._lock:
            return self._free.pop() if self._free else None

    def reserve(self) -> str | None:
        """A fresh name for a new spare, or None if the pool is full."""
        with self._lock:
            if len(self._free) + self._reserved >= self.capacity:
                return None
            self._reserved += 1
            return f"{self.directory}/spare.{next(self._numbers)}"

    def put(self, path: str, size: int | None) -> None:
        """End a reservation: a file of ``size`` bytes now has the name (None: none has)."""
        with self._lock:
            self._reserved -= 1
            if size is not None:
                self._free.append((path, size))

    def drain(self) -> list[str]:
        """Every usable spare's path, now the caller's (to remove them)."""
        with self._lock:
            out, self._free = self._free, []
            return [path for path, _ in out]

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)
