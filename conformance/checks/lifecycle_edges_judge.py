"""The model side of a lifecycle-edges trial: what the observer and the actor saw,
checked against ``spec``'s model.

The actor's operation takes effect at one point among the observer's calls (before its
listing, or after any one of its claims); some point must explain what the observer
listed and claimed and what the operation returned (a linearizability check of a
history of one pending operation).  Then the observer's sends are applied, both close,
and the reopened queue must be exactly the model's restart (``spec.crash.judge`` at
rest) with nothing found while reading it back.

Every field read back is compared with what was committed, byte for byte: each schedule
a listing, a claim or the operation handed back, its reason too (C5); what the observer
read while delivering the rest, the sender, the recipient and its index, the body (its
SHA-256 and size, and ``meta.body_size``), and ``meta.schedule`` against the claim's
(C6, C5); the reopened queue's entries likewise (``spec.crash.judge``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.checks.lifecycle_edges_actors import (
    CANCEL,
    CHECK,
    NEW_BODY,
    NEW_RCPTS,
    NEW_SENDER,
    RESCHEDULE,
    TARGET_KEY,
)
from conformance.crashexplore.recovered_queue import to_views
from conformance.harness.field_compare import same_value, schedule_diff
from queue_ref.storage import Schedule
from spec.crash import judge
from spec.model import Call, EntryKey, Message, Model
from spec.model import run as run_call
from spec.states import EntryState, Op
from spec.states import Outcome as ModelOutcome


@dataclass
class Trial:
    op: str
    target: str
    stop: int | None  # a stop point (seam), or None: SIGSTOP after ``delay``
    delay: float = 0.0

    @property
    def scenario(self) -> str:
        where = str(self.stop) if self.stop is not None else f"sig{round(self.delay * 1e6)}"
        return f"{CHECK}:{self.op}:{self.target}:{where}"


@dataclass
class Run:
    """The model side of one trial: ids learnt, the model before the operation."""

    model: Model = field(default_factory=Model)
    msgids: dict[str, int] = field(default_factory=dict)
    keys: dict[str, EntryKey] = field(default_factory=dict)

    def ident(self, key: EntryKey) -> str | None:
        return next((i for i, k in self.keys.items() if k == key), None)

    def apply(self, op: Op, key: EntryKey, schedule: Schedule | None = None) -> None:
        self.model, _ = self.model.apply(op, key, schedule)


def _call(op: str, target: str, run_: Run) -> Call:
    if op == "enqueue":
        return Call(Op.ENQUEUE, mail_from=NEW_SENDER, body=NEW_BODY[target],
                    rcpts=tuple(NEW_RCPTS[target]))
    key = TARGET_KEY[target]
    sched = {"reschedule": RESCHEDULE, "send_cancel": CANCEL}.get(op)
    return Call(Op(op), key, sched)


Problems = list[tuple[str, str]]


def _sched_diff(got: Any, want: Schedule) -> str | None:
    """None if ``got`` (``[at, attempts, reason]`` as a child sent it; ``[at, attempts]``
    is one without a reason) is ``want`` exactly, else what differs."""
    try:
        sched = Schedule(*got)
    except Exception:
        return f"{got!r} is no schedule"
    return schedule_diff(sched, want)


def _state_clause(state: EntryState) -> str:
    return {EntryState.INFLIGHT: "C4", EntryState.PENDING_CLEANUP: "C3",
            EntryState.GONE: "C3", EntryState.HELD: "C14"}.get(state, "C2")


def _moved(res: dict[str, Any]) -> bool | None:
    return None if "error" in res else bool(res.get("moved"))


def judge_trial(run_: Run, trial: Trial, seen: dict[str, Any], result: dict[str, Any],
                child_claims: dict[str, Any] | None, done: dict[str, Any], rec: Any,
                *, snapshot: bool = True) -> Problems:
    """Everything wrong with one trial (empty: it keeps the contract).  ``snapshot``: the
    observer listed while the actor stood still (else the two ran at once once the actor
    was let go, and a listing, which is not atomic, may show part of a commit)."""
    op = trial.op
    found: Problems = []
    if "error" in result:
        clause = "C2" if op == "enqueue" else "C10" if op == "open" else "C7"
        found.append((clause, f"{op} failed while another process opened the queue, with no "
                              f"fault injected: {result['error']}"))
    if not seen.get("observed"):
        found.append(("C10", f"opening the queue while another process was inside {op} "
                             f"failed: {seen.get('error')}"))
        return found
    if op == "enqueue" and _moved(result):
        m = run_.model.next_id
        run_.msgids[result["message"]] = m
        for i, e in enumerate(result["entries"]):
            run_.keys[e] = (m, i)
    if op == "open":
        found += _judge_open(run_, seen, child_claims)
    else:
        found += _judge_concurrent(run_, trial, seen, result, snapshot)
    for eid, sent, cleaned, *read in done.get("finished", []):
        key = run_.keys.get(eid)
        if key is None:
            continue
        msg = run_.model.messages.get(key[0])
        if read and msg is not None:
            found += _read_back(read[0], msg, key, "the observer, sending what it claimed,")
        if not sent:
            found.append(("C7", f"the observer's claim of {key} was taken from it: send_done "
                                "returned None"))
            continue
        run_.apply(Op.SEND_DONE, key)
        if cleaned:
            run_.apply(Op.CLEANUP, key)
    if "error" in done:
        found.append(("C7", f"the observer's send_done/cleanup failed: {done['error']}"))
    found += _judge_delivered(run_, done.get("delivered", []))
    views = to_views(rec, run_.msgids, run_.keys, run_.model, None)
    for v in judge(run_.model, None, views):
        found.append((v.clause, f"after both closed and the queue was reopened: {v.detail}"))
    for clause, detail in rec.problems:
        found.append((clause, f"reading the reopened queue back: {detail}"))
    return list(dict.fromkeys(found))


def _judge_delivered(run_: Run, delivered: list[list[Any]]) -> Problems:
    """The observer delivered, one at a time while the actor still had the queue open,
    every entry still queued: each read back whole (C6), none lost (C1: a store that lost
    count of a message's holders frees a body another entry still needs)."""
    found: Problems = []
    for eid, digest, sched, error, *rest in delivered:
        key = run_.keys.get(eid)
        who = "the observer, delivering what was left while the actor lived,"
        if key is None:
            found.append(("C2", f"{who} claimed {eid}, an entry of no committed message"))
            continue
        if error is not None:
            found.append(("C1", f"{who} could not read queued entry {key} ({error}): its "
                                "message was committed and nothing was damaged"))
            continue
        msg = run_.model.messages.get(key[0])
        claim = _claim(run_, eid, sched, who)
        if claim:
            found += claim
            continue
        assert msg is not None  # the claim found the entry queued
        if rest:
            found += _read_back(rest[0], msg, key, who)
        elif digest != msg.digest:
            found.append(("C6", f"{who} read entry {key} with other bytes than committed"))
        run_.apply(Op.SEND_DONE, key)
        run_.apply(Op.CLEANUP, key)
    return found


def _read_back(read: dict[str, Any], msg: Message, key: EntryKey, who: str) -> Problems:
    """What ``read_inflight`` gave for a claim of ``key`` (``lifecycle_edges_actors
    .read_back``) against what was committed: the sender, the recipient and its index,
    ``meta.body_size``, the body (C6; a read that fails, C1), and ``meta.schedule``
    against the handle's (C5)."""
    if "error" in read:
        return [("C1", f"{who} could not read entry {key}, which it held ({read['error']}): "
                       "its message was committed and nothing was damaged")]
    found: Problems = []
    for name, want in (("mail_from", msg.mail_from), ("rcpt", msg.rcpts[key[1]]),
                       ("index", key[1]), ("body_size", len(msg.body))):
        got = read.get(name)
        if not same_value(got, want):
            found.append(("C6", f"{who} read entry {key}: meta.{name} is "
                                f"{ascii(got)[:300]}, committed {ascii(want)[:300]}"))
    if read.get("digest") != msg.digest:
        found.append(("C6", f"{who} read entry {key} with other bytes than committed "
                            f"({read.get('size')} octets, committed {len(msg.body)})"))
    try:
        handle = Schedule(*read["handle"])
    except Exception:
        return [*found, ("API", f"{who} read entry {key} through a handle whose schedule is "
                                f"{read.get('handle')!r}")]
    diff = _sched_diff(read.get("schedule"), handle)
    if diff is not None:
        found.append(("C5", f"{who} read entry {key}: meta.{diff} (its handle's)"))
    return found


def _judge_open(run_: Run, seen: dict[str, Any], child: dict[str, Any] | None) -> Problems:
    """Two recoveries at once: each open leaves the restart of the queue; then the
    observer claims (it had its turn first), then the actor claims the rest."""
    found: Problems = []
    dead = set(run_.model.keys_in(EntryState.INFLIGHT))  # the owner that went away
    run_.model = run_.model.restart()
    for eid, sched in seen.get("adopted", {}).items():
        key = run_.keys.get(eid)
        if key not in dead:
            found.append(("C7", f"find_inflight adopted {key or eid}, which no dead owner held"))
            continue
        # adopted before a recovery requeued it: the same as claiming it
        found += _claim(run_, eid, sched, "the observer (find_inflight)")
    found += _listing(run_, seen["listed"], set(), "the observer",
                      seen.get("listed_schedules"))
    for eid in seen["listed"]:
        found += _claim(run_, eid, seen["claimed"].get(eid), "the observer")
    if child is not None and "result" in child:
        found.append(("C7", f"the second process failed claiming what it listed: "
                            f"{child['result'].get('error')}"))
    elif child is not None:
        for eid in child.get("adopted", []):
            found.append(("C7", f"find_inflight of the second process adopted "
                                f"{run_.keys.get(eid, eid)}, held by a live owner"))
        for eid, sched in child.get("claimed", {}).items():
            found += _claim(run_, eid, sched, "the second process")
        left = set(run_.model.keys_in(EntryState.QUEUED))
        if left:
            found.append(("API", f"entries {sorted(left)} were queued but the second process "
                                 "never listed them"))
    return found


def _claim(run_: Run, eid: str, sched: list[int] | None, who: str) -> Problems:
    key = run_.keys.get(eid)
    if key is None:
        return [("C2", f"{who} claimed {eid}, an entry of no committed message")]
    state = run_.model.state_of(key)
    moved = sched is not None
    if moved and state is not EntryState.QUEUED:
        return [("C7" if state is EntryState.INFLIGHT else _state_clause(state),
                 f"{who} claimed {key}, which was {state.value}")]
    if moved:
        want = run_.model.entries[key].schedule
        run_.apply(Op.SEND_START, key)
        diff = _sched_diff(sched, want)
        if diff is not None:
            return [("C5", f"{who} claimed {key} with a handle whose {diff}")]
    return []


def _listing(run_: Run, listed: list[str], touched: set[EntryKey], who: str,
             schedules: dict[str, Any] | None = None) -> Problems:
    """The listing against the model: nothing that is not queued, every queued entry the
    operation under way does not touch (which may be out of sight while it runs), and
    each entry it does not touch with the model's schedule (``schedules``: the listed
    handles' by entry id)."""
    found: Problems = []
    keys = []
    for eid in listed:
        key = run_.keys.get(eid)
        if key is None:
            found.append(("C2", f"{who} listed {eid}, an entry of no committed message"))
            continue
        keys.append(key)
        state = run_.model.state_of(key)
        if state is not EntryState.QUEUED:
            what = "held INFLIGHT by a live owner" if state is EntryState.INFLIGHT else state.value
            found.append((_state_clause(state), f"{who} listed {key} as queued, but it is {what}"))
        elif schedules is not None and key not in touched:
            diff = _sched_diff(schedules.get(eid), run_.model.entries[key].schedule)
            if diff is not None:
                found.append(("C5", f"{who} listed {key} with a handle whose {diff}"))
    if len(set(keys)) != len(keys):
        found.append(("C7", f"{who} listed an entry twice"))
    missing = set(run_.model.keys_in(EntryState.QUEUED)) - set(keys) - touched
    if missing:
        found.append(("API", f"{who} did not list the queued entries {sorted(missing)}"))
    return found


def _judge_concurrent(run_: Run, trial: Trial, seen: dict[str, Any],
                      result: dict[str, Any], snapshot: bool) -> Problems:
    """The operation takes effect at one point among the observer's calls: before its
    listing, or after its i-th claim.  Some point must explain everything seen."""
    call = _call(trial.op, trial.target, run_)
    moved = _moved(result)
    claims = [eid for eid in seen["listed"]]
    before = run_.model
    best: tuple[Problems, Model] | None = None
    # latest first: on a tie, the observer saw the state before the operation
    points = range(len(claims) + 1, -1, -1)
    for cleaned_by_observer in ((False, True) if trial.op == "cleanup" else (False,)):
        for p in points:
            run_.model = before
            found: Problems = []
            if cleaned_by_observer:  # its recovery finished the cleanup first
                run_.apply(Op.CLEANUP, TARGET_KEY[trial.target])
            for eid, sched in seen.get("adopted", {}).items():
                found.append(("C7", f"find_inflight adopted {run_.keys.get(eid, eid)} "
                                    f"(schedule {sched}) while its owner was alive"))
            touched = _touched(call, run_, result)
            if p == 0:
                found += _apply_call(run_, call, moved, trial.op, result)
            found += _listing(run_, seen["listed"], touched, "the observer",
                              seen.get("listed_schedules"))
            if call.op is Op.ENQUEUE and snapshot:
                got = touched & {run_.keys[e] for e in seen["listed"] if e in run_.keys}
                if got and got != touched:
                    found.append(("C2", f"the observer listed {sorted(got)} of the message "
                                        f"being committed, {sorted(touched)}"))
            for i, eid in enumerate(claims, 1):
                found += _claim(run_, eid, seen["claimed"].get(eid), "the observer")
                if p == i:
                    found += _apply_call(run_, call, moved, trial.op, result)
            if p == len(claims) + 1:
                found += _apply_call(run_, call, moved, trial.op, result)
            if best is None or len(found) < len(best[0]):
                best = (found, run_.model)
            if not found:
                return []
    assert best is not None
    run_.model = best[1]
    return best[0]


def _touched(call: Call, run_: Run, result: dict[str, Any]) -> set[EntryKey]:
    if call.op is Op.ENQUEUE:
        m = run_.model.next_id
        return {(m, i) for i in range(len(call.rcpts))}
    assert call.key is not None
    return {call.key}


def _apply_call(run_: Run, call: Call, moved: bool | None, op: str,
                result: dict[str, Any] | None = None) -> Problems:
    """The operation applied to the model at this point; what it answered must be the
    model's answer there (C7), and the handle it returned must carry the entry's
    schedule after it (C5)."""
    if moved is None:  # it failed: reported already; the model keeps the old state
        return []
    after, outcome = run_call(run_.model, call)
    if call.op is Op.ENQUEUE:
        run_.model = after
        return [] if moved else [("C2", "the enqueue returned without committing")]
    model_moved = outcome is ModelOutcome.MOVED
    if moved and not model_moved:
        return [("C7", f"{op} of {call.key} succeeded, but another process had already "
                       f"moved the entry ({run_.model.state_of(call.key).value})")]
    if not moved and model_moved:
        return [("C7", f"{op} of {call.key} returned None, as if another process had moved "
                       f"it, but none did ({run_.model.state_of(call.key).value})")]
    run_.model = after
    got = (result or {}).get("schedule")
    entry = after.entries.get(call.key) if call.key is not None else None
    if moved and got is not None and entry is not None:
        diff = _sched_diff(got, entry.schedule)
        if diff is not None:
            return [("C5", f"{op} of {call.key} returned a handle whose {diff}")]
    return []
