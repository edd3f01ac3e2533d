"""FsQueue across real processes: a claim race over the same entries, and a sender killed
with SIGKILL while it holds entries inflight."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.layout import parse_inflight
from queue_ref.storage import Footprint
from tests.test_fsqueue_support import put

CTX = mp.get_context("spawn")
RACERS = 4


def _racer(root: str, reverse: bool, barrier: Any, out: Any) -> None:
    q = FsQueue(root)
    # every racer lists every entry before any claims one: each claim below races the
    # others' claims of the same entry, however the machine schedules the processes
    listed = list(q.list_queue())
    barrier.wait(timeout=60)
    got = []
    for m in reversed(listed) if reverse else listed:
        i = q.send_start(m)
        if i is not None:
            got.append(i.entry_id)
    out.put((q.owner, len(listed), got))
    q.close()


def test_claim_race_between_processes_claims_each_entry_once(tmp_path: Any) -> None:
    root = str(tmp_path / "q")
    q = FsQueue(root)
    everything = sorted(h.entry_id for _ in range(3) for h in put(q, n=100))
    barrier = CTX.Barrier(RACERS)
    out = CTX.Queue()
    procs = [CTX.Process(target=_racer, args=(root, k % 2 == 1, barrier, out))
             for k in range(RACERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [n for _, n, _ in results] == [len(everything)] * RACERS  # all raced for all
    claimed = [e for _, _, got in results for e in got]
    assert sorted(claimed) == everything  # every entry exactly once, none lost
    by_owner = {owner: set(got) for owner, _, got in results}
    for name in os.listdir(os.path.join(root, "inflight")):
        parsed = parse_inflight(name)
        assert parsed is not None
        assert parsed[0].entry_id in by_owner[parsed[1]]
    assert list(q.list_queue()) == []
    report = q.recover()  # the racers closed: their claims are requeued
    assert report.requeued == len(everything)
    assert sorted(m.entry_id for m in q.list_queue()) == everything
    q.close()


def _claim_and_hang(root: str, n: int, ready: Any) -> None:
    q = FsQueue(root)
    for m in list(q.list_queue())[:n]:
        assert q.send_start(m) is not None
    ready.set()
    time.sleep(120)


def test_sigkilled_sender_entries_are_requeued(tmp_path: Any) -> None:
    root = str(tmp_path / "q")
    q = FsQueue(root)
    hs = put(q, n=5)
    ready = CTX.Event()
    child = CTX.Process(target=_claim_and_hang, args=(root, 3, ready))
    child.start()
    try:
        assert ready.wait(timeout=60)
        assert len(os.listdir(os.path.join(root, "inflight"))) == 3
        assert list(q.find_inflight()) == []  # its owner is alive: not ours to take
        assert len(list(q.list_queue())) == 2
    finally:
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL
    other = FsQueue(root)  # a new process opening the queue requeues the dead one's entries
    assert other.last_recovery is not None and other.last_recovery.requeued == 3
    assert sorted(m.entry_id for m in q.list_queue()) == sorted(h.entry_id for h in hs)
    other.close()
    for m in list(q.list_queue()):
        i = q.send_start(m)
        assert i is not None
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)
    assert q.footprint() == Footprint(0, 0)
    q.close()


def test_find_inflight_adopts_entries_of_a_killed_process(tmp_path: Any) -> None:
    root = str(tmp_path / "q")
    q = FsQueue(root)
    put(q, n=2)
    ready = CTX.Event()
    child = CTX.Process(target=_claim_and_hang, args=(root, 2, ready))
    child.start()
    assert ready.wait(timeout=60)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=30)
    adopted = list(q.find_inflight())
    assert len(adopted) == 2
    assert sorted(os.listdir(os.path.join(root, "inflight"))) == sorted(
        f"{m.entry_id}@{q.owner}" for m in adopted)
    for i in adopted:
        with q.read_inflight(i) as r:
            assert r.read_all().startswith(b"Subject")
        assert q.send_done(i) is not None
    q.close()
