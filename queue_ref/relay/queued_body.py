"""A delivery's body as the queue gives it: read in a storage thread, whole or a piece at
a time (``QueuedBody``, a ``smtp_wire_body.BodyStream``: bodies over ``STREAMED_BODY``).

Every storage call of a delivery job runs in the relay's storage threads
(``storage_call``), and one that is running when the job is cancelled (a shutdown) is
waited for before the cancellation goes on: no storage call outlives its job, so the
job's entries are put back by a stop only after their last read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TypeVar

from queue_ref.relay.smtp_wire_body import STREAM_PIECE, BodyStream, BodyUnreadable
from queue_ref.storage import InflightMail, MailReader, Storage

__all__ = ["QueuedBody", "read_piece", "storage_call"]

T = TypeVar("T")


async def storage_call(executor: Executor, fn: Callable[..., T], *args: object,
                       undo: Callable[[T], object] | None = None) -> T:
    """``fn(*args)`` in a storage thread; a cancellation waits for it to end first, and
    then ``undo``es what it gave (in a storage thread too: a reader opened is closed)."""
    loop = asyncio.get_running_loop()
    call = loop.run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            got = await call
            if undo is not None:
                await loop.run_in_executor(executor, undo, got)
        raise


def read_piece(reader: MailReader, n: int) -> bytes:
    """Up to ``n`` octets of ``reader``, fewer only at the end (a reader may give fewer a
    call: the KV queue's its chunks)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        b = reader.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class QueuedBody(BodyStream):
    """The body of an entry a delivery job holds inflight, read from the queue as it goes
    out, ``STREAM_PIECE`` octets a storage call.  Whatever the queue raises (damage found:
    ``CorruptionError``, the message quarantined; an I/O error; the queue closed) goes up
    as ``BodyUnreadable`` with it as the cause."""

    def __init__(self, store: Storage, executor: Executor, mail: InflightMail,
                 size: int) -> None:
        self.store = store
        self.executor = executor
        self.mail = mail
        self.size = size
        self._held = 0
        #: read to its end once: the queue checked its digest (no damage to find later)
        self.complete = False

    def held(self) -> int:
        """The piece just read (not what the encoder and the connection hold of it)."""
        return self._held

    @contextlib.asynccontextmanager
    async def pieces(self) -> AsyncIterator[AsyncIterator[bytes]]:
        try:
            reader = await storage_call(self.executor, self.store.read_inflight, self.mail,
                                        undo=MailReader.close)
        except Exception as e:
            raise BodyUnreadable(f"opening the body: {type(e).__name__}: {e}") from e
        try:
            yield self._read(reader)
        finally:
            self._held = 0
            with contextlib.suppress(Exception):
                await storage_call(self.executor, reader.close)

    async def _read(self, reader: MailReader) -> AsyncIterator[bytes]:
        while True:
            try:
                piece = await storage_call(self.executor, read_piece, reader, STREAM_PIECE)
            except Exception as e:
                raise BodyUnreadable(f"reading the body: {type(e).__name__}: {e}") from e
            self._held = len(piece)
            if not piece:
                self.complete = True
                return
            yield piece
