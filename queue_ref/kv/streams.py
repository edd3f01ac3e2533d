"""Streaming bodies in and out of the KV queue in 64 KiB chunks, in bounded memory."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Mapping, Sequence
from typing import Protocol

from queue_ref.body_digest import BodyDigest
from queue_ref.kv import claims as cl
from queue_ref.kv import keys, kv_records
from queue_ref.kv.base import WriteBatch
from queue_ref.kv.core import BATCH_BYTES, CHUNK, SPILL_AFTER, Core, io_error
from queue_ref.kv.kv_records import EntryRec, MetaRec, Stored
from queue_ref.storage import (
    ClosedError,
    CorruptionError,
    Enqueuer,
    EntryMeta,
    InvalidInputError,
    MailReader,
    QueuedMail,
    Recipient,
    Schedule,
    validate_recipients,
)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

class _Queue(Protocol):
    """What the streams need of their KvQueue (which imports this module)."""

    _core: Core

    def _check_open(self) -> None: ...
    def _out_of_space(self) -> None: ...
    def _issue(self, cls: type[QueuedMail], entry_id: str, message_id: str,
               schedule: Schedule, extra: object = None) -> QueuedMail: ...


class KvEnqueuer(Enqueuer):
    """Writes chunks as they fill, unsynced, in batches of about 1 MiB; from
    ``SPILL_AFTER`` bytes on, each batch is followed by ``KV.spill`` (a big body is not
    held in the engine's memory).

    The message gets its id at the first batch it writes (so small messages are numbered
    in commit order).  ``commit`` writes the last chunks, the ``#`` and ``*`` records, the
    live count and every entry in ONE synced batch: the message appears whole or not at
    all, and the synced batch carries the earlier chunk batches to disk with it (see
    ``queue_ref.kv.core``).  Chunks of an enqueue that never commits are removed by
    ``abort`` or, after a crash, by recovery.
    """

    def __init__(self, queue: _Queue, mail_from: str, params: Mapping[str, str]) -> None:
        self._queue = queue
        self._core: Core = queue._core
        self._mail_from = mail_from
        self._params = dict(params)
        self._mid: int | None = None
        self._seq = 0  # chunks emitted
        self._written = 0  # chunks that reached the engine
        self._pending = bytearray()
        self._batch = WriteBatch()
        self._batch_bytes = 0
        self._hash = BodyDigest()
        self._size = 0
        self._done = False

    def _check(self) -> None:
        if self._done:
            raise ClosedError("this Enqueuer was committed or aborted")
        self._queue._check_open()

    def _id(self) -> int:
        if self._mid is None:
            try:
                self._mid = self._core.new_id()
            except OSError as e:
                if e.errno in _NO_SPACE:
                    self._queue._out_of_space()
                raise io_error("enqueue: reserving message ids", e, None,
                               reopen=self._core.kv.failed is not None) from e
        return self._mid

    @property
    def message_id(self) -> str:
        """The message's id, taken now if it has none yet (see ``Enqueuer.message_id``)."""
        self._check()
        return str(self._id())

    def _emit(self, data: bytes) -> None:
        mid = self._id()
        if self._seq >= keys.MAX_SEQ:
            raise InvalidInputError(f"a body may have at most {keys.MAX_SEQ} chunks")
        self._seq += 1
        self._batch.put(keys.chunk(mid, self._seq), data)
        self._batch_bytes += len(data)
        if self._batch_bytes >= BATCH_BYTES:
            try:
                self._core.write(self._batch, sync=False)
            except OSError as e:
                if e.errno in _NO_SPACE:
                    self._queue._out_of_space()
                raise io_error("enqueue: writing body chunks", e, None,
                               reopen=self._core.kv.failed is not None) from e
            self._written = self._seq
            self._batch = WriteBatch()
            self._batch_bytes = 0
            if self._seq * CHUNK >= SPILL_AFTER:
                # a hint, which fails nothing it follows: a queue closed meanwhile
                # refuses the next write
                with contextlib.suppress(ClosedError):
                    self._core.kv.spill()

    def write(self, data: bytes) -> None:
        """Append body bytes.  On StorageIOError the enqueue must be aborted."""
        self._check()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"body data must be bytes, got {type(data).__name__}")
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._size += len(view)
        off = 0
        if self._pending:
            off = min(len(view), CHUNK - len(self._pending))
            self._pending += view[:off]
            if len(self._pending) < CHUNK:
                return
            self._emit(bytes(self._pending))
            self._pending.clear()
        while len(view) - off >= CHUNK:
            self._emit(bytes(view[off:off + CHUNK]))
            off += CHUNK
        self._pending += view[off:]

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        self._check()
        checked = validate_recipients(rcpts)
        if len(checked) > keys.MAX_RCPTS + 1:
            raise InvalidInputError(f"a message may have at most {keys.MAX_RCPTS + 1} recipients")
        if self._pending:
            self._emit(bytes(self._pending))
            self._pending.clear()
        mid = self._id()
        meta = MetaRec(mid, self._mail_from, self._params, self._size, self._hash.value(),
                       self._seq, self._core.clock(), tuple((r.address, r.zone) for r in checked))
        b = self._batch
        b.put(keys.created(mid), kv_records.created_value(mid, meta.created))
        meta_raw = meta.encode()
        b.put(keys.meta(mid), meta_raw)
        b.put(keys.live(mid), kv_records.live_value(mid, len(checked)))
        stored = []
        for i, r in enumerate(checked):
            ref = Stored.of(EntryRec(mid, i, kv_records.QUEUED, r.address, r.zone, r.schedule))
            stored.append(ref)
            b.put(keys.zone(r.zone, mid, i), ref.raw)
            b.put(keys.domain(keys.domain_of(r.address), mid, i),
                  kv_records.domain_value(mid, i, r.zone))
        self._done = True
        self._batch = WriteBatch()
        try:
            with self._core.claims.hold(shared=[cl.EVERYTHING]):
                self._core.write(b, sync=True)
        except OSError as e:
            # The batch may or may not be on disk: its chunks stay for recovery to judge,
            # unless the engine knows it wrote nothing (a full disk, the log cut back).
            # Then they go now: an open queue must not keep a failed message's body
            # (C8), least of all on a full disk.
            if e.errno in _NO_SPACE:
                self._queue._out_of_space()
            if self._core.kv.left_nothing(e):
                self._drop_chunks(mid)
            raise io_error("enqueue: commit", e, None,
                               reopen=self._core.kv.failed is not None) from e
        finally:
            with self._core.mu:
                self._core.enqueuing.discard(mid)
        self._core.remember_meta(meta_raw, meta)
        q = self._queue
        return [q._issue(QueuedMail, keys.entry_id(mid, i), str(mid), r.schedule, ref)
                for i, (r, ref) in enumerate(zip(checked, stored, strict=True))]

    def abort(self) -> None:
        """Drop the uncommitted message.  Idempotent.

        If deleting the chunks fails (or the queue was closed), they stay until the next
        recovery, which removes chunks of messages that never committed.
        """
        if self._done:
            return
        self._done = True
        self._pending.clear()
        self._batch = WriteBatch()
        mid = self._mid
        if mid is None:
            return
        try:
            self._drop_chunks(mid)
        finally:
            with self._core.mu:
                self._core.enqueuing.discard(mid)

    def _drop_chunks(self, mid: int) -> None:
        """Delete the body chunks written so far (unsynced: a crash leaves them to
        recovery, which removes chunks of messages that never committed)."""
        try:
            b = WriteBatch()
            for seq in range(1, self._written + 1):
                b.delete(keys.chunk(mid, seq))
            self._core.write(b, sync=False)
        except (OSError, ClosedError):
            pass


class KvReader(MailReader):
    """Streams the chunks with ``get`` (one chunk in memory at a time), hashing them.

    The last chunk is handed out only after the whole body matched its size and digest;
    on a mismatch the message is quarantined and CorruptionError raised (every later
    read raises it again).
    """

    def __init__(self, queue: _Queue, meta: EntryMeta, rec: MetaRec) -> None:
        self.meta = meta
        self._queue = queue
        self._core: Core = queue._core
        self._rec = rec
        self._seq = 0
        self._buf = b""
        self._pos = 0
        self._hash = BodyDigest(rec.digest)
        self._got = 0
        self._checked = False
        self._closed = False
        self._error: CorruptionError | None = None

    def _corrupt(self, why: str) -> CorruptionError:
        mid = self._rec.mid
        with self._core.message_exclusive(mid):
            if self._core.kv.get(keys.created(mid)) is None:
                raise ClosedError(f"message {mid} is no longer stored (cleaned up)")
            try:
                self._core.quarantine_message(mid, why)
            except OSError as e:
                raise io_error("read_inflight: quarantine", e, None) from e
        self._error = CorruptionError(f"message {mid}: {why}", self.meta.entry_id,
                                      keys.quarantine(keys.message_prefix(mid)).decode())
        return self._error

    def _finish(self) -> None:
        if self._got != self._rec.size:
            raise self._corrupt(f"body has {self._got} bytes, {self._rec.size} expected")
        if self._hash.value() != self._rec.digest:
            raise self._corrupt("body digest mismatch")
        self._checked = True

    def _load(self) -> bool:
        """Load the next chunk; False at the end (after the final check)."""
        if self._seq >= self._rec.chunks:
            if not self._checked:
                self._finish()
            return False
        self._seq += 1
        mid = self._rec.mid
        try:
            data = self._core.kv.get(keys.chunk(mid, self._seq))
        except OSError as e:
            raise io_error("read_inflight: reading the body", e, None) from e
        if data is None:
            raise self._corrupt(f"body chunk {self._seq} is missing")
        last = self._seq == self._rec.chunks
        if not last and len(data) != CHUNK:
            raise self._corrupt(f"body chunk {self._seq} has {len(data)} bytes")
        self._hash.update(data)
        self._got += len(data)
        if last:
            self._finish()
        self._buf, self._pos = data, 0
        return True

    def read(self, n: int = -1) -> bytes:
        if self._closed:
            raise ClosedError("this MailReader is closed")
        self._queue._check_open()
        if self._error is not None:
            raise self._error
        if n < 0:
            parts: list[bytes] = []
            while True:
                b = self.read(CHUNK)
                if not b:
                    return b"".join(parts)
                parts.append(b)
        while self._pos >= len(self._buf):
            if not self._load():
                return b""
        out = self._buf[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def close(self) -> None:
        self._closed = True
        self._buf = b""
