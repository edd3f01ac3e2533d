"""Scale and concurrency within one process.

``many-recipients``: one message to N recipients (10,000 in both profiles).  Commit
returns N handles in recipient order, the queue lists N entries, a sample of them (all
of them in the thorough profile) is claimed, read back (each entry has its own
recipient and index, and the one body), sent and cleaned up; when all were, nothing is
left.

``threads``: several threads enqueue at once, then race ``send_start`` on the same
entries through their own listings: every entry is claimed exactly once; then every
claim is sent and cleaned up concurrently and nothing is left.  A backend with the I/O
seam runs through a recording ``FaultyIO`` (scratch syncs, each held open
``THREAD_SYNC_HOLD`` seconds so that callers arrive while it runs), its commits and
``send_done`` calls bracketed, and the trace is judged at the end by the sync-cover rule
(``conformance.harness.sync_cover``): an acknowledgement that rode a sync begun before
its change is C1 (commit) or C3 (send_done).  Which callers meet inside a sync is the
threads' luck; what the rule makes of a trace is not.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from conformance.crashexplore.traced_runs import ScratchIO, scratch_base
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.suite_profiles import Profile
from conformance.harness.sync_cover import uncovered_on
from faultinject.fault_errors import ModelError
from faultinject.seam import FaultyIO
from queue_ref.storage import (
    Capability,
    InflightMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
)

BODY = b"Subject: many\r\n\r\n" + b"line of body\r\n" * 200
#: Seconds the threads check holds each sync open, for a backend with the I/O seam.
THREAD_SYNC_HOLD = 0.0005


def _with_store(backend: Backend, fn: Callable[[Storage], None],
                io: Callable[[str], FaultyIO] | None = None) -> None:
    """``fn`` on a queue opened in a fresh directory (through the seam ``io(root)`` makes,
    if given)."""
    root = tempfile.mkdtemp(prefix="queue-ref-scale-",
                            dir=None if io is None else scratch_base())
    try:
        store = backend.open(root) if io is None else backend.open(root, io(root))
        try:
            fn(store)
        finally:
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _lifecycle(store: Storage, h: QueuedMail, index: int, addr: str, out: list[str]) -> None:
    f = store.send_start(h)
    if f is None:
        out.append(f"C7|send_start of listed entry {index} answered VANISHED")
        return
    with store.read_inflight(f) as r:
        body = r.read_all()
        meta = r.meta
    if (meta.rcpt, meta.rcpt_index, body) != (addr, index, BODY):
        out.append(f"C6|entry {index} reads back rcpt {meta.rcpt!r} index {meta.rcpt_index} "
                   f"and {len(body)} body bytes; committed {addr!r}, {index}, {len(BODY)}")
    p = store.send_done(f)
    if p is None or not store.cleanup(p):
        out.append(f"C8|entry {index} could not be sent and cleaned up")


def many_recipients(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    n = profile.many_recipients
    problems: list[str] = []
    stats: dict[str, float | int] = {"recipients": n}
    rng = random.Random(seed)

    def body(store: Storage) -> None:
        addrs = [f"rcpt{i}@d{i % 97}.example" for i in range(n)]
        t = time.perf_counter()
        with store.enqueue("many@example.org") as enq:
            enq.write(BODY)
            got = enq.commit([Recipient(a, Schedule(i)) for i, a in enumerate(addrs)])
        stats["commit_seconds"] = round(time.perf_counter() - t, 3)
        if len(got) != n or len({h.entry_id for h in got}) != n:
            problems.append(f"C2|commit of {n} recipients returned {len(got)} handles, "
                            f"{len({h.entry_id for h in got})} distinct")
            return
        index = {h.entry_id: i for i, h in enumerate(got)}
        bad = [i for i, h in enumerate(got) if h.schedule != Schedule(i)]
        if bad:
            problems.append(f"C6|handles of {len(bad)} recipients carry another recipient's "
                            f"schedule (first: {bad[0]})")
        t = time.perf_counter()
        listed = list(store.list_queue())
        stats["list_seconds"] = round(time.perf_counter() - t, 3)
        ids = Counter(h.entry_id for h in listed)
        if set(ids) != set(index) or any(c > 1 for c in ids.values()):
            problems.append(f"C2|the queue lists {len(listed)} entries ({len(ids)} distinct, "
                            f"{len(set(ids) & set(index))} of the committed {n})")
            return
        chosen = listed if profile.many_full_drain else rng.sample(listed, min(50, n))
        t = time.perf_counter()
        for h in chosen:
            i = index[h.entry_id]
            _lifecycle(store, h, i, addrs[i], problems)
        stats["lifecycles"] = len(chosen)
        stats["lifecycle_seconds"] = round(time.perf_counter() - t, 3)
        if profile.many_full_drain:
            fp = store.footprint()
            if fp.objects or fp.bytes:
                problems.append(f"C8|after all {n} entries were cleaned up, {fp.objects} "
                                f"objects and {fp.bytes} bytes remain")

    start = time.perf_counter()
    _with_store(backend, body)
    findings = [Finding(p.split("|")[0], p.split("|", 1)[1], f"many-recipients:{n}", NO_CRASH)
                for p in problems]
    return finished("many-recipients", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)


def threads(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    nthreads, per = profile.threads, profile.thread_messages
    problems: list[str] = []
    errors: list[str] = []
    stats: dict[str, int | float] = {"threads": nthreads, "messages": nthreads * per}
    seams: list[FaultyIO] = []  # the recording seam, for a backend that declares one

    def traced(root: str) -> FaultyIO:
        seams.append(FaultyIO(root, inner=ScratchIO(), sync_hold=THREAD_SYNC_HOLD))
        return seams[0]

    def operation(name: str) -> AbstractContextManager[object]:
        return seams[0].operation(name) if seams else nullcontext()

    def run_threads(target: Callable[[int], None]) -> None:
        ts = [threading.Thread(target=_guard(target, errors), args=(k,))
              for k in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def body(store: Storage) -> None:
        committed: list[list[QueuedMail]] = [[] for _ in range(nthreads)]

        def produce(k: int) -> None:
            for m in range(per):
                with operation("commit"), store.enqueue(f"t{k}.m{m}@example.org") as enq:
                    enq.write(BODY)
                    committed[k] += enq.commit([Recipient(f"r{j}.t{k}.m{m}@example.net",
                                                          Schedule(m)) for j in range(2)])

        run_threads(produce)
        all_ids = [h.entry_id for hs in committed for h in hs]
        if errors or len(set(all_ids)) != 2 * nthreads * per:
            problems.append(f"C2|concurrent enqueues gave {len(set(all_ids))} distinct entries "
                            f"for {2 * nthreads * per} recipients")
            return
        listings = [list(store.list_queue()) for _ in range(nthreads)]
        for k, lst in enumerate(listings):
            random.Random(seed + k).shuffle(lst)
        claims: list[list[InflightMail]] = [[] for _ in range(nthreads)]

        def claim(k: int) -> None:
            for h in listings[k]:
                f = store.send_start(h)
                if f is not None:
                    claims[k].append(f)

        run_threads(claim)
        count = Counter(f.entry_id for c in claims for f in c)
        twice = sorted(e for e, c in count.items() if c > 1)
        if twice:
            problems.append(f"C7|{len(twice)} entries were claimed by two threads "
                            f"(first: {twice[0]})")
        never = set(all_ids) - set(count)
        if never:
            problems.append(f"C7|{len(never)} listed entries were claimed by no thread")

        def finish(k: int) -> None:
            for f in claims[k]:
                with operation("send_done"):
                    p = store.send_done(f)
                if p is not None:
                    store.cleanup(p)

        if not twice:
            run_threads(finish)
            fp = store.footprint()
            if fp.objects or fp.bytes:
                problems.append(f"C8|after every entry was sent and cleaned up, "
                                f"{fp.objects} objects and {fp.bytes} bytes remain")

    start = time.perf_counter()
    seam = backend.takes_io and backend.probe().has(Capability.IO_SEAM)
    _with_store(backend, body, traced if seam else None)
    problems += [f"C9|{e}" for e in errors]
    findings = [Finding(p.split("|")[0], p.split("|", 1)[1], f"threads:{seed}", NO_CRASH)
                for p in problems]
    if seams:
        findings += _sync_cover(seams[0], f"threads:{seed}")
        stats["sync_hold_seconds"] = THREAD_SYNC_HOLD
    return finished("threads", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)


def _sync_cover(io: FaultyIO, scenario: str) -> list[Finding]:
    """The threads' commits and send_done calls judged by the sync-cover rule: one finding
    per acknowledgement that rode a sync begun before its change, the calls of every
    thread in between as its steps."""
    try:
        found = uncovered_on(io)
    except ModelError as e:
        return [Finding("C9", f"the trace cannot be replayed for the sync-cover rule: {e}",
                        scenario, NO_CRASH)]
    return [Finding(u.clause, u.detail(), scenario, NO_CRASH, u.excerpt) for u in found]


def _guard(fn: Callable[[int], None], errors: list[str]) -> Callable[[int], None]:
    def run(k: int) -> None:
        try:
            fn(k)
        except Exception as e:
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    return run
