"""A filesystem queue for ``queue-ref relay --backend tests.relay_faulty_steps:fs`` whose
chosen call raises an unexpected error (``RuntimeError``, what no backend should raise),
once, when the file ``<queue>.fail-<call>`` exists: a bug in a backend or in the relay,
met at a moment the test chooses.  Calls: send_start, read_inflight, send_done, cleanup,
send_cancel, and enqueue and commit of a message with the null sender (the relay's own
bounces: the receiver's commits of the test's mail are not touched).  The relay hands a
job's outcomes over in one ``send_finish``: ``send_done`` and ``send_cancel`` fail it when
it holds such outcomes (before it moves anything), ``send_finish`` fails it after it moved
the first half of its entries, one by one (a backend that broke off in the middle), and
``cleanup_all`` likewise after it released the first half of its entries (``cleanup``
fails it before it releases anything).  The
file ``<queue>.io-send_finish`` makes the next batch fail as a disk does
(``StorageIOError``, every handle given back, nothing moved), and ``<queue>.io-read`` the
next ``read`` of a body already open (a disk error in the middle of a body)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from queue_ref.fsqueue import FsQueue
from queue_ref.storage import Enqueuer, MailReader, QueuedMail, Recipient, StorageIOError

CALLS = ("send_start", "read_inflight", "send_done", "cleanup", "send_cancel", "enqueue",
         "commit", "send_finish", "cleanup_all")


def trigger_of(path: str, call: str) -> str:
    return os.path.abspath(path).rstrip("/") + f".fail-{call}"


def io_trigger_of(path: str) -> str:
    return os.path.abspath(path).rstrip("/") + ".io-send_finish"


def read_io_trigger_of(path: str) -> str:
    return os.path.abspath(path).rstrip("/") + ".io-read"


def _take_trigger(path: str) -> bool:
    """Whether the trigger file ``path`` was there (it is gone now: it fires once)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class InjectedError(RuntimeError):
    """What the chosen call raises: no backend raises it, so the relay meets it as a bug."""


class _Enqueuer:
    """The queue's Enqueuer, whose commit may raise first."""

    def __init__(self, q: FaultyStepsQueue, inner: Enqueuer, null_sender: bool) -> None:
        self._q = q
        self._inner = inner
        self._null_sender = null_sender

    @property
    def message_id(self) -> str | None:
        return self._inner.message_id

    def write(self, data: bytes) -> None:
        self._inner.write(data)

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        if self._null_sender:
            self._q.maybe_fail("commit")
        return self._inner.commit(rcpts)

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> _Enqueuer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)  # type: ignore[arg-type]


class _Reader(MailReader):
    """The queue's MailReader, whose next ``read`` fails as a disk does when the file
    ``<queue>.io-read`` exists."""

    def __init__(self, q: FaultyStepsQueue, inner: MailReader, mail: Any) -> None:
        self.meta = inner.meta
        self._q, self._inner, self._mail = q, inner, mail

    def read(self, n: int = -1) -> bytes:
        if _take_trigger(read_io_trigger_of(self._q.root)):
            raise StorageIOError("reading the body: injected EIO", self._mail)
        return self._inner.read(n)

    def close(self) -> None:
        self._inner.close()


class FaultyStepsQueue(FsQueue):
    def maybe_fail(self, call: str) -> None:
        if _take_trigger(trigger_of(self.root, call)):
            raise InjectedError(f"injected failure of {call}")

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Any:
        if not mail_from:
            self.maybe_fail("enqueue")
        return _Enqueuer(self, super().enqueue(mail_from, params), not mail_from)

    def send_start(self, mail: Any) -> Any:
        self.maybe_fail("send_start")
        return super().send_start(mail)

    def read_inflight(self, mail: Any) -> Any:
        self.maybe_fail("read_inflight")
        return _Reader(self, super().read_inflight(mail), mail)

    def send_done(self, mail: Any) -> Any:
        self.maybe_fail("send_done")
        return super().send_done(mail)

    def send_finish(self, done: Any = (), cancel: Any = ()) -> Any:
        if done:
            self.maybe_fail("send_done")
        if cancel:
            self.maybe_fail("send_cancel")
        if _take_trigger(io_trigger_of(self.root)):
            raise StorageIOError("send_finish: injected EIO before anything moved")
        if os.path.exists(trigger_of(self.root, "send_finish")):
            half = list(done)[: max(1, len(done) // 2)]
            for h in half:  # moved, and their new handles lost with the error
                super().send_done(h)
            self.maybe_fail("send_finish")
        return super().send_finish(done, cancel)

    def cleanup(self, mail: Any) -> Any:
        self.maybe_fail("cleanup")
        return super().cleanup(mail)

    _release_left: int | None = None  # entries FsQueue.cleanup_all releases before failing

    def cleanup_all(self, mails: Any) -> Any:
        self.maybe_fail("cleanup")
        if os.path.exists(trigger_of(self.root, "cleanup_all")):
            self._release_left = max(1, len(mails) // 2)
        try:
            return super().cleanup_all(mails)
        finally:
            self._release_left = None

    def _release_entry(self, h: Any, *, shared: bool = False) -> bool:
        if self._release_left is not None:
            if not self._release_left:
                self.maybe_fail("cleanup_all")  # inside FsQueue's batch, half released
            self._release_left -= 1
        return super()._release_entry(h, shared=shared)

    def send_cancel(self, mail: Any, schedule: Any) -> Any:
        self.maybe_fail("send_cancel")
        return super().send_cancel(mail, schedule)


def fs(path: str) -> FaultyStepsQueue:
    return FaultyStepsQueue(path)
