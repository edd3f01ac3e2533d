"""Durable lifecycle benchmark: enqueue, send_start, send_done, cleanup of 4 KiB messages.

Measured in one run, on one directory, so the ratios compare like with like:

* lifecycle rate with 1 and with 16 concurrent producers (threads), per backend, and the
  bytes its directory holds once drained (and after ``compact()``, for backends with one);
* one message to 1,000 recipients (enqueue, then every entry's lifecycle);
* peak Python memory while enqueuing and reading back a 100 MB body (in a child process);
* the raw floor on the same directory: create a file, write 4 KiB, fsync it, fsync the
  directory, per message;
* for log-structured backends, the raw ceiling: append N records and one fdatasync.

Target (filesystem queue): with 16 producers, lifecycle rate / raw floor >= 1.
Target (KV queue): with 16 producers, its lifecycle rate >= 3 x the filesystem queue's.

The last line printed is one JSON object with every figure and ratio.

    python benchmarks/lifecycle.py [--backend fs|kv-log|kv-leveldb|all] [--messages N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from queue_ref.storage import Recipient, Schedule, Storage

BODY = b"x" * 4096


def open_backend(name: str, root: str) -> Storage:
    if name == "fs":
        from queue_ref.fsqueue import FsQueue

        return FsQueue(root)
    if name == "kv-log":
        from queue_ref.kv.queue import KvQueue

        return KvQueue.open_log(root)
    if name == "kv-leveldb":
        from queue_ref.kv.queue import KvQueue

        return KvQueue.open_leveldb(root)
    raise SystemExit(f"unknown backend {name!r}")


def lifecycle_one(q: Storage, now: int) -> None:
    with q.enqueue("sender@example.org") as enq:
        enq.write(BODY)
        (mail,) = enq.commit([Recipient("rcpt@example.net", Schedule(now))])
    inflight = q.send_start(mail)
    assert inflight is not None
    done = q.send_done(inflight)
    assert done is not None
    assert q.cleanup(done)


def run_producers(q: Storage, producers: int, messages: int) -> float:
    """Messages per second of the full lifecycle, ``producers`` threads sharing ``messages``."""
    now = int(time.time())
    per = [messages // producers + (1 if i < messages % producers else 0) for i in range(producers)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(producers + 1)

    def work(n: int) -> None:
        try:
            barrier.wait()
            for _ in range(n):
                lifecycle_one(q, now)
        except BaseException as e:  # reported after join
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in per]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return messages / elapsed


def disk_bytes(root: str) -> int:
    """Bytes of the files under ``root`` (what the queue's directory holds on disk)."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                continue
    return total


def raw_floor(directory: str, messages: int) -> float:
    """Create + write 4 KiB + fsync file + fsync dir, per message, on ``directory``."""
    d = os.path.join(directory, "raw-floor")
    os.mkdir(d)
    t0 = time.perf_counter()
    for i in range(messages):
        fd = os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        os.write(fd, BODY)
        os.fsync(fd)
        os.close(fd)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
    rate = messages / (time.perf_counter() - t0)
    shutil.rmtree(d)
    return rate


def raw_log_ceiling(directory: str, records: int, batch: int = 16) -> float:
    """Append ``batch`` 4 KiB records, then one fdatasync, repeatedly: records per second."""
    path = os.path.join(directory, "raw-log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    t0 = time.perf_counter()
    done = 0
    while done < records:
        for _ in range(batch):
            os.write(fd, BODY)
        os.fdatasync(fd)
        done += batch
    rate = done / (time.perf_counter() - t0)
    os.close(fd)
    os.unlink(path)
    return rate


def many_recipients(q: Storage, n: int) -> dict[str, float]:
    now = int(time.time())
    t0 = time.perf_counter()
    with q.enqueue("list@example.org") as enq:
        enq.write(BODY)
        mails = enq.commit([Recipient(f"r{i}@example.net", Schedule(now)) for i in range(n)])
    t1 = time.perf_counter()
    for m in mails:
        inflight = q.send_start(m)
        assert inflight is not None
        done = q.send_done(inflight)
        assert done is not None
        q.cleanup(done)
    t2 = time.perf_counter()
    return {"recipients": n, "enqueue_s": t1 - t0, "lifecycle_s": t2 - t1,
            "entries_per_s": n / (t2 - t1)}


BIG_CHILD = r"""
import sys, tracemalloc, time
sys.path.insert(0, sys.argv[3])
from benchmarks.lifecycle import open_backend
from queue_ref.storage import Recipient, Schedule
size = int(sys.argv[2]); chunk = b"y" * (1 << 16)
q = open_backend(sys.argv[1], sys.argv[4])
tracemalloc.start()
with q.enqueue("big@example.org") as enq:
    left = size
    while left:
        n = min(left, len(chunk)); enq.write(chunk[:n]); left -= n
    (mail,) = enq.commit([Recipient("r@example.net", Schedule(int(time.time())))])
m = q.send_start(mail)
total = 0
with q.read_inflight(m) as r:
    for b in r:
        total += len(b)
assert total == size, (total, size)
print(tracemalloc.get_traced_memory()[1])
"""


def big_body_peak(backend: str, directory: str, size: int) -> int:
    root = os.path.join(directory, "big")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", BIG_CHILD, backend, str(size), here, root],
        check=True, capture_output=True, text=True,
    )
    shutil.rmtree(root, ignore_errors=True)
    return int(out.stdout.strip().splitlines()[-1])


def bench_backend(name: str, base: str, messages: int, say: Callable[[str], None]) -> dict[str, object]:
    res: dict[str, object] = {}
    for producers in (1, 16):
        root = os.path.join(base, f"{name}-{producers}")
        q = open_backend(name, root)
        n = messages if producers == 16 else max(messages // 4, 50)
        res[f"lifecycle_{producers}p_per_s"] = run_producers(q, producers, n)
        fp = q.footprint()
        res[f"footprint_after_{producers}p"] = {"objects": fp.objects, "bytes": fp.bytes}
        res[f"disk_after_{producers}p_bytes"] = disk_bytes(root)
        compact = getattr(q, "compact", None)
        if callable(compact):
            compact()
            res[f"disk_after_{producers}p_compact_bytes"] = disk_bytes(root)
        q.close()
        shutil.rmtree(root)
        say(f"{name}: {producers:2d} producers: {res[f'lifecycle_{producers}p_per_s']:.0f} msg/s")
    root = os.path.join(base, f"{name}-rcpts")
    q = open_backend(name, root)
    res["one_message_1000_rcpts"] = many_recipients(q, 1000)
    q.close()
    shutil.rmtree(root)
    res["peak_memory_100MB_body_bytes"] = big_body_peak(name, base, 100 * 1024 * 1024)
    say(f"{name}: 1000 rcpts {res['one_message_1000_rcpts']}; 100 MB body peak "
        f"{int(res['peak_memory_100MB_body_bytes']) / 1e6:.1f} MB")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="all", choices=["fs", "kv-log", "kv-leveldb", "all"])
    ap.add_argument("--messages", type=int, default=2000, help="messages for the 16-producer run")
    ap.add_argument("--dir", help="directory to measure on (default: a temporary one under the cwd)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-lifecycle-", dir=args.dir or os.getcwd())

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    try:
        floor = raw_floor(base, max(args.messages // 2, 200))
        ceiling = raw_log_ceiling(base, max(args.messages * 2, 1000))
        say(f"raw floor (create+4K+fsync+dir fsync): {floor:.0f}/s; raw log ceiling: {ceiling:.0f}/s")
        names = ["fs", "kv-log", "kv-leveldb"] if args.backend == "all" else [args.backend]
        result: dict[str, object] = {"raw_floor_per_s": floor, "raw_log_ceiling_per_s": ceiling,
                                     "messages": args.messages}
        for name in names:
            r = bench_backend(name, base, args.messages, say)
            r["ratio_16p_to_raw_floor"] = float(r["lifecycle_16p_per_s"]) / floor
            result[name] = r
        if "fs" in result:
            fs16 = float(result["fs"]["lifecycle_16p_per_s"])
            for kv in ("kv-log", "kv-leveldb"):
                if kv in result:
                    result[f"ratio_{kv}_to_fs_16p"] = float(
                        result[kv]["lifecycle_16p_per_s"]) / fs16
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
