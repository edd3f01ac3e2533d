"""DATA as the relay sends it: its own payload matches aiosmtplib's, byte for byte, and a
real SMTP server gets back exactly the body that was queued, dot lines included."""

from __future__ import annotations

import smtplib

from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings
from hypothesis import example, given
from hypothesis import strategies as st

from queue_ref.relay.smtp_delivery import wire_body
from tests.relay_support import DnsServer, RelayThread, Sink, relay_config


def aiosmtplib_payload(body: bytes) -> bytes:
    """What ``aiosmtplib.SMTP.data(body)`` writes after DATA (its protocol's own steps)."""
    return PERIOD_REGEX.sub(b"..", normalize_message_line_endings(body)) + b".\r\n"


bodies = st.lists(st.sampled_from([b"a", b".", b"..", b"\r", b"\n", b"\r\n", b"x.y", b" "]),
                  max_size=40).map(b"".join)


@given(bodies)
@example(b"")
@example(b".")
@example(b".\r\n")
@example(b"a\r\n.\r\n")
@example(b"a\r\n..b")
@example(b"\r\n\r\n.")
def test_the_payload_is_aiosmtplibs_or_left_to_aiosmtplib(body):
    got = wire_body(body)
    bare = body.replace(b"\r\n", b"")
    if b"\r" in bare or b"\n" in bare:
        assert got is None  # a bare CR or LF: aiosmtplib's own conversion sends it
    else:
        assert got == aiosmtplib_payload(body)


def test_a_body_with_dot_lines_arrives_as_it_was_queued(tmp_path):
    lines = [b"Subject: dots", b"", b".", b"..", b"...x", b".leading", b"middle.", b"",
             b". space", b"end"]
    body = b"\r\n".join(lines) + b"\r\n"
    big = b"".join(b".%06d " % i + b"y" * 70 + b"\r\n" for i in range(20_000))  # 1.6 MB
    zone = {"ok.test": [("MX", (10, "mx.ok.test"))], "mx.ok.test": [("A", "127.0.0.1")]}
    with DnsServer(zone) as dns, Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), dns_nameservers=["127.0.0.1"], dns_port=dns.port,
            smtp_port=sink.port, log_json=True)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            for i, b in enumerate((body, b"Subject: big\r\n\r\n" + big)):
                c.sendmail("a@ok.test", [f"u{i}@ok.test"], b)
        got = {m.rcpts[0]: m.data for m in sink.wait_for(2)}
    # the relay puts its Received: header first; the rest is the body as it was queued
    assert got["u0@ok.test"].endswith(b"\r\n" + body)
    assert got["u1@ok.test"].endswith(b"\r\n\r\n" + big)
    assert got["u0@ok.test"].startswith(b"Received: ")
