"""A body over ``STREAMED_BODY`` is never held whole: it is read from the queue a piece at a
time as it goes out (``smtp_wire_body``, ``queued_body``).

The sink stops reading in the middle of DATA (a pause point: ``SinkState.data_pause``), so
the relay's writes wait with the body part sent; what the relay holds then is looked at,
the queue is damaged or made to fail at that moment, and what arrives (or does not) is
compared with what was queued.  A body found damaged, or a read that fails, in the middle
of DATA drops the connection before the final dot: the peer delivers nothing."""

from __future__ import annotations

import contextlib
import json
import os
import smtplib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref.kv.base import KV
from queue_ref.kv.core import CHUNK
from queue_ref.opener import open_queue
from queue_ref.relay.smtp_wire_body import STREAM_PIECE, STREAMED_BODY
from queue_ref.storage import Recipient, Schedule
from tests.relay_faulty_steps import read_io_trigger_of
from tests.relay_support import RelayThread, Sink, relay_config
from tests.test_relay_waiting_bodies import big_body, flip_a_bit, flip_in_chunk, prequeue

MIB = 1024 * 1024
SIZE = 12 * MIB


def odd_body(size: int) -> bytes:
    """About ``size`` octets of mail with what the wire changes: lines that start with a
    dot, lines over 998 octets (folded), a bare LF and a bare CR."""
    lines = []
    n = 0
    while n < size:
        i = len(lines)
        line = (b"." if i % 7 == 0 else b"") + b"%08d " % i + (
            b"z" * 1500 if i % 50 == 0 else b"y" * 60)
        lines.append(line)
        n += len(line) + 2
    return b"Subject: odd\r\n\r\n" + b"\r\n".join(lines) + b"\r\nbare\nlf\rcr\r\n"


def unfolded(data: bytes) -> bytes:
    """What a sink received, with the folding undone (aiosmtpd unstuffs the dots)."""
    return data.replace(b"\r\n ", b"")


def wait_until(what: str, cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.02)


def settled(r: RelayThread) -> None:
    wait_until("settled", lambda: not r.call(lambda: r.relay.scheduler.sizes())["inflight"])


def wait_paused(sink: Sink, n: int) -> None:
    wait_until(f"{n} sessions paused", lambda: sink.state.paused == n)


@contextlib.contextmanager
def relay_paused_in_data(queue: str, paused: int = 1, after: int = 2 * MIB, **config: object
                         ) -> Iterator[tuple[Sink, RelayThread, threading.Event]]:
    """A relay whose next hop (a sink) stops reading DATA after ``after`` octets of it;
    yields once ``paused`` sessions stopped there (0: at once), and the gate that lets the
    sink read on (set at the latest when the block ends)."""
    with Sink() as sink:
        gate = threading.Event()
        sink.state.data_pause = (after, gate)
        with RelayThread(relay_config(queue, relayhost=f"[127.0.0.1]:{sink.port}",
                                      **config)) as r:
            try:
                if paused:
                    wait_paused(sink, paused)
                yield sink, r, gate
            finally:
                gate.set()


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_a_big_body_goes_out_a_piece_at_a_time(tmp_path: Path, backend: str) -> None:
    """Paused in the middle of DATA, the relay holds at most one piece of the body (the
    gauge ``body_bytes``), not the body; what arrives is what was queued, folded lines
    and dot lines included."""
    queue = str(tmp_path / "q")
    bodies = [big_body(0, SIZE), odd_body(SIZE)]
    assert all(len(b) > STREAMED_BODY for b in bodies)
    prequeue(queue, bodies, backend=backend)
    with relay_paused_in_data(queue, 2, 3 * MIB, backend=backend) as (sink, r, gate):
        held = r.call(lambda: r.relay.scheduler.body_bytes)
        assert 0 < held <= 2 * STREAM_PIECE, held
        gate.set()
        got = sink.wait_for(2, timeout=60)
        settled(r)
        assert r.call(lambda: r.relay.scheduler.body_bytes) == 0
    by_rcpt = {m.rcpts[0]: m.data for m in got}
    assert by_rcpt["u0.0@ok.test"] == bodies[0]
    assert unfolded(by_rcpt["u1.0@ok.test"]) == bodies[1].replace(b"\nlf\rcr", b"\r\nlf\r\ncr")
    assert max(map(len, by_rcpt["u1.0@ok.test"].split(b"\r\n"))) <= 998


def test_mail_the_receiver_took_goes_out_streamed_as_it_came(tmp_path: Path) -> None:
    """A message of 6 MB received over SMTP (its body found to go out as it is) is
    delivered streamed, byte for byte after the relay's Received: header."""
    body = big_body(5, 6 * MIB)
    with relay_paused_in_data(str(tmp_path / "q"), 0) as (sink, r, gate):
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as c:
            assert c.sendmail("a@ok.test", ["u@ok.test"], body) == {}
        wait_paused(sink, 1)
        assert r.call(lambda: r.relay.scheduler.body_bytes) <= STREAM_PIECE
        gate.set()
        (m,) = sink.wait_for(1, timeout=60)
    assert m.data.startswith(b"Received: ") and m.data.endswith(b"\r\n" + body)


def damage_late(kv: KV, queue: str, backend: str, victim: str, size: int) -> None:
    """One bit flipped near the end of the stored body of ``victim`` (past what the
    relay has read of it while the sink is paused); ``kv``: the engine of the store that
    holds it (the relay's, while it runs)."""
    if backend == "fs":
        flip_a_bit(os.path.join(queue, "data", victim), from_end=1000)
    else:
        flip_in_chunk(kv, victim, size // CHUNK - 2)


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_a_body_found_damaged_while_it_streams_is_never_delivered(
        tmp_path: Path, backend: str) -> None:
    """Damaged while its DATA is under way: the queue finds it at the end, before the
    last octets; the connection is dropped without the final dot, so the sink delivers
    nothing, the message is quarantined (one ``read`` error), and no DSN is sent."""
    queue = str(tmp_path / "q")
    (victim,) = prequeue(queue, [big_body(1, SIZE)], rcpts=2, backend=backend)
    with relay_paused_in_data(queue, backend=backend, log_json=True) as (sink, r, gate):
        damage_late(getattr(r.relay.scheduler.store, "kv", None), queue, backend, victim, SIZE)
        gate.set()
        settled(r)
        assert r.call(lambda: r.relay.scheduler.job_errors) == 0
        assert r.call(lambda: r.relay.scheduler.sizes())["queued"] == 0
    assert sink.state.data_commands == 1 and sink.state.messages == []
    records = [json.loads(line) for line in r.log_lines]
    errors = [e for e in records if e["event"] == "error"]
    assert [(e["queue_id"], e["what"]) for e in errors] == [(victim, "read")], errors
    assert errors[0]["reason"].startswith("quarantined:")
    assert not any(e["event"] in ("delivery", "bounce") for e in records)
    with open_queue(queue, backend) as q:
        assert list(q.list_queue()) == [] and list(q.find_inflight()) == []
    if backend == "fs":
        assert os.path.exists(os.path.join(queue, "quarantine", f"{victim}.msg"))


def test_a_disk_error_while_a_body_streams_puts_its_entries_back(tmp_path: Path) -> None:
    """A read fails as a disk does in the middle of DATA: the connection is dropped
    before the final dot (nothing delivered), the error is logged, and the entries go back
    to the queue due in a minute with no attempt counted; another message goes on."""
    queue = str(tmp_path / "q")
    victim, other = prequeue(queue, [big_body(2, SIZE), big_body(3, 5 * MIB)], rcpts=2)
    with relay_paused_in_data(queue, log_json=True, backend="tests.relay_faulty_steps:fs",
                              default_destination_concurrency_limit=1) as (sink, r, gate):
        Path(read_io_trigger_of(queue)).touch()  # the next piece read: victim's
        gate.set()
        got = sink.wait_for(2, timeout=60)
        settled(r)
    assert not os.path.exists(read_io_trigger_of(queue))  # it fired
    assert sorted(r for m in got for r in m.rcpts) == ["u1.0@ok.test", "u1.1@ok.test"]
    assert {m.data for m in got} == {big_body(3, 5 * MIB)}
    records = [json.loads(line) for line in r.log_lines]
    errors = [e for e in records if e["event"] == "error"]
    assert [(e["queue_id"], e["what"]) for e in errors] == [(victim, "read")], errors
    assert "injected EIO" in errors[0]["reason"]
    assert not any(e["event"] == "delivery" and e["queue_id"] == victim for e in records)
    with open_queue(queue) as q:
        back = list(q.list_queue())
    assert sorted(h.entry_id for h in back) == [f"{victim}.0", f"{victim}.1"]
    assert all(h.schedule.attempts == 0 and h.schedule.at > time.time() + 30 for h in back)
    assert other not in {h.message_id for h in back}


def test_a_next_hop_that_stops_reading_is_given_up_after_the_timeout(tmp_path: Path) -> None:
    """The sink never reads past 2 MB: each piece waits ``smtp_timeout`` at most for the
    connection to send, then the connection is dropped and the recipient deferred."""
    queue = str(tmp_path / "q")
    (mid,) = prequeue(queue, [big_body(4, SIZE)])
    with relay_paused_in_data(queue, 0, log_json=True, smtp_timeout=1.0) as (sink, r, _):
        [rec] = r.wait_events(1, timeout=30)
    assert rec["queue_id"] == mid and rec["status"] == "deferred"
    assert "while sending DATA: Timed out sending the message body" in rec["reason"], rec
    assert sink.state.messages == []


def test_a_big_message_to_two_domains_streams_to_each(tmp_path: Path) -> None:
    """Two transactions, one per domain, each reading the body on its own: both paused
    at once, the relay holds a piece for each, and both get the message."""
    queue = str(tmp_path / "q")
    body = big_body(6, SIZE)
    with open_queue(queue) as q, q.enqueue("a@ok.test") as enq:
        enq.write(body)
        enq.commit([Recipient("u@ok.test", Schedule(0)),
                    Recipient("v@other.test", Schedule(0))])
    with relay_paused_in_data(queue, 2) as (sink, r, gate):
        held = r.call(lambda: r.relay.scheduler.body_bytes)
        assert 0 < held <= 2 * STREAM_PIECE, held
        gate.set()
        got = sink.wait_for(2, timeout=60)
    assert sorted(m.rcpts[0] for m in got) == ["u@ok.test", "v@other.test"]
    assert all(m.data == body for m in got)


def _answers_early(conn: socket.socket, closes: bool) -> None:
    """An SMTP server that answers DATA with 552 after 2 MB of it (or at its end), then
    closes the connection or reads on without a word more."""
    with contextlib.suppress(OSError), conn:
        conn.sendall(b"220 early.test ESMTP\r\n")
        f = conn.makefile("rb", buffering=0)
        while line := f.readline():
            verb = line[:4].upper()
            if verb != b"DATA":
                conn.sendall(b"250 ok\r\n" if verb != b"QUIT" else b"221 bye\r\n")
                continue
            conn.sendall(b"354 go ahead\r\n")
            got = b""
            while len(got) < 2 * MIB and not got.endswith(b"\r\n.\r\n"):
                data = conn.recv(65536)
                if not data:
                    return
                got = (got + data)[-2 * MIB:] if len(got) < 2 * MIB else got + data
            conn.sendall(b"552 5.3.4 Message size exceeds fixed limit\r\n")
            if closes:
                return
            while conn.recv(65536):
                continue


@pytest.mark.parametrize("closes", [True, False], ids=["then-closes", "reads-on"])
def test_a_refusal_before_the_end_of_a_streamed_body_is_heard(
        tmp_path: Path, closes: bool) -> None:
    """The next hop says 552 after 2 MB of a 12 MB body (and closes, or reads on): the
    rest is not sent, and the recipient is bounced with that reply, as a whole body
    written at once would be; not deferred as a lost connection or a timeout."""
    queue = str(tmp_path / "q")
    (mid,) = prequeue(queue, [big_body(7, SIZE)])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = server.accept()[0]
                threading.Thread(target=_answers_early, args=(conn, closes),
                                 daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        with RelayThread(relay_config(queue, relayhost=f"[127.0.0.1]:{server.getsockname()[1]}",
                                      log_json=True, smtp_timeout=5.0)) as r:
            [rec] = r.wait_events(1, timeout=30, queue_id=mid)
    finally:
        server.close()
    assert rec["queue_id"] == mid and rec["status"] == "bounced", rec
    assert rec["dsn"] == "5.3.4" and "552 5.3.4 Message size exceeds" in rec["reason"]


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_a_damaged_big_body_refused_before_data_is_quarantined_not_bounced(
        tmp_path: Path, backend: str) -> None:
    """Its recipient is refused at RCPT, so DATA never reads it: the DSN would be built
    from it, so it is read to its end first, its damage found, the message quarantined,
    and no DSN sent from it."""
    queue = str(tmp_path / "q")
    with open_queue(queue, backend) as q:
        with q.enqueue("a@ok.test", {"arrival": str(time.time())}) as enq:
            enq.write(big_body(8, 6 * MIB))
            (victim,) = {h.message_id for h in enq.commit([Recipient("reject@ok.test",
                                                                     Schedule(0))])}
        damage_late(getattr(q, "kv", None), queue, backend, victim, 6 * MIB)
    with Sink() as sink:
        config = relay_config(queue, relayhost=f"[127.0.0.1]:{sink.port}", backend=backend,
                              log_json=True)
        with RelayThread(config) as r:
            r.wait_events(1, event="bounce", timeout=30)
            settled(r)
    records = [json.loads(line) for line in r.log_lines]
    errors = [e for e in records if e["event"] == "error"]
    assert [(e["queue_id"], e["what"]) for e in errors] == [(victim, "read")], errors
    assert errors[0]["reason"].startswith("quarantined:")
    [bounce] = [e for e in records if e["event"] == "bounce"]
    assert bounce["status"] == "dropped" and "quarantined" in bounce["reason"]
    assert sink.state.messages == []  # no DSN went out
    with open_queue(queue, backend) as q:
        assert list(q.list_queue()) == [] and list(q.find_inflight()) == []


def test_an_internationalized_big_body_for_a_next_hop_without_smtputf8_bounces(
        tmp_path: Path) -> None:
    """SMTPUTF8 mail whose header section holds UTF-8, streamed: its header section is
    read (not the body) to find that the next hop cannot take it, and it bounces 5.6.7,
    as Postfix does rather than downgrade it."""
    queue = str(tmp_path / "q")
    body = "Subject: Grüße\r\n\r\n".encode() + big_body(9, SIZE)
    with open_queue(queue) as q, q.enqueue("a@ok.test", {"smtputf8": "yes"}) as enq:
        enq.write(body)
        enq.commit([Recipient("u@ok.test", Schedule(0))])
    with Sink() as sink:
        sink.state.without = {"SMTPUTF8"}
        with RelayThread(relay_config(queue, relayhost=f"[127.0.0.1]:{sink.port}",
                                      log_json=True)) as r:
            [rec] = r.wait_events(1, timeout=30, to="u@ok.test")
    assert rec["status"] == "bounced" and rec["dsn"] == "5.6.7", rec
    assert "SMTPUTF8 is required" in rec["reason"]
