"""Self-check of the executable contract: every reachable model state within a bound.

The model is deterministic, so the states reachable by operation sequences of length at
most ``d`` are exactly the first ``d`` layers of a breadth-first search.  The search below
runs to its fixpoint, so it covers every operation sequence of every length within the
bound (messages, recipients per message, schedules); its depth is reported.

CI bound: 2 messages x 1-2 recipients x 2 schedules: 8,191 states (HELD included), every
one reached within 10 operations (the count equals a closed form, so no state is missed or
invented); 360,950 (state, call) pairs, of which 76,204 move an entry.  The thorough
profile (``QUEUE_REF_PROFILE=thorough``) adds 2 messages x 1-2 recipients x 3 schedules
(33,307 states) and 3 messages x 1-2 recipients x 1 schedule (27,931 states), and checks
the crash oracle on every pair.

Besides the invariants and the transition table, the crash oracle is checked: every
allowed recovery is accepted and hand-made bad recoveries are rejected with the clause
they break.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest

from spec import (
    CLAUSES,
    TABLE,
    Call,
    EntryState,
    EntryView,
    Model,
    Op,
    Outcome,
    Schedule,
    allowed_views,
    judge,
    run,
)
from spec.invariants import check
from spec.model import finish_call
from spec.states import LIVE_STATES, RESTART
from tests.conftest import thorough

S0 = Schedule(0)
S1 = Schedule(900, 1)
S2 = Schedule(3600, 2)
OTHER = Schedule(12345, 9)  # never used by the bounded workloads


@dataclass(frozen=True)
class Bound:
    messages: int
    max_rcpts: int
    schedules: tuple[Schedule, ...]

    def expected_states(self) -> int:
        """Closed form: each entry of an enqueued message is in one of 4*S+1 states
        (QUEUED, HELD, INFLIGHT or PENDING_CLEANUP with each of S schedules, or GONE)."""
        per_entry = len(LIVE_STATES) * len(self.schedules) + 1
        per_message = sum(per_entry ** n for n in range(1, self.max_rcpts + 1))
        return sum(per_message ** k for k in range(self.messages + 1))


CI_BOUND = Bound(messages=2, max_rcpts=2, schedules=(S0, S1))
THOROUGH_BOUNDS = (
    CI_BOUND,
    Bound(messages=2, max_rcpts=2, schedules=(S0, S1, S2)),
    Bound(messages=3, max_rcpts=2, schedules=(S0,)),
)
BOUNDS = THOROUGH_BOUNDS if thorough() else (CI_BOUND,)
over_bounds = pytest.mark.parametrize(
    "b", BOUNDS, ids=lambda b: f"{b.messages}msg-{b.max_rcpts}rcpt-{len(b.schedules)}sched")


def sender(mid: int) -> str:
    return f"sender{mid}@example.org"


def body(mid: int) -> bytes:
    return b"Subject: m%d\r\n\r\nbody of message %d\r\n" % (mid, mid)


def rcpt(mid: int, i: int) -> str:
    return f"r{i}.m{mid}@example.net"


def calls(m: Model, b: Bound) -> Iterator[Call]:
    """Every call of the bound on ``m``: enqueues of the next message and every op on every
    key, including keys that are absent, gone or of messages not yet enqueued."""
    if m.next_id < b.messages:
        mid = m.next_id
        for n in range(1, b.max_rcpts + 1):
            for scheds in itertools.product(b.schedules, repeat=n):
                yield Call(Op.ENQUEUE, mail_from=sender(mid), body=body(mid),
                           rcpts=tuple((rcpt(mid, i), s) for i, s in enumerate(scheds)))
    for key in itertools.product(range(b.messages), range(b.max_rcpts)):
        for op in TABLE:
            if op is Op.ENQUEUE:
                continue
            if TABLE[op].changes_schedule:
                for s in b.schedules:
                    yield Call(op, key, s)
            else:
                yield Call(op, key)


@dataclass(frozen=True)
class Exploration:
    bound: Bound
    states: tuple[Model, ...]
    depth: dict[tuple[object, ...], int]
    edges: int


@functools.cache
def explore(b: Bound) -> Exploration:
    """Breadth-first search of every state reachable from the empty model, to the fixpoint."""
    start = Model()
    depth = {start.canonical(): 0}
    order = [start]
    frontier = [start]
    edges = 0
    while frontier:
        nxt = []
        for m in frontier:
            d = depth[m.canonical()]
            for c in calls(m, b):
                edges += 1
                after, _ = run(m, c)
                key = after.canonical()
                if key not in depth:
                    depth[key] = d + 1
                    order.append(after)
                    nxt.append(after)
        frontier = nxt
    return Exploration(b, tuple(order), depth, edges)


def pairs(b: Bound) -> Iterator[tuple[Model, Call]]:
    for m in explore(b).states:
        for c in calls(m, b):
            yield m, c


# ---- the state space -------------------------------------------------------------------


@over_bounds
def test_state_space_is_complete_and_deep(b: Bound) -> None:
    ex = explore(b)
    assert len(ex.states) == b.expected_states()
    assert max(ex.depth.values()) >= 6
    # Every entry state of the table is reached, with every schedule.
    seen = {(e.state, e.schedule) for m in ex.states for e in m.entries.values()}
    assert seen == {(s, sc) for s in LIVE_STATES for sc in b.schedules}
    assert any(EntryState.GONE in {m.state_of(k) for k in m.retired} for m in ex.states)


def test_ci_bound_numbers() -> None:
    """The numbers the module docstring quotes."""
    ex = explore(CI_BOUND)
    assert len(ex.states) == 8191
    assert max(ex.depth.values()) == 10
    assert ex.edges == sum(1 for _ in pairs(CI_BOUND)) == 360_950
    assert sum(1 for _ in moved_pairs(CI_BOUND)) == 76_204


@over_bounds
def test_invariants_hold_in_every_reachable_state(b: Bound) -> None:
    for m in explore(b).states:
        assert check(m) == [], m


def test_invariants_detect_broken_models() -> None:
    """The invariants are not vacuous: each catches a model that breaks it."""
    m, _ = Model().enqueue(sender(0), body(0), [(rcpt(0, 0), S0), (rcpt(0, 1), S0)])
    m, _ = m.apply(Op.DROP, (0, 0))
    e = m.entries[(0, 1)]
    broken = {
        "I1": replace(m, entries={**m.entries, (0, 5): e}),
        "I2": replace(m, messages={**m.messages, 7: m.messages[0]}, next_id=8),
        "I3": replace(m, entries={**m.entries, (0, 1): replace(e, state=EntryState.GONE)}),
        "I4": replace(m, entries={**m.entries, (0, 0): e}),
        "I5": replace(m, retired=frozenset()),
        "I6": replace(m, next_id=0),
    }
    for inv, bad in broken.items():
        problems = check(bad)
        assert any(p.startswith(inv + ":") for p in problems), (inv, problems)


# ---- the transition table --------------------------------------------------------------


def _check_single_entry_call(m: Model, c: Call) -> None:
    assert c.key is not None
    key = c.key
    before = m.state_of(key)
    after, outcome = run(m, c)
    assert isinstance(outcome, Outcome)
    t = TABLE[c.op]
    if before is not t.source:
        assert outcome is Outcome.VANISHED, (c.describe(), before)
        assert after is m, "a VANISHED call must change nothing"
        return
    assert outcome is Outcome.MOVED, (c.describe(), before)
    assert after.state_of(key) is t.target
    if t.target in LIVE_STATES:
        want = c.schedule if t.changes_schedule else m.entries[key].schedule
        assert after.entries[key].schedule == want
    # Frame: no other entry, message or id changes.
    assert {k: e for k, e in after.entries.items() if k != key} == {
        k: e for k, e in m.entries.items() if k != key}
    assert after.next_id == m.next_id
    assert after.retired == (m.retired | {key} if t.target is EntryState.PENDING_CLEANUP
                             else m.retired)
    still = {k[0] for k in after.entries}
    assert dict(after.messages) == {i: v for i, v in m.messages.items() if i in still}


def _check_enqueue(m: Model, c: Call) -> None:
    after, mid = run(m, c)
    assert mid == m.next_id and after.next_id == m.next_id + 1
    assert after.messages[mid].body == c.body and after.messages[mid].mail_from == c.mail_from
    new = {k: e for k, e in after.entries.items() if k not in m.entries}
    assert new == {(mid, i): after.entries[(mid, i)] for i in range(len(c.rcpts))}
    for i, (_, s) in enumerate(c.rcpts):
        assert after.entries[(mid, i)].state is TABLE[Op.ENQUEUE].target
        assert after.entries[(mid, i)].schedule == s
    assert {k: after.entries[k] for k in m.entries} == dict(m.entries)
    assert after.retired == m.retired


@over_bounds
def test_every_call_moves_per_table_or_vanishes(b: Bound) -> None:
    n = 0
    for m, c in pairs(b):
        if c.op is Op.ENQUEUE:
            _check_enqueue(m, c)
        else:
            _check_single_entry_call(m, c)
        n += 1
    assert n == explore(b).edges


def test_vanished_covers_every_non_source_state() -> None:
    """Every (state, op) pair off the table is reached and vanishes."""
    hit: set[tuple[EntryState, Op]] = set()
    for m, c in pairs(CI_BOUND):
        if c.op is not Op.ENQUEUE and c.key is not None:
            s = m.state_of(c.key)
            if run(m, c)[1] is Outcome.VANISHED:
                hit.add((s, c.op))
    want = {(s, op) for s in EntryState for op in TABLE
            if op is not Op.ENQUEUE and s is not TABLE[op].source}
    assert hit == want


def test_schedule_argument_is_checked() -> None:
    m, _ = Model().enqueue(sender(0), body(0), [(rcpt(0, 0), S0)])
    with pytest.raises(ValueError, match="needs a schedule"):
        m.apply(Op.RESCHEDULE, (0, 0))
    with pytest.raises(ValueError, match="takes no schedule"):
        m.apply(Op.SEND_START, (0, 0), S1)
    with pytest.raises(ValueError, match=r"Model\.enqueue"):
        m.apply(Op.ENQUEUE, (0, 0))
    with pytest.raises(ValueError, match="at least one recipient"):
        m.enqueue(sender(1), body(1), [])
    with pytest.raises(ValueError, match="non-negative"):
        Schedule(-1)
    with pytest.raises(ValueError, match="attempts"):
        Schedule(0, -1)


# ---- restart -----------------------------------------------------------------------------


@over_bounds
def test_restart_is_idempotent_and_follows_rule_5(b: Bound) -> None:
    for m in explore(b).states:
        r = m.restart()
        assert r.restart() == r
        assert check(r) == []
        assert r.next_id == m.next_id and r.retired == m.retired
        for k, e in m.entries.items():
            target = RESTART[e.state]
            assert r.state_of(k) is target
            if target in LIVE_STATES:
                assert r.entries[k].schedule == e.schedule
        assert set(r.entries) <= set(m.entries)
        assert all(v.state in (EntryState.QUEUED, EntryState.HELD) for v in r.view())


# ---- the crash oracle --------------------------------------------------------------------


def moved_pairs(b: Bound) -> Iterator[tuple[Model, Call]]:
    for m, c in pairs(b):
        if run(m, c)[1] is not Outcome.VANISHED:
            yield m, c


@over_bounds
def test_judge_accepts_the_restart_view_at_rest(b: Bound) -> None:
    for m in explore(b).states:
        assert allowed_views(m, None) == (m.restart().view(),)
        assert judge(m, None, m.restart().view()) == []


@over_bounds
def test_vanished_calls_allow_only_the_old_view(b: Bound) -> None:
    """A call that vanishes changes nothing, so only the old view is allowed.  CI checks
    every 8th such pair (the transition test already shows each leaves the model as it
    was); the thorough profile checks all."""
    stride = 1 if thorough() else 8
    vanished = (mc for mc in pairs(b) if run(*mc)[1] is Outcome.VANISHED)
    for m, c in itertools.islice(vanished, 0, None, stride):
        old = m.restart().view()
        assert allowed_views(m, c) == (old,)
        assert judge(m, c, old) == []


def clauses(before: Model, call: Call | None, recovered: frozenset[EntryView]) -> set[str]:
    out = judge(before, call, recovered)
    assert out, "a bad recovery was accepted"
    assert all(v.clause in CLAUSES for v in out)
    return {v.clause for v in out}


def _with_schedule(v: EntryView, s: Schedule) -> EntryView:
    return replace(v, schedule=s)


@over_bounds
def test_judge_rejects_bad_recoveries_at_rest(b: Bound) -> None:
    """A restart at rest (no pending call): every hand-made corruption names its clause."""
    for m in explore(b).states:
        good = m.restart().view()
        for v in good:
            key = (v.msg, v.index)
            lost = clauses(m, None, good - {v})
            assert lost == ({"C4"} if m.state_of(key) is EntryState.INFLIGHT else {"C1"})
            assert clauses(m, None, good - {v} | {_with_schedule(v, OTHER)}) == {"C5"}
            assert clauses(m, None, good - {v} | {replace(v, body_digest="0" * 64)}) == {"C6"}
            assert clauses(m, None, good - {v} | {replace(v, rcpt="x@evil")}) == {"C6"}
            assert clauses(m, None, good - {v} | {replace(v, mail_from="x@evil")}) == {"C6"}
            assert "C6" in clauses(m, None, good | {_with_schedule(v, OTHER)})
            inflight = replace(v, state=EntryState.INFLIGHT)
            assert clauses(m, None, good - {v} | {inflight}) == {"C10"}
            flipped = replace(v, state=EntryState.QUEUED if v.state is EntryState.HELD
                              else EntryState.HELD)
            assert clauses(m, None, good - {v} | {flipped}) == {"C14"}
        for key in m.retired:
            ghost = EntryView(key[0], key[1], rcpt(*key), sender(key[0]), "", S0,
                              EntryState.QUEUED)
            assert clauses(m, None, good | {ghost}) == {"C3"}
        unborn = EntryView(m.next_id, 0, rcpt(m.next_id, 0), sender(m.next_id),
                           "", S0, EntryState.QUEUED)
        assert clauses(m, None, good | {unborn}) == {"C2"}
        stranger = replace(unborn, msg=-1)
        assert clauses(m, None, good | {stranger}) == {"C2"}


@over_bounds
def test_judge_on_every_call_that_moves(b: Bound) -> None:
    """Both restart views of every moving call are accepted; corruptions name their clause."""
    for m, c in moved_pairs(b):
        views = allowed_views(m, c)
        after, _ = run(m, c)
        assert views[0] == m.restart().view()
        assert views[-1] == after.restart().view()
        assert len(views) == len(set(views))
        for allowed in views:
            assert judge(m, c, allowed) == [], (c.describe(), allowed)
        old, new = views[0], views[-1]
        if c.op is Op.ENQUEUE:
            assert len(new - old) == len(c.rcpts)
            for v in new - old if len(c.rcpts) > 1 else ():
                assert clauses(m, c, new - {v}) == {"C2"}, c.describe()
        elif c.op in (Op.RESCHEDULE, Op.SEND_CANCEL):
            if old != new:
                (v,) = old - new
                assert clauses(m, c, old - {v} | {_with_schedule(v, OTHER)}) == {"C5"}
        elif c.op in (Op.HOLD, Op.RELEASE):
            (v,) = old - new
            (w,) = new - old
            assert v.state is not w.state and v.schedule == w.schedule  # the schedule is kept
            assert clauses(m, c, old - {v} | {_with_schedule(v, OTHER)}) == {"C5"}
        elif c.op in (Op.SEND_DONE, Op.DROP, Op.DROP_HELD):
            (v,) = old - new
            assert not new - old
            assert clauses(m, c, old - {v} | {_with_schedule(v, OTHER)}) == {"C5"}
        elif c.op is Op.CLEANUP:
            assert c.key is not None and old == new
            ghost = EntryView(c.key[0], c.key[1], rcpt(*c.key), sender(c.key[0]), "", S0,
                              EntryState.QUEUED)
            assert clauses(m, c, old | {ghost}) == {"C3"}
        else:
            assert c.op is Op.SEND_START and old == new


def _two_messages() -> Model:
    m, _ = Model().enqueue(sender(0), body(0), [(rcpt(0, 0), S0), (rcpt(0, 1), S0)])
    m, _ = m.enqueue(sender(1), body(1), [(rcpt(1, 0), S1)])
    return m


def test_named_bad_recoveries() -> None:
    """The six bad recoveries of the contract, spelled out one by one."""
    m = _two_messages()
    m, _ = m.apply(Op.SEND_START, (1, 0))
    good = m.restart().view()
    by_key = {(v.msg, v.index): v for v in good}
    # Lost entry: a QUEUED entry is missing after the restart.
    assert clauses(m, None, good - {by_key[(0, 1)]}) == {"C1"}
    # Lost inflight: the entry being sent at the crash is missing.
    assert clauses(m, None, good - {by_key[(1, 0)]}) == {"C4"}
    # Partial enqueue: a crash inside enqueue left one of two recipients.
    enq = Call(Op.ENQUEUE, mail_from=sender(2), body=body(2),
               rcpts=((rcpt(2, 0), S0), (rcpt(2, 1), S0)))
    new = allowed_views(m, enq)[-1]
    part = next(v for v in new if (v.msg, v.index) == (2, 1))
    assert clauses(m, enq, new - {part}) == {"C2"}
    # Resurrected retired entry: dropped (drop returned), then a crash inside cleanup.
    dropped, _ = m.apply(Op.DROP, (0, 0))
    cleanup = Call(Op.CLEANUP, (0, 0))
    assert clauses(dropped, cleanup, dropped.restart().view() | {by_key[(0, 0)]}) == {"C3"}
    # Wrong schedule: a crash inside reschedule left neither the old nor the new one.
    resch = Call(Op.RESCHEDULE, (0, 1), S1)
    assert {v.schedule for v in allowed_views(m, resch)[-1] if v.index == 1 and v.msg == 0} \
        == {S1}
    bad = good - {by_key[(0, 1)]} | {_with_schedule(by_key[(0, 1)], OTHER)}
    assert clauses(m, resch, bad) == {"C5"}
    # Altered body.
    altered = good - {by_key[(0, 0)]} | {replace(by_key[(0, 0)], body_digest="f" * 64)}
    assert clauses(m, None, altered) == {"C6"}


def test_crash_inside_send_start_and_send_done() -> None:
    """Both outcomes of an interrupted claim or delivery are allowed, nothing else."""
    m = _two_messages()
    start = Call(Op.SEND_START, (0, 0))
    assert len(allowed_views(m, start)) == 1  # INFLIGHT restarts as QUEUED: same view
    m2, _ = m.apply(Op.SEND_START, (0, 0))
    done = Call(Op.SEND_DONE, (0, 0))
    old, new = allowed_views(m2, done)
    assert {(v.msg, v.index) for v in old - new} == {(0, 0)}
    assert judge(m2, done, old) == [] and judge(m2, done, new) == []
    assert clauses(m2, done, new - {next(iter(new))}) <= {"C1", "C4"}


# ---- SEND_FINISH (rule 7, C15) -----------------------------------------------------------


def _inflight_pairs(b: Bound) -> Iterator[Model]:
    """Every reachable state of the bound with at least two INFLIGHT entries."""
    for m in explore(b).states:
        if len(m.keys_in(EntryState.INFLIGHT)) >= 2:
            yield m


def _batches(m: Model) -> Iterator[tuple[Call, ...]]:
    keys = m.keys_in(EntryState.INFLIGHT)
    for ops in itertools.product((Op.SEND_DONE, Op.SEND_CANCEL), repeat=len(keys)):
        yield tuple(Call(op, k, S2 if op is Op.SEND_CANCEL else None)
                    for op, k in zip(ops, keys, strict=True))


def test_send_finish_is_the_fold_of_its_steps() -> None:
    n = 0
    for m in _inflight_pairs(CI_BOUND):
        for parts in _batches(m):
            after, outcomes = m.finish(parts)
            want = m
            for p in parts:
                want, _ = run(want, p)
            assert after == want and outcomes == (Outcome.MOVED,) * len(parts)
            assert run(m, finish_call(parts)) == (after, Outcome.MOVED)
            assert check(after) == []
            n += 1
    assert n > 100


def test_send_finish_steps_are_checked() -> None:
    k = (0, 0)
    for bad in ([Call(Op.SEND_DONE, k), Call(Op.SEND_CANCEL, k, S1)],  # one entry twice
                [Call(Op.SEND_START, k)], [Call(Op.SEND_DONE, None)],
                [finish_call([Call(Op.SEND_DONE, k)])]):
        with pytest.raises(ValueError):
            finish_call(bad)
    with pytest.raises(ValueError):
        Model().apply(Op.SEND_FINISH, k)


def test_cleanup_all_is_the_fold_of_its_cleanups_and_checked() -> None:
    """Every reachable state with two PENDING_CLEANUP entries or more: a CLEANUP_ALL of
    any two or more of them (rule 8) is the cleanups one after the other, it keeps every
    invariant, and a crash inside it may leave each entry where its own step before or
    after would (after recovery: GONE alike)."""
    n = 0
    for m in explore(CI_BOUND).states:
        keys = m.keys_in(EntryState.PENDING_CLEANUP)
        for size in range(2, len(keys) + 1):
            for chosen in itertools.combinations(keys, size):
                parts = [Call(Op.CLEANUP, k) for k in chosen]
                call = finish_call(parts, Op.CLEANUP_ALL)
                after, outcomes = m.finish(parts, Op.CLEANUP_ALL)
                want = m
                for p in parts:
                    want, _ = run(want, p)
                assert after == want and outcomes == (Outcome.MOVED,) * size
                assert run(m, call) == (after, Outcome.MOVED)
                assert check(after) == []
                assert judge(m, call, after.restart().view()) == []
                assert judge(m, call, m.restart().view()) == []
                n += 1
    assert n > 10
    k = (0, 0)
    for bad in ([Call(Op.CLEANUP, k), Call(Op.CLEANUP, k)], [Call(Op.SEND_DONE, k)],
                [Call(Op.CLEANUP, None)]):
        with pytest.raises(ValueError):
            finish_call(bad, Op.CLEANUP_ALL)
    with pytest.raises(ValueError):
        Model().apply(Op.CLEANUP_ALL, k)
    with pytest.raises(ValueError):  # a send_finish takes no cleanup
        finish_call([Call(Op.CLEANUP, k)])


def test_judge_allows_each_entry_of_a_batch_old_or_new_on_its_own() -> None:
    """Inside a SEND_FINISH every mixture of the steps' old and new views is allowed (rule
    7), and nothing else: an entry outside the batch changed, a done entry listed with
    another schedule, a cancelled one with a third schedule."""
    checked = 0
    for m in _inflight_pairs(CI_BOUND):
        for parts in _batches(m):
            call = finish_call(parts)
            old = m.restart().view()
            per_step = []
            for p in parts:
                one, _ = run(m, p)
                per_step.append((old - one.restart().view(), one.restart().view() - old))
            for pick in itertools.product((False, True), repeat=len(parts)):
                view = set(old)
                for (gone, came), take in zip(per_step, pick, strict=True):
                    if take:
                        view = (view - gone) | came
                assert judge(m, call, frozenset(view)) == [], (call.describe(), pick)
                checked += 1
            for gone, came in per_step:
                if came:  # a cancel: a schedule neither old nor new is C5
                    (v,) = came
                    assert clauses(m, call, frozenset((old - gone) | {
                        _with_schedule(v, OTHER)})) == {"C5"}
                else:  # a done entry listed with another schedule is C5 too
                    (v,) = gone
                    assert clauses(m, call, frozenset((old - {v}) | {
                        _with_schedule(v, OTHER)})) == {"C5"}
            outside = [v for v in old if (v.msg, v.index) not in {p.key for p in parts}]
            for v in outside:  # an entry outside the batch: lost, or changed
                assert clauses(m, call, frozenset(old - {v})) & {"C1", "C4"}
                assert clauses(m, call, frozenset((old - {v}) | {
                    _with_schedule(v, OTHER)})) == {"C5"}
                gone_state = EntryState.HELD if v.state is EntryState.QUEUED \
                    else EntryState.QUEUED
                assert clauses(m, call, frozenset((old - {v}) | {
                    replace(v, state=gone_state)})) & {"C10", "C14"}
    assert checked > 300
