"""The model and each real backend in lockstep, under one hypothesis state machine.

Every rule does the same thing to the model (``spec.model.Model``) and to the backend,
and compares the results: a transition moves in both or vanishes in both (the backend
returns None, or False for cleanup); after every step the backend lists exactly the
model's QUEUED entries with their schedules and its PENDING_CLEANUP entries.  Backend
message ids are mapped to the model's numbers by commit order, entry ids to
(message, recipient index).

Backends are listed in ``BACKENDS`` (name -> factory taking a directory); each gets its
own test class ``TestLockstep<Name>``.  The ``restart`` rule (close, reopen with the same
directory: the backend must list ``model.restart()``) is off for the backends in
``VOLATILE``, which keep nothing across close.

Sizes come from the hypothesis profile in ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from queue_ref.fsqueue import FsQueue
from queue_ref.kv.queue import KvQueue
from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    ClosedError,
    Footprint,
    Handle,
    InflightMail,
    InvalidInputError,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
)
from spec import TABLE, EntryState, Model, Op, Outcome
from spec.invariants import check
from spec.model import EntryKey

Factory = Callable[[Path], Storage]

#: Every backend the lockstep machine runs, by name.  Adding one is one line.
BACKENDS: dict[str, Factory] = {
    "memory": lambda root: MemoryStorage(),
    "fsqueue": lambda root: FsQueue(str(root)),
    "kv-log": lambda root: KvQueue.open_log(str(root)),
    "kv-leveldb": lambda root: KvQueue.open_leveldb(str(root)),
}

#: Backends that keep nothing across close: no restart rule for them.
VOLATILE = frozenset({"memory"})

# Addresses carry characters an id built from them would betray ("/", "..", " ", "%").
SENDERS = ("", "alice@example.org", "bounce+x/../y@example.org")
ADDRESSES = ("bob@example.net", "carol@b.example", "../../etc/passwd@x.example",
             "d a%ve@example.net")
ZONES = ("default", "slow")
PARAM_KEYS = ("ENVID", "RET", "BODY")

schedules = st.builds(Schedule, st.integers(0, 10**9), st.integers(0, 20))
recipients = st.lists(
    st.builds(Recipient, st.sampled_from(ADDRESSES), schedules, st.sampled_from(ZONES)),
    min_size=1, max_size=3)
bodies = st.lists(st.binary(max_size=300), max_size=4)
params = st.dictionaries(st.sampled_from(PARAM_KEYS), st.text("abcXYZ=+;", max_size=8),
                         max_size=2)

#: The handle type each operation takes and the one it returns.
TAKES: dict[Op, type[Handle]] = {
    Op.RESCHEDULE: QueuedMail,
    Op.SEND_START: QueuedMail,
    Op.DROP: QueuedMail,
    Op.SEND_DONE: InflightMail,
    Op.SEND_CANCEL: InflightMail,
    Op.CLEANUP: PendingCleanupMail,
}
GIVES: dict[Op, type[Handle]] = {
    Op.RESCHEDULE: QueuedMail,
    Op.SEND_START: InflightMail,
    Op.DROP: PendingCleanupMail,
    Op.SEND_DONE: PendingCleanupMail,
    Op.SEND_CANCEL: QueuedMail,
}
POOL_CAP = 40  # live handles kept at most (relisting adds second handles to entries)

Held = tuple[Handle, EntryKey]


class LockstepMachine(RuleBasedStateMachine):
    backend: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="queue-ref-lockstep-")) / "q"
        self.store = BACKENDS[self.backend](self.root)
        self.model = Model()
        self.keys: dict[str, EntryKey] = {}  # backend entry id -> model key
        self.mids: dict[str, int] = {}  # backend message id -> model message number
        self.params: dict[int, dict[str, str]] = {}
        self.zones: dict[EntryKey, str] = {}
        self.pool: list[Held] = []  # live handles of self.store
        self.used: list[Held] = []  # consumed handles of self.store
        self.foreign: list[Handle] = []  # handles of closed stores or of another Storage
        self.other = MemoryStorage()

    def teardown(self) -> None:
        self.store.close()
        self.other.close()
        shutil.rmtree(self.root.parent, ignore_errors=True)

    # ---- helpers ---------------------------------------------------------------------

    def _has(self, cls: type[Handle]) -> bool:
        return any(type(h) is cls for h, _ in self.pool)

    def _draw(self, data: st.DataObject, cls: type[Handle]) -> Held:
        held = data.draw(st.sampled_from([x for x in self.pool if type(x[0]) is cls]))
        self.pool.remove(held)
        return held

    def _key(self, h: Handle) -> EntryKey:
        assert h.entry_id in self.keys, f"unknown entry id {h.entry_id!r} listed"
        key = self.keys[h.entry_id]
        assert self.mids.get(h.message_id) == key[0], "entry listed with another message id"
        return key

    def _transition(self, data: st.DataObject, op: Op, schedule: Schedule | None = None) -> None:
        h, key = self._draw(data, TAKES[op])
        self.model, outcome = self.model.apply(op, key, schedule)
        fn = getattr(self.store, op.value)
        res = fn(h) if schedule is None else fn(h, schedule)
        self.used.append((h, key))
        if op is Op.CLEANUP:
            assert res is (outcome is Outcome.MOVED), f"cleanup returned {res!r}, model {outcome}"
            return
        if outcome is Outcome.VANISHED:
            assert res is None, f"{op.value} of a {self.model.state_of(key).value} entry acted"
            return
        assert type(res) is GIVES[op], f"{op.value} returned {res!r}"
        assert (res.entry_id, res.message_id) == (h.entry_id, h.message_id)
        assert res.schedule == self.model.entries[key].schedule, (
            f"{op.value} returned a handle with schedule {res.schedule}, "
            f"the entry's is {self.model.entries[key].schedule}")
        self.pool.append((res, key))

    # ---- enqueue ---------------------------------------------------------------------

    @rule(mail_from=st.sampled_from(SENDERS), rcpts=recipients, chunks=bodies, prm=params)
    def enqueue(self, mail_from: str, rcpts: list[Recipient], chunks: list[bytes],
                prm: dict[str, str]) -> None:
        with self.store.enqueue(mail_from, prm) as enq:
            for c in chunks:
                enq.write(c)
            handles = enq.commit(rcpts)
        self.model, mid = self.model.enqueue(
            mail_from, b"".join(chunks), [(r.address, r.schedule) for r in rcpts])
        assert len(handles) == len(rcpts)
        msg_ids = {h.message_id for h in handles}
        assert len(msg_ids) == 1, "entries of one message carry different message ids"
        (msg_id,) = msg_ids
        assert msg_id not in self.mids, f"message id {msg_id!r} reused"
        self.mids[msg_id] = mid
        self.params[mid] = prm
        for i, (h, r) in enumerate(zip(handles, rcpts, strict=True)):
            assert type(h) is QueuedMail and h.schedule == r.schedule
            assert h.entry_id not in self.keys, f"entry id {h.entry_id!r} reused"
            for addr in (*ADDRESSES, *SENDERS[1:]):
                assert addr not in h.entry_id and addr not in h.message_id, \
                    "an id was built from an address"
            self.keys[h.entry_id] = (mid, i)
            self.zones[(mid, i)] = r.zone
            self.pool.append((h, (mid, i)))

    @rule(case=st.sampled_from(["mail_from", "rcpt", "no-rcpts", "zone"]), chunks=bodies)
    def enqueue_bad_input(self, case: str, chunks: list[bytes]) -> None:
        """Malformed input raises InvalidInputError and stores nothing."""
        good = [Recipient("bob@example.net", Schedule(0))]
        rcpts = {
            "mail_from": good,
            "rcpt": [good[0], Recipient("evil\r\nRCPT TO:<x@y>", Schedule(0))],
            "no-rcpts": [],
            "zone": [Recipient("bob@example.net", Schedule(0), "a\x00b")],
        }[case]
        sender = "nul\x00@x" if case == "mail_from" else "a@b"
        with pytest.raises(InvalidInputError), self.store.enqueue(sender) as enq:
            for c in chunks:
                enq.write(c)
            enq.commit(rcpts)

    # ---- transitions -----------------------------------------------------------------

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data(), schedule=schedules)
    def reschedule(self, data: st.DataObject, schedule: Schedule) -> None:
        self._transition(data, Op.RESCHEDULE, schedule)

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data())
    def send_start(self, data: st.DataObject) -> None:
        self._transition(data, Op.SEND_START)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data())
    def send_done(self, data: st.DataObject) -> None:
        self._transition(data, Op.SEND_DONE)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data(), schedule=schedules)
    def send_cancel(self, data: st.DataObject, schedule: Schedule) -> None:
        self._transition(data, Op.SEND_CANCEL, schedule)

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self._transition(data, Op.DROP)

    @precondition(lambda self: self._has(PendingCleanupMail))
    @rule(data=st.data())
    def cleanup(self, data: st.DataObject) -> None:
        self._transition(data, Op.CLEANUP)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data(), n=st.sampled_from([-1, 1, 7, 4096]))
    def read_inflight(self, data: st.DataObject, n: int) -> None:
        held = self._draw(data, InflightMail)
        h, key = held
        assert isinstance(h, InflightMail)
        self.pool.append(held)  # reading does not consume the handle
        assert self.model.state_of(key) is EntryState.INFLIGHT
        msg = self.model.messages[key[0]]
        with self.store.read_inflight(h) as r:
            meta = r.meta
            parts = []
            while True:
                b = r.read(n)
                if not b:
                    break
                parts.append(b)
                if n == -1:
                    assert r.read(n) == b""
                    break
        assert b"".join(parts) == msg.body, f"read_inflight of {key} returned other bytes"
        assert (meta.entry_id, meta.message_id) == (h.entry_id, h.message_id)
        assert (meta.mail_from, meta.rcpt, meta.rcpt_index) == (
            msg.mail_from, msg.rcpts[key[1]], key[1])
        assert meta.zone == self.zones[key]
        assert dict(meta.params) == self.params[key[0]]
        assert meta.schedule == self.model.entries[key].schedule
        assert meta.body_size == len(msg.body)

    # ---- listing and handle discipline -----------------------------------------------

    @rule()
    def relist(self) -> None:
        """Fresh handles from the listers: a second handle on an entry makes the first
        one's next transition vanish once the entry has moved."""
        for h in [*self.store.list_queue(), *self.store.find_pending_cleanup()]:
            if len(self.pool) < POOL_CAP:
                self.pool.append((h, self._key(h)))

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def misuse_consumed_handle(self, data: st.DataObject) -> None:
        h, _ = data.draw(st.sampled_from(self.used))
        self._misuse(data, h, same_type=True)

    @precondition(lambda self: self.pool)
    @rule(data=st.data())
    def misuse_wrong_type(self, data: st.DataObject) -> None:
        """A live handle passed to an operation of another state: MisuseError, and the
        handle stays usable."""
        h, _ = data.draw(st.sampled_from(self.pool))
        self._misuse(data, h, same_type=False)

    @rule(data=st.data())
    def misuse_foreign_handle(self, data: st.DataObject) -> None:
        """A handle of another Storage (or of this backend before a restart)."""
        with self.other.enqueue("a@b") as enq:
            (mine,) = enq.commit([Recipient("c@d", Schedule(0))])
        h = data.draw(st.sampled_from([mine, *self.foreign[-5:]]))
        self._misuse(data, h, same_type=True)

    def _misuse(self, data: st.DataObject, h: Handle, *, same_type: bool) -> None:
        ops = [op for op, cls in TAKES.items() if (cls is type(h)) == same_type]
        op = data.draw(st.sampled_from(ops))
        fn = getattr(self.store, op.value)
        with pytest.raises(MisuseError):
            if TABLE[op].changes_schedule:
                fn(h, Schedule(1))
            else:
                fn(h)
        if same_type and type(h) is InflightMail:
            with pytest.raises(MisuseError):
                self.store.read_inflight(h)

    # ---- restart -----------------------------------------------------------------------

    @precondition(lambda self: self.backend not in VOLATILE)
    @rule()
    def restart(self) -> None:
        """Close and reopen: the backend must hold exactly ``model.restart()``."""
        old = self.store
        old.close()
        old.close()  # idempotent
        with pytest.raises(ClosedError):
            list(old.list_queue())
        self.foreign.extend(h for h, _ in [*self.pool, *self.used])
        self.pool.clear()
        self.used.clear()
        self.store = BACKENDS[self.backend](self.root)
        self.model = self.model.restart()
        self._check_listing()
        report = self.store.recover()  # a second recovery finds nothing to do (C10)
        assert (report.requeued, report.cleaned, report.uncommitted_removed,
                report.quarantined) == (0, 0, 0, 0), report

    # ---- invariants ------------------------------------------------------------------

    @invariant()
    def listing_equals_model(self) -> None:
        assert check(self.model) == []
        self._check_listing()

    def _check_listing(self) -> None:
        queued: dict[EntryKey, Schedule] = {}
        for h in self.store.list_queue():
            key = self._key(h)
            assert key not in queued, f"entry {key} listed twice"
            queued[key] = h.schedule
        want = {k: e.schedule for k, e in self.model.entries.items()
                if e.state is EntryState.QUEUED}
        assert queued == want, f"listed QUEUED {queued}, the model has {want}"
        pending = [self._key(h) for h in self.store.find_pending_cleanup()]
        want_pc = self.model.keys_in(EntryState.PENDING_CLEANUP)
        assert sorted(pending) == want_pc, f"listed PENDING_CLEANUP {pending}, want {want_pc}"
        assert list(self.store.find_inflight()) == [], "a live owner's entry was adopted"
        if not self.model.messages:
            fp = self.store.footprint()
            assert fp == Footprint(0, 0), f"{fp} stored with every message cleaned up"


def _class_name(backend: str) -> str:
    return "TestLockstep" + "".join(p.capitalize() for p in backend.split("-"))


def _machine(backend: str) -> type[LockstepMachine]:
    return type(f"Lockstep{backend}", (LockstepMachine,), {"backend": backend})


for _name in BACKENDS:
    globals()[_class_name(_name)] = _machine(_name).TestCase
