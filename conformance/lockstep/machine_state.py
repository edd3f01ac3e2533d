"""The lockstep machine's state, its helpers and the check made after every step.

``MachineBase`` holds the backend (``store``), the model, the maps from the backend's
ids to the model's numbering (messages numbered in commit order, entries as
``(message, recipient index)``), and the handles the rules play with: ``pool`` (live
handles, several per entry once listings add second ones, so a rule may act through a
stale one), ``spent`` (consumed handles) and ``foreign`` (handles of an earlier
incarnation of the queue, from before a restart or a crash).

After every step the invariant ``listing_equals_model`` compares the whole listing with
the model: the QUEUED entries with their schedules, the PENDING_CLEANUP entries, no
adopted INFLIGHT entry, ``list_held``, ``list_domain`` of every domain of a queued
recipient (where declared), ``inflight_entries`` (where the backend lists them), and no
stored object once every message is gone; and it reads one listed entry back (the one
read longest ago: inspected where ``inspect_entry`` is declared, claimed, read, put back
with its schedule), so every listed entry's message is shown to exist and read back
intact.  Schedules and metadata are compared field by field (``field_compare``); the
data is the tame data below or mail's (``mail_data``).  The machine with
the crash rule skips the read-back: the syncs of its claim and cancel would make durable
the very writes a crash must be able to lose.

A machine that runs the backend through the I/O seam (``traced``: the crash rule's, and
the others' for a backend that declares the seam) brackets every operation whose success
the contract makes durable (``sync_cover.JUDGED``) with ``FaultyIO.operation``, and after
every step judges the operations acknowledged since the last one by the sync-cover rule
(``conformance.harness.sync_cover``): an acknowledgement that rode a sync begun before
its change raises ``ClauseViolation``.  The seam holds open the syncs of any thread of the
backend's own (``BackgroundSyncHoldIO``), so a backend that syncs in the background is
seen; a backend without threads records the same trace as before and is not replayed.

A difference raises ``ClauseViolation`` (an AssertionError) naming the clause it breaks.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from conformance.crashexplore.traced_runs import ScratchIO, scratch_base
from conformance.harness import mail_data
from conformance.harness.backend_factory import Backend
from conformance.harness.field_compare import meta_diff, schedule_diff
from conformance.harness.sync_cover import BackgroundSyncHoldIO, uncovered_on
from faultinject.fault_errors import ModelError
from faultinject.seam import FaultyIO
from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    Capability,
    EntryMeta,
    Handle,
    HeldMail,
    InflightMail,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
    UnsupportedError,
)
from spec.invariants import check
from spec.model import EntryKey, Model
from spec.states import HOLD_OPS, EntryState, Op, Outcome


class ClauseViolation(AssertionError):
    """The backend broke ``clause``; ``detail`` says how."""

    def __init__(self, clause: str, detail: str) -> None:
        super().__init__(f"{clause}: {detail}")
        self.clause = clause
        self.detail = detail


# ---- what the rules draw ------------------------------------------------------------------

BODY_SIZES = (0, 1, 17, 300, 4096, 70_000)
WRITE_CHUNKS = (1000, 65536, 1 << 30)
READ_CHUNKS = (-1, 1, 7, 100, 4096, 65536)
ZONES = ("default", "z1", "z2")
# Addresses carry characters an id built from them would betray ("/", "..", " ", "%").
DOMAINS = ("a.example", "b.example", "C.Example", "x/../y.example", "sp ace%25.example")
LOCALS = ("rcpt", "../../etc/passwd", "d a%ve", "bounce+x/../y")
SENDERS = ("", "alice@example.org", "bounce+x/../y@example.org")
PARAM_KEYS = ("ENVID", "RET", "BODY")

#: Reasons of the last attempt: none, a reply, non-ASCII with a line break, JSON's and
#: SQL's specials, and one past MAX_REASON (cut to it, whole characters, by Schedule).
REASONS = ("", "451 4.7.1 greylisted, try again later",
           "connect to mx.example.net[192.0.2.7]:25: Connection refused",
           "550-5.1.1 nicht zustellbar \u00e9\r\n550 5.1.1 \u2603", "'\"\\ ; --\x00",
           "\u00e9" * 600)



def _schedule(at: int, attempts: int) -> Schedule:
    """A schedule whose reason follows from its time and count (no draw of its own, so
    the searches of derandomized tests stay those they were before reasons)."""
    return Schedule(at, attempts, REASONS[(at + attempts) % len(REASONS)])


#: Schedules: the tame ones first (shrinking goes there), then mail's (``mail_data``:
#: the past, 2038 and beyond, the largest time and count, reasons up to MAX_REASON).
schedules = st.one_of(st.builds(_schedule, st.integers(0, 10**9), st.integers(0, 20)),
                      mail_data.schedules)
#: What a recipient is committed with: a new entry has had no attempt, so no reason (the
#: tame ones); mail's may carry any schedule the contract allows.
first_schedules = st.builds(Schedule, st.integers(0, 10**9), st.integers(0, 20))
recipients = st.one_of(
    st.builds(Recipient, st.builds("{}@{}".format, st.sampled_from(LOCALS),
                                   st.sampled_from(DOMAINS)),
              first_schedules, st.sampled_from(ZONES)),
    st.builds(Recipient, mail_data.addresses, mail_data.schedules, st.sampled_from(ZONES)))


@dataclass(frozen=True)
class EnqueueArgs:
    """One enqueue: sender, ESMTP parameters, recipients (repeats allowed), and a body of
    ``size`` bytes drawn from ``body_seed`` (or ``text``, mail's body, when given), written
    in pieces of ``chunk`` bytes."""

    mail_from: str
    params: tuple[tuple[str, str], ...]
    rcpts: tuple[Recipient, ...]
    size: int
    body_seed: int
    chunk: int
    text: bytes | None = None

    @property
    def body(self) -> bytes:
        return body_bytes(self.body_seed, self.size) if self.text is None else self.text


_params = st.dictionaries(st.sampled_from(PARAM_KEYS), st.text("abcXYZ=+;", max_size=8),
                          max_size=2).map(lambda d: tuple(sorted(d.items())))
_rcpt_lists = st.lists(recipients, min_size=1, max_size=3).map(tuple)
#: Tame enqueues first (random bodies of BODY_SIZES), then mail's (``mail_data.bodies``,
#: any sender): the body's size is the text's.
enqueue_args = st.one_of(
    st.builds(EnqueueArgs, st.sampled_from(SENDERS), _params, _rcpt_lists,
              st.sampled_from(BODY_SIZES), st.integers(0, 2**32), st.sampled_from(WRITE_CHUNKS)),
    st.builds(lambda f, p, r, t, c: EnqueueArgs(f, p, r, len(t), 0, c, t),
              mail_data.senders, _params, _rcpt_lists, mail_data.bodies,
              st.sampled_from((1, 7, *WRITE_CHUNKS))))


def body_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


#: The handle type each operation takes and the one it gives back.
TAKES: dict[Op, type[Handle]] = {
    Op.RESCHEDULE: QueuedMail, Op.SEND_START: QueuedMail, Op.DROP: QueuedMail,
    Op.SEND_DONE: InflightMail, Op.SEND_CANCEL: InflightMail, Op.CLEANUP: PendingCleanupMail,
    Op.HOLD: QueuedMail, Op.RELEASE: HeldMail, Op.DROP_HELD: HeldMail,
}
GIVES: dict[Op, type[Handle]] = {
    Op.RESCHEDULE: QueuedMail, Op.SEND_START: InflightMail, Op.DROP: PendingCleanupMail,
    Op.SEND_DONE: PendingCleanupMail, Op.SEND_CANCEL: QueuedMail,
    Op.HOLD: HeldMail, Op.RELEASE: QueuedMail, Op.DROP_HELD: PendingCleanupMail,
}
POOL_CAP = 40  # live handles kept at most (every listing adds second handles)

Held = tuple[Handle, EntryKey]


def describe_model(m: Model) -> list[str]:
    """The model, one line per entry, for reports."""
    out = [f"next message {m.next_id}, retired {sorted(m.retired)}"]
    for key, e in sorted(m.entries.items()):
        msg = m.messages[key[0]]
        out.append(f"{key} {e.state.value} at={e.schedule.at} attempts={e.schedule.attempts} "
                   f"reason={e.schedule.reason[:40]!r} rcpt={msg.rcpts[key[1]]!r} "
                   f"from={msg.mail_from!r} body={len(msg.body)}B")
    return out


class MachineBase(RuleBasedStateMachine):
    """State and helpers shared by the rules; subclasses set ``backend`` and the switches."""

    backend: ClassVar[Backend]
    restarts: ClassVar[bool] = False
    listing: ClassVar[bool] = False
    crashes: ClassVar[bool] = False  # set only for backends that declare the I/O seam
    #: run the backend through a recording seam (``self.io``), judged by the sync-cover
    #: rule; set only for backends that declare the I/O seam (always with ``crashes``)
    traced: ClassVar[bool] = False
    last_log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        type(self).last_log = self.log
        self.model = Model()
        self.io: FaultyIO | None = None
        self.judged_ops = 0  # operations of ``self.io`` the sync-cover rule has seen
        self.root = self._new_root()
        try:
            if self.traced or self.crashes:
                self.io = self._new_io(self.root)
            self.store: Storage = self._call("open", self._open)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.pool: list[Held] = []
        self.spent: list[tuple[str, Handle]] = []
        self.foreign: list[Handle] = []
        self.other: Storage | None = None  # a second Storage, for its foreign handles
        self.keys: dict[str, EntryKey] = {}
        self.mids: dict[str, int] = {}
        self.zone: dict[EntryKey, str] = {}
        self.params: dict[int, dict[str, str]] = {}
        self.read_at: dict[EntryKey, int] = {}  # when each entry was last read back
        self.no_inflight_listing = False  # inflight_entries raised UnsupportedError
        self.no_inspect = False  # inspect_entry raised UnsupportedError
        self.steps = 0

    # ---- opening ---------------------------------------------------------------------

    def _new_root(self) -> str:
        return tempfile.mkdtemp(prefix="queue-ref-lockstep-",
                                dir=scratch_base() if self.traced or self.crashes else None)

    def _new_io(self, root: str) -> FaultyIO:
        """A recording seam on ``root`` whose background syncs are held open; starts the
        count of operations judged by the sync-cover rule again."""
        self.judged_ops = 0
        return BackgroundSyncHoldIO(root, inner=ScratchIO())

    def _open(self) -> Storage:
        return self.backend.open(self.root, self.io)

    def teardown(self) -> None:
        try:
            if hasattr(self, "store"):
                self.store.close()
            if self.other is not None:
                self.other.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- calling the backend -----------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any], op: str | None = None) -> Any:
        """``fn()``, its exceptions as clause violations; ``op`` names the Storage
        operation it is, bracketed for the sync-cover rule when the machine has a seam."""
        try:
            if op is not None and self.io is not None:
                with self.io.operation(op):
                    return fn()
            return fn()
        except ClauseViolation:
            raise
        except MisuseError as e:
            raise ClauseViolation("API", f"{what} raised MisuseError on valid input: {e}") from e
        except Exception as e:
            raise ClauseViolation(
                "C9", f"{what} raised {type(e).__name__}: {e} (no fault was injected)") from e

    def check_sync_cover(self) -> None:
        """The operations acknowledged through ``self.io`` since the last check, judged by
        the sync-cover rule (replayed only when a sync of another thread overlapped
        one of them: ``sync_cover.exposed``).  Run after every step, and before the
        crash rule leaves the seam behind."""
        io = self.io
        if io is None or len(io.operations) == self.judged_ops:
            return
        new = io.operations[self.judged_ops:]
        self.judged_ops = len(io.operations)
        try:
            found = uncovered_on(io, new)
        except ModelError as e:
            raise ClauseViolation("C9", f"the trace cannot be replayed for the sync-cover "
                                        f"rule: {e}") from e
        if found:
            u = found[0]
            raise ClauseViolation(u.clause, "\n".join((u.detail(), "trace:", *u.excerpt)))

    def _expect_misuse(self, what: str, fn: Callable[[], object]) -> None:
        """``fn`` must raise MisuseError (C9 otherwise)."""
        try:
            got = fn()
        except MisuseError:
            return
        except Exception as e:
            raise ClauseViolation("C9", f"{what} raised {type(e).__name__}: {e}, not "
                                        "MisuseError") from e
        raise ClauseViolation("C9", f"{what} returned {got!r} instead of raising MisuseError")

    def _other(self) -> Storage:
        if self.other is None:
            self.other = MemoryStorage()
        return self.other

    # ---- handles -------------------------------------------------------------------------

    def _key(self, h: Handle | EntryMeta) -> EntryKey:
        key = self.keys.get(h.entry_id)
        if key is None:
            raise ClauseViolation("API", f"entry id {h.entry_id!r} was never handed out by "
                                         "commit (ids must stay the same across restarts)")
        if self.mids.get(h.message_id) != key[0]:
            raise ClauseViolation("API", f"entry {key} is listed with message id "
                                         f"{h.message_id!r}, not the one commit gave")
        return key

    @property
    def holds(self) -> bool:
        """Whether the backend declares Capability.HOLD (the hold rules run only then)."""
        return Capability.HOLD in self.store.capabilities

    def _ops(self) -> list[Op]:
        """The operations of TAKES this backend declares (hold ones only with HOLD)."""
        return [op for op in TAKES if self.holds or op not in HOLD_OPS]

    def _has(self, cls: type[Handle]) -> bool:
        return any(type(h) is cls for h, _ in self.pool)

    def _keep(self, h: Handle, key: EntryKey) -> None:
        """Keep a second handle a listing gave, while the pool has room."""
        if len(self.pool) < POOL_CAP:
            self.pool.append((h, key))

    def _draw(self, data: st.DataObject, cls: type[Handle]) -> Held:
        """Take a handle of type ``cls`` out of the pool: an entry first, then one of the
        handles held on it (so an entry's stale second handle is drawn as often as not)."""
        key = data.draw(st.sampled_from(sorted({k for h, k in self.pool if type(h) is cls})))
        held = [x for x in self.pool if type(x[0]) is cls and x[1] == key]
        pick = held[data.draw(st.integers(0, len(held) - 1))]
        self.pool.remove(pick)
        return pick

    def _stale_effect(self, op: Op, key: EntryKey, before: Model) -> ClauseViolation:
        was = before.state_of(key)
        if was is EntryState.INFLIGHT and op is Op.SEND_START:
            return ClauseViolation("C7", f"{op.value}{key} through a stale handle claimed an "
                                         "entry that is already inflight (claimed twice)")
        if key in before.retired:
            return ClauseViolation("C3", f"{op.value}{key} through a stale handle acted on an "
                                         f"entry that was {was.value} (resurrection)")
        return ClauseViolation("C5", f"{op.value}{key} through a stale handle acted on an "
                                     f"entry that is {was.value}")

    def _transition(self, op: Op, key: EntryKey, handle: Handle, got: object,
                    schedule: Schedule | None) -> None:
        """Apply ``op`` to the model and compare the backend's answer ``got`` with it."""
        before = self.model
        self.model, outcome = before.apply(op, key, schedule)
        if op is Op.CLEANUP and not isinstance(got, bool):
            raise ClauseViolation("API", f"cleanup returned {got!r}, not a bool")
        moved = got is not None and got is not False
        if outcome is Outcome.MOVED and not moved:
            raise ClauseViolation("API", f"{op.value}{key} answered VANISHED but the entry "
                                         f"was {before.state_of(key).value}")
        if outcome is Outcome.VANISHED and moved:
            raise self._stale_effect(op, key, before)
        self.spent.append((op.value, handle))
        if not isinstance(got, Handle):
            return
        if type(got) is not GIVES[op]:
            raise ClauseViolation("API", f"{op.value}{key} returned a {type(got).__name__}, "
                                         f"not a {GIVES[op].__name__}")
        if (got.entry_id, got.message_id) != (handle.entry_id, handle.message_id):
            raise ClauseViolation("API", f"{op.value}{key} returned a handle for entry "
                                         f"{got.entry_id} of message {got.message_id}, not "
                                         f"{handle.entry_id} of {handle.message_id}")
        diff = schedule_diff(got.schedule, self.model.entries[key].schedule)
        if diff is not None:
            raise ClauseViolation("C5", f"{op.value}{key} returned a handle whose {diff}")
        self.pool.append((got, key))

    # ---- listings --------------------------------------------------------------------

    def _compare_listing(self, when: str) -> list[QueuedMail]:
        """list_queue must give the model's QUEUED entries, each once, with its schedule."""
        listed: list[QueuedMail] = self._call("list_queue", lambda: list(self.store.list_queue()))
        keys = [self._key(h) for h in listed]
        if len(set(keys)) != len(keys):
            raise ClauseViolation("API", f"list_queue {when} listed an entry twice")
        want = set(self.model.keys_in(EntryState.QUEUED))
        for k in sorted(set(keys) - want):
            if k in self.model.retired:
                raise ClauseViolation("C3", f"list_queue {when} lists {k}, which was retired")
            if self.model.state_of(k) is EntryState.INFLIGHT:
                raise ClauseViolation("C7", f"list_queue {when} lists {k}, which is inflight")
            raise ClauseViolation("C2", f"list_queue {when} lists {k}, which was never "
                                        "committed")
        missing = sorted(want - set(keys))
        if missing:
            raise ClauseViolation("API", f"list_queue {when} misses queued entries {missing}")
        self._compare_schedules(f"list_queue {when}", "C5", listed, keys)
        return listed

    def _compare_schedules(self, what: str, clause: str, got: list[Any],
                           keys: list[EntryKey]) -> None:
        """Each listed handle's schedule is its entry's in the model, field by field
        (``field_compare``): time and count the same ints, reason the same text."""
        for h, k in zip(got, keys, strict=True):
            diff = schedule_diff(h.schedule, self.model.entries[k].schedule)
            if diff is not None:
                raise ClauseViolation(clause, f"{what} gives {k} a {diff}")

    def _compare_held(self, when: str) -> list[HeldMail]:
        """list_held must give the model's HELD entries, each once, with their schedules
        (C14); a backend without Capability.HOLD has none."""
        if not self.holds:
            return []
        got: list[HeldMail] = self._call("list_held", lambda: list(self.store.list_held()))
        keys = [self._key(h) for h in got]
        want = self.model.keys_in(EntryState.HELD)
        if sorted(keys) != want or len(set(keys)) != len(keys):
            raise ClauseViolation("C14", f"list_held {when} lists {sorted(keys)}, expected "
                                         f"{want}")
        self._compare_schedules(f"list_held {when}", "C14", got, keys)
        return got

    def _domains_held(self, *, every: bool) -> list[str]:
        """The domains (as committed) of the model's QUEUED recipients, or of ``every``
        recipient it holds, at most 12."""
        msgs = self.model.messages
        keys = self.model.entries if every else self.model.keys_in(EntryState.QUEUED)
        return sorted({msgs[k[0]].rcpts[k[1]].rpartition("@")[2] for k in keys})[:12]

    def _compare_domains(self, domains: list[str], when: str) -> None:
        """``list_domain`` of each domain must give exactly the model's QUEUED entries
        there, each once, with their schedules.  The contract compares domains
        lower-cased (``str.lower``): the part after the last ``@`` (the whole address when
        it has none), and nothing else (``a.example.`` is not ``a.example``)."""
        msgs = self.model.messages
        for d in dict.fromkeys(domains):
            got: list[QueuedMail] = self._call("list_domain", partial(self._listed_domain, d))
            keys = [self._key(h) for h in got]
            want = sorted(k for k in self.model.keys_in(EntryState.QUEUED)
                          if msgs[k[0]].rcpts[k[1]].rpartition("@")[2].lower() == d.lower())
            if sorted(keys) != want or len(set(keys)) != len(keys):
                raise ClauseViolation("API", f"list_domain({d!r}) {when} gives "
                                             f"{sorted(keys)}, expected {want}")
            self._compare_schedules(f"list_domain({d!r}) {when}", "C5", got, keys)

    def _listed_domain(self, domain: str) -> list[QueuedMail]:
        return list(self.store.list_domain(domain))

    def _compare_pending(self, when: str) -> list[PendingCleanupMail]:
        got: list[PendingCleanupMail] = self._call(
            "find_pending_cleanup", lambda: list(self.store.find_pending_cleanup()))
        keys = sorted(self._key(h) for h in got)
        want = self.model.keys_in(EntryState.PENDING_CLEANUP)
        if keys != want:
            raise ClauseViolation("API", f"find_pending_cleanup {when} lists {keys}, "
                                         f"expected {want}")
        return got

    # ---- reading back ------------------------------------------------------------------

    def _check_read(self, h: InflightMail, key: EntryKey, what: str,
                    piece: int | None = None) -> None:
        """``read_inflight`` gives the committed metadata and body of ``key``, read with
        ``read_all`` or, given ``piece``, in reads of that many bytes (-1: ``read()``)."""
        msg = self.model.messages[key[0]]

        def go() -> tuple[Any, bytes]:
            with self.store.read_inflight(h) as r:
                if piece is None:
                    return r.meta, r.read_all()
                parts = []
                while b := r.read(piece):
                    parts.append(b)
                return r.meta, b"".join(parts)

        meta, body = self._call(f"read_inflight of {what}", go)
        diff = meta_diff(meta, self.want_meta(key, h))
        if diff is not None:
            raise ClauseViolation("C6", f"{what} {key} reads back {diff}")
        if body != msg.body:
            raise ClauseViolation("C6", f"{what} {key} reads back {len(body)} bytes that "
                                        f"differ from the {len(msg.body)} committed")

    def want_meta(self, key: EntryKey, h: Handle | EntryMeta) -> dict[str, object]:
        """Every field of ``key``'s metadata as committed (ids as ``h`` names them)."""
        msg = self.model.messages[key[0]]
        return {"entry_id": h.entry_id, "message_id": h.message_id,
                "mail_from": msg.mail_from, "rcpt": msg.rcpts[key[1]], "rcpt_index": key[1],
                "zone": self.zone[key], "params": self.params[key[0]],
                "schedule": self.model.entries[key].schedule, "body_size": len(msg.body)}

    def _compare_inflight_entries(self) -> None:
        """Where the backend lists them (``inflight_entries`` raises no UnsupportedError),
        the INFLIGHT entries are the model's, each once, every field of their metadata as
        committed (C13)."""
        if self.no_inflight_listing:
            return

        def go() -> list[EntryMeta] | None:
            try:
                return list(self.store.inflight_entries())
            except UnsupportedError:
                return None

        metas: list[EntryMeta] | None = self._call("inflight_entries", go)
        if metas is None:
            self.no_inflight_listing = True
            return
        keys = [self._key(m) for m in metas]
        want = self.model.keys_in(EntryState.INFLIGHT)
        if sorted(keys) != want or len(set(keys)) != len(keys):
            raise ClauseViolation("C13", f"inflight_entries lists {sorted(keys)}, expected "
                                         f"{want}")
        for m, k in zip(metas, keys, strict=True):
            diff = meta_diff(m, self.want_meta(k, m))
            if diff is not None:
                raise ClauseViolation("C13", f"inflight_entries gives {k} {diff}")

    def _check_inspect(self, h: QueuedMail, key: EntryKey) -> None:
        """Where declared, ``inspect_entry`` of a listed QUEUED entry gives its committed
        metadata and body (C13); the handle stays usable."""
        if self.no_inspect:
            return

        def go() -> tuple[object, bytes] | None:
            try:
                r = self.store.inspect_entry(h)
            except UnsupportedError:
                return None
            if r is None:
                raise ClauseViolation("API", f"inspect_entry of the listed queued entry {key} "
                                             "returned None")
            with r:
                return r.meta, r.read_all()

        got = self._call("inspect_entry", go)
        if got is None:
            self.no_inspect = True
            return
        meta, body = got
        diff = meta_diff(meta, self.want_meta(key, h))
        if diff is not None:
            raise ClauseViolation("C6", f"the listed entry {key} reads back by inspect_entry "
                                        f"{diff}")
        if body != self.model.messages[key[0]].body:
            raise ClauseViolation("C6", f"the listed entry {key} reads back by inspect_entry "
                                        f"{len(body)} bytes that differ from the "
                                        f"{len(self.model.messages[key[0]].body)} committed")

    def _read_back(self, listed: list[QueuedMail]) -> None:
        """Each step reads back one listed entry (the one read longest ago): claimed by a
        second worker through its listed handle, read (its message exists, metadata and
        body as committed), and put back with its schedule.  The model does not change;
        every handle held on it stays valid (the entry is QUEUED again).  The reads take
        each piece size in turn (``READ_CHUNKS``: ``read()``, 1, 7, ... bytes), so every
        way of reading is met within a few steps, whatever the seed."""
        if not listed:
            return
        by_key = {self._key(h): h for h in listed}
        key = min(by_key, key=lambda k: (self.read_at.get(k, -1), k))
        self.read_at[key] = self.steps
        h = by_key[key]
        self._check_inspect(h, key)
        f = self._call("send_start of a listed entry", lambda: self.store.send_start(h),
                       "send_start")
        if not isinstance(f, InflightMail):
            raise ClauseViolation("API", f"send_start of the listed queued entry {key} "
                                         f"returned {f!r}")
        piece = READ_CHUNKS[self.steps % len(READ_CHUNKS)]
        if piece > 0:  # at most 256 reads of a body
            piece = max(piece, len(self.model.messages[key[0]].body) // 256)
        self._check_read(f, key, f"the listed entry (read in pieces of {piece})", piece)
        sched = self.model.entries[key].schedule
        back = self._call("send_cancel of a listed entry",
                          lambda: self.store.send_cancel(f, sched), "send_cancel")
        if not isinstance(back, QueuedMail) or schedule_diff(back.schedule, sched):
            raise ClauseViolation("C5" if isinstance(back, QueuedMail) else "API",
                                  f"send_cancel of {key} with its own schedule {sched} "
                                  f"returned {back!r}")
        self._keep(back, key)

    @invariant()
    def listing_equals_model(self) -> None:
        if not hasattr(self, "store"):
            return
        self.check_sync_cover()
        problems = check(self.model)
        assert problems == [], f"the model itself breaks its invariants: {problems}"
        listed = self._compare_listing("after the step")
        self._compare_held("after the step")
        self._compare_pending("after the step")
        adopted = self._call("find_inflight", lambda: list(self.store.find_inflight()))
        if adopted:
            raise ClauseViolation("C7", f"find_inflight adopted {len(adopted)} entries this "
                                        "live queue holds inflight")
        self._compare_inflight_entries()
        if Capability.DOMAIN_INDEX in self.store.capabilities:
            self._compare_domains(self._domains_held(every=False), "after the step")
        self.steps += 1
        if not self.crashes:  # a read-back's own syncs would make a lost write durable
            self._read_back(listed)
        if not self.model.messages:
            fp = self._call("footprint", self.store.footprint)
            if fp.objects or fp.bytes:
                raise ClauseViolation("C8", f"every entry is cleaned up but {fp.objects} "
                                            f"objects and {fp.bytes} bytes remain")
