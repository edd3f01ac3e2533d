"""Several processes share one queue (``Capability.MULTI_PROCESS``).

The parent opens the queue and enqueues messages; child processes open the same queue,
wait at a common start line, list it and race ``send_start`` on every entry.  No entry
may be claimed by two processes (C7) and every entry is claimed by one.  The first child
then dies (SIGKILL) holding its claims; the others send and clean up theirs and close.
The parent's ``find_inflight`` must now return exactly the dead child's entries
(at-least-once, C4), and once those are sent and cleaned up nothing is left.
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
    ch.recv()  # the start line: every process waits here until all are open
    listed = list(store.list_queue())
    random.Random(seed).shuffle(listed)
    claimed = [f for f in (store.send_start(h) for h in listed) if f is not None]
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
        ids = set()
        for m in range(n_msgs):
            with store.enqueue(f"m{m}@example.org") as enq:
                enq.write(b"Subject: shared\r\n\r\nbody\r\n")
                ids |= {h.entry_id for h in enq.commit(
                    [Recipient(f"r{j}.m{m}@example.net", Schedule(m)) for j in range(2)])}
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
        for c in children:
            c.tell("go")
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
        for f in adopted:
            p = store.send_done(f)
            if p is not None:
                store.cleanup(p)
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
