"""Recovery of the KV queue: from whatever a crash left to a state of the contract.

Every step is a sequence of atomic batches, each taking a consistent store to a
consistent store, so a crash during recovery is repaired by running it again (C10).  It
runs with every other operation of the queue excluded, and leaves alone what this
process is using (entries it holds inflight, enqueues still open).  In order:

1. messages: chunks without a ``#`` record are an enqueue that never committed: removed
   (or, under a quarantine mark, moved to the quarantine); a message whose ``#`` or
   ``*`` record fails its checksum is quarantined with all its entries;
2. pending cleanups are noted; an entry stored in two states (only a reordering of
   batches could do that) keeps the later one, pending cleanup;
3. inflight entries (their owners died: one process owns the database) go back to the
   queue with their schedule (rule 5); held entries stay held (checked like queued ones;
   an entry also pending cleanup loses its held key);
4. pending cleanups are finished (rule 5): their keys go, step 7 does the rest;
5. queued entries are checked: corrupt ones quarantined, those of no committed message
   removed and their message named lost (a commit writes a message's records and its
   entries in one batch: only damage leaves an entry without them; steps 3 and 4 do the
   same for inflight and held entries), missing domain-index keys added;
6. domain-index keys that point at no queued entry are removed;
7. live counts are recounted and fixed, a message with no entry left is removed;
8. the id high-water mark is raised above every id in use (one synced write, which
   also carries the unsynced batches above to disk).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from queue_ref.kv import keys, kv_records
from queue_ref.kv.base import WriteBatch
from queue_ref.kv.core import Core
from queue_ref.kv.kv_records import BadRecord, EntryRec, MetaRec
from queue_ref.storage import RecoveryReport

FLUSH_OPS = 1024  # operations per unsynced batch of bulk deletes


@dataclass
class _Run:
    core: Core
    requeued: int = 0
    cleaned: int = 0
    uncommitted: int = 0
    orphans: int = 0
    quarantined: int = 0
    problems: list[str] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)  # messages quarantined, wholly or in part
    committed: set[int] = field(default_factory=set)
    counts: Counter[int] = field(default_factory=Counter)  # entries kept, per message
    retired: set[tuple[int, int]] = field(default_factory=set)  # pending cleanup
    held_keys: set[tuple[int, int]] = field(default_factory=set)  # held, kept
    finished: Counter[int] = field(default_factory=Counter)  # cleanups finished, per message
    top: int = -1

    def report(self) -> RecoveryReport:
        return RecoveryReport(self.requeued, self.cleaned, self.uncommitted, self.orphans,
                              self.quarantined, tuple(self.problems),
                              lost=tuple(str(m) for m in sorted(self.lost)))

    def write(self, b: WriteBatch) -> None:
        self.core.write(b, sync=False)

    def delete_all(self, todo: list[bytes]) -> None:
        for i in range(0, len(todo), FLUSH_OPS):
            b = WriteBatch()
            for k in todo[i:i + FLUSH_OPS]:
                b.delete(k)
            self.write(b)

    def busy(self, mid: int) -> bool:
        with self.core.mu:
            return mid in self.core.enqueuing

    # ---- 1. messages ------------------------------------------------------------------

    def messages(self) -> None:
        kv = self.core.kv
        marks = set()
        q = keys.quarantine(keys.MESSAGE)
        for k, _ in kv.iterate(q, keys.end_of(q)):
            try:
                mid, tail = keys.parse_message(k.removeprefix(keys.QUARANTINE))
            except keys.BadKey:
                continue
            self.top = max(self.top, mid)
            if tail == keys.QUARANTINE_MARK:
                marks.add(mid)
        seen: dict[int, dict[bytes, bytes]] = {}  # mid -> its # and * records
        chunks: dict[int, list[bytes]] = {}
        stray: list[bytes] = []
        for k, v in kv.iterate(keys.MESSAGE, keys.end_of(keys.MESSAGE)):
            try:
                mid, tail = keys.parse_message(k)
                if tail not in (keys.CREATED, keys.META):
                    keys.parse_num(tail, keys.SEQ_WIDTH)
            except keys.BadKey:
                stray.append(k)
                continue
            self.top = max(self.top, mid)
            recs = seen.setdefault(mid, {})
            if tail in (keys.CREATED, keys.META):
                recs[tail] = v
            else:
                chunks.setdefault(mid, []).append(k)
        if stray:
            self.orphans += len(stray)
            self.delete_all(stray)
        for mid, recs in seen.items():
            if self.busy(mid):
                continue
            if not recs:
                if mid in marks:
                    self.core.quarantine_chunks(mid)
                else:
                    self.uncommitted += 1
                    self.delete_all(chunks.get(mid, []))
                continue
            why = self.check_message(mid, recs)
            if why:
                self.problems.append(f"message {mid} quarantined: {why}")
                self.quarantined += 1
                self.lost.add(mid)
                self.core.quarantine_message(mid, why)
            else:
                self.committed.add(mid)

    def check_message(self, mid: int, recs: dict[bytes, bytes]) -> str:
        if keys.CREATED not in recs or keys.META not in recs:
            return "only one of its # and * records is stored"
        try:
            kv_records.check_created(recs[keys.CREATED], mid)
            MetaRec.decode(recs[keys.META], mid)
        except BadRecord as e:
            return str(e)
        return ""

    # ---- 2-4. inflight and pending cleanup --------------------------------------------

    def entries(self) -> None:
        kv = self.core.kv
        cleanups: list[tuple[bytes, int, int]] = []
        for k, _ in kv.iterate(keys.CLEANUP, keys.end_of(keys.CLEANUP)):
            try:
                mid, idx = keys.parse_entry(k)
            except keys.BadKey:
                self.orphan(k, "bad cleanup key")
                continue
            self.top = max(self.top, mid)
            cleanups.append((k, mid, idx))
        self.retired = {(m, i) for _, m, i in cleanups}
        for k, v in kv.iterate(keys.INFLIGHT, keys.end_of(keys.INFLIGHT)):
            self.inflight(k, v)
        for k, v in kv.iterate(keys.HELD, keys.end_of(keys.HELD)):
            self.held(k, v)
        # Finishing a cleanup only deletes its key here: step 7 recounts every message
        # and removes those left without entries.
        self.delete_all([k for k, _, _ in cleanups])
        self.cleaned += len(cleanups)
        self.finished.update(m for _, m, _ in cleanups)

    def orphan(self, k: bytes, why: str) -> None:
        self.orphans += 1
        self.problems.append(f"removed {k!r}: {why}")
        b = WriteBatch()
        b.delete(k)
        self.write(b)

    def orphan_entry(self, k: bytes, mid: int) -> None:
        """An entry of a message with no records: the commit wrote them in the entry's
        batch, so damage took them (the commit's record, with a later state change of
        the entry intact).  The message was acknowledged and cannot be delivered: it is
        named lost (C6), and the entry removed."""
        self.lost.add(mid)
        self.orphan(k, f"entry of no committed message (message {mid}, whose records are "
                       "gone, is lost)")

    def inflight(self, k: bytes, v: bytes) -> None:
        try:
            mid, idx = keys.parse_entry(k)
        except keys.BadKey:
            self.orphan(k, "bad inflight key")
            return
        self.top = max(self.top, mid)
        with self.core.mu:
            if (mid, idx) in self.core.inflight:
                self.counts[mid] += 1
                return  # held by a live sender of this process
        if (mid, idx) in self.retired:
            self.orphan(k, "entry is also pending cleanup")
            return
        if mid not in self.committed:
            self.orphan_entry(k, mid)
            return
        try:
            rec = EntryRec.decode(v, mid, idx, kv_records.INFLIGHT)
        except BadRecord as e:
            self.quarantine(k, v, mid, idx, str(e))
            return
        b = WriteBatch()
        b.delete(k)
        b.put(keys.zone(rec.zone, mid, idx),
              replace(rec, state=kv_records.QUEUED, owner="").encode())
        b.put(keys.domain(keys.domain_of(rec.address), mid, idx),
              kv_records.domain_value(mid, idx, rec.zone))
        self.write(b)
        self.requeued += 1

    def held(self, k: bytes, v: bytes) -> None:
        try:
            mid, idx = keys.parse_entry(k)
        except keys.BadKey:
            self.orphan(k, "bad held key")
            return
        self.top = max(self.top, mid)
        if (mid, idx) in self.retired:
            self.orphan(k, "entry is also pending cleanup")
            return
        if mid not in self.committed:
            self.orphan_entry(k, mid)
            return
        try:
            EntryRec.decode(v, mid, idx, kv_records.HELD)
        except BadRecord as e:
            self.quarantine(k, v, mid, idx, str(e))
            return
        self.held_keys.add((mid, idx))
        self.counts[mid] += 1

    def quarantine(self, k: bytes, v: bytes, mid: int, idx: int, why: str) -> None:
        self.quarantined += 1
        self.lost.add(mid)
        self.problems.append(f"entry {mid}.{idx} quarantined: {why}")
        self.core.quarantine_entry(k, v, mid, idx, release=False)

    # ---- 5-6. queued entries and the domain index -------------------------------------

    def queued(self) -> None:
        kv = self.core.kv
        for k, v in kv.iterate(keys.ZONE, keys.end_of(keys.ZONE)):
            try:
                zone, mid, idx = keys.parse_indexed(k)
            except keys.BadKey:
                self.orphan(k, "bad delivery-zone key")
                continue
            self.top = max(self.top, mid)
            if mid not in self.committed:
                self.orphan_entry(k, mid)
                continue
            if (mid, idx) in self.retired:
                self.orphan(k, "entry is also pending cleanup")
                continue
            if (mid, idx) in self.held_keys:
                self.orphan(k, "entry is also held")
                continue
            try:
                rec = EntryRec.decode(v, mid, idx, kv_records.QUEUED)
                if rec.zone != zone:
                    raise BadRecord(f"record of zone {rec.zone!r} under zone {zone!r}")
            except BadRecord as e:
                self.quarantine(k, v, mid, idx, str(e))
                continue
            self.counts[mid] += 1
            dkey = keys.domain(keys.domain_of(rec.address), mid, idx)
            want = kv_records.domain_value(mid, idx, zone)
            if kv.get(dkey) != want:
                b = WriteBatch()
                b.put(dkey, want)
                self.write(b)
                self.problems.append(f"domain index of entry {mid}.{idx} rebuilt")

    def domains(self) -> None:
        kv = self.core.kv
        for k, v in kv.iterate(keys.DOMAIN, keys.end_of(keys.DOMAIN)):
            try:
                dom, mid, idx = keys.parse_indexed(k)
                zone = kv_records.decode_domain(v, mid, idx)
                rec = EntryRec.decode(kv.get(keys.zone(zone, mid, idx)) or b"", mid, idx,
                                      kv_records.QUEUED)
                if keys.domain_of(rec.address) != dom:
                    raise BadRecord("domain of another address")
            except (keys.BadKey, BadRecord):
                self.orphan(k, "domain index key of no queued entry")

    # ---- 7-8. live counts and ids -----------------------------------------------------

    def live(self) -> None:
        kv = self.core.kv
        stored: set[int] = set()
        for k, v in kv.iterate(keys.LIVE, keys.end_of(keys.LIVE)):
            try:
                mid = keys.parse_live(k)
            except keys.BadKey:
                self.orphan(k, "bad live key")
                continue
            self.top = max(self.top, mid)
            if mid not in self.committed:
                self.orphan(k, "live count of no committed message")
                continue
            stored.add(mid)
            try:
                n = kv_records.decode_live(v, mid)
            except BadRecord:
                n = -1
            self.fix_count(mid, n)
        for mid in sorted(self.committed - stored):
            self.fix_count(mid, -1)

    def fix_count(self, mid: int, stored: int) -> None:
        """Store the recounted live count; ``stored`` is -1 when missing or corrupt.

        A count lower than the stored one is the normal outcome of cleanups finished,
        here or by a recovery a crash interrupted after it finished them (its unsynced
        deletes of their keys survived, its recount did not); a missing or corrupt count,
        or one lower than the entries stored, is reported as a problem.
        """
        want = self.counts[mid]
        if want == stored:
            return
        if stored < 0 or want > stored:
            self.problems.append(f"live count of message {mid}: {stored} -> {want}")
        b = WriteBatch()
        if want:
            b.put(keys.live(mid), kv_records.live_value(mid, want))
        else:
            b.delete(keys.live(mid))
            self.core.delete_message(b, mid)
        self.write(b)


def recover(core: Core) -> RecoveryReport:
    """Run every step; the caller holds the queue's exclusive claim on everything."""
    run = _Run(core)
    run.messages()
    run.entries()
    run.queued()
    run.domains()
    run.live()
    core.raise_mark(run.top + 1)
    return run.report()
