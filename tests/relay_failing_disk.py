"""Backends for ``queue-ref relay --backend tests.relay_failing_disk:fs`` (or ``:kv_log``)
whose next sync fails with EIO, once, when the file ``<queue>.fail-next-sync`` exists: a
disk that loses a writeback, at a moment the test chooses, under a real relay process.
While ``<queue>.fail-next-open`` exists, the next open fails (and the file goes): the
relay's reopening must try again."""

from __future__ import annotations

import errno
import os

from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import StorageIOError


class FailNextSyncIO(OsIO):
    """The real system calls, except that a sync fails (and the trigger file goes) while
    ``trigger`` exists."""

    def __init__(self, trigger: str) -> None:
        self.trigger = trigger

    def _maybe_fail(self, name: str) -> None:
        try:
            os.unlink(self.trigger)
        except FileNotFoundError:
            return
        raise OSError(errno.EIO, f"{name}: injected EIO (a lost writeback)")

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync")
        super().fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        self._maybe_fail("fsync_dir")
        super().fsync_dir(path)

    def syncfs(self, path: str) -> None:
        self._maybe_fail("syncfs")
        super().syncfs(path)


def trigger_of(path: str) -> str:
    return os.path.abspath(path).rstrip("/") + ".fail-next-sync"


def open_trigger_of(path: str) -> str:
    return os.path.abspath(path).rstrip("/") + ".fail-next-open"


def _fail_open_once(path: str) -> None:
    try:
        os.unlink(open_trigger_of(path))
    except FileNotFoundError:
        return
    raise StorageIOError(f"opening {path}: injected EIO (the disk is not back yet)")


def fs(path: str) -> FsQueue:
    _fail_open_once(path)
    return FsQueue(path, FailNextSyncIO(trigger_of(path)))


def kv_log(path: str) -> KvQueue:
    _fail_open_once(path)
    return KvQueue.open_log(path, FailNextSyncIO(trigger_of(path)))
