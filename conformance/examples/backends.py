"""Factories of the project's own backends, in the form ``queue-ref certify`` takes.

    queue-ref certify conformance.examples.backends:fs
    queue-ref certify conformance.examples.backends:fs_fsync
    queue-ref certify conformance.examples.backends:fs_two_roots
    queue-ref certify conformance.examples.backends:kv_log
    queue-ref certify conformance.examples.backends:kv_leveldb

Opened through an I/O seam (crash exploration, I/O faults), the filesystem queue gets
owner tokens and message ids derived from what is on disk
(``conformance.crashexplore.explored_backends``), so that every rerun of a workload makes the same
calls; opened without one it is the plain ``FsQueue``.
"""

from __future__ import annotations

import os

from queue_ref.io import IO
from queue_ref.storage import Storage


def fs(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``queue_ref.fsqueue.FsQueue``)."""
    if io is None:
        from queue_ref.fsqueue import FsQueue

        return FsQueue(root)
    from conformance.crashexplore.explored_backends import open_fs

    return open_fs(root, io)


def fs_fsync(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue in ``fsync`` mode (files fsynced by their writers, directory
    fsyncs shared) rather than its default."""
    if io is None:
        from queue_ref.fsqueue import FsQueue

        return FsQueue(root, sync="fsync")
    from conformance.crashexplore.explored_backends import open_fs_mode

    return open_fs_mode("fsync")(root, io)


def fs_two_roots(root: str, io: IO | None = None) -> Storage:
    """One queue over two roots (``queue_ref.multi_root.MultiRootQueue``): the filesystem
    queue in ``root/a`` and in ``root/b``, new mail spread between them."""
    if io is None:
        from conformance.crashexplore.explored_backends import make_dir
        from queue_ref.io import OsIO
        from queue_ref.multi_root import MultiRootQueue

        make_dir(root, OsIO())
        return MultiRootQueue.open_fs([os.path.join(root, "a"), os.path.join(root, "b")])
    from conformance.crashexplore.explored_backends import open_fs_two_roots

    return open_fs_two_roots(root, io)


def kv_log(root: str, io: IO | None = None) -> Storage:
    """The KV queue over the Python log engine (every byte through the seam)."""
    from queue_ref.kv.kv_queue import KvQueue

    return KvQueue.open_log(root, io)


def kv_leveldb(root: str) -> Storage:
    """The KV queue over real LevelDB (plyvel); no seam, so crash-tested by killing."""
    from queue_ref.kv.kv_queue import KvQueue

    return KvQueue.open_leveldb(root)
