"""Promises of spec/RELAY_CONTRACT.md that no other test showed: what the Received header
reveals, lifetimes counted from arrival across a restart, and a double bounce that fails.
A real relay, a real DNS server and a real SMTP sink on loopback."""

from __future__ import annotations

import email
import email.policy
import smtplib
import time

from queue_ref.opener import open_queue
from tests.relay_support import RelayThread, Sink, relay_config
from tests.test_relay_delivery import config, dns_server, send

BODY = b"Subject: t\r\n\r\nhi\r\n"


def _received(data: bytes) -> str:
    msg = email.message_from_bytes(data, policy=email.policy.default)
    (first, *_rest) = msg.get_all("Received")
    return str(first)


def test_received_names_the_client_ip_and_helo_and_a_lone_recipient_only(tmp_path):
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}")) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.ehlo("bad(name)[x]\\y")
            c.mail("alice@example.org")
            c.rcpt("bob@example.net")
            c.rcpt("carol@example.net")
            assert c.data(BODY)[0] == 250
            c.mail("alice@example.org")
            c.rcpt("dave@example.net")
            assert c.data(BODY)[0] == 250
        got = {tuple(sorted(m.rcpts)): m for m in sink.wait_for(3)}
    two = _received(got[("bob@example.net", "carol@example.net")].data)
    assert "[127.0.0.1]" in two and "by relay.test" in two
    assert "bad_name__x__y" in two and "(name)" not in two  # HELO made header-safe
    for hidden in ("alice@", "bob@", "carol@"):  # neither sender nor several recipients
        assert hidden not in two, two
    one = _received(got[("dave@example.net",)].data)
    assert "for <dave@example.net>" in one and "alice@" not in one


def test_the_lifetime_counts_from_arrival_across_a_restart(tmp_path):
    with dns_server() as dns, Sink() as sink:
        with RelayThread(config(tmp_path, dns, sink)) as r:  # lifetime: 5 days
            arrived = time.time()
            send(r.port, "alice@ok.test", ["defer-me@ok.test"])
            assert r.wait_events(1, status="deferred")
        time.sleep(max(0.0, arrived + 3.0 - time.time()))
        # The same queue under a lifetime of 2 s: the message arrived over 2 s ago, so
        # its next failure expires it, though it waited less than that since the restart.
        with RelayThread(config(tmp_path, dns, sink, maximal_queue_lifetime=2.0)) as r:
            (bounced,) = r.wait_events(1, status="bounced", timeout=15)
            (dsn,) = sink.wait_for(1)
            deferred_after_restart = r.wait_events(1, status="deferred", timeout=0)
    assert bounced["reason"].startswith("message expired: 450 4.2.0"), bounced
    assert deferred_after_restart == []  # the first failure after the restart expired it
    assert dsn.rcpts == ["alice@ok.test"] and dsn.mail_from == ""


def test_a_double_bounce_that_fails_is_dropped_and_sent_once(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, double_bounce_recipient="reject-postmaster@ok.test")) as r:
        send(r.port, "reject-sender@ok.test", ["reject-rcpt@ok.test"])
        dropped = r.wait_events(1, "bounce", status="dropped", timeout=15)
        time.sleep(1.0)  # time for any further bounce (there must be none)
        bounces = [b for b in r.events("bounce") if b.get("bounce_id")]
    assert dropped, r.log_lines
    assert sink.state.seen.get("reject-postmaster@ok.test") == 1  # tried once, not retried
    assert [b["to"] for b in bounces] == ["reject-sender@ok.test", "reject-postmaster@ok.test"]
    assert sink.state.messages == []
    with open_queue(str(tmp_path / "q")) as q:
        assert list(q.list_queue()) == [] and q.footprint().objects == 0


def test_a_next_hop_that_stalls_past_smtp_timeout_returns_the_entry_deferred(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, smtp_timeout=1.0, minimal_backoff_time=3600,
            maximal_backoff_time=3600)) as r:
        send(r.port, "alice@ok.test", ["slow-one@ok.test"])  # the sink sits on DATA for 60 s
        (deferred,) = r.wait_events(1, status="deferred", timeout=15)
    assert deferred["to"] == "slow-one@ok.test" and deferred["dsn"].startswith("4."), deferred
    with open_queue(str(tmp_path / "q")) as q:
        (entry,) = list(q.list_queue())  # queued again, not left claimed
    assert entry.schedule.attempts == 1 and entry.schedule.at > time.time() + 3000
