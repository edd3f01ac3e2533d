"""The operator commands on a live queue: a ``queue-ref relay`` process delivers while the
commands hold, release and flush in this process (two processes sharing one filesystem
queue).  Held mail is never delivered until released; nothing is claimed (delivered)
twice; nothing is lost."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from conformance.cli import main
from queue_ref.opener import open_queue, wake_relay
from queue_ref.operate import queue_actions as qa
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import Sink, relay_process


def enqueue(queue: str, names: list[str], at: int = 0) -> None:
    with open_queue(queue) as q:
        for n in names:
            with q.enqueue("ops@example.org", {"arrival": f"{time.time():.3f}"}) as enq:
                enq.write(b"Subject: %s\r\n\r\nbody\r\n" % n.encode())
                enq.commit([Recipient(f"{n}@example.net", Schedule(at))])


def cmd(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main([*args, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


def held_names(queue: str) -> set[str]:
    with open_queue(queue) as q:
        return {i.rcpt.split("@")[0] for _, i in qa.listing(q) if i.state == "held"}


def test_held_mail_waits_for_release_under_a_running_relay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = str(tmp_path / "q")
    first = [f"early{i}" for i in range(6)]
    enqueue(queue, first)
    assert cmd(capsys, "hold", "--queue", queue, "--domain", "example.net")["changed"] == 6
    assert cmd(capsys, "release", "--queue", queue,
               *entry_ids(queue, ("early0", "early1", "early2")))["changed"] == 3
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (proc, _):
        sink.wait_for(3, timeout=20)
        time.sleep(0.5)
        assert sorted(sink.state.rcpts()) == [f"early{i}@example.net" for i in range(3)]
        # a burst arrives; the operator holds everything while the relay delivers
        burst = [f"burst{i:02d}" for i in range(30)]
        enqueue(queue, burst)
        assert wake_relay(queue)
        cmd(capsys, "hold", "--queue", queue, "--all")
        held = held_names(queue)
        time.sleep(1.0)
        delivered = {r.split("@")[0] for r in sink.state.rcpts()}
        assert not held & delivered, f"held mail was delivered: {sorted(held & delivered)}"
        assert {f"early{i}" for i in range(3, 6)} <= held
        # release: everything arrives, each recipient exactly once; the relay is woken and
        # the command says so, as flush does
        assert main(["release", "--queue", queue, "--all"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[-2:] == [f"release: {len(held)} entries", "relay woken"]
        sink.wait_for(36, timeout=30)
        time.sleep(0.5)
        rcpts = sink.state.rcpts()
        assert sorted(rcpts) == sorted(f"{n}@example.net" for n in first + burst)
        assert len(rcpts) == len(set(rcpts)) == 36  # nothing claimed twice
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    capsys.readouterr()
    assert main(["mailq", "--queue", queue]) == 0
    assert capsys.readouterr().out.strip() == "Mail queue is empty"


def entry_ids(queue: str, names: tuple[str, ...]) -> list[str]:
    with open_queue(queue) as q:
        return [i.entry_id for _, i in qa.listing(q) if i.rcpt.split("@")[0] in names]


def test_flush_wakes_the_running_relay_which_delivers_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`queue-ref flush` makes deferred mail due and wakes the relay (SIGUSR1), which then
    delivers it at once, not at its next scan (300 s); nothing to flush wakes nobody."""
    queue = str(tmp_path / "q")
    enqueue(queue, ["later0", "later1"], at=int(time.time()) + 3600)
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (proc, _):
        time.sleep(0.5)
        assert sink.state.rcpts() == []
        res = cmd(capsys, "flush", "--queue", queue)
        assert res["changed"] == 2 and res["relay_woken"] is True
        sink.wait_for(2, timeout=10)
        assert sorted(sink.state.rcpts()) == ["later0@example.net", "later1@example.net"]
        time.sleep(0.3)
        res = cmd(capsys, "flush", "--queue", queue)
        assert res["changed"] == 0 and res["relay_woken"] is False
        proc.send_signal(signal.SIGHUP)  # a Postfix operator's reload: said what it is not
        assert proc.wait_log("signal=SIGHUP")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    woken = [line for line in proc.stderr().splitlines() if "what=woken" in line]
    assert len(woken) == 2 and "signal=SIGUSR1" in woken[0]  # the flush's, said once
    assert "signal=SIGHUP" in woken[1] and "configuration is read at start only" in woken[1]
