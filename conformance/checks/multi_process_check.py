"""Several processes share one queue (``Capability.MULTI_PROCESS``).

The parent opens the queue and enqueues messages; child processes open the same queue,
wait at a common start line, list it and race ``send_start`` on every entry (but the
entries of two messages, which the first child claims before it races, so that it holds
claims whoever wins the race).  No entry
may be claimed by two processes (C7) and every entry is claimed by one.  The first child
then dies (SIGKILL) holding its claims; the others send and clean up theirs and close.
The parent's ``find_inflight`` must now return exactly the dead child's entries
(at-least-once, C4), each handle carrying the schedule the entry was committed with (C11:
the messages have schedules of their own, attempts included, so a handle made up anew is
seen); half of them are put back with ``send_cancel`` to the schedule their handle
carries, as a relay that could not deliver now does, and must be listed with it.  Once
everything is sent and cleaned up nothing is left (C8).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections import Counter

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Channel, Child
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import Recipient, Schedule


def _claimer(ch: Channel, backend: Backend, root: str, seed: int, keep: bool) -> None:
    store = backend.open(root)
    ch.send({"ready": True})
    go = ch.recv()  # the start line: every process waits here until all are open
    reserved = set(go.split())
    listed = list(store.list_queue())
    random.Random(seed).shuffle(listed)
    # the process to be killed takes the reserved entries first (the others leave them):
    # it always dies holding claims, however the race over the rest goes
    mine = [h for h in listed if h.entry_id in reserved] if keep else []
    rest = [h for h in listed if h.entry_id not in reserved]
    claimed = [f for f in (store.send_start(h) for h in mine + rest) if f is not None]
    ch.send({"claimed": [f.entry_id for f in claimed]})
    if keep:
        while True:
            time.sleep(1)
    for f in claimed:
        p = store.send_done(f)
        if p is not None:
            store.cleanup(p)
    store.close()


def run(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="queue-ref-multiproc-")
    findings: list[Finding] = []
    scenario = f"multi-process:{seed}"

    def fail(clause: str, detail: str) -> None:
        findings.append(Finding(clause, detail, scenario, NO_CRASH))

    n_msgs = 10 * profile.processes
    stats: dict[str, int] = {"processes": profile.processes, "entries": 2 * n_msgs}
    store = backend.open(root)
    children: list[Child] = []
    try:
        committed: dict[str, Schedule] = {}
        for m in range(n_msgs):
            sched = Schedule(1_000 + m, 1 + m % 3)
            with store.enqueue(f"m{m}@example.org") as enq:
                enq.write(b"Subject: shared\r\n\r\nbody\r\n")
                committed |= {h.entry_id: sched for h in enq.commit(
                    [Recipient(f"r{j}.m{m}@example.net", sched) for j in range(2)])}
        ids = set(committed)
        for k in range(profile.processes):
            children.append(Child(_claimer, backend, root, seed + k, k == 0))
        claims: dict[int, list[str]] = {}
        for k, c in enumerate(children):
            for msg in c.messages():
                if "crashed" in msg:
                    fail("C9", f"process {k} failed: {msg['crashed']}")
                    break
                if msg.get("ready"):
                    break
        reserved = sorted(committed)[-4:]  # two messages' entries, for the killed process
        for c in children:
            c.tell(" ".join(reserved))
        for k, c in enumerate(children):
            for msg in c.messages():
                if "claimed" in msg:
                    claims[k] = msg["claimed"]
                    if k == 0:
                        break
                if "crashed" in msg:
                    fail("C9", f"process {k} failed: {msg['crashed']}")
        children[0].kill()
        for c in children[1:]:
            c.wait()
        count = Counter(e for c in claims.values() for e in c)
        twice = sorted(e for e, n in count.items() if n > 1)
        if twice:
            fail("C7", f"{len(twice)} entries were claimed by two processes (first: {twice[0]})")
        if set(count) != ids and not findings:
            fail("C7", f"{len(ids - set(count))} entries were claimed by no process")
        stats["claimed_by_killed"] = len(claims.get(0, []))
        adopted = list(store.find_inflight())
        got = sorted(f.entry_id for f in adopted)
        want = sorted(claims.get(0, []))
        if got != want:
            fail("C4", f"after the process holding {len(want)} claims died, find_inflight "
                       f"returned {len(got)} entries ({len(set(got) & set(want))} of its)")
        wrong = [(f.entry_id, f.schedule) for f in adopted
                 if f.entry_id in committed and f.schedule != committed[f.entry_id]]
        if wrong:
            e, got_sched = wrong[0]
            fail("C11", f"{len(wrong)} of {len(adopted)} entries adopted by find_inflight "
                        f"carry a schedule other than the stored one (first: {e}: "
                        f"{got_sched!r}, stored {committed[e]!r})")
        back = {}
        for i, f in enumerate(adopted):
            if i % 2:
                # the schedule its handle carries; the stored one if that is already wrong
                # (a C11 finding above), so the rest of the run still says what it sees
                sched = f.schedule if not wrong else committed.get(f.entry_id, f.schedule)
                q = store.send_cancel(f, sched)
                if q is not None:
                    back[q.entry_id] = sched
                continue
            p = store.send_done(f)
            if p is not None:
                store.cleanup(p)
        for h in list(store.list_queue()):
            if h.entry_id in back and h.schedule != back[h.entry_id] and not wrong:
                fail("C11", f"entry {h.entry_id}, put back with send_cancel to "
                            f"{back[h.entry_id]!r}, is listed with {h.schedule!r}")
            f2 = store.send_start(h)
            if f2 is not None:
                p = store.send_done(f2)
                if p is not None:
                    store.cleanup(p)
        stats["put_back"] = len(back)
        left = list(store.list_queue())
        fp = store.footprint()
        if not findings and (left or fp.objects or fp.bytes):
            fail("C8", f"after everything was sent and cleaned up, {len(left)} entries are "
                       f"queued and {fp.objects} objects, {fp.bytes} bytes remain")
    finally:
        for c in children:
            c.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return finished("multi-process", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)
