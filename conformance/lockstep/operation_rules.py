"""The lockstep machine's operations: enqueue, the transitions, reading, draining.

Every rule performs one operation on the backend and on the model and compares the
answers (``MachineBase._transition``).  A transition draws any live handle of the type it
takes, a stale one included (the entry has moved since it was listed): the model says
whether the operation moves the entry or vanishes, and the backend must agree.

``perform(name, data)`` runs the operation a rule of that name runs, drawing its
arguments from ``data``, and returns the model ``Call`` it made (None for an aborted
enqueue, which changes nothing); the crash rule uses it to crash inside any operation.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from conformance.harness.field_compare import meta_diff, schedule_diff
from conformance.harness.mail_data import (
    CORPUS_BODY,
    CORPUS_RCPTS,
    CORPUS_SCHEDULES,
    CORPUS_SENDER,
    MAX_SCHEDULE,
    fit_address,
)
from conformance.lockstep.machine_state import (
    BODY_SIZES,
    READ_CHUNKS,
    TAKES,
    ClauseViolation,
    EnqueueArgs,
    Held,
    MachineBase,
    body_bytes,
    enqueue_args,
    schedules,
)
from queue_ref.storage import (
    Handle,
    HeldMail,
    InflightMail,
    InvalidInputError,
    PendingCleanupMail,
    QueuedMail,
    Recipient,
    Schedule,
)
from spec.model import Call, EntryKey, finish_call, run
from spec.states import HOLD_OPS, TABLE, EntryState, Op

#: The operations the crash rule may crash inside, by rule name.
CRASHABLE = ("enqueue", "enqueue_aborted", *(op.value for op in TAKES), Op.SEND_FINISH.value,
             Op.CLEANUP_ALL.value)

BAD_INPUT = ("mail_from", "rcpt", "no-rcpts", "zone")


#: The message every example starts with: mail's data in each category the random draws
#: may miss on a given seed (``mail_corpus``).
CORPUS = EnqueueArgs(
    CORPUS_SENDER, (("ENVID", "corpus"),), (
        *(Recipient(a, sched, zone) for a, sched, zone in zip(
            CORPUS_RCPTS, CORPUS_SCHEDULES, ("z1", "default"), strict=True)),
        # a domain in UTF-8 and upper case with a trailing dot, due at the largest time
        Recipient("x@B\u00dcCHER.example.", Schedule(MAX_SCHEDULE, MAX_SCHEDULE), "z2"),
    ), len(CORPUS_BODY), 0, 7, CORPUS_BODY)


class Operations(MachineBase):
    # ---- enqueue -------------------------------------------------------------------------

    @initialize()
    def mail_corpus(self) -> None:
        """Every example starts with one message of mail's data (``CORPUS``): a sender
        and recipients that NFC or lower-casing would change, a domain with a trailing
        dot, schedules in the past, past 2038 and the largest, a reason with CRLF, and a
        body with dot lines, bare CR and LF, a NUL, a byte that is not UTF-8 and a final
        CRLF.  The listing and the read-backs of the first steps meet each of them, so a
        store that gets one wrong fails on every seed, not when the draws reach it."""
        self.log.append("corpus: one message of mail's data")
        self._enqueue(CORPUS)


    @rule(args=enqueue_args)
    def enqueue(self, args: EnqueueArgs) -> None:
        self._enqueue(args)

    def _enqueue(self, a: EnqueueArgs) -> Call:
        params = dict(a.params)
        body = a.body
        chunk = max(a.chunk, len(body) // 256)  # at most 256 writes
        # Addresses longer than the backend declares (Limits.max_address) are cut to it.
        limit = self.store.limits.max_address
        a = replace(a, mail_from=fit_address(a.mail_from, limit),
                    rcpts=tuple(replace(r, address=fit_address(r.address, limit))
                                for r in a.rcpts))
        rcpts = list(a.rcpts)
        shown = f"{a.size}B" if a.text is None else (repr(body) if a.size <= 80 else
                                                       f"{a.size}B ending {body[-12:]!r}")
        self.log.append(f"enqueue(from={a.mail_from!r}, params={params}, body={shown} in "
                        f"pieces of {chunk}, rcpts="
                        f"{[(r.address, r.schedule.at, r.schedule.attempts, r.zone) for r in rcpts]})")

        def go() -> list[QueuedMail]:
            enq = self.store.enqueue(a.mail_from, params or None)
            for i in range(0, len(body), chunk):
                enq.write(body[i:i + chunk])
            return enq.commit(rcpts)

        got: list[QueuedMail] = self._call("enqueue/commit", go, "commit")
        call = Call(Op.ENQUEUE, mail_from=a.mail_from, body=body,
                    rcpts=tuple((r.address, r.schedule) for r in rcpts))
        self.model, res = run(self.model, call)
        assert isinstance(res, int)
        mid = res
        if len(got) != len(rcpts):
            raise ClauseViolation("C2", f"commit of {len(rcpts)} recipients returned "
                                        f"{len(got)} handles")
        if len({h.entry_id for h in got}) != len(got) or len({h.message_id for h in got}) != 1:
            raise ClauseViolation("API", "commit returned handles with repeated entry ids or "
                                         "different message ids")
        if got[0].message_id in self.mids:
            old = self.mids[got[0].message_id]
            if self.model.entries_of(old):
                # The store gave a live message's id again: it no longer knows that
                # message (a commit it acknowledged is gone, after a crash that left it
                # undurable, say), or it hands out ids twice; either way the message
                # acknowledged under that id can no longer be told apart.
                raise ClauseViolation("C1", f"commit reused message id {got[0].message_id!r} "
                                            f"of message {old}, acknowledged and not finished "
                                            "in the model: the store lost it, or its ids "
                                            "repeat")
            raise ClauseViolation("API", f"commit reused message id {got[0].message_id!r}")
        self.mids[got[0].message_id] = mid
        self.params[mid] = params
        for i, h in enumerate(got):
            self._check_new_handle(h, i, rcpts, a.mail_from)
            self.keys[h.entry_id] = (mid, i)
            self.zone[(mid, i)] = rcpts[i].zone
            self.pool.append((h, (mid, i)))
        return call

    def _check_new_handle(self, h: QueuedMail, i: int, rcpts: list[Recipient],
                          mail_from: str) -> None:
        if type(h) is not QueuedMail:
            raise ClauseViolation("API", f"commit returned a {type(h).__name__}")
        if h.entry_id in self.keys:
            old = self.keys[h.entry_id]
            if self.model.state_of(old) is EntryState.GONE:
                raise ClauseViolation("C3", f"commit gave the new entry the id {h.entry_id} "
                                            f"of entry {old}, which is gone: the old entry "
                                            "reappears by its id")
            raise ClauseViolation("API", f"commit reused entry id {h.entry_id} of the live "
                                         f"entry {old}")
        diff = schedule_diff(h.schedule, rcpts[i].schedule)
        if diff is not None:
            raise ClauseViolation("C5", f"commit returned for recipient {i} a handle whose "
                                        f"{diff}")
        for addr in {*(r.address for r in rcpts), mail_from} - {""}:
            if addr in h.entry_id or addr in h.message_id:
                raise ClauseViolation("API", f"an id was built from the address {addr!r}")

    @rule(size=st.sampled_from(BODY_SIZES), body_seed=st.integers(0, 2**32))
    def enqueue_aborted(self, size: int, body_seed: int) -> None:
        self._enqueue_aborted(size, body_seed)

    def _enqueue_aborted(self, size: int, body_seed: int) -> None:
        self.log.append(f"enqueue(body={size}B) then abort")

        def go() -> None:
            enq = self.store.enqueue("aborted@example.org")
            enq.write(body_bytes(body_seed, size))
            enq.abort()

        self._call("enqueue/abort", go)

    @rule(case=st.sampled_from(BAD_INPUT), chunks=st.lists(st.binary(max_size=300), max_size=3))
    def enqueue_bad_input(self, case: str, chunks: list[bytes]) -> None:
        """Malformed input raises InvalidInputError and stores nothing (the invariant)."""
        self.log.append(f"enqueue with a bad {case}")
        good = Recipient("bob@example.net", Schedule(0))
        rcpts = {
            "mail_from": [good],
            "rcpt": [good, Recipient("evil\r\nRCPT TO:<x@y>", Schedule(0))],
            "no-rcpts": [],
            "zone": [Recipient("bob@example.net", Schedule(0), "a\x00b")],
        }[case]
        sender = "nul\x00@x" if case == "mail_from" else "a@b"
        try:
            with self.store.enqueue(sender) as enq:
                for c in chunks:
                    enq.write(c)
                enq.commit(rcpts)
        except InvalidInputError:
            return
        except Exception as e:
            raise ClauseViolation("C9", f"an enqueue with a bad {case} raised "
                                        f"{type(e).__name__}: {e}, not InvalidInputError") from e
        raise ClauseViolation("C9", f"an enqueue with a bad {case} was committed")

    # ---- transitions -------------------------------------------------------------------

    def _act(self, data: st.DataObject, op: Op, schedule: Schedule | None = None) -> Call:
        h, key = self._draw(data, TAKES[op])
        return self._do(op, h, key, schedule)

    def _do(self, op: Op, h: Handle, key: EntryKey, schedule: Schedule | None = None) -> Call:
        """``op`` on the entry ``key`` through the handle ``h``, on the backend and the
        model, the answers compared."""
        stale = self.model.state_of(key) is not TABLE[op].source
        to = "" if schedule is None else (f" to at={schedule.at}, attempts={schedule.attempts}, "
                                          f"reason={schedule.reason[:40]!r}")
        self.log.append(f"{op.value}{key}{to}" + (" through a stale handle" if stale else ""))
        fn = getattr(self.store, op.value)
        got = self._call(op.value, lambda: fn(h) if schedule is None else fn(h, schedule),
                         op.value)
        self._transition(op, key, h, got, schedule)
        return Call(op, key, schedule)

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data())
    def send_start(self, data: st.DataObject) -> None:
        self._act(data, Op.SEND_START)

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data(), schedule=schedules)
    def reschedule(self, data: st.DataObject, schedule: Schedule) -> None:
        self._act(data, Op.RESCHEDULE, schedule)

    @precondition(lambda self: self._has(QueuedMail))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self._act(data, Op.DROP)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data(), schedule=schedules)
    def send_cancel(self, data: st.DataObject, schedule: Schedule) -> None:
        self._act(data, Op.SEND_CANCEL, schedule)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data())
    def send_done(self, data: st.DataObject) -> None:
        self._act(data, Op.SEND_DONE)

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data())
    def send_finish(self, data: st.DataObject) -> None:
        self._finish(data)

    def _finish(self, data: st.DataObject) -> Call:
        """``send_finish`` of some INFLIGHT entries (C15), each done or cancelled with a
        drawn schedule, through any handle the pool holds of it (a stale one included):
        each answer compared as its own call's, the model folding the steps in order."""
        keys = sorted({k for h, k in self.pool if type(h) is InflightMail})
        chosen = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys),
                                    unique=True))
        parts: list[tuple[Op, Handle, EntryKey, Schedule | None]] = []
        for key in chosen:
            held = [x for x in self.pool if type(x[0]) is InflightMail and x[1] == key]
            h, _ = held[data.draw(st.integers(0, len(held) - 1))]
            self.pool.remove((h, key))
            cancel = data.draw(st.booleans())
            parts.append((Op.SEND_CANCEL if cancel else Op.SEND_DONE, h, key,
                          data.draw(schedules) if cancel else None))
        done = [x for x in parts if x[0] is Op.SEND_DONE]
        back = [x for x in parts if x[0] is Op.SEND_CANCEL]
        self.log.append("send_finish(" + "; ".join(
            f"{op.value}{key}" + ("" if s is None else f" to at={s.at}, attempts={s.attempts}")
            for op, _, key, s in [*done, *back]) + ")")
        got = self._call("send_finish", lambda: self.store.send_finish(
            [h for _, h, _, _ in done],
            [(h, s) for _, h, _, s in back if s is not None]), "send_finish")
        if len(got.done) != len(done) or len(got.cancelled) != len(back):
            raise ClauseViolation("API", f"send_finish answered {len(got.done)} and "
                                         f"{len(got.cancelled)} results for {len(done)} "
                                         f"and {len(back)}")
        for (op, h, key, s), answer in zip([*done, *back], [*got.done, *got.cancelled],
                                           strict=True):
            self._transition(op, key, h, answer, s)
        return finish_call([Call(op, key, s) for op, _, key, s in [*done, *back]])

    @precondition(lambda self: self._has(PendingCleanupMail))
    @rule(data=st.data())
    def cleanup(self, data: st.DataObject) -> None:
        self._act(data, Op.CLEANUP)

    @precondition(lambda self: self._has(PendingCleanupMail))
    @rule(data=st.data())
    def cleanup_all(self, data: st.DataObject) -> None:
        self._cleanup_all(data)

    def _cleanup_all(self, data: st.DataObject) -> Call:
        """``cleanup_all`` of some PENDING_CLEANUP entries (C16), each through any handle
        the pool holds of it (a stale one included): each answer compared as its own
        ``cleanup``'s, the model folding the steps in order."""
        keys = sorted({k for h, k in self.pool if type(h) is PendingCleanupMail})
        chosen = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys),
                                    unique=True))
        parts: list[tuple[Handle, EntryKey]] = []
        for key in chosen:
            held = [x for x in self.pool if type(x[0]) is PendingCleanupMail and x[1] == key]
            h, _ = held[data.draw(st.integers(0, len(held) - 1))]
            self.pool.remove((h, key))
            parts.append((h, key))
        self.log.append("cleanup_all(" + "; ".join(f"cleanup{key}" for _, key in parts) + ")")
        got = self._call("cleanup_all", lambda: self.store.cleanup_all(
            [h for h, _ in parts]), "cleanup_all")
        if not isinstance(got, list) or len(got) != len(parts):
            raise ClauseViolation("API", f"cleanup_all answered {got!r} for {len(parts)} "
                                         "entries")
        for (h, key), answer in zip(parts, got, strict=True):
            self._transition(Op.CLEANUP, key, h, answer, None)
        return finish_call([Call(Op.CLEANUP, key) for _, key in parts], Op.CLEANUP_ALL)

    @precondition(lambda self: self.holds and self._has(QueuedMail))
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        self._act(data, Op.HOLD)

    @precondition(lambda self: self.holds and self._has(HeldMail))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._act(data, Op.RELEASE)

    @precondition(lambda self: self.holds and self._has(HeldMail))
    @rule(data=st.data())
    def drop_held(self, data: st.DataObject) -> None:
        self._act(data, Op.DROP_HELD)

    # ---- any of them, for the crash rule --------------------------------------------------

    def can_perform(self, name: str) -> bool:
        if name in ("enqueue", "enqueue_aborted"):
            return True
        if name == Op.SEND_FINISH.value:
            return self._has(InflightMail)
        if name == Op.CLEANUP_ALL.value:
            return self._has(PendingCleanupMail)
        if Op(name) in HOLD_OPS and not self.holds:
            return False
        return self._has(TAKES[Op(name)])

    def perform(self, name: str, data: st.DataObject) -> Call | None:
        if name == "enqueue":
            return self._enqueue(data.draw(enqueue_args))
        if name == "enqueue_aborted":
            self._enqueue_aborted(data.draw(st.sampled_from(BODY_SIZES)),
                                  data.draw(st.integers(0, 2**32)))
            return None
        op = Op(name)
        if op is Op.SEND_FINISH:
            return self._finish(data)
        if op is Op.CLEANUP_ALL:
            return self._cleanup_all(data)
        return self._act(data, op, data.draw(schedules) if TABLE[op].changes_schedule else None)

    # ---- reading and draining ----------------------------------------------------------

    @precondition(lambda self: self._has(InflightMail))
    @rule(data=st.data(), chunk=st.sampled_from(READ_CHUNKS))
    def read_inflight(self, data: st.DataObject, chunk: int) -> None:
        """The body comes back byte for byte, in reads of ``chunk`` bytes (at least 1/256
        of the body, to bound the number of reads), and the metadata is the committed one.
        Reading does not consume the handle."""
        held = self._draw(data, InflightMail)
        self.pool.append(held)
        h, key = held
        assert isinstance(h, InflightMail)
        msg = self.model.messages[key[0]]
        n = chunk if chunk < 0 else max(chunk, len(msg.body) // 256)
        self.log.append(f"read_inflight{key} in reads of {n}")

        def go() -> tuple[object, bytes]:
            with self.store.read_inflight(h) as r:
                parts = []
                while True:
                    b = r.read(n)
                    if not b:
                        break
                    parts.append(b)
                return r.meta, b"".join(parts)

        meta, body = self._call("read_inflight", go)
        diff = meta_diff(meta, self.want_meta(key, h))
        if diff is not None:
            raise ClauseViolation("C6", f"read_inflight{key}: {diff}")
        if body != msg.body:
            raise ClauseViolation("C6", f"read_inflight{key} returned {len(body)} bytes that "
                                        f"differ from the {len(msg.body)} committed")

    @rule()
    def drain(self) -> None:
        """Two workers empty the queue: one lists it, the other claims through every
        QueuedMail held; the first then claims through its listed handles (an entry the
        other claimed must vanish).  Everything is sent and cleaned up through every
        handle held; afterwards nothing may be stored (the invariant)."""
        self.log.append("drain: list, claim through every handle held, then through the "
                        "listed ones; send and clean up all")
        listed: list[Held] = [(q, self._key(q))
                              for q in self._compare_listing("while draining")]
        for op, cls in ((Op.SEND_START, QueuedMail), (Op.SEND_DONE, InflightMail),
                        (Op.CLEANUP, PendingCleanupMail)):
            held = [x for x in self.pool if type(x[0]) is cls]
            self.pool = [x for x in self.pool if type(x[0]) is not cls]
            for h, key in held + (listed if op is Op.SEND_START else []):
                got = self._call(op.value, partial(getattr(self.store, op.value), h),
                                 op.value)
                self._transition(op, key, h, got, None)
