"""Errors the KV engines raise on purpose (both are ``OSError``s, so callers that map disk
failures to ``StorageIOError`` treat them alike)."""

from __future__ import annotations

import errno


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


class DatabaseCorruptError(OSError):
    """Durable state failed its checks (bad CRC in a table or manifest, a missing file).

    This is never raised for a torn log tail, which recovery drops silently because no
    synced write can end there.  The files are left as they were for inspection.
    """

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(errno.EIO, f"corrupt database file {path}: {detail}")
        self.path = path
        self.detail = detail
