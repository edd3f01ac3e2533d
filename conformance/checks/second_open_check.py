"""A second open while the queue is open and holds a claim (every backend with a root).

The parent opens the queue, enqueues two messages and claims one entry (it holds it
INFLIGHT, a live owner's claim).  Then:

1. the same process opens the queue again;
2. another process opens it, lists it, calls ``find_inflight`` and closes;
3. the parent delivers its claimed entry (``send_done``, ``cleanup``), closes, and the
   queue is opened once more: the other message is still queued, once.

Each second open may be refused with a ``QueueError`` (a backend of one owner, such as a
KV store holding a lock) or may open (a queue processes share); one that opens must not
list the held entry as queued nor adopt it (C4: an entry a live owner holds is never
handed out again; C7).  Any other exception breaks C9.  Step 2 comes after step 1 on
purpose: a lock that a refused open in the same process lets go (POSIX record locks are
the process's, and closing any descriptor of the file drops them, which is how LevelDB's
own ``LOCK`` behaves when a second open in one process is refused) leaves the queue open
to a second owner, who then requeues the live claim.

Scenario ``second-open``: the same steps (they draw nothing at random).
"""

from __future__ import annotations

import time
from typing import Any

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import (
    CheckResult,
    Finding,
    Status,
    findings_in_scratch,
    finished,
)
from conformance.harness.child_process import Channel, Child
from queue_ref.storage import QueueError, Recipient, Schedule, Storage

SCENARIO = "second-open"
STEPS = ("open the queue, enqueue two messages, claim the first one's entry and hold it",
         "open the queue again in the same process", "open it in another process: list "
         "it, find_inflight, close", "deliver the held entry, close, open and read back")


def _look(store: Storage) -> dict[str, list[str]]:
    return {"listed": sorted(h.entry_id for h in store.list_queue()),
            "adopted": sorted(f.entry_id for f in store.find_inflight())}


def _other_process(ch: Channel, backend: Backend, root: str) -> None:
    try:
        store = backend.open(root)
    except QueueError as e:
        ch.send({"refused": f"{type(e).__name__}: {e}"})
        return
    except Exception as e:
        ch.send({"raised": f"{type(e).__name__}: {e}"})
        return
    try:
        ch.send(_look(store))
    finally:
        store.close()


def _judge(who: str, seen: dict[str, Any], held: str, fail: list[tuple[str, str]]) -> None:
    if "raised" in seen:
        fail.append(("C9", f"{who} raised {seen['raised']}; a second open either opens or "
                           "is refused with a QueueError"))
    if held in seen.get("listed", ()):
        fail.append(("C4", f"{who} opened and lists entry {held} as queued, which the first "
                           "open holds INFLIGHT and is delivering: it would be sent twice"))
    if held in seen.get("adopted", ()):
        fail.append(("C7", f"{who} opened and adopted entry {held} with find_inflight, "
                           "although its owner is alive and holds it"))


def _steps(backend: Backend, root: str, stats: dict[str, int]) -> list[tuple[str, str]]:
    fail: list[tuple[str, str]] = []
    first = backend.open(root)
    try:
        ids = []
        for i in range(2):
            with first.enqueue(f"s{i}@example.org") as enq:
                enq.write(b"Subject: second open %d\r\n\r\nbody\r\n" % i)
                ids.append(enq.commit([Recipient(f"r{i}@example.net", Schedule(i))])[0])
        claim = first.send_start(ids[0])
        if claim is None:
            return [("C7", f"the queue's only user could not claim entry {ids[0].entry_id}")]
        held, other = ids[0].entry_id, ids[1].entry_id
        # 1. a second open in this process
        try:
            again = backend.open(root)
        except QueueError as e:
            stats["refused_here"] = 1
            seen: dict[str, Any] = {"refused": str(e)}
        except Exception as e:
            seen = {"raised": f"{type(e).__name__}: {e}"}
        else:
            try:
                seen = _look(again)
            finally:
                again.close()
        _judge("a second open in the same process", seen, held, fail)
        # 2. an open in another process
        child = Child(_other_process, backend, root)
        try:
            got = child.drain(60.0)
        finally:
            child.close()
        seen = next((m for m in got if {"refused", "raised", "listed"} & set(m)),
                    {"raised": f"the process ended without an answer: {got}"})
        stats["refused_there"] = int("refused" in seen)
        _judge("an open in another process (after the second open in this one)", seen,
               held, fail)
        # 3. the holder goes on
        done = first.send_done(claim)
        if done is None:
            fail.append(("C4", f"the first open's send_done of its held entry {held} "
                               "returned None after the second opens: its claim was taken"))
        else:
            first.cleanup(done)
    finally:
        first.close()
    last = backend.open(root)
    try:
        listed = [h.entry_id for h in last.list_queue()]
    finally:
        last.close()
    if listed != [other]:
        fail.append(("C4", f"opened once more, the queue lists {listed}; it holds entry "
                           f"{other} alone (entry {held} was delivered)"))
    return fail


def replay(backend: Backend) -> list[Finding]:
    return _run(backend, {})


def _run(backend: Backend, stats: dict[str, int]) -> list[Finding]:
    return findings_in_scratch("queue-ref-second-open-",
                               lambda root: _steps(backend, root, stats), SCENARIO, STEPS)


def run(backend: Backend) -> CheckResult:
    start = time.perf_counter()
    if not backend.takes_root:
        return CheckResult("second-open", NO_CRASH, Status.UNSUPPORTED,
                           note="the backend keeps nothing at a location (its factory "
                                "takes no root): every open is a new queue")
    stats = {"refused_here": 0, "refused_there": 0}
    findings = _run(backend, stats)
    return finished("second-open", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    stats=stats)
