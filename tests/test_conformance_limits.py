"""The limits check: at and beyond the declared limits, invalid schedules."""

from __future__ import annotations

import tempfile

import pytest

from conformance.certify.scenario_replay import replay
from conformance.checks import limits_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from queue_ref.storage import InvalidInputError, Limits, Recipient, Schedule

BROKEN = "conformance.examples.broken_backends"


@pytest.mark.parametrize("factory", [
    "conformance.examples.backends:fs", "conformance.examples.backends:kv_log",
    "queue_ref.memory:MemoryStorage", f"{BROKEN}:fs_small_links"])
def test_the_real_queues_keep_their_limits(factory: str) -> None:
    res = limits_check.run(Backend.from_factory(factory))
    assert res.status is Status.PASS, res.findings
    assert "recipients-100000_seconds" in res.stats and "schedule_seconds" in res.stats


def test_the_queues_declare_their_limits() -> None:
    assert Backend.from_factory("queue_ref.memory:MemoryStorage").open(
        tempfile.mkdtemp()).limits == Limits()
    fs = Backend.from_factory(f"{BROKEN}:fs_small_links").open(tempfile.mkdtemp())
    try:
        assert fs.limits.max_recipients == 99
        with fs.enqueue("a@example.org") as enq, pytest.raises(InvalidInputError,
                                                               match="recipients"):
            enq.commit([Recipient(f"r{i}@example.net", Schedule(0)) for i in range(100)])
    finally:
        fs.close()


def test_a_commit_beyond_the_limit_without_the_count_check_is_c9() -> None:
    backend = Backend.from_factory(f"{BROKEN}:fs_unchecked_recipients")
    res = limits_check.run(backend)
    bad = {f.scenario for f in res.findings}
    assert bad == {"limits:recipients-100", "limits:recipients-10000",
                   "limits:recipients-100000"}
    assert {f.clause for f in res.findings} == {"C9"}
    assert all("StorageIOError" in f.detail for f in res.findings)
    again = replay(backend, "limits:recipients-100")
    assert [f.detail.split(":")[0] for f in again] == ["commit of 100 recipients (declared "
                                                       "limit 99) raised StorageIOError"]


def test_a_forged_schedule_accepted_by_reschedule_is_c9() -> None:
    backend = Backend.from_factory(f"{BROKEN}:kv_unchecked_schedule")
    found = replay(backend, "limits:schedule")
    assert found and found[0].clause == "C9"
    assert "reschedule to a schedule of negative time returned" in found[0].detail
