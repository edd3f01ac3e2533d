"""The ordered key-value interface the KV queue is written against.

Two engines implement it: ``queue_ref.kv.logengine`` (log-structured, in Python, every byte
through the I/O seam, so it can be crashed at every call) and ``queue_ref.kv.leveldb``
(real LevelDB through plyvel).

Guarantees an engine gives:

* ``write(batch)`` is atomic: after a crash either every operation of the batch is
  visible or none is.
* With ``sync=True`` (the default) a write is durable when it returns; concurrent
  synced writers may share one fsync (group commit), and none returns before the fsync
  that covers it.
* With ``sync=False`` a write is visible when it returns but promises nothing after a
  crash: a power cut, or for the log engine (which keeps up to 64 KiB of them in memory
  until the next write to its log) even a process kill, may lose it.  Whether a synced
  write also makes the unsynced writes before it durable depends on the engine (see
  ``queue_ref.kv.core``: the log engine does, LevelDB nearly does).
* ``iterate`` yields keys in ascending bytewise order, as of a consistent snapshot.
* After ``close`` every call raises ``queue_ref.storage.ClosedError``.
* An I/O failure raises ``OSError``; after a failed synced write the engine refuses
  further writes until reopened (its log may end in a torn record that recovery drops).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class WriteBatch:
    """An ordered list of puts and deletes applied atomically."""

    ops: list[tuple[bytes, bytes | None]] = field(default_factory=list)

    def put(self, key: bytes, value: bytes) -> None:
        self.ops.append((bytes(key), bytes(value)))

    def delete(self, key: bytes) -> None:
        self.ops.append((bytes(key), None))

    def __len__(self) -> int:
        return len(self.ops)


class KV(abc.ABC):
    #: Whether deleting keys works while the disk is full (``Limits.drains_full_disk``).
    drains_full_disk = True
    #: Free space the engine's own rewrites (compactions) may need, up to as much as it
    #: holds: new mail is refused while less than the smaller of the two is free.
    #: 0: none (such an engine has no ``disk_bytes``).
    compaction_headroom = 0

    def disk_bytes(self) -> int:
        """The bytes of the engine's files (engines with a ``compaction_headroom``)."""
        raise NotImplementedError

    @abc.abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, or None."""

    @abc.abstractmethod
    def write(self, batch: WriteBatch, *, sync: bool = True) -> None:
        """Apply the batch atomically; durable on return when ``sync``."""

    @abc.abstractmethod
    def iterate(
        self, start: bytes = b"", stop: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Pairs with ``start <= key < stop`` (no upper bound if None), ascending."""

    def spill(self) -> None:  # noqa: B027 (a hint: doing nothing is a right answer)
        """Told by a writer streaming in a body too big to die young in memory (one past
        ``queue_ref.kv.core.SPILL_AFTER`` bytes), after each of its batches: hold no more
        than a small write buffer in memory now.  A hint; after it (or a failure of it)
        every write stays as visible and as durable as it was.  The default does nothing:
        an engine whose write buffer is small anyway (LevelDB's 4 MiB) has none to
        shrink."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush nothing more, release files; idempotent."""

    def put(self, key: bytes, value: bytes, *, sync: bool = True) -> None:
        b = WriteBatch()
        b.put(key, value)
        self.write(b, sync=sync)

    def delete(self, key: bytes, *, sync: bool = True) -> None:
        b = WriteBatch()
        b.delete(key)
        self.write(b, sync=sync)

    @property
    def failed(self) -> BaseException | None:
        """The failed sync after which the engine refuses writes until reopened, if any
        (engines that never refuse keep None)."""
        return None

    def left_nothing(self, error: OSError) -> bool:
        """Whether a ``write`` that raised ``error`` is known to have left nothing in the
        store (so the caller may undo what its earlier, unsynced writes stored).  False
        unless the engine can tell: a failed write may be in the log or not, and
        recovery decides."""
        return False

    @abc.abstractmethod
    def disk_usage(self) -> int:
        """Bytes the engine's files take on disk (for the drain-to-zero check)."""
