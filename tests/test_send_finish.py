"""send_finish (C15): many entries' send_done and send_cancel in one call.

Each entry moves as its own call would; everything is checked before anything moves; on
a disk error every handle comes back live for the old state; the filesystem queue needs
a fixed number of sync rounds whatever the batch holds, the KV queue one synced write.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator

import pytest

from conformance.examples import backends
from faultinject import FaultPlan, FaultyIO, crash_states, materialize
from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.memory import MemoryStorage
from queue_ref.multi_root import MultiRootQueue
from queue_ref.storage import (
    Finished,
    InflightMail,
    InvalidInputError,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
    StorageIOError,
)

OPENERS: dict[str, Callable[[str], Storage]] = {
    "fs": backends.fs,
    "fs_fsync": backends.fs_fsync,
    "fs_two_roots": backends.fs_two_roots,
    "kv_log": backends.kv_log,
    "kv_leveldb": backends.kv_leveldb,
    "memory": lambda root: MemoryStorage(),
}


@pytest.fixture(params=sorted(OPENERS), name="store")
def every_backend(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]
                  ) -> Iterator[Storage]:
    """A queue of each backend (``store``; tests/test_cleanup_all.py uses it too)."""
    s = OPENERS[request.param](os.path.join(tmp_path, "q"))
    yield s
    s.close()


def claimed(s: Storage, n: int, *, sender: str = "s@example.org",
            body: bytes = b"Subject: wide\r\n\r\nbody\r\n") -> list[InflightMail]:
    """A message of ``n`` recipients, every entry claimed."""
    with s.enqueue(sender) as enq:
        enq.write(body)
        queued = enq.commit([Recipient(f"r{i}@d{i % 3}.example", Schedule(0, 0))
                             for i in range(n)])
    out = []
    for q in queued:
        got = s.send_start(q)
        assert got is not None
        out.append(got)
    return out


def listed(s: Storage) -> dict[str, Schedule]:
    return {q.entry_id: q.schedule for q in s.list_queue()}


def test_each_entry_moves_as_its_own_call_would(store: Storage) -> None:
    mails = claimed(store, 7)
    later = [Schedule(5000 + i, 1, f"451 4.3.0 try later {i}\r\nline two") for i in range(3)]
    got = store.send_finish(mails[:4], list(zip(mails[4:], later, strict=True)))
    assert isinstance(got, Finished)
    assert [type(h) for h in got.done] == [PendingCleanupMail] * 4
    assert [type(h) for h in got.cancelled] == [QueuedMail] * 3
    assert [h.entry_id for h in got.done] == [m.entry_id for m in mails[:4]]
    assert [h.schedule for h in got.cancelled if h] == later
    assert listed(store) == {m.entry_id: s for m, s in zip(mails[4:], later, strict=True)}
    assert {p.entry_id for p in store.find_pending_cleanup()} >= {
        h.entry_id for h in got.done if h}
    for h in got.done:
        assert h is not None and store.cleanup(h)
    for q in got.cancelled:  # the requeued entries go on like any other
        assert q is not None
        inflight = store.send_start(q)
        assert inflight is not None
        pending = store.send_done(inflight)
        assert pending is not None and store.cleanup(pending)
    assert store.footprint().objects == 0


@pytest.mark.parametrize("kind", sorted(set(OPENERS) - {"fs_two_roots"}))
def test_an_entry_no_longer_inflight_answers_none_and_the_others_move(
        kind: str, tmp_path: os.PathLike[str]) -> None:
    store = OPENERS[kind](os.path.join(tmp_path, "q"))
    mails = claimed(store, 3)
    # the first entry is finished meanwhile, and the batch names it through a copy of
    # its handle (what a sender holding a stale copy would pass; the composite handles
    # of several roots cannot be copied so)
    pending = store.send_done(mails[0])
    assert pending is not None
    stale = InflightMail(mails[0].entry_id, mails[0].message_id, mails[0].schedule,
                         mails[0]._owner, True, mails[0]._extra)
    got = store.send_finish([stale, mails[1]], [(mails[2], Schedule(9, 1))])
    assert got.done[0] is None
    assert got.done[1] is not None and got.cancelled[0] is not None
    assert list(listed(store)) == [mails[2].entry_id]
    store.close()


def test_empty_batch_changes_nothing(store: Storage) -> None:
    assert store.send_finish() == Finished([], [])


@pytest.mark.parametrize("bad", ["twice", "stale", "queued_handle", "schedule", "pair"])
def test_misuse_anywhere_in_the_batch_moves_nothing(store: Storage, bad: str) -> None:
    mails = claimed(store, 3)
    done: list[object] = [mails[0], mails[1]]
    cancel: list[object] = [(mails[2], Schedule(7, 1))]
    err: type[Exception] = MisuseError
    if bad == "twice":
        done.append(mails[0])
    elif bad == "stale":
        used = claimed(store, 1)[0]
        assert store.send_done(used) is not None
        done.append(used)
    elif bad == "queued_handle":
        with store.enqueue("x@example.org") as enq:
            enq.write(b"x\r\n")
            (q,) = enq.commit([Recipient("y@example.org", Schedule(0))])
        done.append(q)
    elif bad == "schedule":
        cancel = [(mails[2], "soon")]
        err = InvalidInputError
    else:
        cancel = [mails[2]]
    before = listed(store)
    with pytest.raises(err):
        store.send_finish(done, cancel)  # type: ignore[arg-type]
    assert listed(store) == before
    # every handle is still live: the same batch without the bad part goes through
    got = store.send_finish(mails[:2], [(mails[2], Schedule(7, 1))])
    assert all(got.done) and all(got.cancelled)


def test_filesystem_queue_syncs_a_hundred_outcomes_in_three_rounds(tmp_path: os.PathLike[str]
                                                                   ) -> None:
    for mode in ("syncfs", "fsync"):
        q = FsQueue(os.path.join(tmp_path, mode), sync=mode)
        try:
            mails = claimed(q, 100)
            rounds = q._group.rounds
            got = q.send_finish(mails[:60], [(m, Schedule(99, 1, "busy")) for m in mails[60:]])
            assert all(got.done) and all(got.cancelled)
            assert q._group.rounds - rounds <= 3, mode
            mails = [q.send_start(h) for h in got.cancelled if h]
            rounds = q._group.rounds
            assert all(q.send_finish([m for m in mails if m]).done)
            assert q._group.rounds - rounds == 1, mode
            # one by one, the same outcomes took a round each at least
            more = claimed(q, 10)
            rounds = q._group.rounds
            for m in more:
                q.send_done(m)
            assert q._group.rounds - rounds >= 10
        finally:
            q.close()


class _FailingSync(OsIO):
    """Fails every fsync/syncfs once armed, as a disk that stopped writing does."""

    armed = False

    def fsync(self, fd: int) -> None:
        if self.armed:
            raise OSError(errno.EIO, "armed fault")
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        if self.armed:
            raise OSError(errno.EIO, "armed fault")
        super().fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        if self.armed:
            raise OSError(errno.EIO, "armed fault")
        super().fsync_dir(path)

    def syncfs(self, path: str) -> None:
        if self.armed:
            raise OSError(errno.EIO, "armed fault")
        super().syncfs(path)


@pytest.mark.parametrize("kind", ["fs", "kv_log"])
def test_a_failed_sync_hands_every_handle_back_and_recovery_keeps_old_or_new(
        tmp_path: os.PathLike[str], kind: str) -> None:
    root = os.path.join(tmp_path, "q")
    io = _FailingSync()
    s: Storage = FsQueue(root, io) if kind == "fs" else KvQueue.open_log(root, io)
    mails = claimed(s, 6)
    io.armed = True
    with pytest.raises(StorageIOError) as err:
        s.send_finish(mails[:3], [(m, Schedule(77, 1, "later")) for m in mails[3:]])
    e = err.value
    assert e.handle is None
    assert [h.entry_id for h in e.handles] == [m.entry_id for m in mails]
    assert all(isinstance(h, InflightMail) and h._live for h in e.handles)
    s.close()
    io.armed = False
    again: Storage = FsQueue(root, io) if kind == "fs" else KvQueue.open_log(root, io)
    try:
        queued = listed(again)
        ids = [m.entry_id for m in mails]
        for i, eid in enumerate(ids):  # each entry on its own: old (requeued) or new
            if eid in queued:
                old_or_new = {Schedule(0, 0)} | ({Schedule(77, 1, "later")} if i >= 3 else set())
                assert queued[eid] in old_or_new, (eid, queued[eid])
            else:
                assert i < 3, f"cancelled entry {eid} was lost"
    finally:
        again.close()


def test_multi_root_batch_spans_the_roots(tmp_path: os.PathLike[str]) -> None:
    q = MultiRootQueue.open_fs([os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")])
    try:
        mails = [m for _ in range(4) for m in claimed(q, 2)]
        assert len({m.entry_id[:3] for m in mails}) == 2  # both roots hold some
        got = q.send_finish(mails[:5], [(m, Schedule(3, 1)) for m in mails[5:]])
        assert all(got.done) and all(got.cancelled)
        assert sorted(listed(q)) == sorted(m.entry_id for m in mails[5:])
    finally:
        q.close()


class _FailSecondCleanupRename(FaultyIO):
    """The second rename into ``cleanup/`` of the armed batch fails with ENOSPC (a link
    directory that cannot grow), after the first one moved."""

    armed = False
    seen = 0

    def rename(self, src: str, dst: str) -> None:
        if self.armed and "/cleanup/" in dst:
            self.seen += 1
            if self.seen == 2:
                self.plan = FaultPlan(fail_at=self.mutating_count, fail_errno=errno.ENOSPC)
        super().rename(src, dst)


@pytest.mark.parametrize("mode", ["syncfs", "fsync"])
def test_links_moved_before_a_failed_rename_are_durable_and_handed_back_new(
        tmp_path: os.PathLike[str], mode: str) -> None:
    """A batch whose second link rename fails: the first entry's move is made durable
    before the error (a retry through its old handle would answer None and sync nothing,
    and a power cut would bring the delivered entry back: C3), and the error's
    ``finished`` hands back its new handle; no crash state of any model requeues it."""
    root = os.path.join(tmp_path, "q")
    os.mkdir(root)
    io = _FailSecondCleanupRename(root)
    q = FsQueue(root, io, sync=mode)
    a, b, c = claimed(q, 3)
    io.armed = True
    with pytest.raises(StorageIOError) as err:
        q.send_finish([a, b], [(c, Schedule(50, 1, "later"))])
    e = err.value
    assert e.finished is not None
    assert isinstance(e.finished.done[0], PendingCleanupMail)
    (back,) = e.finished.cancelled  # moved back before the done links, and made durable
    assert e.finished.done[1] is None and isinstance(back, QueuedMail)
    assert (back.entry_id, back.schedule) == (c.entry_id, Schedule(50, 1, "later"))
    assert q.send_done(a) is None  # the old handle: the entry is no longer INFLIGHT
    events = list(io.events)
    q.close()
    for model in ("ext4-ordered", "weak"):
        for st in crash_states(io.initial, events, model, exhaustive_limit=8,
                               random_states=8):
            d = os.path.join(tmp_path, f"s{model}{st.key}")
            materialize(st.image, d)
            r = FsQueue(d, sync=mode)
            try:
                assert a.entry_id not in listed(r), (model, st.key, st.description)
            finally:
                r.close()


class SecondDoneFails(MemoryStorage):
    """A memory queue whose second ``send_done`` fails as a disk does."""

    calls = 0

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        self.calls += 1
        if self.calls == 2:
            h = self._take(mail, InflightMail)
            raise StorageIOError("EIO", self._give_back(h))
        return super().send_done(mail)


def test_the_default_batch_hands_back_what_it_finished_before_a_failure() -> None:
    s = SecondDoneFails()
    mails = claimed(s, 3)
    with pytest.raises(StorageIOError) as err:
        s.send_finish(mails)
    e = err.value
    assert e.finished is not None
    assert isinstance(e.finished.done[0], PendingCleanupMail)
    assert e.finished.done[1:] == [None, None]
    assert [h.entry_id for h in e.handles] == [m.entry_id for m in mails]
    assert s.cleanup(e.finished.done[0])  # the handle the error gave is live
    again = s.send_finish(list(e.handles[1:]))  # type: ignore[arg-type]
    assert all(again.done)


class _CountingSyncs(OsIO):
    syncs = 0

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self.syncs += 1
        super().fsync(fd)


@pytest.mark.parametrize("part", [None, 1])
def test_a_multi_root_batch_is_one_durable_step_per_root(tmp_path: os.PathLike[str],
                                                          part: int | None) -> None:
    """Over KV roots, each root's outcomes go in one ``send_finish`` of that root: one
    synced write, not one per recipient (a relay worker serving one root of a KV queue,
    ``part``, took 50 synced writes for 50 recipients before)."""
    io = _CountingSyncs()
    roots = [os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")]
    q = MultiRootQueue.over(roots, lambda p: KvQueue.open_log(p, io), part=part)
    try:
        mails = [m for _ in range(2) for m in claimed(q, 25)]
        assert len({m.entry_id[:3] for m in mails}) == (2 if part is None else 1)
        before = io.syncs
        got = q.send_finish(mails[:40], [(m, Schedule(9, 1, "later")) for m in mails[40:]])
        assert all(got.done) and all(got.cancelled)
        assert [h.entry_id for h in got.done] == [m.entry_id for m in mails[:40]]
        assert [h.entry_id for h in got.cancelled] == [m.entry_id for m in mails[40:]]
        assert io.syncs - before == (2 if part is None else 1)
        assert sorted(listed(q)) == sorted(m.entry_id for m in mails[40:])
    finally:
        q.close()


def test_a_multi_root_batch_failing_in_its_second_root_says_what_moved() -> None:
    """Root r0 moves its entries, root r1 fails after its first: ``finished`` holds the
    new handles of those three, every handle comes back live, and a retry through them
    moves the rest and answers None for what moved."""
    q = MultiRootQueue({"a": MemoryStorage, "b": SecondDoneFails})
    try:
        mails = [m for _ in range(2) for m in claimed(q, 1)]
        mails += [m for _ in range(4) for m in claimed(q, 1)]
        mails.sort(key=lambda m: m.entry_id)  # r0's three, then r1's three
        assert [m.entry_id[:3] for m in mails] == ["r0-"] * 3 + ["r1-"] * 3
        with pytest.raises(StorageIOError) as err:
            q.send_finish(mails)
        e = err.value
        assert e.finished is not None and e.handle is None
        moved = [h is not None for h in e.finished.done]
        assert moved == [True, True, True, True, False, False]
        assert [h.entry_id for h in e.finished.done if h] == [m.entry_id for m in mails[:4]]
        assert [h.entry_id for h in e.handles] == [m.entry_id for m in mails]
        assert all(h._live for h in e.handles)
        again = q.send_finish(list(e.handles))  # type: ignore[arg-type]
        assert [h is not None for h in again.done] == [False] * 4 + [True, True]
        assert all(q.cleanup(h) for h in [*e.finished.done[:4], *again.done[4:]] if h)
        assert listed(q) == {} and list(q.find_pending_cleanup()) == []
    finally:
        q.close()
