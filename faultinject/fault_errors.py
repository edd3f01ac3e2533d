"""Errors of the fault injector.

``Crash`` stands for the death of the process (a kill or a power cut).  It derives from
``BaseException`` so that ``except Exception`` in backend code cannot swallow it: once it is
raised, the workload is over and the harness builds the disk a crash would leave.
"""

from __future__ import annotations


class Crash(BaseException):
    """The simulated process died at a crash point.

    ``call_index`` counts mutating calls (0-based, the index ``FaultPlan.crash_at`` names);
    ``when`` is ``"before"`` (the call never ran) or ``"after"`` (it ran, its result was
    lost); ``event_index`` is the crashing call's index in the trace; ``repeated`` is true
    for the ``Crash`` raised by any call made after the process had already died.
    """

    def __init__(
        self,
        call_index: int,
        when: str,
        *,
        name: str = "",
        event_index: int = -1,
        repeated: bool = False,
    ) -> None:
        self.call_index = call_index
        self.when = when
        self.name = name
        self.event_index = event_index
        self.repeated = repeated
        what = f"{name} " if name else ""
        again = " (process already dead)" if repeated else ""
        super().__init__(
            f"crash {when} mutating call #{call_index} {what}(trace event #{event_index}){again}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_crash, (self.call_index, self.when, self.name, self.event_index,
                                 self.repeated))


def _rebuild_crash(call_index: int, when: str, name: str, event_index: int,
                   repeated: bool) -> Crash:
    return Crash(call_index, when, name=name, event_index=event_index, repeated=repeated)


class ModelError(ValueError):
    """A trace cannot be replayed on the inode model.

    Raised when a recorded call that succeeded on the real disk is impossible in the model
    (the directory was changed outside the seam, a path left the root, an absolute symlink
    had to be followed) or when a crash-state key does not name a state of the model.
    Nothing is half-built when it is raised.
    """
