"""RFC 5321 conformance with a real Postfix as the peer, both ways: one private Postfix
(``tests/postfix_instance``) and one relay for the module.

(a) Postfix relays INTO the relay: its relayhost is the relay, which delivers to an
aiosmtpd sink.  Mail from swaks, smtplib and smtp-source arrives with its envelope and
content intact: an 8-bit body, a SMTPUTF8 message, a body of dot lines, and the bounce
Postfix itself makes (``MAIL FROM:<>``) when the relay refuses a recipient 554.

(b) The relay delivers TO Postfix (a transport map entry) with STARTTLS at the ``verify``
level, Postfix holding a certificate from a test CA made with openssl; Postfix delivers
on to the sink.  The client table's rows that Postfix can be made to answer (access
tables for MAIL, RCPT, DATA and the end of DATA, with ``smtpd_delay_reject = no``) give
the outcome they give against aiosmtpd.

And the receiver table's dialogues are spoken to Postfix's smtpd: each gets the codes
the relay gives, or the ones the row names for Postfix (the differences
docs/relay.md lists).
"""

from __future__ import annotations

import shutil
import smtplib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.postfix_instance import PrivatePostfix, free_port, instance_dir, postfix_missing
from tests.relay_support import (
    DROP,
    RelayThread,
    Sink,
    codes,
    queued_entries,
    raw_dialogue,
    relay_config,
)
from tests.test_rfc5321_receiver import ROWS
from tests.tls_certs import CertAuthority, have_openssl

pytestmark = pytest.mark.skipif(bool(postfix_missing()) or not have_openssl(),
                                reason=postfix_missing() or "openssl makes the certificates")

#: sender addresses Postfix's access tables answer (the client table against Postfix)
SENDER_ACCESS = {
    "mailfail@src.test": "553 5.1.8 Sender address rejected",
    "maildefer@src.test": "451 4.3.0 Temporary sender trouble",
}
DATA_ACCESS = {"datacmdfail@src.test": "554 5.7.1 No data accepted from you"}
END_OF_DATA_ACCESS = {
    "dotfail@src.test": "554 5.6.0 Content rejected",
    "dotdefer@src.test": "452 4.3.1 Insufficient system storage",
}
RCPT_ACCESS = {
    "defer1@out.test": "450 4.2.0 Mailbox busy, try later",
    "reject1@out.test": "550 5.1.1 No such user here",
}


@dataclass
class World:
    postfix: PrivatePostfix
    relay: RelayThread
    sink: Sink
    queue: str


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = instance_dir()
    try:
        yield from _world(base, tmp_path_factory.mktemp("rfc5321pf") / "q")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _world(base: Path, queue: Path) -> Iterator[World]:
    ca = CertAuthority(base / "ca")
    relay_port = free_port()
    with Sink() as sink:
        pf = PrivatePostfix(base / "postfix", f"[127.0.0.1]:{relay_port}",
                            tls=ca.issue(["postfix-test.localdomain", "127.0.0.1"]))
        pf.settings.update({
            "smtpd_delay_reject": "no",  # MAIL refused at MAIL, not at the first RCPT
            "smtpd_sender_restrictions":
                "check_sender_access " + pf.table("sender_access", SENDER_ACCESS),
            "smtpd_recipient_restrictions":
                "check_recipient_access " + pf.table("rcpt_access", RCPT_ACCESS),
            "smtpd_data_restrictions":
                "check_sender_access " + pf.table("data_access", DATA_ACCESS),
            "smtpd_end_of_data_restrictions":
                "check_sender_access " + pf.table("eod_access", END_OF_DATA_ACCESS),
            "transport_maps": pf.table("transport", {
                "out.test": f"smtp:[127.0.0.1]:{sink.port}",
                # the receiver table's mail, spoken to Postfix, goes nowhere
                "dst.test": "discard:", "postfix-test.localdomain": "discard:"}),
            "smtp_tls_security_level": "may",
        })
        with pf:
            hop = f"[127.0.0.1]:{pf.port}"
            cfg = relay_config(
                str(queue), log_json=True, listen=f"127.0.0.1:{relay_port}", mynetworks=[],
                relay_domains=["in.test", "src.test", "out.test"],
                relayhost=f"[127.0.0.1]:{sink.port}", transport_maps={"out.test": hop},
                smtp_tls_policy_maps={hop: "verify"}, smtp_tls_CAfile=str(ca.ca_file),
                minimal_backoff_time=300.0, maximal_backoff_time=600.0)
            with RelayThread(cfg) as relay:
                yield World(pf, relay, sink, str(queue))


#: what Postfix adds to a message that lacks it (always_add_missing_headers), so that a
#: message arrives as it was sent after the Received: headers
HEADERS = (b"From: <alice@src.test>\r\nDate: Thu, 26 Nov 2026 10:00:00 +0000\r\n"
           b"Message-ID: <rfc5321@src.test>\r\n")


def _arrived(sink: Sink, rcpt: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sink.state.lock:
            found = [m for m in sink.state.messages if rcpt in m.rcpts]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"{rcpt} never reached the sink")


# ---- (a) Postfix relays into the relay ----


def test_postfix_relays_into_the_relay_with_envelope_and_content_intact(world):
    body = (HEADERS + b"Subject: via postfix\r\nX-Test: a\r\n\r\n"
            b"line one\r\n.\r\n..two dots\r\n.x\r\nend\r\n")
    with smtplib.SMTP("127.0.0.1", world.postfix.port, timeout=10) as c:
        c.sendmail("alice@src.test", ["ann@in.test", "bob@in.test"], body)
    got = _arrived(world.sink, "bob@in.test")
    assert got.mail_from == "alice@src.test" and sorted(got.rcpts) == ["ann@in.test",
                                                                       "bob@in.test"]
    assert got.data.endswith(body), got.data  # dot lines too, unstuffed twice
    assert got.data.startswith(b"Received: from postfix-test.localdomain ([127.0.0.1])\r\n"
                               b"\tby relay.test (queue-ref) with ESMTP id "), got.data[:300]
    assert b"by postfix-test.localdomain (Postfix)" in got.data


def test_swaks_and_smtp_source_through_postfix_into_the_relay(world):
    run = subprocess.run(["swaks", "--server", "127.0.0.1", "--port", str(world.postfix.port),
                          "--from", "carol@src.test", "--to", "swaks@in.test",
                          "--helo", "client.test", "--header", "Subject: swaks"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr
    got = _arrived(world.sink, "swaks@in.test")
    assert got.mail_from == "carol@src.test" and b"Subject: swaks" in got.data
    run = subprocess.run(["smtp-source", "-s", "2", "-m", "10", "-l", "2000", "-f",
                          "source@src.test", "-t", "source@in.test",
                          f"127.0.0.1:{world.postfix.port}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 30
    while world.sink.state.rcpts().count("source@in.test") < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert world.sink.state.rcpts().count("source@in.test") == 10


def test_8bit_and_smtputf8_mail_through_postfix(world):
    eight = HEADERS + b"Subject: 8 bit\r\nContent-Type: text/plain; charset=latin-1\r\n\r\ncaf\xe9 \xff\r\n"
    with smtplib.SMTP("127.0.0.1", world.postfix.port, timeout=10) as c:
        c.sendmail("alice@src.test", ["eight@in.test"], eight, mail_options=["BODY=8BITMIME"])
        utf8 = HEADERS + "Subject: grüße\r\n\r\nhallo jörg\r\n".encode()
        c.sendmail("jörg@src.test", ["jöhn@in.test"], utf8, mail_options=["SMTPUTF8"])
    got = _arrived(world.sink, "eight@in.test")
    assert got.data.endswith(eight) and "BODY=8BITMIME" in got.mail_options
    got = _arrived(world.sink, "jöhn@in.test")
    assert got.mail_from == "jörg@src.test" and "SMTPUTF8" in got.mail_options
    assert got.data.endswith(utf8)


def test_a_bounce_postfix_makes_goes_through_the_relay_with_the_null_sender(world):
    """The relay refuses a recipient (554 5.7.1: not a relay domain, and Postfix is not
    in its mynetworks); Postfix bounces it with ``MAIL FROM:<>`` through its relayhost,
    the relay, to the sender's domain."""
    with smtplib.SMTP("127.0.0.1", world.postfix.port, timeout=10) as c:
        c.sendmail("dora@src.test", ["nobody@nowhere.test"], b"Subject: lost\r\n\r\nhi\r\n")
    got = _arrived(world.sink, "dora@src.test")
    assert got.mail_from == "" and got.rcpts == ["dora@src.test"]
    assert b"nobody@nowhere.test" in got.data and b"Relay access denied" in got.data
    assert b"Content-Type: message/delivery-status" in got.data
    (received,) = world.relay.wait_events(1, "received", **{"from": ""})
    assert received["client"] == "127.0.0.1"


# ---- (b) the relay delivers to Postfix over STARTTLS ----

OK = ("sent", "2.0.0")
#: (sender, recipient -> outcome, MAIL parameters, body): client table rows with Postfix
POSTFIX_ROWS = {
    "accepted over TLS": ("alice@src.test", {"p1@out.test": OK}, "", "Subject: tls\r\n\r\nhi\r\n"),
    "RCPT 4xx and 5xx per recipient": (
        "alice@src.test", {"defer1@out.test": ("deferred", "4.2.0"),
                           "reject1@out.test": ("bounced", "5.1.1"), "p2@out.test": OK},
        "", "Subject: rcpt\r\n\r\nhi\r\n"),
    "MAIL 553": ("mailfail@src.test", {"p3@out.test": ("bounced", "5.1.8")}, "",
                 "Subject: m\r\n\r\nhi\r\n"),
    "MAIL 451": ("maildefer@src.test", {"p4@out.test": ("deferred", "4.3.0")}, "",
                 "Subject: m\r\n\r\nhi\r\n"),
    "DATA command 554": ("datacmdfail@src.test", {"p5@out.test": ("bounced", "5.7.1")}, "",
                         "Subject: d\r\n\r\nhi\r\n"),
    "after the final dot 554": ("dotfail@src.test", {"p6@out.test": ("bounced", "5.6.0")}, "",
                                "Subject: d\r\n\r\nhi\r\n"),
    "after the final dot 452": ("dotdefer@src.test", {"p7@out.test": ("deferred", "4.3.1")}, "",
                                "Subject: d\r\n\r\nhi\r\n"),
    "8BITMIME": ("alice@src.test", {"p8@out.test": OK}, " BODY=8BITMIME",
                 "Subject: 8\r\n\r\ncafé\r\n"),
    "SMTPUTF8": ("jörg@src.test", {"pjöhn@out.test": OK}, " SMTPUTF8",
                 "Subject: grüße\r\n\r\nhi\r\n"),
    "dot lines": ("alice@src.test", {"p9@out.test": OK}, "",
                  "Subject: dots\r\n\r\n.\r\n..\r\n.x\r\n"),
}


@pytest.mark.parametrize("name", list(POSTFIX_ROWS))
def test_the_relay_delivers_to_postfix_over_starttls(world, name):
    sender, outcomes, params, text = POSTFIX_ROWS[name]
    body = HEADERS + text.encode("latin-1" if "BODY" in params else "utf-8")
    steps: list[bytes | tuple[bytes, int]] = [
        b"EHLO client.test", f"MAIL FROM:<{sender}>{params}".encode()]
    steps += [f"RCPT TO:<{r}>".encode() for r in outcomes]
    steps += [b"DATA", (body.replace(b"\r\n.", b"\r\n..") + b".\r\n", 1), b"QUIT"]  # stuffed
    replies = raw_dialogue(world.relay.port, steps)
    assert codes(replies) == "220 250 250 " + "250 " * len(outcomes) + "354 250 221", replies
    deadline = time.monotonic() + 20
    while len(got := [e for e in world.relay.events() if e["to"] in outcomes]) < len(
            outcomes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {e["to"]: (e["status"], e["dsn"]) for e in got} == outcomes, got
    for e in got:
        assert e["relay"] == f"127.0.0.1[127.0.0.1]:{world.postfix.port}"
        assert e["tls"].startswith("TLSv1."), e  # verified STARTTLS to Postfix
    for rcpt, (status, _) in outcomes.items():
        if status == "sent":
            m = _arrived(world.sink, rcpt)
            assert m.mail_from == sender and m.data.endswith(body)
            assert all(o in m.mail_options for o in params.split())
    deferred = {e["to"]: e["reason"] for e in got if e["status"] == "deferred"}
    deadline = time.monotonic() + 10
    while True:  # a deferral is logged before its entry is handed back to the queue
        left = {e.rcpt: e.schedule.reason for e in queued_entries(world.queue)
                if e.rcpt in outcomes}
        if left == deferred or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == deferred
    if any(s == "bounced" for s, _ in outcomes.values()) and sender.isascii():
        dsn = _arrived(world.sink, sender)
        assert dsn.mail_from == ""


def test_postfix_logs_the_relays_tls_session(world):
    with smtplib.SMTP("127.0.0.1", world.relay.port, timeout=10) as c:
        c.sendmail("alice@src.test", ["tls@out.test"], HEADERS + b"Subject: tls\r\n\r\nhi\r\n")
    assert _arrived(world.sink, "tls@out.test").mail_from == "alice@src.test"
    log = world.postfix.wait_log("TLS connection established from")
    assert "TLS connection established from localhost[127.0.0.1]: TLSv1.3" in log, log[-3000:]
    tls = world.relay.wait_events(1, "tls", direction="out")[0]
    assert tls["server"] == f"127.0.0.1[127.0.0.1]:{world.postfix.port}"
    assert tls["version"] == "TLSv1.3"


# ---- the receiver table spoken to Postfix's smtpd ----

PEER_ROWS = [r for r in ROWS if DROP not in r.steps]


@pytest.mark.parametrize("row", PEER_ROWS, ids=[r.name for r in PEER_ROWS])
def test_the_receiver_table_against_postfix(world, row):
    replies = raw_dialogue(world.postfix.port, row.steps)
    assert codes(replies) == (row.postfix or row.codes), replies
