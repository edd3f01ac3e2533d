"""The null reverse-path ``MAIL FROM:<>`` (RFC 5321 4.5.5, RFC 1123 5.2.9): every bounce
another server sends.  It is accepted, queued with the empty sender, relayed with
``MAIL FROM:<>``, logged as ``from=<>``, and never bounced when it fails.  The SMTP edges
around it (a second MAIL, ``RCPT TO:<>``, ``<>`` followed by junk, RSET) behave as for any
sender.  Real peers: Python's smtplib, swaks, and a raw socket for the malformed forms."""

from __future__ import annotations

import smtplib
import subprocess
import time
from pathlib import Path

from queue_ref.opener import open_queue
from tests.relay_support import DnsServer, RelayThread, Sink, codes, raw_dialogue, relay_config

ZONE = {"ok.test": [("MX", (10, "mx.ok.test"))], "mx.ok.test": [("A", "127.0.0.1")]}
DSN = (b"Subject: Undelivered Mail Returned to Sender\r\nAuto-Submitted: auto-replied\r\n"
       b"\r\nyour mail could not be delivered\r\n")


def _config(tmp_path: Path, dns: DnsServer, sink: Sink):
    return relay_config(str(tmp_path / "q"), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
                        smtp_port=sink.port, log_json=True)


def test_the_null_sender_is_accepted_relayed_and_logged(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(_config(tmp_path, dns, sink)) as rt:
        with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
            c.ehlo("mx.elsewhere.test")
            assert c.mail("")[0] == 250  # smtplib sends MAIL FROM:<>
            assert c.rcpt("bob@ok.test")[0] == 250
            code, msg = c.data(DSN)
        assert code == 250, msg
        qid = msg.decode().rsplit(" ", 1)[1]
        [got] = sink.wait_for(1)
        [received] = rt.wait_events(1, "received")
        [sent] = rt.wait_events(1, status="sent")
        text = rt.relay.log.text(received)
    assert got.mail_from == "" and got.rcpts == ["bob@ok.test"]
    assert got.data.endswith(DSN)
    assert received["queue_id"] == qid and received["from"] == ""
    assert "from=<>" in text
    assert sent["queue_id"] == qid and sent["to"] == "bob@ok.test"


def test_a_failed_message_with_the_null_sender_is_not_bounced(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(_config(tmp_path, dns, sink)) as rt:
        with smtplib.SMTP("127.0.0.1", rt.port, timeout=10) as c:
            c.ehlo("mx.elsewhere.test")
            c.mail("")
            c.rcpt("reject@ok.test")
            assert c.data(DSN)[0] == 250
        [dropped] = rt.wait_events(1, "bounce", status="dropped")
        time.sleep(0.3)
        assert rt.call(rt.relay.scheduler.sizes)["queued"] == 0
    assert dropped["nrcpt"] == 1
    assert sink.state.messages == []  # no bounce of a bounce
    store = open_queue(str(tmp_path / "q"))
    try:
        assert list(store.list_queue()) == []
    finally:
        store.close()


def test_the_smtp_edges_of_the_null_sender(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(_config(tmp_path, dns, sink)) as rt:
        replies = raw_dialogue(rt.port, [
            b"EHLO client.test",
            b"MAIL FROM:<>x",                      # not a path
            b"MAIL FROM:<> SIZE=100 BODY=8BITMIME",  # the null path with parameters
            b"MAIL FROM:<>",                       # a second MAIL in the transaction
            b"RCPT TO:<>",                         # no null forward-path
            b"ETRN ok.test",                       # inside a transaction
            b"RCPT TO:<bob@ok.test>",
            b"RSET",
            b"MAIL FROM:<alice@ok.test>",          # a new transaction after RSET
            b"QUIT",
        ])
    assert codes(replies) == "220 250 555 250 503 501 503 250 250 250 221", replies


def test_swaks_sends_a_bounce_with_the_null_sender(tmp_path):
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(_config(tmp_path, dns, sink)) as rt:
        run = subprocess.run(
            ["swaks", "--server", "127.0.0.1", "--port", str(rt.port), "--from", "<>",
             "--to", "carol@ok.test", "--helo", "mx.elsewhere.test",
             "--header", "Subject: Delivery Status Notification (Failure)"],
            capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "MAIL FROM:<>" in run.stdout
        [got] = sink.wait_for(1)
    assert got.mail_from == "" and got.rcpts == ["carol@ok.test"]
