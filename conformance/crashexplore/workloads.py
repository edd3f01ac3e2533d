"""Workloads for crash exploration: short sequences of queue operations in model terms.

A workload is a tuple of ``spec.model.Call``.  Two sources:

* ``enumerate_workloads(bound)``: EVERY sequence of at most ``bound`` operations over at
  most two messages of one or two recipients, in a fixed order (depth first, options in
  the order of ``_options``).  Each operation is valid in the model state it meets, except
  a few *stale* ones: ``send_start`` or ``reschedule`` through a handle listed while the
  entry was still QUEUED (the race of a second worker), which the model answers VANISHED.
  Where two or more entries are INFLIGHT, one ``send_finish`` of all of them (done and
  cancelled in turn) is an option too: it first appears at bound 4.
  Because a sequence and all its prefixes are enumerated, a crash inside operation ``i``
  of a long sequence is the crash inside the last operation of its prefix of length
  ``i + 1``: the explorer crashes each sequence only inside its last operation.
* ``enumerate_steps(bound, after=LIFE)``: the same enumeration, of what may follow one
  message's whole life (enqueue, send_start, send_done, cleanup).  A backend that keeps
  something of a finished message for reuse (the filesystem queue's spare files) is then
  exercised with it: every workload of up to ``bound`` calls meets a queue that holds it.
* ``random_workload(seed, length)``: a longer sequence drawn by ``random.Random(seed)``.

Messages and schedules are chosen so that every message has a distinct body, sender and
schedules, and every schedule change gives a schedule the entry never had: a recovered
entry then tells which state it came from.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from spec.model import Call, EntryKey, Model, Schedule, finish_call, run
from spec.states import BATCHES, EntryState, Op, Outcome

Workload = tuple[Call, ...]

MAX_MESSAGES = 2  # messages of an exhaustive workload
MAX_RCPTS = 2  # recipients of one message
STALE_OPS = (Op.SEND_START, Op.RESCHEDULE)  # the VANISHED calls workloads may contain


def body_of(mid: int) -> bytes:
    """A small body, distinct per message (a few lines, so torn writes show)."""
    return (f"From: sender{mid}@example.org\r\nSubject: message {mid}\r\n\r\n"
            f"body of message {mid}\r\n" + "x" * (40 + 17 * mid) + "\r\n").encode()


def enqueue_call(mid: int, nrcpts: int, *, pad: int = 0) -> Call:
    """Enqueue message ``mid`` (its body followed by ``pad`` more bytes)."""
    rcpts = tuple((f"rcpt{i}.m{mid}@example.net", _schedule(mid, i)) for i in range(nrcpts))
    return Call(Op.ENQUEUE, mail_from=f"sender{mid}@example.org",
                body=body_of(mid) + b"p" * pad, rcpts=rcpts)



def _schedule(mid: int, index: int) -> Schedule:
    return Schedule(at=100 * (mid + 1) + index)


def _bumped(model: Model, key: EntryKey, *, attempt: bool) -> Schedule:
    """A schedule the entry never had: later than any it had (times only grow).  A failed
    attempt (``send_cancel``) records its reason, which names the new time, so a backend
    that stores the reason apart from the time is caught between the two (C5)."""
    e = model.entries.get(key)
    base = e.schedule if e is not None else Schedule(0)
    at = base.at + 1000
    if attempt:
        return Schedule(at, base.attempts + 1, f"451 4.4.1 deferred until {at}")
    return Schedule(at, base.attempts, base.reason)

#: One message's whole life, the start of the ``after`` family of ``enumerate_steps``.
#: Its body is longer than those of the messages that follow, so that what a backend
#: reuses of it is always longer than what it is reused for.
LIFE: tuple[Call, ...] = (enqueue_call(0, 1, pad=600), Call(Op.SEND_START, (0, 0)),
                          Call(Op.SEND_DONE, (0, 0)), Call(Op.CLEANUP, (0, 0)))



@dataclass(frozen=True)
class Step:
    """A workload prefix and the model state it leads to (a node of the enumeration)."""

    index: int
    workload: Workload
    before: Model  # the state the last call met
    after: Model


def stale_candidates(history: Sequence[Model], model: Model) -> list[EntryKey]:
    """Entries that were QUEUED at some point of ``history`` and are not QUEUED now."""
    seen: set[EntryKey] = set()
    for m in history:
        seen.update(m.keys_in(EntryState.QUEUED))
    return sorted(k for k in seen if model.state_of(k) is not EntryState.QUEUED)


def _options(history: Sequence[Model], model: Model, max_messages: int,
             stale: bool) -> list[Call]:
    out: list[Call] = []
    if model.next_id < max_messages:
        out.extend(enqueue_call(model.next_id, n) for n in range(1, MAX_RCPTS + 1))
    for key in sorted(model.entries):
        state = model.entries[key].state
        if state is EntryState.QUEUED:
            out.append(Call(Op.RESCHEDULE, key, _bumped(model, key, attempt=False)))
            out.append(Call(Op.SEND_START, key))
            out.append(Call(Op.DROP, key))
        elif state is EntryState.INFLIGHT:
            out.append(Call(Op.SEND_CANCEL, key, _bumped(model, key, attempt=True)))
            out.append(Call(Op.SEND_DONE, key))
        elif state is EntryState.PENDING_CLEANUP:
            out.append(Call(Op.CLEANUP, key))
    inflight = model.keys_in(EntryState.INFLIGHT)
    if len(inflight) >= 2:  # one delivery's outcomes at once: done and cancelled in turn
        out.append(finish_call([
            Call(Op.SEND_DONE, key) if i % 2 == 0 else
            Call(Op.SEND_CANCEL, key, _bumped(model, key, attempt=True))
            for i, key in enumerate(inflight)]))
    pending = model.keys_in(EntryState.PENDING_CLEANUP)
    if len(pending) >= 2:  # a delivered message's entries released together
        out.append(finish_call([Call(Op.CLEANUP, key) for key in pending], Op.CLEANUP_ALL))
    if stale:
        for key in stale_candidates(history, model):
            out.append(Call(Op.SEND_START, key))
            out.append(Call(Op.RESCHEDULE, key, _bumped(model, key, attempt=False)))
    return out


def enumerate_steps(bound: int = 3, *, max_messages: int = MAX_MESSAGES,
                    stale: bool = True, after: Workload = ()) -> Iterator[Step]:
    """Every workload of 0..``bound`` calls, depth first; index 0 is the empty workload.

    The empty workload stands for opening a new queue: its crash points are those of
    creating the queue's directories.  With ``after``, every workload starts with those
    calls (index 0 is ``after`` itself) and ``bound`` and ``max_messages`` count what
    follows them.
    """
    if bound < 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    counter = 0
    history = [Model()]
    for call in after:
        history.append(run(history[-1], call)[0])
    max_messages += history[-1].next_id

    def walk(prefix: Workload, history: tuple[Model, ...]) -> Iterator[Step]:
        nonlocal counter
        model = history[-1]
        if len(prefix) >= len(after) + bound:
            return
        for call in _options(history, model, max_messages, stale):
            nxt, _ = run(model, call)
            counter += 1
            wl = (*prefix, call)
            yield Step(counter, wl, model, nxt)
            yield from walk(wl, (*history, nxt))

    yield Step(0, tuple(after), history[-2] if after else history[-1], history[-1])
    yield from walk(tuple(after), tuple(history))


def enumerate_workloads(bound: int = 3, **kw: object) -> list[Workload]:
    """The workloads of ``enumerate_steps``, in order (``[i]`` is workload ``w<i>``)."""
    return [s.workload for s in enumerate_steps(bound, **kw)]  # type: ignore[arg-type]


def workload_at(bound: int, index: int, *, after: Workload = ()) -> Workload:
    """Workload number ``index`` of the enumeration with ``bound`` (and ``after``)."""
    for s in enumerate_steps(bound, after=after):
        if s.index == index:
            return s.workload
    raise ValueError(f"the enumeration of bound {bound} has no workload {index}")


def random_workload(seed: int, length: int, *, max_live: int = 3) -> Workload:
    """``length`` calls drawn by ``random.Random(seed)``: mostly valid, a few stale.

    At most ``max_live`` messages are stored at once; message numbers keep growing.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    rng = random.Random(seed)
    model = Model()
    history: list[Model] = [model]
    calls: list[Call] = []
    while len(calls) < length:
        live = len(model.messages)
        opts = _options(history, model, model.next_id + (1 if live < max_live else 0),
                        stale=rng.random() < 0.1)
        enq = [c for c in opts if c.op is Op.ENQUEUE]
        rest = [c for c in opts if c.op is not Op.ENQUEUE]
        pool = enq if enq and (not rest or rng.random() < 0.3) else rest
        call = rng.choice(pool)
        model, _ = run(model, call)
        history.append(model)
        calls.append(call)
    return tuple(calls)


def outcomes(workload: Workload) -> list[tuple[Model, Outcome | int]]:
    """The model state each call meets and the call's result, in order."""
    model = Model()
    out: list[tuple[Model, Outcome | int]] = []
    for call in workload:
        after, res = run(model, call)
        out.append((model, res))
        model = after
    return out


def targeted_workloads(max_length: int = 4) -> list[Workload]:
    """For every operation, the shortest workloads that end with it moving an entry: one
    of a one-recipient message and one of a two-recipient message (a prefix that brings
    the entry to the operation's source state, then the operation).  Crashing inside
    their last call covers every operation at every one of its mutating calls, whatever
    the exhaustive bound.  Operations no workload of ``max_length`` calls reaches are
    missing (crash exploration then reports its coverage incomplete)."""
    found: dict[tuple[Op, int], Workload] = {}
    for step in enumerate_steps(max_length):
        wl = step.workload
        if not wl:
            continue
        call = wl[-1]
        _, res = run(step.before, call)
        key: tuple[Op, int]
        if call.op is Op.ENQUEUE:
            key = (call.op, len(call.rcpts))
        elif call.op in BATCHES and res is Outcome.MOVED:
            key = (call.op, len(call.parts))
        elif res is Outcome.MOVED and call.key is not None:
            key = (call.op, len(step.before.messages[call.key[0]].rcpts))
        else:
            continue
        if key not in found or len(wl) < len(found[key]):
            found[key] = wl
    return [found[k] for k in sorted(found, key=lambda k: (list(Op).index(k[0]), k[1]))]


def hold_workloads() -> list[Workload]:
    """Workloads of the hold capability (``Capability.HOLD``): hold, release and drop_held
    of a one- and a two-recipient message, and two longer ones where a held entry sits
    beside a sibling that is rescheduled, claimed, delivered or dropped.  Crash
    exploration crashes them from their second call on, for backends that declare HOLD."""
    out: list[Workload] = []
    for n in (1, 2):
        enq = enqueue_call(0, n)
        key = (0, n - 1)
        hold = Call(Op.HOLD, key)
        out += [(enq, hold), (enq, hold, Call(Op.RELEASE, key)),
                (enq, hold, Call(Op.DROP_HELD, key))]
    enq = enqueue_call(0, 2)
    out.append((enq, Call(Op.HOLD, (0, 0)), Call(Op.RESCHEDULE, (0, 1), Schedule(at=5000)),
                Call(Op.SEND_START, (0, 1)), Call(Op.RELEASE, (0, 0)),
                Call(Op.SEND_DONE, (0, 1)), Call(Op.HOLD, (0, 0))))
    out.append((enq, Call(Op.HOLD, (0, 1)), Call(Op.DROP, (0, 0)), Call(Op.CLEANUP, (0, 0)),
                Call(Op.DROP_HELD, (0, 1)), Call(Op.CLEANUP, (0, 1))))
    return out
