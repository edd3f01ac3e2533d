"""Durable lifecycle benchmark: enqueue, send_start, send_done, cleanup of 4 KiB messages.

Every ratio compares figures taken in one run, on one directory.  A shared machine's disk
changes speed from one second to the next (fsync took 130 us in one minute and 500 us in
the next on the development machine), so the run is made of *rounds*, and in each round
the raw floor is measured before the first contender and after each one: a contender's
ratio divides its rate by the mean of the floors measured right before and right after
it.  The order of the contenders alternates from round to round.  Medians over the rounds
are reported, with the lowest and highest ratio and the rounds at or above target.

Figures:

* the raw floor on the same directory: create a file, write 4 KiB, fsync it, fsync the
  directory, per message, one after the other;
* lifecycle rate with 16 concurrent producers, per backend: the filesystem queue in
  each sync mode (``fs-syncfs``, ``fs-fsync``), and the KV queue on the Python log engine
  and on LevelDB, as 16 threads of one process; and for the filesystem queue also as
  ``--procs`` processes of 16/procs threads each on the same queue directory (the queue
  is made for several processes; a Python process runs Python code on one core at a
  time, so that is how a deployment uses a machine's cores); with 1 producer once per
  backend; bytes left on disk once drained and closed (for the KV queue, also after
  ``compact()`` before closing);
* one message to 1,000 recipients (enqueue, then every entry's lifecycle);
* 100-recipient messages (4 producers, 24 messages a round, three interleaved rounds):
  each message enqueued, every entry claimed, delivered and cleaned up, its outcomes in
  one ``send_finish`` (C15) and its cleanups in one ``cleanup_all`` (C16), as the relay
  makes them, against one ``send_done`` and one ``cleanup`` per recipient
  (``wide_100_rcpts``, ``ratio_batched_to_each``; until 2026-11-29 the batch side made
  one ``cleanup`` per recipient, and the figure was named ``ratio_send_finish_to_each``);
* peak Python memory while enqueuing and reading back a 100 MB body (in a child process);
* the raw log ceiling: append 16 records of 4 KiB, one fdatasync, repeatedly; each KV
  queue's 16-producer median against it, in lifecycles and in write batches (four per
  lifecycle, each one record of the log) per ceiling record
  (``ratio_<kv>_16p_to_raw_log_ceiling``).

Targets: the filesystem queue's 16-producer lifecycle rate is at least the raw floor; the
KV queue's is at least 3 times the filesystem queue's (in its default mode, one process).

The last line printed is one JSON object with every figure and ratio.

    python benchmarks/lifecycle.py [--backend fs|kv-log|kv-leveldb|all] [--rounds N]
                                   [--messages N] [--procs P] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from queue_ref.storage import Recipient, Schedule, Storage

BODY = b"x" * 4096
FS_MODES = {"fs-syncfs": "syncfs", "fs-fsync": "fsync"}
BACKENDS = (*FS_MODES, "kv-log", "kv-leveldb")


def open_backend(name: str, root: str) -> Storage:
    if name == "fs":
        from queue_ref.fsqueue import FsQueue

        return FsQueue(root)
    if name in FS_MODES:
        from queue_ref.fsqueue import FsQueue

        return FsQueue(root, sync=FS_MODES[name])
    if name == "kv-log":
        from queue_ref.kv.kv_queue import KvQueue

        return KvQueue.open_log(root)
    if name == "kv-leveldb":
        from queue_ref.kv.kv_queue import KvQueue

        return KvQueue.open_leveldb(root)
    raise SystemExit(f"unknown backend {name!r}")


#: The KV queue's write batches (log records) in one lifecycle: the commit, send_start,
#: send_done and cleanup each write one.
BATCHES_PER_LIFECYCLE = 4


def lifecycle_one(q: Storage, now: int) -> None:
    with q.enqueue("sender@example.org") as enq:
        enq.write(BODY)
        (mail,) = enq.commit([Recipient("rcpt@example.net", Schedule(now))])
    inflight = q.send_start(mail)
    assert inflight is not None
    done = q.send_done(inflight)
    assert done is not None
    assert q.cleanup(done)


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` nearly equal whole shares."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_producers(q: Storage, producers: int, messages: int,
                  ready: Callable[[], None] | None = None) -> float:
    """Messages per second of the full lifecycle, ``producers`` threads sharing ``messages``.
    ``ready`` is called once the threads wait to start (a process pool's start signal)."""
    now = int(time.time())
    return run_threads(producers, messages, lambda: lifecycle_one(q, now), ready)


def run_threads(producers: int, messages: int, one: Callable[[], None],
                ready: Callable[[], None] | None = None) -> float:
    """Calls of ``one`` per second, ``producers`` threads sharing ``messages`` calls, all
    started at once; the first error of any thread is raised after they all ended."""
    per = shares(messages, producers)
    errors: list[BaseException] = []
    barrier = threading.Barrier(producers + 1)

    def work(n: int) -> None:
        try:
            barrier.wait()
            for _ in range(n):
                one()
        except BaseException as e:  # reported after join
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in per]
    for t in threads:
        t.start()
    if ready is not None:
        ready()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return messages / elapsed


def _producer_process(name: str, root: str, threads: int, conn: Connection) -> None:
    """One process of a ``ProducerProcesses`` pool: open the queue, then run what the
    parent asks, starting when it says so."""
    try:
        q = open_backend(name, root)
        conn.send("opened")

        def ready() -> None:
            conn.send("ready")
            if conn.recv() != "go":
                raise RuntimeError("the benchmark did not say go")

        while (messages := conn.recv()) is not None:
            run_producers(q, threads, messages, ready)
            conn.send("done")
        q.close()
        conn.send("closed")
    except BaseException as e:  # reported to the parent, which fails the benchmark
        conn.send(f"failed: {e!r}")


class ProducerProcesses:
    """``procs`` processes of ``producers // procs`` threads each, on one queue directory.

    Every process opens the queue (running its recovery) before any of them starts a
    lifecycle; ``run`` starts them all at once and times them from the parent.
    """

    def __init__(self, name: str, root: str, procs: int, producers: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_producer_process, args=(name, root, producers // procs,
                                                             child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._all("opened")

    def _all(self, want: str) -> None:
        for c in self.conns:
            got = c.recv()
            if got != want:
                raise RuntimeError(f"a producer process answered {got!r}, not {want!r}")

    def run(self, messages: int) -> float:
        for c, n in zip(self.conns, shares(messages, len(self.conns)), strict=True):
            c.send(n)
        self._all("ready")
        t0 = time.perf_counter()
        for c in self.conns:
            c.send("go")
        self._all("done")
        return messages / (time.perf_counter() - t0)

    def close(self) -> None:
        try:
            for c in self.conns:
                c.send(None)
            self._all("closed")
        finally:
            for p in self.procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()


def disk_bytes(root: str) -> int:
    """Bytes of the files under ``root`` (what the queue's directory holds on disk), but
    the filesystem queue's ``queue-ref.format``, written once when the queue is made."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if d == root and f == "queue-ref.format":
                continue
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


def wide_one(q: Storage, now: int, rcpts: int, batch: bool) -> None:
    """One message of ``rcpts`` recipients (as a mailing list sends): every entry claimed,
    all delivered, cleaned up; the outcomes in one ``send_finish`` and the cleanups in one
    ``cleanup_all`` (``batch``), or one call each."""
    with q.enqueue("list@example.org") as enq:
        enq.write(BODY)
        mails = enq.commit([Recipient(f"r{i}@d{i % 7}.example.net", Schedule(now))
                            for i in range(rcpts)])
    inflight = [q.send_start(m) for m in mails]
    claimed = [m for m in inflight if m is not None]
    assert len(claimed) == rcpts
    done = q.send_finish(claimed).done if batch else [q.send_done(m) for m in claimed]
    pending = [d for d in done if d is not None]
    assert len(pending) == rcpts
    if batch:
        assert all(q.cleanup_all(pending))
    else:
        for d in pending:
            assert q.cleanup(d)


def wide_rate(q: Storage, producers: int, messages: int, rcpts: int, batch: bool) -> float:
    """Messages per second of ``wide_one``, ``producers`` threads sharing ``messages``."""
    now = int(time.time())
    return run_threads(producers, messages, lambda: wide_one(q, now, rcpts, batch))


def wide(q: Storage, rounds_: int, messages: int, rcpts: int = 100, producers: int = 4
         ) -> dict[str, object]:
    """The 100-recipient lifecycle, its outcomes in one ``send_finish`` and its cleanups in
    one ``cleanup_all`` per message against one call per recipient each, in interleaved
    rounds on one queue."""
    wide_rate(q, producers, producers, rcpts, True)  # warm
    batch: list[float] = []
    single_calls: list[float] = []
    for r in range(rounds_):
        for b in ((True, False) if r % 2 == 0 else (False, True)):
            os.sync()
            (batch if b else single_calls).append(wide_rate(q, producers, messages, rcpts, b))
    return {"recipients": rcpts, "producers": producers, "messages": messages,
            "messages_per_s_batched": spread(batch),
            "messages_per_s_each": spread(single_calls),
            "ratio_batched_to_each": spread(
                [x / y for x, y in zip(batch, single_calls, strict=True)])}


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


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rounds(base: str, names: list[str], rounds_: int, messages: int, floor_messages: int,
           procs: int, say: Callable[[str], None]) -> dict[str, object]:
    """Interleaved rounds of each contender's 16-producer lifecycle, each run between two
    measurements of the floor: every backend as 16 threads of this process, and
    (``procs`` > 1) the filesystem queue as ``procs`` processes on one directory too
    (``<name>/<procs>proc``)."""
    roots: dict[str, str] = {}
    queues: dict[str, Storage] = {}
    pools: dict[str, ProducerProcesses] = {}
    runs: dict[str, Callable[[int], float]] = {}
    floors: list[float] = []
    out: dict[str, object] = {"rounds": rounds_, "procs": procs}
    try:
        for n in names:
            roots[n] = os.path.join(base, f"{n}-16")
            q = queues[n] = open_backend(n, roots[n])
            runs[n] = lambda m, q=q: run_producers(q, 16, m)
            if n in FS_MODES and procs > 1:
                k = f"{n}/{procs}proc"
                roots[k] = os.path.join(base, f"{n}-16x{procs}")
                pool = pools[k] = ProducerProcesses(n, roots[k], procs, 16)
                runs[k] = pool.run
        for run in runs.values():
            run(64)  # warm: caches, pinned directories, spare files, threads
        rates: dict[str, list[float]] = {k: [] for k in runs}
        around: dict[str, list[float]] = {k: [] for k in runs}  # the floor around each run
        order = list(runs)
        for r in range(rounds_):
            os.sync()  # every measurement starts with nothing left to write back
            before = raw_floor(base, floor_messages)
            floors.append(before)
            for k in order if r % 2 == 0 else order[::-1]:
                os.sync()
                rates[k].append(runs[k](messages))
                os.sync()
                after = raw_floor(base, floor_messages)
                floors.append(after)
                around[k].append((before + after) / 2)
                before = after
            say(f"round {r + 1}/{rounds_}: " + "; ".join(
                f"{k} {rates[k][-1]:.0f}/s (floor {around[k][-1]:.0f}/s: "
                f"{rates[k][-1] / around[k][-1]:.2f}x)" for k in order))
        out["raw_floor_per_s"] = spread(floors)

        def figures(k: str, suffix: str) -> dict[str, object]:
            ratios = [x / f for x, f in zip(rates[k], around[k], strict=True)]
            return {f"lifecycle_16p{suffix}_per_s": spread(rates[k]),
                    f"ratio_16p{suffix}_to_raw_floor": spread(ratios) | {
                        "rounds_at_or_above_1": sum(1 for x in ratios if x >= 1)}}

        for n in names:
            entry = figures(n, "")
            compact = getattr(queues[n], "compact", None)
            if callable(compact):
                compact()
                entry["disk_after_16p_compact_bytes"] = disk_bytes(roots[n])
            queues.pop(n).close()
            entry["disk_after_16p_bytes"] = disk_bytes(roots[n])
            k = f"{n}/{procs}proc"
            if k in pools:
                entry |= figures(k, f"_{procs}proc")
                pools.pop(k).close()
                entry[f"disk_after_16p_{procs}proc_bytes"] = disk_bytes(roots[k])
            out[n] = entry
        fs = next((n for n in names if n in FS_MODES), None)
        for n in names:
            if fs is not None and n.startswith("kv-"):
                out[f"ratio_{n}_to_{fs}_16p"] = spread(
                    [x / y for x, y in zip(rates[n], rates[fs], strict=True)])
        return out
    finally:
        for q in queues.values():
            q.close()
        for pool in pools.values():
            pool.close()
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


def single(base: str, name: str, messages: int, rcpts: int, big_mb: int,
           say: Callable[[str], None]) -> dict[str, object]:
    res: dict[str, object] = {}
    root = os.path.join(base, f"{name}-1")
    q = open_backend(name, root)
    res["lifecycle_1p_per_s"] = run_producers(q, 1, messages)
    compact = getattr(q, "compact", None)
    if callable(compact):
        compact()
        res["disk_after_1p_compact_bytes"] = disk_bytes(root)
    q.close()
    res["disk_after_1p_bytes"] = disk_bytes(root)
    shutil.rmtree(root)
    root = os.path.join(base, f"{name}-rcpts")
    q = open_backend(name, root)
    res[f"one_message_{rcpts}_rcpts"] = many_recipients(q, rcpts)
    q.close()
    shutil.rmtree(root)
    root = os.path.join(base, f"{name}-wide")
    q = open_backend(name, root)
    res["wide_100_rcpts"] = w = wide(q, 3, 24)
    q.close()
    shutil.rmtree(root)
    say(f"{name}: 100-recipient messages, 4 producers: send_finish and cleanup_all "
        f"{w['messages_per_s_batched']['median']:.1f}/s, one call each "
        f"{w['messages_per_s_each']['median']:.1f}/s "
        f"({w['ratio_batched_to_each']['median']:.2f}x)")
    peak = big_body_peak(name, base, big_mb * 1024 * 1024)
    res[f"peak_memory_{big_mb}MB_body_bytes"] = peak
    say(f"{name}: 1 producer {res['lifecycle_1p_per_s']:.0f}/s; {rcpts} rcpts "
        f"{res[f'one_message_{rcpts}_rcpts']}; {big_mb} MB body peak {peak / 1e6:.1f} MB")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="all", choices=["fs", "kv-log", "kv-leveldb", "all"],
                    help="fs: both sync modes of the filesystem queue")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--messages", type=int, default=800,
                    help="messages per 16-producer measurement (default 800)")
    ap.add_argument("--rcpts", type=int, default=1000,
                    help="recipients of the one big-list message (default 1000)")
    ap.add_argument("--big-mb", type=int, default=100,
                    help="size of the body whose peak memory is measured (default 100)")
    ap.add_argument("--procs", type=int, default=2,
                    help="also run the filesystem queue's 16 producers as this many "
                         "processes of 16/procs threads each (1: only as threads; default 2)")
    ap.add_argument("--dir", help="directory to measure on (default: a temporary one under the cwd)")
    args = ap.parse_args()
    if args.rounds < 1 or args.messages < 16 or args.rcpts < 1 or args.big_mb < 1:
        ap.error("--rounds, --rcpts and --big-mb must be at least 1, --messages at least 16")
    if args.procs not in (1, 2, 4, 8, 16):
        ap.error("--procs must divide the 16 producers: 1, 2, 4, 8 or 16")
    base = tempfile.mkdtemp(prefix="bench-lifecycle-", dir=args.dir or os.getcwd())

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    if args.backend == "all":
        names = list(BACKENDS)
    elif args.backend == "fs":
        names = list(FS_MODES)
    else:
        names = ["fs-syncfs", args.backend]  # a KV queue is measured against the fs queue
    floor_messages = max(args.messages // 3, 100)
    try:
        ceiling = raw_log_ceiling(base, max(args.messages * 2, 1000))
        say(f"raw log ceiling (16 x 4 KiB appends + fdatasync): {ceiling:.0f} records/s")
        result: dict[str, object] = {"raw_log_ceiling_per_s": ceiling, "messages": args.messages,
                                     "floor_messages": floor_messages}
        result |= rounds(base, names, args.rounds, args.messages, floor_messages,
                         args.procs, say)
        for name in names:  # the log ceiling's share a KV queue reaches with 16 producers
            entry = result[name]
            if name.startswith("kv-") and isinstance(entry, dict):
                rate = entry["lifecycle_16p_per_s"]["median"]
                result[f"ratio_{name}_16p_to_raw_log_ceiling"] = {
                    "lifecycles": rate / ceiling,
                    "write_batches": rate * BATCHES_PER_LIFECYCLE / ceiling}
        for name in names:
            entry = result[name]
            assert isinstance(entry, dict)
            entry |= single(base, name, max(args.messages // 4, 50), args.rcpts, args.big_mb,
                            say)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
