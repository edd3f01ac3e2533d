"""The errors of the contract that a caller's mistake raises (clauses C11 and C12).

They live here, not in ``queue_ref``, because the contract's own values check their
arguments too: ``Schedule(-1)`` is a caller's mistake exactly as a recipient address with
a newline is, and raises the same kind of error.  ``queue_ref.storage`` re-exports them
and adds the errors of a real disk (``StorageIOError``, ``CorruptionError``...).
"""

from __future__ import annotations


class QueueError(Exception):
    """Base of every error a Storage raises on purpose."""


class MisuseError(QueueError):
    """A handle was consumed already, belongs to another Storage, or has the wrong type."""


class InvalidInputError(MisuseError, ValueError):
    """An argument is malformed (an address with NUL or newline, an empty recipient list...)."""


class ScheduleError(InvalidInputError):
    """A schedule time or attempt count that is not a non-negative int, or a reason that
    is not a str with a UTF-8 form."""


__all__ = ["InvalidInputError", "MisuseError", "QueueError", "ScheduleError"]
