"""What a hung next hop costs a relay in memory, against the mail queued for it.

    python benchmarks/hung_nexthop.py [--messages 130] [--backend fs] [--stall greeting|data]
                                      [--work DIR]

A queue is filled with ``--messages`` messages of 1 to 10 MB (sizes drawn with a fixed
seed), all due now, for one destination: a loopback port that accepts every connection
and then hangs, before its greeting (``--stall greeting``) or after its 354 to DATA,
never reading the message (``--stall data``).  ``queue-ref relay`` is started on it and
its RSS sampled for 20 s: every job is claimed, as many connections as the
destination's limit are open and hang, and the other jobs wait for a slot.  A job that
waits holds no body over 256 KiB (``delivery_scheduler.WAITING_BODY_KEPT``), and a
body over 4 MiB in DATA is held a piece at a time (``smtp_wire_body.STREAMED_BODY``),
so the RSS grows with the connections open, not with the mail queued.  The last line
is one JSON object:
``rss_mb`` (the largest RSS seen), ``start_rss_mb`` (the relay's RSS with an empty
queue, from a second run), ``queued_mb``, ``connections`` and ``growth_vs_queued``
(the RSS above an idle relay's, over the megabytes queued; 1 would be every body held).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule


def fill(root: str, backend: str, messages: int) -> int:
    """The queue filled; the bytes queued."""
    rng = random.Random(1)
    line = b"x" * 70 + b"\r\n"
    total = 0
    with open_queue(root, backend=backend) as q:
        for i in range(messages):
            body = b"Subject: big\r\n\r\n" + line * (rng.randint(1, 10) * 1_000_000 // 72)
            with q.enqueue("a@ok.test") as enq:
                enq.write(body)
                enq.commit([Recipient(f"u{i}@ok.test", Schedule(int(time.time())))])
            total += len(body)
    return total


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0


def stall_in_data(conn: socket.socket) -> None:
    """Greet, take EHLO, MAIL, RCPT and DATA, answer the DATA with 354, then read no
    more: the client's message waits in its buffers."""
    with contextlib.suppress(OSError):
        conn.sendall(b"220 stalls.test ESMTP\r\n")
        f = conn.makefile("rb", buffering=0)
        while line := f.readline():
            verb = line[:4].upper()
            if verb == b"DATA":
                conn.sendall(b"354 go ahead\r\n")
                return
            conn.sendall(b"250 ok\r\n" if verb != b"QUIT" else b"221 bye\r\n")


def run(root: str, backend: str, seconds: float, stall: str = "greeting") -> tuple[int, int]:
    """The relay on ``root`` with a hung next hop: its largest RSS, connections opened."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(500)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(hung.accept()[0])
            except OSError:
                return
            if stall == "data":
                threading.Thread(target=stall_in_data, args=(held[-1],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    relay = subprocess.Popen(
        [shutil.which("queue-ref") or "queue-ref", "relay", "--queue", root,
         "--backend", backend, "--listen", "127.0.0.1:0",
         "--relayhost", f"[127.0.0.1]:{hung.getsockname()[1]}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.25)
            assert relay.poll() is None, "the relay exited"
            peak = max(peak, rss_mb(relay.pid))
    finally:
        relay.terminate()
        relay.wait(60)
        hung.close()
        for c in held:
            c.close()
    return peak, len(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=130)
    ap.add_argument("--backend", default="fs")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--stall", choices=("greeting", "data"), default="greeting",
                    help="where the next hop hangs: before its greeting, or after its 354")
    ap.add_argument("--work", default=None, help="directory for the queues (default: a temporary one)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="hung-", dir=args.work)
    try:
        idle, _ = run(os.path.join(work, "empty"), args.backend, 3.0)
        queued = fill(os.path.join(work, "q"), args.backend, args.messages)
        print(f"queued {args.messages} messages, {queued / 1e6:.0f} MB; relay idle at {idle} MB",
              file=sys.stderr)
        peak, conns = run(os.path.join(work, "q"), args.backend, args.seconds, args.stall)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    growth = (peak - idle) / (queued / 1e6)
    print(f"next hop hung at {args.stall}: {conns} connections, largest RSS {peak} MB "
          f"({growth:.2f} of what was queued above an idle relay)")
    print(json.dumps({"rss_mb": peak, "start_rss_mb": idle, "queued_mb": round(queued / 1e6),
                      "connections": conns, "growth_vs_queued": round(growth, 3),
                      "backend": args.backend, "stall": args.stall}))


if __name__ == "__main__":
    main()
