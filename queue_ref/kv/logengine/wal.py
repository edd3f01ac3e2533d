"""The write-ahead log: appending framed records and replaying them.

A record is one WriteBatch (framing in ``format.py``).  When replay meets a record that
is short, fails its CRC or does not parse, it looks for the next intact record after it
(resynchronises).  If there is none, the bad bytes are a torn tail: the last write, cut
short by a crash or a failed write, which no synced write covers, so nothing in it was
acknowledged; the caller truncates the log there.  Unless they are one whole record of
the length its header gives that fails its check: that write reached the disk whole, and
was damaged since (after a crash no clean-close record can tell what it held), so it is
reported as damage like the regions in the middle.  If intact records follow, the bad
bytes are damage in the middle of the log (a flipped bit, a lost block): replay keeps
every intact record after them and reports the bad region, so the caller can say what
was lost and keep the file aside.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from queue_ref.io import IO
from queue_ref.kv.logengine.format import HEADER, Op, check_record, decode_batch

_READ_CHUNK = 1 << 20


class LogWriter:
    """An open log file for appending.  Not thread-safe: the group-commit leader owns it."""

    def __init__(self, io: IO, path: str, fd: int, size: int) -> None:
        self.io = io
        self.path = path
        self.fd = fd
        self.size = size

    @classmethod
    def create(cls, io: IO, path: str) -> LogWriter:
        """A new, empty log (its directory entry is not yet durable)."""
        return cls(io, path, io.open_create(path, append=True), 0)

    def append(self, data: bytes) -> None:
        """Append bytes; on error some prefix of them may be in the file."""
        self.io.write(self.fd, data)
        self.size += len(data)

    def sync(self) -> None:
        self.io.fdatasync(self.fd)

    def close(self) -> None:
        self.io.close(self.fd)


class _Reader:
    """Sequential reads of a file in big chunks through ``pread``."""

    def __init__(self, io: IO, fd: int, size: int) -> None:
        self._io = io
        self._fd = fd
        self.size = size
        self._buf = b""
        self._base = 0

    def take(self, pos: int, n: int) -> bytes | None:
        """Bytes [pos, pos+n), or None if the file ends first."""
        if pos + n > self.size:
            return None
        rel = pos - self._base
        if rel < 0 or rel + n > len(self._buf):
            want = min(max(n, _READ_CHUNK), self.size - pos)
            self._buf = self._io.pread(self._fd, want, pos)
            self._base = pos
            rel = 0
            if len(self._buf) < n:
                return None
        return self._buf[rel : rel + n]


#: Bytes of a damaged region kept in memory for the report (ids are read from them).
SAMPLE_LIMIT = 1 << 20
_COUNT_KIND = struct.Struct("<IB")


@dataclass(frozen=True)
class BadRegion:
    """Bytes ``[start, end)`` of a log that hold no intact record; ``sample`` is (a prefix
    of) them.  ``last``: the log's last record, whole in length but failing its check."""

    start: int
    end: int
    sample: bytes
    last: bool = False


@dataclass
class Replayed:
    """What replay found: the end of the last intact record, the file's size, the damaged
    regions in the middle (the torn tail, if any, is ``[valid, size)``), and the keys the
    intact records after the first damaged region wrote (so a caller can tell a message
    that the damage took from one that later records finished)."""

    valid: int
    size: int
    bad: list[BadRegion] = field(default_factory=list)
    later_keys: set[bytes] = field(default_factory=set)


def _framed(reader: _Reader, pos: int) -> tuple[bytes, int] | None:
    """The header and length of a record at ``pos`` that fits in the file, with a
    plausible count and kind (cheap filters before the CRC); else None."""
    header = reader.take(pos, HEADER.size)
    if header is None:
        return None
    length, _crc = HEADER.unpack(header)
    if pos + HEADER.size + length > reader.size or length < 4:
        return None
    head = reader.take(pos + HEADER.size, min(length, _COUNT_KIND.size))
    if head is None:
        return None
    if length >= _COUNT_KIND.size:
        count, kind = _COUNT_KIND.unpack(head)
        if kind > 1 or count == 0 or count > length // 5:
            return None
    return header, length


def _intact_at(reader: _Reader, pos: int) -> tuple[list[Op], int] | None:
    """The operations of an intact record starting at ``pos`` and its end, or None."""
    framed = _framed(reader, pos)
    if framed is None:
        return None
    header, length = framed
    payload = reader.take(pos + HEADER.size, length)
    if payload is None or not check_record(header, payload):
        return None
    ops = decode_batch(payload)
    if ops is None:
        return None
    return ops, pos + HEADER.size + length


def _whole_length(reader: _Reader, pos: int) -> bool:
    """Whether the bad bytes from ``pos`` to the end are one record of the length its
    header gives, with a plausible count and kind: a write that reached the disk whole and
    then changed (damage at rest), not one a crash cut short.  A power cut that kept the
    length and lost some of the record's blocks looks the same: its message was never
    acknowledged, and naming it is the lesser mistake (silence would be the worse one)."""
    framed = _framed(reader, pos)
    return (framed is not None and framed[1] >= _COUNT_KIND.size
            and pos + HEADER.size + framed[1] == reader.size)


def _resync(reader: _Reader, pos: int) -> int | None:
    """The start of the first intact record after ``pos``, or None (a torn tail)."""
    for q in range(pos + 1, reader.size - HEADER.size + 1):
        if _intact_at(reader, q) is not None:
            return q
    return None


def replay(io: IO, path: str, apply: Callable[[list[Op]], None]) -> Replayed:
    """Apply every intact record of the log in order, resynchronising after damage.

    Reads the file once, in chunks, while it is intact; memory is one chunk or one record
    (a search for the next intact record after damage reads ahead as it goes).
    """
    fd = io.open_read(path)
    try:
        reader = _Reader(io, fd, io.fsize(fd))
        out = Replayed(0, reader.size)
        pos = 0
        while pos < reader.size:
            got = _intact_at(reader, pos)
            if got is None:
                nxt = _resync(reader, pos)
                if nxt is None:
                    if _whole_length(reader, pos):
                        out.bad.append(BadRegion(pos, reader.size, reader.take(
                            pos, min(reader.size - pos, SAMPLE_LIMIT)) or b"", last=True))
                    break  # a torn tail, or a damaged last record
                sample = reader.take(pos, min(nxt - pos, SAMPLE_LIMIT)) or b""
                out.bad.append(BadRegion(pos, nxt, sample))
                pos = nxt
                continue
            ops, end = got
            apply(ops)
            if out.bad:
                out.later_keys.update(k for k, _ in ops)
            pos = end
            out.valid = end
        return out
    finally:
        io.close(fd)
