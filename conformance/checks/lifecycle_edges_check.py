"""Another process at the lifecycle edges (``Capability.MULTI_PROCESS``).

One child process, the *actor*, opens the queue and runs one operation; it is stopped in
the middle of it.  While it stands still a second child, the *observer*, opens the same
queue (its recovery runs), lists it, calls ``find_inflight`` and tries ``send_start`` on
every entry it sees.  Then the actor is let go and finishes; the observer sends what it
claimed (``send_done``, and ``cleanup`` of every other one); both close, and the queue is
reopened and read back (``crashexplore.recovered_queue.inspect``).

Where the actor stops:

* through the I/O seam (``Capability.IO_SEAM``): at every *stop point* of the operation,
  before its first mutating call and after each one (``harness.stop_gate_io``), found by
  running it with stop points 0, 1, 2, ... until it finishes without reaching one;
* any other backend: ``SIGSTOP`` after a random delay within the operation's measured
  duration (as process-kill kills it), ``SIGCONT`` after.

Operations: ``open`` (after a killed owner left an inflight entry, a pending cleanup and
an uncommitted enqueue: two processes recover at once), ``enqueue`` (open, body, commit),
``send_start``, ``send_done``, ``send_cancel``, ``reschedule``, ``drop``, ``cleanup``, and
with ``Capability.HOLD`` ``hold`` and ``release``, each on an entry of a one-recipient and
of a two-recipient message.  Besides its target the actor holds one more entry INFLIGHT
all along (a live owner's claim nobody else may take).

Judged against ``spec``'s model: the actor's operation and the observer's calls must be
linearizable (the operation takes effect at one point among the observer's calls: what
the observer listed and claimed, and what the operation returned, agree with the model
in that order); the observer lists no entry a live owner holds INFLIGHT (C4), adopts none
with ``find_inflight`` and claims nothing the actor also moved (C7), sees all or nothing
of an enqueue in progress (C2); nothing fails, since no fault is injected; after
reopening the queue is exactly the model's (nothing committed lost: C1/C4, nothing
finished back: C3, nothing quarantined or altered: C6, no leak: C8).

Scenario ids: ``lifecycle-edges:<op>:<target>:<stop>`` (``<stop>`` a stop point, or
``sig<microseconds>`` for a SIGSTOP delay); ``queue-ref certify FACTORY --scenario ID``
runs that trial again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from conformance.crashexplore.recovered_queue import inspect, to_views
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import API, NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Channel, Child, sleep_precise
from conformance.harness.stop_gate_io import StopGateIO
from conformance.harness.suite_profiles import Profile
from queue_ref.io import OsIO
from queue_ref.storage import Capability, QueueError, Recipient, Schedule, Storage
from spec.crash import judge
from spec.model import Call, EntryKey, Model
from spec.model import run as run_call
from spec.states import EntryState, Op
from spec.states import Outcome as ModelOutcome

CHECK = "lifecycle-edges"
OPS = ("open", "enqueue", "send_start", "send_done", "send_cancel", "reschedule", "drop",
       "cleanup", "hold", "release")
HOLD_OPS = ("hold", "release")
TARGETS = ("single", "pair")
#: How long the parent lets the observer work while the actor stands still before it
#: lets the actor go (the observer may be waiting for a lock the actor holds).
OBSERVE_WAIT = 0.4
#: Longest a child may take to answer once it can (a hang is reported, not waited out).
ANSWER_TIMEOUT = 60.0

# The queue every trial starts from: message 0 has two recipients, 1 one, 2 two.
_PREFIX: tuple[tuple[str, tuple[tuple[str, int], ...], bytes], ...] = (
    ("a@edges.example", (("r0@x.example", 100), ("r1@y.example", 101)),
     b"Subject: zero\r\n\r\nfirst\r\n"),
    ("b@edges.example", (("s0@x.example", 110),), b"Subject: one\r\n\r\nsecond\r\n"),
    ("c@edges.example", (("t0@z.example", 120), ("t1@z.example", 121)),
     b"Subject: two\r\n\r\nthird\r\n"),
)
_TARGET_KEY: dict[str, EntryKey] = {"single": (1, 0), "pair": (0, 0)}
_BYSTANDER: EntryKey = (2, 1)  # the actor holds it INFLIGHT throughout
_RESCHEDULE = Schedule(500, 1)
_CANCEL = Schedule(600, 2)
# The enqueue under test: one recipient and a small body, or two and a body written
# in several pieces before the commit.
_NEW_SENDER = "n@edges.example"
_NEW_BODY = {"single": b"Subject: new\r\n\r\nsmall\r\n",
             "pair": b"Subject: new\r\n\r\n" + b"x" * 150_000 + b"\r\n"}
_NEW_RCPTS = {"single": (("u0@x.example", 130),),
              "pair": (("u0@x.example", 130), ("u1@y.example", 131))}


def _sched(s: Schedule) -> list[int]:
    return [s.at, s.attempts]


# ---- the children --------------------------------------------------------------------

def _recv(ch: Channel) -> dict[str, Any] | None:
    """The parent's next command: a JSON object, or a word (None: the parent is gone)."""
    line = ch.recv()
    if not line:
        return None
    return json.loads(line) if line.startswith("{") else {"cmd": line}


def _actor(ch: Channel, backend: Backend, seam: bool) -> None:
    """Runs trials on command; stops inside the operation under test."""
    kept: list[object] = []  # what a killed owner leaves open: never closed
    while True:
        cmd = _recv(ch)
        if cmd is None or cmd["cmd"] == "quit":
            return
        if cmd["cmd"] == "leave":
            _leave(ch, backend, cmd, kept)
        elif cmd["cmd"] == "run":
            _act(ch, backend, seam, cmd)


def _leave(ch: Channel, backend: Backend, cmd: dict[str, Any], kept: list[object]) -> None:
    """An owner that goes away mid-work: an inflight entry, a pending cleanup and an
    enqueue it never committed (closed without finishing, as a killed owner would)."""
    store = backend.open(cmd["root"])
    listed = {h.entry_id: h for h in store.list_queue()}
    f = store.send_start(listed[cmd["inflight"]])
    g = store.send_start(listed[cmd["pending"]])
    p = store.send_done(g) if g is not None else None
    enq = store.enqueue("gone@edges.example")
    enq.write(b"Subject: never\r\n\r\n" + b"y" * 70_000)
    kept.append(enq)
    kept.append(store)
    store.close()
    ch.send({"left": [f is not None, p is not None]})


def _act(ch: Channel, backend: Backend, seam: bool, cmd: dict[str, Any]) -> None:
    op, stop = cmd["op"], cmd["stop"]

    def on_stop(point: int, name: str, when: str) -> None:
        ch.send({"stopped": point, "call": name, "when": when})
        ch.recv()  # "release"

    gate = StopGateIO(OsIO(), on_stop) if seam else None
    store: Storage | None = None
    try:
        if op == "open":
            if gate is not None:
                gate.arm(stop)
            else:
                ch.send({"starting": True})
            t0 = time.perf_counter()
            store = backend.open(cmd["root"], gate) if gate is not None else \
                backend.open(cmd["root"])
            took = time.perf_counter() - t0
            if gate is not None:
                gate.disarm()
            ch.send({"result": {"opened": True}, "seconds": took,
                     "calls": gate.count if gate else 0})
            if _recv(ch) is None:  # "claim": the observer has had its turn
                return
            found = [f.entry_id for f in store.find_inflight()]
            claimed = {}
            for h in store.list_queue():
                f = store.send_start(h)
                if f is not None:
                    claimed[f.entry_id] = _sched(f.schedule)
            ch.send({"claimed": claimed, "adopted": found})
        else:
            store = backend.open(cmd["root"], gate) if gate is not None else \
                backend.open(cmd["root"])
            result, took = _operate(ch, store, gate, cmd)
            ch.send({"result": result, "seconds": took, "calls": gate.count if gate else 0})
    except Exception as e:
        ch.send({"result": {"error": f"{type(e).__name__}: {e}",
                            "typed": isinstance(e, QueueError)}, "seconds": 0.0, "calls": 0})
    if _recv(ch) is not None and store is not None:  # "close"
        store.close()
    ch.send({"closed": True})


def _operate(ch: Channel, store: Storage, gate: StopGateIO | None, cmd: dict[str, Any]
             ) -> tuple[dict[str, Any], float]:
    op, target = cmd["op"], cmd["target"]
    listed = {h.entry_id: h for h in store.list_queue()}
    if store.send_start(listed[cmd["bystander"]]) is None:
        raise RuntimeError("the actor could not claim its bystander entry")
    h: Any = listed.get(cmd["entry"])
    if op in ("send_done", "send_cancel", "cleanup"):
        h = store.send_start(h)
    if op == "cleanup":
        h = store.send_done(h)
    if op == "release":
        h = store.hold(h)
    if op != "enqueue" and h is None:
        raise RuntimeError(f"the actor could not bring its entry to {op}'s state")
    if gate is not None:
        gate.arm(cmd["stop"])
    else:
        ch.send({"starting": True})
    t0 = time.perf_counter()
    try:
        if op == "enqueue":
            rcpts = [Recipient(r, Schedule(at)) for r, at in _NEW_RCPTS[target]]
            with store.enqueue(_NEW_SENDER) as enq:
                body = _NEW_BODY[target]
                for i in range(0, len(body), 65536):
                    enq.write(body[i:i + 65536])
                got = enq.commit(rcpts)
            out: dict[str, Any] = {"moved": True, "message": got[0].message_id,
                                   "entries": [g.entry_id for g in got]}
        else:
            res: Any = {
                "send_start": lambda: store.send_start(h),
                "send_done": lambda: store.send_done(h),
                "send_cancel": lambda: store.send_cancel(h, _CANCEL),
                "reschedule": lambda: store.reschedule(h, _RESCHEDULE),
                "drop": lambda: store.drop(h),
                "cleanup": lambda: store.cleanup(h),
                "hold": lambda: store.hold(h),
                "release": lambda: store.release(h),
            }[op]()
            if res is None or res is False:
                out = {"moved": False}
            elif res is True:
                out = {"moved": True}
            else:
                out = {"moved": True, "entry": res.entry_id, "schedule": _sched(res.schedule)}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "typed": isinstance(e, QueueError)}
    took = time.perf_counter() - t0
    if gate is not None:
        gate.disarm()
    return out, took


def _observer(ch: Channel, backend: Backend) -> None:
    """Opens the queue on command while the actor stands still, lists and claims."""
    while True:
        cmd = _recv(ch)
        if cmd is None or cmd["cmd"] == "quit":
            return
        _observe(ch, backend, cmd["root"])


def _observe(ch: Channel, backend: Backend, root: str) -> None:
    store: Storage | None = None
    claims: list[Any] = []
    try:
        store = backend.open(root)
        adopted = list(store.find_inflight())
        listed = list(store.list_queue())
        claimed: dict[str, list[int]] = {}
        for h in listed:
            f = store.send_start(h)
            if f is not None:
                claimed[f.entry_id] = _sched(f.schedule)
                claims.append(f)
        claims[:0] = adopted
        ch.send({"observed": True, "listed": [h.entry_id for h in listed],
                 "adopted": {f.entry_id: _sched(f.schedule) for f in adopted},
                 "claimed": claimed})
    except Exception as e:
        ch.send({"observed": False, "error": f"{type(e).__name__}: {e}"})
    if _recv(ch) is None:  # "finish"
        return
    finished_: list[list[Any]] = []
    try:
        for i, f in enumerate(claims):
            assert store is not None
            p = store.send_done(f)
            cleaned = store.cleanup(p) if p is not None and i % 2 == 0 else None
            finished_.append([f.entry_id, p is not None, cleaned])
        ch.send({"finished": finished_})
    except Exception as e:
        ch.send({"finished": finished_, "error": f"{type(e).__name__}: {e}"})
    if _recv(ch) is not None and store is not None:  # "close"
        store.close()
    ch.send({"closed": True})


# ---- the parent ----------------------------------------------------------------------

def _poll(child: Child, timeout: float) -> dict[str, Any] | None:
    """The child's next message, or None if none comes within ``timeout``."""
    if b"\n" not in child._buf:
        ready, _, _ = select.select([child._fd], [], [], timeout)
        if not ready:
            return None
    return next(child.messages(ANSWER_TIMEOUT), None)


class Hang(Exception):
    """A child did not answer in time."""


def _answer(child: Child, what: str, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    got = _poll(child, timeout)
    if got is None:
        raise Hang(f"the {what} did not answer within {timeout:.0f} s")
    if "crashed" in got:
        raise RuntimeError(f"the {what} failed: {got['crashed']}\n{got.get('trace', '')}")
    return got


@dataclass
class Trial:
    op: str
    target: str
    stop: int | None  # a stop point (seam), or None: SIGSTOP after ``delay``
    delay: float = 0.0

    @property
    def scenario(self) -> str:
        where = str(self.stop) if self.stop is not None else f"sig{round(self.delay * 1e6)}"
        return f"{CHECK}:{self.op}:{self.target}:{where}"


@dataclass
class TrialOutcome:
    findings: list[tuple[str, str]] = field(default_factory=list)
    stopped: bool = False  # the actor was stopped inside the operation
    calls: int = 0  # mutating calls the operation made (seam)
    seconds: float = 0.0  # how long the operation took (unstopped)
    blocked: bool = False  # the observer waited for the actor
    steps: list[str] = field(default_factory=list)


class Bench:
    """The two children (started once, reused by every trial) and where trials run."""

    def __init__(self, backend: Backend, seam: bool, seed: int) -> None:
        self.backend = backend
        self.seam = seam
        self.rng = random.Random(seed)
        self.base = tempfile.mkdtemp(prefix="queue-ref-edges-")
        self.actor: Child | None = None
        self.observer: Child | None = None
        self.count = 0

    def children(self) -> tuple[Child, Child]:
        if self.actor is None:
            self.actor = Child(_actor, self.backend, self.seam)
        if self.observer is None:
            self.observer = Child(_observer, self.backend)
        return self.actor, self.observer

    def reset(self) -> None:
        """Kill both children (after a hang or a failure); fresh ones start next time."""
        for c in (self.actor, self.observer):
            if c is not None:
                c.close()
        self.actor = self.observer = None

    def close(self) -> None:
        for c in (self.actor, self.observer):
            if c is not None:
                c.tell(json.dumps({"cmd": "quit"}))
                _reap(c)
        self.actor = self.observer = None
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reap(c: Child) -> None:
    """Wait (a little) for a child told to quit, then make sure it is gone."""
    with contextlib.suppress(Exception):
        for _ in c.messages(10.0):
            pass
    c.close()


@dataclass
class Run:
    """The model side of one trial: ids learnt, the model before the operation."""

    model: Model = field(default_factory=Model)
    msgids: dict[str, int] = field(default_factory=dict)
    keys: dict[str, EntryKey] = field(default_factory=dict)

    def ident(self, key: EntryKey) -> str | None:
        return next((i for i, k in self.keys.items() if k == key), None)

    def apply(self, op: Op, key: EntryKey, schedule: Schedule | None = None) -> None:
        self.model, _ = self.model.apply(op, key, schedule)


def _prefix(backend: Backend, root: str) -> Run:
    run_ = Run()
    store = backend.open(root)
    try:
        for sender, rcpts, body in _PREFIX:
            with store.enqueue(sender) as enq:
                enq.write(body)
                got = enq.commit([Recipient(r, Schedule(at)) for r, at in rcpts])
            run_.model, m = run_.model.enqueue(sender, body,
                                               [(r, Schedule(at)) for r, at in rcpts])
            run_.msgids[got[0].message_id] = m
            for i, g in enumerate(got):
                run_.keys[g.entry_id] = (m, i)
    finally:
        store.close()
    return run_


def _call(op: str, target: str, run_: Run) -> Call:
    if op == "enqueue":
        return Call(Op.ENQUEUE, mail_from=_NEW_SENDER, body=_NEW_BODY[target],
                    rcpts=tuple((r, Schedule(at)) for r, at in _NEW_RCPTS[target]))
    key = _TARGET_KEY[target]
    sched = {"reschedule": _RESCHEDULE, "send_cancel": _CANCEL}.get(op)
    return Call(Op(op), key, sched)


def run_trial(bench: Bench, trial: Trial) -> TrialOutcome:
    """One trial: prefix, actor stopped, observer, release, finish, reopen, judge."""
    bench.count += 1
    root = os.path.join(bench.base, f"q{bench.count}")
    os.mkdir(root)
    out = TrialOutcome()
    try:
        _run_trial(bench, trial, root, out)
    except Hang as e:
        out.findings.append(("API" if trial.op != "open" else "C10", f"{e} ({_where(out)})"))
        bench.reset()
    except Exception:
        bench.reset()
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _where(out: TrialOutcome) -> str:
    return "; ".join(out.steps) if out.steps else "before the operation"


def _run_trial(bench: Bench, trial: Trial, root: str, out: TrialOutcome) -> None:
    actor, observer = bench.children()
    run_ = _prefix(bench.backend, root)
    op, target = trial.op, trial.target
    if op == "open":
        actor.tell(json.dumps({"cmd": "leave", "root": root,
                               "inflight": run_.ident(_BYSTANDER),
                               "pending": run_.ident(_TARGET_KEY[target])}))
        left = _answer(actor, "actor")["left"]
        if not all(left):
            raise RuntimeError("the owner that goes away could not claim its entries")
        run_.apply(Op.SEND_START, _BYSTANDER)
        run_.apply(Op.SEND_START, _TARGET_KEY[target])
        run_.apply(Op.SEND_DONE, _TARGET_KEY[target])
    else:
        run_.apply(Op.SEND_START, _BYSTANDER)
        key = _TARGET_KEY[target]
        if op in ("send_done", "send_cancel", "cleanup"):
            run_.apply(Op.SEND_START, key)
        if op == "cleanup":
            run_.apply(Op.SEND_DONE, key)
        if op == "release":
            run_.apply(Op.HOLD, key)
    actor.tell(json.dumps({"cmd": "run", "root": root, "op": op, "target": target,
                           "stop": trial.stop, "entry": run_.ident(_TARGET_KEY[target]),
                           "bystander": run_.ident(_BYSTANDER)}))
    first = _stop_actor(bench, actor, trial, out)
    seen: dict[str, Any] | None = None
    result: dict[str, Any] | None = first if "result" in first else None
    if out.stopped:
        observer.tell(json.dumps({"cmd": "observe", "root": root}))
        seen = _poll(observer, OBSERVE_WAIT)
        out.blocked = seen is None
        out.steps.append(f"{op} stopped {first.get('where', '')}".rstrip())
        _release(bench, actor, trial)
        if seen is None:
            seen = _answer(observer, "observer")
        if "crashed" in seen:
            raise RuntimeError(f"the observer failed: {seen['crashed']}")
        if result is None:
            result = _answer(actor, "actor")
    assert result is not None
    out.seconds = result.get("seconds", 0.0)
    out.calls = result.get("calls", 0)
    child_claims: dict[str, Any] | None = None
    if op == "open" and "error" not in result["result"]:
        actor.tell("claim")
        child_claims = _answer(actor, "actor")
    if not out.stopped:
        actor.tell("close")
        _answer(actor, "actor")
        return
    observer.tell("finish")
    done = _answer(observer, "observer")
    actor.tell("close")
    _answer(actor, "actor")
    observer.tell("close")
    _answer(observer, "observer")
    out.steps.append(f"the observer's open ({'waited' if out.blocked else 'at once'}): "
                     f"listed {len(seen.get('listed', []))}, claimed "
                     f"{len(seen.get('claimed', {}))}, adopted {len(seen.get('adopted', {}))}")
    out.steps.append(f"{op} returned {json.dumps(result['result'])}")
    rec = inspect(bench.backend.opener(root))
    out.findings.extend(judge_trial(run_, trial, seen, result["result"], child_claims,
                                    done, rec))


def _stop_actor(bench: Bench, actor: Child, trial: Trial, out: TrialOutcome) -> dict[str, Any]:
    """Wait until the actor stands still inside its operation (or finished it)."""
    first = _answer(actor, "actor")
    if bench.seam:
        if "stopped" in first:
            out.stopped = True
            first["where"] = f"{first['when']} {first['call']} (stop point {first['stopped']})"
        return first
    if "starting" not in first:
        return first  # it failed before the operation
    if trial.delay < 0:  # not stopped: only its duration is wanted
        return _answer(actor, "actor")
    sleep_precise(trial.delay)
    os.kill(actor.pid, signal.SIGSTOP)
    out.stopped = True
    first["where"] = f"by SIGSTOP {trial.delay * 1e6:.0f} us in"
    early = _poll(actor, 0.0)  # it may have finished before the signal
    return early if early is not None else first


def _release(bench: Bench, actor: Child, trial: Trial) -> None:
    if bench.seam:
        actor.tell("release")
    else:
        os.kill(actor.pid, signal.SIGCONT)


# ---- the judge -----------------------------------------------------------------------

Problems = list[tuple[str, str]]


def _state_clause(state: EntryState) -> str:
    return {EntryState.INFLIGHT: "C4", EntryState.PENDING_CLEANUP: "C3",
            EntryState.GONE: "C3", EntryState.HELD: "C14"}.get(state, "C2")


def _moved(res: dict[str, Any]) -> bool | None:
    return None if "error" in res else bool(res.get("moved"))


def judge_trial(run_: Run, trial: Trial, seen: dict[str, Any], result: dict[str, Any],
                child_claims: dict[str, Any] | None, done: dict[str, Any], rec: Any
                ) -> Problems:
    """Everything wrong with one trial (empty: it keeps the contract)."""
    op = trial.op
    found: Problems = []
    if "error" in result:
        clause = "C2" if op == "enqueue" else "C10" if op == "open" else "C7"
        found.append((clause, f"{op} failed while another process opened the queue, with no "
                              f"fault injected: {result['error']}"))
    if not seen.get("observed"):
        found.append(("C10", f"opening the queue while another process was inside {op} "
                             f"failed: {seen.get('error')}"))
        return found
    if op == "enqueue" and _moved(result):
        m = run_.model.next_id
        run_.msgids[result["message"]] = m
        for i, e in enumerate(result["entries"]):
            run_.keys[e] = (m, i)
    if op == "open":
        found += _judge_open(run_, seen, child_claims)
    else:
        found += _judge_concurrent(run_, trial, seen, result)
    for eid, sent, cleaned in done.get("finished", []):
        key = run_.keys.get(eid)
        if key is None:
            continue
        if not sent:
            found.append(("C7", f"the observer's claim of {key} was taken from it: send_done "
                                "returned None"))
            continue
        run_.apply(Op.SEND_DONE, key)
        if cleaned:
            run_.apply(Op.CLEANUP, key)
    if "error" in done:
        found.append(("C7", f"the observer's send_done/cleanup failed: {done['error']}"))
    views = to_views(rec, run_.msgids, run_.keys, run_.model, None)
    for v in judge(run_.model, None, views):
        found.append((v.clause, f"after both closed and the queue was reopened: {v.detail}"))
    for clause, detail in rec.problems:
        found.append((clause, f"reading the reopened queue back: {detail}"))
    return list(dict.fromkeys(found))


def _judge_open(run_: Run, seen: dict[str, Any], child: dict[str, Any] | None) -> Problems:
    """Two recoveries at once: each open leaves the restart of the queue; then the
    observer claims (it had its turn first), then the actor claims the rest."""
    found: Problems = []
    dead = set(run_.model.keys_in(EntryState.INFLIGHT))  # the owner that went away
    run_.model = run_.model.restart()
    for eid, sched in seen.get("adopted", {}).items():
        key = run_.keys.get(eid)
        if key not in dead:
            found.append(("C7", f"find_inflight adopted {key or eid}, which no dead owner held"))
            continue
        # adopted before a recovery requeued it: the same as claiming it
        found += _claim(run_, eid, sched, "the observer (find_inflight)")
    found += _listing(run_, seen["listed"], set(), "the observer")
    for eid in seen["listed"]:
        found += _claim(run_, eid, seen["claimed"].get(eid), "the observer")
    if child is not None and "result" in child:
        found.append(("C7", f"the second process failed claiming what it listed: "
                            f"{child['result'].get('error')}"))
    elif child is not None:
        for eid in child.get("adopted", []):
            found.append(("C7", f"find_inflight of the second process adopted "
                                f"{run_.keys.get(eid, eid)}, held by a live owner"))
        for eid, sched in child.get("claimed", {}).items():
            found += _claim(run_, eid, sched, "the second process")
        left = set(run_.model.keys_in(EntryState.QUEUED))
        if left:
            found.append(("API", f"entries {sorted(left)} were queued but the second process "
                                 "never listed them"))
    return found


def _claim(run_: Run, eid: str, sched: list[int] | None, who: str) -> Problems:
    key = run_.keys.get(eid)
    if key is None:
        return [("C2", f"{who} claimed {eid}, an entry of no committed message")]
    state = run_.model.state_of(key)
    moved = sched is not None
    if moved and state is not EntryState.QUEUED:
        return [("C7" if state is EntryState.INFLIGHT else _state_clause(state),
                 f"{who} claimed {key}, which was {state.value}")]
    if moved:
        want = run_.model.entries[key].schedule
        run_.apply(Op.SEND_START, key)
        if sched != _sched(want):
            return [("C5", f"{who} claimed {key} with schedule {sched}, it is {_sched(want)}")]
    return []


def _listing(run_: Run, listed: list[str], touched: set[EntryKey], who: str) -> Problems:
    """The listing against the model: nothing that is not queued, every queued entry the
    operation under way does not touch (which may be out of sight while it runs)."""
    found: Problems = []
    keys = []
    for eid in listed:
        key = run_.keys.get(eid)
        if key is None:
            found.append(("C2", f"{who} listed {eid}, an entry of no committed message"))
            continue
        keys.append(key)
        state = run_.model.state_of(key)
        if state is not EntryState.QUEUED:
            what = "held INFLIGHT by a live owner" if state is EntryState.INFLIGHT else state.value
            found.append((_state_clause(state), f"{who} listed {key} as queued, but it is {what}"))
    if len(set(keys)) != len(keys):
        found.append(("C7", f"{who} listed an entry twice"))
    missing = set(run_.model.keys_in(EntryState.QUEUED)) - set(keys) - touched
    if missing:
        found.append(("API", f"{who} did not list the queued entries {sorted(missing)}"))
    return found


def _judge_concurrent(run_: Run, trial: Trial, seen: dict[str, Any],
                      result: dict[str, Any]) -> Problems:
    """The operation takes effect at one point among the observer's calls: before its
    listing, or after its i-th claim.  Some point must explain everything seen."""
    call = _call(trial.op, trial.target, run_)
    moved = _moved(result)
    claims = [eid for eid in seen["listed"]]
    before = run_.model
    best: tuple[Problems, Model] | None = None
    points = range(len(claims) + 2)
    for cleaned_by_observer in ((False, True) if trial.op == "cleanup" else (False,)):
        for p in points:
            run_.model = before
            found: Problems = []
            if cleaned_by_observer:  # its recovery finished the cleanup first
                run_.apply(Op.CLEANUP, _TARGET_KEY[trial.target])
            for eid, sched in seen.get("adopted", {}).items():
                found.append(("C7", f"find_inflight adopted {run_.keys.get(eid, eid)} "
                                    f"(schedule {sched}) while its owner was alive"))
            touched = _touched(call, run_, result)
            if p == 0:
                found += _apply_call(run_, call, moved, trial.op)
            found += _listing(run_, seen["listed"], touched, "the observer")
            if call.op is Op.ENQUEUE:
                got = touched & {run_.keys[e] for e in seen["listed"] if e in run_.keys}
                if got and got != touched:
                    found.append(("C2", f"the observer listed {sorted(got)} of the message "
                                        f"being committed, {sorted(touched)}"))
            for i, eid in enumerate(claims, 1):
                found += _claim(run_, eid, seen["claimed"].get(eid), "the observer")
                if p == i:
                    found += _apply_call(run_, call, moved, trial.op)
            if p == len(claims) + 1:
                found += _apply_call(run_, call, moved, trial.op)
            if best is None or len(found) < len(best[0]):
                best = (found, run_.model)
            if not found:
                return []
    assert best is not None
    run_.model = best[1]
    return best[0]


def _touched(call: Call, run_: Run, result: dict[str, Any]) -> set[EntryKey]:
    if call.op is Op.ENQUEUE:
        m = run_.model.next_id
        return {(m, i) for i in range(len(call.rcpts))}
    assert call.key is not None
    return {call.key}


def _apply_call(run_: Run, call: Call, moved: bool | None, op: str) -> Problems:
    if moved is None:  # it failed: reported already; the model keeps the old state
        return []
    after, outcome = run_call(run_.model, call)
    if call.op is Op.ENQUEUE:
        run_.model = after
        return [] if moved else [("C2", "the enqueue returned without committing")]
    model_moved = outcome is ModelOutcome.MOVED
    if moved and not model_moved:
        return [("C7", f"{op} of {call.key} succeeded, but another process had already "
                       f"moved the entry ({run_.model.state_of(call.key).value})")]
    if not moved and model_moved:
        return [("C7", f"{op} of {call.key} returned None, as if another process had moved "
                       f"it, but none did ({run_.model.state_of(call.key).value})")]
    run_.model = after
    return []


# ---- the check -------------------------------------------------------------------------

def _ops(caps: frozenset[Capability]) -> list[str]:
    return [o for o in OPS if o not in HOLD_OPS or Capability.HOLD in caps]


def _trials(bench: Bench, ops: list[str], targets: list[str], profile: Profile,
            rng: random.Random) -> Iterator[tuple[Trial, TrialOutcome]]:
    """Every stop point of every operation (seam; the quick profile samples them), or
    random SIGSTOP delays (other backends)."""
    for op in ops:
        for target in targets:
            if bench.seam:
                stop = 0
                points: list[int] | None = None
                while True:
                    if points is not None:
                        if not points:
                            break
                        stop = points.pop(0)
                    trial = Trial(op, target, stop)
                    out = run_trial(bench, trial)
                    yield trial, out
                    if not out.stopped or stop > 1000:
                        break  # past the last stop point
                    if points is None and profile.edges_stops is not None and out.stopped \
                            and not out.findings:
                        # learn how many stop points there are, then sample them
                        probe = run_trial(bench, Trial(op, target, 10_000))
                        total = probe.calls + 1
                        rest = list(range(1, total))
                        rng.shuffle(rest)
                        points = sorted(rest[:max(0, profile.edges_stops - 1)])
                        continue
                    if points is None:
                        stop += 1
            else:
                probe = run_trial(bench, Trial(op, target, None, -1.0))
                span = max(probe.seconds, 0.0005) * 1.2
                for _ in range(profile.edges_signal_trials):
                    trial = Trial(op, target, None, rng.uniform(0.0, span))
                    yield trial, run_trial(bench, trial)


def run(backend: Backend, profile: Profile, seed: int,
        caps: frozenset[Capability] | None = None) -> CheckResult:
    start = time.perf_counter()
    if caps is None:
        caps = backend.probe().capabilities
    seam = backend.takes_io and Capability.IO_SEAM in caps
    rng = random.Random(seed)
    findings: list[Finding] = []
    stats: dict[str, Any] = {"trials": 0, "stopped": 0, "observer_waited": 0,
                             "mode": "stop points" if seam else "SIGSTOP"}
    targets = list(TARGETS) if profile.edges_all_targets else [rng.choice(TARGETS)]
    with Bench(backend, seam, seed) as bench:
        for trial, out in _trials(bench, _ops(caps), targets, profile, rng):
            stats["trials"] += 1
            stats["stopped"] += out.stopped
            stats["observer_waited"] += out.blocked
            for clause, detail in out.findings:
                findings.append(Finding(clause, detail, trial.scenario, NO_CRASH,
                                        tuple(out.steps)))
    return finished(CHECK, NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of one trial, run again."""
    parts = scenario.split(":")
    if len(parts) != 4 or parts[0] != CHECK or parts[1] not in OPS or parts[2] not in TARGETS:
        raise ValueError(f"{scenario!r}: expected {CHECK}:<op>:<single|pair>:<stop point "
                         "or sig<microseconds>>")
    op, target, where = parts[1:]
    caps = backend.probe().capabilities
    seam = backend.takes_io and Capability.IO_SEAM in caps
    if where.startswith("sig"):
        trial = Trial(op, target, None, int(where[3:]) / 1e6)
    else:
        trial = Trial(op, target, int(where))
    if seam != (trial.stop is not None):
        raise ValueError(f"{scenario!r}: this backend is stopped "
                         f"{'at stop points' if seam else 'by SIGSTOP'}")
    with Bench(backend, seam, 0) as bench:
        out = run_trial(bench, trial)
    return [Finding(c, d, trial.scenario, NO_CRASH, tuple(out.steps)) for c, d in out.findings]


__all__ = ["API", "CHECK", "replay", "run"]
