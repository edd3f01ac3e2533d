"""Crash FsQueue before every mutating call of every operation (and of its recovery), then
reopen and judge the recovered queue with the spec's crash condition (spec.crash.judge).

Crash model here: process kill (everything the kernel accepted stays).  Power-loss models
are explored by faultinject; the power-loss states the protocol must handle (duplicate
links, orphans) are built by hand in test_fsqueue_recovery.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.layout import EntryName, parse_inflight
from queue_ref.storage import Footprint, Schedule
from spec import Call, EntryState, EntryView, Model, Op, judge
from tests.test_fsqueue_support import Crash, CrashIO, message_parts

FROM = "sender@example.com"
BODY = b"Subject: crash\r\n\r\n" + b"x" * 5000
RCPTS = (("user0@example.org", Schedule(0)), ("user1@example.org", Schedule(1)))


def _put(q: FsQueue) -> Any:
    from queue_ref.storage import Recipient

    with q.enqueue(FROM) as enq:
        enq.write(BODY[:100])
        enq.write(BODY[100:])
        return enq.commit([Recipient(a, s) for a, s in RCPTS])


def _model(*ops: tuple[Op, tuple[int, int], Schedule | None]) -> Model:
    m, _ = Model().enqueue(FROM, BODY, RCPTS)
    for op, key, sched in ops:
        m, _ = m.apply(op, key, sched)
    return m


@dataclass
class Scenario:
    setup: Callable[[FsQueue], Any]
    op: Callable[[FsQueue, Any], object]
    before: Model
    call: Call


def _started(q: FsQueue) -> Any:
    h = _put(q)
    return q.send_start(h[0])


def _dropped_first(q: FsQueue) -> Any:
    h = _put(q)
    return q.drop(h[0])


def _last_left(q: FsQueue) -> Any:
    h = _put(q)
    p = q.drop(h[0])
    q.cleanup(p)
    return q.drop(h[1])


S0, S1 = Schedule(50, 1), Schedule(60, 2)
SCENARIOS = {
    "enqueue": Scenario(lambda q: None, lambda q, _: _put(q), Model(),
                        Call(Op.ENQUEUE, mail_from=FROM, body=BODY, rcpts=RCPTS)),
    "send_start": Scenario(_put, lambda q, h: q.send_start(h[0]), _model(),
                           Call(Op.SEND_START, (0, 0))),
    "reschedule": Scenario(_put, lambda q, h: q.reschedule(h[1], S0), _model(),
                           Call(Op.RESCHEDULE, (0, 1), S0)),
    "send_cancel": Scenario(_started, lambda q, i: q.send_cancel(i, S1),
                            _model((Op.SEND_START, (0, 0), None)),
                            Call(Op.SEND_CANCEL, (0, 0), S1)),
    "send_done": Scenario(_started, lambda q, i: q.send_done(i),
                          _model((Op.SEND_START, (0, 0), None)), Call(Op.SEND_DONE, (0, 0))),
    "drop": Scenario(_put, lambda q, h: q.drop(h[1]), _model(), Call(Op.DROP, (0, 1))),
    "cleanup": Scenario(_dropped_first, lambda q, p: q.cleanup(p),
                        _model((Op.DROP, (0, 0), None)), Call(Op.CLEANUP, (0, 0))),
    "cleanup_last": Scenario(_last_left, lambda q, p: q.cleanup(p),
                             _model((Op.DROP, (0, 0), None), (Op.CLEANUP, (0, 0), None),
                                    (Op.DROP, (0, 1), None)),
                             Call(Op.CLEANUP, (0, 1))),
}


def recovered_views(q: FsQueue) -> set[EntryView]:
    """Every linked entry, read through a backdoor (the files), as the spec's views."""
    msgids: set[str] = set()
    found: list[tuple[EntryName, EntryState]] = []
    for d, state in (("queue", EntryState.QUEUED), ("inflight", EntryState.INFLIGHT),
                     ("cleanup", EntryState.PENDING_CLEANUP)):
        for name in os.listdir(os.path.join(q.root, d)):
            e = EntryName.parse(name)
            if e is None:
                parsed = parse_inflight(name)
                assert parsed is not None, name
                e = parsed[0]
            found.append((e, state))
            msgids.add(e.msgid)
    number = {m: k for k, m in enumerate(sorted(msgids))}
    out = set()
    for e, state in found:
        got = q._load_entry(e)
        assert got is not None, f"{e} dangles after recovery"
        env, sched = got
        digest = hashlib.sha256(message_parts(os.path.join(q.root, "data", e.msgid))[0]
                                ).hexdigest()
        out.add(EntryView(number[e.msgid], e.index, env.rcpts[e.index].address, env.mail_from,
                          digest, sched, state))
    return out


def check_recovered(root: str, sc: Scenario, where: str) -> None:
    q = FsQueue(root)
    try:
        views = recovered_views(q)
        problems = judge(sc.before, sc.call, views)
        assert not problems, f"{where}: {[str(p) for p in problems]}"
        again = q.recover()  # idempotent: nothing left to do
        assert again == type(again)(), f"{where}: second recovery did {again}"
        assert os.listdir(os.path.join(root, "tmp")) == [q.owner], where
        for m in list(q.list_queue()):  # drain: nothing may leak (C8)
            i = q.send_start(m)
            assert i is not None
            p = q.send_done(i)
            assert p is not None and q.cleanup(p)
        assert q.footprint() == Footprint(0, 0), where
        for d in ("queue", "inflight", "cleanup", "data"):
            assert os.listdir(os.path.join(root, d)) == [], (where, d)
    finally:
        q.close()


def crash_in_op(root: str, sc: Scenario, k: int | None) -> int:
    """Run the setup, then the op with a crash before its k-th mutating call; 'kill' the
    process.  Returns the number of mutating calls the op made (when k is None)."""
    io = CrashIO()
    q = FsQueue(root, io)
    ctx = sc.setup(q)
    base = len(io.calls)
    io.crash_at = None if k is None else base + k
    with contextlib.suppress(Crash):
        sc.op(q, ctx)
    io.kill()
    return len(io.calls) - base


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_crash_at_every_call_of_an_operation(tmp_path: Any, name: str) -> None:
    sc = SCENARIOS[name]
    total = crash_in_op(str(tmp_path / "dry"), sc, None)
    assert total > 0
    for k in range(total + 1):  # k == total: the op returned, then the process died
        root = str(tmp_path / f"k{k}")
        crash_in_op(root, sc, k)
        check_recovered(root, sc, f"{name}: crash before call {k} of {total}")


@pytest.mark.parametrize("name", ["enqueue", "send_done", "cleanup_last", "send_cancel"])
def test_crash_inside_recovery_then_recover_again(tmp_path: Any, name: str) -> None:
    sc = SCENARIOS[name]
    total = crash_in_op(str(tmp_path / "dry"), sc, None)
    runs = 0
    for k in range(total):
        dry = str(tmp_path / f"dry{k}")
        crash_in_op(dry, sc, k)
        io = CrashIO()
        opened = FsQueue(dry, io)
        rec_calls = len(io.calls)  # opening: layout checks, owner registration, recovery
        opened.close()
        for j in range(rec_calls):
            root = str(tmp_path / f"k{k}j{j}")
            crash_in_op(root, sc, k)
            io = CrashIO(crash_at=j)
            with pytest.raises(Crash):
                FsQueue(root, io)
            io.kill()
            check_recovered(root, sc, f"{name}: crash before call {k}, then in recovery "
                                      f"before call {j} of {rec_calls}")
            runs += 1
    assert runs > 0


class NonAtomicMove(FsQueue):
    """A deliberately broken queue: moves a link by unlink + a new hard link to the
    message file instead of rename."""

    def _move_link(self, src: str, dst: str) -> bool:
        msgid = os.path.basename(src).split("@")[0].rsplit(".", 1)[0]
        if not self.io.exists(src):
            return False
        self.io.unlink(src)
        self.io.link(self.layout.msg_file(msgid), dst)
        return True


def test_the_exploration_finds_a_broken_step(tmp_path: Any) -> None:
    """Sanity check of this harness: a non-atomic move loses the entry of a send_cancel."""
    sc = SCENARIOS["send_cancel"]
    found = []
    for k in range(8):
        root = str(tmp_path / f"k{k}")
        io = CrashIO()
        q = NonAtomicMove(root, io)
        ctx = sc.setup(q)
        io.crash_at = len(io.calls) + k
        with contextlib.suppress(Crash):
            sc.op(q, ctx)
        io.kill()
        q2 = FsQueue(root)
        found += judge(sc.before, sc.call, recovered_views(q2))
        q2.close()
    assert any(v.clause == "C4" for v in found), found
