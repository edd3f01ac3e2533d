"""FsQueue and bad input: foreign, stale and mistyped handles, closed queues, bad addresses."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.storage import (
    ClosedError,
    InflightMail,
    InvalidInputError,
    MisuseError,
    PendingCleanupMail,
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


def test_foreign_handle_is_refused_and_changes_nothing(tmp_path: str, q: FsQueue) -> None:
    other = FsQueue(str(tmp_path / "other"))
    theirs = put(other, n=1)[0]
    mine = put(q, n=1)[0]
    before = t(q)
    for call in (q.send_start, q.drop, lambda h: q.reschedule(h, Schedule(1))):
        with pytest.raises(MisuseError, match="another Storage"):
            call(theirs)
    # Same root, another FsQueue object: its handles are foreign too.
    twin = FsQueue(q.root)
    with pytest.raises(MisuseError):
        twin.send_start(mine)
    twin.close()
    assert t(q) == before
    assert other.send_start(theirs) is not None  # still live for its owner
    other.close()


def test_stale_handle_is_refused(q: FsQueue) -> None:
    h = put(q, n=1)[0]
    i = q.send_start(h)
    assert i is not None
    with pytest.raises(MisuseError, match="used already"):
        q.send_start(h)
    p = q.send_done(i)
    assert p is not None
    with pytest.raises(MisuseError):
        q.send_done(i)
    with pytest.raises(MisuseError):
        q.read_inflight(i)
    assert q.cleanup(p)
    with pytest.raises(MisuseError):
        q.cleanup(p)


def test_wrong_handle_type_is_refused(q: FsQueue) -> None:
    h = put(q, n=1)[0]
    fake_inflight = InflightMail(h.entry_id, h.message_id, h.schedule, h._owner)
    fake_cleanup = PendingCleanupMail(h.entry_id, h.message_id, h.schedule, h._owner)
    before = t(q)
    bad: list[Any] = [fake_inflight, fake_cleanup, "entry", None, 3]
    for b in bad:
        with pytest.raises(MisuseError):
            q.send_start(b)
        with pytest.raises(MisuseError):
            q.drop(b)
    with pytest.raises(MisuseError):
        q.send_done(h)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        q.cleanup(fake_inflight)  # type: ignore[arg-type]
    assert t(q) == before
    assert q.send_start(h) is not None  # the real handle was never consumed


def test_bad_schedule_does_not_consume_the_handle(q: FsQueue) -> None:
    h = put(q, n=1)[0]
    with pytest.raises(InvalidInputError):
        q.reschedule(h, 5)  # type: ignore[arg-type]
    i = q.send_start(h)
    assert i is not None
    with pytest.raises(InvalidInputError):
        q.send_cancel(i, None)  # type: ignore[arg-type]
    assert q.send_cancel(i, Schedule(3)) is not None


def test_everything_raises_closed_error_after_close(tmp_path: str) -> None:
    q = FsQueue(str(tmp_path / "q"))
    h = put(q, n=2)
    i = q.send_start(h[0])
    assert i is not None
    reader = q.read_inflight(i)
    enq = q.enqueue("a@b")
    q.close()
    q.close()  # idempotent
    calls: list[Any] = [
        lambda: list(q.list_queue()), lambda: list(q.find_inflight()),
        lambda: list(q.find_pending_cleanup()), lambda: q.enqueue("a@b"),
        lambda: q.send_start(h[1]), lambda: q.reschedule(h[1], Schedule(1)),
        lambda: q.drop(h[1]), lambda: q.send_done(i), lambda: q.send_cancel(i, Schedule(1)),
        lambda: q.read_inflight(i), q.recover, q.footprint,
        lambda: enq.write(b"x"), lambda: enq.commit(rcpts(1)),
    ]
    for c in calls:
        with pytest.raises(ClosedError):
            c()
    assert reader.read_all().startswith(b"Subject")  # an open reader keeps its file
    reader.close()
    with pytest.raises(ClosedError):
        reader.read()
    enq.abort()


@pytest.mark.parametrize("bad", ["a\nb@x", "a\rb", "nul\x00@x", "x" * 1025, 7])
def test_bad_sender_creates_nothing(q: FsQueue, bad: Any) -> None:
    with pytest.raises(InvalidInputError):
        q.enqueue(bad)
    assert t(q) == EMPTY


@pytest.mark.parametrize("bad", [
    [Recipient("a\nb@x", Schedule(0))],
    [Recipient("nul\x00@x", Schedule(0))],
    [Recipient("ok@x", Schedule(0), zone="z\r")],
    [Recipient("", Schedule(0))],
    [],
    ["ok@x"],
    "ok@x",
])
def test_bad_recipients_create_nothing(q: FsQueue, bad: Any) -> None:
    enq = q.enqueue("a@b")
    with pytest.raises(InvalidInputError):
        enq.commit(bad)
    assert t(q) == EMPTY
    enq.write(b"body")
    with pytest.raises(InvalidInputError):
        enq.commit(bad)
    assert list(q.list_queue()) == []
    enq.abort()
    assert t(q) == EMPTY


def test_bad_params_and_body_types(q: FsQueue) -> None:
    with pytest.raises(InvalidInputError):
        q.enqueue("a@b", {"K": "v\x00"})
    with pytest.raises(InvalidInputError):
        q.enqueue("a@b", {"K": 1})  # type: ignore[dict-item]
    with q.enqueue("a@b") as enq, pytest.raises(InvalidInputError):
        enq.write("text")  # type: ignore[arg-type]
    assert t(q) == EMPTY


def test_path_like_addresses_are_data_not_paths(tmp_path: str, q: FsQueue) -> None:
    outside = sorted(os.listdir(tmp_path))
    evil = ["../../x", "../data/../../etc/passwd", "/etc/shadow", "a/../../b", ".", ".."]
    with q.enqueue("../../sender") as enq:
        enq.write(b"b")
        hs = enq.commit([Recipient(a, Schedule(0), zone=a) for a in evil])
    assert sorted(os.listdir(tmp_path)) == outside
    names = [line for line in t(q) if not line.startswith("tmp/")]
    assert names == sorted(["cleanup/", "data/", "data/M0 (13 names)", "held/", "inflight/",
                            "quarantine/", "queue-ref.format", "queue/"]
                           + [f"data/M0.{i} = data/M0" for i in range(6)]
                           + [f"queue/M0.{i} = data/M0" for i in range(6)])
    got = []
    for h in hs:
        i = q.send_start(h)
        assert i is not None
        with q.read_inflight(i) as r:
            got.append((r.meta.mail_from, r.meta.rcpt, r.meta.zone))
    assert got == [("../../sender", a, a) for a in evil]


def test_commit_and_write_after_commit_are_refused(q: FsQueue) -> None:
    enq = q.enqueue("a@b")
    enq.write(b"x")
    hs = enq.commit(rcpts(1))
    with pytest.raises(ClosedError):
        enq.write(b"more")
    with pytest.raises(ClosedError):
        enq.commit(rcpts(1))
    enq.abort()  # a no-op after commit
    assert [m.entry_id for m in q.list_queue()] == [hs[0].entry_id]
    assert isinstance(hs[0], QueuedMail)


class FewLinks(OsIO):
    """A file system whose files may have at most 5 names (``link`` fails with EMLINK
    beyond, as the kernel's)."""

    def link_max(self, path: str) -> int:
        return 5

    def link(self, src: str, dst: str) -> None:
        if os.lstat(src).st_nlink >= 5:
            raise OSError(errno.EMLINK, os.strerror(errno.EMLINK), src)
        super().link(src, dst)


def test_more_recipients_than_the_file_system_can_link_are_refused_cleanly(
        tmp_path: str) -> None:
    q = FsQueue(str(tmp_path / "q"), FewLinks())
    try:
        assert q.limits.max_recipients == 2
        enq = q.enqueue("a@b")
        enq.write(b"body")
        with pytest.raises(InvalidInputError, match="at most 2"):
            enq.commit(rcpts(3))  # 3 links + 3 references + the message's own name: 7 > 5
        assert list(q.list_queue()) == []  # nothing changed ...
        hs = enq.commit(rcpts(2))  # ... and the Enqueuer is still usable: 5 names
        assert [m.entry_id for m in q.list_queue()] == [h.entry_id for h in hs]
        assert os.stat(os.path.join(q.root, "data", hs[0].message_id)).st_nlink == 5
    finally:
        q.close()


def test_the_real_link_limit_is_read_from_the_file_system(tmp_path: str) -> None:
    io = OsIO()
    assert io.link_max(str(tmp_path)) == os.pathconf(str(tmp_path), "PC_LINK_MAX")
    assert io.link_max(str(tmp_path / "missing")) == 2 ** 31 - 1
