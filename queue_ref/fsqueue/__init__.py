"""The filesystem queue backend (seed 001's layout, crash-safe under power loss).

``FsQueue(root, io=None, *, recover=True, owner=None, clock=time.time_ns)``; the protocol is
documented in ``steps.py``, recovery in ``fs_recovery.py``, names and paths in ``layout.py``.
"""

from queue_ref.fsqueue.fs_queue import FsQueue

__all__ = ["FsQueue"]
