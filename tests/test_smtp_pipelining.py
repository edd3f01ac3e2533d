"""The SMTP client's command pipelining (RFC 2920), against a scripted server on loopback.

The server answers each command line as it parses it, and notes how many command lines
it had read when it sent its first reply of a transaction: with pipelining MAIL and every
RCPT arrive before any reply (one write), without it one at a time.  Its replies can be
cut into pieces, spread over several writes, be multi-line, stop (the server hangs up
after k replies) or overflow (one reply too many), which is what a real server or the
network does to a pipelined group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import pytest

from queue_ref.relay.mx_routing import Nexthop
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.smtp_delivery import RcptResult, SmtpDeliverer

BODY = b"Subject: pipelined\r\n\r\nhello\r\n"


@dataclasses.dataclass
class Script:
    pipelining: bool = True
    refuse_mail: bool = False
    refused: Callable[[str], bool] = lambda rcpt: False
    piece: int = 0  # >0: replies written this many bytes at a time
    hang_up_after: int | None = None  # replies of the group before the server closes
    hang_up_tx: int = 0  # in that transaction only (0: in every one)
    extra_reply: bool = False  # one reply more than commands
    # what the server saw
    first_reply_after: list[int] = dataclasses.field(default_factory=list)
    transactions: int = 0
    connections: int = 0
    rsets: int = 0


class ScriptedServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._session, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        s = self.script
        if not s.piece:
            writer.write(data)
            await writer.drain()
            return
        for i in range(0, len(data), s.piece):
            writer.write(data[i:i + s.piece])
            await writer.drain()
            await asyncio.sleep(0)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = self.script
        s.connections += 1
        writer.write(b"220 scripted ESMTP\r\n")
        replied_in_tx = 0
        lines_in_tx = 0
        in_group = False
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    ext = b"250-PIPELINING\r\n" if s.pipelining else b""
                    writer.write(b"250-scripted\r\n" + ext + b"250 8BITMIME\r\n")
                    continue
                if verb == b"MAIL":
                    in_group, lines_in_tx, replied_in_tx = True, 0, 0
                    s.transactions += 1
                if in_group and verb in (b"MAIL", b"RCPT"):
                    lines_in_tx += 1
                    # every complete line already buffered counts as read
                    buffered = reader._buffer.count(b"\n")  # type: ignore[attr-defined]
                    if replied_in_tx == 0:
                        s.first_reply_after.append(lines_in_tx + buffered)
                    if (s.hang_up_after is not None and replied_in_tx >= s.hang_up_after
                            and s.hang_up_tx in (0, s.transactions)):
                        writer.close()
                        return
                    replied_in_tx += 1
                    if verb == b"MAIL":
                        reply = (b"550-5.7.1 not you\r\n550 5.7.1 go away\r\n" if s.refuse_mail
                                 else b"250-2.1.0 sender\r\n250 2.1.0 ok\r\n")
                    elif s.refuse_mail:
                        reply = b"503 5.5.1 need MAIL\r\n"
                    else:
                        rcpt = line.decode().split(":", 1)[1].strip().strip("<>")
                        reply = (b"550 5.1.1 <" + rcpt.encode() + b"> unknown\r\n"
                                 if s.refused(rcpt) else b"250 2.1.5 ok\r\n")
                    if s.extra_reply and verb == b"MAIL":
                        reply += b"250 2.0.0 surplus\r\n"
                    await self._send(writer, reply)
                    continue
                in_group = False
                if verb == b"DATA":
                    writer.write(b"354 go on\r\n")
                    await reader.readuntil(b"\r\n.\r\n")
                    writer.write(b"250 2.0.0 queued as X\r\n")
                elif verb == b"RSET":
                    s.rsets += 1
                    writer.write(b"250 2.0.0 reset\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    await writer.drain()
                    return
                else:
                    writer.write(b"502 5.5.2 what\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def deliver(script: Script, rcpts: list[str], *, times: int = 1) -> list[list[RcptResult]]:
    async def run() -> list[list[RcptResult]]:
        async with ScriptedServer(script) as srv:
            d = SmtpDeliverer(RelayConfig(smtp_timeout=5.0, smtp_connect_timeout=5.0))
            hop = Nexthop("127.0.0.1", "127.0.0.1", srv.port)
            try:
                return [await d.deliver([hop], "list@example.org", rcpts, BODY, {})
                        for _ in range(times)]
            finally:
                await d.close()
                await asyncio.sleep(0.05)  # closed transports finish closing in this loop
    return asyncio.run(asyncio.wait_for(run(), 60))


RCPTS = [f"r{i}@example.net" for i in range(50)]


def seventh(rcpt: str) -> bool:
    return int(rcpt[1:].split("@")[0]) % 7 == 3


@pytest.mark.parametrize("piece", [0, 1, 7])
def test_mail_and_every_rcpt_go_out_as_one_group_and_each_keeps_its_reply(piece: int) -> None:
    s = Script(refused=seventh, piece=piece)
    [results] = deliver(s, RCPTS)
    assert s.first_reply_after == [51]  # MAIL and 50 RCPTs read before the first reply
    for rcpt, r in zip(RCPTS, results, strict=True):
        if seventh(rcpt):
            assert (r.code, r.dsn, r.outcome) == (550, "5.1.1", "bounced")
            assert f"<{rcpt}> unknown" in r.text
        else:
            assert (r.code, r.outcome) == (250, "sent")
            assert "queued as X" in r.text


def test_without_pipelining_offered_commands_go_one_at_a_time() -> None:
    s = Script(pipelining=False, refused=seventh)
    [results] = deliver(s, RCPTS[:10])
    assert s.first_reply_after == [1]
    assert [r.code for r in results] == [550 if seventh(r) else 250 for r in RCPTS[:10]]


def test_a_refused_sender_refuses_every_recipient_and_the_connection_is_reset_and_reused() -> None:
    s = Script(refuse_mail=True)
    first, second = deliver(s, RCPTS[:5], times=2)
    for r in first + second:
        assert (r.code, r.dsn) == (550, "5.7.1")
        assert "not you" in r.text and "go away" in r.text
    assert s.rsets == 2 and s.connections == 1  # every 503 read: the session stays usable


@pytest.mark.parametrize("after", [1, 4])
def test_a_server_that_hangs_up_mid_group_defers_the_unanswered_and_keeps_the_refused(
        after: int) -> None:
    s = Script(refused=lambda r: r.startswith("r2@"), hang_up_after=after)
    [results] = deliver(s, RCPTS[:6])
    answered_rcpts = after - 1  # the first reply is MAIL's
    for i, r in enumerate(results):
        if i < answered_rcpts and RCPTS[i].startswith("r2@"):
            assert r.code == 550
        else:
            assert (r.code, r.dsn, r.outcome) == (0, "4.4.2", "deferred")
            assert "lost connection" in r.text and "RCPT TO" in r.text


def test_a_reused_session_closed_before_any_reply_is_tried_again_on_a_new_connection() -> None:
    s = Script(hang_up_after=0, hang_up_tx=2)
    first, second = deliver(s, RCPTS[:3], times=2)
    assert [r.code for r in first + second] == [250] * 6
    assert s.transactions == 3 and s.connections == 2  # the second, dead; tried again


def test_a_new_session_closed_before_any_reply_defers_everything_as_a_connection_failure() -> None:
    s = Script(hang_up_after=0)
    [results] = deliver(s, RCPTS[:3])
    assert s.connections == 1
    assert {(r.code, r.dsn) for r in results} == {(0, "4.4.1")}


def test_a_reply_too_many_is_a_protocol_error_and_nothing_is_sent() -> None:
    s = Script(extra_reply=True)
    first, second = deliver(s, RCPTS[:3], times=2)
    assert {(r.code, r.dsn) for r in first} == {(0, "4.4.2")}
    assert "more replies than commands" in first[0].text
    assert {(r.code, r.dsn) for r in second} == {(0, "4.4.2")}  # the server does it again
    assert s.connections == 2  # the confused session was not used again
    assert s.transactions == 2


# ---- replies out of place: a raw server per scenario ------------------------------------

Session = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run_raw(session: Session, rcpts: list[str], *, times: int = 1, timeout: float = 5.0
            ) -> tuple[list[list[RcptResult]], float]:
    async def main() -> tuple[list[list[RcptResult]], float]:
        server = await asyncio.start_server(session, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        d = SmtpDeliverer(RelayConfig(smtp_timeout=timeout, smtp_connect_timeout=5.0))
        hop = Nexthop("127.0.0.1", "127.0.0.1", port)
        t0 = time.monotonic()
        try:
            return ([await d.deliver([hop], "a@example.org", rcpts, BODY, {})
                     for _ in range(times)], time.monotonic() - t0)
        finally:
            await d.close()
            server.close()
            await server.wait_closed()
            await asyncio.sleep(0.05)  # closed transports finish closing in this loop
    return asyncio.run(asyncio.wait_for(main(), 60))


def replying(replies: dict[bytes, bytes], *, pipelining: bool = True,
             bodies: list[bytes] | None = None, late: bytes = b"",
             connections: list[int] | None = None) -> Session:
    """A server answering each verb as ``replies`` says (DATA: 354, the body kept in
    ``bodies``, then its reply); ``late``: sent 50 ms after the last RCPT's reply."""
    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.append(1)
        writer.write(b"220 raw ESMTP\r\n")
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    writer.write(b"250-raw\r\n" + (b"250-PIPELINING\r\n" if pipelining else b"")
                                 + b"250 8BITMIME\r\n")
                elif verb == b"DATA" and replies.get(b"DATA", b"354") == b"354":
                    writer.write(b"354 go on\r\n")
                    got = await reader.readuntil(b"\r\n.\r\n")
                    if bodies is not None:
                        bodies.append(got)
                    writer.write(replies.get(b"DOT", b"250 2.0.0 queued") + b"\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    await writer.drain()
                    return
                else:
                    writer.write(replies.get(verb, b"250 2.0.0 ok") + b"\r\n")
                    if verb == b"RCPT" and late and b"last@" in line:
                        await writer.drain()
                        await asyncio.sleep(0.05)
                        writer.write(late)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    return session


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_stray_reply_read_as_the_answer_to_data_sends_nothing_and_defers(
        pipelining: bool) -> None:
    """A surplus 250 that comes after the group, in a later segment, is what the client
    reads as DATA's reply: no body went out, so nobody is "sent"; the recipients are
    deferred as after a protocol error, and the connection is not used again."""
    bodies: list[bytes] = []
    conns: list[int] = []
    session = replying({}, pipelining=pipelining, bodies=bodies, connections=conns,
                       late=b"250 2.0.0 surplus\r\n")
    (first, second), _ = run_raw(session, ["a@example.net", "last@example.net"], times=2)
    assert bodies == []
    for r in first + second:
        assert (r.outcome, r.dsn) == ("deferred", "4.5.0")
        assert "protocol error" in r.text and "surplus" in r.text
    assert len(conns) == 2


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("verb,reply", [(b"MAIL", b"251 2.1.0 odd"), (b"RCPT", b"252 2.1.5 odd"),
                                        (b"DATA", b"250 2.0.0 odd")])
def test_a_positive_reply_where_a_step_wants_another_is_never_sent(
        pipelining: bool, verb: bytes, reply: bytes) -> None:
    bodies: list[bytes] = []
    session = replying({verb: reply}, pipelining=pipelining, bodies=bodies)
    [results], _ = run_raw(session, ["a@example.net", "b@example.net"])
    assert bodies == []
    assert {(r.outcome, r.dsn) for r in results} == {("deferred", "4.5.0")}
    assert all("odd" in r.text for r in results)


def test_a_final_2xx_other_than_250_is_sent() -> None:
    bodies: list[bytes] = []
    [results], _ = run_raw(replying({b"DOT": b"251 2.0.0 taken"}, bodies=bodies),
                           ["a@example.net"])
    assert len(bodies) == 1 and [(r.code, r.outcome) for r in results] == [(251, "sent")]


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_421_to_mail_defers_and_the_connection_is_not_reused(pipelining: bool) -> None:
    conns: list[int] = []
    session = replying({b"MAIL": b"421 4.3.2 shutting down", b"RCPT": b"503 5.5.1 need MAIL"},
                       pipelining=pipelining, connections=conns)
    (first, second), _ = run_raw(session, ["b@example.net"], times=2)
    for r in first + second:
        assert (r.code, r.outcome) == (421, "deferred") or r.dsn == "4.4.2"
    assert len(conns) == 2


def test_a_421_to_a_rcpt_sends_no_data_and_defers_the_rest() -> None:
    bodies: list[bytes] = []
    conns: list[int] = []

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        writer.write(b"220 raw ESMTP\r\n")
        n = 0
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb == b"EHLO":
                writer.write(b"250-raw\r\n250 PIPELINING\r\n")
            elif verb == b"RCPT":
                n += 1
                writer.write(b"421 4.3.2 going down\r\n" if n == 2 else b"250 2.1.5 ok\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go\r\n")
                bodies.append(await reader.readuntil(b"\r\n.\r\n"))
                writer.write(b"250 2.0.0 queued\r\n")
            else:
                writer.write(b"250 2.0.0 ok\r\n")
            await writer.drain()
        writer.close()

    [results], _ = run_raw(session, ["a@example.net", "b@example.net", "c@example.net"])
    assert bodies == []
    assert all(r.outcome == "deferred" for r in results)
    assert "421" in results[1].text


def test_each_reply_of_the_group_must_come_whole_within_the_timeout() -> None:
    """A server that drips MAIL's reply a byte per 0.5 s (4 s in all) against a 1 s
    timeout: the group fails after about a second, as one command at a time would."""
    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 raw ESMTP\r\n")
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    writer.write(b"250-raw\r\n250 PIPELINING\r\n")
                elif verb == b"MAIL":
                    for ch in b"250 ok\r\n":
                        await asyncio.sleep(0.5)
                        writer.write(bytes([ch]))
                        await writer.drain()
                else:
                    writer.write(b"250 2.0.0 ok\r\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    [results], took = run_raw(session, ["b@example.net"], timeout=1.0)
    assert took < 2.5
    assert [r.outcome for r in results] == ["deferred"]
