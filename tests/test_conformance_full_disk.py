"""The full-disk check: a real tmpfs of 4 MiB, mounted in a mount namespace of a child
process, fills up.  The project's backends pass it (those that cannot drain a full disk
say so in their limits and are judged by the rest); the reserve's two variants fail it
with C9; a backend whose errors on a full disk are not NoSpaceError fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks import full_disk_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from queue_ref.memory import MemoryStorage

BROKEN = "conformance.examples.broken_backends"


@pytest.mark.parametrize(("factory", "drains"), [
    ("conformance.examples.backends:fs", True),
    ("conformance.examples.backends:kv_log", True),
    ("conformance.examples.backends:kv_leveldb", False),
    ("conformance.examples.sqlite_backend:factory", False),
])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_projects_backends_pass(factory: str, drains: bool, seed: int) -> None:
    res = full_disk_check.run(Backend.from_factory(factory), seed)
    assert res.status is Status.PASS, res.findings
    rounds = {"space freed", "filled by another"} | (set(full_disk_check.DRAINING) if drains
                                                     else set())
    assert rounds <= set(res.stats)
    assert all(res.stats[r] >= 20 for r in rounds)  # each round stored mail before it filled
    assert ("cannot drain a full disk" in res.note) is not drains


@pytest.mark.parametrize(("variant", "round_"), [
    ("kv_log_reserve_too_small", "drained while full"),
    ("kv_log_reserve_kept_at_open", "filled by another"),
])
def test_a_reserve_that_cannot_drain_the_queue_is_c9(variant: str, round_: str) -> None:
    res = full_disk_check.run(Backend.from_factory(f"{BROKEN}:{variant}"), 1)
    assert res.status is Status.FAIL and {f.clause for f in res.findings} == {"C9"}
    assert any(f.detail.startswith(f"{round_}:") and "drainable" in f.detail
               for f in res.findings)
    assert full_disk_check.replay(Backend.from_factory(f"{BROKEN}:{variant}"),
                                  res.findings[0].scenario)


def test_a_full_disk_reported_as_another_error_is_c9() -> None:
    """The filesystem queue over a disk layer that turns ENOSPC into EIO: a full disk
    raises a plain StorageIOError (the operator looks for a failing disk)."""
    res = full_disk_check.run(Backend.from_factory(f"{BROKEN}:fs_full_disk_as_eio"), 1)
    assert res.status is Status.FAIL
    assert any(f.clause == "C9" and "not NoSpaceError" in f.detail for f in res.findings)


def test_a_backend_with_nothing_on_disk_is_unsupported() -> None:
    res = full_disk_check.run(Backend.from_factory(MemoryStorage), 1)
    assert res.status is Status.UNSUPPORTED


def test_without_unshare_the_check_is_an_error_that_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No tmpfs can be mounted: the check is not run, and says so; never a pass."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no unshare, no mount
    res = full_disk_check.run(Backend.from_factory("conformance.examples.backends:fs"), 1)
    assert res.status is Status.ERROR
    assert res.note == "not run: `unshare` (util-linux) is not installed"


def test_a_replay_names_its_scenario() -> None:
    with pytest.raises(ValueError, match="full-disk:<seed>"):
        full_disk_check.replay(Backend.from_factory("conformance.examples.backends:fs"),
                               "full-disk:x")


def test_a_queue_that_never_takes_mail_again_after_a_full_disk_is_c9() -> None:
    """The LevelDB queue whose spent reserve is never made again: restarted and drained,
    it still refuses new mail for a full disk."""
    res = full_disk_check.run(
        Backend.from_factory(f"{BROKEN}:kv_leveldb_reserve_spent_for_good"), 1)
    assert res.status is Status.FAIL
    assert any(f.clause == "C9" and "the drained queue still refuses new mail" in f.detail
               for f in res.findings), res.findings
