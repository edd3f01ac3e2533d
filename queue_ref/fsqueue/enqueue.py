"""The Enqueuer of the filesystem queue: streams a body to disk, then commits.

The body goes to the message file ``tmp/<owner>/<msgid>`` while its digest is computed,
in writes of ``BODY_BUFFER`` (64 KiB) bytes, so a body of any size needs that much memory
and no more; a smaller message is written whole, with its envelope, at commit.  Nothing is
created before the body outgrows the buffer or the commit; nothing is visible to listers
before the commit point (see ``FsSteps._commit_message``).  After a write error the
message is discarded and the Enqueuer is closed: the caller starts again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from queue_ref.fsqueue.steps import MessageTx
from queue_ref.storage import (
    ClosedError,
    Enqueuer,
    InvalidInputError,
    QueuedMail,
    Recipient,
    validate_recipients,
)


class _EnqueueSteps(Protocol):
    """What an FsEnqueuer needs of its FsQueue (which imports this module)."""

    def _check_open(self) -> None: ...
    def _enqueue_write(self, tx: MessageTx, data: bytes) -> None: ...
    def _check_recipient_count(self, n: int) -> None: ...
    def _enqueue_commit(self, tx: MessageTx, rcpts: list[Recipient]) -> list[QueuedMail]: ...
    def _enqueue_discard(self, tx: MessageTx) -> None: ...


class FsEnqueuer(Enqueuer):
    def __init__(self, store: _EnqueueSteps, tx: MessageTx) -> None:
        self._store = store
        self._tx = tx
        self._done = False

    @property
    def message_id(self) -> str:
        return self._tx.msgid

    def _check(self) -> None:
        if self._done:
            raise ClosedError("this Enqueuer was committed or aborted")
        self._store._check_open()

    def write(self, data: bytes) -> None:
        """Append body bytes.  On StorageIOError the message is discarded and this Enqueuer
        is closed (nothing of it is ever visible)."""
        self._check()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"body data must be bytes, got {type(data).__name__}")
        if data:
            try:
                self._store._enqueue_write(self._tx, bytes(data))
            except BaseException:
                self._done = True
                raise

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        """Commit the message; see ``Enqueuer.commit``.  Invalid recipients raise
        InvalidInputError before anything changes, and this Enqueuer stays usable."""
        self._check()
        checked = validate_recipients(rcpts)
        self._store._check_recipient_count(len(checked))
        self._done = True
        return self._store._enqueue_commit(self._tx, checked)

    def abort(self) -> None:
        """Discard the uncommitted message.  Idempotent; a no-op after commit.  Leftovers of
        a failed discard belong to this owner and are removed by recovery after it dies."""
        if self._tx.committed:
            self._done = True
            return
        self._done = True
        self._store._enqueue_discard(self._tx)
