"""Forced interleavings inside sync rounds (``Capability.IO_SEAM``): late callers must wait.

For every pair of operations (A, B) of ``OPERATIONS`` the backend supports (``hold`` and
``release`` with ``Capability.HOLD``) and every sync call A's operation makes (its j-th,
j = 0, 1, ... until A makes no more), one run on a fresh queue:

1. a message for A and one for B are brought to the state their operation needs;
2. A starts, and is stopped *inside* its j-th sync call, after the sync began and before
   it ended (``FaultyIO.pause_in_sync``): it may be the leader of a round, syncing for
   others;
3. B starts and runs until it has made its changes and waits (no call for ``QUIET``
   seconds; at most ``B_LIMIT``), or returns;
4. A is let go; both finish.

The trace is judged by the sync-cover rule (``conformance.harness.sync_cover``): an
operation that returned success must have had, for each change it waited on a sync for, a
covering sync that began after the change and ended before it returned.  A backend whose
running round acknowledges a caller that arrived during its sync (the caller's change came
after the sync began) fails: C1 for a commit, C3 for send_done and drop, C9 for the others.
Nothing depends on timing but step 3's wait: let go too early, B may make its change after
A's sync ended and so miss the interleaving (no finding), never produce a ride.

Scenario ``sync-rounds:<A>-vs-<B>:<j>``; the same run is made for it every time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from conformance.crashexplore.traced_runs import ScratchIO, scratch_dir
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.sync_cover import uncovered_acks
from faultinject.fault_errors import ModelError
from faultinject.seam import FaultyIO
from faultinject.trace import OperationSpan
from queue_ref.storage import (
    Capability,
    Handle,
    HeldMail,
    InflightMail,
    QueuedMail,
    QueueError,
    Recipient,
    Schedule,
    Storage,
)

OPERATIONS = ("commit", "send_done", "send_cancel", "reschedule", "hold", "release", "drop")
NEEDS_HOLD = frozenset({"hold", "release"})
#: B waits (for a later round) once it made no call for this long, seconds.
QUIET = 0.015
#: The longest B runs before A is let go anyway, seconds.
B_LIMIT = 1.0
#: A caller still running this long after A was let go hangs: an error.
HANG = 30.0
#: The most sync calls of one operation the check stops A in.
MAX_SYNCS = 12


#: The schedule of every message made here, and the ones send_cancel and reschedule give.
FIRST, CANCELLED, RESCHEDULED = Schedule(10), Schedule(20, 1), Schedule(30, 1)


def mail(tag: str) -> tuple[str, bytes, str]:
    """The sender, body and recipient of the message made for caller ``tag``."""
    return (f"{tag}@example.org", b"Subject: " + tag.encode() + b"\r\n\r\nsync rounds\r\n",
            f"{tag}@example.net")


def _commit(store: Storage, tag: str) -> list[QueuedMail]:
    sender, body, rcpt = mail(tag)
    with store.enqueue(sender) as enq:
        enq.write(body)
        return enq.commit([Recipient(rcpt, FIRST)])


def _prepare(store: Storage, op: str, tag: str) -> Handle | None:
    """A handle in the state ``op`` takes (None for ``commit``)."""
    if op == "commit":
        return None
    mail: Handle = _commit(store, tag)[0]
    if op in ("send_done", "send_cancel"):
        got = store.send_start(mail)  # type: ignore[arg-type]
        if got is None:
            raise RuntimeError(f"sync-rounds setup: send_start of {tag}'s message found nothing")
        mail = got
    elif op == "release":
        held = store.hold(mail)  # type: ignore[arg-type]
        if held is None:
            raise RuntimeError(f"sync-rounds setup: hold of {tag}'s message found nothing")
        mail = held
    return mail


def _act(store: Storage, io: FaultyIO, op: str, handle: Handle | None, tag: str,
         run: Interleaved) -> Callable[[], None]:
    outcome = run.outcome
    if handle is not None:
        run.ids[tag] = (handle.message_id, handle.entry_id)

    def body() -> None:
        try:
            with io.operation(op) as span:
                run.spans[tag] = span
                if op == "commit":
                    made = _commit(store, tag)[0]
                    run.ids[tag] = (made.message_id, made.entry_id)
                elif op == "send_done":
                    assert isinstance(handle, InflightMail)
                    store.send_done(handle)
                elif op == "send_cancel":
                    assert isinstance(handle, InflightMail)
                    store.send_cancel(handle, CANCELLED)
                elif op == "reschedule":
                    assert isinstance(handle, QueuedMail)
                    store.reschedule(handle, RESCHEDULED)
                elif op == "hold":
                    assert isinstance(handle, QueuedMail)
                    store.hold(handle)
                elif op == "release":
                    assert isinstance(handle, HeldMail)
                    store.release(handle)
                else:
                    assert isinstance(handle, QueuedMail)
                    store.drop(handle)
            outcome[tag] = "ok"
        except QueueError as e:
            outcome[tag] = f"{type(e).__name__}: {e}"
        except BaseException as e:  # reported as a finding, not lost in the thread
            outcome[tag] = f"raised {type(e).__name__}: {e}"

    return body


def _wait_for_b(io: FaultyIO, b: threading.Thread) -> None:
    """Until B has made no call for QUIET seconds (it waits; 3 QUIET if it made none
    yet: it may wait on a lock before its first call, or not have started), or ended."""
    deadline = time.monotonic() + B_LIMIT
    seen, since = -1, time.monotonic()
    while b.is_alive() and time.monotonic() < deadline:
        with io._mutex:
            mine = sum(1 for e in io.events if e.thread == b.ident)
        now = time.monotonic()
        if mine != seen:
            seen, since = mine, now
        elif now - since >= (QUIET if mine else 3 * QUIET):  # none: it waits on a lock
            return
        time.sleep(0.002)


@dataclass
class Interleaved:
    """One forced interleaving, run: its trace (``io``; ``at_rest``: the events before the
    queue was closed), each caller's outcome, span and entry ((message id, entry id), known
    once its operation returned or, for the others, from the start)."""

    a: str
    b: str
    j: int
    io: FaultyIO
    outcome: dict[str, str]
    spans: dict[str, OperationSpan]
    ids: dict[str, tuple[str, str]]
    at_rest: int = 0
    stopped_in: str = ""

    @property
    def steps(self) -> tuple[str, ...]:
        return (f"A: {self.a}, stopped inside its sync call #{self.j} ({self.stopped_in})",
                f"B: {self.b}, run until it waits; then A let go",
                f"A: {self.outcome.get('a')}; B: {self.outcome.get('b')}")


def interleave(backend: Backend, a: str, b: str, j: int) -> Interleaved | None:
    """A stopped in its ``j``-th sync while B runs (None: A makes fewer syncs)."""
    scenario = f"sync-rounds:{a}-vs-{b}:{j}"
    with scratch_dir("queue-ref-rounds-") as root:
        io = FaultyIO(root, inner=ScratchIO())
        store = backend.open(root, io)
        run = Interleaved(a, b, j, io, {}, {}, {})
        try:
            ha, hb = _prepare(store, a, "a"), _prepare(store, b, "b")
            gate = io.pause_in_sync(io.sync_count + j)
            ta = threading.Thread(target=_act(store, io, a, ha, "a", run), daemon=True)
            ta.start()
            while not gate.wait_reached(0.005) and ta.is_alive():
                pass
            if not gate.reached:
                gate.release()
                ta.join(HANG)
                return None
            run.stopped_in = str(gate.call)
            tb = threading.Thread(target=_act(store, io, b, hb, "b", run), daemon=True)
            tb.start()
            _wait_for_b(io, tb)
            gate.release()
            for t in (ta, tb):
                t.join(HANG)
                if t.is_alive():
                    raise RuntimeError(f"{scenario}: a caller still runs after {HANG:.0f} s "
                                       "(deadlock)")
            with io._mutex:
                run.at_rest = len(io.events)
        finally:
            store.close()
    return run


def run_case(backend: Backend, a: str, b: str, j: int) -> tuple[bool, list[Finding]]:
    """A stopped in its ``j``-th sync while B runs; (whether A made a j-th sync, findings)."""
    scenario = f"sync-rounds:{a}-vs-{b}:{j}"
    run = interleave(backend, a, b, j)
    if run is None:
        return False, []
    io, outcome, steps = run.io, run.outcome, run.steps
    found = [Finding("C9", f"{op} {what}; expected success or a QueueError", scenario,
                     NO_CRASH, steps)
             for op, what in ((a, outcome.get("a", "")), (b, outcome.get("b", "")))
             if what.startswith("raised")]
    try:
        bad = uncovered_acks(io.initial, io.events, io.operations)
    except ModelError as e:
        return True, [*found, Finding("C9", f"the trace cannot be replayed: {e}", scenario,
                                      NO_CRASH, steps)]
    return True, found + [Finding(u.clause, u.detail(), scenario, NO_CRASH,
                                  steps + u.excerpt) for u in bad]


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """Run ``sync-rounds:<A>-vs-<B>:<j>`` again."""
    try:
        head, names, j = scenario.split(":")
        a, b = names.split("-vs-")
        number = int(j)
    except ValueError:
        raise ValueError(f"not a sync-rounds scenario: {scenario!r} "
                         "(sync-rounds:<A>-vs-<B>:<sync call>)") from None
    if head != "sync-rounds" or a not in OPERATIONS or b not in OPERATIONS or number < 0:
        raise ValueError(f"not a sync-rounds scenario: {scenario!r} (operations: "
                         f"{', '.join(OPERATIONS)})")
    reached, found = run_case(backend, a, b, number)
    if not reached:
        raise ValueError(f"{scenario}: {a} makes fewer than {number + 1} sync calls here")
    return found


def pairs(capabilities: frozenset[Capability]) -> list[tuple[str, str]]:
    ops = [op for op in OPERATIONS if Capability.HOLD in capabilities or op not in NEEDS_HOLD]
    return [(a, b) for a in ops for b in ops]


def run(backend: Backend, seed: int, capabilities: frozenset[Capability]) -> CheckResult:
    start = time.perf_counter()
    findings: list[Finding] = []
    cases = 0
    for a, b in pairs(capabilities):
        for j in range(MAX_SYNCS):
            reached, found = run_case(backend, a, b, j)
            if not reached:
                break
            cases += 1
            findings += found
    return finished("sync-rounds", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats={"cases": cases, "pairs": len(pairs(capabilities))})
