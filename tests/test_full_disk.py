"""A full disk, on a real size-limited tmpfs: every backend raises NoSpaceError, loses no
acknowledged message, and goes on without a restart once space is freed (with these
compressible bodies LevelDB's compactions find room too: with incompressible ones it may
need a restart, as it declares; see the certifier's full-disk check); the filesystem
queue and the KV queue on its log engine also drain and reopen while the disk is still
full (the KV queue's reserve, and its engine giving back what delivered mail took: many
small messages, in ``test_kv_full_disk_drain.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from queue_ref import NoSpaceError, Recipient, Schedule, Storage
from queue_ref.fsqueue import FsQueue
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.reserve import default_size, free_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

BODY = bytes(range(256)) * 80  # 20 KiB


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    mnt = tempfile.mkdtemp(prefix="queue-ref-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    try:
        yield Path(mnt)
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)
        os.rmdir(mnt)


OPENERS: dict[str, Callable[[str], Storage]] = {
    "fs": FsQueue, "kv-log": KvQueue.open_log, "kv-leveldb": KvQueue.open_leveldb,
}


def enqueue_until_full(q: Storage, limit: int = 1000) -> list[str]:
    """Enqueue 20 KiB messages until NoSpaceError; the acknowledged message ids."""
    acked = []
    for i in range(limit):
        try:
            with q.enqueue("from@example.org") as e:
                e.write(BODY)
                acked.append(e.commit([Recipient(f"r{i}@example.net", Schedule(0))])[0]
                             .message_id)
        except NoSpaceError:
            return acked
    raise AssertionError("the disk never filled")


def deliver(q: Storage, count: int | None = None) -> list[str]:
    out = []
    for h in list(q.list_queue())[:count]:
        f = q.send_start(h)
        assert f is not None
        with q.read_inflight(f) as r:
            assert r.read_all() == BODY
        done = q.send_done(f)
        assert done is not None and q.cleanup(done)
        out.append(h.message_id)
    return out


@pytest.mark.parametrize("backend", list(OPENERS))
def test_full_disk_then_space_freed_goes_on_without_a_restart(
    small_disk: Path, backend: str
) -> None:
    ballast = small_disk / "ballast"
    ballast.write_bytes(bytes(1 << 20))  # someone else's file takes a quarter of the disk
    q = OPENERS[backend](str(small_disk / "q"))
    try:
        acked = enqueue_until_full(q)
        assert len(acked) > 10
        ballast.unlink()  # the operator frees space
        more: list[str] = []
        with q.enqueue("from@example.org") as e:  # no restart: new mail is accepted again
            e.write(BODY)
            more.append(e.commit([Recipient("late@example.net", Schedule(0))])[0].message_id)
        assert sorted(deliver(q)) == sorted(acked + more)  # nothing acknowledged was lost
    finally:
        q.close()


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_a_full_disk_drains_and_reopens_while_still_full(small_disk: Path, backend: str) -> None:
    root = str(small_disk / "q")
    q = OPENERS[backend](root)
    acked = enqueue_until_full(q)
    first = deliver(q, len(acked) // 2)  # send_done and cleanup on a full disk
    q.close()
    if backend == "kv-log":
        # Draining gave back the room of what it delivered (``LogEngine.reclaim``): another
        # file takes it again, all but half a reserve, so the disk is still full.
        with open(small_disk / "ballast", "wb") as f:
            f.write(bytes(max(0, free_bytes(root) - default_size(root) // 2)))
    q = OPENERS[backend](root)  # reopening (recovery) on a full disk
    try:
        if backend == "kv-log":
            with pytest.raises(NoSpaceError, match="new mail is refused"):
                q.enqueue("from@example.org")
        rest = deliver(q)
        assert sorted(first + rest) == sorted(acked)
        assert q.footprint().objects == 0
        with contextlib.suppress(FileNotFoundError):
            (small_disk / "ballast").unlink()
        with q.enqueue("from@example.org") as e:  # space came back: mail is accepted
            e.write(BODY)
            e.commit([Recipient("again@example.net", Schedule(0))])
    finally:
        q.close()
