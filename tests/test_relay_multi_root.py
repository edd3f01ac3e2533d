"""The relay and the operator commands on one queue over two roots (``--queue A --queue
B``, ``queue_directories``): a real relay process receives mail, spreads it over both
roots and delivers it to an aiosmtpd sink; ``mailq``, ``hold`` and ``release`` see both
roots; a second relay on any of the roots is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.cli import main
from queue_ref.opener import open_queues
from queue_ref.relay.relay_config import ConfigError, load_config
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import Sink, relay_process, smtp_send


def mailq(capsys: pytest.CaptureFixture[str], *queues: str) -> list[dict[str, object]]:
    """``queue-ref mailq --json`` on the roots: one object per message, then the totals."""
    capsys.readouterr()
    assert main(["mailq", *(a for q in queues for a in ("--queue", q)), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_relay_spreads_mail_over_two_roots_and_operators_see_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with open_queues([a, b]) as q:
        for i in range(6):
            with q.enqueue("ops@example.org") as enq:
                enq.write(b"Subject: early%d\r\n\r\nbody\r\n" % i)
                enq.commit([Recipient(f"early{i}@example.net", Schedule(0))])
    roots = ["--queue", b, "--queue", a]
    capsys.readouterr()
    assert main(["hold", *roots, "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["changed"] == 6
    listed = mailq(capsys, a, b)
    assert listed[-1]["messages"] == 6
    assert {str(m["queue_id"])[:3] for m in listed[:-1]} == {"r0-", "r1-"}
    with Sink() as sink, relay_process([*roots, "--listen", "127.0.0.1:0", "--relayhost",
                                        f"[127.0.0.1]:{sink.port}"]) as (proc, port):
        ids = [smtp_send(port, "s@example.org", [f"new{i}@example.net"]) for i in range(6)]
        assert {i[:3] for i in ids} == {"r0-", "r1-"}  # spread over both roots
        sink.wait_for(6, timeout=20)
        time.sleep(0.5)
        assert sorted(sink.state.rcpts()) == sorted(f"new{i}@example.net" for i in range(6))
        other = subprocess.run(  # one relay per set of roots: b is taken
            [sys.executable, "-m", "conformance.cli", "relay", "--queue", b, "--queue",
             str(tmp_path / "c"), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and f"works on {b}" in other.stderr
        capsys.readouterr()
        assert main(["release", *roots, "--all", "--json"]) == 0  # and the relay is woken
        sink.wait_for(12, timeout=30)
        time.sleep(0.5)
        rcpts = sink.state.rcpts()
        assert sorted(rcpts) == sorted([f"new{i}@example.net" for i in range(6)]
                                       + [f"early{i}@example.net" for i in range(6)])
        assert len(set(rcpts)) == 12  # nothing delivered twice
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert mailq(capsys, a, b) == [{"messages": 0, "recipients": 0, "bytes": 0}]


def test_queue_directories_in_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "relay.toml"
    conf.write_text(f'queue_directories = ["{tmp_path}/a", "{tmp_path}/b"]\n')
    cfg = load_config(str(conf))
    assert cfg.queue_roots() == [f"{tmp_path}/a", f"{tmp_path}/b"]
    assert load_config(str(conf), {"queue": str(tmp_path / "c"),
                                   "queue_directories": []}).queue_roots() == [
        f"{tmp_path}/c"]  # --queue once replaces the file's roots
    conf.write_text(f'queue = "{tmp_path}/q"\nqueue_directories = ["{tmp_path}/a"]\n')
    with pytest.raises(ConfigError, match="both set"):
        load_config(str(conf))
    conf.write_text(f'queue_directories = ["{tmp_path}/a", "{tmp_path}/a/"]\n')
    with pytest.raises(ConfigError, match="repeated"):
        load_config(str(conf))
    conf.write_text('queue_directories = "not a list"\n')
    with pytest.raises(ConfigError, match="list of strings"):
        load_config(str(conf))
