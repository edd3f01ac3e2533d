"""Drive a Storage in lockstep with the model, one workload call at a time.

``Driver`` keeps the live handle of every model entry, the map from the backend's
message and entry ids to the model's numbering (messages numbered in commit order, as
the model does), and the spare handles stale calls need: a stale ``send_start`` or
``reschedule`` goes through a handle listed by ``list_queue`` while the entry was still
QUEUED, as a second worker would hold it.

A backend answer that differs from the model's (a call the model says moves the entry
returning ``None``, a stale call succeeding) raises ``Divergence`` naming the clause it
breaks.  Everything else (``Crash``, ``StorageIOError``) passes through to the caller.

``Driver.operation``, when set (``FaultyIO.operation``), brackets each call: an enqueue
from ``enqueue`` to its commit's return as ``commit``, a transition by its name; the
sync-cover rule judges the spans (``traced_runs.run_workload``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from conformance.crashexplore.workloads import Workload
from queue_ref.storage import (
    Handle,
    HeldMail,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Storage,
)
from spec.model import Call, EntryKey, Model, run
from spec.states import EntryState, Op, Outcome

#: A body above ``ONE_WRITE_MAX`` bytes is written in pieces of these sizes, in turn: sizes
#: that are not multiples of a store's chunk, so that a store which streams a body into
#: chunks and batches (the KV queue's 64 KiB chunks, 1 MiB batches) carries a partial
#: chunk from one write to the next, as a relay's DATA phase does.
PIECES = (100_003, 250_007, 180_001, 299_993)
ONE_WRITE_MAX = 64 * 1024


def body_pieces(body: bytes) -> list[bytes]:
    """The writes that put ``body`` into an enqueue: one for a small body, else pieces
    of the ``PIECES`` sizes in turn."""
    if len(body) <= ONE_WRITE_MAX:
        return [body]
    out: list[bytes] = []
    off = 0
    while off < len(body):
        n = PIECES[len(out) % len(PIECES)]
        out.append(body[off:off + n])
        off += n
    return out


class Divergence(Exception):
    """The backend answered a call otherwise than the model, with no crash involved."""

    def __init__(self, index: int, call: Call, clause: str, detail: str) -> None:
        super().__init__(f"call {index} {call.describe()}: {detail}" if index >= 0 else detail)
        self.index = index
        self.call = call
        self.clause = clause
        self.detail = detail


def spare_plan(workload: Workload) -> dict[int, list[EntryKey]]:
    """After which call to list a spare handle for each stale call, and of which entry.

    A stale call at position ``j`` on entry ``k`` needs a QueuedMail listed after the
    last call before ``j`` that left ``k`` QUEUED.
    """
    models = [Model()]
    results: list[Outcome | int] = []
    for call in workload:
        after, res = run(models[-1], call)
        models.append(after)
        results.append(res)
    plan: dict[int, list[EntryKey]] = {}
    for j, (call, res) in enumerate(zip(workload, results, strict=True)):
        if res is not Outcome.VANISHED:
            continue
        assert call.key is not None
        if call.op not in (Op.SEND_START, Op.RESCHEDULE, Op.DROP):
            raise ValueError(f"call {j} {call.describe()}: only send_start, reschedule and "
                             "drop can be stale (through a handle listed earlier)")
        # models[p + 1] is the state after call p
        queued_after = [p for p in range(j) if models[p + 1].state_of(call.key)
                        is EntryState.QUEUED]
        if not queued_after:
            raise ValueError(f"call {j} {call.describe()}: the entry was never queued, "
                             "so no handle for it can exist")
        plan.setdefault(queued_after[-1], []).append(call.key)
    return plan


@dataclass
class Driver:
    storage: Storage
    handles: dict[EntryKey, Handle] = field(default_factory=dict)
    spares: dict[EntryKey, list[QueuedMail]] = field(default_factory=dict)
    message_ids: dict[str, int] = field(default_factory=dict)
    entry_keys: dict[str, EntryKey] = field(default_factory=dict)
    #: called with the call's index once an enqueue's body is written, before its commit
    before_commit: Callable[[int], None] | None = None
    #: brackets each call by the name of its operation (``FaultyIO.operation``)
    operation: Callable[[str], AbstractContextManager[object]] | None = None

    def _bracket(self, name: str) -> AbstractContextManager[object]:
        return contextlib.nullcontext() if self.operation is None else self.operation(name)

    def step(self, index: int, model: Model, call: Call) -> Model:
        """Perform ``call`` on the backend; returns the model after it."""
        after, result = run(model, call)
        if call.op is Op.ENQUEUE:
            assert isinstance(result, int)
            with self._bracket("commit"):
                self._enqueue(index, call, result)
            return after
        if call.op is Op.SEND_FINISH:
            with self._bracket(call.op.value):
                self._finish(index, model, call)
            return after
        if call.op is Op.CLEANUP_ALL:
            with self._bracket(call.op.value):
                self._cleanup_all(index, model, call)
            return after
        assert call.key is not None
        key = call.key
        if result is Outcome.MOVED:
            handle = self.handles.pop(key)
        else:
            pool = self.spares.get(key)
            if not pool:
                raise ValueError(f"call {index} {call.describe()} is stale but no spare "
                                 "handle was listed for it (see spare_plan)")
            handle = pool.pop(0)
        with self._bracket(call.op.value):
            got = self._call(call, handle)
        if result is Outcome.MOVED:
            if got is None or got is False:
                raise Divergence(index, call, "C1",
                                 "the backend answered VANISHED for an entry in the source "
                                 f"state ({model.state_of(key).value})")
            if isinstance(got, Handle):
                want = after.entries[key].schedule
                if got.schedule != want:
                    raise Divergence(index, call, "C5",
                                     f"the new handle has schedule {got.schedule}, not {want}")
                self.handles[key] = got
        elif got is not None and got is not False:
            was = model.state_of(key)
            clause = "C7" if call.op is Op.SEND_START else (
                "C3" if key in model.retired else "C5")
            raise Divergence(index, call, clause,
                             f"a stale handle acted on an entry that is {was.value}")
        return after

    def _finish(self, index: int, model: Model, call: Call) -> None:
        """A SEND_FINISH: one ``send_finish`` of every step, each answer checked as its
        own call's would be.  Every step must move (no stale InflightMail exists)."""
        after, outcomes = model.finish(call.parts)
        if Outcome.VANISHED in outcomes:
            raise ValueError(f"call {index} {call.describe()}: a send_finish step whose "
                             "entry is not INFLIGHT has no handle to pass")
        done = [p for p in call.parts if p.op is Op.SEND_DONE]
        cancel = [p for p in call.parts if p.op is Op.SEND_CANCEL]
        got = self.storage.send_finish(
            [self.handles.pop(p.key) for p in done if p.key is not None],  # type: ignore[misc]
            [(self.handles.pop(p.key), p.schedule) for p in cancel  # type: ignore[misc]
             if p.key is not None and p.schedule is not None])
        if len(got.done) != len(done) or len(got.cancelled) != len(cancel):
            raise Divergence(index, call, "API",
                             f"send_finish answered {len(got.done)} and "
                             f"{len(got.cancelled)} results for {len(done)} and {len(cancel)}")
        for p, h in [*zip(done, got.done, strict=True), *zip(cancel, got.cancelled,
                                                              strict=True)]:
            assert p.key is not None
            if h is None:
                raise Divergence(index, call, "C1",
                                 f"send_finish answered VANISHED for entry {p.key}, which "
                                 "was INFLIGHT")
            want = after.entries[p.key].schedule
            if h.schedule != want:
                raise Divergence(index, call, "C5", f"the new handle of entry {p.key} has "
                                                    f"schedule {h.schedule}, not {want}")
            self.handles[p.key] = h

    def _cleanup_all(self, index: int, model: Model, call: Call) -> None:
        """A CLEANUP_ALL: one ``cleanup_all`` of every step, each answer checked as its own
        ``cleanup``'s would be.  Every step must move (no stale PendingCleanupMail)."""
        _, outcomes = model.finish(call.parts, Op.CLEANUP_ALL)
        if Outcome.VANISHED in outcomes:
            raise ValueError(f"call {index} {call.describe()}: a cleanup_all step whose "
                             "entry is not PENDING_CLEANUP has no handle to pass")
        got = self.storage.cleanup_all(
            [self.handles.pop(p.key) for p in call.parts if p.key is not None])
        if len(got) != len(call.parts):
            raise Divergence(index, call, "API", f"cleanup_all answered {len(got)} results "
                                                 f"for {len(call.parts)} entries")
        for p, released in zip(call.parts, got, strict=True):
            if released is not True:
                raise Divergence(index, call, "C1",
                                 f"cleanup_all answered {released!r} for entry {p.key}, "
                                 "which was PENDING_CLEANUP")

    def take_spares(self, keys: Iterable[EntryKey]) -> None:
        """List the queue and keep one more handle of each entry of ``keys``; an entry the
        listing misses is a ``Divergence`` (API: a listing that misses an entry)."""
        for key in keys:
            found = [q for q in self.storage.list_queue() if self.entry_keys.get(q.entry_id)
                     == key]
            if not found:
                raise Divergence(-1, Call(Op.SEND_START, key), "API",
                                 f"list_queue does not list entry {key}, which is QUEUED")
            self.spares.setdefault(key, []).append(found[0])

    def _enqueue(self, index: int, call: Call, mid: int) -> None:
        enq = self.storage.enqueue(call.mail_from)
        try:
            for piece in body_pieces(call.body):
                enq.write(piece)
            if self.before_commit is not None:
                self.before_commit(index)
            got = enq.commit([Recipient(r, s) for r, s in call.rcpts])
        except Exception:
            # as every caller does (a relay's DATA phase, ``with storage.enqueue()``): a
            # failed write or commit is aborted, and what it stored goes then (C8); a
            # simulated crash (a BaseException) is a process that died: nothing runs
            enq.abort()
            raise
        if len(got) != len(call.rcpts):
            raise Divergence(index, call, "C2",
                             f"commit returned {len(got)} handles for {len(call.rcpts)} "
                             "recipients")
        self.message_ids[got[0].message_id] = mid
        for i, h in enumerate(got):
            self.handles[(mid, i)] = h
            self.entry_keys[h.entry_id] = (mid, i)

    def _call(self, call: Call, h: Handle) -> Handle | bool | None:
        s = self.storage
        op = call.op
        if op is Op.RESCHEDULE:
            assert isinstance(h, QueuedMail) and call.schedule is not None
            return s.reschedule(h, call.schedule)
        if op is Op.SEND_START:
            assert isinstance(h, QueuedMail)
            return s.send_start(h)
        if op is Op.DROP:
            assert isinstance(h, QueuedMail)
            return s.drop(h)
        if op is Op.SEND_CANCEL:
            assert isinstance(h, InflightMail) and call.schedule is not None
            return s.send_cancel(h, call.schedule)
        if op is Op.SEND_DONE:
            assert isinstance(h, InflightMail)
            return s.send_done(h)
        if op is Op.CLEANUP:
            assert isinstance(h, PendingCleanupMail)
            return s.cleanup(h)
        if op is Op.HOLD:
            assert isinstance(h, QueuedMail)
            return s.hold(h)
        if op is Op.RELEASE:
            assert isinstance(h, HeldMail)
            return s.release(h)
        if op is Op.DROP_HELD:
            assert isinstance(h, HeldMail)
            return s.drop_held(h)
        raise ValueError(f"unknown operation {op!r}")


def drive(storage: Storage, workload: Workload, *, driver: Driver | None = None,
          stop: int | None = None) -> tuple[Driver, Model]:
    """Run ``workload[:stop]`` on ``storage``; returns the driver and the model after it.

    Exceptions (a ``Crash`` included) propagate; ``driver`` then holds the maps built
    so far.
    """
    d = driver if driver is not None else Driver(storage)
    plan = spare_plan(workload)
    model = Model()
    for i, call in enumerate(workload[:stop]):
        model = d.step(i, model, call)
        if i in plan:
            d.take_spares(plan[i])
    return d, model


def drive_and_report(send: Callable[[dict[str, Any]], None], store: Storage,
                     workload: Workload, *, before: Callable[[int], None] | None = None,
                     returned: Callable[[int], None] | None = None) -> bool:
    """Run ``workload`` on ``store`` in a child process, telling the parent through
    ``send`` when each call begins (``{"b": i}``) and was acknowledged (``{"a": i}`` with
    the message and entry ids it made known), a divergence from the model
    (``{"divergence": clause, ...}``), and the end (``{"done": n}``).  ``before(i)`` runs
    as call ``i`` begins, ``returned(i)`` once it returned and before it is reported (a
    process-kill trial dies there).  False if a divergence stopped the run."""
    driver = Driver(store)
    plan = spare_plan(workload)
    model = Model()
    known_m: set[str] = set()
    known_e: set[str] = set()
    for i, call in enumerate(workload):
        send({"b": i})
        if before is not None:
            before(i)
        try:
            model = driver.step(i, model, call)
        except Divergence as d:
            send({"divergence": d.clause, "detail": str(d), "i": i})
            return False
        if returned is not None:
            returned(i)
        new_m = {k: v for k, v in driver.message_ids.items() if k not in known_m}
        new_e = {k: list(v) for k, v in driver.entry_keys.items() if k not in known_e}
        known_m.update(new_m)
        known_e.update(new_e)
        send({"a": i, "m": new_m, "e": new_e})
        if i in plan:
            try:
                driver.take_spares(plan[i])
            except Divergence as d:
                send({"divergence": d.clause, "detail": str(d), "i": i})
                return False
    send({"done": len(workload)})
    return True


def model_before(workload: Workload, n: int) -> Model:
    """The model's state after the first ``n`` calls of ``workload``."""
    model = Model()
    for call in workload[:n]:
        model, _ = run(model, call)
    return model
