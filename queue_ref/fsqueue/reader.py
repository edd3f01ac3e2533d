"""The MailReader of the filesystem queue: streams a body and verifies it on the way.

The reader knows the committed size and digest (``body_digest``) from the envelope
(which follows the body in the message file, and whose position already proved the
body's size).  It hashes every byte it hands out, and before it hands out the bytes that
reach the end of the body it checks that the hash matches; on a mismatch it quarantines
the message and raises CorruptionError instead, so the last bytes of altered mail are
never delivered.  Memory use is one chunk.

A reader of an inflight entry opens the message file when its body is first read: the
relay reads the metadata of each of a message's entries and the body of one, and a
hundred recipients need not cost a hundred opens.  Its process holds the entry, so the
file is not released meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from queue_ref.body_digest import BodyDigest
from queue_ref.fsqueue.diskutil import storage_error
from queue_ref.io import IO
from queue_ref.storage import ClosedError, CorruptionError, EntryMeta, Handle, MailReader

CHUNK = 1 << 16


class FsMailReader(MailReader):
    def __init__(self, io: IO, fd: int | Callable[[], int], meta: EntryMeta, digest: str,
                 handle: Handle | None, on_corrupt: Callable[[str], CorruptionError],
                 on_close: Callable[[], None]) -> None:
        """``fd``: the message file open, or how to open it when the body is first read
        (raising FileNotFoundError if it is missing: then the entry is corrupt)."""
        self.meta = meta
        self._io = io
        self._open = None if isinstance(fd, int) else fd
        self._fd: int | None = fd if isinstance(fd, int) else -1
        self._expect = digest
        self._handle = handle
        self._on_corrupt = on_corrupt
        self._on_close = on_close
        self._hash = BodyDigest(digest)
        self._pos = 0
        self._verified = False

    def _fail(self, reason: str) -> CorruptionError:
        self.close()
        return self._on_corrupt(reason)

    def _verify_end(self) -> None:
        """At the committed size: the hash must match."""
        if self._hash.value() != self._expect:
            raise self._fail("body digest does not match its envelope")
        self._verified = True

    def _file(self) -> int:
        if self._open is not None:
            try:
                self._fd = self._open()
            except FileNotFoundError:
                raise self._fail("message file is missing") from None
            self._open = None
        assert self._fd is not None
        return self._fd

    def _read_some(self, n: int) -> bytes:
        fd = self._file()
        want = min(n, self.meta.body_size - self._pos)
        parts = []
        got = 0
        while got < want:
            b = self._io.read(fd, min(want - got, 1 << 20))
            if not b:
                raise self._fail(
                    f"body ends at {self._pos + got} of its {self.meta.body_size} bytes")
            parts.append(b)
            got += len(b)
        data = b"".join(parts)
        self._hash.update(data)
        self._pos += len(data)
        if self._pos == self.meta.body_size:
            self._verify_end()
        return data

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` verified bytes (all remaining if -1); b"" at the end.  Raises
        CorruptionError (message quarantined) before returning the final bytes of a body
        that does not match; StorageIOError (carrying the InflightMail) on a disk error."""
        if self._fd is None:
            raise ClosedError("this MailReader is closed")
        try:
            self._file()  # opened (and so found) even when the body is empty
            if self._pos == self.meta.body_size and not self._verified:
                self._verify_end()
            if n == 0 or self._pos == self.meta.body_size:
                return b""
            if n > 0:
                return self._read_some(n)
            parts = []
            while self._pos < self.meta.body_size:
                parts.append(self._read_some(CHUNK))
            return b"".join(parts)
        except OSError as e:
            raise storage_error("reading the body", e, self._handle) from e

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if fd >= 0:
                    self._io.close(fd)
            finally:
                self._on_close()
