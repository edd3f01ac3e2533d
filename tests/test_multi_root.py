"""One queue over several roots (``queue_ref.multi_root``): new mail spread over the roots,
ids that name their root, listings over all of them, and a root whose disk fails taking
no new mail while the other goes on, its mail delivered once it is reopened."""

from __future__ import annotations

import errno
import os
import re
from typing import Any

import pytest

from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.crash_task import explore_task, task_for
from conformance.crashexplore.traced_runs import run_workload
from conformance.crashexplore.workloads import enqueue_call
from queue_ref.fsqueue import FsQueue
from queue_ref.multi_root import MultiRootQueue, _Root, share_a_file_system, split_id
from queue_ref.storage import (
    InvalidInputError,
    MisuseError,
    NoSpaceError,
    QueuedMail,
    Recipient,
    ReopenRequiredError,
    Schedule,
    Storage,
    StorageIOError,
)
from tests.relay_failing_disk import FailNextSyncIO, trigger_of
from tests.test_fsqueue_faults import FaultyIO


def put(q: Storage, i: int, domain: str = "example.org") -> list[QueuedMail]:
    with q.enqueue("sender@example.com") as enq:
        enq.write(b"Subject: %d\r\n\r\nbody %d\r\n" % (i, i))
        return enq.commit([Recipient(f"user{i}@{domain}", Schedule(0))])


def deliver_all(q: Storage) -> list[bytes]:
    """Claim, read, send_done and clean up every queued entry: the bodies read."""
    bodies = []
    for m in list(q.list_queue()):
        f = q.send_start(m)
        assert f is not None
        with q.read_inflight(f) as r:
            bodies.append(r.read_all())
        done = q.send_done(f)
        assert done is not None and q.cleanup(done)
    return bodies


def data_files(root: str) -> list[str]:
    """Message files in a root's data/ (read with os: a backdoor)."""
    return sorted(os.listdir(os.path.join(root, "data")))


def test_mail_is_spread_and_every_listing_sees_both_roots(tmp_path: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    q = MultiRootQueue.open_fs([b, a])  # ordered by path: a is r0 whatever the order
    assert q.root_names == [a, b]
    # one file system under both: a failed syncfs of one would cover the other's changes
    assert share_a_file_system([a, b]) and not share_a_file_system([a, "/proc/nothing"])
    assert [s.sync_mode for s in q.root_stores()] == ["fsync", "fsync"]  # type: ignore[attr-defined]
    ids = [put(q, i)[0] for i in range(6)]
    assert [m.entry_id[:3] for m in ids] == ["r0-", "r1-"] * 3
    assert len(data_files(a)) == len(data_files(b)) == 3
    for m in ids:  # the root's own id follows the prefix
        k, own = split_id(m.entry_id, 2) or (-1, "")
        assert own.rpartition(".")[0] in data_files([a, b][k])
    listed = [m.entry_id for m in q.list_queue()]
    assert sorted(listed) == sorted(m.entry_id for m in ids)
    assert [m.entry_id for m in q.list_domain("EXAMPLE.org")] == listed
    held = q.hold(next(m for m in q.list_queue() if m.entry_id.startswith("r1-")))
    assert held is not None and [h.entry_id for h in q.list_held()] == [held.entry_id]
    scanned = list(q.scan_queue())  # each root's scan in turn, with the root's prefix
    assert sorted(h.entry_id for h in scanned) == sorted(m.entry_id for m in ids)
    assert [h.entry_id[:3] for h in scanned] == ["r0-"] * 3 + ["r1-"] * 3
    assert [h.entry_id for h in scanned if type(h).__name__ == "HeldMail"] == [held.entry_id]
    assert scanned[-1].entry_id == held.entry_id  # r1's queued, then its held
    f = q.send_start(next(q.list_queue()))
    assert f is not None
    assert [e.entry_id for e in q.inflight_entries()] == [f.entry_id]
    with q.read_inflight(f) as r:
        assert r.meta.entry_id == f.entry_id and r.meta.message_id == f.message_id
    insp = q.inspect_entry(held)
    assert insp is not None and insp.meta.entry_id == held.entry_id
    insp.close()
    q.close()
    q = MultiRootQueue.open_fs([a, b])  # reopening requeues the inflight entry
    assert q.last_recovery is not None and q.last_recovery.requeued == 1
    assert sorted(m.entry_id for m in q.list_queue()) == sorted(
        m.entry_id for m in ids if m.entry_id != held.entry_id)
    released = q.release(next(q.list_held()))
    assert released is not None
    assert len(deliver_all(q)) == 6
    assert q.footprint().objects == 0
    q.close()


def test_new_mail_goes_to_the_least_busy_root(tmp_path: Any) -> None:
    q = MultiRootQueue.open_fs([str(tmp_path / "a"), str(tmp_path / "b")])
    slow = q.enqueue("sender@example.com")  # r0 is busy while it is open
    slow.write(b"a body still arriving")
    assert put(q, 1)[0].entry_id.startswith("r1-")
    assert put(q, 2)[0].entry_id.startswith("r1-")
    assert slow.commit([Recipient("user0@example.org", Schedule(0))])[0].entry_id.startswith(
        "r0-")
    q.close()


def test_a_root_whose_sync_failed_takes_no_mail_until_reopened(tmp_path: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def opener(root: str) -> Any:
        return lambda: FsQueue(root, FailNextSyncIO(trigger_of(root)), sync="syncfs")

    q = MultiRootQueue({a: opener(a), b: opener(b)})
    before = [put(q, i)[0] for i in range(2)]  # acknowledged: one on each root
    open(trigger_of(a), "w").close()  # a's next sync fails
    with pytest.raises(ReopenRequiredError):
        put(q, 2)
    assert q.healthy() == [False, True]
    after = [put(q, i)[0] for i in range(3, 7)]
    assert all(m.entry_id.startswith("r1-") for m in after)
    on_a = next(m for m in q.list_queue() if m.entry_id.startswith("r0-"))
    with pytest.raises(ReopenRequiredError) as caught:  # its mail waits for the reopen
        q.send_start(on_a)
    assert caught.value.handle is not None and caught.value.handle.entry_id == on_a.entry_id
    assert q.reopen_failed() == [a]
    assert q.healthy() == [True, True]
    with pytest.raises(Exception, match="reopened"):  # handles of the old opening are void
        q.send_start(caught.value.handle)  # type: ignore[arg-type]
    acknowledged = {m.entry_id for m in before + after}
    assert acknowledged <= {m.entry_id for m in q.list_queue()}
    bodies = set(deliver_all(q))  # the failed commit may be there or not, whole
    assert {b"Subject: %d\r\n\r\nbody %d\r\n" % (i, i) for i in (0, 1, 3, 4, 5, 6)} <= bodies
    assert q.footprint().objects == 0
    q.close()


def test_a_full_root_takes_no_mail_for_a_while_and_none_healthy_raises(tmp_path: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ios = {a: FaultyIO(), b: FaultyIO()}
    now = [0.0]
    q = MultiRootQueue({r: (lambda r=r: FsQueue(r, ios[r])) for r in (a, b)},
                       retry_after=30.0, clock=lambda: now[0])
    ios[a].faults[("write", "")] = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(NoSpaceError):
        put(q, 0)
    assert [put(q, i)[0].entry_id[:3] for i in (1, 2)] == ["r1-", "r1-"]
    now[0] = 31.0  # a is tried again, and fails again: b goes on
    with pytest.raises(NoSpaceError):
        put(q, 3)
    assert put(q, 4)[0].entry_id.startswith("r1-")
    ios[b].faults[("write", "")] = OSError(errno.EIO, "Input/output error")
    with pytest.raises(StorageIOError) as caught:  # neither is healthy: the last error
        put(q, 5)
    assert not isinstance(caught.value, NoSpaceError)
    with pytest.raises(StorageIOError, match=f"no root .* takes new mail.*{b}") as caught:
        put(q, 5)  # neither is tried: the error of the one that failed last, b
    assert not isinstance(caught.value, NoSpaceError)
    ios[a].faults.clear()
    ios[b].faults.clear()
    now[0] = 100.0
    assert sorted(m.entry_id[:3] for m in (put(q, 6)[0], put(q, 7)[0])) == ["r0-", "r1-"]
    assert len(deliver_all(q)) == 5  # 1, 2, 4, 6, 7: nothing acknowledged is lost
    q.close()


def test_bad_input_and_a_root_that_cannot_open(tmp_path: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with pytest.raises(InvalidInputError, match="non-empty list"):
        MultiRootQueue.open_fs([])
    with pytest.raises(InvalidInputError, match="given twice"):
        MultiRootQueue.open_fs([a, a + "/"])
    with pytest.raises(InvalidInputError, match="retry_after"):
        MultiRootQueue.open_fs([a], retry_after=-1)
    (tmp_path / "file").write_bytes(b"not a directory")
    with pytest.raises(StorageIOError, match="file"):
        MultiRootQueue.open_fs([a, str(tmp_path / "file")])
    FsQueue(a).close()  # a was closed again: its owner lock is free
    q = MultiRootQueue.open_fs([a, b])
    other = FsQueue(str(tmp_path / "c"))
    with pytest.raises(MisuseError):
        q.send_start(put(other, 0)[0])
    with pytest.raises(MisuseError):  # a root's own handle is not this queue's
        q.send_start(put(q.root_stores()[0], 1)[0])
    assert split_id("r1-abc.0", 2) == (1, "abc.0")
    assert [split_id(x, 2) for x in ("r2-abc.0", "r01-abc", "r-abc", "abc.0", "r1-")] == [
        None] * 5
    other.close()
    q.close()


def test_a_crash_inside_the_second_root_keeps_the_first_roots_mail() -> None:
    """Crash exploration of ``fs-two-roots``: message 0 is committed in root a, then
    every crash point of message 1's enqueue, in root b, under every model (and inside
    recovery, and with each fsync failed by EIO): recovery of both roots keeps message 0
    and message 1 whole or not at all."""
    wl = (enqueue_call(0, 1), enqueue_call(1, 2))
    run = run_workload(resolve("fs-two-roots"), wl)
    assert not run.crashed and run.error is None
    calls = [e.short() for e in run.events if e.mutating]  # "#7 rename(b/queue/..., ...)"
    for i, root in ((0, "a/"), (1, "b/")):  # every path a call of message i names is root's
        paths = [p for c in calls[run.op_starts[i]:run.op_ends[i]]
                 for p in re.findall(r"[(, ]([ab]/[^,)]*)", c)]
        assert paths and all(p.startswith(root) for p in paths), (i, paths)
    r = explore_task(task_for("fs-two-roots", wl, ("process-kill", "weak", "ext4-ordered"),
                              recovery_sample=1))
    assert r.points > 20 and r.eio_points > 0 and not r.errors
    assert not r.failures, [f"{f.scenario}: {f.violations}" for f in r.failures[:5]]


def test_a_part_serves_one_root_under_the_ids_it_has_in_the_whole_queue(tmp_path: Any) -> None:
    """``part=k``: one process of a relay whose backend processes cannot share serves
    root k alone.  Its ids are those the whole queue gives that root's mail (``r<k>-``,
    as ``mailq`` over every root shows them); the other root is not opened, so another
    process can hold it at the same time (the KV queue's store is one process's); a
    handle of another root is refused, not served from the wrong store."""
    from queue_ref.kv.kv_queue import KvQueue

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    whole = MultiRootQueue.over(roots, KvQueue.open_log)
    put(whole, 0)
    put(whole, 1)  # one message in each root (round robin)
    ids = sorted(m.entry_id for m in whole.list_queue())
    whole.close()
    assert [i[:3] for i in ids] == ["r0-", "r1-"]

    second = MultiRootQueue.over(roots, KvQueue.open_log, part=1)
    first = MultiRootQueue.over(roots, KvQueue.open_log, part=0)  # both open at once
    try:
        assert second.root_names == [roots[1]] and first.root_names == [roots[0]]
        assert [m.entry_id for m in second.list_queue()] == [ids[1]]
        assert [m.entry_id for m in first.list_queue()] == [ids[0]]
        put(second, 2)  # new mail in a part goes to its root, under its prefix
        assert all(m.entry_id.startswith("r1-") for m in second.list_queue())
        assert len(list(second.list_queue())) == 2
        # a handle naming root 0, issued by the part serving root 1 (forged: no call makes one)
        inner = next(iter(first.root_stores()[0].list_queue()))
        forged = second._wrap(_Root(0, roots[0], lambda: first), inner)
        with pytest.raises(InvalidInputError, match="which this queue does not serve"):
            second.send_start(forged)
        assert len(deliver_all(second)) == 2 and deliver_all(first) == [
            b"Subject: 0\r\n\r\nbody 0\r\n"]
    finally:
        second.close()
        first.close()
    for bad in (2, -1, True, "0"):
        with pytest.raises(InvalidInputError, match="part must be"):
            MultiRootQueue.over(roots, KvQueue.open_log, part=bad)  # type: ignore[arg-type]
