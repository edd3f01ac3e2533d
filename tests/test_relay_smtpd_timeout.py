"""``smtpd_timeout`` bounds each wait for the client, not a whole upload: a message sent
slowly, a line at a time, is taken however long it takes while bytes keep coming; a
client that sends nothing for the timeout (before a command, or in the middle of its
data) gets ``421 4.4.2 ... timeout exceeded`` before the connection is closed, as from
Postfix's smtpd, and a ``timeout`` record says after what.  Refused commands are logged
(``reject``, Postfix's ``NOQUEUE: reject:``), and aiosmtpd's own log lines never reach
the relay's standard error among its JSON records."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from tests.relay_support import RelayThread, Sink, relay_config, relay_process
from tests.test_relay_badinput import Raw

TIMEOUT = 1.0


def test_a_slow_upload_is_taken_while_bytes_keep_coming(tmp_path: Path) -> None:
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", smtpd_timeout=TIMEOUT,
            log_json=True)) as r:
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.cmd(b"RCPT TO:<b@example.net>")
        assert c.cmd(b"DATA").startswith(b"354")
        c.send(b"Subject: slow\r\n\r\n")
        started = time.monotonic()
        n = 0
        while time.monotonic() - started < 3 * TIMEOUT:  # three timeouts long in all
            c.send(b"line %d\r\n" % n)
            n += 1
            time.sleep(TIMEOUT * 0.4)
        c.send(b".\r\n")
        assert c.reply().startswith(b"250 ")
        c.cmd(b"QUIT")
        c.sock.close()
        (got,) = sink.wait_for(1)
    assert got.data.count(b"line ") == n
    assert not r.events("timeout")


def test_a_client_that_stops_gets_421_before_the_close(tmp_path: Path) -> None:
    with RelayThread(relay_config(str(tmp_path / "q"), smtpd_timeout=TIMEOUT,
                                  log_json=True)) as r:
        idle = Raw(r.port)  # says nothing after the greeting
        stalled = Raw(r.port)
        stalled.cmd(b"EHLO client.test")
        stalled.cmd(b"MAIL FROM:<a@example.org>")
        stalled.cmd(b"RCPT TO:<b@example.net>")
        stalled.cmd(b"DATA")
        stalled.send(b"Subject: stalled\r\n\r\nwaiting")
        started = time.monotonic()
        for c in (idle, stalled):
            assert c.closed(timeout=10)
            assert c.buf.startswith(b"421 4.4.2 ") and b"timeout exceeded" in c.buf, c.buf
        assert time.monotonic() - started < 5
        for c in (idle, stalled):
            c.sock.close()
        events = r.wait_events(2, "timeout")
    assert sorted(e["after"] for e in events) == ["DATA", "command"]
    assert all(e["client"].startswith("[127.0.0.1]:") for e in events)


def test_refused_commands_are_logged_and_aiosmtpd_says_nothing(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    with relay_process(["--queue", queue, "--listen", "127.0.0.1:0", "--log-json"]) \
            as (rp, port):
        c = Raw(port)
        c.cmd(b"EHLO client.test")
        c.cmd(b"MAIL FROM:<a@example.org>")
        assert c.cmd(b"RCPT TO:<a@b@c>").startswith(b"501 5.1.3")
        for _ in range(19):  # aiosmtpd says "unrecognised" to its logger each time
            c.send(b"BOGUS\x1b[31m\r\n")
        replies = [c.reply() for _ in range(20)]
        # Postfix's rule for unknown commands too (not aiosmtpd's 502 after 5): the 20th
        # error, then 421 and the end of the session
        assert replies[-2].startswith(b"500 5.5.2") and replies[-1].startswith(b"421 4.7.0")
        assert c.closed()
        c.sock.close()
        assert rp.wait_log('"reply": "421 4.7.0')
        rp.terminate()
        rp.wait(30)
    lines = rp.stderr().splitlines()
    records = [json.loads(line) for line in lines]  # every line a record: none of aiosmtpd's
    rejects = [e for e in records if e["event"] == "reject"]
    assert [e["reply"][:9] for e in rejects] == ["501 5.1.3"] + ["500 5.5.2"] * 19 + ["421 4.7.0"]
    assert rejects[0]["from"] == "a@example.org" and rejects[0]["helo"] == "client.test"
    assert all("\x1b" not in e["reply"] for e in rejects)


def test_data_past_the_size_limit_buys_no_time(tmp_path: Path) -> None:
    """Bytes past ``message_size_limit`` (and a little slack) are dropped and no longer
    push the timeout back: a client cannot hold a session by trickling them."""
    with RelayThread(relay_config(str(tmp_path / "q"), smtpd_timeout=TIMEOUT,
                                  message_size_limit=10_000, log_json=True)) as r:
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        c.cmd(b"MAIL FROM:<a@example.org>")
        c.cmd(b"RCPT TO:<b@example.net>")
        assert c.cmd(b"DATA").startswith(b"354")
        c.send(b"x" * 100 + b"\r\n" * 40_000)  # 80 KB: past the limit and the slack
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the relay hung up: the trickle meets it
            while time.monotonic() - started < 10:
                c.send(b"more\r\n")  # a trickle that kept the session open before
                time.sleep(TIMEOUT * 0.3)
        assert time.monotonic() - started < 4 * TIMEOUT
        c.sock.close()
        [event] = r.wait_events(1, "timeout")
    assert event["after"] == "DATA"


def test_an_error_while_handling_a_command_is_logged_not_shown(tmp_path: Path) -> None:
    """A bug met while a command is handled: the client gets 451 and nothing of the
    relay's insides; the log gets an error record naming where (aiosmtpd's own log, where
    its traceback went, is silenced)."""
    with RelayThread(relay_config(str(tmp_path / "q"), log_json=True)) as r:
        def broken(*args: object) -> str:
            raise KeyError("secret-internal-name")

        r.relay.receiver.etrn = broken  # type: ignore[union-attr, method-assign]
        c = Raw(r.port)
        c.cmd(b"EHLO client.test")
        reply = c.cmd(b"ETRN example.net")
        assert reply.startswith(b"451 4.3.0") and b"secret" not in reply
        assert c.cmd(b"QKZBU0U2NA==").startswith(b"500")  # a credential sent as a command
        c.sock.close()
        [error] = r.wait_events(1, "error")
        rejects = r.events("reject")
    assert error["what"] == "smtpd session" and "KeyError" in error["reason"]
    assert "test_relay_smtpd_timeout.py" in error["reason"]  # where it came from
    assert rejects and not any("QKZBU0U2NA" in e["reply"] for e in rejects)
