"""The write-ahead log: appending framed records and replaying them.

A record is one WriteBatch (framing in ``format.py``).  Replay stops at the first record
that is short, fails its CRC or does not parse: a synced write covers every byte before
it, so nothing from that point on was ever acknowledged as durable, and the caller
truncates the log there (a torn tail left by a crash or a failed write).
"""

from __future__ import annotations

from collections.abc import Callable

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


def replay(io: IO, path: str, apply: Callable[[list[Op]], None]) -> tuple[int, int]:
    """Apply every intact record of the log in order; returns ``(valid length, file size)``.

    Reads the file once, in chunks; memory is one chunk or one record.
    """
    fd = io.open_read(path)
    try:
        reader = _Reader(io, fd, io.fsize(fd))
        pos = 0
        while True:
            header = reader.take(pos, HEADER.size)
            if header is None:
                break
            length, _crc = HEADER.unpack(header)
            payload = reader.take(pos + HEADER.size, length)
            if payload is None or not check_record(header, payload):
                break
            ops = decode_batch(payload)
            if ops is None:
                break
            apply(ops)
            pos += HEADER.size + length
        return pos, reader.size
    finally:
        io.close(fd)
