"""``queue-ref relay --processes N``: several relay processes on one queue and one port.

Real processes, a real SMTP sink, real signals: the workers share the port (both take
connections) and the queue (each message delivered once), a killed worker is started
again and loses nothing, a killed master takes its workers with it, a backend that
processes cannot share is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import smtplib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from queue_ref.opener import PID_FILE, open_queue, read_relay_pid, wake_relay
from queue_ref.relay.session_handoff import channel_pair
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayProcess, Sink, relay_process

_STARTED = re.compile(r"queue-ref/relay\[(\d+)\]: relay, what=started, .*worker=(\d+)")
_SENT = re.compile(r"queue-ref/relay\[(\d+)\]: \S+: to=<[^>]+>.*status=sent")


def _send(port: int, tokens: list[str], acked: set[str], lock: threading.Lock) -> None:
    for token in tokens:
        for _ in range(100):
            try:
                with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
                    c.sendmail("a@example.org", [f"{token}@example.net"],
                               f"Subject: {token}\r\n\r\nbody {token}\r\n".encode())
                with lock:
                    acked.add(token)
                break
            except (OSError, smtplib.SMTPException):
                time.sleep(0.05)  # a worker being restarted: the client tries again


def _subjects(sink: Sink) -> list[str]:
    with sink.state.lock:
        return [m.data.split(b"Subject: ")[1].split(b"\r\n")[0].decode()
                for m in sink.state.messages]


def _wait_delivered(sink: Sink, want: set[str], timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _subjects(sink)
        if want <= set(got):
            return got
        time.sleep(0.05)
    return _subjects(sink)


def _workers(rp: RelayProcess) -> dict[int, int]:
    """worker index -> pid, from the started lines of the log (the latest per index)."""
    found: dict[int, int] = {}
    for line in list(rp.err_lines):
        m = _STARTED.search(line)
        if m:
            found[int(m.group(2))] = int(m.group(1))
    return found


def kill_a_worker_while_mail_flows(rp: RelayProcess, port: int, sink: Sink,
                                   tokens: list[str], index: int, after: int) -> list[str]:
    """Three clients send ``tokens``; once ``after`` are acknowledged worker ``index`` is
    killed (SIGKILL) while mail flows through both workers.  Asserts that it is started
    again, that every token is acknowledged and every acknowledged one delivered; then
    stops the relay.  The subjects the sink got."""
    acked: set[str] = set()
    lock = threading.Lock()
    assert _wait(lambda: len(_workers(rp)) == 2)
    victim = _workers(rp)[index]
    threads = [threading.Thread(target=_send, args=(port, tokens[k::3], acked, lock))
               for k in range(3)]
    for t in threads:
        t.start()
    assert _wait(lambda: len(acked) >= after)
    os.kill(victim, signal.SIGKILL)
    killed_at = len(acked)
    assert _wait(lambda: _workers(rp).get(index) not in (None, victim))
    for t in threads:
        t.join(180)
    assert killed_at < len(tokens) and acked == set(tokens)
    got = _wait_delivered(sink, acked, timeout=90)
    missing = acked - set(got)
    assert not missing, f"{len(missing)} acknowledged, never delivered: {sorted(missing)[:5]}"
    rp.send_signal(signal.SIGTERM)
    assert rp.wait(60) == 0
    return got


def _wait(cond: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _title(pid: int) -> str:
    """A process's command line as ``ps`` shows it."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_two_processes_share_the_port_and_the_queue(tmp_path):
    queue = str(tmp_path / "q")
    tokens = [f"m{i:03d}" for i in range(80)]
    acked: set[str] = set()
    lock = threading.Lock()
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--processes", "2",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        assert read_relay_pid(queue) == rp.pid  # the master owns the pid file
        assert _wait(lambda: len(_workers(rp)) == 2)
        pids = _workers(rp)
        assert rp.pid not in pids.values() and len(set(pids.values())) == 2
        # named in ps as what they are, not "python -c from multiprocessing.spawn ..."
        assert _title(rp.pid) == f"queue-ref relay: master --queue {queue}"
        assert sorted(_title(p) for p in pids.values()) == [
            f"queue-ref relay: worker {k} of 2 --queue {queue}" for k in (0, 1)]
        threads = [threading.Thread(target=_send, args=(port, tokens[k::4], acked, lock))
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert acked == set(tokens)
        got = _wait_delivered(sink, acked)
        # every message once: the claims are exclusive across the processes
        assert sorted(got) == sorted(tokens)
        # mail another process queued: SIGUSR1 to the master reaches the workers
        with open_queue(queue) as q, q.enqueue("a@example.org", {"arrival": "0"}) as enq:
            enq.write(b"Subject: woken\r\n\r\nhi\r\n")
            enq.commit([Recipient("w@example.net", Schedule(0))])
        assert wake_relay(queue)
        assert "woken" in _wait_delivered(sink, {"woken"}, timeout=20)
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0
        err = rp.stderr()
    senders = {int(m.group(1)) for m in _SENT.finditer(err)}
    assert senders == set(pids.values()), (senders, pids)  # both workers took mail
    assert not os.path.exists(os.path.join(queue, PID_FILE))
    with open_queue(queue) as q:
        assert list(q.list_queue()) == [] and list(q.find_inflight()) == []
        assert q.footprint().objects == 0


def _session(port: int) -> smtplib.SMTP:
    c = smtplib.SMTP("127.0.0.1", port, timeout=10)
    assert c.ehlo("client.test")[0] == 250  # greeted: the session is in a worker
    return c


def _worker_of(rp: RelayProcess, c: smtplib.SMTP, token: str) -> int:
    """Queue a message on session ``c``: the pid of the worker that received it."""
    assert c.mail("a@example.org")[0] == 250
    assert c.rcpt(f"{token}@example.net")[0] == 250
    code, text = c.data(f"Subject: {token}\r\n\r\nbody\r\n".encode())
    assert code == 250, text
    qid = text.decode().rsplit(" ", 1)[1]
    line = re.compile(rf"queue-ref/relay\[(\d+)\]: {qid}: received")
    assert rp.wait_log(f"{qid}: received", 10)
    found = [int(m.group(1)) for x in list(rp.err_lines) if (m := line.search(x))]
    assert len(found) == 1, found
    return found[0]


def test_sessions_held_at_once_are_spread_evenly_over_the_workers(tmp_path):
    """Nine sessions from one client, all open at once, on three workers: three each.
    (Each worker listening with SO_REUSEPORT, as before, spread them by a hash of the
    ports: five benchmark sessions all went to one worker in 3 runs of 5.)"""
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--processes", "3",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 3)
        sessions = [_session(port) for _ in range(9)]
        try:
            where = [_worker_of(rp, c, f"s{i}") for i, c in enumerate(sessions)]
        finally:
            for c in sessions:
                c.quit()
        assert sorted(where.count(pid) for pid in set(where)) == [3, 3, 3], where
        assert set(where) == set(_workers(rp).values())
        assert len(_wait_delivered(sink, {f"s{i}" for i in range(9)})) == 9
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0


def test_a_worker_whose_sessions_ended_gets_the_next_ones(tmp_path):
    """The master counts the sessions each worker holds, ends included: with two
    sessions on each worker, both of one worker's ended, the next two go to it."""
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--processes", "2",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 2)
        sessions = [_session(port) for _ in range(4)]
        where = [_worker_of(rp, c, f"a{i}") for i, c in enumerate(sessions)]
        assert sorted(where.count(pid) for pid in set(where)) == [2, 2], where
        freed = where[0]
        for c, pid in zip(sessions, where, strict=True):
            if pid == freed:
                c.quit()
        time.sleep(1)  # the worker's reports of the ended sessions reach the master
        later = [_session(port) for _ in range(2)]
        assert [_worker_of(rp, c, f"b{i}") for i, c in enumerate(later)] == [freed, freed]
        for c in [*sessions, *later]:
            if c.sock is not None:  # not ended above
                c.quit()
        assert len(_wait_delivered(sink, {"a0", "a1", "a2", "a3", "b0", "b1"})) == 6
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0


def test_connections_a_killed_worker_never_took_are_greeted_by_another(tmp_path):
    """One worker stalled (SIGSTOP) while six clients connect: the master hands them out
    in turn, and those of the stalled worker wait in its channel.  It is killed
    (SIGKILL) before it took them: the master hands them to the other worker, and every
    client is greeted.  (Until 2026-11-29 those clients saw their connection closed
    without a word.)"""
    with _two_workers(tmp_path) as (rp, port):
        victim = _workers(rp)[0]
        os.kill(victim, signal.SIGSTOP)
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10)
                   for _ in range(6)]
        time.sleep(0.5)  # handed over: three wait in the stalled worker's channel
        os.kill(victim, signal.SIGKILL)
        heard = []
        for c in clients:
            c.settimeout(30)
            with contextlib.suppress(OSError):
                heard.append(c.recv(64))
            c.close()
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0
        err = rp.stderr()
    assert len(heard) == 6 and all(h.startswith(b"220 ") for h in heard), heard
    assert "what=worker died, worker=0, exit=-9" in err
    assert "what=connections handed on, worker=0, connections=3" in err


def _read_all(s: socket.socket, timeout: float = 30.0) -> bytes:
    s.settimeout(timeout)
    got = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(4096):
            got += chunk
    return got


@contextlib.contextmanager
def _two_workers(tmp_path: Path) -> Iterator[tuple[RelayProcess, int]]:
    """A relay of two workers on a queue under ``tmp_path``, both started."""
    with relay_process(["--queue", str(tmp_path / "q"), "--listen", "127.0.0.1:0",
                        "--processes", "2", "--relayhost", "[127.0.0.1]:9"]) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 2)
        yield rp, port


@contextlib.contextmanager
def _stalled(rp: RelayProcess) -> Iterator[None]:
    """Every worker stopped (SIGSTOP) for the block, then running again."""
    workers = list(_workers(rp).values())
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)


def _channel_capacity() -> int:
    """How many connections a worker's channel holds before the master's send would
    block (about 280 on this machine: it follows the socket buffer sizes)."""
    mine, theirs = channel_pair()
    held = 0
    with mine, theirs, socket.socket() as conn:
        while True:
            try:
                socket.send_fds(mine, [b"s"], [conn.fileno()])
            except BlockingIOError:
                return held
            held += 1


def test_connections_wait_while_every_worker_is_stalled_none_is_closed(tmp_path):
    """Both workers stalled (SIGSTOP) while more connections arrive than their two
    channels hold: the master fills them, then stops accepting and the rest wait in the
    kernel's accept queue; once the workers run again every client is greeted.  (A
    master that closed what no channel could take closed 244 of 800 here.)"""
    total = 2 * _channel_capacity() + 140
    with _two_workers(tmp_path) as (rp, port):
        clients: list[socket.socket] = []
        with _stalled(rp):
            for _ in range(total):
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(1)  # the master hands over what the channels hold
        greeted = 0
        for c in clients:
            c.settimeout(30)
            with contextlib.suppress(OSError):
                greeted += c.recv(64).startswith(b"220 ")
            c.close()
        assert greeted == total
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0
        err = rp.stderr()
    assert "handing over" not in err and "what=counting sessions" not in err


def test_connections_handed_to_a_stopping_worker_are_told_421(tmp_path):
    """Connections handed to stalled workers when the relay is told to stop: each
    client hears the 421 the other sessions get, not a connection closed without a
    word.  (Whether a worker reads them before or while it stops depends on the order
    it wakes in; the drain at stop is forced in test_relay_session_handoff.py.)"""
    with _two_workers(tmp_path) as (rp, port):
        with _stalled(rp):
            clients = [socket.create_connection(("127.0.0.1", port), timeout=10)
                       for _ in range(6)]
            time.sleep(0.5)  # handed over: in the stalled workers' channels
            rp.send_signal(signal.SIGTERM)  # the master stops, its workers get SIGTERM
            time.sleep(0.5)
        heard = [_read_all(c) for c in clients]
        for c in clients:
            c.close()
        assert rp.wait(60) == 0
    assert all(b"\r\n421 " in b"\r\n" + h for h in heard), heard


def test_a_killed_worker_is_started_again_and_nothing_acknowledged_is_lost(tmp_path):
    queue = str(tmp_path / "q")
    tokens = [f"k{i:03d}" for i in range(240)]
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--processes", "2",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        kill_a_worker_while_mail_flows(rp, port, sink, tokens, 0, after=60)
        err = rp.stderr()
    assert "what=worker died, worker=0, exit=-9" in err
    assert "what=worker restarted, worker=0" in err
    with open_queue(queue) as q:
        assert list(q.list_queue()) == [] and list(q.find_inflight()) == []


def test_a_killed_master_takes_its_workers_with_it(tmp_path):
    queue = str(tmp_path / "q")
    with relay_process(["--queue", queue, "--listen", "127.0.0.1:0", "--processes", "2",
                        "--relayhost", "[127.0.0.1]:9"]) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 2)
        workers = list(_workers(rp).values())
        rp.kill()
        rp.wait(30)

        def gone() -> bool:
            for pid in workers:
                try:
                    os.kill(pid, 0)
                    return False
                except ProcessLookupError:
                    pass
            return True

        assert _wait(gone, 30), "workers outlived their master"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # nobody listens any more
    # and a new relay starts on that queue
    with relay_process(["--queue", queue, "--listen", "127.0.0.1:0", "--processes", "2",
                        "--relayhost", "[127.0.0.1]:9"]) as (rp, _):
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance.cli", "relay", *args],
                          capture_output=True, text=True, timeout=120)


def test_processes_a_backend_cannot_share_or_a_bad_count_are_refused(tmp_path):
    for check in ([], ["--check-config"]):  # refused by the configuration's check alike
        r = _cli("--queue", str(tmp_path / "kv"), "--backend", "kv-log", "--listen",
                 "127.0.0.1:0", "--processes", "2", *check)
        assert r.returncode == 2, r.stderr
        assert "backend kv-log cannot be shared by several processes" in r.stderr
    assert not os.path.exists(tmp_path / "kv")  # nothing was made: no KV store
    assert "one root per process (queue_directories, or --queue once per root: 2 roots for " \
           "processes = 2; now 1)" in r.stderr
    assert not os.path.exists(tmp_path / "kv" / PID_FILE)
    r = _cli("--queue", str(tmp_path / "q"), "--processes", "0", "--check-config")
    assert r.returncode == 2
    assert r.stderr.strip() == "queue-ref relay: processes: must be at least 1"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = _cli("--queue", str(tmp_path / "q"), "--processes", "2",
                 "--listen", f"127.0.0.1:{busy.getsockname()[1]}")
    assert r.returncode == 1 and "cannot listen on 127.0.0.1:" in r.stderr
    assert not os.path.exists(tmp_path / "q" / PID_FILE)


def test_the_master_exits_only_after_every_worker_stopped(tmp_path):
    """SIGTERM: the master waits for each worker's orderly stop (a delivery cut short by
    ``shutdown_timeout`` and put back) before it exits 0: no worker outlives it, so a new
    relay never meets the old one's workers on the queue."""
    queue = str(tmp_path / "q")
    with Sink() as sink:
        cfg = tmp_path / "relay.toml"
        cfg.write_text(f'queue = "{queue}"\nlisten = "127.0.0.1:0"\nprocesses = 2\n'
                       f'relayhost = "[127.0.0.1]:{sink.port}"\nshutdown_timeout = "1s"\n')
        with relay_process(["--config", str(cfg)]) as (rp, port):
            assert _wait(lambda: len(_workers(rp)) == 2)
            workers = list(_workers(rp).values())
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:  # the sink holds DATA
                c.sendmail("a@example.org", ["slow1@example.net"], b"Subject: s\r\n\r\nx\r\n")
            assert _wait(lambda: sink.state.connections >= 1)
            time.sleep(0.3)  # the delivery is in DATA
            rp.send_signal(signal.SIGTERM)
            assert rp.wait(60) == 0
            alive = []
            for pid in workers:
                try:
                    os.kill(pid, 0)
                    alive.append(pid)
                except ProcessLookupError:
                    pass
            err = rp.stderr()
    assert alive == [], f"workers {alive} outlived their master"
    lines = err.splitlines()
    stops = [i for i, line in enumerate(lines) if "relay, what=stopped" in line]
    master = [i for i in stops if f"relay[{rp.pid}]" in lines[i]]
    assert len(stops) == 3 and master == [max(stops)], lines[-10:]
    with open_queue(queue) as q:  # the delivery cut short is queued again, not lost
        assert [h.message_id for h in q.list_queue()] and list(q.find_inflight()) == []


def test_a_worker_stopped_on_its_own_is_logged_as_stopped_and_started_again(tmp_path):
    """SIGTERM to one worker (not the master): it stops cleanly (exit 0), which the
    master logs as a stop, not a death, and starts it again; the relay goes on."""
    with Sink() as sink, relay_process(["--queue", str(tmp_path / "q"), "--listen",
                                        "127.0.0.1:0", "--processes", "2", "--relayhost",
                                        f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 2)
        victim = _workers(rp)[1]
        os.kill(victim, signal.SIGTERM)
        assert _wait(lambda: _workers(rp).get(1) not in (None, victim))
        acked: set[str] = set()
        _send(port, ["after-stop"], acked, threading.Lock())
        assert acked == {"after-stop"}
        assert _wait_delivered(sink, acked) == ["after-stop"]
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0
        err = rp.stderr()
    assert "what=worker stopped, worker=1, exit=0" in err
    assert "what=worker died" not in err


def test_json_records_name_the_process_that_wrote_them(tmp_path):
    """With ``--log-json`` the master and each worker write to one stream: every record
    carries its writer's pid, as the text line's ``relay[PID]`` does."""
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--processes", "2", "--log-json",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, port):
        def started() -> list[dict]:
            return [r for r in (json.loads(x) for x in list(rp.err_lines) if x.startswith("{"))
                    if r.get("what") == "started"]

        assert _wait(lambda: len(started()) == 3)
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
            c.sendmail("a@example.org", ["r@example.net"], b"Subject: pid\r\n\r\nbody\r\n")
        sink.wait_for(1)
        assert _wait(lambda: any('"delivery"' in x for x in list(rp.err_lines)))
        records = [json.loads(x) for x in list(rp.err_lines) if x.startswith("{")]
    workers = {r["worker"]: r["pid"] for r in started() if "worker" in r}
    [master] = [r["pid"] for r in started() if "processes" in r]
    assert master == rp.pid and sorted(workers) == [0, 1]
    assert rp.pid not in workers.values() and len(set(workers.values())) == 2
    [received] = [r for r in records if r["event"] == "received"]
    [delivery] = [r for r in records if r["event"] == "delivery"]
    assert received["pid"] in workers.values() and delivery["pid"] in workers.values()
    assert all(isinstance(r["pid"], int) for r in records)


def test_a_relay_of_one_process_is_named_in_ps_too(tmp_path):
    queue = str(tmp_path / "q")
    with relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                        "--relayhost", "[127.0.0.1]:9"]) as (rp, _):
        assert _title(rp.pid) == f"queue-ref relay: one process --queue {queue}"
