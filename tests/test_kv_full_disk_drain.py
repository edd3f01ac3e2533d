"""A KV queue (log engine) that filled its own disk with thousands of small messages drains
completely while the disk stays full: every message is claimed, delivered and cleaned up
once, the footprint goes to zero and the disk's space comes back (``LogEngine.reclaim``,
started by the queue once its reserve is spent: ``KvQueue._make_room``).  Before it, an
8 MiB disk of 2 KiB messages drained a few hundred of its 2,600 messages and then
``send_start``/``send_done`` raised ``NoSpaceError``: every state change appends to the
log, and a flush needs room for a table of everything live.

Also killed with SIGKILL in the middle of the drain: reopened on the disk kept full (another
file takes what the drain had freed), the rest drains and no acknowledged delivery comes
back.  Real tmpfs mounts, as ``tests/test_full_disk.py`` (root only).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref import NoSpaceError, Recipient, Schedule
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.reserve import default_size, free_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

DISK = "8m"
BODY_BYTES = 2048


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted after the test."""
    mnt = tempfile.mkdtemp(prefix="queue-ref-drain-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", mnt], check=True)
    try:
        yield Path(mnt)
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)
        os.rmdir(mnt)


def body_of(n: int) -> bytes:
    """Message n's body: 2 KiB that no other message has (and that do not compress)."""
    seed = hashlib.sha256(b"%d" % n).digest()
    return b"".join(hashlib.sha256(seed + bytes([i])).digest()
                    for i in range(BODY_BYTES // 32))


def fill(q: KvQueue) -> dict[str, bytes]:
    """Enqueue small messages until the queue refuses one for a full disk; the bodies of
    those acknowledged, by message id."""
    acked: dict[str, bytes] = {}
    for n in range(100_000):
        body = body_of(n)
        try:
            with q.enqueue("from@example.org") as e:
                e.write(body)
                mid = e.commit([Recipient(f"r{n}@example.net", Schedule(0))])[0].message_id
        except NoSpaceError:
            return acked
        acked[mid] = body
    raise AssertionError("the disk never filled")


def drain(q: KvQueue, bodies: dict[str, bytes]) -> Counter[str]:
    """Deliver and clean up every queued entry; how often each message was delivered."""
    delivered: Counter[str] = Counter()
    for h in list(q.list_queue()):
        f = q.send_start(h)
        assert f is not None
        with q.read_inflight(f) as r:
            assert r.read_all() == bodies[h.message_id]
        done = q.send_done(f)
        assert done is not None
        delivered[h.message_id] += 1
        assert q.cleanup(done)
    return delivered


def test_a_full_disk_of_small_messages_drains_completely(small_disk: Path) -> None:
    root = str(small_disk / "q")
    q = KvQueue.open_log(root)
    try:
        bodies = fill(q)
        assert len(bodies) > 2000  # 8 MiB of 2 KiB messages
        full = free_bytes(root)
        assert full < 2 * default_size(root)  # the disk is full: the reserve is spent
        with pytest.raises(NoSpaceError, match="new mail is refused"):
            q.enqueue("from@example.org")
        delivered = drain(q, bodies)
        assert delivered == Counter(dict.fromkeys(bodies, 1))  # each one, exactly once
        assert q.footprint().objects == 0 and q.footprint().bytes == 0
        assert not list(q.find_inflight()) and not list(q.find_pending_cleanup())
        assert free_bytes(root) > 6 << 20  # the space came back, without a compaction
    finally:
        q.close()
    q = KvQueue.open_log(root)
    try:
        assert q.footprint().objects == 0 and not list(q.list_queue())
        with q.enqueue("from@example.org") as e:  # and the queue takes mail again
            e.write(b"again")
            e.commit([Recipient("again@example.net", Schedule(0))])
        assert q.footprint().objects > 0
    finally:
        q.close()


CHILD = textwrap.dedent("""
    import sys
    from queue_ref.kv.kv_queue import KvQueue
    q = KvQueue.open_log(sys.argv[1])
    print("ready", flush=True)
    for h in list(q.list_queue()):
        f = q.send_start(h)
        done = q.send_done(f)
        print("done", h.message_id, flush=True)  # acknowledged: never delivered again
        q.cleanup(done)
    print("drained", flush=True)
""")


def test_a_drain_killed_midway_goes_on_after_a_reopen_on_the_full_disk(
        small_disk: Path) -> None:
    root = str(small_disk / "q")
    q = KvQueue.open_log(root)
    try:
        bodies = fill(q)
    finally:
        q.close()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    acked: list[str] = []
    with subprocess.Popen([sys.executable, "-c", CHILD, root], stdout=subprocess.PIPE,
                          text=True, env=env) as child:
        assert child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            while len(acked) < len(bodies) // 3:
                line = child.stdout.readline()
                assert line.startswith("done "), line
                acked.append(line.split()[1])
            os.kill(child.pid, signal.SIGKILL)  # somewhere in the middle of the drain
            tail = child.stdout.read()
        finally:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    acked += [line.split()[1] for line in tail.splitlines() if line.startswith("done ")]
    assert "drained" not in tail
    # Keep the disk full: another file takes the room the drain had given back, all but
    # half a reserve.
    ballast = small_disk / "ballast"
    with open(ballast, "wb") as f:
        f.write(bytes(max(0, free_bytes(root) - default_size(root) // 2)))
    q = KvQueue.open_log(root)  # recovery on the full disk
    try:
        with pytest.raises(NoSpaceError, match="new mail is refused"):
            q.enqueue("from@example.org")
        listed = {h.message_id for h in q.list_queue()}
        assert not listed & set(acked)  # no acknowledged delivery comes back
        # Nothing acknowledged was lost: every message is queued again or was delivered,
        # unacknowledged only if its send_done returned as the kill came, before the line.
        assert len(set(bodies) - listed - set(acked)) <= 1
        delivered = drain(q, bodies)
        assert delivered == Counter(dict.fromkeys(listed, 1))
        assert q.footprint().objects == 0 and not list(q.find_inflight())
    finally:
        q.close()
    ballast.unlink()
    q = KvQueue.open_log(root)
    try:
        assert q.footprint().objects == 0
        with q.enqueue("from@example.org") as e:
            e.write(b"again")
            e.commit([Recipient("again@example.net", Schedule(0))])
    finally:
        q.close()
