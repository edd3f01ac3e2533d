"""Errors the KV engines raise on purpose (both are ``OSError``s, so callers that map disk
failures to ``StorageIOError`` treat them alike), and the damage an engine reports."""

from __future__ import annotations

import errno
from dataclasses import dataclass


class DatabaseLockedError(OSError):
    """Another open engine (in this process or another) holds the database's lock.

    Nothing was read or changed; the other holder keeps working.
    """

    def __init__(self, path: str) -> None:
        super().__init__(
            errno.EWOULDBLOCK,
            f"database {path} is locked by another open engine (one writer process per DB)",
        )
        self.path = path


def held_by_another(e: BaseException) -> bool:
    """Whether ``e``, or an error that caused it (a queue wraps the engine's), is a
    database's lock held by another open engine."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, DatabaseLockedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def repair_command(queue: str, backend: str) -> str:
    """The command that salvages the intact part of a damaged store."""
    return f"queue-ref repair --queue {queue} --backend {backend}"


class DatabaseCorruptError(OSError):
    """Durable state failed its checks (bad CRC in a table or manifest, a missing file).

    This is never raised for a torn log tail, which recovery drops silently because no
    synced write can end there.  The files are left as they were for inspection and for
    the repair command the message names (``repair``: the queue directory and backend).
    """

    def __init__(self, path: str, detail: str, *, repair: tuple[str, str] | None = None) -> None:
        msg = f"corrupt database file {path}: {detail}"
        if repair is not None:
            msg += (f"; the store was left as it is: run `{repair_command(*repair)}` to "
                    "salvage every intact message")
        super().__init__(errno.EIO, msg)
        self.path = path
        self.detail = detail
        self.repair = repair

    def with_repair(self, queue: str, backend: str) -> DatabaseCorruptError:
        """The same error, its message naming the repair command."""
        if self.repair is not None:
            return self
        return DatabaseCorruptError(self.path, self.detail, repair=(queue, backend))


@dataclass(frozen=True)
class Damage:
    """Damage an engine met and survived: bytes it could not read, kept aside in ``kept``
    (a path), never deleted.  ``sample`` is (a prefix of) the unreadable bytes, from which
    the queue reads the ids they named; ``later_keys`` are the keys that intact records
    written after them changed."""

    kept: str
    detail: str
    sample: bytes = b""
    later_keys: frozenset[bytes] = frozenset()
