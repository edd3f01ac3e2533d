"""Command pipelining for the SMTP client (RFC 2920): MAIL and every RCPT of a transaction
in one write, their replies read back in order.

aiosmtplib sends a command and waits for its reply before the next: a message of 100
recipients costs 101 round trips and 101 writes before DATA, where Postfix's smtp sends
the group at once when the server offers PIPELINING.  aiosmtplib's protocol reads one
reply per command it wrote (a second reply arriving before the first is taken is
dropped), so for the group the connection's transport is handed to a collector of its
own (``BaseTransport.set_protocol``), which keeps every byte, and handed back once the
last reply is in: aiosmtplib's protocol then meets the connection exactly as it left it,
with nothing unread.

What holds after a failure: the replies read before it are returned with it, in order,
so a caller knows which commands were answered (a lost connection before the first
reply means the server never took the transaction: a reused connection the server had
closed).  Bytes beyond the replies expected are a protocol error (the connection must
not be used again).
"""

from __future__ import annotations

import asyncio

import aiosmtplib

__all__ = ["PipelineResult", "pipelined_replies"]

#: As aiosmtplib's own limits: a reply line, and all the replies of one group.
MAX_LINE = 8192
MAX_GROUP = 1 << 20


class PipelineResult:
    """The replies read, in command order, and the error that ended the group early."""

    __slots__ = ("error", "replies")

    def __init__(self) -> None:
        self.replies: list[aiosmtplib.SMTPResponse] = []
        self.error: aiosmtplib.SMTPException | None = None


class _Collector(asyncio.Protocol):
    """Keeps what arrives; wakes the reader at each arrival and at the end."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.lost: BaseException | None = None
        self._arrived: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool | None:
        self.lost = aiosmtplib.SMTPServerDisconnected("the server closed the connection")
        self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = aiosmtplib.SMTPServerDisconnected(
            f"connection lost{f': {exc}' if exc else ''}")
        self._wake()

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    async def more(self, timeout: float | None) -> None:
        self._arrived = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see ondemand_probe
                await self._arrived
        except TimeoutError as e:
            raise aiosmtplib.SMTPReadTimeoutError("timed out waiting for the server's "
                                                  "replies") from e
        finally:
            self._arrived = None


def _next_reply(buffer: bytearray) -> aiosmtplib.SMTPResponse | None:
    """Take one whole reply (its lines) off the front of ``buffer``; None if it is not all
    there yet.  Raises SMTPResponseException for a malformed line."""
    offset = 0
    lines: list[bytes] = []
    while True:
        end = buffer.find(b"\n", offset)
        if end < 0:
            if len(buffer) - offset > MAX_LINE:
                raise aiosmtplib.SMTPResponseException(-1, "reply line too long")
            return None
        line = bytes(buffer[offset:end + 1])
        offset = end + 1
        if len(line) > MAX_LINE or not line[:3].isdigit() or line[3:4] not in (
                b" ", b"-", b"\r", b"\n"):
            raise aiosmtplib.SMTPResponseException(
                -1, f"malformed reply line: {line[:80].decode('utf-8', 'replace')!r}")
        lines.append(line[4:].strip(b" \t\r\n"))
        if line[3:4] != b"-":
            del buffer[:offset]
            return aiosmtplib.SMTPResponse(
                int(line[:3]), b"\n".join(lines).decode("utf-8", "surrogateescape"))


async def pipelined_replies(smtp: aiosmtplib.SMTP, commands: bytes, count: int
                            ) -> PipelineResult:
    """Write ``commands`` (``count`` whole command lines) in one write on ``smtp``'s
    connection and read their ``count`` replies, each whole within ``smtp.timeout`` of
    the one before (a server that sends a byte at a time does not stretch it)."""
    result = PipelineResult()
    transport = smtp.transport
    if transport is None or transport.is_closing():
        result.error = aiosmtplib.SMTPServerDisconnected("connection lost")
        return result
    own = transport.get_protocol()
    collector = _Collector()
    transport.set_protocol(collector)
    loop = asyncio.get_running_loop()
    timeout = smtp.timeout

    def deadline() -> float | None:  # each reply within the timeout, as aiosmtplib's
        return None if timeout is None else loop.time() + timeout

    try:
        transport.write(commands)  # type: ignore[attr-defined]
        due = deadline()
        while len(result.replies) < count:
            reply = _next_reply(collector.buffer)
            if reply is not None:
                result.replies.append(reply)
                due = deadline()
                continue
            if collector.lost is not None:
                raise collector.lost
            if len(collector.buffer) > MAX_GROUP:
                raise aiosmtplib.SMTPResponseException(-1, "replies too long")
            await collector.more(None if due is None else max(0.0, due - loop.time()))
        if collector.buffer:
            raise aiosmtplib.SMTPResponseException(
                -1, "the server sent more replies than commands")
    except aiosmtplib.SMTPException as e:
        result.error = e
    except OSError as e:
        result.error = aiosmtplib.SMTPServerDisconnected(str(e))
    finally:
        transport.set_protocol(own)
    if collector.lost is not None and result.error is None:
        result.error = aiosmtplib.SMTPServerDisconnected(str(collector.lost))
    return result
