"""FsQueue at size: 10,000 recipients on one message, and a 100 MB body in flat memory.

Sizes grow with the thorough profile (QUEUE_REF_PROFILE=thorough).
"""

from __future__ import annotations

import hashlib
import os
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from queue_ref.fsqueue import FsQueue
from queue_ref.storage import Footprint, QueuedMail, Recipient, Schedule
from tests.conftest import thorough
from tests.test_fsqueue_support import EMPTY, tree

RCPTS = 20_000 if thorough() else 10_000
BODY_MB = 500 if thorough() else 100
MB = 1 << 20


def test_ten_thousand_recipients_full_lifecycle(tmp_path: Any) -> None:
    q = FsQueue(str(tmp_path / "q"))
    t0 = time.perf_counter()
    with q.enqueue("bulk@example.com") as enq:
        enq.write(b"Subject: newsletter\r\n\r\n" + b"x" * 4000)
        handles = enq.commit([Recipient(f"r{i}@d{i % 97}.example", Schedule(i), f"z{i % 3}")
                              for i in range(RCPTS)])
    t_enqueue = time.perf_counter() - t0
    assert len(os.listdir(os.path.join(q.root, "queue"))) == RCPTS
    listed = list(q.list_queue())
    assert [m.entry_id for m in listed] == [h.entry_id for h in handles]

    def life(m: QueuedMail) -> None:
        i = q.send_start(m)
        assert i is not None
        with q.read_inflight(i) as r:
            assert r.meta.rcpt == f"r{r.meta.rcpt_index}@d{r.meta.rcpt_index % 97}.example"
            assert len(r.read_all()) == 4023
        if r.meta.rcpt_index % 1000 == 0:
            back = q.send_cancel(i, Schedule(10 ** 9, 1))
            assert back is not None
            i2 = q.send_start(back)
            assert i2 is not None
            i = i2
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:  # as the MTA does; directory fsyncs are shared
        list(pool.map(life, listed))
    t_life = time.perf_counter() - t0
    assert q.footprint() == Footprint(0, 0)
    assert tree(q.root, [q.owner]) == EMPTY
    assert q._group.rounds < q._group.requests  # group commit shared fsyncs
    print(f"\n{RCPTS} recipients: enqueue {t_enqueue:.2f}s, lifecycle {t_life:.2f}s, "
          f"dir fsyncs {q._group.rounds} for {q._group.requests} requests")
    assert t_enqueue < 30 and t_life < 120
    q.close()


def _chunk(k: int) -> bytes:
    return k.to_bytes(8, "big") * (MB // 8)


def test_hundred_megabyte_body_streams_in_flat_memory(tmp_path: Any) -> None:
    q = FsQueue(str(tmp_path / "q"))
    digest = hashlib.sha256()
    tracemalloc.start()
    try:
        with q.enqueue("big@example.com") as enq:
            for k in range(BODY_MB):
                chunk = _chunk(k)
                digest.update(chunk)
                enq.write(chunk)
                del chunk
            (h,) = enq.commit([Recipient("r@example.org", Schedule(0))])
        _, peak_in = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        i = q.send_start(h)
        assert i is not None
        back = hashlib.sha256()
        size = 0
        with q.read_inflight(i) as r:
            assert r.meta.body_size == BODY_MB * MB
            for part in r:
                back.update(part)
                size += len(part)
        _, peak_out = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == BODY_MB * MB and back.digest() == digest.digest()
    print(f"\n{BODY_MB} MB body: peak traced memory in {peak_in / MB:.1f} MB, "
          f"out {peak_out / MB:.1f} MB")
    assert peak_in < 8 * MB and peak_out < 8 * MB
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    assert q.footprint() == Footprint(0, 0)
    q.close()
