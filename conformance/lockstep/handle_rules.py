"""The lockstep machine's listings and handle discipline.

Listings (``list_queue``, ``find_pending_cleanup``, and with ``listing`` the zone and
domain listings a backend declares) must agree with the model, and add second handles to
entries: the first one's next transition then vanishes once the entry has moved.

Misuse: a consumed handle, a live handle passed to an operation of another state, and a
handle of another Storage or of this queue before a restart must all raise MisuseError
(C9), and a wrong-type call leaves the handle usable.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from conformance.lockstep.machine_state import DOMAINS, TAKES, ZONES, ClauseViolation, MachineBase
from queue_ref.storage import (
    Capability,
    Handle,
    HeldMail,
    InflightMail,
    QueuedMail,
    Recipient,
    Schedule,
)
from spec.states import TABLE, EntryState

#: How the list_domain rule spells the domains the model holds.
DOMAIN_FORMS = ("as committed", "upper", "lower")


class HandleRules(MachineBase):
    # ---- listings --------------------------------------------------------------------------

    @rule()
    def list_queue(self) -> None:
        self.log.append("list_queue()")
        for h in self._compare_listing("now"):
            self._keep(h, self._key(h))

    @precondition(lambda self: self.holds)
    @rule()
    def list_held(self) -> None:
        self.log.append("list_held()")
        for h in self._compare_held("now"):
            self._keep(h, self._key(h))

    @rule()
    def scan_queue(self) -> None:
        """``scan_queue`` gives the model's QUEUED and HELD entries, each once, as the
        handle of its state with its schedule (C13), in any order."""
        self.log.append("scan_queue()")
        got = self._call("scan_queue", lambda: list(self.store.scan_queue()))
        keys = [self._key(h) for h in got]
        queued = set(self.model.keys_in(EntryState.QUEUED))
        held = set(self.model.keys_in(EntryState.HELD))
        if len(set(keys)) != len(keys) or set(keys) != queued | held:
            raise ClauseViolation("C13", f"scan_queue gives {sorted(keys)}, expected "
                                         f"{sorted(queued | held)}")
        for h, k in zip(got, keys, strict=True):
            kind = QueuedMail if k in queued else HeldMail
            if type(h) is not kind:
                raise ClauseViolation("C13", f"scan_queue gives {k} as a {type(h).__name__}, "
                                             f"but it is {kind.__name__[:-4].upper()}")
        self._compare_schedules("scan_queue", "C5", got, keys)
        for h, k in zip(got, keys, strict=True):
            self._keep(h, k)

    @rule()
    def find_pending_cleanup(self) -> None:
        self.log.append("find_pending_cleanup()")
        for h in self._compare_pending("now"):
            self._keep(h, self._key(h))

    @precondition(lambda self: self.listing
                  and Capability.ZONE_LISTING in self.store.capabilities)
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
        self._compare_schedules(f"list_zone({zone!r})", "C5", got, keys)
        for h, key in zip(got, keys, strict=True):
            self._keep(h, key)

    @precondition(lambda self: self.listing
                  and Capability.DOMAIN_INDEX in self.store.capabilities)
    @rule(domain=st.sampled_from(DOMAINS), form=st.sampled_from(DOMAIN_FORMS))
    def list_domain(self, domain: str, form: str) -> None:
        """``list_domain`` of ``domain``, then of every domain of a recipient the model
        holds (at most 12), each in ``form``: as committed, upper- or lower-cased.  The
        contract compares domains lower-cased (``str.lower``), the part after the last
        ``@`` (the whole address when it has none), and nothing else: ``a.example.`` is
        not ``a.example``.  Each must list exactly the model's QUEUED entries there, with
        their schedules."""
        present = self._domains_held(every=True)
        shaped = [d if form == "as committed" else d.upper() if form == "upper" else d.lower()
                  for d in present]
        self.log.append(f"list_domain of {domain!r} and of {len(shaped)} domains held, "
                        f"{form}")
        self._compare_domains([domain, *shaped], "now")

    # ---- misuse ------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.spent))
    @rule(data=st.data())
    def misuse_consumed_handle(self, data: st.DataObject) -> None:
        """A consumed handle, passed to any operation of its state (and to read_inflight)."""
        op, h = data.draw(st.sampled_from(self.spent))
        self._misuse(data, h, f"the handle of {h.entry_id} consumed by {op}", same_type=True)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def misuse_wrong_type(self, data: st.DataObject) -> None:
        """A live handle passed to an operation of another state; it stays usable."""
        h, _ = data.draw(st.sampled_from(self.pool))
        self._misuse(data, h, f"a live {type(h).__name__} of {h.entry_id}", same_type=False)

    @rule(data=st.data())
    def misuse_foreign_handle(self, data: st.DataObject) -> None:
        """A handle of another Storage, or of this queue before a restart or a crash."""
        with self._other().enqueue("a@b") as enq:
            (mine,) = enq.commit([Recipient("c@d", Schedule(0))])
        h = data.draw(st.sampled_from([mine, *self.foreign[-5:]]))
        what = "another Storage's handle" if h is mine else \
            f"the handle of {h.entry_id} from before a restart"
        self._misuse(data, h, what, same_type=True)

    def _misuse(self, data: st.DataObject, h: Handle, what: str, *, same_type: bool) -> None:
        ops = [op for op in self._ops() if (TAKES[op] is type(h)) == same_type]
        op = data.draw(st.sampled_from(ops))
        self.log.append(f"{op.value} through {what}")
        fn = getattr(self.store, op.value)
        self._expect_misuse(f"{op.value} through {what}",
                            lambda: fn(h, Schedule(1)) if TABLE[op].changes_schedule else fn(h))
        if same_type and type(h) is InflightMail:
            self._expect_misuse(f"read_inflight through {what}",
                                lambda: self.store.read_inflight(h))
