"""FsQueue's two sync modes: what each one asks of the disk, and group commit under load.

``syncfs`` shares one syncfs per round between every caller; ``fsync`` fsyncs each file in
its writer's thread and shares directory fsyncs.  The counts below are read off a counting
seam (real calls go through), so they say exactly which durability calls a lifecycle makes.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_queue import default_sync_mode
from queue_ref.io import OsIO, syncfs_reports_errors
from queue_ref.storage import Footprint, InvalidInputError, Recipient, Schedule
from tests.test_fsqueue_support import put

MODES = ["syncfs", "fsync"]
SYNCS = ("fsync", "fdatasync", "fsync_dir", "syncfs")


class CountingIO(OsIO):
    """Counts the calls of a lifecycle that change, sync or open files (``COUNTED``)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1


COUNTED = ("fsync", "fsync_dir", "syncfs", "open_create", "open_read", "write", "ftruncate",
           "fsize", "close", "rename", "unlink", "symlink", "link")  # symlink: none made


def _counting(name: str) -> Any:
    def call(self: CountingIO, *args: Any, **kw: Any) -> Any:
        self._count(name)
        return getattr(OsIO, name)(self, *args, **kw)

    call.__name__ = name
    return call


for _name in COUNTED:
    setattr(CountingIO, _name, _counting(_name))


def lifecycle(q: FsQueue, n: int = 1) -> None:
    for h in put(q, n=n):
        i = q.send_start(h)
        assert i is not None
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)


def test_the_default_mode_is_syncfs_where_it_reports_errors(tmp_path: Any) -> None:
    q = FsQueue(str(tmp_path / "q"))
    try:
        assert q.sync_mode == default_sync_mode()
        assert q.sync_mode == ("syncfs" if syncfs_reports_errors() else "fsync")
    finally:
        q.close()


@pytest.mark.parametrize("bad", ["", "sync", "SYNCFS", None, 1])
def test_an_unknown_sync_mode_is_refused_before_touching_the_disk(tmp_path: Any,
                                                                  bad: Any) -> None:
    root = str(tmp_path / "q")
    if bad is None:
        FsQueue(root, sync=bad).close()  # None: the default
        return
    with pytest.raises(InvalidInputError, match="sync"):
        FsQueue(root, sync=bad)
    assert not os.path.exists(root)


def test_syncfs_mode_lifecycle_is_three_shared_syncs_and_twelve_calls(tmp_path: Any) -> None:
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io, sync="syncfs")
    try:
        assert io.calls["open_create"] == 1  # the new queue's queue-ref.format
        io.calls.clear()
        lifecycle(q)  # a new message file, kept as a spare by its cleanup
        assert io.calls["open_create"] == 2  # the message file and the domain's index anchor
        assert io.calls["unlink"] == 2  # index + cleanup/ link
        assert q.spare_files == 1
        io.calls.clear()
        lifecycle(q)  # written into the spare: the same calls every time from now on
        assert io.calls == collections.Counter({
            "syncfs": 3,
            "open_create": 1, "write": 1, "close": 1,  # the spare, rewritten
            # the queue/ link, a hard link to the message file (a name, no inode of its
            # own), and the domain index link, a name of the domain's anchor
            "link": 2,
            "rename": 4,  # commit, send_start, send_done, cleanup (data/ to a spare name)
            "open_read": 1,  # send_start: the entry has no schedule record
            "unlink": 2})  # the domain index link and the cleanup/ link
        assert q.spare_files == 1
    finally:
        q.close()


def test_spares_off_makes_each_message_a_new_file(tmp_path: Any) -> None:
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io, sync="syncfs", spares=0)
    try:
        lifecycle(q)
        io.calls.clear()
        lifecycle(q)
        assert io.calls == collections.Counter(
            {"syncfs": 3, "open_create": 1, "write": 1, "close": 1, "link": 2, "rename": 3,
             "open_read": 1, "unlink": 3})
        assert q.spare_files == 0
    finally:
        q.close()


def test_fsync_mode_fsyncs_the_file_and_shares_directory_fsyncs(tmp_path: Any) -> None:
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io, sync="fsync")
    try:
        lifecycle(q)
        io.calls.clear()
        lifecycle(q)
        # the message file; then data/, tmp/<owner>/ and queue/ at commit; then
        # cleanup/ and inflight/ at send_done
        assert {k: io.calls[k] for k in SYNCS if io.calls[k]} == {"fsync": 1, "fsync_dir": 5}
    finally:
        q.close()


@pytest.mark.parametrize("mode", MODES)
def test_two_recipient_commit_syncs_the_hard_links_before_the_commit_rename(
        tmp_path: Any, mode: str) -> None:
    order: list[str] = []

    class Recording(CountingIO):
        def _count(self, name: str) -> None:
            order.append(name)

    q = FsQueue(str(tmp_path / "q"), Recording(), sync=mode)
    try:
        order.clear()
        put(q, n=2)
        commit_rename = max(i for i, n in enumerate(order) if n == "rename")
        assert "symlink" not in order  # every name is a hard link: no inode per entry
        last_link = max(i for i, n in enumerate(order) if n == "link")
        synced = {"syncfs"} if mode == "syncfs" else {"fsync_dir"}
        assert any(order[i] in synced for i in range(last_link, commit_rename))
        assert order[-1] in synced  # and the commit itself, before commit returns
    finally:
        q.close()


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_producers_share_rounds_and_lose_nothing(tmp_path: Any, mode: str) -> None:
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io, sync=mode)
    threads, per = 12, 15
    bodies: dict[str, bytes] = {}
    lock = threading.Lock()
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def producer(k: int) -> None:
        try:
            start.wait()
            for j in range(per):
                body = f"message {k}.{j}\r\n".encode() * (k + 1)
                with q.enqueue(f"p{k}@example.org") as enq:
                    enq.write(body)
                    (h,) = enq.commit([Recipient(f"r{k}.{j}@example.net", Schedule(j))])
                with lock:
                    bodies[h.entry_id] = body
                i = q.send_start(h)
                assert i is not None
                with q.read_inflight(i) as r:
                    assert r.read_all() == body
                p = q.send_done(i)
                assert p is not None and q.cleanup(p)
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        before = q._group.requests
        ts = [threading.Thread(target=producer, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        assert len(bodies) == threads * per
        # one wait for the commit (syncfs: its two rounds pipelined; fsync: the file is
        # fsynced in its thread) and one for send_done
        assert q._group.requests - before == 2 * threads * per
        assert q._group.rounds < q._group.requests  # shared
        assert q.footprint() == Footprint(0, 0) and list(q.list_queue()) == []
    finally:
        q.close()


def test_a_failed_round_fails_every_later_sync(tmp_path) -> None:
    """fsyncgate: a change made before a failed sync may be gone although a later sync
    succeeds, so after a failed round no caller is told its change is durable."""
    import errno as _errno

    from queue_ref.fsqueue.groupsync import GroupSync
    from queue_ref.io import OsIO

    class FailsOnce(OsIO):
        calls = 0

        def syncfs(self, path: str) -> None:
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                raise OSError(_errno.EIO, "injected")
            super().syncfs(path)

        def fsync_dir(self, path: str) -> None:
            self.syncfs(path)

    for mode in ("syncfs", "fsync"):
        FailsOnce.calls = 0
        g = GroupSync(FailsOnce(), mode, str(tmp_path))
        with pytest.raises(OSError, match="injected"):
            g.sync([str(tmp_path)])
        for _ in range(2):  # the disk now answers, the group does not believe it
            with pytest.raises(OSError, match="injected"):
                g.sync([str(tmp_path)])
        assert FailsOnce.calls == 1
