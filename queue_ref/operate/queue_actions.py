"""The operator's library: list a queue with its envelopes, pick entries, and act on them.

Every action goes through one Storage transition per entry (``hold``, ``release``,
``drop``/``drop_held`` then ``cleanup``, ``reschedule``), so each is atomic and durable,
and an entry that moved meanwhile (a relay claimed it, another operator held it) is
reported as *vanished*, never acted on twice.  Selection checks every id first: an
unknown id changes nothing.

Ids: an entry id (one recipient) or a message id (all of its recipients), as ``mailq``
prints them.  Domains: a recipient (or sender) domain, compared case-insensitively.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from queue_ref.multi_root import split_id
from queue_ref.storage import (
    Capability,
    Handle,
    HeldMail,
    InvalidInputError,
    QueuedMail,
    Schedule,
    Storage,
    UnsupportedError,
)

__all__ = [
    "AGE_BUCKETS", "ActionResult", "EntryInfo", "MessageInfo", "check_domain", "delete",
    "domain_entries", "domain_of", "flush", "group_messages", "hold", "in_delivery", "listing",
    "one_line", "qshape",
    "release", "requeue", "scan", "select", "stream", "stream_messages",
]

#: Postfix qshape's age columns, in minutes: an entry younger than 5 minutes counts
#: under "5", one between 5 and 10 under "10", ..., one of 1280 or more under "1280+".
AGE_BUCKETS = (5, 10, 20, 40, 80, 160, 320, 640, 1280)
AGE_COLUMNS = ("T", *(str(b) for b in AGE_BUCKETS), "1280+")

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DOMAIN = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}\.?")
_LITERAL = re.compile(r"\[[0-9A-Fa-f:.]{2,}\]|\[IPv6:[0-9A-Fa-f:.]{2,}\]")


def check_domain(value: str) -> str:
    """A domain as an operator names it (``example.org``, ``[192.0.2.1]``), lower-cased;
    InvalidInputError for anything else (an address, spaces, empty labels, control
    characters)."""
    if not isinstance(value, str) or len(value) > 253 or not (
            _DOMAIN.fullmatch(value) or _LITERAL.fullmatch(value)):
        raise InvalidInputError(f"malformed domain {value!r}: expected a name like "
                                "example.org or an address literal like [192.0.2.1]")
    return value.rstrip(".").lower()


def domain_of(address: str) -> str:
    """The domain of an address (lower-cased); "" for the null sender."""
    return address.rpartition("@")[2].lower() if "@" in address else ""


@dataclass(frozen=True)
class EntryInfo:
    """One QUEUED, HELD or INFLIGHT entry as an operator sees it; ``schedule.reason`` is
    why its last attempt failed ("" when none is recorded)."""

    entry_id: str
    message_id: str
    state: str  # "queued" | "held" | "inflight"
    rcpt: str
    rcpt_index: int
    zone: str
    mail_from: str
    params: dict[str, str]
    schedule: Schedule
    size: int
    arrival_ns: int

    def to_json(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "recipient": self.rcpt, "state": self.state,
                "index": self.rcpt_index, "zone": self.zone,
                "next_attempt": self.schedule.at, "attempts": self.schedule.attempts,
                **({"delay_reason": self.schedule.reason} if self.schedule.reason else {})}


@dataclass
class MessageInfo:
    message_id: str
    mail_from: str
    size: int
    arrival_ns: int
    params: dict[str, str]
    entries: list[EntryInfo] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return all(e.state == "held" for e in self.entries)

    @property
    def in_delivery(self) -> bool:
        """Whether a sender holds one of its entries INFLIGHT now."""
        return any(e.state == "inflight" for e in self.entries)

    @property
    def queue_name(self) -> str:
        """Postfix's queue of the message: ``active`` while in delivery, ``hold`` when
        every entry is held, ``deferred`` once an attempt failed, else ``active``."""
        if self.in_delivery:
            return "active"
        if self.held:
            return "hold"
        return "deferred" if any(e.schedule.attempts for e in self.entries) else "active"

    def to_json(self) -> dict[str, Any]:
        """The shape of ``postqueue -j``: one object per message (a recipient's
        ``delay_reason`` when its last attempt failed)."""
        return {"queue_name": self.queue_name,
                "queue_id": self.message_id, "arrival_time": self.arrival_ns // 10**9,
                "message_size": self.size, "sender": self.mail_from,
                "params": dict(sorted(self.params.items())),  # the same on every backend
                "recipients": [e.to_json() for e in self.entries]}


def listing(store: Storage) -> list[tuple[Handle, EntryInfo]]:
    """Every QUEUED and HELD entry with its envelope, oldest message first, from the
    ordered listings (``list_queue``, ``list_held``): what an action (hold, release,
    delete, requeue, show) selects from.  Not ``scan_queue``, which may leave out an
    entry whose message another entry of moves meanwhile.  Entries a sender holds
    INFLIGHT right now are not listed (no listing may take them from it)."""
    out = list(_with_envelopes(store, _ordered_handles(store)))
    out.sort(key=lambda x: (x[1].arrival_ns, x[1].message_id, x[1].rcpt_index))
    return out


def _ordered_handles(store: Storage) -> Iterator[QueuedMail | HeldMail]:
    yield from store.list_queue()
    if Capability.HOLD in store.capabilities:
        yield from store.list_held()


def scan(store: Storage) -> Iterator[tuple[Handle, EntryInfo]]:
    """What ``mailq`` and ``qshape`` show, as the backend finds it
    (``Storage.scan_queue``: the filesystem queue's directory order), each entry as soon
    as it is read: nothing is kept, so the first comes at once whatever the queue holds."""
    return _with_envelopes(store, store.scan_queue())


def _with_envelopes(store: Storage, handles: Iterable[QueuedMail | HeldMail]
                    ) -> Iterator[tuple[Handle, EntryInfo]]:
    for h in handles:
        state = "held" if isinstance(h, HeldMail) else "queued"
        try:
            reader = store.inspect_entry(h)
        except UnsupportedError:
            yield h, EntryInfo(h.entry_id, h.message_id, state, "", -1, "", "", {},
                               h.schedule, 0, 0)
            continue
        if reader is None:
            continue  # claimed or moved since it was listed
        with reader:
            m = reader.meta
        yield h, EntryInfo(m.entry_id, m.message_id, state, m.rcpt, m.rcpt_index, m.zone,
                           m.mail_from, dict(m.params), m.schedule, m.body_size, m.arrival_ns)


def stream(store: Storage) -> Iterator[EntryInfo]:
    """What ``mailq`` shows, as it is found: ``scan``, with the entries in delivery (a
    sender's few, read first) given beside the first entry of their message the scan
    meets, and those of messages it does not meet at the end: a message partly in
    delivery comes once (``stream_messages``).  An entry claimed meanwhile is shown
    once, in delivery."""
    busy: dict[str, list[EntryInfo]] = {}
    for i in in_delivery(store):
        busy.setdefault(i.message_id, []).append(i)
    shown = {i.entry_id for infos in busy.values() for i in infos}
    for _, info in scan(store):
        if info.entry_id not in shown:
            yield from busy.pop(info.message_id, ())
            yield info
    for infos in busy.values():
        yield from infos


def in_delivery(store: Storage) -> list[EntryInfo]:
    """The entries a sender holds INFLIGHT now (``Storage.inflight_entries``; none where
    the backend cannot list them).  Never selectable for an action: no handle."""
    try:
        metas = list(store.inflight_entries())
    except UnsupportedError:
        return []
    return [EntryInfo(m.entry_id, m.message_id, "inflight", m.rcpt, m.rcpt_index, m.zone,
                      m.mail_from, dict(m.params), m.schedule, m.body_size, m.arrival_ns)
            for m in metas]


def group_messages(infos: Iterable[EntryInfo]) -> list[MessageInfo]:
    by_id: dict[str, MessageInfo] = {}
    for e in infos:
        m = by_id.get(e.message_id)
        if m is None:
            m = by_id[e.message_id] = MessageInfo(e.message_id, e.mail_from, e.size,
                                                  e.arrival_ns, e.params)
        m.entries.append(e)
    for m in by_id.values():
        m.entries.sort(key=lambda e: e.rcpt_index)
    return list(by_id.values())


def stream_messages(infos: Iterable[EntryInfo]) -> Iterator[MessageInfo]:
    """``group_messages`` as it streams: the entries of one message that come one after
    another make one MessageInfo, given as soon as the next message's entry comes.  The
    backends' scans give a message's entries together (``stream``); one whose entries
    move while the scan runs may come once per run of them."""
    current: MessageInfo | None = None
    for e in infos:
        if current is not None and current.message_id != e.message_id:
            current.entries.sort(key=lambda x: x.rcpt_index)
            yield current
            current = None
        if current is None:
            current = MessageInfo(e.message_id, e.mail_from, e.size, e.arrival_ns, e.params)
        current.entries.append(e)
    if current is not None:
        current.entries.sort(key=lambda x: x.rcpt_index)
        yield current


def select(listed: Sequence[tuple[Handle, EntryInfo]], *, ids: Sequence[str] = (),
           domain: str | None = None, every: bool = False, roots: int = 1,
           busy: Callable[[], Iterable[EntryInfo]] | None = None
           ) -> list[tuple[Handle, EntryInfo]]:
    """The listed entries an operator named: by entry or message id, by recipient
    domain, or all.  InvalidInputError (nothing chosen) for an id that names no listed
    entry (with why, where it can tell: an entry of ``busy()``, in delivery now; an id
    ``r<k>-...`` of a queue over several roots given for one of ``roots = 1``) or a
    malformed domain."""
    if sum((bool(ids), domain is not None, every)) != 1:
        raise InvalidInputError("name the entries: queue ids, --domain D, or --all")
    if every:
        return list(listed)
    if domain is not None:
        d = check_domain(domain)
        return [x for x in listed if domain_of(x[1].rcpt) == d]
    known = {x[1].entry_id for x in listed} | {x[1].message_id for x in listed}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise InvalidInputError(_unknown(unknown, roots, busy))
    wanted = set(ids)
    return [x for x in listed if x[1].entry_id in wanted or x[1].message_id in wanted]


def _unknown(unknown: list[str], roots: int,
             busy: Callable[[], Iterable[EntryInfo]] | None) -> str:
    """Why the first of ``unknown`` names no queued or held entry, as far as it shows."""
    if busy is not None:
        sending = {x for i in busy() for x in (i.entry_id, i.message_id)}
        named = next((i for i in unknown if i in sending), None)
        if named is not None:
            return (f"queue id {named!r} is in delivery now (mailq's *): an action takes "
                    "queued and held entries; try again once the attempt ends")
    if roots == 1:
        for i in unknown:
            split = split_id(i, sys.maxsize)
            if split is not None:
                # an id as a queue over several roots gives it (a split relay logs them):
                # with one root opened alone its own id is the rest, but only the
                # operator knows which root DIR is (KV ids repeat from root to root)
                k, rest = split
                return (f"unknown queue id {i!r}: an id of root {k} of a queue over "
                        f"several roots; give every root (--queue once per root, or "
                        f"--config), or {rest!r} if this directory is root {k}")
    return (f"unknown queue id {unknown[0]!r}: no queued or held entry of this queue has "
            "it (see mailq)")


@dataclass
class ActionResult:
    """What an action did: entries changed, entries that moved meanwhile (vanished), and
    entries it does not apply to (skipped: e.g. release of a queued entry)."""

    action: str
    changed: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: why entries were skipped, and how many for each reason
    why: dict[str, int] = field(default_factory=dict)
    #: the message id of each entry changed
    message_of: dict[str, str] = field(default_factory=dict)

    def made(self, h: Handle, changed: bool) -> None:
        """``h``'s entry changed, or moved meanwhile (vanished)."""
        if changed:
            self.changed.append(h.entry_id)
            self.message_of[h.entry_id] = h.message_id
        else:
            self.vanished.append(h.entry_id)

    def skip(self, entry_id: str, why: str) -> None:
        self.skipped.append(entry_id)
        self.why[why] = self.why.get(why, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "changed": len(self.changed),
                "vanished": len(self.vanished), "skipped": len(self.skipped),
                "skipped_why": self.why, "entries": self.changed}


def hold(store: Storage, chosen: Iterable[tuple[Handle, EntryInfo]]) -> ActionResult:
    res = ActionResult("hold")
    for h, _ in chosen:
        if isinstance(h, QueuedMail):
            res.made(h, store.hold(h) is not None)
        else:
            res.skip(h.entry_id, "on hold already")
    return res


def release(store: Storage, chosen: Iterable[tuple[Handle, EntryInfo]]) -> ActionResult:
    res = ActionResult("release")
    for h, _ in chosen:
        if isinstance(h, HeldMail):
            res.made(h, store.release(h) is not None)
        else:
            res.skip(h.entry_id, "not on hold")
    return res


def delete(store: Storage, chosen: Iterable[tuple[Handle, EntryInfo]]) -> ActionResult:
    """Drop queued and held entries (never sent), then clean them up."""
    res = ActionResult("delete")
    for h, _ in chosen:
        if isinstance(h, QueuedMail):
            p = store.drop(h)
        elif isinstance(h, HeldMail):
            p = store.drop_held(h)
        else:
            res.skip(h.entry_id, f"neither queued nor on hold: {type(h).__name__}")
            continue
        if p is not None:
            store.cleanup(p)
        res.made(h, p is not None)
    return res


def requeue(store: Storage, chosen: Iterable[tuple[Handle, EntryInfo]],
            now: int | None = None) -> ActionResult:
    """Make queued entries due now (their attempt count and last reason kept); held ones are skipped
    (release them first)."""
    at = int(time.time()) if now is None else now
    res = ActionResult("requeue")
    for h, _ in chosen:
        if not isinstance(h, QueuedMail):
            res.skip(h.entry_id, "on hold: release it first")
            continue
        got = store.reschedule(h, Schedule(at, h.schedule.attempts, h.schedule.reason))
        res.made(h, got is not None)
    return res


def one_line(text: str) -> str:
    """A text from outside (a reply's reason, a client's words) on one line of output or
    log: control characters (a multi-line reply's CR LF, a terminal escape) as spaces."""
    return "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in text)


def flush(store: Storage, domain: str | None = None, now: int | None = None) -> ActionResult:
    """Make deferred mail (every QUEUED entry due later than ``now``, or only those of
    one recipient domain) due now.  One domain is listed through the backend's domain
    index where it declares one (``Capability.DOMAIN_INDEX``: no scan of the queue, the
    ETRN of seed 002), else by scanning the queue.  Held mail stays held."""
    at = int(time.time()) if now is None else now
    res = ActionResult("flush")
    source = store.list_queue() if domain is None else domain_entries(store, domain)
    for h in list(source):
        if h.schedule.at <= at:
            res.skip(h.entry_id, "due already")
            continue
        got = store.reschedule(h, Schedule(at, h.schedule.attempts, h.schedule.reason))
        res.made(h, got is not None)
    return res


def domain_entries(store: Storage, domain: str) -> Iterable[QueuedMail]:
    """The QUEUED entries of one recipient domain: through the backend's domain index
    where it declares one (``Capability.DOMAIN_INDEX``), else by scanning the queue
    (ETRN's flush, ATRN's listing)."""
    d = check_domain(domain)
    if Capability.DOMAIN_INDEX in store.capabilities:
        return store.list_domain(d)
    return (h for h in store.list_queue() if _rcpt_domain(store, h) == d)


def _rcpt_domain(store: Storage, h: QueuedMail) -> str | None:
    r = store.inspect_entry(h)
    if r is None:
        return None
    with r:
        return domain_of(r.meta.rcpt)


def qshape(infos: Iterable[EntryInfo], now_ns: int, *, by: str = "recipient",
           top: int = 0) -> list[tuple[str, list[int]]]:
    """Domains x age buckets (``AGE_COLUMNS``), like Postfix's qshape: the first row is
    TOTAL, then domains by count, descending.  ``by="recipient"`` counts entries by
    recipient domain; ``by="sender"`` counts messages by sender domain."""
    if by not in ("recipient", "sender"):
        raise InvalidInputError(f"--by must be recipient or sender, not {by!r}")
    rows: dict[str, list[int]] = {}
    total = [0] * len(AGE_COLUMNS)
    last = None  # a message's entries come one after another (``scan``): counted once
    for e in infos:
        if by == "sender":
            if e.message_id == last:
                continue
            last = e.message_id
            key = domain_of(e.mail_from) or "MAILER-DAEMON"
        else:
            key = domain_of(e.rcpt)
        age_min = max(0, now_ns - e.arrival_ns) / 60e9
        col = next((i + 1 for i, b in enumerate(AGE_BUCKETS) if age_min < b),
                   len(AGE_COLUMNS) - 1)
        row = rows.setdefault(key, [0] * len(AGE_COLUMNS))
        for r in (row, total):
            r[0] += 1
            r[col] += 1
    ordered = sorted(rows.items(), key=lambda kv: (-kv[1][0], kv[0]))
    if top > 0:
        ordered = ordered[:top]
    return [("TOTAL", total), *ordered]
