"""Traced runs of a workload: every disk call recorded, optionally crashed or failed.

* ``run_workload``: run a workload on a fresh directory through ``FaultyIO`` (optionally
  crashing or failing at a mutating call), keeping the trace, the model state before
  every call, the ids the backend gave, and each call's span for the sync-cover rule
  (``uncovered``).
* ``Run.rest_cut``: where in the trace of a run that did not crash a crash *at rest*
  falls: after a number of calls returned, with no operation in flight and the backend
  not closed (whatever it kept in its own memory dies with the process).
* ``sync_points``, ``events_through``: where a call's fsyncs are, where its events end.
* ``scratch_dir``, ``ScratchIO``: throwaway directories and a seam without real syncs
  (crash states are built from the trace, never from what the real disk kept).

Every directory made here is removed before the function returns (a ``root`` passed in
is the caller's).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.workload_driver import Divergence, Driver, spare_plan
from conformance.crashexplore.workloads import Workload
from conformance.harness.sync_cover import BackgroundSyncHoldIO, exposed, uncovered_acks
from faultinject.disk import DiskImage
from faultinject.fault_errors import Crash
from faultinject.seam import FaultPlan
from faultinject.trace import SYNC_CALLS, OperationSpan, TraceEvent
from queue_ref.io import OsIO
from queue_ref.storage import (
    Footprint,
    QueueError,
    ReopenRequiredError,
    Storage,
    StorageIOError,
)
from spec.model import Call, Model, Schedule
from spec.states import Op

OPEN = -1  # the "call" index of opening the queue (before the workload's first call)


@dataclass(frozen=True)
class Limits:
    """How many crash states to build per crash point (see ``faultinject.models``)."""

    exhaustive_limit: int = 10
    random_states: int = 8
    seed: int = 0


def scratch_base() -> str | None:
    """Where scratch directories go: ``$QUEUE_REF_SCRATCH``, else ``/dev/shm`` (a tmpfs:
    exploration creates and removes thousands of small trees), else the system default."""
    env = os.environ.get("QUEUE_REF_SCRATCH")
    if env:
        return env
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return None


@contextmanager
def scratch_dir(prefix: str = "queue-ref-crash-") -> Iterator[str]:
    d = tempfile.mkdtemp(prefix=prefix, dir=scratch_base())
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def image_digest(image: DiskImage) -> str:
    """A short stable name of a disk image's contents."""
    return hashlib.sha256(pickle.dumps(image, protocol=4)).hexdigest()[:16]


class ScratchIO(OsIO):
    """``OsIO`` whose syncs only check their argument: crash states are built from the
    trace, never from what the real disk kept, so the exploration's throwaway
    directories need no real fsync (and run many times faster without)."""

    def fsync(self, fd: int) -> None:
        os.fstat(fd)

    def fdatasync(self, fd: int) -> None:
        os.fstat(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.close(fd)

    def syncfs(self, path: str) -> None:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))


@dataclass
class Run:
    """One run of a workload through ``FaultyIO``."""

    workload: Workload
    initial: DiskImage
    events: list[TraceEvent]
    trace_hash: str
    models: list[Model]  # models[i]: the state call i met; then the state after the last
    op_starts: list[int]  # the mutating-call count when call i began
    op_ends: list[int]  # ... and when it returned (or raised)
    message_ids: dict[str, int] = field(default_factory=dict)
    entry_keys: dict[str, tuple[int, int]] = field(default_factory=dict)
    stopped_in: int | None = None  # call index where a Crash or an error stopped the run
    crashed: bool = False
    error: BaseException | None = None  # what a call raised (not a Crash)
    divergence: Divergence | None = None
    mutating_total: int = 0
    open_end: int = 0  # the mutating-call count when opening the queue returned
    workload_end: int = 0  # len(events) when the last call returned (before any close)
    #: enqueue call i -> the mutating-call count once its body was written (its commit's
    #: start)
    commit_starts: dict[int, int] = field(default_factory=dict)
    open_events: int = 0  # len(events) when opening the queue returned
    event_ends: list[int] = field(default_factory=list)  # len(events) when call i returned
    close_error: BaseException | None = None  # what closing the queue after the run raised
    #: After a call failed with StorageIOError (not ReopenRequiredError), what the queue,
    #: still open, listed right then (entry id -> schedule); None if not listed.
    live_queued: dict[str, Schedule] | None = None
    #: ... or what that listing raised, if not a QueueError (a QueueError is a refusal).
    live_listing_error: str | None = None
    #: With a plan that fails a call: ``footprint()`` right before each enqueue (call index
    #: -> value),
    #: and right after a call failed, in the queue still open (None: not taken).
    footprints: dict[int, Footprint] = field(default_factory=dict)
    live_footprint: Footprint | None = None
    #: each workload call's span on the seam's counter (``FaultyIO.operation``)
    operations: list[OperationSpan] = field(default_factory=list)

    def returned(self) -> int:
        """How many calls of the workload returned (raising counts as not returning)."""
        if self.stopped_in is None:
            return len(self.workload)
        return max(self.stopped_in, 0)

    def rest_cut(self, calls: int) -> int:
        """How many trace events a crash at rest after ``calls`` calls returned keeps.

        The process dies between two calls: no operation is in flight and the backend is
        not closed, so what it kept in memory is lost; what reached the seam is in the
        trace.  ``calls`` is 0 (right after opening the queue) up to ``returned()``.
        Raises ``ValueError`` for a point the run did not reach.
        """
        if self.stopped_in == OPEN or not 0 <= calls <= self.returned():
            raise ValueError(f"the run has no rest point after {calls} calls (it returned "
                             f"from {self.returned()} of {len(self.workload)} calls)")
        return self.open_events if calls == 0 else self.event_ends[calls - 1]

    def interrupted(self) -> tuple[Model, Call | None]:
        """The model state the interrupted call met, and the call (None: opening)."""
        i = self.stopped_in
        if i is None or i == OPEN:
            return Model(), None
        return self.models[i], self.workload[i]

    def call_of_event(self, event_index: int) -> int:
        """The workload call during which trace event ``event_index`` was made (OPEN for
        opening the queue, len(workload) for closing it)."""
        m = sum(1 for e in self.events[:event_index] if e.mutating)
        for i in range(len(self.op_starts)):
            if self.op_starts[i] <= m < self.op_ends[i]:
                return i
        return OPEN if not self.op_starts or m < self.op_starts[0] else len(self.workload)


def run_workload(backend: BackendSpec, workload: Workload, plan: FaultPlan | None = None,
                 *, root: str | None = None) -> Run:
    """Run ``workload`` through ``FaultyIO`` with ``plan``; stop at a crash or an error.

    The seam holds open the syncs of any thread of the backend's own
    (``sync_cover.BackgroundSyncHoldIO``; the workload's thread's are instants, as
    before), and each call is bracketed (``Run.operations``) for the sync-cover rule.

    A call that raises (an injected EIO) ends the run there.  The trace (``events``,
    ``trace_hash``) ends where the workload stopped: a power cut that follows sees the
    disk as the last call left it.  Unless the process "died", the queue is then closed
    to release its files; those calls are not in the trace, so a crash at the end of the
    trace (``rest_cut``) is one of a process that never closed the queue.
    """
    if root is None:
        with scratch_dir() as d:
            return run_workload(backend, workload, plan, root=d)
    io = BackgroundSyncHoldIO(root, plan, inner=ScratchIO())
    models = [Model()]
    starts: list[int] = []
    ends: list[int] = []
    run = Run(workload, io.initial, io.events, "", models, starts, ends)
    storage: Storage | None = None
    current = OPEN
    driver: Driver | None = None
    event_ends = run.event_ends
    try:
        storage = backend.open(root, io)
        run.open_end = io.mutating_count
        run.open_events = len(io.events)
        driver = Driver(storage, operation=io.operation)
        driver.before_commit = lambda i: run.commit_starts.__setitem__(i, io.mutating_count)
        spares = spare_plan(workload)
        for i, call in enumerate(workload):
            current = i
            if plan is not None and plan.fail_at is not None and call.op is Op.ENQUEUE:
                # reads only, before the call's mutating count starts: a failed enqueue
                # must leave the footprint as it found it (C8), without a restart
                with contextlib.suppress(QueueError):
                    run.footprints[i] = storage.footprint()
            starts.append(io.mutating_count)
            try:
                models.append(driver.step(i, models[-1], call))
                if i in spares:
                    driver.take_spares(spares[i])
            except Divergence as d:
                run.divergence = d
                run.stopped_in = i
                ends.append(io.mutating_count)
                break
            except Exception as e:
                run.error = e
                run.stopped_in = i
                ends.append(io.mutating_count)
                break
            ends.append(io.mutating_count)
            event_ends.append(len(io.events))
        else:
            current = len(workload)
    except Crash:
        run.crashed = True
        run.stopped_in = current
        if len(ends) < len(starts):
            ends.append(io.mutating_count)
    except Exception as e:
        if current != OPEN:
            raise
        run.error = e  # opening failed (an injected fault in the queue's creation)
        run.stopped_in = OPEN
    if driver is not None:
        run.message_ids = dict(driver.message_ids)
        run.entry_keys = dict(driver.entry_keys)
    run.events = list(io.events)
    run.operations = list(io.operations)
    run.workload_end = len(run.events)
    run.trace_hash = io.trace_hash()
    run.mutating_total = io.mutating_count
    if storage is not None and isinstance(run.error, StorageIOError) \
            and not isinstance(run.error, ReopenRequiredError):
        _list_live(storage, run)
    if storage is not None and not run.crashed:
        try:
            storage.close()
        except Exception as e:  # after an injected fault a close may fail, and say so
            run.close_error = e
    return run


def uncovered(run: Run) -> list[tuple[str, str]]:
    """The sync-cover rule on ``run``'s trace (``conformance.harness.sync_cover``):
    (clause, detail with the calls in between) of every acknowledgement that rode a sync
    begun before its change.  Replays the trace only if a sync of another thread
    overlapped a call (``sync_cover.exposed``).  Raises ``faultinject.ModelError`` if it
    cannot be replayed."""
    spans = exposed(run.events, run.operations)
    if not spans:
        return []
    return [(u.clause, "\n".join((f"sync-cover rule: {u.detail()}; trace:", *u.excerpt)))
            for u in uncovered_acks(run.initial, run.events, spans)]


def _list_live(storage: Storage, run: Run) -> None:
    """What the open queue lists right after a call failed (after the trace ends: the
    listing is not part of what a power cut can see)."""
    with contextlib.suppress(QueueError):
        run.live_footprint = storage.footprint()
    try:
        run.live_queued = {h.entry_id: h.schedule for h in storage.list_queue()}
    except QueueError:
        pass  # the queue refuses to list after the failure, and says so
    except Exception as e:
        run.live_listing_error = f"{type(e).__name__}: {e}"


def sync_points(run: Run, call: int) -> list[int]:
    """Mutating indexes of the fsyncs (file or directory) made during ``call``."""
    out, m = [], 0
    for e in run.events:
        if e.mutating:
            if e.name in SYNC_CALLS and run.op_starts[call] <= m < run.op_ends[call]:
                out.append(m)
            m += 1
    return out


def events_through(run: Run, call: int) -> int:
    """How many events precede the end of ``call`` (a later call's events excluded)."""
    m = 0
    for pos, e in enumerate(run.events):
        if e.mutating:
            if m >= run.op_ends[call]:
                return pos
            m += 1
    return len(run.events)
