"""The second-open check: the queue opened again, here and in another process, while the
first open holds a claim.  The project's backends pass; a one-owner lock that a refused
second open in the same process lets go is caught."""

from __future__ import annotations

import pytest

from conformance.certify.scenario_replay import replay
from conformance.checks import second_open_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from queue_ref.memory import MemoryStorage

BROKEN = "conformance.examples.broken_backends"


@pytest.mark.parametrize("factory, refused", [
    ("conformance.examples.backends:fs", False),
    ("conformance.examples.backends:kv_log", True),
    ("conformance.examples.backends:kv_leveldb", True),
    ("conformance.examples.sqlite_backend:factory", None),
])
def test_the_projects_backends_pass(factory: str, refused: bool | None) -> None:
    res = second_open_check.run(Backend.from_factory(factory))
    assert res.status is Status.PASS, [f.detail for f in res.findings]
    if refused is not None:  # the filesystem queue is shared; a KV store has one owner
        assert res.stats == {"refused_here": int(refused), "refused_there": int(refused)}


def test_a_lock_a_refused_second_open_lets_go_is_c4() -> None:
    """POSIX record locks belong to the process, and closing any descriptor of the lock
    file drops them: a queue that refuses its second open in one process that way (as
    LevelDB's own LOCK does) lets another process open beside it, whose recovery
    requeues the entry being delivered."""
    broken = Backend.from_factory(f"{BROKEN}:kv_posix_lock_dropped")
    res = second_open_check.run(broken)
    assert res.status is Status.FAIL
    assert [f.clause for f in res.findings] == ["C4"]
    assert "another process" in res.findings[0].detail
    assert res.stats["refused_here"] == 1 and res.stats["refused_there"] == 0
    assert [f.clause for f in replay(broken, "second-open")] == ["C4"]


def test_a_queue_without_a_location_is_unsupported() -> None:
    assert second_open_check.run(Backend.from_factory(MemoryStorage)).status \
        is Status.UNSUPPORTED
