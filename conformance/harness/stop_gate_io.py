"""An I/O seam that stops its process at a chosen mutating call until it is let go.

``StopGateIO(inner, on_stop)`` passes every call to ``inner``.  Once ``arm(stop)`` is
called it counts the mutating calls (``queue_ref.io.MUTATING``) from 0 and, at *stop
point* ``stop``, calls ``on_stop(point, call_name, when)`` in the calling thread, which
blocks until the process is released (the lifecycle-edges check waits there for a line
from its parent):

* stop point 0 is just before mutating call 0;
* stop point ``n >= 1`` is just after mutating call ``n - 1`` (whether it succeeded or
  raised), before anything else happens.

So stop points ``0..M`` of an operation that makes ``M`` mutating calls cover every gap
between them, the last one after its last call, before it returns.  The gate stops once
per ``arm``; ``stopped`` tells whether it did, ``count`` how many mutating calls were made
since ``arm``.  Calls of several threads are counted in the order they reach the gate.

Nothing is recorded and nothing fails: this is a pause, not a fault (``faultinject``
crashes and fails calls).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from queue_ref.io import IO, MUTATING, OsIO

OnStop = Callable[[int, str, str], None]


def kill_self() -> None:
    """SIGKILL this process: no ``finally``, no atexit, as a crash."""
    os.kill(os.getpid(), signal.SIGKILL)


def killing_io(inner: IO | None = None) -> StopGateIO:
    """The real disk (or ``inner``), through a gate that SIGKILLs this process at its stop
    point (inside the call, right after mutating call ``stop - 1``)."""
    return StopGateIO(inner if inner is not None else OsIO(),
                      lambda point, name, when: kill_self())


class StopGateIO(IO):
    """See the module docstring."""

    def __init__(self, inner: IO, on_stop: OnStop) -> None:
        self.inner = inner
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._stop: int | None = None
        self.count = 0
        self.stopped = False

    def arm(self, stop: int | None) -> None:
        """Count mutating calls from now on; stop at point ``stop`` (None: never)."""
        with self._lock:
            self._stop = stop
            self.count = 0
            self.stopped = False

    def disarm(self) -> None:
        with self._lock:
            self._stop = None

    def _take(self, point: int) -> bool:
        with self._lock:
            if self._stop != point or self.stopped:
                return False
            self.stopped = True
            return True

    def _mutating(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        with self._lock:
            index = self.count
            self.count += 1
        if index == 0 and self._take(0):
            self._on_stop(0, name, "before")
        try:
            return fn(*args, **kwargs)
        finally:
            if self._take(index + 1):
                self._on_stop(index + 1, name, "after")


def _passing(name: str) -> Callable[..., Any]:
    def call(self: StopGateIO, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _gated(name: str) -> Callable[..., Any]:
    def call(self: StopGateIO, *args: Any, **kwargs: Any) -> Any:
        return self._mutating(name, getattr(self.inner, name), args, kwargs)

    call.__name__ = name
    return call


# Every call of the seam goes to ``inner``; the mutating ones through the gate.
# ``rename_noreplace`` is left to IO's own, which is made of the gated link and unlink.
for _name in sorted(vars(IO)):
    if _name.startswith("_") or _name == "rename_noreplace" or not callable(vars(IO)[_name]):
        continue
    setattr(StopGateIO, _name, _gated(_name) if _name in MUTATING else _passing(_name))

assert all(hasattr(StopGateIO, m) for m in MUTATING), "a mutating call the seam lacks"
