"""A pure, executable model of the whole queue.

The model holds messages (envelope and body, shared by the message's entries), entries
(one per recipient, each with a state and a schedule) and the set of entries that have
been retired (sent or dropped).  Every operation is a pure function from a model to a new
model and a result; the model is never mutated.

Identifiers: the model numbers messages 0, 1, 2, ... in commit order; an entry is
``(message number, recipient index)``.  Real backends use their own ids; the harness maps
them to the model's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from spec.contract_errors import ScheduleError
from spec.states import (
    BATCHES,
    LIVE_STATES,
    TABLE,
    EntryState,
    Op,
    Outcome,
    after_restart,
    step,
)

EntryKey = tuple[int, int]


#: The most octets of UTF-8 a schedule's ``reason`` keeps; a longer one is cut (at a
#: character boundary) when the Schedule is made.
MAX_REASON = 1000


@dataclass(frozen=True, order=True)
class Schedule:
    """When an entry is next due, how many delivery attempts it has had, and why the
    last one failed (``reason``, "" when none was recorded: a new entry's, or one whose
    caller gave none).  The reason is part of the schedule: it is stored, changed and
    recovered with it, atomically (C5), and cut to MAX_REASON octets of UTF-8.

    inv: self.at >= 0 and self.attempts >= 0
    inv: len(self.reason.encode("utf-8")) <= MAX_REASON
    """

    at: int
    attempts: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.at, int) or isinstance(self.at, bool) or self.at < 0:
            raise ScheduleError(f"schedule time must be a non-negative int, got {self.at!r}")
        if (
            not isinstance(self.attempts, int)
            or isinstance(self.attempts, bool)
            or self.attempts < 0
        ):
            raise ScheduleError(f"attempts must be a non-negative int, got {self.attempts!r}")
        if not isinstance(self.reason, str):
            raise ScheduleError(f"reason must be a str, got {type(self.reason).__name__}")
        try:
            raw = self.reason.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ScheduleError(f"reason is not encodable as UTF-8: {e}") from None
        if len(raw) > MAX_REASON:  # cut, whole characters only
            object.__setattr__(self, "reason", raw[:MAX_REASON].decode("utf-8", "ignore"))


@dataclass(frozen=True)
class Message:
    mail_from: str
    rcpts: tuple[str, ...]
    body: bytes

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


@dataclass(frozen=True)
class Entry:
    state: EntryState
    schedule: Schedule


@dataclass(frozen=True)
class EntryView:
    """What survives a restart of one entry, as a backend must report it."""

    msg: int
    index: int
    rcpt: str
    mail_from: str
    body_digest: str
    schedule: Schedule
    state: EntryState


@dataclass(frozen=True)
class Model:
    messages: Mapping[int, Message] = field(default_factory=dict)
    entries: Mapping[EntryKey, Entry] = field(default_factory=dict)
    retired: frozenset[EntryKey] = frozenset()
    next_id: int = 0

    # ---- queries -------------------------------------------------------------------

    def state_of(self, key: EntryKey) -> EntryState:
        e = self.entries.get(key)
        if e is not None:
            return e.state
        if key in self.retired:
            return EntryState.GONE
        return EntryState.ABSENT

    def keys_in(self, state: EntryState) -> list[EntryKey]:
        return sorted(k for k, e in self.entries.items() if e.state is state)

    def entries_of(self, mid: int) -> list[Entry]:
        """The stored entries of message ``mid``, in recipient order."""
        return [e for (m, _), e in sorted(self.entries.items(), key=lambda kv: kv[0]) if m == mid]

    def canonical(self) -> tuple[object, ...]:
        """A hashable form, equal for equal models."""
        return (
            tuple(sorted(self.messages.items())),
            tuple(sorted(self.entries.items(), key=lambda kv: kv[0])),
            tuple(sorted(self.retired)),
            self.next_id,
        )

    def view(self) -> frozenset[EntryView]:
        out = set()
        for (m, i), e in self.entries.items():
            msg = self.messages[m]
            out.add(EntryView(m, i, msg.rcpts[i], msg.mail_from, msg.digest, e.schedule, e.state))
        return frozenset(out)

    # ---- operations ----------------------------------------------------------------

    def enqueue(
        self, mail_from: str, body: bytes, rcpts: Sequence[tuple[str, Schedule]]
    ) -> tuple[Model, int]:
        """Commit a message with its recipients: all entries appear at once.

        pre: len(rcpts) > 0
        pre: all(m < self.next_id for m, _ in self.entries)
        post: __return__[1] == self.next_id and __return__[0].next_id == self.next_id + 1
        post: len(__return__[0].entries) == len(self.entries) + len(rcpts)
        post: all(e.state == EntryState.QUEUED for e in __return__[0].entries_of(self.next_id))
        post: [e.schedule for e in __return__[0].entries_of(self.next_id)] == [s for _, s in rcpts]
        post: __return__[0].retired == self.retired
        """
        if not rcpts:
            raise ValueError("a message needs at least one recipient")
        mid = self.next_id
        msg = Message(mail_from, tuple(r for r, _ in rcpts), bytes(body))
        entries = dict(self.entries)
        for i, (_, sched) in enumerate(rcpts):
            entries[(mid, i)] = Entry(TABLE[Op.ENQUEUE].target, sched)
        messages = dict(self.messages)
        messages[mid] = msg
        return replace(self, messages=messages, entries=entries, next_id=mid + 1), mid

    def apply(
        self, op: Op, key: EntryKey, schedule: Schedule | None = None
    ) -> tuple[Model, Outcome]:
        """Apply a single-entry operation.  Returns the new model and the outcome.

        pre: op != Op.ENQUEUE and op not in BATCHES
        pre: (schedule is not None) == TABLE[op].changes_schedule
        pre: all(k in self.retired for k in self.keys_in(EntryState.PENDING_CLEANUP))
        post: (__return__[1] == Outcome.MOVED) == (self.state_of(key) == TABLE[op].source)
        post: __return__[1] != Outcome.VANISHED or __return__[0] is self
        post: __return__[1] != Outcome.MOVED or __return__[0].state_of(key) == TABLE[op].target
        post: __return__[0].next_id == self.next_id and self.retired <= __return__[0].retired
        post: all(__return__[0].entries.get(k) == e for k, e in self.entries.items() if k != key)
        """
        if op is Op.ENQUEUE:
            raise ValueError("use Model.enqueue for ENQUEUE")
        if op in BATCHES:
            raise ValueError(f"use Model.finish for {op.name}")
        t = TABLE[op]
        if t.changes_schedule and schedule is None:
            raise ValueError(f"{op.value} needs a schedule")
        if not t.changes_schedule and schedule is not None:
            raise ValueError(f"{op.value} takes no schedule")
        outcome, target = step(self.state_of(key), op)
        if outcome is Outcome.VANISHED:
            return self, outcome
        entries = dict(self.entries)
        retired = self.retired
        messages: Mapping[int, Message] = self.messages
        if target in LIVE_STATES:
            old = entries[key]
            entries[key] = Entry(target, schedule if schedule is not None else old.schedule)
            if target is EntryState.PENDING_CLEANUP:
                retired = retired | {key}
        else:
            del entries[key]
            if not any(k[0] == key[0] for k in entries):
                messages = {m: v for m, v in messages.items() if m != key[0]}
        return replace(self, entries=entries, retired=retired, messages=messages), outcome

    def finish(self, parts: Sequence[Call], batch: Op = Op.SEND_FINISH
               ) -> tuple[Model, tuple[Outcome, ...]]:
        """A SEND_FINISH or a CLEANUP_ALL (``batch``, rules 7 and 8): each part applied in
        turn, as if called alone.

        pre: batch in BATCHES
        pre: all(c.op in BATCHES[batch] and c.key is not None for c in parts)
        pre: len({c.key for c in parts}) == len(parts)
        post: len(__return__[1]) == len(parts)
        post: __return__[0].next_id == self.next_id and self.retired <= __return__[0].retired
        """
        check_parts(parts, batch)
        model = self
        outcomes = []
        for c in parts:
            assert c.key is not None
            model, outcome = model.apply(c.op, c.key, c.schedule)
            outcomes.append(outcome)
        return model, tuple(outcomes)

    def restart(self) -> Model:
        """The model as recovery after a restart must leave it (rule 5).

        post: all(e.state in (EntryState.QUEUED, EntryState.HELD) for e in __return__.entries.values())
        post: __return__.retired == self.retired and __return__.next_id == self.next_id
        post: __return__.restart() == __return__
        """
        entries: dict[EntryKey, Entry] = {}
        for k, e in self.entries.items():
            s = after_restart(e.state)
            if s in LIVE_STATES:
                entries[k] = Entry(s, e.schedule)
        live_msgs = {k[0] for k in entries}
        messages = {m: v for m, v in self.messages.items() if m in live_msgs}
        return replace(self, entries=entries, messages=messages)


@dataclass(frozen=True)
class Call:
    """One operation of a workload, in model terms."""

    op: Op
    key: EntryKey | None = None
    schedule: Schedule | None = None
    mail_from: str = ""
    body: bytes = b""
    rcpts: tuple[tuple[str, Schedule], ...] = ()
    #: the steps of a SEND_FINISH or CLEANUP_ALL call (rules 7 and 8), each a
    #: single-entry call of the ops ``BATCHES`` names for it
    parts: tuple[Call, ...] = ()

    def describe(self) -> str:
        if self.op in BATCHES:
            return f"{self.op.value}({'; '.join(p.describe() for p in self.parts)})"
        if self.op is Op.ENQUEUE:
            rc = ", ".join(f"{r}@{s.at}" for r, s in self.rcpts)
            return f"enqueue(from={self.mail_from!r}, body={len(self.body)}B, rcpts=[{rc}])"
        args = [f"{self.key}"]
        if self.schedule is not None:
            args.append(f"at={self.schedule.at}, attempts={self.schedule.attempts}")
            if self.schedule.reason:
                args.append(f"reason={self.schedule.reason!r}")
        return f"{self.op.value}({', '.join(args)})"


def check_parts(parts: Sequence[Call], batch: Op = Op.SEND_FINISH) -> None:
    """The steps of a SEND_FINISH or CLEANUP_ALL (``batch``): single-entry calls of the
    ops ``BATCHES`` names for it, on distinct entries."""
    allowed = BATCHES[batch]
    for c in parts:
        if c.op not in allowed or c.key is None or c.parts:
            raise ValueError(f"a {batch.value} step must be "
                             f"{' or '.join(sorted(o.value for o in allowed))} of one "
                             f"entry, not {c.describe()}")
    if len({c.key for c in parts}) != len(parts):
        raise ValueError(f"a {batch.value} names one entry more than once")


def finish_call(parts: Sequence[Call], batch: Op = Op.SEND_FINISH) -> Call:
    """A SEND_FINISH (rule 7) or CLEANUP_ALL (rule 8) call of ``parts``."""
    check_parts(parts, batch)
    return Call(batch, parts=tuple(parts))


def keys_of(call: Call) -> list[EntryKey]:
    """The entries a call names (every step's of a batch; none for an enqueue)."""
    if call.op in BATCHES:
        return [k for p in call.parts if (k := p.key) is not None]
    return [] if call.key is None else [call.key]


def run(model: Model, call: Call) -> tuple[Model, Outcome | int]:
    """Apply one workload call to the model.  A batch (SEND_FINISH, CLEANUP_ALL) answers
    MOVED when any of its steps moved (``Model.finish`` gives each step's outcome)."""
    if call.op is Op.ENQUEUE:
        return model.enqueue(call.mail_from, call.body, call.rcpts)
    if call.op in BATCHES:
        after, outcomes = model.finish(call.parts, call.op)
        return after, Outcome.MOVED if Outcome.MOVED in outcomes else Outcome.VANISHED
    assert call.key is not None
    return model.apply(call.op, call.key, call.schedule)
