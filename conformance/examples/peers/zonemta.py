"""ZoneMTA's LevelDB era: seed 000's key layout, every write ``sync: false``.

This is the project's own KV queue (``queue_ref.kv.kv_queue.KvQueue``, the same key layout
as ZoneMTA's wiki describes) over the Python log engine, with one change: the engine
ignores ``sync=True`` and appends every batch to its log without an fsync, as ZoneMTA
passed ``{sync: false}`` to every LevelDB write.

What the suite shows: a power cut loses acknowledged messages (C1) and can bring back
sent ones (C3): the log records that said "committed" or "done" were never made durable.
In this re-creation even a process kill loses them, because the Python log engine keeps
unsynced records in the process's memory until a synced write comes (real LevelDB hands
each record to the kernel, so there only a power cut loses them).  ZoneMTA's README
answered corruption with "start with an empty queue"; the fix is a synced write (or a
group-committed one) before acknowledging.
"""

from __future__ import annotations

from queue_ref.io import IO
from queue_ref.kv.base import WriteBatch
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.logengine import LogEngine


class UnsyncedLogEngine(LogEngine):
    """The log engine with every write unsynced, whatever the caller asks."""

    def write(self, batch: WriteBatch, *, sync: bool = True) -> None:
        super().write(batch, sync=False)


def factory(root: str, io: IO | None = None) -> KvQueue:
    kv = UnsyncedLogEngine(root, io)
    try:
        return KvQueue(kv)
    except BaseException:
        kv.close()
        raise
