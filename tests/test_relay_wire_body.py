"""DATA as the relay sends it: its own payload matches aiosmtplib's, byte for byte, made
whole or a piece at a time (``WireEncoder``, for bodies streamed from the queue), and a
real SMTP server gets back exactly the body that was queued, dot lines included."""

from __future__ import annotations

import smtplib
import socket

from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings
from hypothesis import example, given
from hypothesis import strategies as st

from queue_ref.relay.smtp_line_folding import dot_lines, wire_ready
from queue_ref.relay.smtp_wire_body import WireEncoder, wire_parts, wire_payload
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
@example(b"a\nb\rc")
def test_the_payload_is_aiosmtplibs(body):
    """Bare CRs and LFs included: made CRLF as aiosmtplib makes them."""
    assert wire_payload(body, 0) == aiosmtplib_payload(body)
    assert wire_payload(body) == aiosmtplib_payload(body)  # no line over 998 here


def encoded_in_pieces(body: bytes, cuts: list[int], limit: int, ready: bool) -> bytes:
    encoder = WireEncoder(limit, ready=ready)
    out, pos = [], 0
    for n in cuts:
        out.append(encoder.feed(body[pos:pos + n]))
        pos += n
    out.append(encoder.feed(body[pos:]))
    return b"".join([*out, encoder.end()])


@given(st.lists(st.sampled_from([b"a", b".", b"..", b"\r", b"\n", b"\r\n", b"x.y", b" ",
                                 b"b" * 7, b"\xc3\xa9", b"c" * 30]), max_size=40).map(b"".join),
       st.lists(st.integers(0, 40), max_size=12), st.sampled_from([0, 5, 998]))
@example(b"a\r", [2], 0)
@example(b"a\r\n", [2], 0)
@example(b"a\r\n", [3], 0)
@example(b".a\r\n.b", [3], 0)
@example(b"", [], 0)
def test_a_body_encoded_a_piece_at_a_time_is_the_payload_made_whole(body, cuts, limit):
    """Cut anywhere (inside a CRLF, after a CR, before a dot, inside a long line), the
    pieces give exactly ``wire_payload`` of the whole; so does a ``ready`` body as it is."""
    assert encoded_in_pieces(body, cuts, limit, False) == wire_payload(body, limit)
    if wire_ready(body, limit):
        assert encoded_in_pieces(body, cuts, limit, True) == wire_payload(body, limit)


def test_the_encoder_holds_only_the_line_not_ended_yet():
    encoder = WireEncoder(998)
    assert encoder.feed(b"abc\r\n.de") == b"abc\r\n"
    assert encoder.held() == 3
    assert encoder.feed(b"f\r") == b""  # an LF may follow the CR
    assert encoder.feed(b"\nx") == b"..def\r\n"
    assert encoder.end() == b"x\r\n.\r\n"


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
    wire = wire_payload(body)
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


@given(st.lists(st.sampled_from([b"a", b".", b"\r", b"\n", b"\r\n", b"a" * 500, b"b" * 997,
                                 b"c" * 998, b"d" * 999]), max_size=12).map(b"".join),
       st.sampled_from([0, 998, 40]))
@example(b".", 0)
@example(b"a\r\n.", 0)
@example(b"a\r.\n", 0)
def test_a_body_the_receiver_found_wire_ready_goes_out_as_wire_payload_makes_it(body, limit):
    """``wire_ready`` holds exactly for bodies with CRLF line breaks only, no line over
    the limit and no line that starts with a dot, whether it looks for those lines or is
    told; for those, ``wire_payload(..., ready=True)`` (nothing looked at) gives aiosmtplib's
    own payload (nothing to fold, convert or stuff)."""
    bare = body.replace(b"\r\n", b"")
    lines = body.split(b"\r\n")
    dots = any(x.startswith(b".") for x in lines)
    assert dot_lines(body) == dots
    want = b"\r" not in bare and b"\n" not in bare and not dots and not (
        limit and any(len(x) > limit for x in lines))
    assert wire_ready(body, limit) == want
    assert wire_ready(body, limit, dots=dots) == want
    if want:
        assert wire_payload(body, limit, ready=True) == aiosmtplib_payload(body)
        parts = wire_parts(body, limit, ready=True)
        assert parts[0] is body and b"".join(parts) == aiosmtplib_payload(body)  # no copy
    assert b"".join(wire_parts(body, limit)) == wire_payload(body, limit)


def test_the_receiver_tells_the_delivery_which_bodies_go_out_as_they_are(tmp_path):
    """A clean body is delivered without the checks (the job says wire_ready); a body
    with a bare CR, a bare LF, a line over the limit or a line that starts with a dot is
    not, and arrives converted (bare LF already at receipt, as Postfix's smtpd normalizes
    it; bare CR at delivery), folded or stuffed.  The client is a raw socket: smtplib
    would fix the line breaks itself."""
    bodies = {"clean": b"Subject: clean\r\n\r\nline\r\nnot.a dot line\r\n",
              "dots": b"Subject: dots\r\n\r\nline\r\n.dot\r\n..two\r\n.\r\n",
              "cr": b"Subject: cr\r\n\r\na\rb\r\n",
              "lf": b"Subject: lf\r\n\r\na\nb\r\n",
              "long": b"Subject: long\r\n\r\n" + b"x" * 1200 + b"\r\n"}
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
        seen: dict[str, bool] = {}
        deliverer = r.relay.scheduler.deliverer
        real = deliverer.deliver

        async def watching(hosts, mail_from, rcpts, body, params, *, wire_ready=False):
            seen[rcpts[0].split("@")[0]] = wire_ready
            return await real(hosts, mail_from, rcpts, body, params, wire_ready=wire_ready)

        deliverer.deliver = watching
        with socket.create_connection(("127.0.0.1", r.port), timeout=10) as s:
            f = s.makefile("rb")

            def say(line: bytes) -> bytes:
                s.sendall(line)
                reply = f.readline()
                while reply[3:4] == b"-":
                    reply = f.readline()
                return reply

            assert f.readline().startswith(b"220")
            assert say(b"EHLO client.test\r\n").startswith(b"250")
            for name, body in bodies.items():
                assert say(b"MAIL FROM:<a@ok.test>\r\n").startswith(b"250")
                assert say(b"RCPT TO:<%s@ok.test>\r\n" % name.encode()).startswith(b"250")
                assert say(b"DATA\r\n").startswith(b"354")
                stuffed = body.replace(b"\r\n.", b"\r\n..")
                assert say(stuffed + b".\r\n").startswith(b"250"), name
            say(b"QUIT\r\n")
        got = {m.rcpts[0].split("@")[0]: m.data for m in sink.wait_for(5)}
    assert seen == {"clean": True, "dots": False, "cr": False, "lf": False, "long": False}
    assert got["clean"].endswith(b"\r\n" + bodies["clean"])
    assert got["dots"].endswith(b"\r\n" + bodies["dots"])
    assert got["cr"].endswith(b"\r\n\r\na\r\nb\r\n")
    assert got["lf"].endswith(b"\r\n\r\na\r\nb\r\n")
    assert max(map(len, got["long"].split(b"\r\n"))) == 998
