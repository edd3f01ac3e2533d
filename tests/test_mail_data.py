"""The lockstep's mail data (``conformance/harness/mail_data.py``) and what it catches.

* every generated address and schedule is one the contract allows, and the limits are
  reached (a 64-octet local part, a 255-octet domain, an address of MAX_ADDRESS
  characters, the largest schedule, a reason of MAX_REASON octets);
* what the contract refuses is refused with InvalidInputError by the project's backends
  (memory, filesystem, KV log), and nothing is stored: the listing, the held schedule
  and ``footprint()`` are those of before;
* each broken variant of ``conformance/examples/broken_mail_data.py`` fails its check
  (the lockstep, or the listing check) on seeds 1-3 of the quick profile (as
  ``queue-ref certify --seed N`` derives the check's seed from them), with the
  clause ``docs/certify.md`` names; the project's backends pass the same machine in
  ``tests/test_lockstep.py``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.certify.suite_runner import check_seed
from conformance.examples import broken_mail_data
from conformance.harness.backend_factory import Backend
from conformance.harness.mail_data import (
    EXAMPLES,
    MAX_DOMAIN,
    MAX_LOCAL,
    REASON_EXAMPLES,
    addresses,
    refused_addresses,
    refused_schedules,
    schedules,
)
from conformance.harness.suite_profiles import get as get_profile
from conformance.lockstep import run_lockstep
from queue_ref.fsqueue import FsQueue
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    MAX_ADDRESS,
    MAX_REASON,
    MAX_SCHEDULE,
    InvalidInputError,
    Recipient,
    Schedule,
    Storage,
    validate_address,
    validate_schedule,
)

OPENERS: dict[str, Callable[[str], Storage]] = {
    "memory": lambda root: MemoryStorage(),
    "fsqueue": FsQueue,
    "kv-log": KvQueue.open_log,
}


@given(addresses, schedules)
def test_generated_data_is_within_the_contract(address: str, schedule: Schedule) -> None:
    assert validate_address(address, "address") == address
    assert validate_schedule(schedule) == schedule


def test_the_examples_reach_every_limit() -> None:
    locals_ = [a.rpartition("@")[0] for a in EXAMPLES]
    domains = [a.rpartition("@")[2] for a in EXAMPLES]
    assert MAX_LOCAL in {len(x.encode()) for x in locals_}  # RFC 5321, in ASCII and UTF-8
    assert len([x for x in locals_ if len(x.encode()) == MAX_LOCAL]) == 2
    assert max(len(x.encode()) for x in domains) == MAX_DOMAIN
    assert max(len(a) for a in EXAMPLES) == MAX_ADDRESS
    assert max(len(Schedule(0, 0, r).reason.encode()) for r in REASON_EXAMPLES) == MAX_REASON
    assert Schedule(MAX_SCHEDULE, MAX_SCHEDULE) == validate_schedule(
        Schedule(MAX_SCHEDULE, MAX_SCHEDULE))


def _refuses(what: str, fn: Callable[[], object]) -> None:
    with pytest.raises(InvalidInputError):
        fn()
        raise AssertionError(f"{what} was accepted")


@pytest.mark.parametrize("backend", sorted(OPENERS))
@given(case=st.sampled_from(("recipient", "sender", "commit schedule", "reschedule",
                             "send_cancel")),
       address=st.one_of(st.just(""), refused_addresses), schedule=refused_schedules)
def test_what_the_contract_refuses_is_refused_and_not_stored(
        backend: str, case: str, address: object, schedule: Schedule) -> None:
    """One good message is queued; then a refused address (as a recipient or a sender)
    or a refused schedule (in a commit, a reschedule, a send_cancel) must raise
    InvalidInputError, and the queue must list what it listed, with the same schedule,
    and hold the same footprint."""
    root = tempfile.mkdtemp(prefix="queue-ref-refused-")
    try:
        with OPENERS[backend](root) as store:
            with store.enqueue("s@a.example") as enq:
                enq.write(b"body\r\n")
                (first,) = enq.commit([Recipient("Rcpt@a.example", Schedule(5, 1, "r"))])
            claimed = store.send_start(first) if case == "send_cancel" else None
            before = store.footprint()
            if case == "recipient":
                with store.enqueue("s@a.example") as enq:
                    enq.write(b"x")
                    _refuses(f"recipient {address!r}",
                             lambda: enq.commit([Recipient(address, Schedule(0))]))  # type: ignore[arg-type]
            elif case == "sender" and address != "":
                def send() -> None:
                    with store.enqueue(address) as enq:  # type: ignore[arg-type]
                        enq.write(b"x")
                        enq.commit([Recipient("r@a.example", Schedule(0))])
                _refuses(f"sender {address!r}", send)
            elif case == "commit schedule":
                with store.enqueue("s@a.example") as enq:
                    _refuses(f"commit with {schedule!r}", lambda: enq.commit(
                        [Recipient("r@a.example", schedule)]))
            elif case == "reschedule":
                _refuses(f"reschedule to {schedule!r}",
                         lambda: store.reschedule(first, schedule))
            elif case == "send_cancel":
                assert claimed is not None
                _refuses(f"send_cancel with {schedule!r}",
                         lambda: store.send_cancel(claimed, schedule))
            assert store.footprint() == before
            if claimed is not None:
                back = store.send_cancel(claimed, Schedule(5, 1, "r"))
                assert back is not None, "the refused send_cancel consumed the claim"
            listed = list(store.list_queue())
            assert [(h.entry_id, h.schedule) for h in listed] == [
                (first.entry_id, Schedule(5, 1, "r"))]
    finally:
        shutil.rmtree(root, ignore_errors=True)


#: Each broken variant, the check that catches it, and the clauses it may be caught on.
CAUGHT = {
    "fs_local_part_lowered": ("lockstep", {"C6"}),
    "kv_addresses_nfc": ("lockstep", {"C6"}),
    "fs_far_future_unlisted": ("lockstep", {"API"}),
    "kv_domain_trailing_dot": ("listing", {"API"}),
    "fs_body_final_crlf_stripped": ("lockstep", {"C6"}),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("variant", sorted(CAUGHT))
def test_each_broken_variant_fails_its_check(variant: str, seed: int) -> None:
    check, clauses = CAUGHT[variant]
    backend = Backend.from_factory(getattr(broken_mail_data, variant), variant)
    findings = run_lockstep(backend, get_profile("quick"), check_seed(seed, check),
                            check=check, listing=check == "listing")
    assert findings, f"{variant} passed the {check} check on seed {seed}"
    assert findings[0].clause in clauses, findings[0]
