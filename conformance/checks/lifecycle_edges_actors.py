"""The two child processes of the lifecycle-edges check, and the queue they start from.

The *actor* (``actor``) runs one operation of a trial on command and stands still inside
it: at a stop point of its I/O seam (``harness.stop_gate_io``), where it waits for the
parent's "release", or wherever SIGSTOP finds it once it has said "starting".  The
*observer* (``observer``) opens the queue on command, calls ``find_inflight``, lists the
queue and claims every entry it lists; on "finish" it reads back and sends what it
claimed (``send_done``, and ``cleanup`` of every other one).  Both answer with one JSON line per
step (``harness.child_process``) and are reused from trial to trial.

The queue holds mail's data (``conformance.harness.mail_data``): a decomposed UTF-8
sender and the null sender, upper-case and quoted local parts, the Angstrom sign, UTF-8
and trailing-dot domains, ``Postmaster``; schedules in the past, at ``2**31 - 1`` and
beyond it to the largest, with reasons of CRLF, NUL and 2-octet UTF-8; bodies with and
without a final CRLF, dot lines, bare CR and LF.  The entries the actor works on (and
its bystander) are due no later than ``2**31 - 1``, the two others after it.  Schedules
travel as ``[at, attempts, reason]``; what the observer reads back (``read_back``: the
sender, the recipient, its index, the body's SHA-256 and size, ``meta.body_size``,
``meta.schedule`` and the handle's) goes to the parent whole, to be compared there with
what was committed.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Channel
from conformance.harness.mail_data import (
    CORPUS_BODY,
    CORPUS_RCPTS,
    CORPUS_SCHEDULES,
    CORPUS_SENDER,
    MAX_SCHEDULE,
)
from conformance.harness.stop_gate_io import StopGateIO
from queue_ref.io import OsIO
from queue_ref.storage import InflightMail, QueueError, Recipient, Schedule, Storage
from spec.model import EntryKey

CHECK = "lifecycle-edges"
OPS = ("open", "enqueue", "send_start", "send_done", "send_cancel", "reschedule", "drop",
       "cleanup", "hold", "release")
HOLD_OPS = ("hold", "release")
TARGETS = ("single", "pair")
#: The last second a signed 32-bit time_t holds: the actor's entries are due by then.
TIME_T_MAX = 2**31 - 1
# The queue every trial starts from: message 0 has two recipients, 1 one, 2 two.
PREFIX: tuple[tuple[str, tuple[tuple[str, Schedule], ...], bytes], ...] = (
    (CORPUS_SENDER, ((CORPUS_RCPTS[0], Schedule(0, 0, "first try \u00e9")),
                     (CORPUS_RCPTS[1], CORPUS_SCHEDULES[0])),
     CORPUS_BODY),
    ("", (('"john doe"@A.EXAMPLE.', Schedule(1, 255, "x\x00y\r\rz\n")),),
     b"Subject: one\r\n\r\n..\r\n.\r\nbare CR\r"),
    ("\u7528\u6237@\u4f8b\u5b50.\u5e7f\u544a",
     (("x@B\u00fccher.example", Schedule(MAX_SCHEDULE, MAX_SCHEDULE, "\u00e9" * 500)),
      ("Postmaster", Schedule(TIME_T_MAX, 2, "421 4.4.2 Pe\u0301rez\r\n"))),
     b"Subject: two\r\n\r\nbare LF\n\r\n.\r\n"),
)
TARGET_KEY: dict[str, EntryKey] = {"single": (1, 0), "pair": (0, 0)}
BYSTANDER: EntryKey = (2, 1)  # the actor holds it INFLIGHT throughout
RESCHEDULE = Schedule(TIME_T_MAX, 1, "452 4.2.2 Pe\u0301rez: mailbox full\r\n")
CANCEL = Schedule(7, 2, "421 4.7.0 \u212b try again later\r\n\x00")
# The enqueue under test: one recipient and a small body, or two and a body written
# in several pieces before the commit.  Its recipients' domains are some the queue
# already holds (in other cases): a new domain's index costs the filesystem queue more
# steps before the commit point, and the quick profile's sample of stop points would
# find the window around it less often.
NEW_SENDER = '"a\\"b"@a.example'
NEW_BODY = {"single": b"Subject: new\r\n\r\n.\r\nsmall\r\n",
             "pair": b"Subject: new\r\n\r\n" + b"x" * 150_000 + b"\r\n"}
NEW_RCPTS: dict[str, tuple[tuple[str, Schedule], ...]] = {
    "single": (("U0@A.example", Schedule(0, 0, "\u2603")),),
    "pair": (("U0@A.example", Schedule(0, 0, "\u2603")),
             ("\u00e9" * 32 + "@C.EXAMPLE.", Schedule(TIME_T_MAX, 0, "P\u00e9rez\r\n")))}


def sched_list(s: Schedule) -> list[Any]:
    """A schedule as the children send it: ``[at, attempts, reason]``."""
    return [s.at, s.attempts, s.reason]


# ---- the children --------------------------------------------------------------------

def _recv(ch: Channel) -> dict[str, Any] | None:
    """The parent's next command: a JSON object, or a word (None: the parent is gone)."""
    line = ch.recv()
    if not line:
        return None
    return json.loads(line) if line.startswith("{") else {"cmd": line}


def actor(ch: Channel, backend: Backend, seam: bool) -> None:
    """Runs trials on command; stops inside the operation under test."""
    kept: list[object] = []  # what a killed owner leaves open: never closed
    while True:
        cmd = _recv(ch)
        if cmd is None or cmd["cmd"] == "quit":
            return
        if cmd["cmd"] == "leave":
            _leave(ch, backend, cmd, kept)
        elif cmd["cmd"] == "run":
            _act(ch, backend, seam, cmd, kept)


def _leave(ch: Channel, backend: Backend, cmd: dict[str, Any], kept: list[object]) -> None:
    """An owner that goes away mid-work: an inflight entry, a pending cleanup and an
    enqueue it never committed (``_abandon_enqueue``)."""
    store = backend.open(cmd["root"])
    listed = {h.entry_id: h for h in store.list_queue()}
    f = store.send_start(listed[cmd["inflight"]])
    g = store.send_start(listed[cmd["pending"]])
    p = store.send_done(g) if g is not None else None
    _abandon_enqueue(store, kept)
    kept.append(store)
    ch.send({"left": [f is not None, p is not None]})


def _abandon_enqueue(store: Storage, kept: list[object]) -> None:
    """Start an enqueue on ``store`` and close it without finishing, as a killed owner
    would: its message is left for a recovery to remove (the enqueue is kept, never
    closed)."""
    enq = store.enqueue("gone@edges.example")
    enq.write(b"Subject: never\r\n\r\n" + b"y" * 70_000)
    kept.append(enq)
    store.close()


def _leave_enqueue(backend: Backend, root: str, kept: list[object]) -> None:
    """Beside the actor's open queue, another owner leaves an enqueue it never committed
    (``_abandon_enqueue``): only a recovery that runs with no other owner alive could have
    removed it before the observer's."""
    _abandon_enqueue(backend.open(root), kept)


def _act(ch: Channel, backend: Backend, seam: bool, cmd: dict[str, Any],
         kept: list[object]) -> None:
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
                    claimed[f.entry_id] = sched_list(f.schedule)
            ch.send({"claimed": claimed, "adopted": found})
        else:
            store = backend.open(cmd["root"], gate) if gate is not None else \
                backend.open(cmd["root"])
            # the observer's recovery then has a dead owner's leftovers to remove beside
            # the live actor, and must take nothing the operation made so far (a
            # commit's hard links before its rename)
            _leave_enqueue(backend, cmd["root"], kept)
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
            rcpts = [Recipient(r, s) for r, s in NEW_RCPTS[target]]
            with store.enqueue(NEW_SENDER) as enq:
                body = NEW_BODY[target]
                for i in range(0, len(body), 65536):
                    enq.write(body[i:i + 65536])
                got = enq.commit(rcpts)
            out: dict[str, Any] = {"moved": True, "message": got[0].message_id,
                                   "entries": [g.entry_id for g in got]}
        else:
            res: Any = {
                "send_start": lambda: store.send_start(h),
                "send_done": lambda: store.send_done(h),
                "send_cancel": lambda: store.send_cancel(h, CANCEL),
                "reschedule": lambda: store.reschedule(h, RESCHEDULE),
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
                out = {"moved": True, "entry": res.entry_id, "schedule": sched_list(res.schedule)}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "typed": isinstance(e, QueueError)}
    took = time.perf_counter() - t0
    if gate is not None:
        gate.disarm()
    return out, took


def observer(ch: Channel, backend: Backend) -> None:
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
                claimed[f.entry_id] = sched_list(f.schedule)
                claims.append(f)
        claims[:0] = adopted
        ch.send({"observed": True, "listed": [h.entry_id for h in listed],
                 "listed_schedules": {h.entry_id: sched_list(h.schedule) for h in listed},
                 "adopted": {f.entry_id: sched_list(f.schedule) for f in adopted},
                 "claimed": claimed})
    except Exception as e:
        ch.send({"observed": False, "error": f"{type(e).__name__}: {e}"})
    if _recv(ch) is None:  # "finish"
        return
    finished_: list[list[Any]] = []
    try:
        for i, f in enumerate(claims):
            assert store is not None
            read = read_back(store, f)
            p = store.send_done(f)
            cleaned = store.cleanup(p) if p is not None and i % 2 == 0 else None
            finished_.append([f.entry_id, p is not None, cleaned, read])
        assert store is not None
        ch.send({"finished": finished_, "delivered": _deliver_rest(store)})
    except Exception as e:
        ch.send({"finished": finished_, "error": f"{type(e).__name__}: {e}"})
    if _recv(ch) is not None and store is not None:  # "close"
        store.close()
    ch.send({"closed": True})


def read_back(store: Storage, f: InflightMail) -> dict[str, Any]:
    """What ``read_inflight`` gives for the claim ``f``: the metadata's sender, recipient,
    index, body size and schedule, the body's size and SHA-256, the handle's schedule;
    or the error it raised."""
    try:
        with store.read_inflight(f) as r:
            body = r.read_all()
            meta = r.meta
    except QueueError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"mail_from": meta.mail_from, "rcpt": meta.rcpt, "index": meta.rcpt_index,
            "body_size": meta.body_size, "size": len(body),
            "digest": hashlib.sha256(body).hexdigest(), "schedule": sched_list(meta.schedule),
            "handle": sched_list(f.schedule)}


def _deliver_rest(store: Storage) -> list[list[Any]]:
    """While the actor still has the queue open (so no recovery that runs alone can mend
    anything meanwhile), deliver every entry still queued, one at a time as a relay does:
    claim, read the body whole, ``send_done``, ``cleanup``.  A store that lost count of
    a message's holders frees a body another entry still needs, whose read then fails.
    [entry id, sha256 of the body, schedule, error or None, ``read_back``] for each entry
    claimed."""
    out: list[list[Any]] = []
    for h in store.list_queue():
        try:
            f = store.send_start(h)
            if f is None:
                continue
            read = read_back(store, f)
            if "error" in read:
                out.append([h.entry_id, None, sched_list(f.schedule), read["error"]])
                continue
            digest = read["digest"]
            p = store.send_done(f)
            if p is not None:
                store.cleanup(p)
            out.append([f.entry_id, digest, sched_list(f.schedule), None, read])
        except QueueError as e:
            out.append([h.entry_id, None, sched_list(h.schedule), f"{type(e).__name__}: {e}"])
    return out
