"""cleanup_all (C16): many entries' cleanup in one call.

Each entry is released as its own call would release it; everything is checked before
anything is released; on a disk error the handles of what may not be released come back
live; the filesystem queue looks at a message file's link count once a message, not twice
an entry, and a crash at any of its steps leaves every entry PENDING_CLEANUP or GONE and
nothing behind once recovered.
"""

from __future__ import annotations

import errno
import os

import pytest

from faultinject import FaultPlan, FaultyIO, crash_states, materialize
from faultinject.persistence import MODELS
from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.multi_root import MultiRootQueue
from queue_ref.storage import (
    Footprint,
    MisuseError,
    PendingCleanupMail,
    Storage,
    StorageIOError,
)
from tests.test_send_finish import (
    claimed,
    every_backend,  # noqa: F401  (the ``store`` fixture)
)

BODY = b"Subject: wide\r\n\r\n" + b"body\r\n" * 100


def delivered(s: Storage, n: int) -> list[PendingCleanupMail]:
    done = s.send_finish(claimed(s, n, body=BODY)).done
    assert all(done)
    return [d for d in done if d is not None]


def test_each_entry_is_released_as_its_own_call_would(store: Storage) -> None:
    """Entries of three messages, one of them kept back: the others' messages are freed,
    the one kept back still reads whole, and once it is released nothing is left."""
    a, b, c = delivered(store, 4), delivered(store, 1), delivered(store, 3)
    assert store.cleanup_all([*a, *b, c[0], c[2]]) == [True] * 7
    assert [p.entry_id for p in store.find_pending_cleanup()] == [c[1].entry_id]
    assert store.cleanup_all([c[1]]) == [True]
    assert store.footprint() == Footprint(0, 0)
    assert store.cleanup_all([]) == []


def test_an_entry_released_meanwhile_answers_false_and_the_others_are_released(
        store: Storage) -> None:
    pending = delivered(store, 3)
    stale = next(p for p in store.find_pending_cleanup() if p.entry_id == pending[1].entry_id)
    assert store.cleanup(pending[1])
    assert store.cleanup_all([pending[0], stale, pending[2]]) == [True, False, True]
    assert store.footprint() == Footprint(0, 0)


@pytest.mark.parametrize("bad", ["spent", "twice", "wrong-kind", "not-a-list"])
def test_misuse_anywhere_in_the_batch_releases_nothing(store: Storage, bad: str) -> None:
    pending = delivered(store, 3)
    batch: object = list(pending)
    if bad == "spent":
        extra = delivered(store, 1)[0]
        assert store.cleanup(extra)
        batch = [*pending, extra]
    elif bad == "twice":
        batch = [*pending, pending[0]]
    elif bad == "wrong-kind":
        batch = [*pending, claimed(store, 1)[0]]
    else:
        batch = pending[0]
    with pytest.raises(MisuseError):
        store.cleanup_all(batch)  # type: ignore[arg-type]
    assert sorted(p.entry_id for p in store.find_pending_cleanup()) == sorted(
        p.entry_id for p in pending)
    assert store.cleanup_all(pending) == [True] * 3  # every handle still live


class _CountingIO(OsIO):
    def __init__(self) -> None:
        super().__init__()
        self.lstats = 0

    def lstat(self, path: str) -> os.stat_result:
        self.lstats += 1
        return super().lstat(path)


def test_filesystem_queue_looks_at_a_message_once_not_twice_an_entry(
        tmp_path: os.PathLike[str]) -> None:
    io = _CountingIO()
    q = FsQueue(os.path.join(tmp_path, "q"), io)
    try:
        pending = delivered(q, 100)
        io.lstats = 0
        assert q.cleanup_all(pending) == [True] * 100
        assert io.lstats <= 3, io.lstats
        assert q.footprint() == Footprint(0, 0)
        pending = delivered(q, 100)
        io.lstats = 0
        for p in pending:  # one by one: two looks an entry
            assert q.cleanup(p)
        assert io.lstats >= 198, io.lstats
    finally:
        q.close()


class _FailingUnlink(OsIO):
    """The ``n``th unlink of a name in ``cleanup/`` fails with EIO once armed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.armed = False

    def unlink(self, path: str) -> None:
        if self.armed and "/cleanup/" in path:
            self.n -= 1
            if self.n == 0:
                raise OSError(errno.EIO, "armed fault")
        super().unlink(path)


@pytest.mark.parametrize("kind", ["fs", "default"])
def test_a_disk_error_hands_back_what_may_not_be_released(tmp_path: os.PathLike[str],
                                                          kind: str) -> None:
    """The third entry's link cannot be unlinked: the first two are released, the error
    hands back live handles of the others, and a retry with them releases everything
    (``default``: Storage's one-by-one batch, which the filesystem queue overrides)."""
    io = _FailingUnlink(3)
    q = FsQueue(os.path.join(tmp_path, "q"), io)
    try:
        pending = delivered(q, 5)
        io.armed = True
        batch = Storage.cleanup_all if kind == "default" else FsQueue.cleanup_all
        with pytest.raises(StorageIOError) as err:
            batch(q, pending)
        e = err.value
        assert e.handle is None
        assert [h.entry_id for h in e.handles] == [p.entry_id for p in pending[2:]]
        assert all(isinstance(h, PendingCleanupMail) and h._live for h in e.handles)
        assert q.cleanup_all(list(e.handles)) == [True] * 3  # type: ignore[arg-type]
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()


class _ThirdReleaseFails(FsQueue):
    """An error no backend should raise, from the third release of a batch."""

    releases = 0

    def _release_entry(self, h: PendingCleanupMail, *, shared: bool = False) -> bool:
        self.releases += 1
        if self.releases == 3:
            raise RuntimeError("injected")
        return super()._release_entry(h, shared=shared)


def test_an_unexpected_error_gives_back_the_handles_of_what_was_not_released(
        tmp_path: os.PathLike[str]) -> None:
    """The relay then releases each of them on its own (found by a cold review: every
    handle stayed spent, and the entries waited for the next recovery)."""
    q = _ThirdReleaseFails(os.path.join(tmp_path, "q"))
    try:
        pending = delivered(q, 5)
        with pytest.raises(RuntimeError):
            q.cleanup_all(pending)
        assert [p._live for p in pending] == [False, False, True, True, True]
        assert [q.cleanup(p) for p in pending[2:]] == [True] * 3
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()


def test_multi_root_batch_spans_the_roots_and_a_failing_root_says_what_is_left(
        tmp_path: os.PathLike[str]) -> None:
    roots = [os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")]
    q = MultiRootQueue.open_fs(roots)
    try:
        pending = [p for _ in range(4) for p in delivered(q, 2)]
        assert len({p.entry_id[:3] for p in pending}) == 2  # both roots hold some
        assert q.cleanup_all(pending) == [True] * 8
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()
    ios = {r: _FailingUnlink(1) for r in roots}
    q = MultiRootQueue.over(roots, lambda r: FsQueue(r, ios[r]))
    try:
        pending = [p for _ in range(4) for p in delivered(q, 2)]
        first = pending[0].entry_id[:3]  # its root's entries go first
        ios[roots[1] if first == "r0-" else roots[0]].armed = True
        with pytest.raises(StorageIOError) as err:
            q.cleanup_all(pending)
        left = err.value.handles
        assert {h.entry_id for h in left} == {p.entry_id for p in pending
                                               if p.entry_id[:3] != first}
        assert q.cleanup_all(list(left)) == [True] * len(left)  # type: ignore[arg-type]
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()


def test_a_crash_at_any_step_leaves_each_entry_pending_or_gone_and_nothing_behind(
        tmp_path: os.PathLike[str]) -> None:
    """Two messages of three recipients, five entries delivered and released in one
    batch: a crash after any call of the batch, under every persistence model, recovers
    to the entry kept back alone, whole, and once it is delivered nothing is left (a
    message file the batch took all names from but its own is the cleanup's orphan,
    removed by recovery: C8)."""
    root = os.path.join(tmp_path, "q")
    os.mkdir(root)
    io = FaultyIO(root)
    q = FsQueue(root, io)
    a, b = delivered(q, 3), claimed(q, 3, body=BODY)
    done = [d for d in q.send_finish(b[:2]).done if d is not None]
    kept = b[2]
    start = len(io.events)
    assert q.cleanup_all([*a, *done]) == [True] * 5
    events = list(io.events)
    q.close()
    assert len(events) - start >= 10
    checked = 0
    for end in range(start, len(events) + 1):
        for model in sorted(MODELS):
            for st in crash_states(io.initial, events[:end], model, exhaustive_limit=6,
                                   random_states=4):
                where = os.path.join(tmp_path, f"c{checked}")
                materialize(st.image, where)
                again = FsQueue(where)
                try:
                    (h,) = again.list_queue()
                    assert h.entry_id == kept.entry_id, (end, model, st.description)
                    assert list(again.find_pending_cleanup()) == []
                    started = again.send_start(h)
                    assert started is not None
                    with again.read_inflight(started) as r:
                        assert r.read_all() == BODY
                    finished = again.send_done(started)
                    assert finished is not None and again.cleanup(finished)
                    assert again.footprint() == Footprint(0, 0), (end, model, st.description)
                finally:
                    again.close()
                checked += 1
    assert checked > len(events) - start


def test_fault_plan_failures_inside_the_batch_are_storage_errors(
        tmp_path: os.PathLike[str]) -> None:
    """Every mutating call of a batch failing in turn (EIO): a StorageIOError each time,
    and a retry with the handles it gives back releases the rest."""
    for k in range(6):
        root = os.path.join(tmp_path, f"q{k}")
        os.mkdir(root)
        io = FaultyIO(root)
        q = FsQueue(root, io)
        try:
            pending = delivered(q, 4)
            io.plan = FaultPlan(fail_at=io.mutating_count + k, fail_errno=errno.EIO)
            with pytest.raises(StorageIOError) as err:
                q.cleanup_all(pending)
            io.plan = FaultPlan()
            left = list(err.value.handles)
            # exactly the entries still PENDING_CLEANUP: none released is handed back
            # (a retry would answer False), none left out (it would wait for recovery)
            assert left and sorted(h.entry_id for h in left) == sorted(
                p.entry_id for p in q.find_pending_cleanup())
            assert q.cleanup_all(left) == [True] * len(left)  # type: ignore[arg-type]
            assert list(q.find_pending_cleanup()) == []
            assert q.footprint() == Footprint(0, 0)
        finally:
            q.close()
