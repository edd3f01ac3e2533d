"""Delivery through a DNS server and SMTP sinks on loopback: MX routing, retries, bounces."""

from __future__ import annotations

import asyncio
import email
import email.policy
import shutil
import smtplib
import ssl
import subprocess
import time
from collections import Counter

import pytest
from aiosmtplib.email import quote_address
from hypothesis import given
from hypothesis import strategies as st

from queue_ref.opener import open_queue
from queue_ref.relay.mx_routing import Router
from queue_ref.relay.smtp_address import PLAIN_ADDRESS, plain_quoted
from tests.relay_support import (
    DnsServer,
    RelayThread,
    Sink,
    plain_addresses,
    relay_config,
    smtp_send,
)

ZONE = {
    "ok.test": [("MX", (10, "mx1.ok.test"))],
    "mx1.ok.test": [("A", "127.0.0.1")],
    "backup.test": [("MX", (10, "dead.backup.test")), ("MX", (20, "mx1.ok.test"))],
    "dead.backup.test": [("A", "127.0.0.2")],  # nothing listens there
    "implicit.test": [("A", "127.0.0.1")],
    "nullmx.test": [("MX", (0, "."))],
    "noaddr.test": [],
    "equal.test": [("MX", (10, "a.equal.test")), ("MX", (10, "b.equal.test")),
                   ("MX", (20, "c.equal.test"))],
    "a.equal.test": [("A", "127.0.0.11")],
    "b.equal.test": [("A", "127.0.0.12")],
    "c.equal.test": [("A", "127.0.0.13")],
}


def dns_server() -> DnsServer:
    return DnsServer(ZONE, silent={"silent.test"}, servfail={"servfail.test"})


def config(tmp_path, dns: DnsServer, sink: Sink, **kw):
    return relay_config(str(tmp_path / "q"), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
                        smtp_port=sink.port, log_json=True, **kw)


send = smtp_send


def test_routes_from_a_real_dns_server(tmp_path):
    with dns_server() as dns:
        cfg = relay_config(str(tmp_path), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
                           smtp_port=2525, dns_timeout=0.5,
                           transport_maps={"mapped.test": "[127.0.0.9]:2600",
                                           ".deep.test": "mx1.ok.test:2601"})
        router = Router(cfg)

        async def routes():
            out = {}
            for d in ("ok.test", "backup.test", "implicit.test", "nullmx.test", "missing.test",
                      "noaddr.test", "silent.test", "servfail.test", "mapped.test",
                      "x.deep.test", "[127.0.0.5]"):
                out[d] = await router.route(d)
            firsts = Counter()
            for _ in range(30):
                r = await router.route("equal.test")
                assert r.hosts[-1].address == "127.0.0.13"  # preference 20 always last
                firsts[r.hosts[0].address] += 1
            return out, firsts

        out, firsts = asyncio.run(routes())
    assert [str(h) for h in out["ok.test"].hosts] == ["mx1.ok.test[127.0.0.1]:2525"]
    assert [h.address for h in out["backup.test"].hosts] == ["127.0.0.2", "127.0.0.1"]
    assert [str(h) for h in out["implicit.test"].hosts] == ["implicit.test[127.0.0.1]:2525"]
    assert (out["nullmx.test"].dsn, out["missing.test"].dsn) == ("5.1.10", "5.1.2")
    assert out["noaddr.test"].dsn == "5.4.4"
    assert out["silent.test"].dsn == "4.4.3" and "Timeout" in out["silent.test"].reason
    assert out["servfail.test"].dsn == "4.4.3"
    assert [str(h) for h in out["mapped.test"].hosts] == ["127.0.0.9[127.0.0.9]:2600"]
    assert out["mapped.test"].destination == "[127.0.0.9]:2600"
    assert [str(h) for h in out["x.deep.test"].hosts] == ["mx1.ok.test[127.0.0.1]:2601"]
    assert [h.address for h in out["[127.0.0.5]"].hosts] == ["127.0.0.5"]
    assert set(firsts) == {"127.0.0.11", "127.0.0.12"}  # random order among equals


def test_mx_implicit_mx_and_next_mx_deliver(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(tmp_path, dns, sink)) as r:
        send(r.port, "alice@ok.test", ["bob@ok.test", "carol@backup.test", "dave@implicit.test"])
        sink.wait_for(3)
        sent = r.wait_events(3, status="sent")
    assert sorted(sink.state.rcpts()) == ["bob@ok.test", "carol@backup.test", "dave@implicit.test"]
    # One message, three domains: three transactions.  backup.test's first MX refused.
    assert {e["to"]: e["relay"].split("[")[0] for e in sent} == {
        "bob@ok.test": "mx1.ok.test", "carol@backup.test": "mx1.ok.test",
        "dave@implicit.test": "implicit.test"}


def test_deferral_then_success_on_retry(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(tmp_path, dns, sink)) as r:
        qid = send(r.port, "alice@ok.test", ["flaky@ok.test", "bob@ok.test"])
        (deferred,) = r.wait_events(1, status="deferred")
        assert deferred["dsn"] == "4.3.0" and deferred["attempts"] == 1
        assert deferred["reason"].startswith("451 4.3.0")
        sent = r.wait_events(2, status="sent", timeout=15)
    assert {(e["to"], e["attempts"]) for e in sent} == {("bob@ok.test", 1), ("flaky@ok.test", 2)}
    assert all(e["queue_id"] == qid for e in sent)
    assert sorted(sink.state.rcpts()) == ["bob@ok.test", "flaky@ok.test"]


def _dsn(received) -> email.message.EmailMessage:
    msg = email.message_from_bytes(received.data, policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    return msg


def test_rejection_bounces_an_rfc3464_report_with_the_null_sender(tmp_path):
    body = b"From: alice@ok.test\r\nSubject: important\r\nMessage-ID: <m1@ok.test>\r\n\r\nhi\r\n"
    with dns_server() as dns, Sink() as sink, RelayThread(config(tmp_path, dns, sink)) as r:
        qid = send(r.port, "alice@ok.test", ["reject-me@ok.test", "x@nullmx.test", "y@ok.test"],
                   body)
        got = sink.wait_for(2)
        bounced = r.wait_events(2, status="bounced")
        (bounce_ev,) = r.wait_events(1, "bounce")
    assert {e["dsn"] for e in bounced} == {"5.1.1", "5.1.10"}
    assert bounce_ev["queue_id"] == qid and bounce_ev["to"] == "alice@ok.test"
    (dsn_mail,) = [m for m in got if m.mail_from == ""]
    assert dsn_mail.rcpts == ["alice@ok.test"]
    msg = _dsn(dsn_mail)
    parts = list(msg.iter_parts())
    assert [p.get_content_type() for p in parts] == [
        "text/plain", "message/delivery-status", "message/rfc822"]  # whole: under 50000
    status = parts[1]
    blocks = [dict(b.items()) for b in status.get_payload()]
    assert blocks[0]["Reporting-MTA"] == "dns; relay.test"
    assert "Arrival-Date" in blocks[0]
    per = {b["Final-Recipient"]: b for b in blocks[1:]}
    assert set(per) == {"rfc822; reject-me@ok.test", "rfc822; x@nullmx.test"}
    rej = per["rfc822; reject-me@ok.test"]
    assert (rej["Action"], rej["Status"], rej["Remote-MTA"]) == ("failed", "5.1.1",
                                                                  "dns; mx1.ok.test")
    assert rej["Diagnostic-Code"] == "smtp; 550 5.1.1 No such user here"
    assert "Last-Attempt-Date" in rej
    assert per["rfc822; x@nullmx.test"]["Status"] == "5.1.10"
    [returned] = parts[2].get_payload()
    assert returned["Message-ID"] == "<m1@ok.test>" and returned.get_content().rstrip() == "hi"
    assert "Undelivered" in msg["Subject"] and msg["Auto-Submitted"] == "auto-replied"


def test_a_bounce_to_an_unreachable_sender_is_not_bounced_again(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(tmp_path, dns, sink)) as r:
        send(r.port, "reject-sender@ok.test", ["reject-rcpt@ok.test"])
        r.wait_events(2, status="bounced")  # the message, then its bounce
        dropped = r.wait_events(1, "bounce", status="dropped")
        assert dropped, r.log_lines
        time.sleep(0.5)
        bounces = r.events("bounce")
    assert len([b for b in bounces if b.get("bounce_id")]) == 1  # no bounce of the bounce
    assert sink.state.rcpts() == []
    with open_queue(str(tmp_path / "q")) as q:
        assert list(q.list_queue()) == [] and q.footprint().objects == 0


def test_lifetime_exceeded_bounces_a_deferred_message(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, maximal_queue_lifetime=2.0)) as r:
        send(r.port, "alice@ok.test", ["defer-me@ok.test"])
        assert r.wait_events(1, status="deferred")
        (bounced,) = r.wait_events(1, status="bounced", timeout=15)
        got = sink.wait_for(1)
    assert bounced["reason"].startswith("message expired: 450 4.2.0")
    assert bounced["dsn"] == "4.2.0"
    msg = _dsn(got[0])
    block = list(msg.iter_parts())[1].get_payload()[1]
    assert block["Action"] == "failed" and block["Status"] == "4.2.0"


def test_dns_failures_defer_and_a_dropped_connection_defers(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, minimal_backoff_time=3600, maximal_backoff_time=3600)) as r:
        send(r.port, "alice@ok.test", ["a@silent.test", "b@servfail.test", "drop-me@ok.test"])
        deferred = {e["to"]: e for e in r.wait_events(3, status="deferred", timeout=15)}
    assert deferred["a@silent.test"]["dsn"] == "4.4.3"
    assert deferred["b@servfail.test"]["dsn"] == "4.4.3"
    assert deferred["drop-me@ok.test"]["dsn"] == "4.4.2"
    assert "lost connection" in deferred["drop-me@ok.test"]["reason"]
    assert sink.state.rcpts() == []
    with open_queue(str(tmp_path / "q")) as q:
        queued = list(q.list_queue())
    assert len(queued) == 3
    assert all(m.schedule.attempts == 1 and m.schedule.at >= time.time() + 3000 for m in queued)


def test_connections_are_reused_and_concurrency_is_limited(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, default_destination_concurrency_limit=1,
            smtp_connection_cache_time_limit=5.0)) as r:
        for i in range(6):
            send(r.port, "alice@ok.test", [f"u{i}@ok.test"])
        sink.wait_for(6)
        assert r.relay.deliverer.connections_made == 1
        assert r.relay.deliverer.connections_reused == 5
    assert sink.state.connections == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a cert")
def test_starttls_is_used_when_offered(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=mx1.ok.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    with dns_server() as dns, Sink(tls_context=ctx) as sink, RelayThread(config(
            tmp_path, dns, sink, smtpd_tls_cert_file=str(cert), smtpd_tls_key_file=str(key))) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.ehlo("client.test")
            assert c.has_extn("starttls")
            c.starttls(context=ssl._create_unverified_context())
            c.ehlo("client.test")
            c.sendmail("alice@ok.test", ["bob@ok.test"], b"Subject: tls\r\n\r\nhi\r\n")
        (got,) = sink.wait_for(1)
    assert got.tls
    assert b"with ESMTPS" in got.data.split(b"\r\n\r\n")[0]


@pytest.mark.parametrize("warning", [1.5, 2.5])
def test_a_delay_warning_is_sent_once_while_retries_go_on(tmp_path, warning):
    """Retries after 1 s, then 2 s (minimal 1, maximal 2; whole seconds): the warning goes
    once, on the deferral whose interval spans the warning time (which one depends on where
    in its second the mail arrived: tests/test_relay_delivery_lockstep.py checks which)."""
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, delay_warning_time=warning)) as r:
        send(r.port, "alice@ok.test", ["defer-me@ok.test"])
        (warn,) = r.wait_events(1, "delayed", timeout=15)
        got = sink.wait_for(1)
        r.wait_events(4, status="deferred", timeout=15)
        assert len(r.events("delayed")) == 1

    assert warn["to"] == "alice@ok.test"
    msg = _dsn(got[0])
    assert "Delayed Mail" in msg["Subject"]
    block = list(msg.iter_parts())[1].get_payload()[1]
    assert block["Action"] == "delayed" and block["Status"] == "4.2.0"
    assert "Will-Retry-Until" in block
    assert block["Remote-MTA"] == "dns; mx1.ok.test"  # the server that deferred it
    assert block["Diagnostic-Code"] == "smtp; 450 4.2.0 Mailbox busy, try later"


def test_shutdown_puts_a_delivery_in_progress_back_with_its_schedule(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, shutdown_timeout=0.5)) as r:
        send(r.port, "alice@ok.test", ["slow-one@ok.test"])
        deadline = time.monotonic() + 10
        while not sink.state.seen and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the sink now sits on DATA
        started = time.monotonic()
    assert time.monotonic() - started < 10
    with open_queue(str(tmp_path / "q")) as q:
        (entry,) = list(q.list_queue())
    assert entry.schedule.attempts == 0  # not counted as an attempt: it was cut short
    assert sink.state.rcpts() == []
    # the wait and its end are said, not silent
    said = [(e["what"], e["deliveries"]) for e in r.events("relay") if "deliveries" in e]
    assert said == [("stopping", 1), ("deliveries cut short", 1)]


def test_undeliverable_bounces_go_to_the_double_bounce_recipient(tmp_path):
    with dns_server() as dns, Sink() as sink, RelayThread(config(
            tmp_path, dns, sink, double_bounce_recipient="postmaster@ok.test")) as r:
        send(r.port, "reject-sender@ok.test", ["reject-rcpt@ok.test"])
        (got,) = sink.wait_for(1)
        r.wait_events(1, status="sent")
        time.sleep(0.3)
    assert got.rcpts == ["postmaster@ok.test"] and got.mail_from == ""
    block = list(_dsn(got).iter_parts())[1].get_payload()[1]
    assert block["Final-Recipient"] == "rfc822; reject-sender@ok.test"
    assert len(sink.state.messages) == 1


@given(st.one_of(plain_addresses(),
                 st.text("a@.-\"<> \u00e9()", max_size=12)))
def test_plain_addresses_are_quoted_as_aiosmtplib_quotes_them(address):
    """The delivery client's own quoting (no email package) gives what aiosmtplib's
    ``quote_address`` gives, wherever it applies; elsewhere aiosmtplib still quotes."""
    ours = plain_quoted(address)
    if ours is not None:
        assert ours == quote_address(address).encode("ascii")
    if PLAIN_ADDRESS.fullmatch(address) is not None or not address:
        assert ours is not None
    else:
        assert ours is None


def test_shutdown_after_commits_does_not_wait_out_its_timeout(tmp_path):
    """Mail was committed and delivered; nothing is in progress: stopping the relay takes
    far less than ``shutdown_timeout`` (it waits for commits in progress, not for one that
    ended)."""
    with dns_server() as dns, Sink() as sink:
        r = RelayThread(config(tmp_path, dns, sink, shutdown_timeout=8.0))
        with r:
            send(r.port, "alice@ok.test", ["bob@ok.test"])
            sink.wait_for(1)
            r.wait_events(1, status="sent")
            assert r.relay.receiver.commits == 0
            started = time.monotonic()
        assert time.monotonic() - started < 4.0


def test_an_ipv6_address_literal_is_routed_whatever_the_case_of_its_tag(tmp_path) -> None:
    """Domains reach the router lower-cased: ``[ipv6:...]`` is the literal ``[IPv6:...]``
    of RFC 5321 4.1.3 (it was bounced as a bad address literal)."""
    router = Router(relay_config(str(tmp_path)))
    for literal in ("[IPv6:2001:db8::1]", "[ipv6:2001:db8::1]"):
        route = asyncio.run(router.route(literal))
        assert [h.address for h in route.hosts] == ["2001:db8::1"], route
    assert asyncio.run(router.route("[ipv6:300.1.1.1]")).dsn == "5.1.2"
