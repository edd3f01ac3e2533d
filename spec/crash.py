"""Crash conditions: which recovered states are allowed after a crash inside an operation.

A crash inside operation ``op`` applied to model state ``S`` must leave, once recovery has
run, exactly the restart view of ``S`` (the operation did not happen) or of ``op(S)`` (it
did); inside a SEND_FINISH or CLEANUP_ALL (rules 7, 8), each entry's view from one or
the other.  Nothing else: no mixture (atomicity), nothing older (durability of everything
acknowledged before), nothing resurrected.  This is the "pending" oracle of RocksDB's
stress test, with one pending operation.

``judge`` compares a recovered state with that condition and names the clause of
``CONTRACT.md`` each difference breaks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spec.model import Call, EntryKey, EntryView, Model, run
from spec.states import BATCHES, EntryState, Op

CLAUSES: dict[str, str] = {
    "C1": "Durable ack",
    "C2": "Atomic enqueue",
    "C3": "No resurrection",
    "C4": "At-least-once",
    "C5": "Atomic update",
    "C6": "Integrity",
    "C7": "Exclusive claim",
    "C8": "No leaks",
    "C9": "Honest errors",
    "C10": "Idempotent recovery",
    "C14": "Durable hold",
}


@dataclass(frozen=True, order=True)
class Violation:
    clause: str
    detail: str

    def __str__(self) -> str:
        return f"{self.clause} ({CLAUSES[self.clause]}): {self.detail}"


def allowed_views(before: Model, call: Call | None) -> tuple[frozenset[EntryView], ...]:
    """The restart views allowed after a crash inside ``call`` (or at rest, if None)."""
    old = before.restart().view()
    if call is None:
        return (old,)
    after, _ = run(before, call)
    new = after.restart().view()
    return (old,) if new == old else (old, new)


def _by_key(views: Iterable[EntryView]) -> dict[EntryKey, EntryView]:
    return {(v.msg, v.index): v for v in views}


def judge(
    before: Model, call: Call | None, recovered: Iterable[EntryView]
) -> list[Violation]:
    """Violations of the crash condition of ``call`` by the recovered entries.

    ``recovered`` holds every entry the backend lists after recovery, with message ids
    mapped to the model's numbering; entries of messages the harness could not map carry
    negative message ids.
    """
    rec = frozenset(recovered)
    allowed = allowed_views(before, call)
    if rec in allowed:
        return []
    old = _by_key(allowed[0])
    new = _by_key(allowed[-1])
    got = _by_key(rec)
    out: list[Violation] = []
    if len(got) != len(rec):
        out.append(Violation("C6", "one entry was listed twice"))
    for key in sorted(set(old) | set(new) | set(got)):
        o, n, g = old.get(key), new.get(key), got.get(key)
        if g is None:
            if o is not None and n is not None:
                was = before.state_of(key)
                clause = "C4" if was is EntryState.INFLIGHT else "C1"
                out.append(Violation(clause, f"entry {key} ({was.value}) was lost"))
            continue
        if key[0] < 0:
            out.append(Violation("C2", f"entry of an unknown message appeared: {g.rcpt!r}"))
            continue
        if o is None and n is None:
            clause = "C3" if key in before.retired else "C2"
            out.append(Violation(clause, f"entry {key} is listed but must not exist"))
            continue
        states = {v.state for v in (o, n) if v is not None}
        if g.state not in states:
            if g.state in (EntryState.QUEUED, EntryState.HELD):
                # a hold lost, or one that appeared: held mail delivered, or never again
                out.append(Violation("C14", f"entry {key} is {g.state.value} after recovery, "
                                            f"allowed {sorted(s.value for s in states)}"))
            else:
                out.append(Violation("C10", f"entry {key} is {g.state.value} after recovery"))
        ref = o if o is not None else n
        assert ref is not None
        if (g.rcpt, g.mail_from, g.body_digest) != (ref.rcpt, ref.mail_from, ref.body_digest):
            out.append(Violation("C6", f"entry {key} has altered metadata or body"))
        scheds = {v.schedule for v in (o, n) if v is not None}
        if g.schedule not in scheds:
            out.append(Violation(
                "C5", f"entry {key} has schedule {g.schedule}, allowed {sorted(scheds)}"))
    if not out and call is not None and call.op is Op.ENQUEUE:
        out.append(Violation("C2", "only some entries of the interrupted enqueue survived"))
    if not out and call is not None and call.op in BATCHES:
        return out  # rules 7 and 8: each entry of the batch old or new, independently
    if not out:
        out.append(Violation("C5", "a mixture of the old and new states was recovered"))
    return out
