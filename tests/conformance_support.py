"""Backends with one planted bug each, for the conformance suite's own tests.

Each is MemoryStorage with one rule broken; the suite must name the clause.
"""

from __future__ import annotations

from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    RecoveryReport,
    Schedule,
)


class DoubleClaim(MemoryStorage):
    """send_start claims an entry even when another worker already holds it (C7)."""

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        h = self._take(mail, QueuedMail)
        with self._lock:
            e = self._entries.get(h.entry_id)
            if e is None or e.state == "cleanup":
                return None
            e.state = "inflight"
            return self._issue(InflightMail, h.entry_id, e.message_id, e.schedule)


class LeakyCleanup(MemoryStorage):
    """cleanup forgets to free the message with its last entry (C8)."""

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        h = self._take(mail, PendingCleanupMail)
        with self._lock:
            e = self._entries.get(h.entry_id)
            if e is None or e.state != "cleanup":
                return False
            del self._entries[h.entry_id]
            return True


def memory(root: str) -> MemoryStorage:
    """factory(root) for MemoryStorage (the root is ignored: nothing is kept)."""
    return MemoryStorage()


class RescheduleLosesBody(MemoryStorage):
    """reschedule rewrites the message without its body: the entry is still listed with
    the right schedule, but its message no longer reads back as committed (C6)."""

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        got = super().reschedule(mail, schedule)
        if got is not None:
            with self._lock:
                msg = self._msgs[self._entries[got.entry_id].message_id]
                msg.body = b""
        return got


class RecoverRequeuesLive(MemoryStorage):
    """recover() on the live queue puts the entries this very queue holds inflight back
    in the queue: another worker then claims them too (C7 in disguise; C10)."""

    def recover(self) -> RecoveryReport:
        with self._lock:
            n = 0
            for e in self._entries.values():
                if e.state == "inflight":
                    e.state = "queued"
                    n += 1
        return RecoveryReport(requeued=n)


class _Stuck:
    """Never set: a wait on it is a deadlock (a lock its holder never releases)."""

    event = __import__("threading").Event()


class HangsInSendDone(MemoryStorage):
    """``send_done`` waits for something that never comes: the certifier must give a
    verdict (a hang, with where it was stuck) instead of running forever."""

    def send_done(self, mail):  # type: ignore[no-untyped-def]
        _Stuck.event.wait()
        return super().send_done(mail)


class HangsOnClose(MemoryStorage):
    """``close`` never returns: even the first opening of a queue (the probe) hangs."""

    def close(self) -> None:
        _Stuck.event.wait()
