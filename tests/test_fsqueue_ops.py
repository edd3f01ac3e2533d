"""FsQueue operations: the exact directory tree before and after each, and the lifecycle."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_records import Envelope, decode_schedule
from queue_ref.fsqueue.owners import OwnerInUseError
from queue_ref.fsqueue.steps import BODY_BUFFER
from queue_ref.storage import (
    Capability,
    Footprint,
    InflightMail,
    InvalidInputError,
    MisuseError,
    QueuedMail,
    Recipient,
    Schedule,
)
from tests.test_fsqueue_support import EMPTY, message_parts, put, rcpts, tree


@pytest.fixture
def q(tmp_path: str) -> Iterator[FsQueue]:
    store = FsQueue(str(tmp_path / "q"))
    yield store
    store.close()


def t(q: FsQueue) -> list[str]:
    return tree(q.root, [q.owner])


# The message file (body, envelope record, trailer) of a 2-recipient message: its names
# are data/M0, one reference hard link and one entry link (a hard link too) per entry.
MESSAGE = ["data/M0 (5 names)"]
REFS = ["data/M0.0 = data/M0", "data/M0.1 = data/M0"]  # the references: same inode
QUEUED = ["queue/M0.0 = data/M0", "queue/M0.1 = data/M0"]  # the entries' links: same inode


def with_(*lines: str, base: list[str] = EMPTY) -> list[str]:
    return sorted(base + list(lines))


def test_open_creates_the_layout_and_declares_capabilities(q: FsQueue) -> None:
    assert t(q) == EMPTY
    owners = sorted(os.listdir(os.path.join(q.root, "owners")))
    assert owners == sorted(["gate.lock", f"{q.owner}.lock"])
    assert q.capabilities == {Capability.GROUP_COMMIT, Capability.STREAMING_BODIES,
                              Capability.MULTI_PROCESS, Capability.IO_SEAM, Capability.HOLD,
                              Capability.DOMAIN_INDEX}
    assert q.footprint() == Footprint(0, 0)


def test_enqueue_tree_while_building_and_after_commit(q: FsQueue) -> None:
    enq = q.enqueue("a@b")
    assert t(q) == EMPTY  # nothing before the first write
    enq.write(b"hello")
    assert t(q) == EMPTY  # small bodies are held back until commit (or 64 KiB)
    enq.write(b"x" * BODY_BUFFER)
    assert t(q) == with_("tmp/O0/M0")
    assert os.path.getsize(os.path.join(q.root, "tmp", q.owner, enq.message_id)) == (
        BODY_BUFFER + 5)
    assert list(q.list_queue()) == []
    handles = enq.commit(rcpts(2))
    assert [h.entry_id.split(".")[1] for h in handles] == ["0", "1"]
    assert t(q) == with_(*MESSAGE, *REFS, *QUEUED)
    assert os.stat(os.path.join(q.root, "data", enq.message_id)).st_nlink == 5
    body, record = message_parts(os.path.join(q.root, "data", enq.message_id))
    assert body == b"hello" + b"x" * BODY_BUFFER
    assert Envelope.decode(record, enq.message_id).rcpts == tuple(rcpts(2))
    assert q.footprint().objects == 3  # the message file and its two references
    assert q.footprint().bytes > 3 * len(body)


def test_a_one_recipient_message_is_one_file_and_one_link(q: FsQueue) -> None:
    (h,) = put(q, n=1)
    assert t(q) == with_("data/M0 (2 names)", "queue/M0.0 = data/M0")
    # no reference for one recipient: its link is the only other name, no inode of its own
    assert os.stat(os.path.join(q.root, "data", h.message_id)).st_nlink == 2


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
    assert t(q) == with_(*MESSAGE, *REFS, "inflight/M0.0@O0 = data/M0",
                         "queue/M0.1 = data/M0")


def test_reschedule_writes_the_record_and_leaves_the_link_queued(q: FsQueue) -> None:
    h = put(q)
    r = q.reschedule(h[1], Schedule(500, 3))
    assert isinstance(r, QueuedMail) and r.schedule == Schedule(500, 3)
    assert t(q) == with_(*MESSAGE, *REFS, *QUEUED, "data/M0.1.sched")
    with open(os.path.join(q.root, "data", f"{h[1].entry_id}.sched"), "rb") as f:
        assert decode_schedule(f.read(), h[1].entry_id) == Schedule(500, 3)
    assert [m.schedule for m in q.list_queue()] == [Schedule(0), Schedule(500, 3)]


def test_send_cancel_writes_the_schedule_and_requeues(q: FsQueue) -> None:
    h = put(q)
    i = q.send_start(h[0])
    assert i is not None
    back = q.send_cancel(i, Schedule(900, 1))
    assert back is not None and back.schedule == Schedule(900, 1)
    assert t(q) == with_(*MESSAGE, *REFS, *QUEUED, "data/M0.0.sched")
    assert {m.entry_id: m.schedule for m in q.list_queue()}[h[0].entry_id] == Schedule(900, 1)


def test_send_done_moves_to_cleanup_and_cleanup_releases_the_entry(q: FsQueue) -> None:
    h = put(q)
    i = q.send_start(h[0])
    assert i is not None
    p = q.send_done(i)
    assert p is not None
    assert t(q) == with_(*MESSAGE, *REFS, "cleanup/M0.0 = data/M0",
                         "queue/M0.1 = data/M0")
    assert [c.entry_id for c in q.find_pending_cleanup()] == [h[0].entry_id]
    assert q.cleanup(p) is True
    assert t(q) == with_("data/M0 (3 names)", "data/M0.1 = data/M0", "queue/M0.1 = data/M0")
    assert os.stat(os.path.join(q.root, "data", h[1].message_id)).st_nlink == 3
    p1 = q.drop(h[1])
    assert p1 is not None and q.cleanup(p1) is True  # the last entry frees the file
    assert t(q) == EMPTY


def test_drop_then_cleanup_of_the_last_entry_removes_the_message(q: FsQueue) -> None:
    h = put(q, n=1)
    p = q.drop(h[0])
    assert p is not None
    assert t(q) == with_("data/M0 (2 names)", "cleanup/M0.0 = data/M0")
    assert q.cleanup(p) is True
    assert t(q) == with_("tmp/O0/spare.0")  # kept for the next message (spares.py)
    assert q.footprint() == Footprint(0, 0)
    q.close()
    assert tree(q.root) == EMPTY[:-1]  # close removes the spare and the tmp directory


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
    assert t(q) == with_("tmp/O0/spare.0")


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
        *MESSAGE, *REFS, "inflight/M0.0@O0 = data/M0", "queue/M0.1 = data/M0")
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


# ---- explicit owner token and clock ----------------------------------------------------------

OWNER = "00000000000000a1"


def test_owner_and_clock_name_the_queue_and_its_message_ids(tmp_path: Path) -> None:
    ticks = iter([5_000, 7_000, 6_000])  # the third goes back in time
    q = FsQueue(str(tmp_path / "q"), owner=OWNER, clock=lambda: next(ticks))
    try:
        assert q.owner == OWNER
        assert f"{OWNER}.lock" in os.listdir(os.path.join(q.root, "owners"))
        assert os.path.isdir(os.path.join(q.root, "tmp", OWNER))
        ids = [put(q, 1)[0].message_id for _ in range(3)]
        assert ids == [f"{5_000:016x}{1:06x}{OWNER}", f"{7_000:016x}{2:06x}{OWNER}",
                       f"{7_000:016x}{3:06x}{OWNER}"]  # never back in time, still unique
        assert [h.message_id for h in q.list_queue()] == ids
    finally:
        q.close()


def test_the_same_owner_and_clock_give_the_same_names(tmp_path: Path) -> None:
    trees = []
    for name in ("one", "two"):
        q = FsQueue(str(tmp_path / name), owner=OWNER, clock=itertools.count(1).__next__)
        try:
            h = put(q, 2)
            assert q.send_start(h[0]) is not None
            trees.append(sorted(os.path.relpath(os.path.join(d, n), q.root)
                                for d, dirs, files in os.walk(q.root) for n in dirs + files))
        finally:
            q.close()
    assert trees[0] == trees[1]  # real names, nothing random left in them
    msgid = f"{1:016x}{1:06x}{OWNER}"
    assert f"inflight/{msgid}.0@{OWNER}" in trees[0] and f"queue/{msgid}.1" in trees[0]


@pytest.mark.parametrize("bad", ["", "00000000000000A1", "0000000000000a1", "g" * 16,
                                 "0" * 17, "../../etc/passwd", 12, b"00000000000000a1"])
def test_a_malformed_owner_is_refused_before_touching_the_disk(tmp_path: Path,
                                                               bad: object) -> None:
    root = str(tmp_path / "q")
    with pytest.raises(InvalidInputError, match="owner"):
        FsQueue(root, owner=bad)  # type: ignore[arg-type]
    assert not os.path.exists(root)


def test_a_clock_must_be_callable_and_give_nanoseconds(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    with pytest.raises(InvalidInputError, match="clock"):
        FsQueue(root, clock=12)  # type: ignore[arg-type]
    assert not os.path.exists(root)
    for bad in (1.5, -1, None, True):
        q = FsQueue(root, clock=lambda b=bad: b)  # type: ignore[misc]
        try:
            with pytest.raises(InvalidInputError, match="clock"):
                q.enqueue("a@b")
            assert q.footprint() == Footprint(0, 0)
        finally:
            q.close()


def test_an_owner_held_by_an_open_queue_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    first = FsQueue(root, owner=OWNER)
    try:
        (h,) = put(first, 1)
        with pytest.raises(OwnerInUseError, match="held by another open queue") as err:
            FsQueue(root, owner=OWNER)
        assert isinstance(err.value, MisuseError)
        other = FsQueue(root)  # a queue with its own token sees the first one alive
        try:
            assert other._owners.alive(OWNER)
            assert other.send_start(next(iter(other.list_queue()))) is not None
        finally:
            other.close()
        assert first.send_start(h) is None  # the other queue claimed it; first still works
        assert f"{OWNER}.lock" in os.listdir(os.path.join(root, "owners"))
    finally:
        first.close()


def test_an_owner_a_dead_queue_left_on_disk_is_never_reused(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    FsQueue(root).close()
    for leftover in (f"owners/{OWNER}.lock", f"tmp/{OWNER}"):
        path = os.path.join(root, leftover)
        if leftover.startswith("tmp/"):
            os.mkdir(path)
        else:
            open(path, "wb").close()
        with pytest.raises(OwnerInUseError, match="used before"):
            FsQueue(root, owner=OWNER)
        assert os.path.exists(path)  # a dead owner's files are recovery's to remove
        assert sorted(os.listdir(os.path.join(root, "owners"))) == sorted(
            {"gate.lock", f"{OWNER}.lock"} if leftover.startswith("owners/") else {"gate.lock"})
        FsQueue(root).close()  # recovery removes them
        assert not os.path.exists(path)
