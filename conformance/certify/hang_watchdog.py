"""A deadline per check: a backend that hangs gets a verdict, not an endless run.

A deadlock or an endless loop in a backend (a lock never released, a wait nobody ends)
would make ``queue-ref certify`` run forever, and a person waiting on it learns nothing.
``Watchdog`` arms a timer around each step of the run; when a step outlives its deadline
the timer thread reports where the run's thread stands (its stack) to ``on_hang``, stops
the run's worker processes and ends the process with exit code 1 (not certified): a
stuck thread cannot be stopped from outside in Python, so the process itself ends.

What holds after a hang: ``on_hang`` has been given the step's name, the deadline and the
stack; whatever it wrote (the certificate of the checks that finished plus an ERROR for
the one that hung) is on disk; no worker process of the run is left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from conformance.harness import child_process

#: Exit code of a run ended by a hang (the same as "not certified").
HUNG_EXIT = 1
#: Lines of the hung thread's stack kept in the report (innermost last).
STACK_LINES = 24

OnHang = Callable[[str, float, str, str], None]  # step, deadline, where, stack


class Watchdog:
    """Deadlines for the steps of one run, in the thread that runs them."""

    def __init__(self, seconds: float | None, on_hang: OnHang) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a check timeout must be a positive number of seconds, "
                             f"got {seconds!r}")
        self.seconds = seconds
        self.on_hang = on_hang
        self._thread = threading.get_ident()
        # Held by a firing timer until the process ends, and by a step as it ends: a step
        # that finishes at its deadline either ends first (the timer then does nothing)
        # or never returns (the timer reports it).
        self._lock = threading.Lock()
        self._running: str | None = None

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run the body with the deadline armed (nothing when the watchdog has none)."""
        if self.seconds is None:
            yield
            return
        with self._lock:
            self._running = name
        timer = threading.Timer(self.seconds, self._fire, args=(name,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            with self._lock:  # blocks for good if the timer fired: the process is ending
                self._running = None

    def stack(self) -> tuple[str, str]:
        """Where the watched thread is now: the innermost call outside the standard
        library ("function (file:line)") and the stack, innermost call last."""
        frame = sys._current_frames().get(self._thread)
        if frame is None:
            return "(the thread is gone)", ""
        summary = traceback.extract_stack(frame)
        stdlib = os.path.dirname(os.__file__)
        where = next((f for f in reversed(summary) if not f.filename.startswith(stdlib)),
                     summary[-1])
        lines = "".join(traceback.format_list(summary)).rstrip().splitlines()
        return (f"{where.name} ({where.filename}:{where.lineno})",
                "\n".join(lines[-STACK_LINES:]))

    def _fire(self, name: str) -> None:
        self._lock.acquire()  # never released: os._exit below
        if self._running != name:  # the step ended as the deadline came
            self._lock.release()
            return
        try:
            assert self.seconds is not None
            self.on_hang(name, self.seconds, *self.stack())
        finally:
            for child in multiprocessing.active_children():
                child.kill()
            child_process.kill_all()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HUNG_EXIT)
