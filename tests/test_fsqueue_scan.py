"""The filesystem queue's ``scan_queue`` (``mailq``, ``qshape``): every QUEUED and HELD
entry once, as the handle of its state, in directory order, a message's entries of one
state together; the first entry after one name whatever the queue holds; a message whose
low entries are gone costs about one look per entry; entries that move while a scan is
paused are given as they are when it reaches them."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.storage import HeldMail, QueuedMail, Recipient, Schedule

FATES = ("queued", "held", "inflight", "delivered", "cleaned")


class CountingIO(OsIO):
    """The real disk; counts the names each ``iter_names`` gave and every ``lstat``."""

    def __init__(self) -> None:
        super().__init__()
        self.pulled = 0
        self.listed = 0
        self.lstats = 0

    def iter_names(self, path: str) -> Iterator[str]:
        for name in super().iter_names(path):
            self.pulled += 1
            yield name

    def listdir(self, path: str, *, ordered: bool = True) -> list[str]:
        names = super().listdir(path, ordered=ordered)
        self.listed += len(names)
        return names

    def lstat(self, path: str) -> os.stat_result:
        self.lstats += 1
        return super().lstat(path)


def put(q: FsQueue, rcpts: int, tag: str = "m") -> list[QueuedMail]:
    with q.enqueue(f"{tag}@example.org") as enq:
        enq.write(b"Subject: scan\r\n\r\nbody\r\n")
        return enq.commit([Recipient(f"{tag}.{i}@example.net", Schedule(1000 + i, i % 3))
                           for i in range(rcpts)])


def runs(handles: list[QueuedMail | HeldMail]) -> list[tuple[str, str]]:
    """(kind, message id) of each run of entries given one after another."""
    out: list[tuple[str, str]] = []
    for h in handles:
        key = (type(h).__name__, h.message_id)
        if not out or out[-1] != key:
            out.append(key)
    return out


@given(st.lists(st.lists(st.sampled_from(FATES), min_size=1, max_size=6),
                min_size=1, max_size=8))
def test_scan_gives_every_queued_and_held_entry_once_with_its_messages_entries_together(
        fates: list[list[str]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        q = FsQueue(os.path.join(d, "q"))
        try:
            want: dict[str, type] = {}
            for m, fate in enumerate(fates):
                for h, f in zip(put(q, len(fate), f"m{m}"), fate, strict=True):
                    if f == "queued":
                        want[h.entry_id] = QueuedMail
                    elif f == "held":
                        assert q.hold(h) is not None
                        want[h.entry_id] = HeldMail
                    else:
                        inflight = q.send_start(h)
                        assert inflight is not None
                        if f != "inflight":
                            done = q.send_done(inflight)
                            assert done is not None
                            if f == "cleaned":
                                assert q.cleanup(done)
            got = list(q.scan_queue())
            assert {h.entry_id: type(h) for h in got} == want
            assert len(got) == len(want)
            # a message's entries together, held ones among its queued ones, once
            by_message = [h.message_id for h in got]
            met = [mid for mid, _ in itertools.groupby(by_message)]
            assert len(met) == len(set(met)), runs(got)
            for h in got:  # each in index order within its message, with its schedule
                index = int(h.entry_id.rpartition(".")[2])
                assert h.schedule == Schedule(1000 + index, index % 3)
            in_order = [int(h.entry_id.rpartition(".")[2]) for h in got]
            for mid in set(by_message):
                mine = [i for h, i in zip(got, in_order, strict=True) if h.message_id == mid]
                assert mine == sorted(mine)
            ordered = {h.entry_id for h in q.list_queue()} | {h.entry_id for h in q.list_held()}
            assert ordered == set(want)
        finally:
            q.close()


def test_the_first_entry_comes_after_one_name_whatever_the_queue_holds(tmp_path: Path) -> None:
    """The scan reads names as it goes; the ordered listing (``list_queue``, oldest
    message first) must read every name before its first entry."""
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io=io)
    try:
        for i in range(2000):
            put(q, 1, f"m{i}")
        io.pulled = io.listed = 0
        scan = q.scan_queue()
        first = next(scan)
        assert isinstance(first, QueuedMail)
        assert io.pulled == 1 and io.listed == 0
        assert first.entry_id == os.listdir(tmp_path / "q" / "queue")[0]
        scan.close()
        ordered = q.list_queue()
        next(ordered)
        assert io.listed == 2000
        ordered.close()
    finally:
        q.close()


def test_a_message_whose_low_entries_are_gone_costs_about_one_look_per_entry(
        tmp_path: Path) -> None:
    """300 recipients, the first 200 delivered and cleaned up, 20 of the rest held: the
    entry first met looks down past the gap once; every other one finds the next lower
    at its first look (looking up from index 0 each time would cost 80 x 200 looks)."""
    io = CountingIO()
    q = FsQueue(str(tmp_path / "q"), io=io)
    try:
        handles = put(q, 300)
        for h in handles[:200]:
            inflight = q.send_start(h)
            assert inflight is not None
            done = q.send_done(inflight)
            assert done is not None and q.cleanup(done)
        for h in handles[250:270]:
            assert q.hold(h) is not None
        io.lstats = 0
        got = list(q.scan_queue())
        assert io.lstats < 1500, io.lstats
        # the held entries with the queued ones, in index order
        assert runs(got) == [("QueuedMail", handles[0].message_id),
                             ("HeldMail", handles[0].message_id),
                             ("QueuedMail", handles[0].message_id)]
        assert [h.entry_id for h in got] == [h.entry_id for h in handles[200:]]
    finally:
        q.close()


def test_entries_moved_while_a_scan_is_paused_are_given_as_they_are_when_it_reaches_them(
        tmp_path: Path) -> None:
    """The scan is paused after its first entry (its directory buffer holds every name
    by then); ten entries are then claimed and ten held.  The claimed ones are not given,
    the held ones are given once, as held, and every other entry once, as queued."""
    q = FsQueue(str(tmp_path / "q"))
    try:
        for i in range(60):
            put(q, 1, f"m{i}")
        scan = q.scan_queue()
        first = next(scan)
        rest = [h for h in q.list_queue() if h.entry_id != first.entry_id]
        claimed = {h.entry_id for h in rest[:10] if q.send_start(h) is not None}
        held = {h.entry_id for h in rest[10:20] if q.hold(h) is not None}
        assert len(claimed) == len(held) == 10
        got = [first, *scan]
        ids = [h.entry_id for h in got]
        assert len(ids) == len(set(ids)) == 50
        assert not claimed & set(ids)
        assert {h.entry_id for h in got if isinstance(h, HeldMail)} == held
        assert {h.entry_id for h in got if isinstance(h, QueuedMail)} == \
            {first.entry_id} | {h.entry_id for h in rest[20:]}
    finally:
        q.close()


def _met_last(q: FsQueue, root: Path, rcpts: int, index: int) -> str:
    """A message of ``rcpts`` recipients whose entry ``index`` comes last in queue/'s
    directory order (ext4's hash order, tried until it does)."""
    for _ in range(400):
        mid = put(q, rcpts)[0].message_id
        order = [n for n in os.listdir(root / "queue") if n.startswith(mid)]
        if order[-1] == f"{mid}.{index}":
            return mid
    raise AssertionError("no message met that entry last")


def test_a_corrupt_lowest_entry_is_quarantined_and_its_siblings_still_given_once(
        tmp_path: Path) -> None:
    """No concurrent change: entry .0's schedule record is damaged and .0 comes after .1
    and .2 in the directory.  .1 and .2 were passed over for .0, which the scan then
    quarantines: they must still be given, once (found by a cold review: they were
    given by list_queue and not by scan_queue)."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    try:
        mid = _met_last(q, root, 3, 0)
        (root / "data" / f"{mid}.0.sched").write_bytes(b"not a schedule record")
        got = [h.entry_id for h in q.scan_queue() if h.message_id == mid]
        assert got == [f"{mid}.1", f"{mid}.2"]
        assert sorted(h.entry_id for h in q.list_queue() if h.message_id == mid) == got
    finally:
        q.close()


def test_junk_at_an_entrys_name_neither_hides_nor_repeats_its_siblings(tmp_path: Path) -> None:
    """A directory at .0's name, met after .1: .1 and .2 are given once; a directory is
    no link, so it gives nothing when met."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    try:
        mid = _met_last(q, root, 3, 0)
        os.unlink(root / "queue" / f"{mid}.0")
        os.mkdir(root / "queue" / f"{mid}.0")
        got = [h.entry_id for h in q.scan_queue() if h.message_id == mid]
        assert got == [f"{mid}.1", f"{mid}.2"]
    finally:
        q.close()


def test_a_name_with_a_huge_index_costs_a_few_looks(tmp_path: Path) -> None:
    """A stray name ``<msgid>.300000`` of a one-recipient message, and one of no message:
    the scan looks no lower than the message's recipients (it made an lstat per index
    below the name's, 300,000 of them, found by a cold review)."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    h = put(q, 1)[0]
    q.close()
    os.link(root / "data" / h.message_id, root / "queue" / f"{h.message_id}.300000")
    (root / "queue" / f"{'0' * 38}.300000").write_bytes(b"")
    io = CountingIO()
    q = FsQueue(str(root), io=io, recover=False)
    try:
        assert [x.entry_id for x in q.scan_queue()] == [h.entry_id]
        assert io.lstats < 20, io.lstats
    finally:
        q.close()


def test_a_held_entry_beside_a_corrupt_queued_one_is_given_once(tmp_path: Path) -> None:
    """No concurrent change: entry .0 is queued with a damaged schedule record, .1 is
    held.  The queue/ pass quarantines .0 and gives .1 with its message; the held/ pass
    must not give .1 again although no queued entry of the message is left (found by a
    cold review: mailq counted that recipient twice)."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    try:
        h = put(q, 2)
        q0 = q.reschedule(h[0], Schedule(5, 1, "451 later"))
        assert q0 is not None and q.hold(h[1]) is not None
        (record,) = [n for n in os.listdir(root / "data") if n.endswith(".sched")]
        with open(root / "data" / record, "r+b") as f:
            f.write(b"garbage!")
        got = [(type(x).__name__, x.entry_id) for x in q.scan_queue()]
        assert got == [("HeldMail", h[1].entry_id)]
        assert any(n.startswith(h[0].entry_id) for n in os.listdir(root / "quarantine"))
    finally:
        q.close()
