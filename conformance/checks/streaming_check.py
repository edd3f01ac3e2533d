"""A 100 MB body through a backend that declares ``Capability.STREAMING_BODIES``.

In a child process (so the measurement sees only this work), with ``tracemalloc``
running: enqueue the body in 64 KiB writes, commit, claim the entry and read the body
back in 64 KiB reads.  The bytes read must be the bytes written (their SHA-256 is
compared, C6), and the Python heap may not grow by more than the profile's limit in
either phase: a backend that holds the body in memory does not stream.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
import tracemalloc

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import API, NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Channel, Child
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import Recipient, Schedule

CHUNK = 64 * 1024


def _block(i: int) -> bytes:
    """64 KiB of bytes that differ from block to block (cheap to make)."""
    seed = hashlib.sha256(i.to_bytes(8, "big")).digest()
    return (seed * (CHUNK // len(seed)))[:CHUNK]


def _stream(ch: Channel, backend: Backend, root: str, size: int) -> None:
    store = backend.open(root)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    h_in = hashlib.sha256()
    t = time.perf_counter()
    with store.enqueue("big@example.org") as enq:
        done = 0
        i = 0
        while done < size:
            b = _block(i)[:size - done]
            enq.write(b)
            h_in.update(b)
            done += len(b)
            i += 1
        (q,) = enq.commit([Recipient("big@example.net", Schedule(0))])
    write_peak = tracemalloc.get_traced_memory()[1] - base
    write_s = time.perf_counter() - t
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t = time.perf_counter()
    f = store.send_start(q)
    assert f is not None, "send_start of the only entry answered VANISHED"
    h_out = hashlib.sha256()
    n = 0
    with store.read_inflight(f) as r:
        size_meta = r.meta.body_size
        while True:
            b = r.read(CHUNK)
            if not b:
                break
            h_out.update(b)
            n += len(b)
    read_peak = tracemalloc.get_traced_memory()[1] - base
    read_s = time.perf_counter() - t
    tracemalloc.stop()
    p = store.send_done(f)
    assert p is not None
    store.cleanup(p)
    fp = store.footprint()
    store.close()
    ch.send({"result": {"in": h_in.hexdigest(), "out": h_out.hexdigest(), "read": n,
                     "meta_size": size_meta, "write_peak": write_peak, "read_peak": read_peak,
                     "write_seconds": round(write_s, 3), "read_seconds": round(read_s, 3),
                     "left": [fp.objects, fp.bytes]}})


def run(backend: Backend, profile: Profile) -> CheckResult:
    start = time.perf_counter()
    size = profile.streaming_bytes
    root = tempfile.mkdtemp(prefix="queue-ref-streaming-")
    scenario = f"streaming:{size}"
    findings: list[Finding] = []
    stats: dict[str, object] = {"bytes": size}
    try:
        with Child(_stream, backend, root, size) as child:
            msgs = child.drain(timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = next((m["result"] for m in msgs if "result" in m), None)
    if res is None:
        err = next((m["crashed"] for m in msgs if "crashed" in m), "the child vanished")
        findings.append(Finding("C9", f"streaming {size} bytes failed: {err}", scenario,
                                NO_CRASH))
    else:
        stats.update(res)
        if res["in"] != res["out"] or res["read"] != size or res["meta_size"] != size:
            findings.append(Finding("C6", f"wrote {size} bytes, read back {res['read']} "
                                          f"(meta says {res['meta_size']}); digests "
                                          f"{'equal' if res['in'] == res['out'] else 'differ'}",
                                    scenario, NO_CRASH))
        limit = profile.streaming_peak_limit
        for phase in ("write", "read"):
            if res[f"{phase}_peak"] > limit:
                findings.append(Finding(
                    API, f"declares streaming-bodies, but the Python heap grew by "
                         f"{res[f'{phase}_peak'] / 2**20:.1f} MiB while the body was "
                         f"{'written' if phase == 'write' else 'read'} (limit "
                         f"{limit / 2**20:.0f} MiB)", scenario, NO_CRASH))
        if res["left"] != [0, 0]:
            findings.append(Finding("C8", f"after the big entry was cleaned up, "
                                          f"{res['left'][0]} objects and {res['left'][1]} "
                                          "bytes remain", scenario, NO_CRASH))
    return finished("streaming", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    stats=stats)
