"""Postfix's ``in_flow_delay``: while delivery is behind (a job waits for a delivery slot),
a DATA command waits before its 354, at most ``in_flow_delay``, so mail is taken no
faster than it goes out.  The sink holds each message after its final dot (a pause
point, ``SinkState.hold``) and the destination takes one delivery at a time: a second
message's job then waits for the slot, and a third client's DATA waits until the sink
lets the first go."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_ref.opener import open_queue
from queue_ref.relay.relay_config import ConfigError, RelayConfig
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayThread, Sink, relay_config, smtp_send
from tests.test_relay_metrics import scrape


@contextlib.contextmanager
def one_job_behind(tmp_path: Path, **kw: Any
                   ) -> Iterator[tuple[RelayThread, Sink, threading.Event]]:
    """A relay whose destination takes one delivery at a time (``kw``: other settings),
    with two messages sent: the first held at the sink until the event is set, the
    second's job waiting for the destination's one slot.  The event is set at the end."""
    with Sink() as sink:
        sink.state.hold = gate = threading.Event()
        config = relay_config(str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}",
                              **{"default_destination_concurrency_limit": 1, **kw})
        with RelayThread(config) as r:
            smtp_send(r.port, "a@ok.test", ["u1@ok.test"])
            smtp_send(r.port, "a@ok.test", ["u2@ok.test"])
            wait_behind(r, 1)
            try:
                yield r, sink, gate
            finally:
                gate.set()


def data_command(port: int, rcpt: bytes = b"u3@ok.test") -> socket.socket:
    """A client that sent EHLO, MAIL, RCPT and DATA (every reply read but DATA's)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    f = s.makefile("rb")
    assert f.readline().startswith(b"220")
    s.sendall(b"EHLO client.test\r\n")
    while not (line := f.readline()).startswith(b"250 "):
        assert line.startswith(b"250-"), line
    for cmd in (b"MAIL FROM:<a@ok.test>", b"RCPT TO:<" + rcpt + b">"):
        s.sendall(cmd + b"\r\n")
        assert f.readline().startswith(b"250"), cmd
    s.sendall(b"DATA\r\n")
    s.settimeout(None)
    return s


def reply_within(s: socket.socket, seconds: float) -> bytes:
    s.settimeout(seconds)
    try:
        return s.recv(100)
    except TimeoutError:
        return b""


@pytest.mark.parametrize("rcpt", ["u3@ok.test", "v@other.test"])
def test_data_waits_while_delivery_is_behind_and_goes_on_when_it_catches_up(
        tmp_path: Path, rcpt: str) -> None:
    """The destination (the relayhost) is behind: a DATA waits, for the same domain or
    another that goes through the same relayhost (it would add to the same backlog), and
    goes when the relayhost's delivery catches up."""
    with one_job_behind(tmp_path, in_flow_delay=10.0) as (r, sink, gate):
        s = data_command(r.port, rcpt.encode())
        try:
            assert reply_within(s, 1.5) == b""  # no 354 while delivery is behind
            gate.set()  # the first message goes; the second takes the slot
            assert reply_within(s, 8).startswith(b"354")
            s.sendall(b"Subject: third\r\n\r\nbody\r\n.\r\n")
            assert reply_within(s, 10).startswith(b"250")
        finally:
            s.close()
        got = sink.wait_for(3)
    assert sorted(x for m in got for x in m.rcpts) == sorted(["u1@ok.test", "u2@ok.test", rcpt])


def prequeued(tmp_path: Path, n: int) -> str:
    """A queue holding ``n`` messages for ok.test, due now (queued before the relay
    starts: their DATA would wait too)."""
    queue = str(tmp_path / "q")
    with open_queue(queue) as q:
        for i in range(1, n + 1):
            with q.enqueue("a@ok.test") as enq:
                enq.write(b"Subject: queued\r\n\r\nbody\r\n")
                enq.commit([Recipient(f"u{i}@ok.test", Schedule(int(time.time())))])
    return queue


def wait_behind(r: RelayThread, n: int) -> None:
    deadline = time.monotonic() + 10
    while r.call(lambda: r.relay.scheduler.behind) != n:
        assert time.monotonic() < deadline, f"never {n} jobs waiting for the slot"
        time.sleep(0.02)


@contextlib.contextmanager
def two_jobs_behind(tmp_path: Path) -> Iterator[tuple[RelayThread, threading.Semaphore]]:
    """A relay whose destination takes one delivery at a time, with three messages queued
    before its start: the first held at the sink until the semaphore is released, the
    other two jobs waiting for the slot.  Every message is delivered at the end."""
    queue = prequeued(tmp_path, 3)
    with Sink() as sink:
        sink.state.hold = tokens = threading.Semaphore(0)
        config = relay_config(queue, relayhost=f"[127.0.0.1]:{sink.port}",
                              default_destination_concurrency_limit=1, in_flow_delay=10.0)
        with RelayThread(config) as r:
            wait_behind(r, 2)
            try:
                yield r, tokens
            finally:
                tokens.release(5)
            sink.wait_for(3)


def test_each_job_that_gets_its_slot_lets_one_waiting_data_go(tmp_path: Path) -> None:
    """Two jobs wait for the slot and two clients' DATA wait: the sink takes one message,
    a job gets the slot, and the first client (only) gets its 354; the sink takes
    another, the last job gets the slot, none waits, and the second client goes too."""
    with two_jobs_behind(tmp_path) as (r, tokens):
        first = data_command(r.port)
        assert reply_within(first, 0.5) == b""
        second = data_command(r.port)
        try:
            assert reply_within(second, 1.0) == b""
            tokens.release()  # u1 is taken: u2's job gets the slot
            assert reply_within(first, 8).startswith(b"354")
            assert reply_within(second, 1.5) == b""  # u3's job still waits
            tokens.release()  # u2 is taken: u3's job gets the slot, none waits
            assert reply_within(second, 8).startswith(b"354")
        finally:
            first.close()
            second.close()


def test_a_turn_no_data_took_is_kept_for_the_next(tmp_path: Path) -> None:
    """A job gets its slot while no DATA waits: the next DATA for the domain goes at once
    (the turn was saved, as Postfix keeps its tokens), the one after waits."""
    with two_jobs_behind(tmp_path) as (r, tokens):
        tokens.release()  # u1 is taken: u2's job gets the slot, no DATA waits
        wait_behind(r, 1)
        first = data_command(r.port)
        second = data_command(r.port)
        try:
            assert reply_within(first, 8).startswith(b"354")
            assert reply_within(second, 1.5) == b""
        finally:
            first.close()
            second.close()


def test_mail_for_another_destination_does_not_wait(tmp_path: Path) -> None:
    """Delivery to the relayhost is behind; a DATA for other.test, which its transport
    map sends elsewhere, gets its 354 at once, and a DATA that gave up waiting leaves
    nothing behind in the scheduler."""
    with Sink() as elsewhere, one_job_behind(
            tmp_path, in_flow_delay=2.0, metrics_listen="127.0.0.1:0",
            transport_maps={"other.test": f"[127.0.0.1]:{elsewhere.port}"}) as (r, sink, gate):
        other = data_command(r.port, b"v@other.test")
        try:
            started = time.monotonic()
            assert reply_within(other, 8).startswith(b"354")
            assert time.monotonic() - started < 1.5  # not in_flow_delay
            assert r.call(lambda: r.relay.scheduler.behind) == 1
        finally:
            other.close()
        for _ in range(2):  # each waits its 2 s and gives up
            s = data_command(r.port)
            try:
                assert reply_within(s, 8).startswith(b"354")
            finally:
                s.close()
        assert r.call(lambda: dict(r.relay.scheduler._inflow)) == {}
        assert r.call(lambda: r.relay.scheduler.in_flow_waits) == 2
        assert r.relay.metrics_port is not None  # what an operator sees
        assert scrape(r.relay.metrics_port)[("queue_ref_relay_in_flow_waits_total", ())] == 2
        gate.set()
        sink.wait_for(2)


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_the_wait_is_at_most_in_flow_delay(tmp_path: Path, delay: float) -> None:
    """Delivery stays behind (the sink holds on): the 354 comes once ``in_flow_delay`` has
    passed (0: at once), while the second job still waits for its slot."""
    with one_job_behind(tmp_path, in_flow_delay=delay) as (r, sink, gate):
        s = data_command(r.port)
        started = time.monotonic()
        try:
            assert reply_within(s, 8).startswith(b"354")
            waited = time.monotonic() - started
            assert r.call(lambda: r.relay.scheduler.behind) == 1  # still behind
            if delay:
                assert waited >= delay * 0.9
        finally:
            s.close()
        gate.set()
        sink.wait_for(2)


@pytest.mark.parametrize("delay", [-0.1, 10.5])
def test_in_flow_delay_is_from_0_to_10_seconds(tmp_path: Path, delay: float) -> None:
    with pytest.raises(ConfigError, match="in_flow_delay"):
        RelayConfig(queue=str(tmp_path / "q"), in_flow_delay=delay).validate()


def test_each_of_n_processes_takes_its_share_of_a_destinations_limit(tmp_path: Path) -> None:
    """A destination sees no more connections than its limit however many processes
    deliver: of 2, each takes 1 of a limit of 2 (a worker used to take all of it, and the
    destination saw twice its limit), so this worker's second message waits.  Of 3, each
    takes 6 of 20 (7 each would make 21).  ``max_deliveries`` stays each process's own."""
    config = relay_config(str(tmp_path / "q"), processes=3)
    assert (config.share(20), config.share(2), config.share(1)) == (6, 1, 1)
    with one_job_behind(tmp_path, processes=2, default_destination_concurrency_limit=2
                        ) as (r, sink, gate):
        assert r.relay.scheduler.destination_limit == 1
        assert r.relay.scheduler.max_deliveries == r.relay.config.max_deliveries
        gate.set()
        sink.wait_for(2)


def test_mail_that_takes_no_delivery_slot_never_waits(tmp_path: Path) -> None:
    """An ATRN domain's mail waits for its client, not for the relayhost its domain would
    map to: its DATA does not wait while the relayhost is behind."""
    import asyncio
    import dataclasses
    import io

    from queue_ref.relay.delivery_log import DeliveryLog
    from queue_ref.relay.delivery_scheduler import DeliveryScheduler
    from queue_ref.relay.mx_routing import Router

    cfg = dataclasses.replace(relay_config(str(tmp_path / "q"), relayhost="[10.0.0.1]:25"),
                              atrn_domains={"atrn.test": "user"})
    s = DeliveryScheduler(None, cfg, Router(cfg), None,  # type: ignore[arg-type]
                          DeliveryLog(stream=io.StringIO()), None)  # type: ignore[arg-type]

    async def waits(rcpt: str) -> float:
        started = time.monotonic()
        await s.in_flow([rcpt], 0.5)
        return time.monotonic() - started

    s._lagging(s.router.destination_of("other.test"), 1)  # a job waits at the relayhost
    assert asyncio.run(waits("u@atrn.test")) < 0.2
    assert asyncio.run(waits("u@other.test")) >= 0.45  # mail for the relayhost does wait
