"""Hostile and broken SMTP clients: each gets the right reply or a closed connection, no
exception escapes, and nothing half-received is queued."""

from __future__ import annotations

import smtplib
import socket
import threading
import time

import pytest

from queue_ref.opener import open_queue
from tests.relay_support import RelayThread, Sink, relay_config


class Raw:
    """A client speaking raw bytes, reading whole (multi-line) replies."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        assert self.reply().startswith(b"220 ")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed; pending {self.buf!r}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def reply(self) -> bytes:
        lines = [self.line()]
        while lines[-1][3:4] == b"-":
            lines.append(self.line())
        return b"\n".join(lines)

    def cmd(self, data: bytes) -> bytes:
        self.send(data + b"\r\n")
        return self.reply()

    def closed(self, timeout: float = 10.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except (ConnectionResetError, TimeoutError):
            return False

    def close(self) -> None:
        self.sock.close()


def _empty_queue(path: str) -> None:
    with open_queue(path) as q:
        assert list(q.list_queue()) == []
        assert q.footprint().objects == 0


def test_malformed_commands_and_huge_lines(tmp_path):
    with RelayThread(relay_config(str(tmp_path / "q"), relayhost="[127.0.0.1]:9",
                                  log_json=True)) as r:
        c = Raw(r.port)
        assert c.cmd(b"MAIL FROM:<a@example.org>").startswith(b"503 5.5.1")  # no EHLO yet
        assert c.cmd(b"EHLO").startswith(b"501 5.5.4")
        assert c.cmd(b"EHLO client.test").endswith(b"250 ENHANCEDSTATUSCODES")
        assert c.cmd(b"RCPT TO:<b@example.net>").startswith(b"503 5.5.1")
        assert c.cmd(b"DATA").startswith(b"503 5.5.1")
        assert c.cmd(b"MAIL FROM:").startswith(b"501 5.5.4")
        assert c.cmd(b"MAIL TO:<a@example.org>").startswith(b"501 5.5.4")
        assert c.cmd(b"X" * 100_000).startswith(b"500 5.5.2")  # a huge command line
        assert c.cmd(b"MAIL FROM:<" + b"a" * 2000 + b"@example.org>").startswith(b"500 5.5.2")
        assert c.cmd(b"\xff\xfe BAD").startswith(b"500 5.5.2")
        assert c.cmd(b"MAIL FROM:<a@example.org>").startswith(b"250 2.1.0")
        assert c.cmd(b"MAIL FROM:<a@example.org>").startswith(b"503 5.5.1")  # nested
        assert c.cmd(b"RCPT TO:<b@exa mple.net>").startswith(b"501")
        assert c.cmd(b"RCPT TO:<b@example.net> FOO=BAR").startswith(b"555 5.5.4")
        assert c.cmd(b"RSET").startswith(b"250 2.0.0")
        assert c.cmd(b"QUIT").startswith(b"221 2.0.0")
        c.close()
        assert not r.events("error")
    _empty_queue(str(tmp_path / "q"))


def test_bare_lf_nul_and_long_data_lines(tmp_path):
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        # NUL in the content: refused, nothing queued.
        assert c.cmd(b"MAIL FROM:<a@example.org>").startswith(b"250")
        assert c.cmd(b"RCPT TO:<b@example.net>").startswith(b"250")
        assert c.cmd(b"DATA").startswith(b"354")
        assert c.cmd(b"Subject: nul\r\n\r\nbad\x00byte\r\n.").startswith(b"554 5.6.0")
        # A line longer than 998 octets: accepted (Postfix's smtpd), folded on delivery.
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.cmd(b"RCPT TO:<b@example.net>")
        c.cmd(b"DATA")
        assert c.cmd(b"Subject: long\r\n\r\n" + b"y" * 5000 + b"\r\n.").startswith(b"250 2.0.0")
        # Bare LF inside lines: stored and delivered as CRLF; ".\n" does not end DATA.
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.cmd(b"RCPT TO:<b@example.net>")
        c.cmd(b"DATA")
        reply = c.cmd(b"Subject: lf\nX-A: 1\n\nline one\n.\nline two\r\n.")
        assert reply.startswith(b"250 2.0.0 Ok: queued as"), reply
        c.cmd(b"QUIT")
        c.close()
        long_one, got = sorted(sink.wait_for(2), key=lambda m: b"Subject: lf" in m.data)
    assert long_one.data.endswith(b"Subject: long\r\n\r\n" + b"y" * 998
                                  + b"".join(b"\r\n " + b"y" * n for n in (997,) * 4 + (14,))
                                  + b"\r\n")
    body = got.data[got.data.index(b"Subject: lf"):]  # after our Received: header
    assert body == b"Subject: lf\r\nX-A: 1\r\n\r\nline one\r\n..\r\nline two\r\n" or \
        body == b"Subject: lf\r\nX-A: 1\r\n\r\nline one\r\n.\r\nline two\r\n"
    _empty_queue(str(tmp_path / "q"))


def test_ten_thousand_recipients(tmp_path):
    with RelayThread(relay_config(str(tmp_path / "q"), relayhost="[127.0.0.1]:9")) as r:
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.send(b"".join(b"RCPT TO:<r%d@example.net>\r\n" % i for i in range(10_000)))
        codes = []
        try:
            while len(codes) < 10_000:
                codes.append(c.reply()[:3])
        except ConnectionError:
            pass
        c.close()
    assert codes[:1000] == [b"250"] * 1000  # smtpd_recipient_limit
    assert set(codes[1000:-1]) == {b"452"}
    assert codes[-1] == b"421" and len(codes) < 1100  # too many errors: disconnected
    _empty_queue(str(tmp_path / "q"))


def test_clients_that_stall_or_disconnect_in_data(tmp_path):
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", smtpd_timeout=1.0,
            log_json=True)) as r:
        # Disconnects halfway through DATA.
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.cmd(b"RCPT TO:<b@example.net>")
        c.cmd(b"DATA")
        c.send(b"Subject: half\r\n\r\nsome text\r\n")
        c.close()
        # Stalls in DATA: the session times out and is closed.
        s = Raw(r.port)
        s.cmd(b"EHLO client.test")
        s.cmd(b"MAIL FROM:<a@example.org>")
        s.cmd(b"RCPT TO:<b@example.net>")
        s.cmd(b"DATA")
        s.send(b"Subject: stalled\r\n\r\nwaiting")
        started = time.monotonic()
        assert s.closed(timeout=10)
        assert time.monotonic() - started < 8
        s.close()
        # The relay still works, and only the complete message went out.
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as ok:
            ok.sendmail("a@example.org", ["b@example.net"], b"Subject: whole\r\n\r\nok\r\n")
        (got,) = sink.wait_for(1)
        time.sleep(0.3)
        assert len(sink.state.messages) == 1 and b"Subject: whole" in got.data
        assert len(r.events("received")) == 1
        assert not r.events("error")
    _empty_queue(str(tmp_path / "q"))


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_slow_reader_cut_off_for_errors_gets_every_reply_then_the_421(tmp_path, event_loop):
    """A pipelining client that makes too many errors and reads its replies slowly still
    gets every reply, the 421 last, and then an orderly end of the stream: the session
    sends FIN after its replies and drops what the client still sends, on both event
    loops (closing with unread input would make the kernel reset the connection and
    throw the unread replies away)."""
    with RelayThread(relay_config(str(tmp_path / "q"), relayhost="[127.0.0.1]:9",
                                  event_loop=event_loop)) as r:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(20)
        s.connect(("127.0.0.1", r.port))
        errors = []

        def send() -> None:
            try:
                s.sendall(b"EHLO x\r\n" + b"NOOP\r\n" * 3000
                          + b"RCPT TO:<r@example.net>\r\n" * 25 + b"NOOP\r\n" * 200_000)
            except OSError as e:  # the relay may stop reading once it has hung up
                errors.append(e)

        sender = threading.Thread(target=send)
        sender.start()
        got = b""
        while True:
            chunk = s.recv(512)  # a reset raises here
            if not chunk:
                break
            got += chunk
            time.sleep(0.001)
        sender.join(30)
        s.close()
    replies = [line for line in got.split(b"\r\n") if line]
    assert replies[0].startswith(b"220 ")
    assert sum(1 for line in replies if line.startswith(b"250 2.0.0")) == 3000  # the NOOPs
    assert sum(1 for line in replies if line.startswith(b"503 ")) == 20  # RCPT before MAIL
    assert replies[-1] == b"421 4.7.0 Error: too many errors"
