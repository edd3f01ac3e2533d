"""FsQueue operations: the exact directory tree before and after each, and the lifecycle."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.storage import (
    Capability,
    Footprint,
    InflightMail,
    QueuedMail,
    Recipient,
    Schedule,
)
from tests.test_fsqueue_support import EMPTY, put, rcpts, tree


@pytest.fixture
def q(tmp_path: str) -> Iterator[FsQueue]:
    store = FsQueue(str(tmp_path / "q"))
    yield store
    store.close()


def t(q: FsQueue) -> list[str]:
    return tree(q.root, [q.owner])


MESSAGE = ["data/M0/", "data/M0/body", "data/M0/envelope", "data/M0/rcpts/"]


def with_(*lines: str, base: list[str] = EMPTY) -> list[str]:
    return sorted(base + list(lines))


def test_open_creates_the_layout_and_declares_capabilities(q: FsQueue) -> None:
    assert t(q) == EMPTY
    owners = sorted(os.listdir(os.path.join(q.root, "owners")))
    assert owners == sorted(["gate.lock", f"{q.owner}.lock"])
    assert q.capabilities == {Capability.GROUP_COMMIT, Capability.STREAMING_BODIES,
                              Capability.MULTI_PROCESS, Capability.IO_SEAM}
    assert q.footprint() == Footprint(0, 0)


def test_enqueue_tree_while_building_and_after_commit(q: FsQueue) -> None:
    enq = q.enqueue("a@b")
    assert t(q) == EMPTY  # nothing before the first write
    enq.write(b"hello")
    assert t(q) == with_("tmp/O0/M0/", "tmp/O0/M0/body", "tmp/O0/M0/rcpts/")
    assert list(q.list_queue()) == []
    handles = enq.commit(rcpts(2))
    assert [h.entry_id.split(".")[1] for h in handles] == ["0", "1"]
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
                         "queue/M0.0 -> ../data/M0/rcpts/0",
                         "queue/M0.1 -> ../data/M0/rcpts/1")
    assert q.footprint().objects == 6  # dir, body, envelope, rcpts/, two rcpts files
    assert q.footprint().bytes > 5


def test_abort_removes_everything(q: FsQueue) -> None:
    with q.enqueue("a@b") as enq:
        enq.write(b"x" * 100)
    assert t(q) == EMPTY
    enq.abort()  # idempotent
    assert q.footprint() == Footprint(0, 0)


def test_send_start_moves_the_link_to_inflight_with_our_owner(q: FsQueue) -> None:
    h = put(q)
    i = q.send_start(h[0])
    assert isinstance(i, InflightMail) and i.schedule == h[0].schedule
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
                         "inflight/M0.0@O0 -> ../data/M0/rcpts/0",
                         "queue/M0.1 -> ../data/M0/rcpts/1")


def test_reschedule_writes_the_record_and_leaves_the_link_queued(q: FsQueue) -> None:
    h = put(q)
    r = q.reschedule(h[1], Schedule(500, 3))
    assert isinstance(r, QueuedMail) and r.schedule == Schedule(500, 3)
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
                         "queue/M0.0 -> ../data/M0/rcpts/0",
                         "queue/M0.1 -> ../data/M0/rcpts/1")
    assert os.path.getsize(os.path.join(q.root, "data", h[1].message_id, "rcpts", "1")) > 0
    assert os.path.getsize(os.path.join(q.root, "data", h[1].message_id, "rcpts", "0")) == 0
    assert [m.schedule for m in q.list_queue()] == [Schedule(0), Schedule(500, 3)]


def test_send_cancel_writes_the_schedule_and_requeues(q: FsQueue) -> None:
    h = put(q)
    i = q.send_start(h[0])
    assert i is not None
    back = q.send_cancel(i, Schedule(900, 1))
    assert back is not None and back.schedule == Schedule(900, 1)
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
                         "queue/M0.0 -> ../data/M0/rcpts/0",
                         "queue/M0.1 -> ../data/M0/rcpts/1")
    assert {m.entry_id: m.schedule for m in q.list_queue()}[h[0].entry_id] == Schedule(900, 1)


def test_send_done_moves_to_cleanup_and_cleanup_releases_the_entry(q: FsQueue) -> None:
    h = put(q)
    i = q.send_start(h[0])
    assert i is not None
    p = q.send_done(i)
    assert p is not None
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
                         "cleanup/M0.0 -> ../data/M0/rcpts/0",
                         "queue/M0.1 -> ../data/M0/rcpts/1")
    assert [c.entry_id for c in q.find_pending_cleanup()] == [h[0].entry_id]
    assert q.cleanup(p) is True
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/1", "queue/M0.1 -> ../data/M0/rcpts/1")


def test_drop_then_cleanup_of_the_last_entry_removes_the_message(q: FsQueue) -> None:
    h = put(q, n=1)
    p = q.drop(h[0])
    assert p is not None
    assert t(q) == with_(*MESSAGE, "data/M0/rcpts/0", "cleanup/M0.0 -> ../data/M0/rcpts/0")
    assert q.cleanup(p) is True
    assert t(q) == EMPTY
    assert q.footprint() == Footprint(0, 0)


def test_vanished_entries_return_none_and_change_nothing(q: FsQueue) -> None:
    h = put(q, n=1)
    others = [next(iter(q.list_queue())) for _ in range(3)]  # more live handles, same entry
    i = q.send_start(h[0])
    assert i is not None
    before = t(q)
    assert q.send_start(others[0]) is None
    assert q.reschedule(others[1], Schedule(1)) is None
    assert q.drop(others[2]) is None
    assert t(q) == before
    p = q.send_done(i)
    assert p is not None
    dup = next(iter(q.find_pending_cleanup()))
    assert q.cleanup(p) is True
    assert q.cleanup(dup) is False
    assert t(q) == EMPTY


def test_full_lifecycle_of_several_messages(q: FsQueue) -> None:
    bodies = [b"one", b"two" * 1000, b""]
    for k, body in enumerate(bodies):
        with q.enqueue(f"s{k}@x", {"BODY": "8BITMIME"}) as enq:
            enq.write(body)
            enq.commit([Recipient(f"r{k}.{i}@y", Schedule(k), zone=f"z{i}") for i in range(3)])
    listed = list(q.list_queue())
    assert len(listed) == 9
    assert [m.message_id for m in listed] == sorted(m.message_id for m in listed)
    seen = []
    for m in listed:
        i = q.send_start(m)
        assert i is not None
        with q.read_inflight(i) as r:
            body = r.read_all()
            seen.append((r.meta.mail_from, r.meta.rcpt, r.meta.zone, body, r.meta.params))
        if r.meta.rcpt_index == 1:
            back = q.send_cancel(i, Schedule(99, 1))
            assert back is not None
            i = q.send_start(back)
            assert i is not None
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)
    assert seen[0] == ("s0@x", "r0.0@y", "z0", b"one", {"BODY": "8BITMIME"})
    assert [s[3] for s in seen] == [b for b in bodies for _ in range(3)]
    assert t(q) == EMPTY
    assert q.footprint() == Footprint(0, 0)


def test_reader_streams_in_pieces(q: FsQueue) -> None:
    body = bytes(range(256)) * 1000
    h = put(q, n=1, body=body)
    i = q.send_start(h[0])
    assert i is not None
    r = q.read_inflight(i)
    parts = [r.read(1000) for _ in range(256)]
    assert b"".join(parts) == body and r.read(10) == b"" and r.read() == b""
    r.close()
    r.close()


def test_close_hands_inflight_entries_to_the_next_owner(tmp_path: str) -> None:
    root = str(tmp_path / "q")
    a = FsQueue(root)
    h = put(a, n=2)
    assert a.send_start(h[0]) is not None
    b = FsQueue(root)  # opens while a is alive: a's claim is untouched
    assert b.last_recovery is not None and b.last_recovery.requeued == 0
    assert [m.entry_id for m in b.list_queue()] == [h[1].entry_id]
    assert list(b.find_inflight()) == []
    a.close()
    adopted = list(b.find_inflight())
    assert [m.entry_id for m in adopted] == [h[0].entry_id]
    assert tree(root, [b.owner, a.owner]) == with_(
        *MESSAGE, "data/M0/rcpts/0", "data/M0/rcpts/1",
        "inflight/M0.0@O0 -> ../data/M0/rcpts/0", "queue/M0.1 -> ../data/M0/rcpts/1")
    p = b.send_done(adopted[0])
    assert p is not None and b.cleanup(p)
    b.close()


def test_threads_of_one_queue_claim_each_entry_once(q: FsQueue) -> None:
    import threading

    everything = sorted(h.entry_id for _ in range(4) for h in put(q, n=50))
    claimed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        listed = list(q.list_queue())
        start.wait()
        for m in reversed(listed) if k % 2 else listed:
            if k % 4 == 3:  # some workers reschedule instead: a claim, then back
                r = q.reschedule(m, Schedule(5, 1))
                m = r if r is not None else m
                if r is None:
                    continue
            i = q.send_start(m)
            if i is not None:
                with lock:
                    claimed.append(i.entry_id)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert sorted(claimed) == everything
    assert list(q.list_queue()) == []
