"""A shared/exclusive lock between the threads of one FsQueue.

Operations hold it shared; ``recover()`` and ``close()`` hold it exclusive, so that the
orphan scan of recovery never sees a link half-way between two directories because of a
thread of its own queue.  Writers are preferred, so a stream of operations cannot starve
recovery.  Neither side is re-entrant across the other: an operation never calls
``recover``.

Taking it shared is the hot path (every operation does, once): one uncontended mutex
acquire and release on the way in and on the way out, and no wake-up unless a writer waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class SharedExclusive:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._shared = _Shared(self)

    def shared(self) -> _Shared:
        """A context manager holding the lock shared (one object, reused by every thread)."""
        return self._shared

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Shared:
    __slots__ = ("_rw",)

    def __init__(self, rw: SharedExclusive) -> None:
        self._rw = rw

    def __enter__(self) -> None:
        rw = self._rw
        with rw._mutex:
            while rw._writer or rw._writers_waiting:
                rw._cond.wait()
            rw._readers += 1

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        rw = self._rw
        with rw._mutex:
            rw._readers -= 1
            if not rw._readers and rw._writers_waiting:
                rw._cond.notify_all()
