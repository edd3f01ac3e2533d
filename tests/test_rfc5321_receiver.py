"""RFC 5321 conformance of the relay's receiver, table-driven: each row a raw dialogue
over a socket (command lines, or chunks sent in one write as a pipelining client sends
them), the reply codes expected in order (greeting first), and the recipients that must
reach the next hop (an aiosmtpd sink, the relayhost) or must not.  After every row the
queue (``open_queue`` and ``listing``, what ``queue-ref mailq --json`` shows) holds
nothing: every message that got 250 was delivered, and nothing else was queued.

The rows that drop the connection check the relay's ``received`` records as well:
nothing is committed unless the final dot was read (then the 250 is sent into a closed
connection and the message is delivered: at least once), and the relay goes on serving
the next client.  ``tests/test_rfc5321_postfix.py`` runs the same table against a real
Postfix's smtpd to show where the two differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.relay_support import (
    DROP,
    RelayThread,
    Sink,
    codes,
    queued_entries,
    raw_dialogue,
    relay_config,
)

POSTMASTER_TO = "hostmaster@admin.test"


def content(*headers: bytes, body: bytes = b"hello\r\n") -> bytes:
    """A message after DATA, with its final dot."""
    return b"".join(h + b"\r\n" for h in (*headers, b"Subject: rfc 5321")) + b"\r\n" + body + b".\r\n"


def hops(n: int) -> bytes:
    return b"".join(b"Received: from hop%d.test by hop%d.test; Thu, 26 Nov 2026 10:00:00 +0000\r\n"
                    % (i, i + 1) for i in range(n))


@dataclass(frozen=True)
class Row:
    name: str
    steps: list[bytes | tuple[bytes, int]]
    codes: str  # the reply codes in order, greeting first
    delivered: tuple[str, ...] = ()  # recipients that reach the next hop (as queued)
    not_delivered: tuple[str, ...] = ()
    sender: str | None = None  # the envelope sender the next hop gets
    options: tuple[str, ...] = ()  # MAIL parameters the next hop gets
    data_has: bytes = b""  # bytes the delivered message holds
    queued: int = 0  # messages committed (``received`` records) by the row
    #: the Postfix (3.7, smtpd) codes where they differ, for tests/test_rfc5321_postfix.py
    postfix: str | None = None


EHLO = b"EHLO client.test"
MAIL = b"MAIL FROM:<alice@src.test>"

ROWS = [
    Row("null sender", [EHLO, b"MAIL FROM:<>", b"RCPT TO:<null@dst.test>", b"DATA",
                        (content(), 1), b"QUIT"],
        "220 250 250 250 354 250 221", delivered=("null@dst.test",), sender="", queued=1),
    Row("postmaster without a domain, any case", [
        EHLO, MAIL, b"RCPT TO:<PostMaster>", b"DATA", (content(), 1), b"QUIT"],
        "220 250 250 250 354 250 221", delivered=(POSTMASTER_TO,), queued=1),
    Row("quoted local parts", [
        EHLO, MAIL, b'RCPT TO:<"john smith"@dst.test>', b'RCPT TO:<"a@b"@dst.test>', b"DATA",
        (content(), 1), b"QUIT"],
        "220 250 250 250 250 354 250 221", delivered=('"john smith"@dst.test', '"a@b"@dst.test'),
        queued=1),
    Row("IP address literals", [
        EHLO, MAIL, b"RCPT TO:<lit4@[127.0.0.1]>", b"RCPT TO:<lit6@[IPv6:::1]>", b"DATA",
        (content(), 1), b"QUIT"],
        "220 250 250 250 250 354 250 221", delivered=("lit4@[127.0.0.1]", "lit6@[IPv6:::1]"),
        queued=1),
    Row("8BITMIME", [
        EHLO, MAIL + b" BODY=8BITMIME", b"RCPT TO:<eight@dst.test>", b"DATA",
        (content(b"Content-Type: text/plain; charset=latin-1",
                  body=b"caf\xe9 \xff\xfe 8-bit octets\r\n"), 1), b"QUIT"],
        "220 250 250 250 354 250 221", delivered=("eight@dst.test",), options=("BODY=8BITMIME",),
        data_has=b"caf\xe9 \xff\xfe 8-bit octets\r\n", queued=1),
    Row("SMTPUTF8", [
        EHLO, "MAIL FROM:<jörg@src.test> SMTPUTF8".encode(), "RCPT TO:<jöhn@dßt.test>".encode(),
        b"DATA", (content("Subject: grüße".encode()), 1), b"QUIT"],
        "220 250 250 250 354 250 221", delivered=("jöhn@dßt.test",), sender="jörg@src.test",
        options=("SMTPUTF8",), data_has="Subject: grüße".encode(), queued=1),
    Row("SMTPUTF8 refused when not given", [
        EHLO, "MAIL FROM:<jörg@src.test>".encode(), MAIL, "RCPT TO:<jöhn@dst.test>".encode(),
        b"QUIT"],
        "220 250 553 250 553 221", not_delivered=("jöhn@dst.test",),
        postfix="220 250 250 503 250 221"),  # Postfix's default strict_smtputf8 = no
    Row("PIPELINING: two transactions in one write", [
        EHLO, (MAIL + b"\r\nRCPT TO:<pipe1@dst.test>\r\nRCPT TO:<bad address>\r\nDATA\r\n"
               + content() + b"MAIL FROM:<>\r\nRCPT TO:<pipe2@dst.test>\r\nDATA\r\n"
               + content() + b"NOOP\r\nQUIT\r\n", 11)],
        "220 250 250 250 501 354 250 250 250 354 250 250 221",
        delivered=("pipe1@dst.test", "pipe2@dst.test"), queued=2),
    Row("RSET in the middle of a transaction", [
        EHLO, MAIL, b"RCPT TO:<rset1@dst.test>", b"RSET", b"DATA", MAIL,
        b"RCPT TO:<rset2@dst.test>", b"DATA", (content(), 1), b"QUIT"],
        "220 250 250 250 250 503 250 250 354 250 221", delivered=("rset2@dst.test",),
        not_delivered=("rset1@dst.test",), queued=1),
    Row("HELO instead of EHLO", [
        b"HELO client.test", MAIL, b"RCPT TO:<helo@dst.test>", b"DATA", (content(), 1),
        b"QUIT"],
        "220 250 250 250 354 250 221", delivered=("helo@dst.test",),
        data_has=b"(queue-ref) with SMTP id ", queued=1),
    Row("commands in the wrong order", [
        b"MAIL FROM:<alice@src.test>", EHLO, b"RCPT TO:<order@dst.test>", b"DATA", MAIL, b"DATA",
        b"QUIT"],
        "220 503 250 503 503 250 503 221", not_delivered=("order@dst.test",),
        # Postfix: MAIL before HELO taken (smtpd_helo_required = no); DATA without a
        # recipient 554 5.5.1 Error: no valid recipients
        postfix="220 250 250 503 503 250 554 221"),
    Row("unknown commands, VRFY, EXPN, NOOP, HELP, QUIT", [
        EHLO, b"FOO bar", b"VRFY bob", b"EXPN staff", b"NOOP", b"QUIT"],
        "220 250 500 252 502 250 221",
        postfix="220 250 500 252 500 250 221"),  # Postfix has no EXPN: 500 5.5.2
    Row("a message over the hop limit is refused at the end of DATA", [
        EHLO, MAIL, b"RCPT TO:<loop@dst.test>", b"DATA", (content(hops(49)), 1), b"QUIT"],
        "220 250 250 250 354 554 221", not_delivered=("loop@dst.test",)),
    Row("a message just under the hop limit is taken", [
        EHLO, MAIL, b"RCPT TO:<hops48@dst.test>", b"DATA", (content(hops(48)), 1), b"QUIT"],
        "220 250 250 250 354 250 221", delivered=("hops48@dst.test",), queued=1),
]

DROPS = [
    Row("dropped after the greeting", [DROP], "220"),
    Row("dropped after EHLO", [EHLO, DROP], "220 250"),
    Row("dropped after MAIL", [EHLO, MAIL, DROP], "220 250 250"),
    Row("dropped after RCPT", [EHLO, MAIL, b"RCPT TO:<cut1@dst.test>", DROP], "220 250 250 250",
        not_delivered=("cut1@dst.test",)),
    Row("dropped in DATA", [EHLO, MAIL, b"RCPT TO:<cut2@dst.test>", b"DATA",
                            (b"Subject: cut\r\n\r\nhalf a mess", 0), DROP],
        "220 250 250 250 354", not_delivered=("cut2@dst.test",)),
    Row("dropped after the final dot, before the reply", [
        EHLO, MAIL, b"RCPT TO:<cut3@dst.test>", b"DATA", (content(), 0), DROP],
        "220 250 250 250 354", delivered=("cut3@dst.test",), queued=1),
]


@pytest.fixture(scope="module")
def relay(tmp_path_factory):
    queue = tmp_path_factory.mktemp("rfc5321") / "q"
    with Sink() as sink:
        cfg = relay_config(str(queue), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
                           postmaster_recipient=POSTMASTER_TO)
        with RelayThread(cfg) as rt:
            yield rt, sink, queue


def _wait(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_row(rt: RelayThread, sink: Sink, queue: Path, row: Row) -> None:
    received_before = len(rt.events("received"))
    replies = raw_dialogue(rt.port, row.steps)
    assert codes(replies) == row.codes, replies
    if row.delivered:
        assert _wait(lambda: set(row.delivered) <= set(sink.state.rcpts())), sink.state.rcpts()
    with sink.state.lock:
        got = [m for m in sink.state.messages if set(m.rcpts) & set(row.delivered)]
    for m in got:
        if row.sender is not None:
            assert m.mail_from == row.sender
        assert set(row.options) <= set(m.mail_options), m.mail_options
        assert row.data_has in m.data
    assert not set(row.not_delivered) & set(sink.state.rcpts())
    # nothing queued but what got 250 (or its final dot read), and that is delivered
    assert _wait(lambda: len(rt.events("received")) - received_before >= row.queued)
    time.sleep(0.2)  # a commit that should not happen has had its time
    assert len(rt.events("received")) - received_before == row.queued
    assert _wait(lambda: queued_entries(str(queue)) == [], 5), queued_entries(str(queue))


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_rfc5321_receiver_table(relay, row):
    rt, sink, queue = relay
    run_row(rt, sink, queue, row)


@pytest.mark.parametrize("row", DROPS, ids=[r.name for r in DROPS])
def test_a_dropped_connection_queues_nothing_unacknowledged(relay, row):
    rt, sink, queue = relay
    run_row(rt, sink, queue, row)
    after = f"after-{row.name.replace(' ', '-').replace(',', '')}@dst.test"
    replies = raw_dialogue(rt.port, [EHLO, MAIL, f"RCPT TO:<{after}>".encode(), b"DATA",
                                     (content(), 1), b"QUIT"])
    assert codes(replies) == "220 250 250 250 354 250 221", replies  # the relay goes on
    assert _wait(lambda: after in sink.state.rcpts())


def test_postmaster_is_taken_from_any_client_and_rewritten(tmp_path):
    """RFC 5321 4.5.1: ``<postmaster>`` is accepted from a client that may relay nowhere
    (it is addressed to this host), queued as ``postmaster_recipient`` and logged."""
    with Sink() as sink:
        cfg = relay_config(str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}",
                           log_json=True, mynetworks=[], postmaster_recipient=POSTMASTER_TO)
        with RelayThread(cfg) as rt:
            replies = raw_dialogue(rt.port, [
                EHLO, MAIL, b"RCPT TO:<bob@elsewhere.test>", b"RCPT TO:<postmaster@dst.test>",
                b"RCPT TO:<postmaster>", b"DATA", (content(), 1), b"QUIT"])
            assert codes(replies) == "220 250 250 554 554 250 354 250 221", replies
            [got] = sink.wait_for(1)
            [rewrite] = rt.wait_events(1, "rewrite")
            [received] = rt.wait_events(1, "received")
    assert got.rcpts == [POSTMASTER_TO] and got.mail_from == "alice@src.test"
    assert rewrite["orig_to"] == "postmaster" and rewrite["to"] == POSTMASTER_TO
    assert rewrite["queue_id"] == received["queue_id"]
    assert f"for <{POSTMASTER_TO}>".encode() in got.data


def test_check_config_shows_and_validates_postmaster_recipient_and_hopcount_limit(tmp_path):
    f = tmp_path / "relay.toml"
    f.write_text('queue = "/var/spool/x"\nmyhostname = "mx.example.org"\n')
    r = subprocess.run([sys.executable, "-m", "conformance.cli", "relay", "--config", str(f),
                        "--check-config", "--json"], capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout)["config"]
    assert (out["postmaster_recipient"], out["hopcount_limit"]) == (
        "postmaster@mx.example.org", 50)
    for line, error in [('postmaster_recipient = "postmaster"',
                         "postmaster_recipient: 'postmaster' is not an address local@domain"),
                        ('postmaster_recipient = "a b@example.org"',
                         "postmaster_recipient: 'a b@example.org' is not an address"),
                        ("hopcount_limit = 0", "hopcount_limit: must be at least 1")]:
        f.write_text(f'queue = "/var/spool/x"\n{line}\n')
        r = subprocess.run([sys.executable, "-m", "conformance.cli", "relay", "--config", str(f),
                            "--check-config"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and error in r.stderr, r.stderr
