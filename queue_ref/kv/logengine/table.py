"""Immutable sorted tables: a streaming writer and a reader that loads only the index.

Layout (little endian)::

    data blocks   each: entries, then u32 crc32(entries)
                  entry: u32 key length | u32 value length (0xFFFFFFFF: tombstone) | key | value
    index         u32 first-key length | first key | u32 block count |
                  per block: u32 last-key length | last key | u64 offset | u32 length (crc included)
    footer        8-byte magic | u64 index offset | u32 index length | u32 index crc32 |
                  u64 entries | u64 tombstones | u32 crc32(the fields before it)

A block closes once it holds ``BLOCK_TARGET`` bytes, so a big value makes a block of its
own.  The reader keeps the index in memory (one key per block) and reads blocks with
``pread``; a table is never loaded whole.  An engine's tables share one ``FdCache``,
which keeps at most a fixed number of their files open, whatever the store's size.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from queue_ref.io import IO
from queue_ref.kv.engine_errors import DatabaseCorruptError
from queue_ref.kv.logengine.format import Op
from queue_ref.storage import ClosedError

BLOCK_TARGET = 16 * 1024
_WRITE_CHUNK = 256 * 1024
_TOMBSTONE = 0xFFFFFFFF
_ENTRY = struct.Struct("<II")
_U32 = struct.Struct("<I")
_BLOCK_REF = struct.Struct("<QI")
_MAGIC = b"QRTBL001"
_FOOTER_FIELDS = struct.Struct("<8sQIIQQ")
FOOTER_SIZE = _FOOTER_FIELDS.size + 4


class TableWriter:
    """Writes entries given in strictly ascending key order to an open, empty file."""

    def __init__(self, io: IO, fd: int) -> None:
        self._io = io
        self._fd = fd
        self._out: list[bytes] = []
        self._out_len = 0
        self._offset = 0
        self._block: list[bytes] = []
        self._block_len = 0
        self._last: bytes | None = None
        self._first: bytes | None = None
        self._index: list[tuple[bytes, int, int]] = []
        self.entries = 0
        self.tombstones = 0

    def add(self, key: bytes, value: bytes | None) -> None:
        if self._last is not None and key <= self._last:
            raise ValueError("table keys must be strictly ascending")
        if self._first is None:
            self._first = key
        self._last = key
        if value is None:
            self._block.append(_ENTRY.pack(len(key), _TOMBSTONE) + key)
            self._block_len += 8 + len(key)
            self.tombstones += 1
        else:
            self._block.append(_ENTRY.pack(len(key), len(value)) + key)
            self._block.append(value)
            self._block_len += 8 + len(key) + len(value)
        self.entries += 1
        if self._block_len >= BLOCK_TARGET:
            self._end_block()

    @property
    def size(self) -> int:
        """The bytes of entries added so far (written or pending), index not counted."""
        return self._offset + self._block_len

    def _end_block(self) -> None:
        if not self._block:
            return
        data = b"".join(self._block)
        assert self._last is not None
        self._index.append((self._last, self._offset, len(data) + 4))
        self._emit(data + _U32.pack(zlib.crc32(data)))
        self._block = []
        self._block_len = 0

    def _emit(self, data: bytes) -> None:
        self._out.append(data)
        self._out_len += len(data)
        self._offset += len(data)
        if self._out_len >= _WRITE_CHUNK:
            self._drain()

    def _drain(self) -> None:
        if self._out:
            self._io.write(self._fd, b"".join(self._out))
        self._out = []
        self._out_len = 0

    def finish(self) -> int:
        """Write the index and footer; returns the file size.  The caller fsyncs."""
        self._end_block()
        first = self._first or b""
        parts = [_U32.pack(len(first)), first, _U32.pack(len(self._index))]
        for last, off, length in self._index:
            parts += [_U32.pack(len(last)), last, _BLOCK_REF.pack(off, length)]
        index = b"".join(parts)
        index_off = self._offset
        self._emit(index)
        fields = _FOOTER_FIELDS.pack(
            _MAGIC, index_off, len(index), zlib.crc32(index), self.entries, self.tombstones
        )
        self._emit(fields + _U32.pack(zlib.crc32(fields)))
        self._drain()
        return self._offset


def _parse_block(path: str, data: bytes) -> tuple[list[bytes], list[bytes | None]]:
    keys: list[bytes] = []
    values: list[bytes | None] = []
    pos = 0
    end = len(data)
    try:
        while pos < end:
            klen, vlen = _ENTRY.unpack_from(data, pos)
            pos += 8
            keys.append(data[pos : pos + klen])
            pos += klen
            if vlen == _TOMBSTONE:
                values.append(None)
            else:
                values.append(data[pos : pos + vlen])
                pos += vlen
    except struct.error as e:
        raise DatabaseCorruptError(path, "malformed block") from e
    if pos != end:
        raise DatabaseCorruptError(path, "malformed block")
    return keys, values


class FdCache:
    """The open files of an engine's tables: at most ``cap`` at once, the least recently
    read closed first.  A table whose file was closed opens it again by its path at its
    next read; its file is never removed while the table is referenced (the engine's
    ``Table.retire``), so the path names the same file.  A file in use by a read under
    way is not closed under it (so reads under way on ``cap`` files at once may take the
    count past ``cap`` for their duration).  Before, each table held its file open for the
    engine's life: a store of 8 GiB in pieces of 8 MiB needed 1,024 descriptors, and past
    the soft limit (``EMFILE``) every flush failed and the store could not be opened."""

    def __init__(self, io: IO, cap: int) -> None:
        self.io = io
        self.cap = cap
        self._lock = threading.Lock()
        #: table -> [fd, reads under way], least recently used first.
        self._open: OrderedDict[Table, list[int]] = OrderedDict()
        self._shut = False
        #: Files opened again after their descriptor was closed (for tests and figures).
        self.reopened = 0

    def __len__(self) -> int:
        return len(self._open)

    def adopt(self, table: Table, fd: int) -> None:
        """Take ``fd``, open on ``table``'s file, as the most recently used."""
        with self._lock:
            self._open[table] = [fd, 0]
            self._trim(0)

    def take(self, table: Table) -> int:
        """The descriptor of ``table``'s file, opened again if it was closed; held open
        until ``give``."""
        with self._lock:
            entry = self._open.get(table)
            if entry is None:
                if not table.held:
                    raise RuntimeError(f"table {table.path} used after release")
                if self._shut:
                    raise ClosedError(f"table {table.path}: its engine is closed")
                self._trim(1)
                try:
                    fd = self.io.open_read(table.path)
                except OSError as e:
                    if e.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    self._trim(self.cap)  # others use descriptors too: give back ours
                    fd = self.io.open_read(table.path)
                self.reopened += 1
                entry = self._open[table] = [fd, 0]
            else:
                self._open.move_to_end(table)
            entry[1] += 1
            return entry[0]

    def give(self, table: Table) -> None:
        """The read ``take`` was for is done."""
        with self._lock:
            entry = self._open.get(table)
            if entry is not None:
                entry[1] -= 1

    def drop(self, table: Table) -> None:
        """Close ``table``'s file for good (its last reference went)."""
        with self._lock:
            entry = self._open.pop(table, None)
        if entry is not None:
            self.io.close(entry[0])

    def shut(self) -> None:
        """The engine closed: files closed from now on are not opened again."""
        with self._lock:
            self._shut = True

    def _trim(self, room: int) -> None:
        """Close the least recently used idle files until ``room`` more fit under the
        cap (the caller holds ``_lock``)."""
        excess = len(self._open) + room - self.cap
        if excess <= 0:
            return
        for table, (fd, reads) in list(self._open.items()):
            if excess <= 0:
                break
            if reads:
                continue
            del self._open[table]
            self.io.close(fd)
            excess -= 1


class Table:
    """An open table: its index in memory, its blocks read on demand.

    Reference counted: the engine's current table list holds one reference and every
    running read or iteration holds one; the file closes with the last one.  With
    ``fds``, the file is opened through that cache (``fd`` is handed to it once the
    index is read), which may close it meanwhile and open it again; a table leaving the
    engine's list then keeps its file until its last reference goes (``retire``).
    Without, ``fd`` stays open until the last reference goes (the file may already be
    unlinked by then, as POSIX allows).

    ``run``: tables of one run are the pieces of one table written (``engine.py``); the
    engine sets it (a table of its own by default).
    """

    def __init__(self, io: IO, path: str, number: int, fd: int,
                 fds: FdCache | None = None) -> None:
        self.io = io
        self.path = path
        self.number = number
        self.run = number
        self._fd = fd
        self._fds: FdCache | None = None  # the index is read through ``fd``
        self._refs = 1
        self._unlink = False
        self._lock = threading.Lock()
        self.size = io.fsize(fd)
        if self.size < FOOTER_SIZE:
            raise DatabaseCorruptError(path, "table shorter than its footer")
        fields = self._footer_fields()
        magic, index_off, index_len, index_crc, entries, tombstones = _FOOTER_FIELDS.unpack(fields)
        if magic != _MAGIC or index_off + index_len != self.size - FOOTER_SIZE:
            raise DatabaseCorruptError(path, "bad footer")
        self.entries: int = entries
        self.tombstones: int = tombstones
        index = self._read(index_off, index_len)
        if zlib.crc32(index) != index_crc:
            raise DatabaseCorruptError(path, "index checksum mismatch")
        self.first_key, self.last_keys, self._blocks = self._parse_index(index)
        if fds is not None:
            fds.adopt(self, fd)
            self._fds = fds

    def _footer_fields(self) -> bytes:
        """The footer's fields, checked against their crc: the entry and tombstone counts
        steer compaction and nothing else checks them (a count flipped high keeps the
        table out of every merge, and its dead keys on the disk for good)."""
        footer = self._read(self.size - FOOTER_SIZE, FOOTER_SIZE)
        fields = footer[:-4]
        if _U32.unpack(footer[-4:])[0] != zlib.crc32(fields):
            raise DatabaseCorruptError(self.path, "footer checksum mismatch")
        return fields

    def _parse_index(self, index: bytes) -> tuple[bytes, list[bytes], list[tuple[int, int]]]:
        try:
            (flen,) = _U32.unpack_from(index, 0)
            first = index[4 : 4 + flen]
            pos = 4 + flen
            (count,) = _U32.unpack_from(index, pos)
            pos += 4
            last_keys: list[bytes] = []
            blocks: list[tuple[int, int]] = []
            for _ in range(count):
                (klen,) = _U32.unpack_from(index, pos)
                pos += 4
                last_keys.append(index[pos : pos + klen])
                pos += klen
                blocks.append(_BLOCK_REF.unpack_from(index, pos))
                pos += _BLOCK_REF.size
        except struct.error as e:
            raise DatabaseCorruptError(self.path, "malformed index") from e
        if pos != len(index):
            raise DatabaseCorruptError(self.path, "malformed index")
        return first, last_keys, blocks

    def _read(self, offset: int, length: int) -> bytes:
        fds = self._fds
        if fds is None:
            data = self.io.pread(self._fd, length, offset)
        else:
            fd = fds.take(self)
            try:
                data = self.io.pread(fd, length, offset)
            finally:
                fds.give(self)
        if len(data) != length:
            raise DatabaseCorruptError(self.path, f"short read at {offset}")
        return data

    def _block(self, i: int) -> tuple[list[bytes], list[bytes | None]]:
        offset, length = self._blocks[i]
        raw = self._read(offset, length)
        data = raw[:-4]
        if _U32.unpack(raw[-4:])[0] != zlib.crc32(data):
            raise DatabaseCorruptError(self.path, f"block checksum mismatch at {offset}")
        return _parse_block(self.path, data)

    def verify(self) -> None:
        """Check every block's CRC (and shape); DatabaseCorruptError at the first bad one."""
        for i in range(len(self._blocks)):
            self._block(i)

    # ---- reads ---------------------------------------------------------------------

    def get(self, key: bytes) -> tuple[bool, bytes | None]:
        """``(found, value)``; found with None is a tombstone."""
        if not self.last_keys or key < self.first_key or key > self.last_keys[-1]:
            return False, None
        keys, values = self._block(bisect.bisect_left(self.last_keys, key))
        j = bisect.bisect_left(keys, key)
        if j < len(keys) and keys[j] == key:
            return True, values[j]
        return False, None

    def scan(self, start: bytes, stop: bytes | None) -> Iterator[Op]:
        """Entries (tombstones included) with ``start <= key < stop``, ascending."""
        if stop is not None and self.last_keys and stop <= self.first_key:
            return  # nothing in range: no block read (nor file opened)
        i = bisect.bisect_left(self.last_keys, start)
        first = True
        while i < len(self._blocks):
            keys, values = self._block(i)
            j = bisect.bisect_left(keys, start) if first else 0
            first = False
            for k in range(j, len(keys)):
                key = keys[k]
                if stop is not None and key >= stop:
                    return
                yield key, values[k]
            i += 1

    # ---- lifetime ------------------------------------------------------------------

    def acquire(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError(f"table {self.path} used after release")
            self._refs += 1

    @property
    def held(self) -> bool:
        """Whether a reference is left (its file may then be read)."""
        return self._refs > 0

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs != 0:
                return
        if self._fds is not None:
            self._fds.drop(self)
        else:
            self.io.close(self._fd)
        if self._unlink:
            with contextlib.suppress(OSError):  # garbage: the next open deletes it
                self.io.unlink_large(self.path)

    def retire(self) -> str | None:
        """Release the engine's reference as the table leaves its list, its file to be
        deleted: returns the path for the caller to delete if nothing else holds the
        table.  Else the last reader's ``release`` deletes it, so that a reader whose file
        the cache closed can open it again meanwhile."""
        with self._lock:
            if self._refs > 1:
                self._refs -= 1
                self._unlink = True
                return None
        self.release()
        return self.path


def write_entries(io: IO, fd: int, entries: Iterable[Op]) -> tuple[int, int]:
    """Write ``entries`` as a table to ``fd``; returns (entry count, file size)."""
    w = TableWriter(io, fd)
    for key, value in entries:
        w.add(key, value)
    size = w.finish()
    return w.entries, size
