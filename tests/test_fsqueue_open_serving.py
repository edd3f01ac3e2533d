"""Opening a filesystem queue for a relay (``opener.open_serving``): without its
recovery when every owner closed, the recovery then run beside it through a second
owner; with it when a process died holding the queue (``FsQueue.dead_owners``)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.recover_child import report_from_json, report_json
from queue_ref.io import IO
from queue_ref.opener import open_serving
from queue_ref.storage import Recipient, RecoveryReport, Schedule, StorageIOError

DEAD = "b" * 16  # an owner token no open queue holds


def put(q: FsQueue, n: int, at: int = 0) -> None:
    """``n`` messages of one recipient, committed by 8 threads (sharing sync rounds)."""
    def one(i: int) -> None:
        with q.enqueue("s@example.org") as enq:
            enq.write(b"Subject: x\r\n\r\nbody\r\n")
            enq.commit([Recipient(f"r{i}@example.net", Schedule(at))])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def owners(root: Path) -> list[str]:
    return sorted(os.listdir(root / "owners"))



def _messages_of(q: FsQueue, sizes: tuple[int, ...]) -> list[str]:
    """Commit one message per size, of that many recipients; their entry ids in order."""
    want: list[str] = []
    for n in sizes:
        with q.enqueue("s@example.org") as enq:
            enq.write(b"Subject: x\r\n\r\nbody\r\n")
            want += [h.entry_id for h in enq.commit(
                [Recipient(f"r{i}@example.net", Schedule(0)) for i in range(n)])]
    return want

def test_a_cleanly_closed_queue_opens_without_recovery_and_recovers_beside(
        tmp_path: Path) -> None:
    root = tmp_path / "q"
    with FsQueue(str(root)) as q:
        put(q, 3)
        claimed = q.send_start(next(q.list_queue()))  # left inflight by a closed owner
        assert claimed is not None
    store, recover = open_serving(str(root))
    try:
        assert isinstance(store, FsQueue) and store.last_recovery is None
        assert recover is not None and store.dead_owners() == []
        assert len(list(store.list_queue())) == 2  # the claimed entry is not queued yet
        put(store, 1)  # commits go on while (here: before) the recovery runs
        report = recover()
        assert report.requeued == 1
        assert len(list(store.list_queue())) == 4
        assert owners(root) == sorted(["gate.lock", f"{store.owner}.lock"])
    finally:
        store.close()


def test_a_dead_owner_makes_the_whole_recovery_run_at_opening(tmp_path: Path) -> None:
    root = tmp_path / "q"
    with FsQueue(str(root)) as q:
        put(q, 2)
    (root / "owners" / f"{DEAD}.lock").touch()
    store, recover = open_serving(str(root))
    try:
        assert recover is None and store.last_recovery is not None
        assert owners(root) == sorted(["gate.lock", f"{store.owner}.lock"])  # exclusive
        assert store.dead_owners() == []
    finally:
        store.close()


def test_a_recovery_beside_a_live_owner_keeps_a_dead_owners_lock_file(tmp_path: Path) -> None:
    """Only an exclusive recovery sweeps a dead owner's orphans, so only it forgets the
    owner: until then the next opening knows a process died (``dead_owners``)."""
    root = tmp_path / "q"
    live = FsQueue(str(root))
    try:
        (root / "owners" / f"{DEAD}.lock").touch()
        (root / "tmp" / ("c" * 16)).mkdir()  # a power cut took its owner's lock file
        assert live.dead_owners() == [DEAD, "c" * 16]
        with FsQueue(str(root)):  # recovers beside ``live``: not exclusive
            pass
        assert f"{DEAD}.lock" in owners(root)
        assert live.dead_owners() == [DEAD]
    finally:
        live.close()
    store, recover = open_serving(str(root))
    try:
        assert recover is None
        assert owners(root) == sorted(["gate.lock", f"{store.owner}.lock"])
    finally:
        store.close()


def test_other_backends_open_with_their_recovery(tmp_path: Path) -> None:
    store, recover = open_serving(str(tmp_path / "q"), "kv-log")
    try:
        assert recover is None and type(store).__name__ == "KvQueue"
    finally:
        store.close()


def test_listing_keeps_message_order_and_holds_no_object_per_name(tmp_path: Path) -> None:
    """``list_queue`` sorts the names as strings and parses one message's at a time:
    oldest message first, each message's entries by index (12 recipients: index 10
    after 9), junk skipped; the first entry costs the names, not an object per name."""
    root = tmp_path / "q"
    with FsQueue(str(root)) as q:
        want = _messages_of(q, (12, 1, 3))
        (root / "queue" / "junk").symlink_to("../data/junk")
        assert [h.entry_id for h in q.list_queue()] == want
        put(q, 3000)
        names = os.listdir(root / "queue")
        tracemalloc.start()
        try:
            first = next(q.list_queue())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert first.entry_id == want[0]
        per_name = peak / len(names)
        assert per_name < 150, f"{per_name:.0f} bytes a name"  # an EntryName more: ~180


class CountedName(str):
    """A directory entry's name that counts the comparisons made of it (``<``: what
    sorting and heaps use)."""

    compared = 0

    def __lt__(self, other: str) -> bool:
        CountedName.compared += 1
        return str.__lt__(self, other)


class ShuffledIO(IO):
    """The real disk, but each directory's names come in a shuffled order, counted."""

    def listdir(self, path: str, *, ordered: bool = True) -> list[str]:
        names: list[str] = [CountedName(n) for n in os.listdir(path)]
        random.Random(len(names)).shuffle(names)
        if ordered:
            names.sort()
        return names


def test_the_first_entry_costs_one_pass_over_the_names_in_any_directory_order(
        tmp_path: Path) -> None:
    """Names out of directory order are still listed oldest message first (index 10
    after 9), and the first entry of N names costs O(N) comparisons of names, not the
    N log N of sorting them all first (about 11 N here): ``mailq``'s first line at a
    million queued."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    try:
        want = _messages_of(q, (12, 1, 3))
        put(q, 3000)
    finally:
        q.close()
    want += sorted((n for n in os.listdir(root / "queue") if n not in want),
                   key=lambda n: (n.split(".")[0], int(n.split(".")[1])))
    with FsQueue(str(root), io=ShuffledIO(), recover=False) as shuffled:
        assert [h.entry_id for h in shuffled.list_queue()] == want
        CountedName.compared = 0
        assert next(shuffled.list_queue()).entry_id == want[0]
        n = len(want)
        assert CountedName.compared < 3 * n, f"{CountedName.compared} comparisons, {n} names"


def test_the_recovery_process_reports_in_json_and_refuses_bad_usage(tmp_path: Path) -> None:
    report = RecoveryReport(requeued=2, problems=("a", "b"), lost=("m1",))
    assert report_from_json(report_json(report)) == report
    with pytest.raises(ValueError, match="unknown fields"):
        report_from_json('{"requeued": 1, "bogus": 2}')
    bad = subprocess.run([sys.executable, "-m", "queue_ref.fsqueue.recover_child",
                          str(tmp_path / "q"), "sometimes"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    assert not (tmp_path / "q").exists()  # nothing opened, nothing created


def test_an_old_format_queue_is_converted_by_its_opening_for_serving(tmp_path: Path) -> None:
    """A queue of the format before hard-link entries (symlinks, no queue-ref.format) is
    opened with its whole recovery, which converts it when no other owner is alive;
    beside a live owner the opening refuses, naming ``queue-ref repair``."""
    from tests.test_fsqueue_format import symlinks, to_old_format

    root = tmp_path / "q"
    live = FsQueue(str(root))
    want = _messages_of(live, (1, 3))
    to_old_format(str(root), {want[1].rsplit(".", 1)[0]})
    with pytest.raises(StorageIOError, match="queue-ref repair"):
        open_serving(str(root))  # live has it open: not converted
    assert len(symlinks(str(root))) == len(want)
    live.close()
    store, recover = open_serving(str(root))
    try:
        assert recover is None and isinstance(store, FsQueue)
        assert store.last_recovery is not None and store.last_recovery.lost == ()
        assert symlinks(str(root)) == [] and (root / "queue-ref.format").is_file()
        assert [h.entry_id for h in store.list_queue()] == want
    finally:
        store.close()
