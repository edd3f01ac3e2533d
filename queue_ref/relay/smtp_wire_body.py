"""The DATA payload of a body: made whole, or streamed from the queue a piece at a time.

The payload is what aiosmtplib's ``data()`` would send: every line break CRLF (a bare CR
or LF made one), a CRLF at the end, each line that starts with ``.`` given another
(dot-stuffing), then ``.`` CRLF; and, unlike aiosmtplib, lines over the line length limit
folded first (``smtp_line_folding``).  ``wire_payload`` makes it from a body held whole,
with ``bytes`` methods in one pass each (aiosmtplib's two regular expressions take about
7 ms per MB; these about 2 ms, and a body the receiver found ``wire_ready`` none).

A body over ``STREAMED_BODY`` is not held whole while it goes out (``BodyStream``): it is
read from the queue ``STREAM_PIECE`` octets at a time, each piece encoded by a
``WireEncoder`` (the same payload, made a piece at a time) and written once the
connection has sent all but ``WRITE_BUFFER_LOW`` octets of the piece before.  A delivery
then holds a piece, the rest of its last line, and what the connection has not sent, not
the body: 20 connections to a slow next hop with 50 MB each hold about 40 MB, not 1 GB.
The limit of a line held until its end is ``message_size_limit``; mail has line breaks far
more often than every MB.

The queue checks the body's digest as it is read and raises before it hands out the last
octets of a body that does not match (``MailReader``).  A read that fails while the body
is streamed (damage, a disk error, the queue reopened) drops the connection before the
final dot, so the peer delivers nothing (RFC 5321 4.1.1.4: mail is delivered only after
the end of data is received), and ``BodyUnreadable`` goes up with the queue's error as
its cause: the caller quarantines or puts back; no next host is tried with it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import cast

import aiosmtplib

from queue_ref.relay.smtp_line_folding import (
    LINE_LENGTH_LIMIT,
    crlf_only,
    fold_long_lines,
    has_long_line,
)

__all__ = ["STREAMED_BODY", "STREAM_PIECE", "BodyStream", "BodyUnreadable", "WireEncoder",
           "header_ascii", "send_stream", "wire_parts", "wire_payload"]

#: Bodies over this many octets are streamed from the queue as they go out.
STREAMED_BODY = 4 << 20
#: How much of a streamed body is read (and written) at a time.
STREAM_PIECE = 1 << 20
#: A piece is written once the connection has fewer than this many octets left to send.
WRITE_BUFFER_LOW = 256 << 10

#: Line breaks as aiosmtplib's ``data()`` makes them CRLF.
_LINE_ENDINGS = re.compile(rb"(?:\r\n|\n|\r(?!\n))")
_CRLF = b"\r\n"
_END = b".\r\n"


def _encoded(lines: bytes, line_limit: int) -> bytes:
    """Whole lines of a body (ending in a line break, starting a line) as they go out:
    CRLF line breaks, long lines folded, dot-stuffed."""
    if not crlf_only(lines):
        lines = _LINE_ENDINGS.sub(_CRLF, lines)
    if line_limit and has_long_line(lines, line_limit):
        lines = fold_long_lines(lines, line_limit)
    stuffed = lines.replace(b"\r\n.", b"\r\n..")
    return b"." + stuffed if stuffed.startswith(b".") else stuffed


def wire_payload(body: bytes, line_limit: int = LINE_LENGTH_LIMIT, *,
                 ready: bool = False) -> bytes:
    """The DATA payload of ``body``, ``.`` CRLF included.  Lines of more than
    ``line_limit`` octets are folded (0: never).  ``ready``: the caller knows that
    ``smtp_line_folding.wire_ready(body, line_limit)`` holds (the receiver checked the
    body it stored): it goes out as it is, nothing looked at (one copy, to put ``.`` CRLF
    after it)."""
    if ready:
        return body + _END if body.endswith(_CRLF) else body + _CRLF + _END
    if not crlf_only(body):
        body = _LINE_ENDINGS.sub(_CRLF, body)
    if not body.endswith(_CRLF):
        body += _CRLF
    return _encoded(body, line_limit) + _END


def wire_parts(body: bytes, line_limit: int = LINE_LENGTH_LIMIT, *,
               ready: bool = False) -> tuple[bytes, ...]:
    """``wire_payload`` as the parts to write one after the other: a ``ready`` body as it
    is, then what ends it (no copy of the body, where joining them took a copy a MB)."""
    if ready:
        return (body, _END if body.endswith(_CRLF) else _CRLF + _END)
    return (wire_payload(body, line_limit),)


class WireEncoder:
    """``wire_payload`` a piece at a time: fed a body in pieces of any sizes, in order,
    ``feed`` and then ``end`` give, joined, exactly ``wire_payload`` of the whole body.

    Each piece is encoded up to its last line break; the rest (a line not ended yet, or
    a CR that an LF may follow) waits for the next piece, kept as the pieces it came in
    (a line of many pieces is joined once, when it ends).  ``ready`` bodies go out as
    they come."""

    def __init__(self, line_limit: int = LINE_LENGTH_LIMIT, *, ready: bool = False) -> None:
        self.line_limit = line_limit
        self.ready = ready
        #: not encoded yet: the start of a line whose end is still to come, in pieces
        self._rest: list[bytes] = []
        self._held = 0
        self._fed = False  # a line break was given back (the rest starts a line after it)
        self._tail = b""  # ``ready``: the last two octets fed

    def held(self) -> int:
        """The octets fed and not given back yet."""
        return self._held

    def feed(self, piece: bytes) -> bytes:
        if self.ready:
            if piece:
                self._tail = (self._tail + piece[-2:])[-2:]
            return piece
        if not piece:
            return b""
        # the last line break: an LF, or a CR with something other than LF after it
        cut = max(piece.rfind(b"\n"), piece.rfind(b"\r", 0, len(piece) - 1))
        if cut < 0 and self._rest and self._rest[-1].endswith(b"\r") and piece[0:1] != b"\n":
            cut = -1  # the rest ends with a bare CR: a line break between the two
        elif cut < 0:
            self._rest.append(piece)
            self._held += len(piece)
            return b""
        lines = b"".join([*self._rest, piece[:cut + 1]])
        after = piece[cut + 1:]
        self._rest, self._held, self._fed = [after] if after else [], len(after), True
        return _encoded(lines, self.line_limit)

    def end(self) -> bytes:
        """The rest, CRLF at the end where the body has none, and ``.`` CRLF."""
        if self.ready:
            return _END if self._tail == _CRLF else _CRLF + _END
        rest = b"".join(self._rest)
        self._rest, self._held = [], 0
        if not rest and self._fed:  # the body ends with the line break given back last
            return _END
        if not crlf_only(rest):
            rest = _LINE_ENDINGS.sub(_CRLF, rest)
        if not rest.endswith(_CRLF):
            rest += _CRLF
        return _encoded(rest, self.line_limit) + _END


class BodyUnreadable(Exception):
    """The queue could not give the rest of a body being sent; the connection was dropped
    before the final dot.  ``__cause__`` is the queue's error (a ``CorruptionError`` when
    the body was found damaged and quarantined)."""


class BodyStream(abc.ABC):
    """A body read from the queue as it goes out.  ``pieces`` reads it from the start
    each time it is entered (a delivery to a second host reads it again)."""

    size: int

    @abc.abstractmethod
    def pieces(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[bytes]]:
        """The body in pieces of at most ``STREAM_PIECE`` octets; the reader is closed at
        the exit however it is left.  A read that fails raises ``BodyUnreadable``."""

    def held(self) -> int:
        """The octets of the body this stream holds now (a piece being sent)."""
        return 0


async def header_ascii(body: bytes | BodyStream) -> bool:
    """Whether the header section of ``body`` (up to its first empty line, or all of it)
    holds ASCII only; a stream is read only up to the end of its header section."""
    if isinstance(body, bytes):
        end = body.find(b"\r\n\r\n")
        return body[:end if end >= 0 else len(body)].isascii()
    carry = b""
    async with body.pieces() as pieces:
        async for piece in pieces:
            data = carry + piece
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                return data[:end].isascii()
            if not data[:-3].isascii():
                return False
            carry = data[-3:]
    return carry.isascii()


async def send_stream(smtp: aiosmtplib.SMTP, body: BodyStream, line_limit: int,
                      ready: bool = False) -> tuple[aiosmtplib.SMTPResponse, bool]:
    """Write the DATA payload of ``body`` (after the 354; ``ready``: as for
    ``wire_payload``), each piece once the connection has sent all but
    ``WRITE_BUFFER_LOW`` octets of the ones before, within ``smtp.timeout`` each
    (SMTPTimeoutError: the peer stopped reading), and read the reply: the reply, and
    whether it came before the end of the data.

    The reply is listened for from the first piece on (aiosmtplib drops what a server
    says while it expects nothing): a server that answers before the end (a 552 for a
    message too big, then a close) is heard, the rest is not sent, and the connection is
    dropped, the final dot never sent; its reply is the answer, even when the writes
    then failed.  Anything else that cuts the data short (a read that fails:
    ``BodyUnreadable``; a timeout; a shutdown) drops the connection before the final dot
    too, and goes up."""
    protocol = smtp.protocol
    # asyncio's and uvloop's transports alike (uvloop's are no ``asyncio.WriteTransport``)
    transport = cast(asyncio.WriteTransport | None, smtp.transport)
    if protocol is None or transport is None:
        raise aiosmtplib.SMTPServerDisconnected("Connection lost")
    reply = asyncio.ensure_future(protocol.read_response(timeout=None))
    encoder = WireEncoder(line_limit, ready=ready)
    try:
        async with body.pieces() as pieces:
            async for piece in pieces:
                if reply.done():
                    break
                out = encoder.feed(piece)
                if out:
                    protocol.write(out)
                    await _sent_down_to(transport, WRITE_BUFFER_LOW, smtp.timeout, reply)
            else:
                if not reply.done():
                    protocol.write(encoder.end())
                    try:
                        return await asyncio.wait_for(reply, smtp.timeout), False
                    except TimeoutError:
                        raise aiosmtplib.SMTPTimeoutError(
                            "Timed out waiting for server response") from None
    except BaseException as e:
        early = _early(reply)
        transport.abort()  # nothing more is sent: no final dot
        smtp.close()
        if early is not None and not isinstance(e, (BodyUnreadable, asyncio.CancelledError)):
            return early, True
        reply.cancel()
        raise
    transport.abort()  # answered before the end: the rest is not sent, nor the final dot
    smtp.close()
    return reply.result(), True  # or the reason it ended without one: the connection lost


def _early(reply: asyncio.Future[aiosmtplib.SMTPResponse]) -> aiosmtplib.SMTPResponse | None:
    """The reply a server gave before the end of the data, if it gave one."""
    if reply.done() and not reply.cancelled() and reply.exception() is None:
        return reply.result()
    return None


async def _sent_down_to(transport: asyncio.WriteTransport, low: int, timeout: float | None,
                        reply: asyncio.Future[aiosmtplib.SMTPResponse]) -> None:
    """Wait until ``transport`` has at most ``low`` octets left to send, or the server
    replied.  The transport's flow control callbacks belong to aiosmtplib's protocol, so
    its buffer is looked at again after a wait that doubles from 1 ms to 50 ms: on a fast
    link it is found empty at once, on a slow one the waits are short beside the time a
    piece takes."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    wait = 0.001
    while transport.get_write_buffer_size() > low and not reply.done():
        if transport.is_closing():
            raise aiosmtplib.SMTPServerDisconnected("Connection lost")
        if deadline is not None and loop.time() >= deadline:
            raise aiosmtplib.SMTPTimeoutError("Timed out sending the message body")
        await asyncio.sleep(wait)
        wait = min(wait * 2, 0.05)
