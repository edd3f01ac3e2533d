"""A dict-backed KV for tests: the KV interface in memory, with a power cut and faults.

``DictStore`` is the "disk": what every open ``DictKV`` on it sees.  It keeps two views,
``data`` (everything written: what survives a process kill) and ``durable`` (every batch
up to the last synced one: what survives a power cut on an engine that persists batches
in order, the assumption the KV queue documents).  ``power_cut()`` keeps only the latter.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field

from queue_ref.kv.base import KV, WriteBatch
from queue_ref.storage import ClosedError


@dataclass
class DictStore:
    data: dict[bytes, bytes] = field(default_factory=dict)
    durable: dict[bytes, bytes] = field(default_factory=dict)
    unsynced: list[WriteBatch] = field(default_factory=list)
    writes: list[tuple[int, bool]] = field(default_factory=list)  # (ops, sync) per batch
    fail: OSError | None = None  # raised by the next writes (nothing applied) while set
    lock: threading.Lock = field(default_factory=threading.Lock)

    def power_cut(self) -> None:
        """Lose every batch written after the last synced one."""
        with self.lock:
            self.data = dict(self.durable)
            self.unsynced.clear()


def _apply(d: dict[bytes, bytes], batch: WriteBatch) -> None:
    for k, v in batch.ops:
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v


class DictKV(KV):
    def __init__(self, store: DictStore | None = None) -> None:
        self.store = store if store is not None else DictStore()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("DictKV is closed")

    def get(self, key: bytes) -> bytes | None:
        self._check()
        with self.store.lock:
            return self.store.data.get(key)

    def write(self, batch: WriteBatch, *, sync: bool = True) -> None:
        self._check()
        s = self.store
        with s.lock:
            if s.fail is not None:
                raise s.fail
            if not batch.ops:
                return
            _apply(s.data, batch)
            s.writes.append((len(batch), sync))
            s.unsynced.append(WriteBatch(list(batch.ops)))
            if sync:
                for b in s.unsynced:
                    _apply(s.durable, b)
                s.unsynced.clear()

    def iterate(
        self, start: bytes = b"", stop: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        self._check()
        with self.store.lock:
            snap = sorted(self.store.data.items())
        i = bisect_left(snap, (start, b""))
        return self._walk(snap[i:], stop)

    def _walk(self, pairs: list[tuple[bytes, bytes]],
              stop: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        for k, v in pairs:
            if stop is not None and k >= stop:
                return
            self._check()
            yield k, v

    def close(self) -> None:
        self._closed = True

    def disk_usage(self) -> int:
        self._check()
        with self.store.lock:
            return sum(len(k) + len(v) for k, v in self.store.data.items())
