"""The KV queue on the log engine, crashed at every mutating disk call of a workload.

For each crash point (before and after every mutating call), every disk the persistence
models allow is built, the queue is opened on it (recovery runs), and what it lists is
judged against the spec's crash condition of the interrupted call (``spec.judge``).  Each
recovered queue must then recover idempotently and drain to zero keys (C8, C10).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from faultinject import Crash, FaultPlan, FaultyIO, crash_states, materialize
from queue_ref.body_digest import BodyDigest
from queue_ref.kv import keys, kv_records
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import InflightMail, QueuedMail, Recipient, Schedule
from spec import Call, EntryState, EntryView, Model, Op, judge, run

BODY = bytes(range(256)) * 280  # 71,680 bytes: two chunks
S = Schedule

WORKLOAD = (
    Call(Op.ENQUEUE, mail_from="s@x", body=BODY, rcpts=(("a@x", S(1)), ("b@y", S(2)))),
    Call(Op.ENQUEUE, mail_from="", body=b"tiny", rcpts=(("c@x", S(3)),)),
    Call(Op.SEND_START, (0, 0)),
    Call(Op.RESCHEDULE, (0, 1), S(5, 1)),
    Call(Op.SEND_DONE, (0, 0)),
    Call(Op.SEND_START, (1, 0)),
    Call(Op.SEND_CANCEL, (1, 0), S(7, 1)),
    Call(Op.DROP, (0, 1)),
    Call(Op.CLEANUP, (0, 0)),
    Call(Op.CLEANUP, (0, 1)),
)


def _apply(q: KvQueue, call: Call, handles: dict[tuple[int, int], object]) -> None:
    if call.op is Op.ENQUEUE:
        with q.enqueue(call.mail_from) as e:
            for i in range(0, len(call.body), 30_000):
                e.write(call.body[i:i + 30_000])
            hs = e.commit([Recipient(r, s) for r, s in call.rcpts])
        for h in hs:
            mid, idx = keys.parse_entry_id(h.entry_id)
            handles[(mid, idx)] = h
        return
    assert call.key is not None
    h = handles.pop(call.key)
    out: object
    if call.op is Op.SEND_START:
        assert isinstance(h, QueuedMail)
        out = q.send_start(h)
    elif call.op is Op.RESCHEDULE:
        assert isinstance(h, QueuedMail) and call.schedule is not None
        out = q.reschedule(h, call.schedule)
    elif call.op is Op.SEND_CANCEL:
        assert isinstance(h, InflightMail) and call.schedule is not None
        out = q.send_cancel(h, call.schedule)
    elif call.op is Op.SEND_DONE:
        assert isinstance(h, InflightMail)
        out = q.send_done(h)
    elif call.op is Op.DROP:
        assert isinstance(h, QueuedMail)
        out = q.drop(h)
    else:
        out = q.cleanup(h)  # type: ignore[arg-type]
    assert out is not None and out is not False
    if out is not True:
        handles[call.key] = out


def _run_until_crash(root: str, plan: FaultPlan) -> tuple[FaultyIO, Model, Call | None, bool]:
    """Run the workload; the model before the call that crashed, and that call."""
    io = FaultyIO(root, plan)
    model = Model()
    call: Call | None = None
    try:
        q = KvQueue.open_log(root, io=io, clock=lambda: 0)
        handles: dict[tuple[int, int], object] = {}
        for call in WORKLOAD:
            _apply(q, call, handles)
            model, _ = run(model, call)
        call = None
        q.close()
    except Crash:
        return io, model, call, True
    return io, model, None, False


def _views(q: KvQueue) -> set[EntryView]:
    """What the recovered queue holds, read from its raw keys (bodies hashed)."""
    out = set()
    for fam, state in ((keys.ZONE, EntryState.QUEUED), (keys.INFLIGHT, EntryState.INFLIGHT),
                       (keys.CLEANUP, EntryState.PENDING_CLEANUP)):
        for k, v in q.kv.iterate(fam, keys.end_of(fam)):
            if fam == keys.ZONE:
                _, mid, idx = keys.parse_indexed(k)
            else:
                mid, idx = keys.parse_entry(k)
            rec = kv_records.EntryRec.decode(v, mid, idx, state.value.split("_")[0])
            meta = kv_records.MetaRec.decode(q.kv.get(keys.meta(mid)) or b"", mid)
            body = b"".join(q.kv.get(keys.chunk(mid, s)) or b"!"
                            for s in range(1, meta.chunks + 1))
            digest = BodyDigest(meta.digest)
            digest.update(body)
            assert digest.value() == meta.digest
            out.add(EntryView(mid, idx, rec.address, meta.mail_from,
                              hashlib.sha256(body).hexdigest(), rec.schedule, state))
    return out


def _check_recovered(root: str, before: Model, call: Call | None, where: str) -> None:
    q = KvQueue.open_log(root)
    try:
        problems = judge(before, call, _views(q))
        assert not problems, f"{where}: {[str(p) for p in problems]}"
        again = q.recover()
        assert again == type(again)(), f"{where}: recovery not idempotent: {again}"
        for h in list(q.list_queue()):
            p = q.drop(h)
            assert p is not None and q.cleanup(p)
        assert q.footprint().objects == 0, where
    finally:
        q.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_every_crash_point_recovers_to_an_allowed_state(tmp_path: Path, when: str) -> None:
    (tmp_path / "count").mkdir()
    total_io, _, _, crashed = _run_until_crash(str(tmp_path / "count"), FaultPlan())
    assert not crashed
    points = total_io.mutating_count
    assert points > 20
    checked = 0
    for n in range(points):
        root = tmp_path / f"{when}-{n}"
        root.mkdir()
        io, before, call, crashed = _run_until_crash(str(root), FaultPlan(n, when))
        assert crashed
        for model in ("process-kill", "weak"):
            for state in crash_states(io.initial, io.events, model, random_states=2, seed=n):
                disk = tmp_path / "disk"
                materialize(state.image, str(disk))
                _check_recovered(str(disk), before, call,
                                 f"crash {when} call {n} ({model}: {state.description})")
                shutil.rmtree(disk)
                checked += 1
        shutil.rmtree(root)
    assert checked >= points
