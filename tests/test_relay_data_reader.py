"""The bulk DATA reader against aiosmtpd's line-by-line one: the same message, the same
error reply, the same bytes left for the next command, however the bytes arrive."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from aiosmtpd.smtp import SMTP
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_ref.relay.smtp_data_reader import (
    LINE_TOO_LONG,
    PIECE,
    TERMINATOR,
    TOO_MUCH,
    DataRead,
    read_data,
)

LINE_LIMIT = SMTP.line_length_limit  # 1001


def _reference(wire: bytes, size_limit: int | None) -> tuple[DataRead, bytes]:
    """aiosmtpd 1.4's smtp_DATA, line by line (RFC 5321 4.5.2 and 4.2.5): the data, and
    the rest.  A line whose content passes the stream limit (1001 bytes) overruns its
    read and is 500 at once; a shorter one is counted first (552 past the size limit),
    then judged by its length with its CRLF (500 past 1001).  ``dot_lines``: a line
    began with a dot (before its dot was removed)."""
    pos, size, lines, error, dots = 0, 0, [], None, False
    while True:
        end = wire.index(b"\r\n", pos) + 2
        line = wire[pos:end]
        pos = end
        if line == b".\r\n":
            break
        if error is None and len(line) - 2 > LINE_LIMIT:
            error = LINE_TOO_LONG
        size += len(line)
        if error is None and size_limit and size > size_limit:
            error = TOO_MUCH
        if error is None and len(line) > LINE_LIMIT:
            error = LINE_TOO_LONG
        dots = dots or line.startswith(b".")
        lines.append(line[1:] if line.startswith(b".") else line)
    got = DataRead(b"", error) if error else DataRead(b"".join(lines), dot_lines=dots)
    return got, wire[pos:]


async def _read(wire: bytes, cuts: list[int], size_limit: int | None
                ) -> tuple[DataRead, bytes]:
    """Feed ``wire`` to a StreamReader in the pieces ``cuts`` makes, read the data, then
    whatever is left."""
    reader = asyncio.StreamReader(limit=LINE_LIMIT)

    async def feed() -> None:
        last = 0
        for c in [*sorted(cuts), len(wire)]:
            reader.feed_data(wire[last:c])
            last = c
            await asyncio.sleep(0)
        reader.feed_eof()

    feeder = asyncio.ensure_future(feed())
    got = await read_data(reader, size_limit, LINE_LIMIT)
    await feeder
    assert reader._limit == LINE_LIMIT  # type: ignore[attr-defined]  # restored
    return got, await reader.read()


def _same(wire: bytes, cuts: list[int], size_limit: int | None = None) -> DataRead:
    got = asyncio.run(_read(wire, cuts, size_limit))
    assert got == _reference(wire, size_limit)
    return got[0]


def test_a_body_of_short_lines_costs_a_few_times_its_size_in_memory() -> None:
    """Three octets a line come three at a piece (the reader looks for a dot after each
    CRLF): kept a piece an object, 600 KB of them took 27 MB (45 times); gathered, 2.6 MB
    (the stream's buffer, the data kept and the message made of it among them)."""
    import tracemalloc

    wire = b"a\r\n" * 200_000 + b".\r\n"
    tracemalloc.start()
    try:
        got, _ = asyncio.run(_read(wire, [], None))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.content == wire[:-3]
    assert peak < 8 * len(wire), peak


def test_a_one_dot_message_and_an_empty_one() -> None:
    assert _same(b".\r\nQUIT\r\n", []) == DataRead(b"")
    assert _same(b"a\r\n.\r\nQUIT\r\n", [1, 2, 3, 4]) == DataRead(b"a\r\n")
    assert _same(b"\r\n.\r\n", [1]) == DataRead(b"\r\n")


def test_dot_stuffing_is_undone_once_per_line() -> None:
    wire = b"..\r\n...x\r\n.y\r\nz.\r\n. \r\n.\r\nMAIL FROM:<a@b.c>\r\n"
    assert _same(wire, []) == DataRead(b".\r\n..x\r\ny\r\nz.\r\n \r\n", dot_lines=True)


def test_the_reader_tells_whether_a_line_began_with_a_dot() -> None:
    """Only a dot at a line's start counts (the data's start is one): a dot after a bare
    CR or LF, or inside a line, is not dot-stuffing."""
    for wire, dots in ((b"a\r\nb.\r\n", False), (b"a\r.b\r\n", False), (b"a\n.b\r\n", False),
                       (b"", False), (b".a\r\n", True), (b"..\r\n", True),
                       (b"a\r\n..b\r\n", True)):
        for cut in range(len(wire) + 3):
            got = _same(wire + b".\r\nQUIT\r\n", [cut])
            assert got.dot_lines is dots, (wire, cut)


def test_every_split_of_a_terminator_is_found() -> None:
    wire = b"Subject: x\r\n\r\n.. \r\nend\r\n.\r\nRSET\r\n"
    for a in range(len(wire)):
        for b in range(a, len(wire)):
            _same(wire, [a, b])


def test_a_large_message_in_pieces_of_every_size() -> None:
    body = b"".join(b"line %06d of a large message, some text to fill it.\r\n" % i
                    for i in range(40_000))  # 2.3 MB: several of the reader's pieces
    wire = body + b".\r\nQUIT\r\n"
    rng = random.Random(5)
    for n in (1, 7, 300):
        assert _same(wire, [rng.randrange(len(wire)) for _ in range(n)]).content == body
    assert len(body) > 2 * PIECE


@pytest.mark.parametrize("limit", [100, 2000, PIECE + 10])
def test_too_much_data_is_552_after_the_terminator(limit: int) -> None:
    body = b"x" * 50 + b"\r\n"
    wire = body * (limit // 52 + 3) + b".\r\nQUIT\r\n"
    assert _same(wire, [7, 500], limit).error == TOO_MUCH
    exact = body * 2  # 104 bytes: at the limit is fine, one more is not
    assert _same(exact + b".\r\n", [], len(exact)) == DataRead(exact)
    assert _same(exact + b".\r\n", [], len(exact) - 1).error == TOO_MUCH


def test_a_long_line_is_500_and_the_stream_stays_in_step() -> None:
    long = b"y" * 5000 + b"\r\n"
    assert _same(b"ok\r\n" + long + b"ok\r\n.\r\nNOOP\r\n", [3, 2000]).error == LINE_TOO_LONG
    edge = b"z" * (LINE_LIMIT - 2) + b"\r\n"  # exactly the limit with its CRLF
    assert _same(edge + b".\r\n", [LINE_LIMIT - 1]) == DataRead(edge)
    assert _same(b"z" + edge + b".\r\n", [LINE_LIMIT]).error == LINE_TOO_LONG
    # the limit passed before the long line: 552, as aiosmtpd answers
    assert _same(b"a\r\n" * 40 + long + b".\r\n", [], 100).error == TOO_MUCH
    assert _same(long + b"a\r\n" * 40 + b".\r\n", [], 100).error == LINE_TOO_LONG


def test_without_a_line_limit_only_the_size_counts() -> None:
    """The relay's reading (Postfix's smtpd takes lines of any length): a 5000-octet line
    is data, a line with no end is bounded by the size limit, and the next command stays
    in the stream however the bytes arrive."""

    async def read(wire: bytes, cuts: list[int], size_limit: int) -> tuple[DataRead, bytes]:
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        last = 0
        for c in [*sorted(cuts), len(wire)]:
            reader.feed_data(wire[last:c])
            last = c
        reader.feed_eof()
        return await read_data(reader, size_limit, None), await reader.read()

    long = b"." + b"y" * 5000 + b"\r\n"  # dot-stuffed: its data starts "y"
    wire = b"ok\r\n" + long + b"ok\r\n.\r\nNOOP\r\n"
    for cuts in ([], [3, 2000], [len(wire) - 8]):
        got, rest = asyncio.run(read(wire, cuts, 10_000))
        assert got == DataRead(b"ok\r\n" + long[1:] + b"ok\r\n", dot_lines=True)
        assert rest == b"NOOP\r\n"
    size = len(b"ok\r\n" + long + b"ok\r\n")  # as aiosmtpd counts: stuffing dots included
    assert asyncio.run(read(wire, [], size))[0] == got  # at the limit
    assert asyncio.run(read(wire, [], size - 1))[0].error == TOO_MUCH
    # 3 MB without a line end: 552, and nothing of it kept past the limit
    endless = b"z" * (3 * PIECE) + b"\r\n.\r\nQUIT\r\n"
    got, rest = asyncio.run(read(endless, [PIECE // 3], 100_000))
    assert got == DataRead(b"", TOO_MUCH) and rest == b"QUIT\r\n"


def test_a_line_just_over_the_limit_that_passes_the_size_limit_is_552() -> None:
    """aiosmtpd counts a line of 1002 or 1003 bytes before it judges its length (its read
    does not overrun), so such a line that passes the size limit is 552, not 500."""
    head = b"a\r\n" * 30  # 90 bytes
    for n in (1000, 1001):
        assert _same(head + b"y" * n + b"\r\n.\r\n", [], 100).error == TOO_MUCH
    assert _same(head + b"y" * 1002 + b"\r\n.\r\n", [], 100).error == LINE_TOO_LONG


def test_the_verdict_does_not_depend_on_where_the_stream_is_cut() -> None:
    short = b"x" * 60 + b"\r\n"
    wire = short * ((PIECE - 10) // len(short)) + b"y" * 5000 + b"\r\n.\r\nQUIT\r\n"
    limit = PIECE + 100
    start = len(short) * ((PIECE - 10) // len(short))
    for cut in (start + 10, start + 600, start + 1003, start + 4000):
        assert _same(wire, [cut], limit).error == LINE_TOO_LONG


def test_lines_that_look_like_the_end_cost_no_more_than_aiosmtpd() -> None:
    """Carriage returns, blank lines and lines ending in a dot are each read in bulk or
    one readuntil per line, never byte by byte."""
    for wire in (b"\r" * 300_000 + b"\r\n.\r\n", b"\r\n" * 150_000 + b".\r\n",
                 b"a.\r\n" * 75_000 + b".\r\n"):
        started = time.process_time()
        _same(wire, [])
        assert time.process_time() - started < 2.0


def test_prose_is_read_in_a_few_pieces() -> None:
    """Lines that end in a full stop, blank lines and runs of CRs are read in bulk: a few
    calls per MiB, not one per line."""
    calls = 0

    class Counting(asyncio.StreamReader):
        async def readuntil(self, separator: bytes = b"\n") -> bytes:
            nonlocal calls
            calls += 1
            return await super().readuntil(separator)

        async def readexactly(self, n: int) -> bytes:
            nonlocal calls
            calls += 1
            return await super().readexactly(n)

    prose = b"".join(b"Sentence %06d ends here.\r\n\r\n" % i for i in range(30_000))
    crs = (b"\r" * 900 + b"\r\n") * 200  # lines of CRs, each within the line limit
    dots = b".a\r\n" * 250_000  # 1 MB of dot lines: once one is seen, the end is looked for
    for wire in (prose, b"\r\n" + prose, crs + prose, dots, prose + dots):
        calls = 0

        async def main(wire: bytes = wire) -> DataRead:
            reader = Counting(limit=LINE_LIMIT)
            reader.feed_data(wire + b".\r\nQUIT\r\n")
            reader.feed_eof()
            got = await read_data(reader, None, LINE_LIMIT)
            assert await reader.read() == b"QUIT\r\n"
            return got

        assert asyncio.run(main()).content == wire.replace(b"\r\n.", b"\r\n").lstrip(b".")
        assert calls <= 12, (len(wire), calls)


lines = st.lists(st.sampled_from([b"", b".", b"..", b"a", b".a", b"\r", b"\n", b"\r.",
                                  b"x" * 1200, b". ", b"\r\n."]), max_size=12)


@settings(deadline=None)
@given(lines, st.lists(st.integers(0, 20_000), max_size=6), st.sampled_from([None, 30, 2000]))
def test_any_data_reads_as_aiosmtpd_reads_it(parts: list[bytes], cuts: list[int],
                                             size_limit: int | None) -> None:
    wire = b"".join(p + b"\r\n" for p in parts) + TERMINATOR[2:] + b"QUIT\r\n"
    _same(wire, [c % (len(wire) + 1) for c in cuts], size_limit)


def test_aiosmtpd_reads_those_messages_the_same_way() -> None:
    """The reference above is aiosmtpd's behaviour: one real aiosmtpd server, fed the
    tricky messages, gives what it says."""
    got: list[bytes] = []

    class Keep:
        async def handle_DATA(self, server: SMTP, session: object, envelope: object) -> str:
            got.append(envelope.original_content)  # type: ignore[attr-defined]
            return "250 kept"

    async def main() -> list[bytes]:
        server = await asyncio.get_running_loop().create_server(
            lambda: SMTP(Keep(), data_size_limit=3000), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        wires = [b".\r\n", b"..\r\n...x\r\n.y\r\n.\r\n", b"a\r\n" * 40 + b"y" * 5000 + b"\r\n.\r\n",
                 b"a\r\n" * 700 + b"y" * 1000 + b"\r\n.\r\n"]  # 1002 bytes past 3,000
        replies = []
        wires_sent.extend(wires)
        for w in wires:
            r, wr = await asyncio.open_connection("127.0.0.1", port)
            await r.readline()
            wr.write(b"HELO x\r\nMAIL FROM:<a@b.c>\r\nRCPT TO:<d@e.f>\r\nDATA\r\n" + w)
            await wr.drain()
            for _ in range(4):
                await r.readline()
            replies.append(await r.readline())
            wr.close()
        server.close()
        await server.wait_closed()
        return replies

    wires_sent: list[bytes] = []
    replies = asyncio.run(main())
    assert got == [b"", b".\r\n..x\r\ny\r\n"]
    assert replies[2].startswith(b"500 Line too long")
    assert replies[3].startswith(b"552")  # counted before its length is judged
    for wire, reply in zip(wires_sent, replies, strict=True):
        ours = _reference(wire + b"QUIT\r\n", 3000)[0]
        assert reply.startswith(ours.error.split()[0].encode() if ours.error else b"250")


@pytest.mark.parametrize("size_limit", [None, 3000])
def test_lines_about_the_limit_cut_at_every_byte_near_their_end(size_limit: int | None) -> None:
    """Lines of LINE_LIMIT - 3 to LINE_LIMIT + 4 bytes (CRLF not counted), each cut at
    every one of its last bytes and its CRLF: a line whose bytes so far already overrun
    the limit is judged by its length then (CRLF included), as aiosmtpd judges it."""
    for n in range(LINE_LIMIT - 3, LINE_LIMIT + 5):
        line = b"q" * n + b"\r\n"
        wire = b"ok\r\n" + line + b"end\r\n.\r\nNOOP\r\n"
        for cut in range(3 + n - 3, 3 + n + 4):
            _same(wire, [cut], size_limit)


@pytest.mark.parametrize("n", range(LINE_LIMIT - 3, LINE_LIMIT + 5))
def test_a_last_line_about_the_limit_ending_a_piece(n: int) -> None:
    """More than a piece of data arrives at once, so the reader takes it up to the
    terminator's CRLF: the last line, ``n`` bytes, is then a piece's unended tail, judged
    by its length with the CRLF still to come, as aiosmtpd judges the whole line."""
    filler = b"f" * 98 + b"\r\n"
    last = b"q" * n + b"\r\n"
    wire = filler * (PIECE // len(filler) + 1) + last + b".\r\nNOOP\r\n"
    got = _same(wire, [])
    assert (got.error == LINE_TOO_LONG) is (n + 2 > LINE_LIMIT)
