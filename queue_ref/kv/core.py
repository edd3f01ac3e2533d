"""The KV queue's shared machinery: writes, reads of checked records, ids, quarantine.

Durability assumption (the ordered log): batches become durable in the order they were
written, as a prefix of one log.  A synced batch therefore also makes every batch written
before it durable, synced or not.  The log engine gives it (one log file; unsynced
records it still holds in memory go to the log ahead of the next group's, in one write).
The queue relies on it in three places, each of which is harmless on its own if an
unsynced batch is lost:

* body chunks are written unsynced while the body streams in; the synced commit batch
  makes them durable with it (so a committed message never lacks a chunk);
* ``send_start`` is unsynced: a lost claim leaves the entry QUEUED, which is where
  recovery would take an INFLIGHT entry anyway (rule 5); ``send_done`` and
  ``send_cancel``, which follow it, are synced and carry it to disk;
* ``cleanup`` is unsynced: a lost cleanup leaves the entry PENDING_CLEANUP, which
  recovery finishes (rule 5), so nothing acknowledged is undone.

Real LevelDB keeps that order except in one window: when it switches to a new log file
it does not fsync the old one, and until the old memtable is written to a table a power
cut can lose unsynced batches of the old log while synced ones of the new log survive.
``sync_all=True`` makes every batch synced and removes the assumption.  Recovery also
repairs what a reordering could leave (an entry both queued and pending cleanup: the
cleanup wins; a wrong live count: recounted), and a body with a lost chunk fails its
SHA-256 and is quarantined, never delivered.

Locking: the caller of a helper here holds the claims it names (see ``claims``).
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from queue_ref.kv import claims as cl
from queue_ref.kv import keys, kv_records
from queue_ref.kv.base import KV, WriteBatch
from queue_ref.kv.claims import Claims
from queue_ref.kv.engine_errors import DatabaseCorruptError
from queue_ref.kv.kv_records import BadRecord, EntryRec, MetaRec, Stored
from queue_ref.storage import (
    CorruptionError,
    DamagedStoreError,
    Handle,
    NoSpaceError,
    ReopenRequiredError,
    StorageIOError,
)

CHUNK = 64 * 1024
BATCH_BYTES = 1 << 20  # body bytes per unsynced batch while a body streams in
#: The body bytes an enqueue writes before it tells the engine, after each further batch,
#: that its body is too big to die young in memory (``KV.spill``): mail's bodies are
#: mostly far smaller, and a body of 100 MB must not be held whole in a memtable.
SPILL_AFTER = 4 << 20
ID_BLOCK = 1024  # ids reserved per synced write of the high-water mark
META_CACHE = 32  # decoded metadata records kept (a 10,000-recipient one is large)
MOVE_BATCH = 16  # chunks moved per batch when a body goes to quarantine


def io_error(what: str, e: OSError, handle: Handle | None, *,
             reopen: bool = False) -> StorageIOError:
    """The StorageIOError to raise for ``e``: ReopenRequiredError once the engine refuses
    writes after a failed sync (``reopen``), DamagedStoreError when the engine found its
    own files damaged, NoSpaceError for ENOSPC/EDQUOT."""
    cls = (ReopenRequiredError if reopen
           else DamagedStoreError if isinstance(e, DatabaseCorruptError)
           else NoSpaceError if e.errno in (errno.ENOSPC, errno.EDQUOT) else StorageIOError)
    return cls(f"{what}: {e}", handle)


class Core:
    """State shared by the queue, its enqueuers, readers and recovery."""

    def __init__(self, kv: KV, *, sync_all: bool, owner: str,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.kv = kv
        self.sync_all = sync_all
        self.owner = owner
        self.clock = clock
        self.claims = Claims()
        self.mu = threading.Lock()  # guards the sets and counters below
        self.inflight: set[tuple[int, int]] = set()  # claimed by this process
        self.enqueuing: set[int] = set()  # ids of open enqueuers (chunks, no commit yet)
        self._metas: OrderedDict[int, tuple[bytes, MetaRec]] = OrderedDict()
        self.next_id = self._load_seq()
        self.id_limit = self.next_id  # ids below it are covered by the persisted mark

    # ---- writes and ids ---------------------------------------------------------

    def write(self, batch: WriteBatch, *, sync: bool) -> None:
        if len(batch):
            self.kv.write(batch, sync=sync or self.sync_all)

    def _load_seq(self) -> int:
        """The persisted high-water mark of ids.

        It is written (synced) before any id of its block is used, so every id ever used
        is below it.  If it fails its checksum, the largest id any key still mentions
        (quarantine included) plus one is used instead: ids stay unique among stored
        messages, but an id of a message drained before the corruption may come again.
        """
        raw = self.kv.get(keys.SEQ)
        if raw is not None:
            try:
                return kv_records.decode_seq(raw)
            except BadRecord:
                pass
        return self.max_id_on_disk() + 1

    def max_id_on_disk(self) -> int:
        """The largest message id any key mentions (-1 if none): a full scan."""
        top = -1
        for key, _ in self.kv.iterate(b"", None):
            inner = key.removeprefix(keys.QUARANTINE)
            parts = inner.split(b" ")
            at = 2 if inner.startswith((keys.ZONE, keys.DOMAIN)) else 1
            if len(parts) > at and len(parts[at]) == keys.ID_WIDTH and parts[at].isdigit():
                top = max(top, int(parts[at]))
        return top

    def new_id(self) -> int:
        """A fresh message id, registered as an open enqueue.  OSError if the mark fails."""
        with self.mu:
            if self.next_id >= self.id_limit:
                limit = self.next_id + ID_BLOCK
                b = WriteBatch()
                b.put(keys.SEQ, kv_records.seq_value(limit))
                self.kv.write(b, sync=True)
                self.id_limit = limit
            mid = self.next_id
            self.next_id += 1
            self.enqueuing.add(mid)
            return mid

    def raise_mark(self, at_least: int) -> None:
        """Make the persisted high-water mark at least ``at_least`` (synced)."""
        with self.mu:
            self.next_id = max(self.next_id, at_least)
            self.id_limit = max(self.id_limit, self.next_id)
            b = WriteBatch()
            b.put(keys.SEQ, kv_records.seq_value(self.id_limit))
            self.kv.write(b, sync=True)

    # ---- checked reads ------------------------------------------------------------

    def meta(self, mid: int) -> MetaRec | None:
        """The message's metadata (None if it is not committed).  BadRecord if corrupt.

        Always read from the engine; decoded only if the bytes differ from the cached
        ones (equal bytes passed the checksum already), so corruption on disk is seen.
        """
        raw = self.kv.get(keys.meta(mid))
        if raw is None:
            return None
        with self.mu:
            hit = self._metas.get(mid)
            if hit is not None and hit[0] == raw:
                self._metas.move_to_end(mid)
                return hit[1]
        m = MetaRec.decode(raw, mid)
        self.remember_meta(raw, m)
        return m

    def remember_meta(self, raw: bytes, m: MetaRec) -> None:
        """Cache a metadata record (its stored bytes) this process wrote or decoded."""
        with self.mu:
            self._metas[m.mid] = (raw, m)
            self._metas.move_to_end(m.mid)
            while len(self._metas) > META_CACHE:
                self._metas.popitem(last=False)

    def forget_meta(self, mid: int) -> None:
        with self.mu:
            self._metas.pop(mid, None)

    def entry(self, key: bytes, mid: int, idx: int, state: str,
              known: Stored | None = None) -> EntryRec | None:
        """The entry record under ``key``, or None.  Corrupt: quarantined, CorruptionError.

        If the stored bytes are those of ``known`` (what the caller's handle saw), its
        decoding is used.  The caller holds the entry's claim and a shared claim on its
        message.
        """
        raw = self.kv.get(key)
        if raw is None:
            return None
        if known is not None and raw == known.raw:
            return known.rec
        try:
            return EntryRec.decode(raw, mid, idx, state)
        except BadRecord as e:
            with self.claims.hold(excl=[cl.count(mid)]):
                self.quarantine_entry(key, raw, mid, idx)
            raise CorruptionError(f"entry {mid}.{idx}: {e}", keys.entry_id(mid, idx),
                                  keys.quarantine(key).decode("ascii")) from None

    # ---- releasing entries and messages -------------------------------------------

    def zone_keys(self, mid: int, meta: MetaRec | None) -> Iterator[bytes]:
        """Every delivery-zone key of the message (a full scan without metadata)."""
        if meta is not None:
            for z in sorted(meta.zones):
                p = keys.zone_prefix(z) + keys.num(mid, keys.ID_WIDTH) + b" "
                yield from (k for k, _ in self.kv.iterate(p, keys.end_of(p)))
            return
        for k, _ in self.kv.iterate(keys.ZONE, keys.end_of(keys.ZONE)):
            try:
                if keys.parse_indexed(k)[1] == mid:
                    yield k
            except keys.BadKey:
                continue

    def domain_keys(self, mid: int, meta: MetaRec | None) -> list[bytes]:
        """Every possible domain-index key of the message (a full scan without metadata)."""
        if meta is not None:
            return [keys.domain(keys.domain_of(a), mid, i) for i, (a, _) in enumerate(meta.rcpts)]
        out = []
        for k, _ in self.kv.iterate(keys.DOMAIN, keys.end_of(keys.DOMAIN)):
            try:
                if keys.parse_indexed(k)[1] == mid:
                    out.append(k)
            except keys.BadKey:
                continue
        return out

    def count_entries(self, mid: int) -> int:
        """Entries of the message stored now, in any state (the live count, recounted)."""
        try:
            meta = self.meta(mid)
        except BadRecord:
            meta = None
        n = sum(1 for _ in self.zone_keys(mid, meta))
        for fam in (keys.INFLIGHT, keys.CLEANUP, keys.HELD):
            p = fam + keys.num(mid, keys.ID_WIDTH) + b" "
            n += sum(1 for _ in self.kv.iterate(p, keys.end_of(p)))
        return n

    def release(self, b: WriteBatch, mid: int) -> None:
        """Add to ``b`` what one entry of ``mid`` leaving the queue changes.

        The entry's own key must still be stored (the recount counts it) and its delete
        be in ``b``.  When it is the last one, the message's keys all go too.  The caller
        holds the message's count claim.
        """
        raw = self.kv.get(keys.live(mid))
        try:
            n = kv_records.decode_live(raw, mid) if raw is not None else self.count_entries(mid)
        except BadRecord:
            n = self.count_entries(mid)
        if n > 1:
            b.put(keys.live(mid), kv_records.live_value(mid, n - 1))
        else:
            b.delete(keys.live(mid))
            self.delete_message(b, mid)

    def delete_message(self, b: WriteBatch, mid: int) -> None:
        try:
            meta = self.meta(mid)
        except BadRecord:
            meta = None
        b.delete(keys.created(mid))
        b.delete(keys.meta(mid))
        if meta is not None:
            for seq in range(1, meta.chunks + 1):
                b.delete(keys.chunk(mid, seq))
        else:
            p = keys.message_prefix(mid)
            for k, _ in self.kv.iterate(p, keys.end_of(p)):
                b.delete(k)
        self.forget_meta(mid)

    # ---- quarantine -----------------------------------------------------------------

    def quarantine_entry(self, key: bytes, raw: bytes, mid: int, idx: int, *,
                         release: bool = True) -> None:
        """Move a corrupt entry record aside; the entry leaves the queue.

        The caller holds the entry's claim and the message's count claim.  The entry's
        domain-index key goes too (found through the metadata; if that is unreadable,
        ``list_domain`` skips the stale key and recovery removes it).  With
        ``release=False`` the live count is left for the caller (recovery) to recount.
        """
        b = WriteBatch()
        b.put(keys.quarantine(key), raw)
        if key.startswith(keys.ZONE):
            with contextlib.suppress(BadRecord):  # without metadata, recovery removes it
                meta = self.meta(mid)
                if meta is not None and idx < len(meta.rcpts):
                    b.delete(keys.domain(keys.domain_of(meta.rcpts[idx][0]), mid, idx))
        if release:
            self.release(b, mid)
        b.delete(key)
        self.write(b, sync=True)
        with self.mu:
            self.inflight.discard((mid, idx))

    def quarantine_message(self, mid: int, reason: str) -> None:
        """Move a message with corrupt metadata or body, and all its entries, aside.

        First one synced batch moves the records and entries (the message stops being
        committed), then the chunks move in batches.  A crash in between leaves the
        quarantine mark, and recovery finishes moving the chunks.  The caller holds the
        message's claim and count claim, exclusively.
        """
        try:
            meta = self.meta(mid)
        except BadRecord:
            meta = None
        self.forget_meta(mid)
        b = WriteBatch()
        b.put(keys.quarantine_mark(mid), kv_records.seal(
            {"k": "quarantine", "id": mid, "reason": reason, "at": self.clock()}))
        moved = [keys.created(mid), keys.meta(mid), keys.live(mid), *self.zone_keys(mid, meta)]
        for fam in (keys.INFLIGHT, keys.CLEANUP, keys.HELD):
            p = fam + keys.num(mid, keys.ID_WIDTH) + b" "
            moved.extend(k for k, _ in self.kv.iterate(p, keys.end_of(p)))
        for k in moved:
            raw = self.kv.get(k)
            if raw is not None:
                b.put(keys.quarantine(k), raw)
                b.delete(k)
        for k in self.domain_keys(mid, meta):
            b.delete(k)  # derived from the zone records, which are kept
        self.write(b, sync=True)
        with self.mu:
            self.inflight = {e for e in self.inflight if e[0] != mid}
        self.quarantine_chunks(mid)

    def quarantine_chunks(self, mid: int) -> None:
        """Move the message's remaining keys (its chunks) under ``quarantine``."""
        p = keys.message_prefix(mid)
        todo = [k for k, _ in self.kv.iterate(p, keys.end_of(p))]
        moved = 0
        for i in range(0, len(todo), MOVE_BATCH):
            b = WriteBatch()
            for k in todo[i:i + MOVE_BATCH]:
                v = self.kv.get(k)
                if v is not None:
                    b.put(keys.quarantine(k), v)
                    b.delete(k)
                    moved += len(v)
            self.write(b, sync=i + MOVE_BATCH >= len(todo))
            if moved >= SPILL_AFTER:
                self.kv.spill()  # a big body, moved whole, is not held in memory

    @contextmanager
    def message_exclusive(self, mid: int) -> Iterator[None]:
        with self.claims.hold(excl=[cl.message(mid), cl.count(mid)],
                              shared=[cl.EVERYTHING]):
            yield
