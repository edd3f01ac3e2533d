"""What one crash point of a task found, model by model: the rows of a crash campaign.

``explore_task`` sums its crash points up per model (``crash_task.ModelStats``); a task
with ``Task.log_points`` set also keeps one ``PointLog`` per crash point (and one for the
fault-free run's restart check, kind ``rest-check``), so that a campaign can store a row
per task, crash point and model and sum them up again in any grouping.  Adding up the
``PointLog``s of every task gives exactly the totals of ``exploration.Summary``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: The kinds of crash point: the restart check after the fault-free run, a crash inside a
#: mutating call (before or after it), a crash at rest between calls, an fsync failed with
#: EIO followed by a power cut.
POINT_KINDS = ("rest-check", "crash", "rest", "eio")


@dataclass
class ModelAtPoint:
    """One crash point under one persistence model."""

    judged: bool = False  # counted as a crash point of the model (``ModelStats.points``)
    exhaustive: bool = True  # every state the model allows was built (else a sample)
    states: int = 0  # first-level states judged (violating ones included)
    recovery_states: int = 0  # states left by a crash inside recovery
    eio_states: int = 0  # states after an fsync failed with EIO
    images: set[str] = field(default_factory=set)  # digests of the disks judged
    #: violating states: (scenario id, clauses, what the first clause saw)
    failures: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)

    def count(self, kind: str) -> None:
        if kind == "recovery":
            self.recovery_states += 1
        elif kind == "eio":
            self.eio_states += 1
        else:
            self.states += 1


@dataclass
class PointLog:
    """One crash point of a task: ``kind`` (see ``POINT_KINDS``), the mutating call (or,
    at rest, the number of calls returned) ``index``, ``when`` (before, after, rest)."""

    kind: str
    index: int
    when: str
    models: dict[str, ModelAtPoint] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    counted: bool = True  # counted as a crash point (an EIO run that failed is not)
    started: float = field(default_factory=time.perf_counter, repr=False)
    errors_from: int = 0  # position in the task's error list when the point began

    def model(self, name: str) -> ModelAtPoint:
        return self.models.setdefault(name, ModelAtPoint())

    def close(self, errors: list[str]) -> None:
        self.seconds = time.perf_counter() - self.started
        self.errors = errors[self.errors_from:]


__all__ = ["POINT_KINDS", "ModelAtPoint", "PointLog"]
