"""Entry states and operations of a mail queue, as one transition table.

An *entry* is one (message, recipient) pair. Its life:

    (absent) --enqueue/commit--> QUEUED
    QUEUED   --reschedule------> QUEUED            new schedule, atomically
    QUEUED   --send_start------> INFLIGHT          claimed by exactly one sender
    INFLIGHT --send_cancel-----> QUEUED            with its new schedule, atomically
    INFLIGHT --send_done-------> PENDING_CLEANUP   delivered or bounced: never sent again
    QUEUED   --drop------------> PENDING_CLEANUP   removed by an operator: never sent again
    QUEUED   --hold------------> HELD              set aside by an operator, schedule kept
    HELD     --release---------> QUEUED            back in the queue with the schedule it had
    HELD     --drop_held-------> PENDING_CLEANUP   a held entry removed: never sent
    PENDING_CLEANUP --cleanup--> GONE              its bytes are released

Rules, which the table below encodes and nothing else may add to:

1. Every operation names the one state its handle claims the entry is in (its *source*).
   If the entry is in that state, it moves to the operation's *target*.
2. If the entry is anywhere else (another worker took it, it was dropped, it was cleaned
   up), the operation changes nothing and reports VANISHED.  Callers see ``None``.
   This is how the race of Kannader's ``reschedule`` is closed: a reschedule or a
   send_start of an entry that is no longer QUEUED cannot act on it.
3. ENQUEUE creates all entries of a message at once, or none.
4. GONE is final.  An entry that reached PENDING_CLEANUP never becomes QUEUED or
   INFLIGHT again.
5. After a restart (crash or orderly), recovery maps INFLIGHT to QUEUED (the send may
   be repeated: at-least-once), keeps HELD entries HELD and finishes PENDING_CLEANUP to
   GONE.
6. A HELD entry is never claimed (no operation takes it to INFLIGHT); only ``release``
   (back to QUEUED) and ``drop_held`` (to PENDING_CLEANUP) move it.  Postfix's hold
   queue and ZMailer's freezer (seed 004).
7. SEND_FINISH is no row of the table: it is one call of several SEND_DONE and
   SEND_CANCEL steps on distinct entries (``BATCH_OPS``; a delivery's outcomes), each
   entry moving by its own row as if called alone.  Crashed inside, each entry is
   where its own step before or after would leave it, independently of the others.
8. CLEANUP_ALL is no row either: one call of several CLEANUP steps on distinct entries
   (a delivered message's entries released together), each as if called alone, and
   after a crash inside each entry where its own step before or after would leave it.

No I/O lives here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EntryState(enum.Enum):
    ABSENT = "absent"  # before enqueue committed; not stored
    QUEUED = "queued"
    HELD = "held"
    INFLIGHT = "inflight"
    PENDING_CLEANUP = "pending_cleanup"
    GONE = "gone"  # final; not stored


class Op(enum.Enum):
    ENQUEUE = "enqueue"
    RESCHEDULE = "reschedule"
    SEND_START = "send_start"
    SEND_CANCEL = "send_cancel"
    SEND_DONE = "send_done"
    DROP = "drop"
    CLEANUP = "cleanup"
    HOLD = "hold"
    RELEASE = "release"
    DROP_HELD = "drop_held"
    SEND_FINISH = "send_finish"  # rule 7: steps of BATCH_OPS, not a transition
    CLEANUP_ALL = "cleanup_all"  # rule 8: CLEANUP steps, not a transition


class Outcome(enum.Enum):
    MOVED = "moved"
    VANISHED = "vanished"


@dataclass(frozen=True)
class Transition:
    op: Op
    source: EntryState
    target: EntryState
    changes_schedule: bool


# The transition table: the whole state machine.
TABLE: dict[Op, Transition] = {
    t.op: t
    for t in (
        Transition(Op.ENQUEUE, EntryState.ABSENT, EntryState.QUEUED, True),
        Transition(Op.RESCHEDULE, EntryState.QUEUED, EntryState.QUEUED, True),
        Transition(Op.SEND_START, EntryState.QUEUED, EntryState.INFLIGHT, False),
        Transition(Op.SEND_CANCEL, EntryState.INFLIGHT, EntryState.QUEUED, True),
        Transition(Op.SEND_DONE, EntryState.INFLIGHT, EntryState.PENDING_CLEANUP, False),
        Transition(Op.DROP, EntryState.QUEUED, EntryState.PENDING_CLEANUP, False),
        Transition(Op.CLEANUP, EntryState.PENDING_CLEANUP, EntryState.GONE, False),
        Transition(Op.HOLD, EntryState.QUEUED, EntryState.HELD, False),
        Transition(Op.RELEASE, EntryState.HELD, EntryState.QUEUED, False),
        Transition(Op.DROP_HELD, EntryState.HELD, EntryState.PENDING_CLEANUP, False),
    )
}

#: States an entry can be stored in.
LIVE_STATES = frozenset({EntryState.QUEUED, EntryState.HELD, EntryState.INFLIGHT,
                         EntryState.PENDING_CLEANUP})

#: States from which an entry may still be delivered (a HELD one once released).
DELIVERABLE = frozenset({EntryState.QUEUED, EntryState.HELD, EntryState.INFLIGHT})

#: The steps one SEND_FINISH call may make (rule 7).
BATCH_OPS = frozenset({Op.SEND_DONE, Op.SEND_CANCEL})

#: The calls made of single-entry steps on distinct entries, and the steps each may make
#: (rules 7 and 8).
BATCHES: dict[Op, frozenset[Op]] = {Op.SEND_FINISH: BATCH_OPS,
                                    Op.CLEANUP_ALL: frozenset({Op.CLEANUP})}

#: The operations of the hold capability (``Capability.HOLD`` of a Storage).
HOLD_OPS = frozenset({Op.HOLD, Op.RELEASE, Op.DROP_HELD})

#: States a backend lists after recovery (rule 5).
AT_REST = frozenset({EntryState.QUEUED, EntryState.HELD})

#: Where recovery after a restart takes each stored state.
RESTART: dict[EntryState, EntryState] = {
    EntryState.QUEUED: EntryState.QUEUED,
    EntryState.HELD: EntryState.HELD,
    EntryState.INFLIGHT: EntryState.QUEUED,
    EntryState.PENDING_CLEANUP: EntryState.GONE,
}


def step(state: EntryState, op: Op) -> tuple[Outcome, EntryState]:
    """Apply ``op`` to one entry in ``state`` (rules 1 and 2).  ``op`` is a row of the
    table (SEND_FINISH and CLEANUP_ALL are not: rules 7 and 8).

    pre: op in TABLE
    post: (__return__[0] == Outcome.MOVED) == (state == TABLE[op].source)
    post: __return__[0] != Outcome.MOVED or __return__[1] == TABLE[op].target
    post: __return__[0] != Outcome.VANISHED or __return__[1] == state
    post: state != EntryState.GONE or __return__[1] == EntryState.GONE
    post: state != EntryState.PENDING_CLEANUP or __return__[1] in (state, EntryState.GONE)
    """
    t = TABLE[op]
    if state is t.source:
        return Outcome.MOVED, t.target
    return Outcome.VANISHED, state


def after_restart(state: EntryState) -> EntryState:
    """Where recovery takes a stored entry (rule 5).

    post: __return__ in (EntryState.QUEUED, EntryState.HELD, EntryState.GONE, EntryState.ABSENT)
    post: state != EntryState.GONE or __return__ == EntryState.GONE
    post: state != EntryState.INFLIGHT or __return__ == EntryState.QUEUED
    post: state != EntryState.HELD or __return__ == EntryState.HELD
    post: state != EntryState.PENDING_CLEANUP or __return__ == EntryState.GONE
    post: state not in LIVE_STATES or __return__ not in (EntryState.INFLIGHT, EntryState.ABSENT)
    """
    if state in RESTART:
        return RESTART[state]
    return state
