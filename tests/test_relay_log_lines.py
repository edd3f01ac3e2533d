"""The log a reader can follow: every message has a line before its delivery lines, even
one committed right before a crash (no ``received`` line of the relay that took it)."""

from __future__ import annotations

import contextlib
import io
import json
import smtplib
import socket
import threading
import time

import pytest

from queue_ref.opener import open_queue
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import DnsServer, RelayThread, Sink, relay_config

ZONE = {"ok.test": [("MX", (10, "mx.ok.test"))], "mx.ok.test": [("A", "127.0.0.1")]}


def test_mail_found_on_the_queue_at_start_gets_a_line_before_its_delivery(tmp_path):
    q = str(tmp_path / "q")
    body = b"Subject: left behind\r\n\r\nhello\r\n"
    store = open_queue(q)
    try:  # what a relay killed right after commit leaves: queued, never logged
        with store.enqueue("alice@ok.test", {"arrival": f"{time.time() - 5:.3f}"}) as enq:
            enq.write(body)
            [h1, _] = enq.commit([Recipient("bob@ok.test", Schedule(0)),
                                  Recipient("carol@ok.test", Schedule(0))])
    finally:
        store.close()
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(relay_config(
            q, dns_nameservers=["127.0.0.1"], dns_port=dns.port, smtp_port=sink.port,
            log_json=True)) as rt:
        sink.wait_for(2)
        rt.wait_events(2, status="sent")
        records = [json.loads(line) for line in list(rt.log_lines)]
        records = [r for r in records if r["event"] in ("active", "delivery")]
        text = rt.relay.log.text(rt.events("active")[0])
    [active] = [e for e in records if e["event"] == "active"]
    assert active["queue_id"] == h1.message_id
    assert (active["from"], active["size"], active["nrcpt"]) == ("alice@ok.test", len(body), 2)
    assert [r["event"] for r in records] == ["active", "delivery", "delivery"]
    assert f"{h1.message_id}: active, from=<alice@ok.test>, size={len(body)}, nrcpt=2" in text


def test_mail_received_by_the_running_relay_gets_no_second_line(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
            smtp_port=sink.port, log_json=True)) as rt:
        with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
            c.sendmail("alice@ok.test", ["bob@ok.test"], b"Subject: x\r\n\r\nhi\r\n")
        sink.wait_for(1)
        rt.wait_events(1, status="sent")
        assert rt.events("received") and not rt.events("active")


def test_a_failed_commit_is_logged_with_the_aborted_messages_id(tmp_path):
    """The receiver's error line names the message the backend had numbered before its
    commit failed (the client got 451 and keeps the mail), its sender and client."""
    from pathlib import Path

    from tests.relay_faulty_steps import trigger_of

    q = str(tmp_path / "q")
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(relay_config(
            q, backend="tests.relay_faulty_steps:fs", dns_nameservers=["127.0.0.1"],
            dns_port=dns.port, smtp_port=sink.port, log_json=True)) as rt:
        Path(trigger_of(q, "commit")).touch()  # the next commit of a null-sender message
        with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
            c.ehlo("mx.elsewhere.test")
            c.mail("")
            c.rcpt("bob@ok.test")
            code, _ = c.data(b"Subject: dsn\r\n\r\nx\r\n")
        [err] = rt.wait_events(1, "error", what="commit")
    assert code == 451
    assert err["queue_id"] not in ("", "NOQUEUE") and err["from"] == ""
    assert err["client"] == "127.0.0.1" and err["nrcpt"] == 1 and "injected" in err["reason"]


def test_the_started_record_names_the_listening_address_and_port(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
            smtp_port=sink.port, log_json=True)) as rt:
        [started] = [e for e in rt.events("relay") if e["what"] == "started"]
        assert started["smtp"] == f"127.0.0.1:{rt.port}"
        assert started["queue"] == str(tmp_path / "q") and started["backend"] == "fs"


class _Writes:
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_batch_of_records_is_one_write_even_when_its_block_raises() -> None:
    out = _Writes()
    log = DeliveryLog(stream=out)
    with log.batch():
        for i in range(100):
            log.emit("delivery", "Q1", to=f"r{i}@example.net", status="sent")
        with log.batch():  # nested: joins the outer batch
            log.emit("delivery", "Q1", to="last@example.net", status="sent")
        assert out.writes == []  # held until the block ends
    assert len(out.writes) == 1
    lines = out.writes[0].splitlines()
    assert len(lines) == 101 and lines[0].endswith("to=<r0@example.net>, status=sent")
    assert lines[-1].endswith("to=<last@example.net>, status=sent")

    with pytest.raises(RuntimeError), log.batch():
        log.emit("delivery", "Q2", to="a@example.net", status="deferred")
        raise RuntimeError("the hook failed")
    assert len(out.writes) == 2 and "Q2: to=<a@example.net>" in out.writes[1]
    log.emit("relay", what="after")  # no batch open: written at once
    assert len(out.writes) == 3


def test_another_threads_records_are_not_held_by_a_batch() -> None:
    out = _Writes()
    log = DeliveryLog(stream=out)
    with log.batch():
        log.emit("delivery", "Q1", to="a@example.net", status="sent")
        t = threading.Thread(target=log.emit, args=("relay",), kwargs={"what": "other"})
        t.start()
        t.join()
        assert len(out.writes) == 1 and "other" in out.writes[0]
    assert len(out.writes) == 2 and "Q1" in out.writes[1]


def test_a_reply_that_is_not_utf8_costs_no_line_of_its_batch(tmp_path) -> None:
    """A next hop's reply with a Latin-1 byte reaches the record as a surrogate: the log
    file escapes it, and the other records of the batch are written all the same."""
    path = tmp_path / "relay.log"
    log = DeliveryLog(path=str(path))
    with log.batch():
        for i in range(10):
            reason = "550 Empf\udce4nger unbekannt" if i == 4 else "250 ok"
            log.emit("delivery", "Q1", to=f"r{i}@example.net", status="sent", reason=reason)
    log.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 10
    assert "Empf\\udce4nger" in lines[4]

    class Ascii:  # a stream that takes ASCII only
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> int:
            text.encode("ascii")
            self.text += text
            return len(text)

        def flush(self) -> None:
            pass

    out = Ascii()
    log = DeliveryLog(stream=out)
    with log.batch():
        log.emit("delivery", "Q2", to="a@example.net", status="sent", reason="250 ok")
        log.emit("delivery", "Q2", to="b@example.net", status="bounced", reason="550 \udce4")
    assert len(out.text.splitlines()) == 2


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_refused_connection_is_said_as_the_system_says_it(tmp_path, event_loop) -> None:
    """``connect to host[ip]:port: Connection refused``, as docs/relay.md promises, on
    both event loops (aiosmtplib wraps the error in words of its own, and asyncio's are
    not the system's)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    with RelayThread(relay_config(str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{port}",
                                  log_json=True, event_loop=event_loop)) as rt:
        with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
            c.sendmail("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nbody\r\n")
        [deferred] = rt.wait_events(1, status="deferred")
    assert deferred["reason"] == f"connect to 127.0.0.1[127.0.0.1]:{port}: Connection refused"


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("peer", ["silent", "closes"])
def test_a_host_reached_that_gives_no_greeting_is_named_as_the_relay(
        tmp_path, event_loop, peer) -> None:
    """TCP connected, then no greeting: Postfix's words (``conversation with ... timed
    out``, ``lost connection with ...`` ``while receiving the initial server greeting``),
    4.4.2, and the host named as the relay, not ``none`` (it was reached)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = server.accept()[0]
                if peer == "closes":
                    conn.close()
                else:
                    accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    hop = f"127.0.0.1[127.0.0.1]:{port}"
    try:
        with RelayThread(relay_config(str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{port}",
                                      log_json=True, event_loop=event_loop,
                                      smtp_connect_timeout=1.0)) as rt:
            with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
                c.sendmail("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nbody\r\n")
            [deferred] = rt.wait_events(1, status="deferred")
    finally:
        server.close()
        for conn in accepted:
            conn.close()
    what = f"conversation with {hop} timed out" if peer == "silent" \
        else f"lost connection with {hop}"
    assert deferred["reason"] == f"{what} while receiving the initial server greeting"
    assert deferred["relay"] == hop and deferred["dsn"] == "4.4.2"


def test_json_records_hold_utf8_as_it_is() -> None:
    """An internationalized address is written as its characters (a grep for it finds
    it), and the line is still one JSON object."""
    out = io.StringIO()
    DeliveryLog(json_lines=True, stream=out).emit("delivery", "m1", to="jürgen@bücher.example")
    line = out.getvalue()
    assert "jürgen@bücher.example" in line and json.loads(line)["to"] == "jürgen@bücher.example"


def test_a_log_file_that_breaks_is_said_once_and_closing_it_does_not_fail(capsys) -> None:
    """``/dev/full`` takes the open and refuses every write: the first failed record is
    said on standard error (the relay goes on: mail must not stop for its log), once
    until a write succeeds again, and closing the file does not raise."""
    log = DeliveryLog(path="/dev/full")
    log.emit("relay", what="started")
    log.emit("delivery", "Q1", to="a@example.net", status="sent")
    log.close()
    err = capsys.readouterr().err
    assert err.count("the log file /dev/full cannot be written to") == 1, err
    assert "No space left" in err


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_a_log_file_the_relay_cannot_write_is_refused_before_it_starts(
        tmp_path, capsys, where) -> None:
    """``--check-config`` and the start alike: one line, exit 2, no traceback."""
    from conformance.cli import main

    path = tmp_path / "nowhere" / "mail.log" if where == "missing-dir" else tmp_path
    conf = tmp_path / "relay.toml"
    conf.write_text(f'queue = "{tmp_path / "q"}"\nlog_file = "{path}"\nlisten = "127.0.0.1:0"\n')
    for extra in (["--check-config"], []):
        code = main(["relay", "--config", str(conf), *extra])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"log_file {path}:" in err and "Traceback" not in err
        assert ("does not exist" if where == "missing-dir" else "is a directory") in err
