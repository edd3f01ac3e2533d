"""The lockstep machine's orderly restart, and what must hold after any reopening.

``restart`` (with ``restarts``) closes the queue (twice: close is idempotent; a closed
queue raises ClosedError) and opens it again on the same directory.  ``after_reopen``
is shared with the crash rule: the reopened backend must list exactly the model's restart
view (every acknowledged entry back, INFLIGHT ones as QUEUED, PENDING_CLEANUP ones gone,
each with its schedule), hold nothing inflight or pending cleanup, and a second
``recover()`` must find nothing to do (C10).  Handles of the earlier incarnation become
foreign: the misuse rules pass them to the new one.
"""

from __future__ import annotations

import contextlib

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from conformance.harness.field_compare import schedule_diff
from conformance.lockstep.machine_state import ClauseViolation, EnqueueArgs
from conformance.lockstep.operation_rules import Operations
from queue_ref.storage import (
    ClosedError,
    Handle,
    InflightMail,
    QueueError,
    Recipient,
    RecoveryReport,
    Schedule,
)
from spec.model import Model
from spec.states import EntryState, Op

FOREIGN_KEPT = 20  # handles of earlier incarnations kept for the misuse rules


class RestartRules(Operations):
    @precondition(lambda self: self.restarts)
    @rule()
    def restart(self) -> None:
        """Close and open again: the backend must hold exactly ``model.restart()``."""
        self.log.append("restart (close, then open again)")
        old = self.store
        self._call("close", old.close)
        self._call("close of a closed queue", old.close)
        try:
            list(old.list_queue())
        except ClosedError:
            pass
        except Exception as e:
            raise ClauseViolation("C9", f"list_queue on a closed queue raised "
                                        f"{type(e).__name__}: {e}, not ClosedError") from e
        else:
            raise ClauseViolation("C9", "list_queue on a closed queue answered instead of "
                                        "raising ClosedError")
        before = self.model
        self.forget_handles()
        self.store = self._call("open", self._open)
        self.model = before.restart()
        self.after_reopen(before, "the restart")

    @precondition(lambda self: self.restarts)
    @rule(size=st.sampled_from((0, 1, 5000)))
    def restart_with_an_enqueue_open(self, size: int) -> None:
        """Restart while a message is half written: its Enqueuer is closed with the queue
        (commit raises ClosedError) and nothing of it survives the reopening."""
        self.log.append(f"enqueue({size}B written, not committed), then restart")
        enq = self._call("enqueue", lambda: self.store.enqueue("open@example.org"))
        if size:
            self._call("write", lambda: enq.write(b"o" * size))
        self.restart()
        try:
            enq.commit([Recipient("late@example.net", Schedule(0))])
        except ClosedError:
            pass
        except Exception as e:
            raise ClauseViolation("C9", f"commit of an Enqueuer whose queue was closed raised "
                                        f"{type(e).__name__}: {e}, not ClosedError") from e
        else:
            raise ClauseViolation("C2", "an Enqueuer committed after its queue was closed")
        with contextlib.suppress(QueueError):
            enq.abort()

    @rule()
    def recover_live(self) -> None:
        """``recover()`` on the live queue, at any step: it may finish cleanups (as another
        worker's ``cleanup`` would: the handles held on them then vanish) and must do
        nothing else: no entry this live queue holds inflight is requeued (C7), nothing
        committed is removed or quarantined (C10)."""
        self.log.append("recover() on the live queue")
        report: RecoveryReport = self._call("recover", self.store.recover)
        if (report.requeued, report.uncommitted_removed, report.quarantined) != (0, 0, 0):
            raise ClauseViolation("C10", f"recover() on a live queue with no crash since the "
                                         f"last one did more than finish cleanups: {report}")
        pending = {self._key(h) for h in self._call(
            "find_pending_cleanup", lambda: list(self.store.find_pending_cleanup()))}
        finished = [k for k in self.model.keys_in(EntryState.PENDING_CLEANUP)
                    if k not in pending]
        if len(finished) != report.cleaned:
            raise ClauseViolation("C10", f"recover() reports {report.cleaned} cleanups "
                                         f"finished; {len(finished)} entries left "
                                         "find_pending_cleanup")
        for key in finished:
            self.model, _ = self.model.apply(Op.CLEANUP, key, None)

    @initialize(edge=st.booleans())
    def claims_held_across_recover(self, edge: bool) -> None:
        """With ``restarts``, about half the examples start at the edge a live recovery
        must get right: a message of two recipients and one of one, all three entries
        claimed, one of them sent (pending cleanup), then ``recover()`` on the live queue,
        then each claim read back and the message of two finished.  A recovery that
        mistakes a live claim for a dead owner's, or trips over an inflight name, fails
        here on every seed rather than when the random rules happen to meet it.

        Every example with ``restarts`` first commits one message and reopens the queue:
        a store that forgets acknowledged mail on an orderly restart fails on every seed,
        whatever the later draws (mail-like data may commit nothing before a restart)."""
        if not self.restarts:
            return
        self.log.append("edge: one message committed, then restart")
        self._enqueue(EnqueueArgs("first@example.org", (), (
            Recipient("kept@example.net", Schedule(0)),), 64, 7, 64))
        self.restart()
        if not edge:
            return
        self.log.append("edge: claims held across a live recover()")
        for rcpts in (("one@a.example", "two@b.example"), ("three@a.example",)):
            self._enqueue(EnqueueArgs("edge@example.org", (), tuple(
                Recipient(r, Schedule(0)) for r in rcpts), 300, len(rcpts), 1000))
        for h, key in [x for x in self.pool if self.model.state_of(x[1]) is EntryState.QUEUED]:
            self.pool.remove((h, key))
            self._do(Op.SEND_START, h, key)
        claims = [x for x in self.pool if isinstance(x[0], InflightMail)]
        sent = claims.pop()
        self.pool.remove(sent)
        self._do(Op.SEND_DONE, *sent)
        self.recover_live()
        for h, key in claims:
            assert isinstance(h, InflightMail)
            self._check_read(h, key, "an entry claimed across a live recover()")
            self.pool.remove((h, key))
            self._do(Op.SEND_DONE, h, key)

    def forget_handles(self) -> None:
        """Every handle held becomes a handle of an earlier incarnation."""
        self.foreign.extend(h for h, _ in self.pool)
        self.foreign.extend(h for _, h in self.spent)
        del self.foreign[:-FOREIGN_KEPT]
        self.pool.clear()
        self.spent.clear()

    def after_reopen(self, before: Model, what: str) -> None:
        """The reopened backend against ``self.model``; ``before`` names the clauses (the
        state the restart or crash interrupted)."""
        listed: list[Handle] = self._call("list_queue",
                                          lambda: list(self.store.list_queue()))
        held = (self._call("list_held", lambda: list(self.store.list_held()))
                if self.holds else [])
        for h in held:
            key = self._key(h)
            if self.model.state_of(key) is EntryState.QUEUED:
                raise ClauseViolation("C14", f"entry {key} is held after {what}, but its "
                                             "hold was never acknowledged")
        for h in listed:
            key = self._key(h)
            if self.model.state_of(key) is EntryState.HELD:
                raise ClauseViolation("C14", f"entry {key} is queued after {what}: its "
                                             "acknowledged hold was lost")
        listed = [*listed, *held]
        inflight = self._call("find_inflight", lambda: list(self.store.find_inflight()))
        pending = self._call("find_pending_cleanup",
                             lambda: list(self.store.find_pending_cleanup()))
        got = {self._key(h): h for h in listed}
        if len(got) != len(listed):
            raise ClauseViolation("C6", f"after {what} list_queue lists an entry twice")
        for key in sorted(set(self.model.entries) - set(got)):
            was = before.state_of(key)
            clause = "C4" if was is EntryState.INFLIGHT else "C1"
            raise ClauseViolation(clause, f"entry {key} ({was.value}) is gone after {what}")
        for key in sorted(set(got) - set(self.model.entries)):
            clause = "C3" if key in before.retired else "C2"
            raise ClauseViolation(clause, f"entry {key} ({before.state_of(key).value}) is "
                                          f"queued after {what}")
        for key, h in got.items():
            diff = schedule_diff(h.schedule, self.model.entries[key].schedule)
            if diff is not None:
                raise ClauseViolation("C5", f"entry {key} came back after {what} with a "
                                            f"{diff}")
            self.pool.append((h, key))
        if inflight or pending:
            raise ClauseViolation("C10", f"after {what}, {len(inflight)} entries are still "
                                         f"inflight and {len(pending)} pending cleanup")
        report: RecoveryReport = self._call("recover", self.store.recover)
        if (report.requeued, report.cleaned, report.uncommitted_removed,
                report.quarantined) != (0, 0, 0, 0):
            raise ClauseViolation("C10", f"a second recovery after {what} still found work "
                                         f"to do: {report}")
