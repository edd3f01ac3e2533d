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


@given(st.lists(st.sampled_from([b"a", b".", b"\r\n", b"a" * 500, b"b" * 997, b"c" * 998,
                                 b"d" * 999, b"e" * 3000]), max_size=12).map(b"".join))
@example(b"x" * 999)
@example(b"." + b"y" * 1200 + b"\r\n.")
def test_long_lines_are_folded_and_nothing_else_changes(body):
    # no spaces in these bodies: a line that starts with one is a piece the folding made
    wire = wire_body(body)
    assert wire is not None
    assert max(map(len, wire.split(b"\r\n"))) <= 998 + 1  # + a dot stuffed on a piece
    if not any(len(line) > 998 for line in body.split(b"\r\n")):
        assert wire == aiosmtplib_payload(body)
    unstuffed = wire[:-3].replace(b"\r\n..", b"\r\n.")
    if unstuffed.startswith(b".."):
        unstuffed = unstuffed[1:]
    assert unstuffed.replace(b"\r\n ", b"") == (body if body.endswith(b"\r\n") else body + b"\r\n")


def test_a_5000_octet_line_arrives_folded_with_all_its_content(tmp_path):
    line = b"".join(b"%05d," % i for i in range(834))[:5000]  # no two pieces alike
    body = b"Subject: long line\r\n\r\nbefore\r\n" + line + b"\r\nafter\r\n"
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            assert c.sendmail("a@ok.test", ["u@ok.test"], body) == {}
        (got,) = sink.wait_for(1)
    data = got.data[got.data.index(b"Subject: long line"):]  # after the Received: header
    lines = data.split(b"\r\n")
    assert max(map(len, lines)) == 998
    assert [len(x) for x in lines[3:9]] == [998, 998, 998, 998, 998, 15]  # 998 + 4*997 + 14
    assert all(x.startswith(b" ") for x in lines[4:9])
    assert data.replace(b"\r\n ", b"") == body  # every octet there, in order
