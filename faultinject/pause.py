"""``PauseGate``: stop a caller at a chosen mutating call until the harness lets it go.

A crash point ends a caller at a chosen call; a pause point *stops* it there, alive,
so that another caller can run its own operation on the same entry while the first is
inside its transition (the other caller's race), and then lets it finish::

    gate = io.pause_at(io.mutating_count + k)   # the k-th mutating call from now
    a = threading.Thread(target=lambda: store.reschedule(h, s)); a.start()
    if gate.wait_reached(5):                    # A stands before that call
        ...                                     # B's competing operation runs now
    gate.release(); a.join()                    # A performs the call and goes on

The paused caller waits *before* the call, outside the seam's lock, so the others'
calls go through meanwhile (they take the next indices of the trace; the paused call
is performed, and recorded, when it is released).  A gate fires once, for the first
mutating call whose index is ``at`` (whichever thread makes it: arm it while only the
caller to stop is running).  ``release`` is idempotent and may come before the call is
reached (then the caller never stops).
"""

from __future__ import annotations

import threading


class PauseGate:
    """One pause point, at mutating call ``at`` (0-based, as ``FaultPlan.crash_at``)."""

    def __init__(self, at: int) -> None:
        if at < 0:
            raise ValueError(f"a pause point must be >= 0, not {at}")
        self.at = at
        self.call = ""  # the name of the call the caller stopped before
        self.thread = 0  # the ident of the thread that stopped
        self._reached = threading.Event()
        self._released = threading.Event()
        self._fired = False

    def fire(self, name: str) -> bool:
        """Claim the gate for call ``name`` (the seam calls this under its lock)."""
        if self._fired:
            return False
        self._fired = True
        self.call = name
        self.thread = threading.get_ident()
        return True

    def stop(self) -> None:
        """Called by the stopped caller, outside the seam's lock: wait for ``release``."""
        self._reached.set()
        self._released.wait()

    @property
    def reached(self) -> bool:
        return self._reached.is_set()

    def wait_reached(self, timeout: float) -> bool:
        """Whether a caller stopped at the gate within ``timeout`` seconds."""
        return self._reached.wait(timeout)

    def release(self) -> None:
        """Let the stopped caller (or the one still to come) go on."""
        self._released.set()
