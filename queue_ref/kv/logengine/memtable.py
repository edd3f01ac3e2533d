"""The memtable: the writes since the last flush, with tombstones for deletes.

A dict gives point lookups; a ``SortedList`` of the keys (a key added at its first write)
gives ordered ranges.  (A plain list kept sorted with ``bisect.insort`` moved half of
itself at each new key: 10 us a key at 120,000 keys, which a 64 MiB log of small mail
holds before its flush; a ``SortedList`` takes about 1 us at any size.)  Keys are never
removed before the flush: a delete stores ``None`` (a tombstone), which hides older
values in the tables.  The caller serialises mutation and reading (the engine's state
lock).
"""

from __future__ import annotations

from sortedcontainers import SortedList  # type: ignore[import-untyped]

from queue_ref.kv.logengine.format import Op

#: Bookkeeping cost of one entry beyond its key and value bytes: measured with
#: tracemalloc on CPython 3.11, 127 bytes for a live entry (its dict slot, its bytes
#: objects' headers, its place in the key list) and 94 for a tombstone.  At 48 the
#: memtable held about twice its limit once deletes had left it mostly tombstones.
ENTRY_OVERHEAD = 112


class Memtable:
    def __init__(self) -> None:
        self._data: dict[bytes, bytes | None] = {}
        self._keys = SortedList()
        self.approx_bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def apply(self, ops: list[Op]) -> None:
        data = self._data
        for key, value in ops:
            vlen = 0 if value is None else len(value)
            if key in data:
                old = data[key]
                self.approx_bytes += vlen - (0 if old is None else len(old))
            else:
                self._keys.add(key)
                self.approx_bytes += len(key) + vlen + ENTRY_OVERHEAD
            data[key] = value

    def lookup(self, key: bytes) -> tuple[bool, bytes | None]:
        """``(found, value)``: found with None means a tombstone."""
        if key in self._data:
            return True, self._data[key]
        return False, None

    def range(self, start: bytes, stop: bytes | None) -> list[Op]:
        """A copy of the entries with ``start <= key < stop``, ascending, tombstones included."""
        data = self._data
        return [(k, data[k]) for k in self._keys.irange(start, stop, inclusive=(True, False))]

