"""The KV queue killed with SIGKILL under a concurrent workload, on LevelDB and the log engine.

A child process (``tests/kv_kill_child.py``, started with ``subprocess``: LevelDB's threads
do not survive a fork) runs enqueue, send_start, reschedule, send_done, send_cancel, drop
and cleanup from several threads and reports every operation before it is called and
once it returned (acknowledged).  The parent kills it at a random moment, reopens the
queue (recovery runs) and checks it against a model with the pending-operation oracle:

* every entry of an acknowledged commit is there, QUEUED, with its last acknowledged
  schedule, unless it was acknowledged sent or dropped (then it is gone for good);
* an operation that was running when the child died (reported, not acknowledged) is
  either fully applied or not at all, and an interrupted enqueue has all its entries or
  none; an aborted enqueue never appears;
* envelope, recipients and bodies are intact (SHA-256 over the stored chunks, and the
  children read bodies back through ``read_inflight``);
* nothing is left INFLIGHT or PENDING_CLEANUP, nothing quarantined, recovery is idempotent.

The next child continues from the recovered queue.  At the end the queue is drained: no
key is left and the files shrink back after a compaction.

Number of kills: ``QUEUE_REF_PROFILE`` ``ci`` (default) kills about 24 times in all,
``thorough`` some hundreds; ``QUEUE_REF_KILLS=N`` sets the kills per engine.  Every run
draws a master seed (printed with any failure); ``QUEUE_REF_KILL_SEED=S`` replays its
workload choices and kill times (the thread interleaving, and so the exact state killed,
is up to the OS scheduler).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from queue_ref.body_digest import BodyDigest
from queue_ref.kv import keys
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.kv_records import MetaRec
from queue_ref.storage import RecoveryReport, Schedule
from tests.conftest import thorough

CHILD = str(Path(__file__).with_name("kv_kill_child.py"))
THREADS = 4
KILLS_CI = {"leveldb": 14, "log": 10}
KILLS_THOROUGH = {"leveldb": 250, "log": 150}
READY_TIMEOUT = 60.0

QUEUED, INFLIGHT, PENDING_CLEANUP, GONE = "queued", "inflight", "pending_cleanup", "gone"

#: op -> (source state, target state, whether it carries a new schedule)
TRANSITIONS: dict[str, tuple[str, str, bool]] = {
    "send_start": (QUEUED, INFLIGHT, False),
    "reschedule": (QUEUED, QUEUED, True),
    "drop": (QUEUED, PENDING_CLEANUP, False),
    "send_done": (INFLIGHT, PENDING_CLEANUP, False),
    "send_cancel": (INFLIGHT, QUEUED, True),
    "cleanup": (PENDING_CLEANUP, GONE, False),
}


def master_seed() -> int:
    env = os.environ.get("QUEUE_REF_KILL_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**32)


def kills_for(engine: str) -> int:
    env = os.environ.get("QUEUE_REF_KILLS")
    if env:
        return int(env)
    return (KILLS_THOROUGH if thorough() else KILLS_CI)[engine]


def open_queue(engine: str, path: str) -> KvQueue:
    return KvQueue.open_leveldb(path) if engine == "leveldb" else KvQueue.open_log(path)


def restart(state: str) -> str:
    """Where recovery takes a stored state (spec rule 5)."""
    return {INFLIGHT: QUEUED, PENDING_CLEANUP: GONE}.get(state, state)


class OracleError(AssertionError):
    pass


@dataclass(frozen=True)
class Msg:
    mail_from: str
    rcpts: tuple[tuple[str, str], ...]  # (address, zone) per recipient index
    sha: str


@dataclass
class Model:
    """What the children acknowledged, entry by entry."""

    msgs: dict[int, Msg] = field(default_factory=dict)
    state: dict[tuple[int, int], str] = field(default_factory=dict)
    sched: dict[tuple[int, int], Schedule] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)  # mail_from of aborted enqueues
    acked: int = 0
    reads: int = 0

    def feed(self, lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Apply the acknowledged operations in report order; the pending ones are returned."""
        pending: dict[int, dict[str, Any]] = {}
        for m in lines:
            t = m["t"]
            if t == "X":
                raise OracleError(f"the child failed:\n{m['error']}")
            if t == "B":
                if m["op"] == "abort":
                    self.aborted.add(m["frm"])
                elif m["op"] != "enqueue":
                    key = self.key(m["e"])
                    src = TRANSITIONS[m["op"]][0]
                    if self.state.get(key) != src:
                        raise OracleError(f"{m['op']} of {m['e']} started in state "
                                          f"{self.state.get(key)}, not {src}")
                pending[m["k"]] = m
            elif t == "A":
                b = pending.pop(m["k"])
                self.acked += 1
                if b["op"] == "enqueue":
                    self.add_message(m["mid"], b)
                elif b["op"] != "abort":
                    self.apply(b)
            elif t == "R":
                mid, _ = self.key(m["e"])
                if m["sha"] != self.msgs[mid].sha:
                    raise OracleError(f"read_inflight of {m['e']} returned an altered body")
                self.reads += 1
        return pending

    @staticmethod
    def key(eid: str) -> tuple[int, int]:
        return keys.parse_entry_id(eid)

    def add_message(self, mid: int, b: dict[str, Any]) -> None:
        if mid in self.msgs:
            raise OracleError(f"message id {mid} was given twice")
        self.msgs[mid] = Msg(b["frm"], tuple((r[0], r[1]) for r in b["rcpts"]), b["sha"])
        for i, r in enumerate(b["rcpts"]):
            self.state[(mid, i)] = QUEUED
            self.sched[(mid, i)] = Schedule(r[2], r[3])

    def apply(self, b: dict[str, Any]) -> None:
        key = self.key(b["e"])
        src, dst, new_sched = TRANSITIONS[b["op"]]
        assert self.state[key] == src
        self.state[key] = dst
        if new_sched:
            self.sched[key] = Schedule(*b["s"])

    def live(self) -> int:
        return sum(1 for s in self.state.values() if s != GONE)


@dataclass
class Observed:
    entries: dict[tuple[int, int], Schedule]
    msgs: dict[int, Msg]


def observe(q: KvQueue) -> Observed:
    """What the recovered queue holds: its listing, and each message's stored envelope and
    body (hashed over the chunks as stored)."""
    rep = q.recover()
    if rep != RecoveryReport():
        raise OracleError(f"recovery is not idempotent: a second run did {rep}")
    if next(q.find_inflight(), None) or next(q.find_pending_cleanup(), None):
        raise OracleError("entries are left inflight or pending cleanup after recovery")
    if q.quarantined():
        raise OracleError(f"recovery quarantined {[k for k, _ in q.quarantined()]}")
    entries: dict[tuple[int, int], Schedule] = {}
    for h in q.list_queue():
        key = keys.parse_entry_id(h.entry_id)
        if key in entries:
            raise OracleError(f"entry {h.entry_id} is listed twice")
        entries[key] = h.schedule
    msgs: dict[int, Msg] = {}
    for mid in sorted({m for m, _ in entries}):
        raw = q.kv.get(keys.meta(mid))
        if raw is None:
            raise OracleError(f"message {mid} has entries but no metadata")
        meta = MetaRec.decode(raw, mid)
        digest, sha256 = BodyDigest(meta.digest), hashlib.sha256()
        for seq in range(1, meta.chunks + 1):
            chunk = q.kv.get(keys.chunk(mid, seq))
            if chunk is None:
                raise OracleError(f"message {mid} lacks body chunk {seq}")
            digest.update(chunk)
            sha256.update(chunk)
        if digest.value() != meta.digest:
            raise OracleError(f"message {mid}: body does not match its stored digest")
        sha = sha256.hexdigest()
        msgs[mid] = Msg(meta.mail_from, meta.rcpts, sha)
    return Observed(entries, msgs)


def judge(model: Model, pending: dict[int, dict[str, Any]], got: Observed) -> None:
    """Raise OracleError unless ``got`` is a restart view the pending-op oracle allows,
    then make the model that view."""
    by_entry = {Model.key(b["e"]): b for b in pending.values() if "e" in b}
    problems: list[str] = []
    for key, state in model.state.items():
        allowed = {(restart(state), model.sched[key])}
        b = by_entry.get(key)
        if b is not None:
            _, dst, new_sched = TRANSITIONS[b["op"]]
            allowed.add((restart(dst), Schedule(*b["s"]) if new_sched else model.sched[key]))
        views = {None if s == GONE else sched for s, sched in allowed}
        seen = got.entries.get(key)
        if seen not in views:
            what = "missing" if seen is None else f"present with {seen}"
            problems.append(f"entry {key} ({state}{', pending ' + b['op'] if b else ''}) "
                            f"is {what}; allowed: {views}")
    enqueues = {b["frm"]: b for b in pending.values() if b["op"] == "enqueue"}
    for mid, msg in got.msgs.items():
        if mid in model.msgs:
            if msg != model.msgs[mid]:
                problems.append(f"message {mid} is altered: {msg} != {model.msgs[mid]}")
            continue
        if msg.mail_from in model.aborted:
            problems.append(f"aborted enqueue {msg.mail_from} appeared as message {mid}")
            continue
        b = enqueues.get(msg.mail_from)
        if b is None:
            problems.append(f"message {mid} from {msg.mail_from!r} was never enqueued")
            continue
        want = {(mid, i): Schedule(r[2], r[3]) for i, r in enumerate(b["rcpts"])}
        have = {k: s for k, s in got.entries.items() if k[0] == mid}
        expect = Msg(b["frm"], tuple((r[0], r[1]) for r in b["rcpts"]), b["sha"])
        if have != want or msg != expect:
            problems.append(f"interrupted enqueue {msg.mail_from} recovered partly or altered: "
                            f"{have} {msg} != {want} {expect}")
            continue
        model.add_message(mid, b)
    if problems:
        raise OracleError("\n".join(problems))
    for key in model.state:
        if key in got.entries:
            model.state[key] = QUEUED
            model.sched[key] = got.entries[key]
        else:
            model.state[key] = GONE


@dataclass
class ChildRun:
    lines: list[dict[str, Any]]
    returncode: int
    stderr: str
    killed_at: float


def run_child(engine: str, path: str, seed: int, gen: int, work: Path) -> ChildRun:
    """Start a child, kill it at a moment drawn from ``seed``, return what it reported."""
    rnd = random.Random(seed)
    early = rnd.random() < 0.1  # sometimes while it opens (recovery) or starts up
    delay = rnd.uniform(0.0, 0.5) if early else rnd.uniform(0.05, 0.8)
    r, w = os.pipe()
    err = work / f"child-{gen}.stderr"
    with open(err, "wb") as ef:
        proc = subprocess.Popen(
            [sys.executable, CHILD, engine, path, str(w), str(seed), str(gen), str(THREADS)],
            pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=ef, stderr=ef)
    os.close(w)
    chunks: list[bytes] = []
    ready = threading.Event()

    def reader() -> None:
        with os.fdopen(r, "rb", buffering=0) as f:
            while True:
                b = f.read(65536)
                if not b:
                    break
                chunks.append(b)
                if not ready.is_set() and b'"t":"ready"' in b"".join(chunks):
                    ready.set()
        ready.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t0 = time.monotonic()
    if not early:
        ready.wait(READY_TIMEOUT)
    time.sleep(delay)
    killed_at = time.monotonic() - t0
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    t.join()
    data = b"".join(chunks)
    if data and not data.endswith(b"\n"):
        raise OracleError("a report line was torn")
    lines = [json.loads(x) for x in data.splitlines()]
    return ChildRun(lines, rc, err.read_text(errors="replace")[-4000:], killed_at)


def drain(q: KvQueue, model: Model) -> None:
    """Send every queued entry (checking its body through read_inflight) and clean it up."""
    for h in list(q.list_queue()):
        mid, _ = keys.parse_entry_id(h.entry_id)
        f = q.send_start(h)
        assert f is not None
        with q.read_inflight(f) as r:
            assert hashlib.sha256(r.read_all()).hexdigest() == model.msgs[mid].sha
        d = q.send_done(f)
        assert d is not None and q.cleanup(d)


@pytest.mark.parametrize("engine", ["leveldb", "log"])
def test_kill_anywhere_recovers_every_acknowledged_operation(engine: str, tmp_path: Path) -> None:
    master = master_seed()
    path = str(tmp_path / "db")
    model = Model()
    kills = kills_for(engine)
    seed = gen = -1
    try:
        for gen in range(kills):
            seed = random.Random(f"{master}-{engine}-{gen}").randrange(2**31)
            run = run_child(engine, path, seed, gen, tmp_path)
            if run.returncode != -signal.SIGKILL:
                raise OracleError(f"child exited by itself ({run.returncode}):\n{run.stderr}")
            pending = model.feed(run.lines)
            q = open_queue(engine, path)
            try:
                judge(model, pending, observe(q))
            finally:
                q.close()
        q = open_queue(engine, path)
        try:
            drain(q, model)
            fp = q.footprint()
            assert (fp.objects, fp.bytes) == (0, 0)
            assert q.compact()
            assert q.disk_usage() < 256 * 1024, q.disk_usage()
        finally:
            q.close()
    except AssertionError as e:
        raise AssertionError(
            f"{engine}: kill {gen} of {kills} (child seed {seed}); replay with "
            f"QUEUE_REF_KILL_SEED={master}: {e}") from e
    # The run must have exercised the queue, not just started children.
    assert model.acked > kills * 5, (model.acked, master)
    assert model.reads > 0, master


def test_a_leveldb_creation_killed_before_its_current_opens_afresh(tmp_path: Path) -> None:
    """LevelDB creates a database by writing MANIFEST-000001, then CURRENT; a process
    killed in between leaves the manifest alone, and nothing was ever acknowledged there
    (the first open that follows writes a manifest of a higher number).  That opens as a
    new queue; a directory that holds data without CURRENT is still refused."""
    from queue_ref.storage import DamagedStoreError

    root = tmp_path / "created"
    root.mkdir()
    (root / "MANIFEST-000001").write_bytes(b"\x00" * 40)
    (root / "000003.log").write_bytes(b"")
    q = KvQueue.open_leveldb(str(root))
    assert list(q.list_queue()) == []
    q.close()
    held = tmp_path / "held"
    held.mkdir()
    (held / "MANIFEST-000001").write_bytes(b"\x00" * 40)
    (held / "000003.log").write_bytes(b"a record")
    with pytest.raises(DamagedStoreError):
        KvQueue.open_leveldb(str(held))
