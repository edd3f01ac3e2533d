"""Listing one domain's mail: the backend's domain index against a full scan.

A queue holds ``--entries`` queued entries (default 100,000): ``--entries / --rcpts``
messages of ``--rcpts`` recipients each, spread over many domains, and among them
``--target`` entries (default 100) at ``target.example``.  For each backend it times

* ``index``: ``list_domain("target.example")`` (``Capability.DOMAIN_INDEX``: the
  filesystem queue's ``domains/<h>/`` directory, the KV queue's ``domain`` keys);
* ``scan``: what a tool without the index does (``queue_actions.flush`` on a backend
  without it): ``list_queue`` and, for every entry, its recipient read with
  ``inspect_entry`` to keep the target domain's.

Both must find the same ``--target`` entries.  Each timing is the median of ``--repeat``
runs on a warm cache; the ratio is scan time / index time.  Building the queue is not
timed.  The last line printed is one JSON object with every figure.

    python benchmarks/domain_listing.py [--backend fs|kv-log|all] [--entries N]
                                        [--target N] [--rcpts N] [--repeat N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule, Storage

TARGET = "target.example"


def build(store: Storage, entries: int, target: int, rcpts: int) -> None:
    """``entries`` queued entries in messages of ``rcpts`` recipients; ``target`` of them
    at TARGET, spread evenly over the run (one per message, in ``target`` messages)."""
    messages = entries // rcpts
    every = max(1, messages // target) if target else messages + 1
    placed = 0
    for m in range(messages):
        addrs = [f"u{m}.{i}@d{(m * rcpts + i) % 997}.example" for i in range(rcpts)]
        if placed < target and m % every == 0:
            addrs[0] = f"u{m}@{TARGET}"
            placed += 1
        with store.enqueue(f"s{m}@sender.example") as enq:
            enq.write(b"Subject: listing\r\n\r\nbody\r\n")
            enq.commit([Recipient(a, Schedule(m)) for a in addrs])
    if placed != target:
        raise SystemExit(f"domain_listing: cannot place {target} target entries in "
                         f"{messages} messages")


def by_index(store: Storage) -> list[str]:
    return [h.entry_id for h in store.list_domain(TARGET)]


def by_scan(store: Storage) -> list[str]:
    out = []
    for h in store.list_queue():
        r = store.inspect_entry(h)
        if r is None:
            continue
        with r:
            if r.meta.rcpt.rpartition("@")[2].lower() == TARGET:
                out.append(h.entry_id)
    return out


def timed(fn: Callable[[Storage], list[str]], store: Storage, repeat: int
          ) -> tuple[float, list[str]]:
    times = []
    found: list[str] = []
    for _ in range(repeat):
        t = time.perf_counter()
        found = fn(store)
        times.append(time.perf_counter() - t)
    return statistics.median(times), found


def measure(backend: str, args: argparse.Namespace, base: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"domain-listing-{backend}-", dir=base)
    try:
        store = open_queue(f"{root}/q", backend)
        t = time.perf_counter()
        build(store, args.entries, args.target, args.rcpts)
        built = time.perf_counter() - t
        store.close()
        store = open_queue(f"{root}/q", backend)  # a reopened queue: recovery ran, cold ids
        try:
            index_s, via_index = timed(by_index, store, args.repeat)
            scan_s, via_scan = timed(by_scan, store, max(1, args.repeat // 2))
        finally:
            store.close()
        if sorted(via_index) != sorted(via_scan) or len(via_index) != args.target:
            raise SystemExit(f"domain_listing: {backend}: the index found {len(via_index)} "
                             f"entries, the scan {len(via_scan)}, expected {args.target}")
        return {"entries": args.entries, "target": args.target, "build_s": round(built, 2),
                "index_s": index_s, "scan_s": scan_s, "ratio": scan_s / index_s}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="all", choices=("fs", "kv-log", "all"))
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--target", type=int, default=100)
    p.add_argument("--rcpts", type=int, default=100, help="recipients per message")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to build the queues (default: /tmp)")
    args = p.parse_args(argv)
    if args.entries < 1 or args.rcpts < 1 or args.repeat < 1 or not (
            0 < args.target <= args.entries // args.rcpts):
        print("domain_listing: need --entries, --rcpts, --repeat >= 1 and 0 < --target <= "
              "entries / rcpts", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    for backend in (("fs", "kv-log") if args.backend == "all" else (args.backend,)):
        fig = measure(backend, args, args.dir or tempfile.gettempdir())
        out[backend] = fig
        print(f"{backend:7} {fig['target']} of {fig['entries']} entries: list_domain "
              f"{fig['index_s'] * 1e3:.2f} ms, full scan {fig['scan_s'] * 1e3:.1f} ms, "
              f"ratio {fig['ratio']:.0f}x (built in {fig['build_s']} s)", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
