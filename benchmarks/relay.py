"""queue-ref relay against Postfix, end to end, in one run.

    python benchmarks/relay.py [--rounds 3] [--messages 5000] [--scenario all|bulk|wide|large]
                               [--backend fs] [--processes N] [--work DIR]
                               [--only postfix|queue-ref]

Both relays run on this machine, on the same file system (``--work``), one at a time in
interleaved rounds (Postfix first in odd rounds, queue-ref first in even ones), each
relaying everything to one Postfix ``smtp-sink`` on loopback, fed by the same Postfix
``smtp-source`` load:

* ``bulk``: ``--messages`` messages of 4 KiB over 20 sessions;
* ``wide``: messages of 4 KiB to 100 recipients each (``--messages`` / 100 of them);
* ``large``: messages of 1 MB (``--messages`` / 250 of them).

Postfix is a private instance (``postfix -c DIR``: its own configuration, queue, ports; no
chroot; ``relayhost`` the sink) started fresh for each run; queue-ref is ``queue-ref relay
--queue DIR --listen ... --relayhost ...`` on a fresh queue.  Each run measures:

* accepted/s: messages divided by the time ``smtp-source`` took to have them all accepted;
* delivered/s: messages divided by the time until the sink had every recipient of them;
* p50/p99 latency from the 250 reply to the sink, from probe messages (one unique
  recipient each) sent by this script through the relay every 10 ms while the load runs
  (``smtp-source`` does not report when each of its messages was accepted);
* CPU seconds per message of the relay's whole process tree (exited children included:
  their parent reaped them), and its largest RSS;
* what the sink got: messages (transactions) delivered, duplicates (a recipient of a
  message delivered twice), ``split`` (transactions beyond one per message), and any
  lost (a loss fails the run).

The sink dumps every transaction (``smtp-sink -D``) into a FIFO this script reads, so each
recipient is timestamped as it arrives.  Installs Postfix if it is missing (Debian, as
root, non-interactive).  The last line is one JSON object with every figure and the ratios
ours/Postfix: ``relay_vs_postfix`` (median over rounds of the delivered/s ratio of the
``bulk`` scenario) and ``p99_vs_postfix`` (median of the p99 ratio; below 1 is better),
and the same two per scenario (``relay_vs_postfix_wide``, ``p99_vs_postfix_wide``, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import smtplib
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the private Postfix lives in tests/
    sys.path.insert(0, str(ROOT))

from tests.postfix_instance import PrivatePostfix, ensure_postfix, free_port, wait_port  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
DOMAIN = "example.com"


@dataclass(frozen=True)
class Scenario:
    name: str
    messages: int
    recipients: int  # per message
    size: int  # bytes per message
    sessions: int


def scenarios(messages: int) -> dict[str, Scenario]:
    return {
        "bulk": Scenario("bulk", messages, 1, 4096, 20),
        "wide": Scenario("wide", max(1, messages // 100), 100, 4096, 5),
        "large": Scenario("large", max(1, messages // 250), 1, 1 << 20, 5),
    }


# ---- the machine --------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, list[str]] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), rest  # parent pid, fields from state on


def tree(pid: int) -> list[int]:
    """``pid`` and every living descendant."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                parents.setdefault(st[0], []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s tree, reaped children included (utime stime cutime cstime)."""
    total = 0
    for p in tree(pid):
        st = _stat(p)
        if st is not None:
            f = st[1]
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / CLK


def tree_rss(pid: int) -> int:
    total = 0
    for p in tree(pid):
        st = _stat(p)
        if st is not None:
            total += int(st[1][21]) * PAGE
    return total


# ---- the sink -------------------------------------------------------------------------


class _Inotify:
    """The names of files closed after writing in one directory (Linux inotify)."""

    IN_CLOSE_WRITE = 0x8
    IN_NONBLOCK = 0o4000

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init()
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init")
        if self._libc.inotify_add_watch(self.fd, str(directory).encode(),
                                        self.IN_CLOSE_WRITE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        self._stop_r, self._stop_w = os.pipe()

    def closed_files(self) -> Iterator[str]:
        while True:
            ready, _, _ = select.select([self.fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            buf = os.read(self.fd, 1 << 16)
            at = 0
            while at < len(buf):
                _wd, _mask, _cookie, size = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16:at + 16 + size].rstrip(b"\0").decode()
                at += 16 + size
                if name:
                    yield name

    def close(self) -> None:
        os.write(self._stop_w, b"x")


class Sink:
    """``smtp-sink`` on loopback, each transaction timestamped as it arrives.

    The sink dumps each transaction to a file of its own (``-d``) in a tmpfs directory
    watched with inotify (``IN_CLOSE_WRITE``), so arrivals are seen when the sink finishes
    writing them, without polling.  A dump has an ``X-Rcpt-Args`` line per recipient and
    the message's ``Message-Id`` (smtp-source numbers its messages), so the sink counts
    transactions and each (message, recipient) it got: ``rcpt_dups`` counts a recipient of
    a message received again (a duplicate delivery).  Both relays mostly deliver a message
    in one transaction (Postfix: ``smtp_destination_recipient_limit = 1000``); a message
    whose entries two delivery jobs claimed arrives in two, which the run reports as
    ``split``, not as a duplicate.
    """

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relay-bench-sink-", dir="/dev/shm"))
        if os.geteuid() == 0:
            shutil.chown(self.dir, "nobody")  # smtp-sink -u nobody writes there
        self.lock = threading.Lock()
        self.transactions = 0
        self.arrived: dict[str, float] = {}  # probe recipient -> first arrival
        self.probe_dups = 0
        self.delivered: set[tuple[str, str]] = set()  # (Message-Id, recipient) received
        self.rcpt_dups = 0  # recipients of one message received again
        self.changed = threading.Condition(self.lock)
        self._inotify = _Inotify(self.dir)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        user = ["-u", "nobody"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            ["smtp-sink", *user, "-d", f"{self.dir}/m.", f"127.0.0.1:{self.port}", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port, 10)

    def _read(self) -> None:
        for name in self._inotify.closed_files():
            now = time.monotonic()
            path = self.dir / name
            rcpts: list[str] = []
            msgid = ""
            with contextlib.suppress(OSError), open(path, "rb") as f:
                for line in f:  # the headers: smtp-sink's own, then the message's
                    if line.startswith(b"X-Rcpt-Args: <"):
                        rcpts.append(line[14:line.index(b">")].decode())
                    elif line[:11].lower() == b"message-id:":
                        msgid = line[11:].strip().decode(errors="replace")
                    elif line in (b"\n", b"\r\n"):
                        break
            rcpt = rcpts[-1] if rcpts else ""
            with contextlib.suppress(OSError):
                path.unlink()
            with self.changed:
                self.transactions += 1
                for r in rcpts:  # smtp-source's Message-Id names each of its messages
                    key = (msgid, r)
                    if key in self.delivered:
                        self.rcpt_dups += 1
                    else:
                        self.delivered.add(key)
                if rcpt.startswith("probe-"):
                    if rcpt in self.arrived:
                        self.probe_dups += 1
                    else:
                        self.arrived[rcpt] = now
                self.changed.notify_all()

    def alive(self) -> str | None:
        """None while smtp-sink runs, else what it said when it died."""
        if self.proc.poll() is None:
            return None
        err = self.proc.stderr.read() if self.proc.stderr else b""
        return f"smtp-sink exited {self.proc.returncode}: {err.decode(errors='replace')[-300:]}"

    def wait_for(self, n: int, timeout: float) -> float | None:
        """The time the sink had ``n`` transactions, or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.transactions < n:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return None
                self.changed.wait(min(left, 0.5))
            return time.monotonic()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._inotify.close()
        self._reader.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the relays -----------------------------------------------------------------------

#: main.cf settings of the benchmark's Postfix beyond tests/postfix_instance's
BENCH_SETTINGS = {"myhostname": "postfix-bench.localdomain",
                  "smtp_destination_recipient_limit": "1000"}


class Relay:
    name = ""
    pid = 0

    def start(self, work: Path, sink_port: int) -> int:  # returns the SMTP port
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def fsync_note(self) -> str:
        raise NotImplementedError


class Postfix(Relay):
    name = "postfix"

    def start(self, work: Path, sink_port: int) -> int:
        shutil.rmtree(work / "postfix", ignore_errors=True)
        self.instance = PrivatePostfix(work / "postfix", f"[127.0.0.1]:{sink_port}",
                                       settings=BENCH_SETTINGS)
        port = self.instance.start()
        self.pid = self.instance.pid
        return port

    def stop(self) -> None:
        self.instance.stop()

    def fsync_note(self) -> str:
        return ("cleanup fsyncs each queue file before smtpd answers 250 (one file per "
                "message; renames between queue directories are not fsynced)")


class QueueRef(Relay):
    name = "queue-ref"

    def __init__(self, backend: str, processes: int) -> None:
        self.backend = backend
        self.processes = processes

    def start(self, work: Path, sink_port: int) -> int:
        self.dir = work / "queue-ref"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        port = free_port()
        exe = Path(sys.executable).with_name("queue-ref")
        # a KV queue's store is one process's: one root of the queue per process
        roots = ([self.dir / f"queue{i}" for i in range(self.processes)]
                 if self.backend.startswith("kv-") and self.processes > 1
                 else [self.dir / "queue"])
        cmd = [str(exe) if exe.exists() else "queue-ref", "relay",
               *[a for r in roots for a in ("--queue", str(r))], "--backend", self.backend,
               "--listen", f"127.0.0.1:{port}", "--relayhost", f"127.0.0.1:{sink_port}",
               "--processes", str(self.processes)]
        self._log = open(self.dir / "relay.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.dir)
        wait_port(port, 60, self.proc)
        self.pid = self.proc.pid
        return port

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def fsync_note(self) -> str:
        return (f"the {self.backend} queue makes each commit durable before 250 (group "
                "commit: concurrent sessions share one sync round)")


# ---- one run --------------------------------------------------------------------------


@dataclass
class Run:
    round: int
    relay: str
    scenario: str
    messages: int
    accepted_per_s: float = 0.0
    delivered_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    probes: int = 0
    cpu_s_per_msg: float = 0.0
    rss_max_mb: float = 0.0
    delivered_messages: int = 0
    lost: int = 0
    duplicates: int = 0
    split: int = 0  # transactions beyond one per message (a message delivered in parts)
    errors: list[str] = field(default_factory=list)


def _probe_loop(port: int, stop: threading.Event, sent: dict[str, float],
                errors: list[str]) -> None:
    i = 0
    smtp: smtplib.SMTP | None = None
    while not stop.is_set():
        rcpt = f"probe-{i}@{DOMAIN}"
        try:
            if smtp is None:
                smtp = smtplib.SMTP("127.0.0.1", port, timeout=30)
                smtp.ehlo("probe.localdomain")
            smtp.sendmail("probe@example.org", [rcpt],
                          f"Subject: probe {i}\r\n\r\nprobe {i}\r\n".encode())
            sent[rcpt] = time.monotonic()
        except (smtplib.SMTPException, OSError) as e:
            errors.append(f"probe {i}: {e}")
            smtp = None
        i += 1
        stop.wait(0.01)
    if smtp is not None:
        with contextlib.suppress(smtplib.SMTPException, OSError):
            smtp.quit()


def _rss_sampler(pid: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.2):
        peak[0] = max(peak[0], tree_rss(pid))


def run_once(relay: Relay, sc: Scenario, work: Path, timeout: float, rnd: int) -> Run:
    sink = Sink(work)
    res = Run(rnd, relay.name, sc.name, sc.messages)
    try:
        port = relay.start(work, sink.port)
        # start on a settled disk: what the last run left unwritten (its queue's deletes,
        # its logs) is not billed to this one's syncs
        os.sync()
        stop = threading.Event()
        peak = [tree_rss(relay.pid)]
        sampler = threading.Thread(target=_rss_sampler, args=(relay.pid, stop, peak))
        sampler.start()
        sent: dict[str, float] = {}
        probe_errors: list[str] = []
        prober = threading.Thread(target=_probe_loop, args=(port, stop, sent, probe_errors))
        cpu0 = tree_cpu(relay.pid)
        t0 = time.monotonic()
        prober.start()
        src = subprocess.run(
            ["smtp-source", "-s", str(sc.sessions), "-m", str(sc.messages), "-d",
             "-l", str(sc.size), "-r", str(sc.recipients), "-f", "load@example.org",
             "-t", f"rcpt@{DOMAIN}", f"127.0.0.1:{port}"],
            capture_output=True, timeout=timeout)
        t_accepted = time.monotonic()
        stop.set()
        prober.join()
        if src.returncode != 0:
            res.errors.append(f"smtp-source: {src.stderr.decode(errors='replace')[-500:]}")
        expected = sc.messages + len(sent)
        t_done = sink.wait_for(expected, timeout)
        cpu1 = tree_cpu(relay.pid)
        time.sleep(0.5)  # a duplicate in flight would arrive now
        sampler.join()
        res.delivered_messages = sink.transactions
        if t_done is None:
            res.errors.append(f"timeout: the sink had {sink.transactions} of {expected} "
                              f"messages after {timeout} s")
            if (why := sink.alive()) is not None:
                res.errors.append(why)
            res.lost = expected - sink.transactions
            t_done = time.monotonic()
        res.duplicates = sink.rcpt_dups  # a recipient of one message delivered twice
        res.split = max(0, sink.transactions - expected) if res.lost == 0 else 0
        res.accepted_per_s = round(sc.messages / (t_accepted - t0), 1)
        res.delivered_per_s = round(sc.messages / (t_done - t0), 1)
        lat = sorted((sink.arrived[r] - t) * 1000 for r, t in sent.items() if r in sink.arrived)
        missing = [r for r in sent if r not in sink.arrived]
        if missing:
            res.errors.append(f"{len(missing)} probes never reached the sink")
        res.probes = len(lat)
        if lat:
            res.p50_ms = round(statistics.median(lat), 2)
            res.p99_ms = round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2)
        res.cpu_s_per_msg = round((cpu1 - cpu0) / max(1, sc.messages + len(sent)), 6)
        res.rss_max_mb = round(peak[0] / 2**20, 1)
        res.errors += probe_errors[:5]
    finally:
        with contextlib.suppress(Exception):
            relay.stop()
        sink.stop()
    return res


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 6) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--scenario", choices=("all", "bulk", "wide", "large"), default="all")
    ap.add_argument("--backend", default="fs", help="queue-ref's backend (queue-ref relay)")
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                    help="queue-ref relay processes (default: one per core, as Postfix "
                         "runs a process per session)")
    ap.add_argument("--only", choices=("postfix", "queue-ref"), default=None,
                    help="run one relay only (no ratios)")
    ap.add_argument("--work", default=None, help="directory for both queues (default: a "
                    "temporary directory under /var/tmp, a disk-backed file system)")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    ensure_postfix()
    base = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="relay-bench-",
                                                                   dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)  # Postfix's daemons (user postfix) and smtp-sink (nobody) enter it
    relays: list[Relay] = []
    if args.only != "queue-ref":
        relays.append(Postfix())
    if args.only != "postfix":
        relays.append(QueueRef(args.backend, args.processes))
    wanted = list(scenarios(args.messages)) if args.scenario == "all" else [args.scenario]
    runs: list[Run] = []
    try:
        for rnd in range(args.rounds):
            order = relays if rnd % 2 == 0 else list(reversed(relays))
            for name in wanted:
                sc = scenarios(args.messages)[name]
                for relay in order:
                    r = run_once(relay, sc, base / f"r{rnd}-{name}", args.timeout, rnd + 1)
                    runs.append(r)
                    print(f"round {rnd + 1} {name:5} {r.relay:9} accepted {r.accepted_per_s:8.1f}/s"
                          f"  delivered {r.delivered_per_s:8.1f}/s  p50 {r.p50_ms:7.1f} ms"
                          f"  p99 {r.p99_ms:7.1f} ms  cpu {r.cpu_s_per_msg * 1000:6.2f} ms/msg"
                          f"  rss {r.rss_max_mb:6.1f} MB  lost {r.lost}  dup {r.duplicates}"
                          f"  split {r.split}"
                          + (f"  errors: {r.errors[:2]}" if r.errors else ""), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(base, ignore_errors=True)
    out: dict[str, object] = {
        "rounds": args.rounds, "messages": args.messages, "backend": args.backend,
        "processes": args.processes,
        "fsync": {r.name: r.fsync_note() for r in relays},
        "runs": [r.__dict__ for r in runs],
        "lost": sum(r.lost for r in runs),
    }
    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in wanted:
        for relay in relays:
            mine = [r for r in runs if r.scenario == name and r.relay == relay.name]
            summary.setdefault(name, {})[relay.name] = {
                k: _median([getattr(r, k) for r in mine])
                for k in ("accepted_per_s", "delivered_per_s", "p50_ms", "p99_ms",
                          "cpu_s_per_msg", "rss_max_mb")}
        if len(relays) == 2:
            by = {(r.round, r.relay): r for r in runs if r.scenario == name}
            pairs = [(by[(k, "queue-ref")], by[(k, "postfix")])
                     for k in range(1, args.rounds + 1)
                     if (k, "queue-ref") in by and (k, "postfix") in by]
            summary[name]["ratio"] = {
                "delivered": _median([a.delivered_per_s / b.delivered_per_s
                                      for a, b in pairs if b.delivered_per_s]),
                "accepted": _median([a.accepted_per_s / b.accepted_per_s
                                     for a, b in pairs if b.accepted_per_s]),
                "p99": _median([a.p99_ms / b.p99_ms for a, b in pairs if b.p99_ms]),
                "cpu": _median([a.cpu_s_per_msg / b.cpu_s_per_msg
                                for a, b in pairs if b.cpu_s_per_msg]),
            }
    out["summary"] = summary
    main_sc = "bulk" if "bulk" in wanted else wanted[0]
    if len(relays) == 2:
        out["relay_vs_postfix"] = summary[main_sc]["ratio"]["delivered"]
        out["p99_vs_postfix"] = summary[main_sc]["ratio"]["p99"]
        for name in wanted:  # the same two figures per shape
            out[f"relay_vs_postfix_{name}"] = summary[name]["ratio"]["delivered"]
            out[f"p99_vs_postfix_{name}"] = summary[name]["ratio"]["p99"]
    ours = [r.rss_max_mb for r in runs if r.relay == "queue-ref"]
    if ours:
        out["queue_ref_rss_max_mb"] = max(ours)
    print(json.dumps(out))
    return 1 if out["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
