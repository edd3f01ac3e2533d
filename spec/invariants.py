"""Invariants every reachable model state satisfies.

Each invariant is a function returning a list of human-readable problems (empty when it
holds), so a failing check says what is wrong rather than only that something is.
"""

from __future__ import annotations

from collections.abc import Callable

from spec.model import Model
from spec.states import LIVE_STATES, EntryState


def entries_reference_messages(m: Model) -> list[str]:
    """I1: every stored entry belongs to a stored message and names one of its recipients."""
    out = []
    for (mid, idx), _ in m.entries.items():
        msg = m.messages.get(mid)
        if msg is None:
            out.append(f"entry {(mid, idx)} has no message")
        elif not 0 <= idx < len(msg.rcpts):
            out.append(f"entry {(mid, idx)} is outside the message's {len(msg.rcpts)} recipients")
    return out


def bodies_freed_with_last_entry(m: Model) -> list[str]:
    """I2: a message (and its body) is stored exactly while one of its entries is."""
    owners = {mid for mid, _ in m.entries}
    return [f"message {mid} is stored with no entry" for mid in m.messages if mid not in owners]


def only_live_states_stored(m: Model) -> list[str]:
    """I3: ABSENT and GONE entries are not stored."""
    return [f"entry {k} stored as {e.state.value}" for k, e in m.entries.items()
            if e.state not in LIVE_STATES]


def retired_never_deliverable(m: Model) -> list[str]:
    """I4 (no resurrection): a retired entry is PENDING_CLEANUP or gone, never deliverable."""
    out = []
    for k in m.retired:
        e = m.entries.get(k)
        if e is not None and e.state is not EntryState.PENDING_CLEANUP:
            out.append(f"retired entry {k} is {e.state.value}")
    return out


def pending_cleanup_is_retired(m: Model) -> list[str]:
    """I5: every PENDING_CLEANUP entry is recorded as retired."""
    return [f"entry {k} is pending cleanup but not retired" for k, e in m.entries.items()
            if e.state is EntryState.PENDING_CLEANUP and k not in m.retired]


def ids_never_reused(m: Model) -> list[str]:
    """I6: message numbers are below next_id, so a new message never reuses one."""
    used = {mid for mid in m.messages} | {mid for mid, _ in m.retired}
    return [f"message {mid} >= next_id {m.next_id}" for mid in used if mid >= m.next_id]


INVARIANTS: dict[str, Callable[[Model], list[str]]] = {
    "I1": entries_reference_messages,
    "I2": bodies_freed_with_last_entry,
    "I3": only_live_states_stored,
    "I4": retired_never_deliverable,
    "I5": pending_cleanup_is_retired,
    "I6": ids_never_reused,
}


def check(m: Model) -> list[str]:
    """All problems of all invariants, each prefixed by its invariant's id."""
    return [f"{name}: {p}" for name, fn in INVARIANTS.items() for p in fn(m)]
