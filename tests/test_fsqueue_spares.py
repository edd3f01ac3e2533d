"""FsQueue spare files: spent message files rewritten in place for the next messages.

Which files become spares, that a rewritten file reads back as exactly the new message
(shorter or longer than the old one), the pool's bound, what close() and recovery remove,
and failures on the way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_records import Envelope
from queue_ref.fsqueue.spares import SPARE_MAX_BODY
from queue_ref.io import OsIO
from queue_ref.storage import (
    Footprint,
    InvalidInputError,
    PendingCleanupMail,
    QueuedMail,
    StorageIOError,
)
from tests.test_fsqueue_support import EMPTY, CrashIO, message_parts, put, tree


@pytest.fixture
def root(tmp_path: Any) -> str:
    return str(tmp_path / "q")


@pytest.fixture
def q(root: str) -> Iterator[FsQueue]:
    store = FsQueue(root)
    yield store
    store.close()


def delivered(q: FsQueue, h: QueuedMail) -> PendingCleanupMail:
    """``h`` claimed and sent: its PENDING_CLEANUP handle."""
    i = q.send_start(h)
    assert i is not None
    p = q.send_done(i)
    assert p is not None
    return p


def finish(q: FsQueue, h: QueuedMail) -> None:
    assert q.cleanup(delivered(q, h))


def spares_on_disk(q: FsQueue) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(q.root, "tmp", q.owner))
                  if n.startswith("spare."))


def read_back(q: FsQueue, h: QueuedMail) -> bytes:
    i = q.send_start(h)
    assert i is not None
    with q.read_inflight(i) as r:
        body = r.read_all()
    q.send_cancel(i, h.schedule)
    return body


@pytest.mark.parametrize("sync", ["syncfs", "fsync"])
def test_a_spare_is_rewritten_in_place_shorter_and_longer(root: str, sync: str) -> None:
    q = FsQueue(root, sync=sync)
    try:
        (first,) = put(q, n=1, body=b"a" * 10_000)
        inode = os.stat(os.path.join(root, "data", first.message_id)).st_ino
        finish(q, first)
        assert spares_on_disk(q) == ["spare.0"] and q.spare_files == 1
        for body in (b"short\r\n", b"b" * 30_000):
            (h,) = put(q, n=1, body=body)
            path = os.path.join(root, "data", h.message_id)
            assert os.stat(path).st_ino == inode  # the same file, rewritten
            got_body, record = message_parts(path)  # exactly the new message, no old tail
            assert got_body == body
            assert Envelope.decode(record, h.message_id).body_size == len(body)
            assert spares_on_disk(q) == [] and q.spare_files == 0
            assert read_back(q, h) == body
            finish(q, next(iter(q.list_queue())))
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()


def test_only_small_one_recipient_files_no_reader_holds_become_spares(q: FsQueue) -> None:
    for h in put(q, n=2):  # a message of two recipients: unlinked by its last cleanup
        finish(q, h)
    assert q.spare_files == 0
    (big,) = put(q, n=1, body=b"x" * (SPARE_MAX_BODY + 1))
    finish(q, big)
    assert q.spare_files == 0
    (read,) = put(q, n=1, body=b"read me\r\n")
    i = q.send_start(read)
    assert i is not None
    r = q.read_inflight(i)
    assert r.read(4) == b"read"
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    assert q.spare_files == 0  # a reader of ours still had the file open
    put(q, n=1, body=b"another message\r\n")  # needs a new file: the reader's is untouched
    assert r.read() == b" me\r\n"
    r.close()
    (small,) = list(q.list_queue())
    finish(q, small)
    assert q.spare_files == 1
    assert q.footprint() == Footprint(0, 0)


def test_the_pool_holds_at_most_its_capacity(root: str) -> None:
    q = FsQueue(root, spares=2)
    try:
        hs = [put(q, n=1)[0] for _ in range(5)]
        for h in hs:
            finish(q, h)
        assert q.spare_files == 2 and spares_on_disk(q) == ["spare.0", "spare.1"]
        assert os.listdir(os.path.join(root, "data")) == []
        assert q.footprint() == Footprint(0, 0)  # spares are not counted
    finally:
        q.close()
    assert tree(root) == EMPTY[:-1]  # close removed them, and the owner's tmp/ directory


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_spares_must_be_a_count(root: str, bad: Any) -> None:
    with pytest.raises(InvalidInputError, match="spares"):
        FsQueue(root, spares=bad)
    assert not os.path.exists(root)


def test_recovery_removes_the_spares_of_a_dead_owner(root: str) -> None:
    io = CrashIO()
    q = FsQueue(root, io)
    for h in [put(q, n=1)[0] for _ in range(3)]:
        finish(q, h)
    kept = put(q, n=1, body=b"still queued\r\n")
    assert len(spares_on_disk(q)) == 2  # one of the three was rewritten for `kept`
    dead = q.owner
    io.kill()  # the process dies without closing the queue
    q2 = FsQueue(root)
    try:
        assert sorted(os.listdir(os.path.join(root, "tmp"))) == [q2.owner]
        assert dead not in os.listdir(os.path.join(root, "tmp"))
        assert [m.entry_id for m in q2.list_queue()] == [kept[0].entry_id]
        assert read_back(q2, next(iter(q2.list_queue()))) == b"still queued\r\n"
    finally:
        q2.close()


class FailingIO(OsIO):
    """Fails the first call whose name and arguments ``fail_on`` accepts, with ``err``."""

    def __init__(self, fail_on: Any, err: int = errno.EIO) -> None:
        self.fail_on = fail_on
        self.err = err
        self.failed = 0

    def _maybe_fail(self, name: str, *args: object) -> None:
        if not self.failed and self.fail_on(name, args):
            self.failed += 1
            raise OSError(self.err, f"injected into {name}")

    def rename(self, src: str, dst: str) -> None:
        self._maybe_fail("rename", src, dst)
        super().rename(src, dst)

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        self._maybe_fail("open_create", path, exclusive)
        return super().open_create(path, exclusive=exclusive, append=append)


def test_a_failed_move_to_the_pool_hands_the_cleanup_back(root: str) -> None:
    io = FailingIO(lambda name, args: name == "rename" and "spare." in str(args[1]))
    q = FsQueue(root, io)
    try:
        (h,) = put(q, n=1)
        p = delivered(q, h)
        with pytest.raises(StorageIOError) as ei:
            q.cleanup(p)
        assert io.failed == 1 and q.spare_files == 0
        assert ei.value.handle is p  # handed back: the retry finishes the cleanup
        assert [c.entry_id for c in q.find_pending_cleanup()] == [h.entry_id]
        assert q.cleanup(p) is True
        assert q.spare_files == 1 and q.footprint() == Footprint(0, 0)
        assert list(q.find_pending_cleanup()) == []
    finally:
        q.close()


def test_a_spare_that_cannot_be_opened_is_dropped_and_a_new_file_used(root: str) -> None:
    io = FailingIO(lambda name, args: name == "open_create" and "spare." in str(args[0]),
                   errno.EACCES)
    q = FsQueue(root, io)
    try:
        finish(q, put(q, n=1)[0])
        assert spares_on_disk(q) == ["spare.0"]
        (h,) = put(q, n=1, body=b"fresh\r\n")
        assert io.failed == 1
        assert spares_on_disk(q) == []  # the unusable spare was removed
        assert read_back(q, h) == b"fresh\r\n"
    finally:
        q.close()


def test_a_spare_removed_behind_the_queues_back_is_not_missed(q: FsQueue) -> None:
    finish(q, put(q, n=1)[0])
    os.unlink(os.path.join(q.root, "tmp", q.owner, "spare.0"))
    (h,) = put(q, n=1, body=b"after\r\n")
    assert read_back(q, h) == b"after\r\n"
    finish(q, next(iter(q.list_queue())))
    assert q.footprint() == Footprint(0, 0)


@pytest.mark.parametrize("pieces", [(4000, 2000), (5000, 1)])
def test_a_reader_in_another_process_keeps_its_file_from_reuse(root: str,
                                                               pieces: tuple[int, int]
                                                               ) -> None:
    """Process B inspects a queued message and reads it in pieces while process A
    delivers it, cleans it up (its file becomes A's spare) and enqueues a small message:
    A takes a new file, and B reads the committed bytes, verified, with nothing
    quarantined (two open queues have two owners, spare pools and readers' guards, as
    two processes do; flocks of two open files conflict within one process too)."""
    body = bytes(range(256)) * 20  # 5,120 bytes
    a, b = FsQueue(root), FsQueue(root)
    try:
        (h,) = put(a, n=1, body=body)
        reader = b.inspect_entry(next(iter(b.list_queue())))
        assert reader is not None
        first = reader.read(pieces[0])
        finish(a, h)
        assert a.spare_files == 1
        (small,) = put(a, n=1, body=b"tiny\r\n")
        assert a.spare_files == 0  # the spare was given up, not written into
        assert reader.read(pieces[1]) == body[pieces[0]:pieces[0] + pieces[1]]
        assert first + reader.read() == body[:pieces[0]] + body[pieces[0] + pieces[1]:]
        reader.close()
        assert os.listdir(os.path.join(root, "quarantine")) == []
        assert read_back(a, small) == b"tiny\r\n"
    finally:
        a.close()
        b.close()


def test_an_inspect_after_the_file_was_reused_finds_the_entry_gone(root: str) -> None:
    """B's handle is stale: the message was delivered and its file now holds another
    message of A's.  The inspect answers None (the entry is no longer queued) and never
    reads the other message's bytes as this one's."""
    a, b = FsQueue(root), FsQueue(root)
    try:
        (h,) = put(a, n=1, body=b"first message\r\n")
        stale = next(iter(b.list_queue()))
        finish(a, h)
        put(a, n=1, body=b"second\r\n")
        assert b.inspect_entry(stale) is None
        assert os.listdir(os.path.join(root, "quarantine")) == []
    finally:
        a.close()
        b.close()


def test_a_reader_that_opened_a_file_now_written_as_a_spare_does_not_wait(root: str
                                                                         ) -> None:
    """B opens the message file; before it takes its shared lock, A delivers the message
    and starts writing a large message into the file (its exclusive lock held while the
    body streams in).  B must not wait for that client: the file is no longer the
    message's, and the inspection answers None at once."""
    a, b = FsQueue(root), FsQueue(root)
    try:
        (h,) = put(a, n=1, body=b"first\r\n")
        stale = next(iter(b.list_queue()))
        opened = b.io.open_read

        def open_then_reuse(path: str) -> int:
            fd = opened(path)
            finish(a, h)  # the file becomes A's spare
            writer = a.enqueue("slow@example.com")
            writer.write(b"x" * (1 << 17))  # past the body buffer: the spare is locked
            held.append(writer)
            return fd

        held: list[Any] = []
        b.io.open_read = open_then_reuse  # type: ignore[method-assign]
        assert b.inspect_entry(stale) is None
        b.io.open_read = opened  # type: ignore[method-assign]
        held[0].abort()
    finally:
        a.close()
        b.close()


def test_an_entry_quarantined_by_two_owners_at_once_keeps_its_body_copy(root: str) -> None:
    """A copies the body aside, then finds the entry's link already moved by B, who saw
    A's copy and made none: A keeps its copy (B relies on it)."""
    from queue_ref.fsqueue.layout import EntryName

    a = FsQueue(root)
    try:
        hs = put(a, n=2, body=b"Subject: two\r\n\r\nshared body\r\n")
        e = EntryName(hs[0].message_id, 0)
        link = a.layout.queue_link(e)
        os.rename(link, a.layout.quarantined(f"{e.entry_id}.link"))  # B moved it first
        a._quarantine_entry(e, link, "a damaged schedule record")
        copy = a.layout.quarantined(f"{e.entry_id}.msg")
        with open(copy, "rb") as f, open(a.layout.msg_file(e.msgid), "rb") as g:
            assert f.read() == g.read()
    finally:
        a.close()


class FailsOneCleanupUnlink(OsIO):
    """``unlink`` of a ``cleanup/`` link fails once with EIO, while armed."""

    armed = False

    def unlink(self, path: str) -> None:
        if self.armed and "/cleanup/" in path:
            self.armed = False
            raise OSError(errno.EIO, "injected", path)
        super().unlink(path)


def test_a_spare_still_named_by_a_failed_cleanups_link_does_not_keep_the_next_message(
        root: str) -> None:
    io = FailsOneCleanupUnlink()
    q = FsQueue(root, io)
    try:
        (h,) = put(q, n=1)
        p = delivered(q, h)
        io.armed = True
        with pytest.raises(StorageIOError, match="injected"):
            q.cleanup(p)  # the file is a spare already; its cleanup/ link is left
        for h2 in put(q, n=2):  # the next message (written into the spare, if reused)
            finish(q, h2)
        (left,) = q.find_pending_cleanup()
        assert q.cleanup(left) is True  # the failed cleanup, retried
        assert q.footprint() == Footprint(0, 0)
        assert os.listdir(os.path.join(root, "data")) == []
    finally:
        q.close()
    again = FsQueue(root)
    try:
        assert again.last_recovery is not None and again.last_recovery.lost == ()
    finally:
        again.close()


class _UnlinkKinds(OsIO):
    """Which call removed each message file (``data/<msgid>``; not an entry's link,
    ``data/<msgid>.<i>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    @staticmethod
    def _message_file(path: str) -> bool:
        return os.path.basename(os.path.dirname(path)) == "data" and \
            "." not in os.path.basename(path)

    def unlink(self, path: str) -> None:
        if self._message_file(path):
            self.kinds.append("unlink")
        super().unlink(path)

    def unlink_large(self, path: str) -> None:
        if self._message_file(path):
            self.kinds.append("unlink_large")
        os.unlink(path)


def test_only_a_large_message_file_is_unlinked_with_the_gil_released(root: str) -> None:
    """A message file that is not kept as a spare is unlinked through ``unlink_large``
    (the GIL released while its blocks are freed) only past ``SPARE_MAX_BODY``: a small
    one stays one GIL-keeping call, as the short calls of a lifecycle are."""
    io = _UnlinkKinds()
    q = FsQueue(root, io)
    try:
        for body in (b"Subject: small\r\n\r\nbody\r\n", b"x" * (SPARE_MAX_BODY + 1) + b"\r\n"):
            for m in put(q, 2, body):  # two recipients: never a spare
                f = q.send_start(m)
                assert f is not None
                done = q.send_done(f)
                assert done is not None and q.cleanup(done)
        assert io.kinds == ["unlink", "unlink_large"]
    finally:
        q.close()
