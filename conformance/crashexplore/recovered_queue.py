"""What a backend shows after recovery, and how it maps onto the model's entries.

``inspect(open_storage)`` opens the backend (recovery runs), lists every entry
(queued, inflight, pending cleanup), reads the metadata and body of each, then drains
the queue (send_done and cleanup of everything) and measures what is left.  Reading
the body needs an inflight handle, so queued entries are claimed first: the directory
is a throwaway copy of the crash state, and every entry is read the same way, so views
of different crash states compare.

The result (``Recovered``) speaks the backend's ids; ``to_views`` maps it onto the
model's numbering given the ids the run learnt.  It depends on the disk image only, so
the explorer caches it per image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from queue_ref.storage import (
    Capability,
    CorruptionError,
    HeldMail,
    InflightMail,
    MailReader,
    PendingCleanupMail,
    QueuedMail,
    RecoveryReport,
    Storage,
)
from spec.model import Call, EntryKey, EntryView, Model, Schedule
from spec.states import EntryState, Op


@dataclass(frozen=True)
class RecoveredEntry:
    message_id: str
    entry_id: str
    rcpt_index: int  # -1 when it could not be read (pending cleanup)
    rcpt: str
    mail_from: str
    body_digest: str
    schedule: Schedule
    state: EntryState


@dataclass(frozen=True)
class Recovered:
    """Everything listed after recovery, problems met while reading, what a drain left."""

    entries: tuple[RecoveredEntry, ...]
    problems: tuple[tuple[str, str], ...] = ()  # (clause, detail)
    quarantined: tuple[str, ...] = ()  # entry ids that raised CorruptionError
    leftover_objects: int = 0
    leftover_bytes: int = 0
    #: the opening's ``Storage.last_recovery`` (not compared: the entries are the state)
    report: RecoveryReport | None = field(default=None, compare=False)

    def describe(self) -> list[str]:
        out = [f"{e.state.value:15} msg {e.message_id} rcpt[{e.rcpt_index}] {e.rcpt} "
               f"at={e.schedule.at} attempts={e.schedule.attempts} "
               + (f"reason={e.schedule.reason!r} " if e.schedule.reason else "")
               + f"body sha256 {e.body_digest[:12]}" for e in self.entries]
        out += [f"quarantined: {q}" for q in self.quarantined]
        if self.leftover_objects or self.leftover_bytes:
            out.append(f"after draining: {self.leftover_objects} objects, "
                       f"{self.leftover_bytes} bytes")
        return out


def _describe_exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def inspect(open_storage: Callable[[], Storage], *, drain: bool = True) -> Recovered:
    """Open (and so recover) the backend, read every entry, drain, measure leftovers.
    With ``drain`` each queued entry is delivered (``send_done``, ``cleanup``) right after
    it is read, before the next one is."""
    problems: list[tuple[str, str]] = []
    try:
        storage = open_storage()
    except Exception as e:
        return Recovered((), (("C10", f"recovery failed: {_describe_exc(e)}"),))
    report = getattr(storage, "last_recovery", None)
    if not isinstance(report, RecoveryReport):
        report = None
    entries: list[RecoveredEntry] = []
    quarantined: list[str] = []
    claimed: list[InflightMail] = []
    pending: list[PendingCleanupMail] = []
    left = (0, 0)
    try:
        try:
            queued = list(storage.list_queue())
            held = (list(storage.list_held()) if Capability.HOLD in storage.capabilities
                    else [])
            inflight = list(storage.find_inflight())
            pending = list(storage.find_pending_cleanup())
        except Exception as e:
            return Recovered((), (("C10", f"listing after recovery failed: "
                                   f"{_describe_exc(e)}"),))
        if Capability.DOMAIN_INDEX in storage.capabilities:
            problems.extend(_check_domain_index(storage, queued))
        problems.extend(_check_scan(storage, queued, held))
        ids = [h.entry_id for h in (*queued, *held, *inflight, *pending)]
        for eid in sorted({i for i in ids if ids.count(i) > 1}):
            problems.append(("C6", f"entry {eid} is listed {ids.count(eid)} times"))
        for q in queued:
            entries.extend(_read_queued(storage, q, claimed, quarantined, problems))
            if drain and claimed and claimed[-1].entry_id == q.entry_id:
                # delivered before the next entry is read, as a relay does: a backend
                # that lost count of a message's holders frees a body another entry of
                # it still needs, and that entry's read finds it gone
                _finish(storage, claimed.pop(), problems)
        for hm in held:
            entries.extend(_read_held(storage, hm, quarantined, problems))
        for f in inflight:
            claimed.append(f)
            entries.extend(_read(storage, f, f.schedule, EntryState.INFLIGHT, quarantined,
                                 problems))
        for p in pending:
            entries.append(RecoveredEntry(p.message_id, p.entry_id, -1, "", "", "",
                                          p.schedule, EntryState.PENDING_CLEANUP))
        if drain:
            left = _drain(storage, claimed, pending, problems, held)
    finally:
        try:
            storage.close()
        except Exception as e:
            problems.append(("C10", f"close after recovery failed: {_describe_exc(e)}"))
    entries.sort(key=lambda e: (e.message_id, e.rcpt_index, e.entry_id, e.state.value))
    return Recovered(tuple(entries), tuple(problems), tuple(sorted(quarantined)), *left,
                     report=report)


def _read_queued(storage: Storage, q: QueuedMail, claimed: list[InflightMail],
                 quarantined: list[str], problems: list[tuple[str, str]]
                 ) -> list[RecoveredEntry]:
    try:
        f = storage.send_start(q)
    except Exception as e:
        problems.append(("C10", f"entry {q.entry_id} is listed but send_start failed: "
                                f"{_describe_exc(e)}"))
        return []
    if f is None:
        if quarantined:
            # reading an earlier entry quarantined its message, this entry with it
            quarantined.append(q.entry_id)
        else:
            problems.append(("C10", f"entry {q.entry_id} is listed as queued but could not "
                                    "be claimed"))
        return []
    claimed.append(f)
    return _read(storage, f, q.schedule, EntryState.QUEUED, quarantined, problems)


def _check_scan(storage: Storage, queued: list[QueuedMail], held: list[HeldMail]
                ) -> list[tuple[str, str]]:
    """After recovery ``scan_queue`` (``mailq``'s listing) gives the queued and held
    entries the ordered listings gave, each once, in the same state (C13)."""
    try:
        got = [(h.entry_id, type(h).__name__) for h in storage.scan_queue()]
    except Exception as e:
        return [("C10", f"scan_queue after recovery failed: {_describe_exc(e)}")]
    want = sorted([(h.entry_id, "QueuedMail") for h in queued]
                  + [(h.entry_id, "HeldMail") for h in held])
    if sorted(got) != want:
        return [("C13", f"after recovery scan_queue gives {sorted(got)}, the listings "
                        f"{want}")]
    return []


def _check_domain_index(storage: Storage, queued: list[QueuedMail]
                        ) -> list[tuple[str, str]]:
    """After recovery ``list_domain`` lists exactly the queued entries of each domain
    (C13; recovery must leave the index whole, so a miss is reported as C10).  Needs
    ``inspect_entry`` to learn the domains without claiming anything."""
    want: dict[str, set[str]] = {}
    for q in queued:
        try:
            r = storage.inspect_entry(q)
        except Exception:  # unsupported, or damage the reading below reports
            return []
        if r is None:
            continue
        with r:
            want.setdefault(r.meta.rcpt.rpartition("@")[2].lower(), set()).add(q.entry_id)
    out = []
    for domain, ids in sorted(want.items()):
        try:
            got = {h.entry_id for h in storage.list_domain(domain)}
        except Exception as e:
            return [("C10", f"list_domain({domain!r}) after recovery failed: "
                            f"{_describe_exc(e)}")]
        if got != ids:
            out.append(("C10", f"after recovery list_domain({domain!r}) lists "
                               f"{sorted(got)}, the queue holds {sorted(ids)} (C13)"))
    return out


def _read_held(storage: Storage, h: HeldMail, quarantined: list[str],
               problems: list[tuple[str, str]]) -> list[RecoveredEntry]:
    """A HELD entry is read without claiming it (``inspect_entry``): no claim takes it."""
    try:
        r = storage.inspect_entry(h)
    except CorruptionError:
        quarantined.append(h.entry_id)
        return []
    except Exception as e:
        problems.append(("C14", f"held entry {h.entry_id} could not be inspected: "
                                f"{_describe_exc(e)}"))
        return []
    if r is None:
        problems.append(("C14", f"entry {h.entry_id} is listed as held but inspect_entry "
                                "finds it no longer held"))
        return []
    return _read(storage, h, h.schedule, EntryState.HELD, quarantined, problems, reader=r)


def _read(storage: Storage, f: InflightMail | HeldMail, schedule: Schedule,
          state: EntryState, quarantined: list[str], problems: list[tuple[str, str]],
          reader: MailReader | None = None) -> list[RecoveredEntry]:
    try:
        opened = reader
        if opened is None:
            assert isinstance(f, InflightMail)
            opened = storage.read_inflight(f)
        with opened as r:
            body = r.read_all()
            meta = r.meta
    except CorruptionError:
        quarantined.append(f.entry_id)
        return []
    except Exception as e:
        problems.append(("C6", f"entry {f.entry_id} could not be read: {_describe_exc(e)}"))
        return []
    if meta.schedule != schedule:
        problems.append(("C5", f"entry {f.entry_id} is listed with {schedule} but its "
                               f"metadata says {meta.schedule}"))
    if meta.body_size != len(body):
        problems.append(("C6", f"entry {f.entry_id} claims {meta.body_size} bytes of body, "
                               f"{len(body)} were read"))
    return [RecoveredEntry(meta.message_id, meta.entry_id, meta.rcpt_index, meta.rcpt,
                           meta.mail_from, hashlib.sha256(body).hexdigest(), schedule, state)]


def _finish(storage: Storage, f: InflightMail, problems: list[tuple[str, str]]) -> None:
    """``send_done`` and ``cleanup`` of one entry read back."""
    try:
        p = storage.send_done(f)
        if p is not None:
            storage.cleanup(p)
    except Exception as e:
        problems.append(("C8", f"delivering entry {f.entry_id} read back after recovery "
                               f"failed: {_describe_exc(e)}"))


def _drain(storage: Storage, claimed: list[InflightMail], pending: list[PendingCleanupMail],
           problems: list[tuple[str, str]], held: list[HeldMail] | None = None
           ) -> tuple[int, int]:
    try:
        for hm in held or ():
            p = storage.drop_held(hm)
            if p is not None:
                pending.append(p)
        for f in claimed:
            p = storage.send_done(f)
            if p is not None:
                pending.append(p)
        for p in pending:
            storage.cleanup(p)
        rest = (list(storage.list_queue()), list(storage.find_inflight()),
                list(storage.find_pending_cleanup()),
                list(storage.list_held()) if held else [])
        if any(rest):
            problems.append(("C8", f"after draining, {sum(len(r) for r in rest)} entries are "
                                   "still listed"))
        fp = storage.footprint()
    except Exception as e:
        problems.append(("C8", f"draining the recovered queue failed: {_describe_exc(e)}"))
        return (0, 0)
    if fp.objects or fp.bytes:
        problems.append(("C8", f"after draining everything, {fp.objects} objects and "
                               f"{fp.bytes} bytes remain"))
    return (fp.objects, fp.bytes)


def to_views(rec: Recovered, message_ids: Mapping[str, int],
             entry_keys: Mapping[str, EntryKey], before: Model, call: Call | None
             ) -> frozenset[EntryView]:
    """The recovered entries in the model's numbering.

    Messages the run committed map to their model numbers; of the others, the first (by
    id) is the interrupted enqueue's message (``before.next_id``) when ``call`` is an
    enqueue, and the rest get negative numbers, which ``judge`` reports.
    """
    unknown = sorted({e.message_id for e in rec.entries} - set(message_ids))
    ids = dict(message_ids)
    start = 0
    if call is not None and call.op is Op.ENQUEUE and unknown:
        ids[unknown[0]] = before.next_id
        start = 1
    for n, mid in enumerate(unknown[start:], 1):
        ids[mid] = -n
    out = set()
    for e in rec.entries:
        m = ids[e.message_id]
        index, rcpt, mail_from, digest = e.rcpt_index, e.rcpt, e.mail_from, e.body_digest
        if index < 0:
            # a pending-cleanup entry: its key and content come from the run
            key = entry_keys.get(e.entry_id)
            index = key[1] if key is not None else 0
            msg = before.messages.get(m)
            if msg is not None and index < len(msg.rcpts):
                rcpt, mail_from, digest = msg.rcpts[index], msg.mail_from, msg.digest
        out.add(EntryView(m, index, rcpt, mail_from, digest, e.schedule, e.state))
    return frozenset(out)
