"""Named in-process locks, taken all at once, each shared or exclusive.

The KV queue serialises operations on one entry (and on one message's live count) with
these, not with one big lock, so writes to different entries run concurrently and their
synced batches can share an fsync in the engine (group commit).

Deadlock freedom rests on two rules the callers keep:

* every ``hold`` takes all its names at once (it never holds some while waiting for
  others);
* the only nested ``hold`` is an exclusive one on a message's live count, and whoever
  holds a live count never waits for anything else while holding it.

A waiting exclusive request blocks new shared requests of the same name, so a recovery
run (exclusive on ``*``) is not starved by a stream of operations (shared on ``*``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

EVERYTHING = "*"


def entry(mid: int, idx: int) -> str:
    return f"e{mid}.{idx}"


def message(mid: int) -> str:
    return f"m{mid}"


def count(mid: int) -> str:
    return f"c{mid}"


class Claims:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._held: dict[str, int] = {}  # name -> shared holders, or -1 when exclusive
        self._wanted: dict[str, int] = {}  # name -> exclusive requests waiting

    def _free(self, excl: tuple[str, ...], shared: tuple[str, ...]) -> bool:
        return (all(n not in self._held for n in excl)
                and all(self._held.get(n, 0) >= 0 and not self._wanted.get(n) for n in shared))

    @contextmanager
    def hold(self, excl: Iterable[str] = (), shared: Iterable[str] = ()) -> Iterator[None]:
        ex, sh = tuple(excl), tuple(shared)
        with self._cv:
            if not self._free(ex, sh):
                for n in ex:
                    self._wanted[n] = self._wanted.get(n, 0) + 1
                try:
                    while not self._free(ex, sh):
                        self._cv.wait()
                finally:
                    for n in ex:
                        self._wanted[n] -= 1
                        if not self._wanted[n]:
                            del self._wanted[n]
            for n in ex:
                self._held[n] = -1
            for n in sh:
                self._held[n] = self._held.get(n, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                for n in ex:
                    del self._held[n]
                for n in sh:
                    left = self._held[n] - 1
                    if left:
                        self._held[n] = left
                    else:
                        del self._held[n]
                self._cv.notify_all()
