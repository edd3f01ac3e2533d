"""The queue contract: states, transition table, executable model, invariants, crash conditions.

This package imports nothing else of the project and performs no I/O.
"""

from spec.contract_errors import InvalidInputError, MisuseError, QueueError, ScheduleError
from spec.crash import CLAUSES, Violation, allowed_views, judge
from spec.model import (
    MAX_REASON,
    Call,
    Entry,
    EntryKey,
    EntryView,
    Message,
    Model,
    Schedule,
    run,
)
from spec.states import TABLE, EntryState, Op, Outcome, Transition, after_restart, step

__all__ = [
    "CLAUSES",
    "MAX_REASON",
    "TABLE",
    "Call",
    "Entry",
    "EntryKey",
    "EntryState",
    "EntryView",
    "InvalidInputError",
    "Message",
    "MisuseError",
    "Model",
    "Op",
    "Outcome",
    "QueueError",
    "Schedule",
    "ScheduleError",
    "Transition",
    "Violation",
    "after_restart",
    "allowed_views",
    "judge",
    "run",
    "step",
]
