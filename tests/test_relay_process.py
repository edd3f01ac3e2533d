"""``queue-ref relay`` as a process: the CLI, swaks, SIGTERM, SIGUSR1 and SIGKILL."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import smtplib
import socket
import subprocess
import sys
import threading
import time

import pytest

from queue_ref.opener import PID_FILE, open_queue, wake_relay
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import Sink, relay_process


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance.cli", "relay", *args],
                          capture_output=True, text=True, timeout=60)


def test_check_config_prints_the_effective_configuration(tmp_path):
    f = tmp_path / "relay.toml"
    f.write_text('queue = "/var/spool/x"\nrelay_domains = ["example.com"]\n'
                 'maximal_queue_lifetime = "72h"\n')
    r = cli("--config", str(f), "--listen", "127.0.0.1:2600", "--check-config", "--json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout.splitlines()[-1])["config"]
    assert cfg["listen"] == "127.0.0.1:2600" and cfg["relay_domains"] == ["example.com"]
    assert cfg["maximal_queue_lifetime"] == 259200 and cfg["minimal_backoff_time"] == 300
    r = cli("--queue", str(tmp_path), "--check-config")
    assert r.returncode == 0 and "maximal_backoff_time = 4000.0" in r.stdout
    assert 'event_loop = "auto"' in r.stdout
    f.write_text('queue = "/var/spool/x"\nevent_loop = "twisted"\n')
    r = cli("--config", str(f), "--check-config")
    assert r.returncode == 2
    assert r.stderr.strip() == ("queue-ref relay: event_loop: expected one of auto, uvloop, "
                                "asyncio, not 'twisted'")
    f.write_text("queue = 3\n")
    r = cli("--config", str(f), "--check-config")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["queue-ref relay: queue: expected a string, got 3"]
    r = cli("--check-config")
    assert r.returncode == 2 and "no queue directory" in r.stderr
    r = cli("--queue", str(tmp_path), "--backend", "nope")
    assert r.returncode == 2 and "backend: unknown 'nope': expected one of fs" in r.stderr
    kv = tmp_path / "kv"
    open_queue(str(kv), "kv-log").close()
    r = cli("--queue", str(kv), "--check-config")  # the default backend, fs, on a KV queue
    assert r.returncode == 2 and f"{kv} holds a kv-log queue, not a fs one" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = cli("--queue", str(tmp_path / "q"), "--listen", f"127.0.0.1:{busy.getsockname()[1]}")
    assert r.returncode == 1 and "cannot listen on 127.0.0.1:" in r.stderr
    assert not (tmp_path / "q" / PID_FILE).exists()


@pytest.mark.parametrize(("setting", "line"), [
    ("smtp_line_length_limit = 79",
     "smtp_line_length_limit: 0 (no folding) or at least 80, not 79"),
    ("smtp_line_length_limit = \"long\"", "smtp_line_length_limit: expected an integer, got 'long'"),
    ("myhostname = \"mx example.org\"", "myhostname: 'mx example.org' is not a host name (letters, "
     "digits and hyphens in dot-separated labels of 1 to 63)"),
    ("mydomain = \"-bad.org\"", "mydomain: '-bad.org' is not a host name (letters, digits and "
     "hyphens in dot-separated labels of 1 to 63)"),
    ("relayhost = \"[smtp example net]:25\"", "relayhost: 'smtp example net' in '[smtp example "
     "net]:25' is neither a host name (letters, digits and hyphens in dot-separated labels) "
     "nor an IP address"),
    ("relayhost = \"smtp.example.net:587:1\"", "relayhost: 'smtp.example.net:587:1': give the "
     "port once, and an IPv6 address in brackets ([2001:db8::1]:25)"),
    ("transport_maps = {\"a.example\" = \"::1\"}", "transport_maps.a.example: '::1': give the "
     "port once, and an IPv6 address in brackets ([2001:db8::1]:25)"),
    ("backend = \"kv-lgo\"", "backend: unknown 'kv-lgo': expected one of fs, fs-fsync, kv-log, "
     "kv-leveldb or package.module:factory"),
])
def test_check_config_refuses_a_bad_relay_setting_in_one_line(tmp_path, setting, line):
    f = tmp_path / "relay.toml"
    f.write_text(f'queue = "/var/spool/x"\n{setting}\n')
    r = cli("--config", str(f), "--check-config")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"queue-ref relay: {line}"]


@pytest.mark.skipif(shutil.which("swaks") is None, reason="swaks (Debian) is not installed")
@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_swaks_mail_arrives_and_sigterm_stops_in_order(tmp_path, event_loop):
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}",
                                        "--event-loop", event_loop]) as (proc, port):
        assert os.path.exists(os.path.join(queue, PID_FILE))
        out = subprocess.run(["swaks", "--server", f"127.0.0.1:{port}", "--from", "a@example.org",
                              "--to", "b@example.net", "--header", "Subject: via swaks",
                              "--body", "hello from swaks"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "250 2.0.0 Ok: queued as" in out.stdout
        (got,) = sink.wait_for(1)
        assert b"Subject: via swaks" in got.data and b"hello from swaks" in got.data
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert idle.recv(512).startswith(b"220 ")
        proc.send_signal(signal.SIGTERM)
        assert idle.recv(512).startswith(b"421 4.3.2")
        idle.close()
        assert proc.wait(30) == 0
        err = proc.stderr()
    assert "status=sent" in err and "to=<b@example.net>" in err
    assert not os.path.exists(os.path.join(queue, PID_FILE))


def test_sigusr1_wakes_the_relay_for_mail_another_process_queued(tmp_path):
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (proc, _):
        assert proc.wait_log("queue listed")  # the first listing ran before this commit
        with open_queue(queue) as q, q.enqueue("a@example.org", {"arrival": "0"}) as enq:
            enq.write(b"Subject: queued elsewhere\r\n\r\nhi\r\n")
            enq.commit([Recipient("c@example.net", Schedule(0))])
        second = cli("--queue", queue, "--listen", "127.0.0.1:0")
        assert second.returncode == 1
        assert f"another relay (pid {proc.pid}) works on" in second.stderr
        time.sleep(0.3)
        assert sink.state.rcpts() == []  # the relay does not poll the queue
        assert wake_relay(queue)
        (got,) = sink.wait_for(1, timeout=10)
        assert got.rcpts == ["c@example.net"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_sigkill_at_random_moments_loses_no_acknowledged_message(tmp_path):
    """A client sends while the relay is killed (SIGKILL) at random moments and restarted:
    every message that got 250 reaches the sink, and the queue drains."""
    queue = str(tmp_path / "q")
    total, kills = 300, 4
    rng = random.Random(int(os.environ.get("RELAY_KILL_SEED", "12")))
    acked: set[str] = set()
    acked_at_kill: list[int] = []
    state = {"port": 0, "done": False}
    thresholds = sorted(rng.sample(range(20, total - 40), kills))
    lock = threading.Lock()

    def client() -> None:
        i = 0
        while len(acked) < total:
            token = f"m{i:05d}"
            i += 1
            c = smtplib.SMTP(timeout=5)
            try:
                c.connect("127.0.0.1", state["port"])
                c.sendmail("a@example.org", [f"r{i % 7}@example.net"],
                           f"Subject: {token}\r\n\r\nbody {token}\r\n".encode())
                with lock:
                    acked.add(token)
                c.quit()
            except (OSError, smtplib.SMTPException):
                time.sleep(0.05)
            finally:
                c.close()
        state["done"] = True

    args = ["--queue", queue, "--listen", "127.0.0.1:0", "--log-json"]
    with Sink() as sink:
        args += ["--relayhost", f"[127.0.0.1]:{sink.port}"]
        t = threading.Thread(target=client, daemon=True)
        started = time.monotonic()
        for k in range(kills + 1):
            with relay_process(args) as (proc, port):
                state["port"] = port
                if k == 0:
                    t.start()
                if k < kills:
                    # Kill once the client has been acknowledged past a random threshold,
                    # so every kill lands while mail flows, however fast the relay is.
                    deadline = time.monotonic() + 30
                    while len(acked) < thresholds[k] and time.monotonic() < deadline:
                        time.sleep(0.002)
                    time.sleep(rng.uniform(0, 0.05))
                    proc.kill()
                    proc.wait(30)
                    acked_at_kill.append(len(acked))
                    continue
                t.join(60)
                assert state["done"], f"client sent {len(acked)} of {total}"
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    got = {m.data.split(b"Subject: ")[1][:6].decode() for m in sink.state.messages}
                    if acked <= got:
                        break
                    time.sleep(0.1)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
        elapsed = time.monotonic() - started
    # The kills came while mail was flowing.
    assert sum(0 < n < total for n in acked_at_kill) >= kills - 1, acked_at_kill
    missing = acked - got
    assert not missing, f"{len(missing)} acknowledged messages never delivered: {sorted(missing)[:5]}"
    with open_queue(queue) as q:
        assert list(q.list_queue()) == []
        assert q.footprint().objects == 0
    assert elapsed < 90


def test_a_relay_that_cannot_start_says_why_in_its_log_too(tmp_path):
    """With ``--log-json`` standard error holds JSON records only, the reason a relay
    could not start included; with ``log_file`` the reason is on standard error and a
    record in the file, where an operator reads the relay's life."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        r = cli("--queue", str(tmp_path / "q"), "--listen", listen, "--log-json")
        f = tmp_path / "relay.toml"
        f.write_text(f'log_file = "{tmp_path / "relay.log"}"\n')
        r2 = cli("--config", str(f), "--queue", str(tmp_path / "q2"), "--listen", listen)
    assert r.returncode == 1
    records = [json.loads(line) for line in r.stderr.splitlines()]  # every line a record
    [record] = [e for e in records if e["event"] == "error"]
    assert record["what"] == "start"
    assert f"cannot listen on {listen}" in record["reason"]
    assert r2.returncode == 1 and f"cannot listen on {listen}" in r2.stderr
    logged = (tmp_path / "relay.log").read_text().splitlines()
    assert any("error, what=start" in line and "cannot listen" in line for line in logged)
