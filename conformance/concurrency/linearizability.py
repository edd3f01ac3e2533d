"""Is a recorded history of concurrent calls on one queue linearizable against ``spec``'s model?

A *history* is what several callers (threads, processes) did to one queue: each call
with its arguments, what it returned (a handle and the schedule it carries, None, or an
error) and when it was invoked and when it returned (``time.monotonic_ns``, one clock
for every process of a Linux machine).  It is *linearizable* when every call can be
given one moment between its invocation and its return such that, taken in the order
of those moments, the calls are the model's (``spec.model.Model``) own answers.

The search is Wing and Gong's, with Lowe's just-in-time linearization and memoization of
(set of calls linearized, model state), as Porcupine implements it: walk the calls in
time order; a call may be linearized when the model accepts its answer in the current
state; reaching the return of a call not yet linearized backtracks.  The model's entries
do not interact (an operation names one entry), so the history is split by entry
(Herlihy and Wing's locality): each entry's part holds the enqueue that created it, the
transitions through its handles, and what every listing said of it.  Each part is
searched exhaustively; ``bound`` caps the model steps of one part and a part that hits it
is *unknown*, never taken as linearizable.

What the contract asks of concurrent callers beyond one model step per call (C7):

* A listing is not a snapshot: each entry it lists was in the listed state, with the
  listed schedule, at some moment during the call; an entry it leaves out was not in that
  state at some moment, unless a transition of the entry that took effect ran meanwhile
  (a claim in progress may hide it).  ``find_pending_cleanup`` may leave out any entry
  (one a live owner cleans up).
* A transition whose entry another caller is moving at the same time (a transition that
  succeeded, or raised, overlaps it) may return None without changing anything (the
  filesystem queue's ``reschedule`` claims the entry while it writes the schedule, so a
  ``send_start`` at that moment finds nothing to claim).  It may never *succeed* where
  the model says it vanishes: two transitions out of one state of one entry never both
  succeed.
* A call that raised (no fault is injected, so that is a finding of its own, C9) may or
  may not have taken effect, at any moment after its invocation.
* A ``drop`` (``send_done``, ``drop_held``) whose entry another holder of it (found by
  ``find_pending_cleanup``) cleaned up before the call returned may carry any schedule
  on its PendingCleanupMail: the entry is gone, and the filesystem queue reads the
  schedule back after its move.

What is compared, byte for byte: every schedule a call hands back (a transition's
handle, each handle of ``list_queue``, ``list_domain`` and ``list_held``) against the
model's, time, count and ``reason`` (the model's schedules carry the reasons the calls
gave), a mismatch being C5 (not ``find_pending_cleanup``'s: a retired entry's schedule
is never used again, and the filesystem queue, listing an entry another caller is
retiring or cleaning up, may read an older one); ``list_domain(d)`` is a listing of
the QUEUED entries whose recipient's domain (after the last ``@``) is ``d`` lower-cased,
and lists no entry of another domain (API); a ``read_inflight`` recorded in the history
(the sender, the recipient, its index and the body's size and SHA-256 read back) must be
what the entry's enqueue committed (C6).  Reads and the committed data are compared
without the search: an entry's envelope and body never change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spec.model import EntryKey, Model, Schedule
from spec.states import BATCHES, TABLE, EntryState, Op, Outcome

#: The listings a history records, and the state each lists.
LISTINGS: dict[str, EntryState] = {
    "list_queue": EntryState.QUEUED,
    "list_domain": EntryState.QUEUED,
    "find_pending_cleanup": EntryState.PENDING_CLEANUP,
    "list_held": EntryState.HELD,
}
#: A read of an INFLIGHT entry's envelope and body (compared with its enqueue's data).
READ = "read_inflight"
#: The transitions a history records, by the name of the Storage method.
TRANSITIONS: dict[str, Op] = {op.value: op for op in Op
                              if op is not Op.ENQUEUE and op not in BATCHES}
#: The operations that retire an entry (after them it is never delivered: C3).
RETIRING = frozenset({Op.SEND_DONE, Op.DROP, Op.DROP_HELD})
#: Which clause to name first when several calls cannot be linearized.
PRIORITY = ("C7", "C3", "C2", "C14", "C6", "C5", "API")
NEVER = 2**63  # the return time of a call that raised: it may take effect at any time

#: A schedule as a history records it: (at, attempts, reason); (at, attempts) is one
#: whose reason is "".
Sched = tuple[int, int] | tuple[int, int, str]


def body_token(body: bytes) -> str:
    """A body as a history records it: its size and SHA-256 (equal only for the same
    octets)."""
    return f"{len(body)}:{hashlib.sha256(body).hexdigest()}"


def _shown_sched(s: Sched | Schedule | None) -> str:
    """A schedule for a report: ``at=T/N``, and its reason in ASCII escapes, cut."""
    if s is None:
        return "none"
    at, attempts, reason = ((s.at, s.attempts, s.reason) if isinstance(s, Schedule)
                            else (s[0], s[1], s[2] if len(s) > 2 else ""))
    shown = f"at={at}/{attempts}"
    if reason:
        r = ascii(reason)
        shown += f" reason={r[:60]}{'...' if len(r) > 60 else ''}"
    return shown


def _shown_body(token: str) -> str:
    size, _, digest = token.partition(":")
    return f"{size} octets (sha256 {digest[:12]})"


@dataclass(frozen=True)
class Recorded:
    """One call of a history.

    ``outcome`` is ``moved`` (a handle, or True from cleanup), ``vanished`` (None, or
    False from cleanup), ``listed`` (a listing), ``read`` (``read_inflight``) or
    ``error``.  ``entries`` are the entries an enqueue created (in recipient order) or
    those a listing gave, ``schedules`` their schedules (an enqueue's recipients', a
    listing's handles').  An enqueue records what it committed (``mail_from``, the
    recipients' addresses ``rcpts``, ``body`` as ``body_token``); a read what it read
    (``mail_from``, ``rcpts`` of one address, ``index`` the recipient's, ``body``);
    ``arg`` is the domain ``list_domain`` was asked for.
    """

    worker: str
    call: str
    invoke_ns: int
    response_ns: int
    outcome: str
    entry: str = ""
    schedule: Sched | None = None
    got_schedule: Sched | None = None
    entries: tuple[str, ...] = ()
    schedules: tuple[Sched, ...] = ()
    error: str = ""
    mail_from: str = ""
    rcpts: tuple[str, ...] = ()
    body: str = ""
    arg: str = ""
    index: int = -1

    def to_json(self) -> dict[str, Any]:
        return {"w": self.worker, "c": self.call, "i": self.invoke_ns, "r": self.response_ns,
                "o": self.outcome, "e": self.entry, "s": self.schedule,
                "g": self.got_schedule, "es": list(self.entries),
                "ss": [list(s) for s in self.schedules], "x": self.error,
                "f": self.mail_from, "rc": list(self.rcpts), "b": self.body, "a": self.arg,
                "ix": self.index}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Recorded:
        def sched(v: Any) -> Sched | None:
            if v is None:
                return None
            return (int(v[0]), int(v[1])) if len(v) < 3 else (int(v[0]), int(v[1]), str(v[2]))

        scheds = tuple(sched(v) for v in d.get("ss", ()))
        return cls(d["w"], d["c"], int(d["i"]), int(d["r"]), d["o"], d.get("e", ""),
                   sched(d.get("s")), sched(d.get("g")), tuple(d.get("es", ())),
                   tuple(s for s in scheds if s is not None), d.get("x", ""),
                   d.get("f", ""), tuple(d.get("rc", ())), d.get("b", ""), d.get("a", ""),
                   int(d.get("ix", -1)))

    @property
    def returns_ns(self) -> int:
        return NEVER if self.outcome == "error" else self.response_ns

    def overlaps(self, other: Recorded) -> bool:
        return self.invoke_ns < other.returns_ns and other.invoke_ns < self.returns_ns

    def describe(self, t0: int = 0) -> str:
        when = f"[{(self.invoke_ns - t0) / 1e6:.3f}..{(self.response_ns - t0) / 1e6:.3f} ms]"
        if self.call == "enqueue":
            what = f"enqueue -> {', '.join(self.entries) or '?'}"
            if self.rcpts:
                what += (f" (from {ascii(self.mail_from)[:80]} to "
                         f"{', '.join(ascii(r)[:80] for r in self.rcpts)}, "
                         f"{_shown_body(self.body)})")
        elif self.call == READ:
            what = (f"{READ}({self.entry}) -> from {ascii(self.mail_from)[:80]} to "
                    f"{ascii(self.rcpts[0] if self.rcpts else '')[:80]} [{self.index}], "
                    f"{_shown_body(self.body)}")
        elif self.call in LISTINGS:
            arg = ascii(self.arg) if self.call == "list_domain" else ""
            what = f"{self.call}({arg}) -> [{', '.join(self.entries)}]"
        else:
            arg = "" if self.schedule is None else f", {_shown_sched(self.schedule)}"
            answers = ({"moved": "True", "vanished": "False"} if self.call == "cleanup"
                       else {"moved": "handle", "vanished": "None"})
            got = answers.get(self.outcome, self.outcome)
            if self.got_schedule is not None:
                got += f" {_shown_sched(self.got_schedule)}"
            what = f"{self.call}({self.entry}{arg}) -> {got}"
        if self.error:
            what += f" ({self.error})"
        return f"{self.worker} {when} {what}"


class SearchBoundHit(RuntimeError):
    """The search of one entry's history took more than ``bound`` model steps."""


@dataclass
class Verdict:
    """The answer for a whole history: linearizable (True), not (False), unknown (None)."""

    linearizable: bool | None
    clause: str = ""
    detail: str = ""
    entry: str = ""
    lines: tuple[str, ...] = ()
    steps: int = 0  # model steps taken, every part together
    parts: int = 0
    calls: int = 0
    #: transitions that overlapped a transition of the same entry that took effect
    contended: int = 0


# ---- one entry's part of the history --------------------------------------------------------

@dataclass(frozen=True)
class _Item:
    """One call of an entry's part: a whole call, or what one listing said of the entry."""

    rec: Recorded
    listed: bool = False
    listed_schedule: Sched | None = None
    may_vanish: bool = False  # a transition of the entry that took effect overlaps it
    #: a retiring call whose entry another holder cleaned up before it returned: the
    #: schedule its PendingCleanupMail carries is not compared (the entry is gone)
    any_schedule: bool = False


@dataclass
class _Part:
    entry: str
    key: EntryKey
    rcpts: tuple[tuple[str, Schedule], ...]
    items: list[_Item] = field(default_factory=list)


def _sched(s: Sched | None) -> Schedule | None:
    return None if s is None else Schedule(*s)


def _domain(address: str) -> str:
    """The domain ``list_domain`` finds an address under: after its last ``@`` (the whole
    address without one), lower-cased."""
    return address.rpartition("@")[2].lower()


def _read_diff(read: Recorded, enq: Recorded, i: int) -> str | None:
    """How what ``read`` read differs from what ``enq`` committed for its recipient ``i``
    (None: not at all)."""
    rcpt = read.rcpts[0] if len(read.rcpts) == 1 else None
    for name, got, want in (("meta.mail_from", read.mail_from, enq.mail_from),
                            ("meta.rcpt", rcpt, enq.rcpts[i]),
                            ("meta.rcpt_index", read.index, i)):
        if not (type(got) is type(want) and got == want):
            return f"{name} is {ascii(got)[:300]}, committed {ascii(want)[:300]}"
    if read.body != enq.body:
        return f"the body read is {_shown_body(read.body)}, committed {_shown_body(enq.body)}"
    return None


def _parts(history: Sequence[Recorded]) -> tuple[list[_Part], list[tuple[str, str, str]]]:
    """Each entry's part, and the findings seen without a search (clause, entry, detail)."""
    static: list[tuple[str, str, str]] = []
    made: dict[str, tuple[Recorded, int]] = {}
    for rec in history:
        if rec.call == "enqueue" and rec.outcome != "error":
            for i, e in enumerate(rec.entries):
                made[e] = (rec, i)
    parts: dict[str, _Part] = {}
    for e, (rec, i) in made.items():
        names = rec.rcpts if len(rec.rcpts) == len(rec.schedules) else \
            tuple(f"r{j}" for j in range(len(rec.schedules)))
        rcpts = tuple((names[j], Schedule(*s)) for j, s in enumerate(rec.schedules))
        parts[e] = _Part(e, (0, i), rcpts, [_Item(rec)])
    for rec in history:
        if rec.call == READ and rec.outcome == "read":
            if rec.entry not in made:
                static.append(("C2", rec.entry, f"{READ} by {rec.worker} read entry "
                                                f"{rec.entry}, which no enqueue of the "
                                                "history created"))
                continue
            enq, i = made[rec.entry]
            diff = _read_diff(rec, enq, i) if enq.rcpts else None
            if diff is not None:
                static.append(("C6", rec.entry, f"{READ} of {rec.entry} by {rec.worker}: "
                                                f"{diff}"))
        elif rec.call in TRANSITIONS and rec.entry:
            if rec.entry not in parts:
                static.append(("C2", rec.entry, f"{rec.call} acted on entry {rec.entry}, "
                                                "which no enqueue of the history created"))
                continue
            parts[rec.entry].items.append(_Item(rec))
        elif rec.call in LISTINGS and rec.outcome != "error":
            seen: dict[str, Sched | None] = {}
            for k, e in enumerate(rec.entries):
                if e in seen:
                    static.append(("API", e, f"{rec.call} by {rec.worker} listed entry {e} "
                                             "twice in one call"))
                seen[e] = rec.schedules[k] if k < len(rec.schedules) else None
            for e in seen:
                if e not in parts:
                    static.append(("C2", e, f"{rec.call} listed entry {e}, which no enqueue "
                                            "of the history created"))
            for e, part in parts.items():
                if rec.call == "list_domain":
                    rcpt = part.rcpts[part.key[1]][0]
                    if _domain(rcpt) != rec.arg.lower():
                        if e in seen:
                            static.append(("API", e, f"list_domain({rec.arg!a}) by "
                                                     f"{rec.worker} listed entry {e}, whose "
                                                     f"recipient is {ascii(rcpt)[:300]}"))
                        continue  # not the domain's: nothing to search
                part.items.append(_Item(rec, e in seen, seen.get(e)))
    for part in parts.values():
        moving = [it.rec for it in part.items
                  if it.rec.call in TRANSITIONS and it.rec.outcome in ("moved", "error")]
        cleaned = [it.rec.invoke_ns for it in part.items
                   if it.rec.call == "cleanup" and it.rec.outcome in ("moved", "error")]
        part.items = [
            _Item(it.rec, it.listed, it.listed_schedule,
                  any(o is not it.rec and o.overlaps(it.rec) for o in moving),
                  it.rec.call in TRANSITIONS and TRANSITIONS[it.rec.call] in RETIRING
                  and any(t < it.rec.response_ns for t in cleaned))
            for it in part.items]
    return list(parts.values()), static


# ---- the model's answer to one call ---------------------------------------------------------

def _state(m: Model, key: EntryKey) -> tuple[EntryState, Schedule | None]:
    e = m.entries.get(key)
    return (m.state_of(key), None if e is None else e.schedule)


def _step(m: Model, part: _Part, it: _Item) -> list[Model]:
    """The models after ``it`` if the model accepts its answer in ``m`` (else none)."""
    rec, key = it.rec, part.key
    if rec.call == "enqueue":
        if m.next_id != 0:
            return []
        m2, _ = m.enqueue("", b"", part.rcpts)
        return [m, m2] if rec.outcome == "error" else [m2]
    if rec.call in LISTINGS:
        state, sched = _state(m, key)
        want = LISTINGS[rec.call]
        if it.listed:
            ok = state is want and (it.listed_schedule is None
                                    or want is EntryState.PENDING_CLEANUP
                                    or _sched(it.listed_schedule) == sched)
        else:
            ok = state is not want or it.may_vanish or want is EntryState.PENDING_CLEANUP
        return [m] if ok else []
    op = TRANSITIONS[rec.call]
    m2, outcome = m.apply(op, key, _sched(rec.schedule))
    if rec.outcome == "error":
        return [m] if m2 is m else [m, m2]
    if rec.outcome == "vanished":
        return [m] if outcome is Outcome.VANISHED or it.may_vanish else []
    if outcome is not Outcome.MOVED:
        return []
    if (rec.got_schedule is not None and op is not Op.CLEANUP and not it.any_schedule
            and _sched(rec.got_schedule) != _state(m2, key)[1]):
        return []
    return [m2]


def _fingerprint(models: Iterable[Model], key: EntryKey) -> frozenset[object]:
    return frozenset(_state(m, key) for m in models)


def _dedupe(models: Iterable[Model], key: EntryKey) -> tuple[Model, ...]:
    out: dict[object, Model] = {}
    for m in models:
        out.setdefault(_state(m, key), m)
    return tuple(out.values())


# ---- the search -------------------------------------------------------------------------------

class _Node:
    __slots__ = ("call", "index", "match", "next", "prev")

    def __init__(self, index: int, call: bool) -> None:
        self.index = index
        self.call = call
        self.match: _Node | None = None
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _event_list(items: Sequence[_Item]) -> _Node:
    events: list[tuple[int, int, int]] = []
    for i, it in enumerate(items):
        # a listing's part shares its call's times; calls come before returns at a tie
        events.append((it.rec.invoke_ns, 0, i))
        events.append((it.rec.returns_ns, 1, i))
    events.sort()
    head = _Node(-1, False)
    calls: dict[int, _Node] = {}
    prev = head
    for _, kind, i in events:
        node = _Node(i, kind == 0)
        if kind == 0:
            calls[i] = node
        else:
            calls[i].match = node
        prev.next = node
        node.prev = prev
        prev = node
    return head


def _lift(n: _Node) -> None:
    assert n.prev is not None and n.match is not None and n.match.prev is not None
    n.prev.next = n.next
    if n.next is not None:
        n.next.prev = n.prev
    m = n.match
    m.prev.next = m.next  # type: ignore[union-attr]
    if m.next is not None:
        m.next.prev = m.prev


def _unlift(n: _Node) -> None:
    m = n.match
    assert m is not None and m.prev is not None and n.prev is not None
    m.prev.next = m
    if m.next is not None:
        m.next.prev = m
    n.prev.next = n
    if n.next is not None:
        n.next.prev = n


def search_part(part: _Part, bound: int) -> tuple[bool, int, list[tuple[_Item, tuple[Model, ...]]]]:
    """Whether the part is linearizable, the model steps taken, and (when not) the calls
    that could not be placed at the deepest point the search reached, with the models
    there.  Raises SearchBoundHit past ``bound`` steps."""
    items = part.items
    head = _event_list(items)
    models: tuple[Model, ...] = (Model(),)
    linearized = 0
    depth = 0
    cache: set[tuple[int, frozenset[object]]] = set()
    stack: list[tuple[_Node, tuple[Model, ...]]] = []
    steps = 0
    best = -1
    stuck: list[tuple[_Item, tuple[Model, ...]]] = []
    node = head.next
    while head.next is not None:
        assert node is not None
        if node.call:
            it = items[node.index]
            nxt: list[Model] = []
            for m in models:
                steps += 1
                nxt.extend(_step(m, part, it))
            if steps > bound:
                raise SearchBoundHit(f"entry {part.entry}: more than {bound} model steps")
            if nxt:
                new = _dedupe(nxt, part.key)
                lin = linearized | (1 << node.index)
                key = (lin, _fingerprint(new, part.key))
                if key not in cache:
                    cache.add(key)
                    stack.append((node, models))
                    models, linearized, depth = new, lin, depth + 1
                    _lift(node)
                    node = head.next
                    continue
            node = node.next
        else:
            if depth > best:
                best, stuck = depth, []
            if depth == best and len(stuck) < 32:
                stuck.append((items[node.index], models))
            if not stack:
                return False, steps, stuck
            top, models = stack.pop()
            linearized &= ~(1 << top.index)
            depth -= 1
            _unlift(top)
            node = top.next
    return True, steps, []


# ---- naming the clause ------------------------------------------------------------------------

def _explain(part: _Part, it: _Item, models: tuple[Model, ...]) -> tuple[str, str]:
    rec = it.rec
    state, sched = _state(models[0], part.key)
    now = f"the entry is {state.value}" + ("" if sched is None else
                                           f" ({_shown_sched(sched)})")
    who = f"{rec.call} by {rec.worker}"
    if rec.call == "list_domain":
        who = f"list_domain({rec.arg!a}) by {rec.worker}"
    if rec.call in LISTINGS:
        want = LISTINGS[rec.call]
        if not it.listed:
            return "API", (f"{who} left out entry {part.entry}, {now}, and no other call "
                           "moved it meanwhile")
        if state is want:
            return "C5", (f"{who} listed {part.entry} with schedule "
                          f"{_shown_sched(it.listed_schedule)}, {now}")
        if state is EntryState.INFLIGHT:
            return "C7", f"{who} listed {part.entry} as {want.value} while it is claimed"
        if state in (EntryState.PENDING_CLEANUP, EntryState.GONE):
            return "C3", f"{who} listed {part.entry} as {want.value}, but it was retired"
        if state is EntryState.ABSENT:
            return "C2", f"{who} listed {part.entry} before its enqueue could have committed"
        if EntryState.HELD in (state, want):
            return "C14", f"{who} listed {part.entry} as {want.value}, {now}"
        return "API", f"{who} listed {part.entry} as {want.value}, {now}"
    if rec.call == "enqueue":
        return "C2", f"the enqueue by {rec.worker} cannot be placed, {now}"
    op = TRANSITIONS[rec.call]
    if rec.outcome == "vanished":
        return "API", (f"{who} on {part.entry} returned None, but {now} and no other call "
                       "moved it meanwhile")
    _, outcome = models[0].apply(op, part.key, _sched(rec.schedule))
    if outcome is Outcome.MOVED:
        return "C5", (f"{who} on {part.entry} returned schedule "
                      f"{_shown_sched(rec.got_schedule)}, but {now} before it")
    if state is EntryState.ABSENT:
        return "C2", f"{who} on {part.entry} succeeded before its enqueue could have committed"
    if state in (EntryState.PENDING_CLEANUP, EntryState.GONE) and op is not Op.CLEANUP:
        retired_before = any(
            o.rec.call in TRANSITIONS and TRANSITIONS[o.rec.call] in RETIRING
            and o.rec.outcome == "moved" and o.rec.response_ns < rec.invoke_ns
            for o in part.items)
        if retired_before:
            return "C3", (f"{who} on {part.entry} succeeded after the entry had been retired "
                          f"({now})")
    return "C7", (f"{who} on {part.entry} succeeded, but another transition out of "
                  f"{TABLE[op].source.value} succeeded too ({now})")


def check_history(history: Sequence[Recorded], bound: int = 200_000) -> Verdict:
    """Search every entry's part; the first part found not linearizable names the clause."""
    t0 = min((r.invoke_ns for r in history), default=0)
    parts, static = _parts(history)
    calls = len(history)
    if static:
        clause, entry, detail = min(static, key=lambda s: PRIORITY.index(s[0]))
        lines = tuple(r.describe(t0) for r in sorted(history, key=lambda r: r.invoke_ns)
                      if r.entry == entry or entry in r.entries)
        return Verdict(False, clause, detail, entry, lines, 0, len(parts), calls)
    total = 0
    for part in parts:
        try:
            ok, steps, stuck = search_part(part, bound)
        except SearchBoundHit as e:
            return Verdict(None, "", str(e), part.entry, (), total + bound, len(parts), calls)
        total += steps
        if not ok:
            found = [_explain(part, it, ms) for it, ms in stuck] or [("API", "no call fits")]
            clause, detail = min(found, key=lambda f: PRIORITY.index(f[0]))
            shown = sorted((it.rec for it in part.items
                            if it.rec.call not in LISTINGS or it.listed
                            or it.rec.call in ("list_queue", "list_domain")),
                           key=lambda r: r.invoke_ns)
            lines = tuple(r.describe(t0) for r in shown)
            return Verdict(False, clause, detail, part.entry, lines, total, len(parts), calls)
    contended = sum(it.may_vanish for p in parts for it in p.items
                    if it.rec.call in TRANSITIONS)
    return Verdict(True, steps=total, parts=len(parts), calls=calls, contended=contended)
