"""Hold (C14, ``Capability.HOLD``): a held entry is never claimed, keeps its schedule,
survives reopening, and comes back with that schedule when released.

One deterministic scenario (``hold:<step>`` names the step a finding comes from):

1. four messages (one of two recipients) are committed; a second handle of each entry
   is listed (the stale handle of a second worker);
2. two entries are held: ``hold`` returns a HeldMail with the entry's schedule;
3. ``list_queue`` (and ``list_zone``/``list_domain`` where declared) no longer shows
   them, ``list_held`` shows exactly them with their schedules;
4. through the stale queued handles, ``send_start``, ``reschedule`` and ``drop`` of a
   held entry return None (a held entry is never claimed or changed);
5. the queue is closed and opened again (for backends kept in a directory): the held
   entries are still held with their schedules, the others queued;
6. ``release`` returns the schedule the entry had; a second release through a stale
   HeldMail returns None; ``drop_held`` retires the other one for good (cleanup, then
   it is never listed again, after another reopening too).

Crashes inside hold, release and drop_held are explored by the crash exploration (for
backends with the I/O seam) and the lockstep machine's crash rule, both of which run
the hold operations for a backend that declares the capability.
"""

from __future__ import annotations

import shutil
import tempfile
import time

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.field_compare import same_value, schedule_diff
from conformance.harness.mail_data import REASON_EXAMPLES
from queue_ref.storage import (
    MAX_SCHEDULE,
    Capability,
    HeldMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
)

CHECK = "hold"
#: The messages' schedule times: the past, 2038, beyond 32 bits, the largest (the second
#: recipient of the first message is one later); each message's reason is one of
#: ``mail_data``'s of MAX_REASON octets, so every schedule listed is compared field by
#: field (``field_compare``) with what was committed.
HOLD_TIMES = (0, 2**31 - 1, 2**32, MAX_SCHEDULE - 1)


class _Scenario:
    def __init__(self, backend: Backend, root: str) -> None:
        self.backend = backend
        self.root = root
        self.findings: list[Finding] = []
        self.step = "setup"
        self.store: Storage = backend.open(root)

    def fail(self, detail: str, clause: str = "C14") -> None:
        self.findings.append(Finding(clause, detail, f"{CHECK}:{self.step}", NO_CRASH))

    def reopen(self) -> bool:
        if not self.backend.takes_root:
            return False
        self.store.close()
        self.store = self.backend.open(self.root)
        return True

    def listed(self) -> tuple[dict[str, Schedule], dict[str, Schedule]]:
        q = {h.entry_id: h.schedule for h in self.store.list_queue()}
        held = {h.entry_id: h.schedule for h in self.store.list_held()}
        return q, held

    def expect_state(self, queued: dict[str, Schedule], held: dict[str, Schedule],
                     when: str) -> None:
        got_q, got_h = self.listed()
        if not same_value(got_h, held):
            self.fail(f"{when}: list_held gives {sorted(got_h.items())}, expected "
                      f"{sorted(held.items())}")
        if not same_value(got_q, queued):
            clause = "C14" if set(got_q) & set(held) else "C1"
            self.fail(f"{when}: list_queue gives {sorted(got_q.items())}, expected "
                      f"{sorted(queued.items())}", clause)

    def run(self) -> None:
        s = self.store
        self.step = "commit"
        handles: list[QueuedMail] = []
        for i in range(4):
            with s.enqueue(f"sender{i}@example.org") as enq:
                enq.write(b"Subject: hold %d\r\n\r\nbody\r\n" % i)
                n = 2 if i == 0 else 1
                handles += enq.commit([Recipient(f"r{j}@hold{i % 2}.example",
                                                 Schedule(HOLD_TIMES[i] + j, i,
                                                          REASON_EXAMPLES[i + 1]), f"z{i % 2}")
                                       for j in range(n)])
        stale = {h.entry_id: h for h in s.list_queue()}
        sched = {h.entry_id: h.schedule for h in handles}
        a, b = handles[0], handles[2]  # one entry of the two-recipient message, one alone

        self.step = "hold"
        held: dict[str, HeldMail] = {}
        for h in (a, b):
            got = s.hold(h)
            if not isinstance(got, HeldMail):
                self.fail(f"hold of the queued entry {h.entry_id} returned {got!r}")
                return
            if schedule_diff(got.schedule, sched[h.entry_id]) is not None:
                self.fail(f"hold of {h.entry_id} returned schedule {got.schedule}, the "
                          f"entry had {sched[h.entry_id]}")
            held[h.entry_id] = got
        queued = {k: v for k, v in sched.items() if k not in held}
        held_sched = {k: sched[k] for k in held}

        self.step = "listings"
        self.expect_state(queued, held_sched, "after two holds")
        if Capability.DOMAIN_INDEX in s.capabilities:
            for d in ("hold0.example", "hold1.example"):
                shown = {h.entry_id for h in s.list_domain(d)} & set(held)
                if shown:
                    self.fail(f"list_domain({d!r}) lists the held entries {sorted(shown)}")
        if Capability.ZONE_LISTING in s.capabilities:
            for z in ("z0", "z1"):
                shown = {h.entry_id for h in s.list_zone(z)} & set(held)
                if shown:
                    self.fail(f"list_zone({z!r}) lists the held entries {sorted(shown)}")

        self.step = "stale-claim"
        for eid in held:
            got_start = s.send_start(stale.pop(eid))
            if got_start is not None:
                self.fail(f"send_start through a stale handle claimed the held entry {eid}")
                return
        self.expect_state(queued, held_sched, "after claims of held entries")

        self.step = "reopen"
        if self.reopen():
            s = self.store
            self.expect_state(queued, held_sched, "after reopening")
            fresh = {h.entry_id: h for h in s.list_held()}
            held = {k: fresh[k] for k in held if k in fresh}
            if len(held) != 2:
                return

        self.step = "release"
        ha, hb = held[a.entry_id], held[b.entry_id]
        second = next((h for h in s.list_held() if h.entry_id == a.entry_id), None)
        back = s.release(ha)
        if not isinstance(back, QueuedMail) or schedule_diff(back.schedule, sched[a.entry_id]):
            self.fail(f"release of {a.entry_id} returned {back!r}, expected a QueuedMail "
                      f"with schedule {sched[a.entry_id]}")
            return
        if second is not None and s.release(second) is not None:
            self.fail(f"a second release of {a.entry_id} through a stale handle acted")
        p = s.drop_held(hb)
        if p is None:
            self.fail(f"drop_held of the held entry {b.entry_id} returned None")
            return
        s.cleanup(p)
        queued[a.entry_id] = sched[a.entry_id]
        del held_sched[a.entry_id], held_sched[b.entry_id]
        self.expect_state(queued, held_sched, "after release and drop_held")
        self.step = "reopen-after-release"
        if self.reopen():
            self.expect_state(queued, held_sched, "after reopening again")
            if b.entry_id in {h.entry_id for h in self.store.find_pending_cleanup()}:
                self.fail(f"{b.entry_id} is pending cleanup again after its cleanup", "C3")


def run(backend: Backend) -> CheckResult:
    start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="queue-ref-hold-")
    sc = None
    try:
        sc = _Scenario(backend, root)
        try:
            sc.run()
        except Exception as e:
            sc.fail(f"{type(e).__name__}: {e}", "C9")
        finally:
            sc.store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return finished(CHECK, NO_CRASH, sc.findings if sc else [],
                    seconds=time.perf_counter() - start, scenarios=[f"{CHECK}:scenario"])
