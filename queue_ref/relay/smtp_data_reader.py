"""The DATA phase read in bulk, not line by line.

aiosmtpd reads a message one line at a time (``readuntil(b"\\r\\n")`` and a dozen Python
steps per line): about 28 ms of CPU for a 1 MB message of 70-byte lines, more than
Postfix's smtpd spends on the whole message.  ``read_data`` reads with the stream's own
``readuntil`` on the start of a line that begins with a dot, ``CRLF .``, in pieces of up
to ``PIECE`` bytes, so the bytes are searched in C: each such line is either the end of
data, ``CRLF . CRLF`` (4.1.1.4), or a line whose dot-stuffing (RFC 5321 4.5.2) is undone
at the end with one ``bytes.replace``.  So most mail, with no dot line, is searched once
(it once was searched for the end of data, then again for dot lines: 0.5 ms per MB more),
and the receiver is told that it needs no stuffing when it goes out again.  Nothing past
the end of data is read: a pipelining client's next command stays in the stream.

``readuntil`` cannot see an end of data whose first bytes were already taken: at the
start (the data's start counts as a line start, as if after CRLF), or after a piece that
ended in part of it.  The reader keeps the stream's last five bytes and how much of the
terminator they end with: after CRLF it takes the three bytes that decide (at the least
the ``. CRLF`` of the end is always coming), after a CR it reads in bulk up to ``LF .``,
otherwise up to ``CRLF .``.  A piece cut at PIECE bytes never ends inside a terminator
that is already in the buffer, so prose, blank lines and runs of CRs are all read in a
few calls per MiB; only lines of two or three bytes each cost a call per line, as every
line does in aiosmtpd, and each dot line a call.  Every dot line shows in those steps:
the stream came to end with ``CRLF .`` (a piece ended there) or, after CRLF, the next
piece began with a dot, and the end of data did not follow.

The reply is decided only after the end of data (4.2.5) and is aiosmtpd's, line by line:
a line longer than ``line_limit`` bytes with its CRLF is ``500``, unless the lines before
it passed ``size_limit`` (then ``552``), or it is at most two bytes over and itself
passes the size limit (aiosmtpd counts such a line's bytes before its length); a line
that passes the size limit is ``552``.  Data after either verdict is dropped as it
arrives, so memory stays bounded.  With ``line_limit=None`` (the relay: Postfix's smtpd
takes lines of any length, and its smtp client folds them, see
``smtp_delivery.fold_long_lines``) only the size counts: ``552`` once the data passes
``size_limit``, however long its lines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

TERMINATOR = b"\r\n.\r\n"
#: The most a single ``readuntil`` may hold before its bytes are taken as they are.
PIECE = 1 << 20

LINE_TOO_LONG = "500 Line too long (see RFC5321 4.5.3.1.6)"
TOO_MUCH = "552 Error: Too much mail data"


@dataclass
class DataRead:
    """The message (dot-stuffing undone), or the error reply owed after the terminator.
    ``dot_lines``: whether a line of the data began with ``.`` (a line of ``content``
    then may; if not, ``content`` needs no dot-stuffing to go out again)."""

    content: bytes
    error: str | None = None
    dot_lines: bool = False


class _Verdict:
    """aiosmtpd's verdict on the data so far, fed piece by piece: its lines' lengths and
    the running size, judged line by line only where a line is long or the size passes
    the limit (elsewhere a ``split`` and a ``max`` in C)."""

    def __init__(self, size_limit: int | None, line_limit: int | None) -> None:
        self.size_limit = size_limit
        self.line_limit = line_limit
        self.tail = b""  # the line not yet ended
        self.seen = 0  # data bytes before ``tail``
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        if self.error is not None or not data:
            return
        if self.line_limit is None:  # no line limit: the size alone, no line kept
            self.seen += len(data)
            if self.size_limit and self.seen > self.size_limit:
                self.error = TOO_MUCH
            return
        buf = self.tail + data
        lines = buf.split(b"\r\n")
        ended, tail = lines[:-1], lines[-1]
        end = self.seen + len(buf) - len(tail)  # where the last ended line ends
        over = bool(self.size_limit) and end > (self.size_limit or 0)
        if ended and (over or max(map(len, ended)) + 2 > self.line_limit):
            start = self.seen
            for line in ended:
                self.error = self._line(start, len(line) + 2)
                if self.error is not None:
                    return
                start += len(line) + 2
        self.seen, self.tail = end, tail
        # long whatever ends it (a CR at its end may be its CRLF's): aiosmtpd overran
        if len(tail) - tail.endswith(b"\r") > self.line_limit:
            self.error = self._line(self.seen, len(tail) + 2)
            self.tail = b""

    def _line(self, start: int, length: int) -> str | None:
        """aiosmtpd's verdict on a line of ``length`` bytes (CRLF included) at ``start``."""
        assert self.line_limit is not None
        limit = self.size_limit
        if limit and start > limit:
            return TOO_MUCH
        if length > self.line_limit + 2:  # aiosmtpd's read overruns: 500 at once
            return LINE_TOO_LONG
        if limit and start + length > limit:
            return TOO_MUCH
        return LINE_TOO_LONG if length > self.line_limit else None


def _state(last: bytes) -> int:
    """How much of TERMINATOR the stream ends with, from its last five bytes."""
    for k in range(len(TERMINATOR), 0, -1):
        if last.endswith(TERMINATOR[:k]):
            return k
    return 0


async def _piece(reader: asyncio.StreamReader, state: int, dots: bool) -> bytes:
    """The next bytes to take, given that the stream so far ends with ``state`` bytes of
    the terminator.  In bulk where that cannot hide the end of data: up to the next line
    that starts with a dot, ``CRLF .`` (nothing of it pending), or up to ``LF .`` (a CR
    pending: runs of CRs stay in bulk), or once a dot line was seen (``dots``: there is
    nothing more to learn) up to the whole terminator, so that dot lines cost nothing
    each (a 10 MB message of ``.a`` lines took 10 s of the event loop); else the few
    bytes that decide (after CRLF, three are always coming: at the least the ``. CRLF``
    of the end)."""
    if state > 1:
        return await reader.readexactly(len(TERMINATOR) - state)
    try:
        return await reader.readuntil(TERMINATOR[state:] if dots else TERMINATOR[state:3])
    except asyncio.LimitOverrunError as e:
        # no separator starts in these bytes (readuntil would have found it)
        return await reader.readexactly(e.consumed)


#: A piece of DATA this long is kept as it came (joined once at the end: appending a MB
#: to a buffer and making ``bytes`` of the buffer copied it twice); shorter ones are
#: gathered in a buffer, so that a body of short lines is not an object per line.
_KEPT_WHOLE = 64 * 1024


def _joined(pieces: list[bytes | bytearray], cut: int) -> bytes:
    """The pieces as one ``bytes``, less their last ``cut`` octets."""
    tail: list[bytes | bytearray | memoryview] = []
    while cut and pieces:
        last = pieces.pop()
        if len(last) > cut:
            tail.append(memoryview(last)[:len(last) - cut])
            cut = 0
        else:
            cut -= len(last)
    return b"".join([*pieces, *tail])


async def read_data(reader: asyncio.StreamReader, size_limit: int | None,
                    line_limit: int | None) -> DataRead:
    """Read one message's data from ``reader``, after the 354 reply, up to and including
    its terminator (``line_limit`` None: lines of any length).
    ``asyncio.IncompleteReadError`` if the stream ends first."""
    #: the data so far (nothing once the reply is an error): big pieces as they came,
    #: small ones gathered in a buffer (a body of short lines comes a few octets a piece)
    kept: list[bytes | bytearray] = []
    verdict = _Verdict(size_limit, line_limit)
    last = b"\r\n"  # the stream's last bytes: the data starts a line, as if after CRLF
    state = 2
    saved = reader._limit  # type: ignore[attr-defined]
    reader._limit = PIECE + len(TERMINATOR)  # type: ignore[attr-defined]
    dots = False  # a line of the data began with a dot (see the module docstring)
    held = b""  # the stream's last bytes after a CRLF, not yet fed to the verdict
    try:
        while state < len(TERMINATOR):
            before = state
            piece = await _piece(reader, state, dots)
            last = (last + piece[-5:])[-5:]
            state = _state(last)
            done = state == len(TERMINATOR)
            if not done and (before > 2 or (before == 2 and piece.startswith(b"."))):
                dots = True
            # the terminator's ". CRLF" is not data; its CRLF ends the last line.  What
            # follows a CRLF the stream ends with (a dot, a dot and CR) is judged with
            # the next piece, which tells whether it is the end: then the bytes held and
            # that piece hold its ". CRLF" (the piece ended with the CRLF before it)
            fed = held + piece if held else piece
            held = fed[len(fed) - (state - 2):] if state > 2 and not done else b""
            verdict.feed(fed[:-3] if done else fed[:len(fed) - len(held)])
            if verdict.error is None:
                if len(piece) >= _KEPT_WHOLE:
                    kept.append(piece)
                elif kept and isinstance(kept[-1], bytearray):
                    kept[-1] += piece
                else:
                    kept.append(bytearray(piece))
            elif kept:
                kept.clear()
    finally:
        reader._limit = saved  # type: ignore[attr-defined]
    if verdict.error is not None:
        return DataRead(b"", verdict.error)
    data = _joined(kept, len(TERMINATOR) - 2)  # without the ". CRLF"
    if not dots:  # most mail: no line to undo, nothing more to look for
        return DataRead(data)
    stuffed = data.count(b"\r\n.")
    if stuffed:
        data = data.replace(b"\r\n.", b"\r\n")
    if data.startswith(b"."):
        return DataRead(data[1:], dot_lines=True)
    return DataRead(data, dot_lines=bool(stuffed))


__all__ = ["LINE_TOO_LONG", "PIECE", "TERMINATOR", "TOO_MUCH", "DataRead", "read_data"]
