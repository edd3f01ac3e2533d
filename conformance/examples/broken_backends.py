"""Broken variants of the project's backends, one bug each, as ``queue-ref certify`` takes
them.  Each is caught by the check named in ``docs/certify.md`` with the clause it breaks;
the project's own backends pass the same checks.  Never use them for mail.

    queue-ref certify conformance.examples.broken_backends:swallow_eio --only io-errors
"""

from __future__ import annotations

from queue_ref.io import IO, OsIO
from queue_ref.storage import Storage


def swallow_eio(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) that logs and forgets a failed fsync and
    reports success: the io-errors check fails it on C9 (a power cut right after the
    success loses what it acknowledged)."""
    from conformance.crashexplore.broken_fs_variants import SwallowFsyncError
    from conformance.crashexplore.explored_backends import deterministic_fs

    return deterministic_fs(SwallowFsyncError)(root, io if io is not None else OsIO())
