"""A hypothesis state machine that drives a backend and the spec model in lockstep.

``lockstep_machine(factory)`` returns a ``RuleBasedStateMachine`` subclass; every rule
performs one operation on the backend and on ``spec.model.Model`` and compares the
answers.  Handles are kept in pools, several per entry (each listing adds one), so
rules also play the second worker that holds a stale handle; consumed handles are
passed again and must raise ``MisuseError``.  With ``restarts=True`` a rule closes the
queue and opens it again (an orderly restart): every acknowledged entry must come back
(INFLIGHT ones as QUEUED, PENDING_CLEANUP ones gone).

A difference raises ``ClauseViolation`` (an AssertionError) naming the clause.  Use it
under pytest::

    TestLockstep = lockstep_machine(my_factory).TestCase

or without pytest, where ``run_lockstep`` returns findings instead of raising::

    hypothesis.stateful.run_state_machine_as_test(lockstep_machine(my_factory))
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    invariant,
    precondition,
    rule,
)

from conformance.clauses import NO_CRASH
from conformance.factory import Backend, Factory
from conformance.profiles import Profile
from conformance.results import Finding
from queue_ref.storage import (
    Capability,
    Handle,
    InflightMail,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
)
from spec.model import EntryKey, Model
from spec.states import EntryState, Op, Outcome


class ClauseViolation(AssertionError):
    """The backend broke ``clause``; ``detail`` says how."""

    def __init__(self, clause: str, detail: str) -> None:
        super().__init__(f"{clause}: {detail}")
        self.clause = clause
        self.detail = detail


BODY_SIZES = (0, 1, 17, 300, 4096, 70_000)
ZONES = ("default", "z1", "z2")
DOMAINS = ("a.example", "b.example", "C.Example", "x/../y.example", "sp ace%25.example")


def body_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class LockstepMachine(RuleBasedStateMachine):
    """Rules shared by every lockstep run; subclasses set ``backend`` and the switches."""

    backend: ClassVar[Backend]
    restarts: ClassVar[bool] = False
    listing: ClassVar[bool] = False
    last_log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="queue-ref-lockstep-")
        self.log: list[str] = []
        type(self).last_log = self.log
        self.model = Model()
        try:
            self.store: Storage = self._call("open", lambda: self.backend.open(self.root))
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.queued: dict[EntryKey, list[QueuedMail]] = {}
        self.inflight: dict[EntryKey, InflightMail] = {}
        self.pending: dict[EntryKey, list[PendingCleanupMail]] = {}
        self.spent: list[tuple[str, Handle]] = []
        self.keys: dict[str, EntryKey] = {}
        self.zone: dict[EntryKey, str] = {}
        self.params: dict[int, dict[str, str]] = {}
        self.senders = 0

    # ---- helpers -------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ClauseViolation:
            raise
        except MisuseError as e:
            raise ClauseViolation("API", f"{what} raised MisuseError on valid input: {e}") from e
        except Exception as e:
            raise ClauseViolation(
                "C9", f"{what} raised {type(e).__name__}: {e} (no fault was injected)") from e

    def _key(self, h: Handle) -> EntryKey:
        key = self.keys.get(h.entry_id)
        if key is None:
            raise ClauseViolation("API", f"entry id {h.entry_id!r} was never handed out by "
                                         "commit (ids must stay the same across restarts)")
        return key

    def _pick(self, data: st.DataObject, pool: dict[EntryKey, Any]) -> EntryKey:
        return data.draw(st.sampled_from(sorted(k for k, v in pool.items() if v)))

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
        before = self.model
        self.model, outcome = before.apply(op, key, schedule)
        moved = got is not None and got is not False
        if outcome is Outcome.MOVED and not moved:
            raise ClauseViolation("API", f"{op.value}{key} answered VANISHED but the entry "
                                         f"was {before.state_of(key).value}")
        if outcome is Outcome.VANISHED and moved:
            raise self._stale_effect(op, key, before)
        self.spent.append((op.value, handle))
        if isinstance(got, Handle):
            if got.entry_id != handle.entry_id:
                raise ClauseViolation("API", f"{op.value}{key} returned a handle for entry "
                                             f"{got.entry_id}, not {handle.entry_id}")
            want = self.model.entries[key].schedule
            if got.schedule != want:
                raise ClauseViolation("C5", f"{op.value}{key} returned schedule "
                                            f"{got.schedule}, expected {want}")

    # ---- rules ---------------------------------------------------------------------

    @rule(nrcpts=st.integers(1, 3), size=st.sampled_from(BODY_SIZES),
          body_seed=st.integers(0, 2**32), chunk=st.sampled_from((1000, 65536, 1 << 30)),
          ats=st.lists(st.integers(0, 10_000), min_size=3, max_size=3),
          zones=st.lists(st.sampled_from(ZONES), min_size=3, max_size=3),
          domains=st.lists(st.sampled_from(DOMAINS), min_size=3, max_size=3),
          null_sender=st.booleans(), with_params=st.booleans())
    def enqueue(self, nrcpts: int, size: int, body_seed: int, chunk: int, ats: list[int],
                zones: list[str], domains: list[str], null_sender: bool,
                with_params: bool) -> None:
        self.senders += 1
        mail_from = "" if null_sender else f"sender{self.senders}@example.org"
        params = {"ENVID": f"id-{self.senders}", "RET": "HDRS"} if with_params else {}
        body = body_bytes(body_seed, size)
        mid = self.model.next_id
        rcpts = [Recipient(f"rcpt{i}.m{mid}@{domains[i]}", Schedule(ats[i]), zones[i])
                 for i in range(nrcpts)]
        self.log.append(f"enqueue(from={mail_from!r}, body={size}B, "
                        f"rcpts={[(r.address, r.schedule.at, r.zone) for r in rcpts]})")

        def go() -> list[QueuedMail]:
            enq = self.store.enqueue(mail_from, params or None)
            for i in range(0, len(body), chunk):
                enq.write(body[i:i + chunk])
            return enq.commit(rcpts)

        got: list[QueuedMail] = self._call("enqueue/commit", go)
        self.model, mid = self.model.enqueue(
            mail_from, body, [(r.address, r.schedule) for r in rcpts])
        if len(got) != nrcpts:
            raise ClauseViolation("C2", f"commit of {nrcpts} recipients returned "
                                        f"{len(got)} handles")
        if len({h.entry_id for h in got}) != nrcpts or len({h.message_id for h in got}) != 1:
            raise ClauseViolation("API", "commit returned handles with repeated entry ids or "
                                         "different message ids")
        for i, h in enumerate(got):
            if type(h) is not QueuedMail:
                raise ClauseViolation("API", f"commit returned a {type(h).__name__}")
            if h.entry_id in self.keys:
                old = self.keys[h.entry_id]
                if self.model.state_of(old) is EntryState.GONE:
                    raise ClauseViolation("C3", f"commit gave the new entry the id "
                                                f"{h.entry_id} of entry {old}, which is gone: "
                                                "the old entry reappears by its id")
                raise ClauseViolation("API", f"commit reused entry id {h.entry_id} of the "
                                             f"live entry {old}")
            if h.schedule != rcpts[i].schedule:
                raise ClauseViolation("C5", f"commit returned schedule {h.schedule} for "
                                            f"recipient {i}, asked {rcpts[i].schedule}")
            self.keys[h.entry_id] = (mid, i)
            self.queued[(mid, i)] = [h]
            self.zone[(mid, i)] = rcpts[i].zone
        self.params[mid] = params

    @rule(size=st.sampled_from(BODY_SIZES), body_seed=st.integers(0, 2**32))
    def enqueue_aborted(self, size: int, body_seed: int) -> None:
        self.log.append(f"enqueue(body={size}B) then abort")

        def go() -> None:
            enq = self.store.enqueue("aborted@example.org")
            enq.write(body_bytes(body_seed, size))
            enq.abort()

        self._call("enqueue/abort", go)
        self._compare_listing("after an aborted enqueue")

    def _compare_listing(self, when: str) -> list[QueuedMail]:
        listed: list[QueuedMail] = self._call("list_queue", lambda: list(self.store.list_queue()))
        keys = [self._key(h) for h in listed]
        if len(set(keys)) != len(keys):
            raise ClauseViolation("API", f"list_queue {when} listed an entry twice")
        want = set(self.model.keys_in(EntryState.QUEUED))
        got = set(keys)
        for k in sorted(got - want):
            if k in self.model.retired:
                raise ClauseViolation("C3", f"list_queue {when} lists {k}, which was retired")
            if self.model.state_of(k) is EntryState.INFLIGHT:
                raise ClauseViolation("C7", f"list_queue {when} lists {k}, which is inflight")
            raise ClauseViolation("C2", f"list_queue {when} lists {k}, which was never "
                                        "committed")
        missing = sorted(want - got)
        if missing:
            raise ClauseViolation("API", f"list_queue {when} misses queued entries {missing}")
        for h, k in zip(listed, keys, strict=True):
            if h.schedule != self.model.entries[k].schedule:
                raise ClauseViolation("C5", f"list_queue {when} gives {k} schedule "
                                            f"{h.schedule}, expected "
                                            f"{self.model.entries[k].schedule}")
        return listed

    @rule()
    def list_queue(self) -> None:
        self.log.append("list_queue()")
        for h in self._compare_listing("now"):
            self.queued.setdefault(self._key(h), []).append(h)

    @rule()
    def find_pending_cleanup(self) -> None:
        self.log.append("find_pending_cleanup()")
        got = self._call("find_pending_cleanup",
                         lambda: list(self.store.find_pending_cleanup()))
        keys = {self._key(h) for h in got}
        want = set(self.model.keys_in(EntryState.PENDING_CLEANUP))
        if keys != want:
            raise ClauseViolation("API", f"find_pending_cleanup lists {sorted(keys)}, "
                                         f"expected {sorted(want)}")
        for h in got:
            self.pending.setdefault(self._key(h), []).append(h)

    def _take_queued(self, data: st.DataObject) -> tuple[EntryKey, QueuedMail]:
        key = self._pick(data, self.queued)
        pool = self.queued[key]
        h = pool.pop(data.draw(st.integers(0, len(pool) - 1)))
        return key, h

    @precondition(lambda self: any(self.queued.values()))
    @rule(data=st.data())
    def send_start(self, data: st.DataObject) -> None:
        key, h = self._take_queued(data)
        self.log.append(f"send_start{key}")
        got = self._call("send_start", lambda: self.store.send_start(h))
        self._transition(Op.SEND_START, key, h, got, None)
        if got is not None:
            self.inflight[key] = got  # the entry's other QueuedMails stay: now stale

    @precondition(lambda self: any(self.queued.values()))
    @rule(data=st.data(), at=st.integers(0, 100_000), attempts=st.integers(0, 5))
    def reschedule(self, data: st.DataObject, at: int, attempts: int) -> None:
        key, h = self._take_queued(data)
        sched = Schedule(at, attempts)
        self.log.append(f"reschedule{key} to at={at}, attempts={attempts}")
        got = self._call("reschedule", lambda: self.store.reschedule(h, sched))
        self._transition(Op.RESCHEDULE, key, h, got, sched)
        if got is not None:
            self.queued.setdefault(key, []).append(got)

    @precondition(lambda self: any(self.queued.values()))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        key, h = self._take_queued(data)
        self.log.append(f"drop{key}")
        got = self._call("drop", lambda: self.store.drop(h))
        self._transition(Op.DROP, key, h, got, None)
        if got is not None:
            self.pending[key] = [got]

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data(), at=st.integers(0, 100_000), attempts=st.integers(0, 5))
    def send_cancel(self, data: st.DataObject, at: int, attempts: int) -> None:
        key = self._pick(data, self.inflight)
        h = self.inflight.pop(key)
        sched = Schedule(at, attempts)
        self.log.append(f"send_cancel{key} with at={at}, attempts={attempts}")
        got = self._call("send_cancel", lambda: self.store.send_cancel(h, sched))
        self._transition(Op.SEND_CANCEL, key, h, got, sched)
        if got is not None:
            self.queued.setdefault(key, []).append(got)

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def send_done(self, data: st.DataObject) -> None:
        key = self._pick(data, self.inflight)
        h = self.inflight.pop(key)
        self.log.append(f"send_done{key}")
        got = self._call("send_done", lambda: self.store.send_done(h))
        self._transition(Op.SEND_DONE, key, h, got, None)
        if got is not None:
            self.pending[key] = [got]

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def cleanup(self, data: st.DataObject) -> None:
        key = self._pick(data, self.pending)
        h = self.pending[key].pop(0)
        self.log.append(f"cleanup{key}")
        got = self._call("cleanup", lambda: self.store.cleanup(h))
        if not isinstance(got, bool):
            raise ClauseViolation("API", f"cleanup returned {got!r}, not a bool")
        self._transition(Op.CLEANUP, key, h, got, None)

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data(), chunk=st.sampled_from((1, 100, 65536, -1)))
    def read_inflight(self, data: st.DataObject, chunk: int) -> None:
        key = self._pick(data, self.inflight)
        h = self.inflight[key]
        self.log.append(f"read_inflight{key} in reads of {chunk}")

        def go() -> tuple[Any, bytes]:
            with self.store.read_inflight(h) as r:
                parts = []
                while True:
                    b = r.read(chunk)
                    if not b:
                        break
                    parts.append(b)
                    if chunk < 0:
                        break
                return r.meta, b"".join(parts)

        meta, body = self._call("read_inflight", go)
        msg = self.model.messages[key[0]]
        want = {"entry_id": h.entry_id, "message_id": h.message_id,
                "mail_from": msg.mail_from, "rcpt": msg.rcpts[key[1]], "rcpt_index": key[1],
                "zone": self.zone[key], "params": self.params[key[0]],
                "schedule": self.model.entries[key].schedule, "body_size": len(msg.body)}
        for field, value in want.items():
            if getattr(meta, field) != value:
                raise ClauseViolation("C6", f"read_inflight{key}: meta.{field} is "
                                            f"{getattr(meta, field)!r}, committed {value!r}")
        if body != msg.body:
            raise ClauseViolation("C6", f"read_inflight{key} returned {len(body)} bytes that "
                                        f"differ from the {len(msg.body)} committed")

    @precondition(lambda self: bool(self.spent))
    @rule(data=st.data())
    def reuse_spent_handle(self, data: st.DataObject) -> None:
        op, h = data.draw(st.sampled_from(self.spent))
        self.log.append(f"{op} again through the consumed handle of {h.entry_id}")
        s = self.store
        calls: dict[str, Callable[[], object]] = {
            "send_start": lambda: s.send_start(h),  # type: ignore[arg-type]
            "reschedule": lambda: s.reschedule(h, Schedule(1)),  # type: ignore[arg-type]
            "drop": lambda: s.drop(h),  # type: ignore[arg-type]
            "send_cancel": lambda: s.send_cancel(h, Schedule(1)),  # type: ignore[arg-type]
            "send_done": lambda: s.send_done(h),  # type: ignore[arg-type]
            "cleanup": lambda: s.cleanup(h),  # type: ignore[arg-type]
        }
        try:
            got = calls[op]()
        except MisuseError:
            return
        except Exception as e:
            raise ClauseViolation("C9", f"{op} through a consumed handle raised "
                                        f"{type(e).__name__}, not MisuseError") from e
        raise ClauseViolation("C9", f"{op} through a consumed handle returned {got!r} "
                                    "instead of raising MisuseError")

    @rule()
    def drain(self) -> None:
        """Claim, send and clean up everything; then nothing may be left (invariant)."""
        self.log.append("drain: send and clean up every entry")
        s = self.store
        for q in self._compare_listing("before draining"):
            key = self._key(q)
            f = self._call("send_start", partial(s.send_start, q))
            self._transition(Op.SEND_START, key, q, f, None)
            self.inflight[key] = f
        for key in sorted(self.inflight):
            i = self.inflight.pop(key)
            p = self._call("send_done", partial(s.send_done, i))
            self._transition(Op.SEND_DONE, key, i, p, None)
            self.pending[key] = [p]
        for key in sorted(self.pending):
            for c in self.pending.pop(key):
                done = self._call("cleanup", partial(s.cleanup, c))
                self._transition(Op.CLEANUP, key, c, done, None)

    @precondition(lambda self: self.restarts)
    @rule()
    def restart(self) -> None:
        self.log.append("restart (close, then open again)")
        self._call("close", self.store.close)
        before = self.model
        self.store = self._call("open", lambda: self.backend.open(self.root))
        self.model = before.restart()
        self.queued.clear()
        self.inflight.clear()
        self.pending.clear()
        self.spent.clear()
        listed: list[QueuedMail] = self._call("list_queue",
                                              lambda: list(self.store.list_queue()))
        inflight = self._call("find_inflight", lambda: list(self.store.find_inflight()))
        pending = self._call("find_pending_cleanup",
                             lambda: list(self.store.find_pending_cleanup()))
        got = {self._key(h): h for h in listed}
        for key in sorted(set(self.model.entries) - set(got)):
            was = before.state_of(key)
            clause = "C4" if was is EntryState.INFLIGHT else "C1"
            raise ClauseViolation(clause, f"entry {key} ({was.value}) is gone after the "
                                          "restart")
        for key in sorted(set(got) - set(self.model.entries)):
            clause = "C3" if key in before.retired else "C2"
            raise ClauseViolation(clause, f"entry {key} ({before.state_of(key).value}) is "
                                          "queued after the restart")
        for key, h in got.items():
            if h.schedule != self.model.entries[key].schedule:
                raise ClauseViolation("C5", f"entry {key} came back with {h.schedule}, "
                                            f"expected {self.model.entries[key].schedule}")
            self.queued[key] = [h]
        if inflight or pending:
            raise ClauseViolation("C10", f"after opening, {len(inflight)} entries are still "
                                         f"inflight and {len(pending)} pending cleanup")

    @precondition(lambda self: self.listing)
    @rule(zone=st.sampled_from(ZONES))
    def list_zone(self, zone: str) -> None:
        self.log.append(f"list_zone({zone!r})")
        got = self._call("list_zone", lambda: list(self.store.list_zone(zone)))
        keys = [self._key(h) for h in got]
        want = sorted(k for k in self.model.keys_in(EntryState.QUEUED) if self.zone[k] == zone)
        if sorted(keys) != want:
            raise ClauseViolation("API", f"list_zone({zone!r}) gives {sorted(keys)}, "
                                         f"expected {want}")
        mids = [k[0] for k in keys]
        if mids != sorted(mids):
            raise ClauseViolation("API", f"list_zone({zone!r}) is not oldest message first: "
                                         f"{keys}")
        for h in got:
            self.queued.setdefault(self._key(h), []).append(h)

    @precondition(lambda self: self.listing)
    @rule(domain=st.sampled_from(DOMAINS))
    def list_domain(self, domain: str) -> None:
        self.log.append(f"list_domain({domain!r})")
        if Capability.DOMAIN_INDEX not in self.store.capabilities:
            return
        got = self._call("list_domain", lambda: list(self.store.list_domain(domain)))
        keys = sorted(self._key(h) for h in got)
        msgs = self.model.messages
        want = sorted(k for k in self.model.keys_in(EntryState.QUEUED)
                      if msgs[k[0]].rcpts[k[1]].rpartition("@")[2].lower() == domain.lower())
        if keys != want:
            raise ClauseViolation("API", f"list_domain({domain!r}) gives {keys}, "
                                         f"expected {want}")

    @invariant()
    def drained_means_empty(self) -> None:
        if self.model.entries or not hasattr(self, "store"):
            return
        fp = self._call("footprint", self.store.footprint)
        if fp.objects or fp.bytes:
            raise ClauseViolation("C8", f"every entry is cleaned up but {fp.objects} objects "
                                        f"and {fp.bytes} bytes remain")

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def lockstep_machine(factory: Factory | Backend | str, *, restarts: bool = False,
                     listing: bool = False) -> type[LockstepMachine]:
    """A LockstepMachine subclass bound to ``factory``."""
    backend = factory if isinstance(factory, Backend) else Backend.from_factory(factory)
    attrs = {"backend": backend, "restarts": restarts, "listing": listing, "last_log": []}
    name = "LockstepRestarts" if restarts else ("LockstepListing" if listing else "Lockstep")
    return type(name, (LockstepMachine,), attrs)


def run_lockstep(backend: Backend, profile: Profile, seed: int, *, check: str = "lockstep",
                 restarts: bool = False, listing: bool = False) -> list[Finding]:
    """Run the machine with the profile's settings from ``seed``; the findings of the
    failure found (shrunk to a minimal one when the profile says so).

    The scenario id is ``<check>:<profile>:seed=<seed>``; the same id runs the same
    examples again.
    """
    machine = lockstep_machine(backend, restarts=restarts, listing=listing)
    settings = Settings(profile.hypothesis_settings(), report_multiple_bugs=False)
    test = hypothesis_seed(seed)(get_state_machine_test(machine, settings=settings))
    scenario = f"{check}:{profile.name}:seed={seed}"
    try:
        test()
    except ClauseViolation as e:
        return [Finding(e.clause, e.detail, scenario, NO_CRASH, tuple(machine.last_log))]
    except Exception as e:  # the machine itself failed (setup, teardown)
        return [Finding("C9", f"{type(e).__name__}: {e}", scenario, NO_CRASH,
                        tuple(machine.last_log))]
    return []
