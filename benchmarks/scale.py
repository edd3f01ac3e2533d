"""The relay and the operator commands on a big queue: start, memory, mailq, qshape.

For each size N (``--sizes``, default 10,000 and 100,000; 1,000,000 runs outside CI:
``make bench-scale``) a filesystem queue is built with N deferred messages of one
recipient each (through the Storage API, ``--threads`` producers sharing group-commit
rounds; not timed against the targets), then measured once:

* ``ready_s``: ``queue-ref relay`` started to its ready line;
* ``accept_s`` / ``deliver_s``: one new message sent (smtplib) to its 250, and to its
  arrival at an aiosmtpd sink (the relayhost);
* ``listed_s``: start to the end of the relay's first listing (``queue listed``), and
  ``rss_mb`` (VmRSS) then, ``peak_rss_mb`` (VmHWM) at its stop;
* ``mailq_first_s`` / ``mailq_s``: ``queue-ref mailq`` started to its first line and to
  its end; ``qshape_s``: ``queue-ref qshape`` to its end.

The targets: ready within 2 s, mailq's first line within 1 s, at most 200 MB of RSS (at
1M queued); each ratio is the figure over its target (at most 1: met).  The last line
printed is one JSON object with every figure.

    python benchmarks/scale.py [--sizes 10000,100000] [--threads 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from queue_ref.fsqueue import FsQueue
from queue_ref.storage import Recipient, Schedule

TARGETS = {"ready_s": 2.0, "mailq_first_s": 1.0, "rss_mb": 200.0}
LATER = 2_000_000_000  # a due time far ahead: deferred mail, never delivered here
BODY = b"Subject: scale\r\n\r\nbody\r\n"


def build(root: str, n: int, threads: int) -> float:
    """``n`` deferred messages of one recipient (1,000 domains) in a new fs queue; seconds."""
    q = FsQueue(root)
    t = time.perf_counter()

    def one(i: int) -> None:
        with q.enqueue(f"s{i}@sender.example", {"arrival": f"{time.time():.3f}"}) as enq:
            enq.write(BODY)
            enq.commit([Recipient(f"u{i}@d{i % 1000}.example", Schedule(LATER + i, 1))])

    try:
        with ThreadPoolExecutor(threads) as ex:
            for start in range(0, n, 10_000):  # not a million futures at once
                for _ in ex.map(one, range(start, min(n, start + 10_000))):
                    pass
        return time.perf_counter() - t
    finally:
        q.close()


class Sink:
    """An aiosmtpd server on loopback in a thread: the time each recipient arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.cond = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> asyncio.Server:
            return await self.loop.create_server(lambda: SMTP(self), "127.0.0.1", 0)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.port: int = self.server.sockets[0].getsockname()[1]

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.cond:
            for r in envelope.rcpt_tos:
                self.arrived.setdefault(r, time.monotonic())
            self.cond.notify_all()
        return "250 OK"

    def wait(self, rcpt: str, timeout: float) -> float | None:
        with self.cond:
            self.cond.wait_for(lambda: rcpt in self.arrived, timeout)
            return self.arrived.get(rcpt)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("queue-ref")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "conformance.cli"]


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def measure_relay(root: str, sink: Sink, timeout: float) -> dict[str, float]:
    """Start a relay on the queue, send it one message, wait for its first listing."""
    t0 = time.monotonic()
    proc = subprocess.Popen([*_cli(), "relay", "--queue", root, "--listen", "127.0.0.1:0",
                             "--relayhost", f"[127.0.0.1]:{sink.port}", "--log-json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listed = threading.Event()
    listed_at: list[float] = []
    errors: list[str] = []

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                rec = json.loads(line)
            except ValueError:
                errors.append(line.rstrip())
                continue
            if rec.get("event") == "error":
                errors.append(line.rstrip())
            if rec.get("event") == "relay" and rec.get("what") == "queue listed":
                listed_at.append(time.monotonic())
                listed.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        ready_s = time.monotonic() - t0
        if not ready.startswith("queue-ref relay ready:"):
            raise SystemExit(f"scale: the relay did not start: {ready!r} {errors[-3:]}")
        port = int(ready.split("smtp=", 1)[1].split()[0].rsplit(":", 1)[1])
        rcpt = f"new{time.time_ns()}@example.net"
        t1 = time.monotonic()
        with smtplib.SMTP("127.0.0.1", port, timeout=timeout) as c:
            c.sendmail("a@example.org", [rcpt], BODY)
            accept_s = time.monotonic() - t1  # at the 250: the relay may deliver before
            # the QUIT that follows is answered
        arrived = sink.wait(rcpt, timeout)
        if arrived is None:
            raise SystemExit(f"scale: the new message was not delivered in {timeout} s "
                             f"{errors[-3:]}")
        if not listed.wait(timeout):
            raise SystemExit(f"scale: the first listing did not end in {timeout} s")
        rss = _status_kb(proc.pid, "VmRSS") / 1024
        peak = _status_kb(proc.pid, "VmHWM") / 1024
        return {"ready_s": ready_s, "accept_s": accept_s, "deliver_s": arrived - t1,
                "listed_s": listed_at[0] - t0, "rss_mb": rss, "peak_rss_mb": peak}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()


def measure_command(args: list[str]) -> tuple[float, float, int]:
    """Seconds to the first line and to the end of ``queue-ref ARGS``; lines printed."""
    t0 = time.monotonic()
    proc = subprocess.Popen([*_cli(), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_s = time.monotonic() - t0
    lines = 1 if first else 0
    for _ in proc.stdout:
        lines += 1
    if proc.wait() != 0:
        raise SystemExit(f"scale: queue-ref {' '.join(args)} failed ({proc.returncode})")
    return first_s, time.monotonic() - t0, lines


def measure(n: int, args: argparse.Namespace, sink: Sink) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix=f"scale-{n}-", dir=args.dir)
    root = os.path.join(base, "q")
    try:
        fig: dict[str, Any] = {"queued": n, "build_s": round(build(root, n, args.threads), 2)}
        fig.update(measure_relay(root, sink, args.timeout))
        first, total, lines = measure_command(["mailq", "--queue", root])
        if lines < 2 * n:  # a header, then per message its line, a recipient and a blank
            raise SystemExit(f"scale: mailq printed {lines} lines for {n} messages")
        fig.update(mailq_first_s=first, mailq_s=total)
        _, fig["qshape_s"], _ = measure_command(["qshape", "--queue", root])
        fig = {k: round(v, 3) if isinstance(v, float) else v for k, v in fig.items()}
        fig["ratios"] = {k: round(fig[k] / t, 3) for k, t in TARGETS.items()}
        return fig
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000",
                   help="queued messages per run, comma-separated (default 10000,100000)")
    p.add_argument("--threads", type=int, default=16, help="producers building a queue")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any step may take")
    p.add_argument("--dir", default=None, help="where to build the queues (default: /tmp)")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or args.threads < 1 or args.timeout <= 0:
        print("scale: need --sizes N[,N...] with every N >= 1, --threads >= 1, --timeout > 0",
              file=sys.stderr)
        return 2
    out: dict[str, Any] = {"targets": TARGETS, "sizes": {}}
    sink = Sink()
    try:
        for n in sizes:
            fig = measure(n, args, sink)
            out["sizes"][str(n)] = fig
            r = fig["ratios"]
            print(f"{n:>9} queued (built in {fig['build_s']} s): ready {fig['ready_s']} s "
                  f"(x{r['ready_s']} of 2 s), new mail accepted {fig['accept_s']} s, "
                  f"delivered {fig['deliver_s']} s, first listing {fig['listed_s']} s, "
                  f"RSS {fig['rss_mb']} MB (x{r['rss_mb']} of 200 MB, peak "
                  f"{fig['peak_rss_mb']}), mailq first line {fig['mailq_first_s']} s "
                  f"(x{r['mailq_first_s']} of 1 s) all {fig['mailq_s']} s, qshape "
                  f"{fig['qshape_s']} s", file=sys.stderr)
    finally:
        sink.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
