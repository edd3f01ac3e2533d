"""FsQueue under faults: junk in its directories, unreadable files, a full disk, failed
fsyncs and renames, and corrupted bodies, envelopes and schedule records."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_records import trailer
from queue_ref.fsqueue.steps import BODY_BUFFER
from queue_ref.io import OsIO
from queue_ref.storage import (
    CorruptionError,
    Footprint,
    InflightMail,
    NoSpaceError,
    QueuedMail,
    ReopenRequiredError,
    Schedule,
    StorageIOError,
)
from tests.test_fsqueue_support import EMPTY, message_parts, put, rcpts, tree


@pytest.fixture
def root(tmp_path: Any) -> str:
    return str(tmp_path / "q")


def entries(q: FsQueue) -> list[str]:
    return [m.entry_id for m in q.list_queue()]


# ---- junk ------------------------------------------------------------------------------


def _altered_copy(src: str, dst: str) -> None:
    """``dst``: the bytes of ``src`` with the last one changed (a copy of a message file
    made with its very bytes is a link copied without its hard link, mended by recovery;
    see tests/test_damage_fs.py)."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


def test_junk_is_quarantined_reported_never_followed(tmp_path: Any, root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=2)
    m = h[0].message_id
    q.close()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    os.makedirs(tmp_path / "victim" / "rcpts")
    (tmp_path / "victim" / "rcpts" / "0").write_bytes(b"")
    junk = {
        "queue/notes.txt": lambda p: open(p, "w").close(),
        f"queue/{m}.7": lambda p: os.symlink(str(secret), p),  # our name, foreign target
        f"queue/{m}.8": lambda p: os.symlink("../../victim/rcpts/0", p),
        # a regular file of an entry's name that is not its message file (another inode,
        # and not a copy of it either: its last byte differs), claimed by a dead owner
        f"inflight/{m}.1@{'e' * 16}": lambda p: _altered_copy(os.path.join(root, "data", m), p),
        # a symlink as the old format made them, in a queue of the new one
        f"queue/{m}.6": lambda p: os.symlink(f"../data/{m}", p),
        "inflight/weird@name": lambda p: os.symlink("/etc/passwd", p),
        f"cleanup/{m}.9": lambda p: os.mkdir(p),
        "data/not-a-message": lambda p: os.mkdir(p),
        "tmp/stranger": lambda p: open(p, "w").close(),
    }
    for rel, make in junk.items():
        make(os.path.join(root, rel))
    q = FsQueue(root, recover=False)
    assert entries(q) == [x.entry_id for x in h]  # listers skip junk without touching it
    report = q.recover()
    assert len(report.problems) == len(junk), report.problems
    for rel in junk:
        where, name = rel.split("/")
        assert any(p.startswith(f"{where}/{name!r}") for p in report.problems), rel
    assert entries(q) == [x.entry_id for x in h]
    assert secret.read_bytes() == b"not yours"  # never followed, never touched
    assert (tmp_path / "victim" / "rcpts" / "0").exists()
    quarantined = os.listdir(os.path.join(root, "quarantine"))
    assert len(quarantined) == len(junk)
    assert tree(root, [q.owner]) == sorted(
        [x for x in EMPTY if x != "quarantine/"]
        + ["data/M0 (5 names)", "data/M0.0 = data/M0", "data/M0.1 = data/M0"]
        + ["queue/M0.0 = data/M0", "queue/M0.1 = data/M0"]
        + [line for line in tree(root, [q.owner]) if line.startswith("quarantine/")])
    assert q.recover().problems == ()  # idempotent: nothing more to report
    q.close()


# ---- unreadable files and failing calls ------------------------------------------------


class FaultyIO(OsIO):
    """Raises a chosen OSError for calls matching (method, path suffix), while armed."""

    def __init__(self) -> None:
        self.faults: dict[tuple[str, str], OSError] = {}
        self.hits = 0

    def _check(self, method: str, path: str) -> None:
        for (m, suffix), err in self.faults.items():
            if m == method and path.endswith(suffix):
                self.hits += 1
                raise err

    def open_read(self, path: str) -> int:
        self._check("open_read", path)
        return super().open_read(path)

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        self._check("open_create", path)
        return super().open_create(path, exclusive=exclusive, append=append)

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        super().fsync_dir(path)

    def syncfs(self, path: str) -> None:
        self._check("syncfs", path)
        super().syncfs(path)

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", dst)
        super().rename(src, dst)

    def write(self, fd: int, data: bytes) -> int:
        self._check("write", "")
        return super().write(fd, data)


def test_unreadable_body_is_an_io_error_not_corruption(root: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io)
    h = put(q, n=1)
    i = q.send_start(h[0])
    assert i is not None
    io.faults[("open_read", f"/{h[0].message_id}")] = PermissionError(errno.EACCES, "denied")
    with q.read_inflight(i) as r:  # the file is opened when the body is first read
        assert r.meta.rcpt == "user0@example.org"
        with pytest.raises(StorageIOError) as ei:
            r.read_all()
    assert ei.value.handle is i and not isinstance(ei.value, NoSpaceError)
    assert os.listdir(os.path.join(root, "quarantine")) == []
    io.faults.clear()
    with q.read_inflight(i) as r:  # the handle was never consumed
        assert r.read_all().startswith(b"Subject")


def test_unreadable_schedule_record_fails_listing_honestly(root: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io)
    h = put(q, n=2)
    assert q.reschedule(h[1], Schedule(5)) is not None
    io.faults[("open_read", f"/{h[1].entry_id}.sched")] = PermissionError(errno.EACCES,
                                                                          "denied")
    with pytest.raises(StorageIOError):
        entries(q)
    io.faults.clear()
    assert len(entries(q)) == 2


def test_failed_rename_gives_the_handle_back_for_a_retry(root: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io)
    h = put(q, n=1)
    i = q.send_start(h[0])
    assert i is not None
    io.faults[("rename", f"/cleanup/{h[0].entry_id}")] = OSError(errno.EIO, "injected")
    with pytest.raises(StorageIOError) as ei:
        q.send_done(i)
    assert ei.value.handle is i
    io.faults.clear()
    p = q.send_done(i)  # the retry completes the transition
    assert p is not None and q.cleanup(p)
    assert q.footprint() == Footprint(0, 0)


def test_failed_reschedule_leaves_the_entry_queued_with_the_old_schedule(root: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io)
    h = put(q, n=1)
    io.faults[("open_create", ".tmp")] = OSError(errno.ENOSPC, "full")
    with pytest.raises(NoSpaceError) as ei:
        q.reschedule(h[0], Schedule(77))
    assert ei.value.handle is h[0]
    assert [m.schedule for m in q.list_queue()] == [Schedule(0)]
    io.faults.clear()
    r = q.reschedule(h[0], Schedule(77))
    assert r is not None and [m.schedule for m in q.list_queue()] == [Schedule(77)]


@pytest.mark.parametrize("mode", ["syncfs", "fsync"])
def test_failed_shared_sync_poisons_until_reopened(root: str, mode: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io, sync=mode)
    h = put(q, n=2)
    i = q.send_start(h[0])
    assert i is not None
    fault = ("fsync_dir", "/inflight") if mode == "fsync" else ("syncfs", "/data")
    io.faults[fault] = OSError(errno.EIO, "injected")
    with pytest.raises(ReopenRequiredError) as ei:  # a StorageIOError that says: reopen
        q.send_done(i)
    assert ei.value.handle is i and q.poisoned
    io.faults.clear()
    with pytest.raises(ReopenRequiredError, match="reopen"):
        q.send_done(i)  # not retried on the strength of a later fsync
    with pytest.raises(ReopenRequiredError):
        q.send_start(h[1])
    with pytest.raises(ReopenRequiredError), q.enqueue("a@b") as enq:
        enq.commit(rcpts(1))
    q.close()
    q = FsQueue(root)  # recovery: the send_done happened (cleanup wins) or it did not
    assert q.last_recovery is not None and q.last_recovery.cleaned == 1
    assert entries(q) == [h[1].entry_id]
    q.close()


def test_write_error_discards_the_message(root: str) -> None:
    io = FaultyIO()
    q = FsQueue(root, io)
    enq = q.enqueue("a@b")
    enq.write(b"first" * BODY_BUFFER)  # written: more than is held back
    assert tree(root, [q.owner]) == sorted([*EMPTY, "tmp/O0/M0"])
    io.faults[("write", "")] = OSError(errno.ENOSPC, "full")
    with pytest.raises(NoSpaceError):
        enq.write(b"second" * BODY_BUFFER)
    io.faults.clear()
    assert tree(root, [q.owner]) == EMPTY
    enq.abort()


# ---- a full disk (pyfakefs) -------------------------------------------------------------


class FakeFsIO(OsIO):
    """pyfakefs patches ``os.lseek`` and ``os.read`` but not ``os.pread``: read at an
    offset through those.  (It has no ``syncfs`` either: the queue runs in fsync mode.)
    Every call goes through ``os``, which pyfakefs patches: none through libc."""

    holds_gil = False

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, n)


def test_full_disk_gives_no_space_error_and_loses_nothing(fs: Any) -> None:
    fs.create_dir("/spool")
    q = FsQueue("/spool/q", FakeFsIO(), sync="fsync")
    kept = put(q, n=3, body=b"x" * 1000)
    i = q.send_start(kept[0])
    assert i is not None
    fs.set_disk_usage(fs.get_disk_usage("/").used + 5000)
    enq = q.enqueue("a@b")
    with pytest.raises(NoSpaceError):
        for _ in range(100):
            enq.write(b"y" * 1000)
    enq.abort()
    fs.set_disk_usage(fs.get_disk_usage("/").used)  # not one byte free
    with pytest.raises(NoSpaceError) as ei:  # the schedule record does not fit
        q.send_cancel(i, Schedule(9, 1))
    assert ei.value.handle is i
    assert [m.entry_id for m in q.list_queue()] == [k.entry_id for k in kept[1:]]
    with q.read_inflight(i) as r:
        assert r.read_all() == b"x" * 1000
    q.close()
    fs.set_disk_usage(10 ** 9)
    q = FsQueue("/spool/q", FakeFsIO(), sync="fsync")
    assert q.last_recovery is not None and q.last_recovery.requeued == 1
    assert sorted(m.entry_id for m in q.list_queue()) == [k.entry_id for k in kept]
    q.close()


# ---- corruption ------------------------------------------------------------------------


def _corrupt(path: str, offset: int = -1) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[offset] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def _envelope_offset(path: str) -> int:
    """Where the envelope record starts in the message file at ``path``."""
    return len(message_parts(path)[0])


@pytest.fixture
def loaded(root: str) -> Iterator[tuple[FsQueue, list[QueuedMail]]]:
    q = FsQueue(root)
    yield q, put(q, n=3, body=bytes(range(256)) * 800)
    q.close()


def _inflight(q: FsQueue, h: QueuedMail) -> InflightMail:
    i = q.send_start(h)
    assert i is not None
    return i


def test_corrupt_body_raises_before_the_last_bytes(loaded: Any, root: str) -> None:
    q, h = loaded
    m = h[0].message_id
    _corrupt(os.path.join(root, "data", m), offset=256 * 800 - 10)  # in the body
    r = q.read_inflight(_inflight(q, h[0]))
    got = b""
    with pytest.raises(CorruptionError) as ei:
        while True:
            b = r.read(65536)
            assert b
            got += b
    assert len(got) < 256 * 800  # the final chunk was never handed out
    assert ei.value.entry_id == h[0].entry_id and ei.value.quarantined_to is not None
    assert ei.value.quarantined_to.endswith(f"{m}.msg")
    assert sorted(os.listdir(os.path.join(root, "quarantine"))) == sorted(
        [f"{m}.msg", f"{m}.note", f"{h[0].entry_id}@{q.owner}.link",
         f"{h[1].entry_id}.link", f"{h[2].entry_id}.link"])
    assert entries(q) == [] and q.footprint() == Footprint(0, 0)


@pytest.mark.parametrize("change", ["shorter body", "longer body", "truncated", "appended"])
def test_a_message_file_of_the_wrong_shape_is_corrupt(loaded: Any, root: str,
                                                      change: str) -> None:
    q, h = loaded
    path = os.path.join(root, "data", h[0].message_id)
    body, record = message_parts(path)
    whole = body + record + trailer(len(record))
    new = {"shorter body": body[:-1] + record + trailer(len(record)),
           "longer body": body + b"!" + record + trailer(len(record)),
           "truncated": whole[:1000], "appended": whole + b"!"}[change]
    with open(path, "r+b") as f:  # the same inode: every hard link sees it
        f.truncate(0)
        f.write(new)
    # The queue that committed it knows the envelope, so it reads exactly the body's
    # length and checks it against the committed digest: the committed bytes when they are
    # still there in front, a CorruptionError when they are not; never altered bytes.
    i = _inflight(q, h[0])
    if change in ("longer body", "appended"):
        with q.read_inflight(i) as r:
            assert r.read_all() == body
    else:
        with pytest.raises(CorruptionError), q.read_inflight(i) as r:
            r.read_all()
    q.close()
    # A queue that reads the file afresh finds the shape wrong and quarantines it.
    fresh = FsQueue(root, recover=False)
    try:
        assert entries(fresh) == []  # every entry of the message shares the file
        assert f"{h[0].message_id}.msg" in os.listdir(os.path.join(root, "quarantine"))
        assert fresh.footprint() == Footprint(0, 0)
    finally:
        fresh.close()


def test_corrupt_envelope_is_quarantined_by_recovery(loaded: Any, root: str) -> None:
    q, h = loaded
    q.close()
    path = os.path.join(root, "data", h[0].message_id)
    _corrupt(path, offset=_envelope_offset(path) + 40)
    q2 = FsQueue(root)
    assert q2.last_recovery is not None and q2.last_recovery.quarantined == 1
    assert entries(q2) == [] and q2.footprint() == Footprint(0, 0)
    q2.close()


def test_corrupt_envelope_is_quarantined_by_listing(loaded: Any, root: str) -> None:
    q, h = loaded
    i = _inflight(q, h[0])
    path = os.path.join(root, "data", h[0].message_id)
    _corrupt(path, offset=_envelope_offset(path) + 40)
    assert entries(q) == []
    with pytest.raises(CorruptionError):  # it is gone from inflight/ too
        q.read_inflight(i)


def test_corrupt_schedule_quarantines_only_that_entry(loaded: Any, root: str) -> None:
    q, h = loaded
    r = q.reschedule(h[1], Schedule(50, 2))
    assert r is not None
    _corrupt(os.path.join(root, "data", f"{h[1].entry_id}.sched"), offset=-3)
    assert entries(q) == [h[0].entry_id, h[2].entry_id]
    qdir = sorted(os.listdir(os.path.join(root, "quarantine")))
    # the link is unlinked, not kept: a hard link in quarantine/ would hold the message
    # file for good (the other entries still hold it, so the body is copied aside)
    assert qdir == sorted([f"{h[1].entry_id}.note", f"{h[1].entry_id}.sched",
                           f"{h[1].entry_id}.msg"])
    assert not os.path.exists(os.path.join(root, "queue", h[1].entry_id))
    assert not os.path.exists(os.path.join(root, "data", h[1].entry_id))  # released
    # the file's names: itself, and the two other entries' references and links
    assert os.stat(os.path.join(root, "data", h[1].message_id)).st_nlink == 5
    with open(os.path.join(root, "quarantine", f"{h[1].entry_id}.msg"), "rb") as kept, \
            open(os.path.join(root, "data", h[1].message_id), "rb") as shared:
        assert kept.read() == shared.read()  # the body its recipient still needs
    for k in (h[0], h[2]):
        for m in q.list_queue():
            if m.entry_id == k.entry_id:
                i = _inflight(q, m)
                with q.read_inflight(i) as rd:
                    assert len(rd.read_all()) == 256 * 800
                p = q.send_done(i)
                assert p is not None and q.cleanup(p)
    assert q.footprint() == Footprint(0, 0)


def test_corrupt_schedule_of_an_inflight_entry(loaded: Any, root: str) -> None:
    q, h = loaded
    h0 = q.reschedule(h[0], Schedule(0, 1))  # a schedule record, read again when opened
    assert h0 is not None
    i = _inflight(q, h0)
    path = os.path.join(root, "data", f"{h[0].entry_id}.sched")
    with open(path, "wb") as f:
        f.write(b"qr-record 1 garbage")
    with pytest.raises(CorruptionError) as ei:
        q.read_inflight(i)
    assert ei.value.quarantined_to is not None and ei.value.quarantined_to.endswith(".sched")


def test_a_schedule_record_appearing_after_the_claim_is_not_read(loaded: Any,
                                                                 root: str) -> None:
    """An entry claimed without a schedule record has none while we hold it (nobody else
    writes one), so opening it reads none: a hundred recipients cost no hundred opens.
    A file planted there meanwhile does not stop the delivery, and the next recovery
    removes it."""
    q, h = loaded
    i = _inflight(q, h[0])
    path = os.path.join(root, "data", f"{h[0].entry_id}.sched")
    with open(path, "wb") as f:
        f.write(b"qr-record 1 garbage")
    with q.read_inflight(i) as r:
        assert r.meta.schedule == h[0].schedule
        assert len(r.read_all()) == 256 * 800
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    q.close()
    q2 = FsQueue(root)
    try:
        assert not os.path.exists(path)
        assert sorted(m.entry_id for m in q2.list_queue()) == [h[1].entry_id, h[2].entry_id]
        assert os.listdir(os.path.join(root, "quarantine")) == []
    finally:
        q2.close()


def test_a_message_file_gone_before_the_body_is_read_is_corruption(loaded: Any,
                                                                   root: str) -> None:
    """The reader opens the message file when the body is first read: a file removed by
    damage before then is found there, and the entry is quarantined, not delivered."""
    q, h = loaded
    i = _inflight(q, h[0])
    with q.read_inflight(i) as r:
        os.unlink(os.path.join(root, "data", h[0].message_id))
        assert r.meta.rcpt == "user0@example.org"
        with pytest.raises(CorruptionError, match="message file is missing") as ei:
            r.read_all()
    assert ei.value.entry_id == h[0].entry_id
    assert os.listdir(os.path.join(root, "inflight")) == []
    assert any(n.startswith(h[0].entry_id) for n in os.listdir(os.path.join(root,
                                                                            "quarantine")))
    assert q.send_done(i) is None  # no longer inflight: never reported delivered


def test_entries_of_a_message_quarantined_elsewhere_are_refused_when_opened(
        root: str) -> None:
    """Three entries claimed here, the first read; another open of the queue (another
    process's) then quarantines the message.  The others are refused when opened (this
    queue still has the envelope cached: only the link tells), never delivered, and the
    quarantine note keeps its reason (found by a cold review: opened from the claim
    alone, they were handed to the relay, and the next read re-quarantined the message
    as "message file is missing")."""
    q = FsQueue(root)
    try:
        inf = [_inflight(q, h) for h in put(q, n=3)]
        with q.read_inflight(inf[0]) as r:
            assert r.read_all().startswith(b"Subject")
        with FsQueue(root) as other:
            other._quarantine_message(inf[0].message_id, "found corrupt elsewhere")
        (note,) = [n for n in os.listdir(os.path.join(root, "quarantine"))
                   if n.endswith(".note")]
        with open(os.path.join(root, "quarantine", note)) as f:
            said = f.read()
        for m in inf[1:]:
            with pytest.raises(CorruptionError, match="was quarantined"):
                q.read_inflight(m)
        with open(os.path.join(root, "quarantine", note)) as f:
            assert f.read() == said
        assert q.send_finish(inf[1:]).done == [None, None]
    finally:
        q.close()


def test_a_damaged_body_is_quarantined_once_with_its_reason(root: str) -> None:
    """The relay's claim loop over a message whose body rotted: the first read finds the
    digest wrong and quarantines the message; the others are refused as quarantined, and
    the note still says why."""
    q = FsQueue(root)
    try:
        inf = [_inflight(q, h) for h in put(q, n=3)]
        with open(os.path.join(root, "data", inf[0].message_id), "r+b") as f:
            f.write(b"X")
        with q.read_inflight(inf[0]) as r, pytest.raises(CorruptionError,
                                                         match="digest does not match"):
            r.read_all()
        for m in inf[1:]:
            with pytest.raises(CorruptionError, match="was quarantined"):
                q.read_inflight(m)
        notes = [n for n in os.listdir(os.path.join(root, "quarantine")) if n.endswith(".note")]
        assert len(notes) == 1
        with open(os.path.join(root, "quarantine", notes[0])) as f:
            assert "digest does not match" in f.read()
    finally:
        q.close()


def test_an_empty_body_whose_file_is_gone_is_found(root: str) -> None:
    """The file is opened when the body is first read, an empty body included: a message
    file gone under our link is damage, found there and quarantined."""
    q = FsQueue(root)
    try:
        (h,) = put(q, n=1, body=b"")
        i = _inflight(q, h)
        with q.read_inflight(i) as r:
            os.unlink(os.path.join(root, "data", h.message_id))
            with pytest.raises(CorruptionError, match="message file is missing"):
                r.read()
        assert q.send_done(i) is None
    finally:
        q.close()
