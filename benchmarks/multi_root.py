"""Commits to one queue over two file systems against one queue on one (seed 002).

"The MTA is going to be limited by the rate that it can fsync the main queue. You can
raise this limit if you have two parallel queues on different disks."  The benchmark
makes three ext4 file systems of its own (``truncate`` + ``mkfs.ext4`` + ``mount -o
loop``; it must run as root) and measures, in each round, the same load on

* ``one``: the filesystem queue on one of them;
* ``two``: ``MultiRootQueue`` over the other two, new mail spread between them;

``--threads`` producer threads (default 16) committing ``--messages`` messages of 4 KiB
with one recipient each (enqueue, write, commit: durable on return), in the queue's
default sync mode.  The order alternates from round to round; the ratio is the median
of the two's rates over the median of one's.  The file systems are unmounted and their
images removed at the end, whatever happens (an interrupt included).

All three images are files on the same disk (``--dir``, default under /var/tmp): a
sync of each loop device's file system ends in the same device's flush, so the figure
says what spreading costs or gains on one disk, not what two disks would give.

The last line printed is one JSON object with every figure.

    python benchmarks/multi_root.py [--rounds N] [--messages N] [--threads N]
                                    [--size-mb N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from queue_ref.fsqueue import FsQueue
from queue_ref.multi_root import MultiRootQueue
from queue_ref.storage import Recipient, Schedule, Storage

_HEAD = b"Subject: multi-root\r\n\r\n"
BODY = _HEAD + b"x" * (4096 - len(_HEAD))


class BenchError(RuntimeError):
    """The machine cannot run the benchmark (not root, no mkfs.ext4, no loop device)."""


def _run(cmd: list[str]) -> None:
    got = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} failed: {got.stderr.strip() or got.returncode}")


@contextmanager
def loop_filesystems(base: str, count: int, size_mb: int) -> Iterator[list[str]]:
    """``count`` fresh ext4 file systems of ``size_mb`` MiB, loop-mounted under ``base``:
    their mount points.  Unmounted and their images removed on the way out, always."""
    if os.geteuid() != 0:
        raise BenchError("loop-mounting file systems needs root")
    if shutil.which("mkfs.ext4") is None:
        raise BenchError("mkfs.ext4 is not installed (Debian: e2fsprogs)")
    work = tempfile.mkdtemp(prefix="queue-ref-multi-root-", dir=base)
    mounted: list[str] = []
    try:
        points = []
        for i in range(count):
            image, point = os.path.join(work, f"fs{i}.img"), os.path.join(work, f"fs{i}")
            _run(["truncate", "-s", f"{size_mb}M", image])
            _run(["mkfs.ext4", "-q", "-F", image])
            os.mkdir(point)
            _run(["mount", "-o", "loop", image, point])
            mounted.append(point)
            points.append(point)
        yield points
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", point], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def commit_rate(q: Storage, threads: int, messages: int) -> float:
    """Commits per second: ``threads`` threads sharing ``messages`` enqueue-and-commits."""
    per = [messages // threads + (1 if i < messages % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            barrier.wait()
            for _ in range(n):
                with q.enqueue("sender@example.org") as enq:
                    enq.write(BODY)
                    enq.commit([Recipient("rcpt@example.net", Schedule(0))])
        except BaseException as e:  # reported after join
            errors.append(e)

    workers = [threading.Thread(target=work, args=(n,)) for n in per]
    for t in workers:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return messages / elapsed


def measure(dirs: list[str], threads: int, messages: int) -> tuple[float, list[str]]:
    """The commit rate of a fresh queue on ``dirs`` (one root, or one per directory) and
    its roots' sync modes; the queue is removed afterwards, outside the timing."""
    q: Storage = FsQueue(dirs[0]) if len(dirs) == 1 else MultiRootQueue.open_fs(dirs)
    try:
        roots = q.root_stores() if isinstance(q, MultiRootQueue) else [q]
        modes = [getattr(r, "sync_mode", "") for r in roots]
        return commit_rate(q, threads, messages), modes
    finally:
        q.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def run(rounds: int, messages: int, threads: int, size_mb: int, base: str,
        say: Callable[[str], None]) -> dict[str, object]:
    rates: dict[str, list[float]] = {"one": [], "two": []}
    modes: dict[str, list[str]] = {}
    with loop_filesystems(base, 3, size_mb) as (fs_one, fs_a, fs_b):
        contenders = {"one": lambda r: [os.path.join(fs_one, f"q{r}")],
                      "two": lambda r: [os.path.join(fs_a, f"q{r}"), os.path.join(fs_b, f"q{r}")]}
        for r in range(rounds):
            order = ["one", "two"] if r % 2 == 0 else ["two", "one"]
            for name in order:
                rate, modes[name] = measure(contenders[name](r), threads, messages)
                rates[name].append(rate)
                say(f"round {r + 1}: {name:<3} {rate:8.0f} commits/s")
    one, two = statistics.median(rates["one"]), statistics.median(rates["two"])
    return {"threads": threads, "messages": messages, "rounds": rounds, "body_bytes": len(BODY),
            "one_root": {"median": one, "rates": rates["one"], "sync": modes["one"]},
            "two_roots": {"median": two, "rates": rates["two"], "sync": modes["two"]},
            "ratio": two / one,
            "ratios": [t / o for t, o in zip(rates["two"], rates["one"], strict=True)],
            "same_disk": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--messages", type=int, default=2000, help="commits per measurement")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--size-mb", type=int, default=256, help="size of each file system")
    ap.add_argument("--dir", default="/var/tmp", help="where the images are made")
    args = ap.parse_args()
    for name in ("rounds", "messages", "threads", "size_mb"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.size_mb < 32:
        ap.error("--size-mb must be at least 32 (mkfs.ext4 and the queue need room)")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(f"multi_root: stopped by signal {signum}")  # unmounts on the way

    signal.signal(signal.SIGTERM, stop)
    try:
        result = run(args.rounds, args.messages, args.threads, args.size_mb, args.dir,
                     lambda line: print(line, flush=True))
    except BenchError as e:
        print(f"multi_root: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"two roots / one root: {result['ratio']:.2f} (median of {args.rounds} rounds; "
          "all three file systems on one disk)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
