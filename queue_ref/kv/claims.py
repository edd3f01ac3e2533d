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
from collections.abc import Iterable

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
        self._waiting = 0  # requests blocked in hold(); releases notify only if any

    def _free(self, excl: tuple[str, ...], shared: tuple[str, ...]) -> bool:
        held, wanted = self._held, self._wanted
        return (all(n not in held for n in excl)
                and all(held.get(n, 0) >= 0 and not wanted.get(n) for n in shared))

    def hold(self, excl: Iterable[str] = (), shared: Iterable[str] = ()) -> Held:
        """A context manager holding every name in ``excl`` exclusively and every name in
        ``shared`` shared, all taken at once when it is entered."""
        return Held(self, tuple(excl), tuple(shared))

    def _acquire(self, ex: tuple[str, ...], sh: tuple[str, ...]) -> None:
        with self._cv:
            if not self._free(ex, sh):
                for n in ex:
                    self._wanted[n] = self._wanted.get(n, 0) + 1
                self._waiting += 1
                try:
                    while not self._free(ex, sh):
                        self._cv.wait()
                finally:
                    self._waiting -= 1
                    for n in ex:
                        self._wanted[n] -= 1
                        if not self._wanted[n]:
                            del self._wanted[n]
            held = self._held
            for n in ex:
                held[n] = -1
            for n in sh:
                held[n] = held.get(n, 0) + 1

    def _release(self, ex: tuple[str, ...], sh: tuple[str, ...]) -> None:
        with self._cv:
            held = self._held
            for n in ex:
                del held[n]
            for n in sh:
                left = held[n] - 1
                if left:
                    held[n] = left
                else:
                    del held[n]
            if self._waiting:
                self._cv.notify_all()


class Held:
    """The names of one ``Claims.hold`` call, taken on ``__enter__``, released on exit."""

    __slots__ = ("_claims", "_ex", "_sh")

    def __init__(self, claims: Claims, ex: tuple[str, ...], sh: tuple[str, ...]) -> None:
        self._claims = claims
        self._ex = ex
        self._sh = sh

    def __enter__(self) -> None:
        self._claims._acquire(self._ex, self._sh)

    def __exit__(self, *exc: object) -> None:
        self._claims._release(self._ex, self._sh)
