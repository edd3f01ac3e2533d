"""The child process of ``tests/test_kv_kill.py``: a concurrent workload on a KV queue that
runs until it is killed.

    python tests/kv_kill_child.py ENGINE PATH FD SEED GENERATION THREADS

ENGINE is ``leveldb`` or ``log``.  The queue at PATH is opened (recovery runs), every
QUEUED entry is put in a shared pool, and THREADS threads draw handles from the pools and
call enqueue (1 to 3 recipients, bodies from empty to 1.5 MB, a few aborted), send_start
(followed by reading the body back), reschedule, send_done, send_cancel, drop and cleanup.

The child reports on file descriptor FD, one JSON object per line; every line is one
``os.write`` shorter than ``PIPE_BUF``, so lines from different threads never interleave
and a kill never tears one:

* ``{"t": "ready", "recovery": [...]}`` once the queue is open;
* ``{"t": "B", "k": token, "op": ..., ...}`` just before an operation is called;
* ``{"t": "A", "k": token, ...}`` once it returned: the operation is acknowledged;
* ``{"t": "R", "e": entry id, "sha": ...}``: the SHA-256 of a body read with read_inflight;
* ``{"t": "X", "error": ...}``: an unexpected result or exception; the child exits 1.

A thread writes the ``A`` line of an operation before it puts the resulting handle back
in a pool, so the lines of one entry are in the order its operations happened.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import select
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import TypeVar

from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import (
    Handle,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
)

H = TypeVar("H", bound=Handle)

LIVE_CAP = 48  # queued + inflight entries above which threads stop enqueuing
ZONES = ("default", "slow", "bulk lane")


def open_queue(engine: str, path: str) -> KvQueue:
    if engine == "leveldb":
        return KvQueue.open_leveldb(path)
    if engine == "log":
        return KvQueue.open_log(path)
    raise SystemExit(f"unknown engine {engine!r}")


def schedule_json(s: Schedule) -> list[int]:
    return [s.at, s.attempts]


@dataclass
class Pools:
    lock: threading.Lock = field(default_factory=threading.Lock)
    queued: list[QueuedMail] = field(default_factory=list)
    inflight: list[InflightMail] = field(default_factory=list)
    cleanup: list[PendingCleanupMail] = field(default_factory=list)

    def live(self) -> int:
        return len(self.queued) + len(self.inflight)


class Child:
    def __init__(self, q: KvQueue, fd: int, generation: int) -> None:
        self.q = q
        self.fd = fd
        self.generation = generation
        self.pools = Pools()
        self.tokens = itertools.count()
        self.failed = threading.Event()

    def say(self, **obj: object) -> None:
        line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        if len(line) > select.PIPE_BUF:
            raise AssertionError(f"report line of {len(line)} bytes is longer than PIPE_BUF")
        os.write(self.fd, line)

    def take(self, pool: list[H], rnd: random.Random) -> H | None:
        with self.pools.lock:
            if not pool:
                return None
            i = rnd.randrange(len(pool))
            pool[i], pool[-1] = pool[-1], pool[i]
            return pool.pop()

    def give(self, pool: list[H], h: H) -> None:
        with self.pools.lock:
            pool.append(h)

    # ---- operations ------------------------------------------------------------------

    def enqueue(self, rnd: random.Random, *, abort: bool) -> None:
        tok = next(self.tokens)
        mail_from = f"g{self.generation}-{tok}@kill.test"
        roll = rnd.random()
        size = (rnd.randrange(0, 4096) if roll < 0.7 else
                rnd.randrange(4096, 150_000) if roll < 0.97 else
                rnd.randrange(1_100_000, 1_500_000))
        body = rnd.randbytes(size)
        rcpts = [Recipient(f"r{i}-{tok}@d{rnd.randrange(4)}.test",
                           Schedule(rnd.randrange(10**9), rnd.randrange(4)),
                           rnd.choice(ZONES))
                 for i in range(rnd.randint(1, 3))]
        self.say(t="B", k=tok, op="abort" if abort else "enqueue", frm=mail_from,
                 sha=hashlib.sha256(body).hexdigest(),
                 rcpts=[[r.address, r.zone, *schedule_json(r.schedule)] for r in rcpts])
        enq = self.q.enqueue(mail_from, {"gen": str(self.generation)})
        with enq:
            pos = 0
            while pos < size:
                n = rnd.randint(1, 200_000)
                enq.write(body[pos:pos + n])
                pos += n
            if abort:
                enq.abort()
                self.say(t="A", k=tok)
                return
            handles = enq.commit(rcpts)
        self.say(t="A", k=tok, mid=int(handles[0].message_id))
        for h in handles:
            self.give(self.pools.queued, h)

    def send_start(self, h: QueuedMail, rnd: random.Random) -> None:
        tok = next(self.tokens)
        self.say(t="B", k=tok, op="send_start", e=h.entry_id)
        out = self.q.send_start(h)
        if out is None:
            raise AssertionError(f"send_start of {h.entry_id} found it gone")
        self.say(t="A", k=tok)
        if rnd.random() < 0.7:
            with self.q.read_inflight(out) as r:
                sha = hashlib.sha256(r.read_all()).hexdigest()
            self.say(t="R", e=out.entry_id, sha=sha)
        self.give(self.pools.inflight, out)

    def on_queued(self, op: str, h: QueuedMail, rnd: random.Random) -> None:
        tok = next(self.tokens)
        if op == "reschedule":
            s = Schedule(rnd.randrange(10**9), rnd.randrange(6))
            self.say(t="B", k=tok, op=op, e=h.entry_id, s=schedule_json(s))
            q = self.q.reschedule(h, s)
            if q is None:
                raise AssertionError(f"reschedule of {h.entry_id} found it gone")
            self.say(t="A", k=tok)
            self.give(self.pools.queued, q)
            return
        self.say(t="B", k=tok, op=op, e=h.entry_id)
        c = self.q.drop(h)
        if c is None:
            raise AssertionError(f"drop of {h.entry_id} found it gone")
        self.say(t="A", k=tok)
        self.give(self.pools.cleanup, c)

    def on_inflight(self, op: str, h: InflightMail, rnd: random.Random) -> None:
        tok = next(self.tokens)
        if op == "send_cancel":
            s = Schedule(rnd.randrange(10**9), h.schedule.attempts + 1)
            self.say(t="B", k=tok, op=op, e=h.entry_id, s=schedule_json(s))
            q = self.q.send_cancel(h, s)
            if q is None:
                raise AssertionError(f"send_cancel of {h.entry_id} found it gone")
            self.say(t="A", k=tok)
            self.give(self.pools.queued, q)
            return
        self.say(t="B", k=tok, op=op, e=h.entry_id)
        c = self.q.send_done(h)
        if c is None:
            raise AssertionError(f"send_done of {h.entry_id} found it gone")
        self.say(t="A", k=tok)
        self.give(self.pools.cleanup, c)

    def cleanup(self, h: PendingCleanupMail) -> None:
        tok = next(self.tokens)
        self.say(t="B", k=tok, op="cleanup", e=h.entry_id)
        if not self.q.cleanup(h):
            raise AssertionError(f"cleanup of {h.entry_id} found it gone")
        self.say(t="A", k=tok)

    # ---- the threads ---------------------------------------------------------------------

    def step(self, rnd: random.Random) -> None:
        p = self.pools
        roll = rnd.random()
        if roll < 0.3 and p.live() < LIVE_CAP:
            self.enqueue(rnd, abort=rnd.random() < 0.05)
            return
        if roll < 0.55:
            qh = self.take(p.queued, rnd)
            if qh is not None:
                r = rnd.random()
                if r < 0.75:
                    self.send_start(qh, rnd)
                else:
                    self.on_queued("reschedule" if r < 0.9 else "drop", qh, rnd)
                return
        if roll < 0.8:
            ih = self.take(p.inflight, rnd)
            if ih is not None:
                self.on_inflight("send_done" if rnd.random() < 0.75 else "send_cancel", ih, rnd)
                return
        ch = self.take(p.cleanup, rnd)
        if ch is not None:
            self.cleanup(ch)
        elif p.live() < LIVE_CAP:
            self.enqueue(rnd, abort=False)

    def run_thread(self, seed: int) -> None:
        rnd = random.Random(seed)
        try:
            while not self.failed.is_set():
                self.step(rnd)
        except BaseException:
            self.failed.set()
            self.say(t="X", error=traceback.format_exc()[-3000:])


def main(argv: list[str]) -> int:
    engine, path, fd_s, seed_s, gen_s, threads_s = argv
    fd, seed, gen, threads = int(fd_s), int(seed_s), int(gen_s), int(threads_s)
    q = open_queue(engine, path)
    child = Child(q, fd, gen)
    rep = q.last_recovery
    child.say(t="ready", recovery=[rep.requeued, rep.cleaned, rep.uncommitted_removed,
                                   rep.orphans_removed, rep.quarantined])
    child.pools.queued.extend(q.list_queue())
    workers = [threading.Thread(target=child.run_thread, args=(seed * 1000 + i,), daemon=True)
               for i in range(threads)]
    for w in workers:
        w.start()
    child.failed.wait()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
