"""The model and each of the project's backends in lockstep: the conformance suite's machine.

``conformance.lockstep`` holds the machine (``queue-ref certify`` runs the same one); here
are the project's backends and which rules each takes:

* the restart rule (close, reopen: the backend lists ``model.restart()``) for every
  backend but ``memory``, which keeps nothing across close;
* the crash rule (crash inside the next operation under a persistence model, recover,
  judge, go on) for the backends that declare the I/O seam: ``fsqueue`` (in its default
  sync mode, and in ``fsync`` mode) and ``kv-log``,
  whose test ids say ``Crashes``.  ``memory`` and ``kv-leveldb`` declare no seam and skip
  only that rule (the hypothesis precondition; each class's docstring says so).

Sizes come from the hypothesis profile in ``tests/conftest.py``.  The last test runs the
crash rule on a filesystem queue that leaves out the directory fsync after its commit
rename, and must catch it.
"""

from __future__ import annotations

import unittest

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.crashexplore.broken_fs_variants import NoCommitDirFsync
from conformance.crashexplore.explored_backends import _owners_on_disk, jumpy_clock
from conformance.harness.backend_factory import Backend, Factory
from conformance.lockstep import ClauseViolation, lockstep_machine
from queue_ref.fsqueue import FsQueue
from queue_ref.io import IO
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.memory import MemoryStorage
from queue_ref.storage import Storage


def _fsqueue(root: str, io: IO) -> Storage:
    return FsQueue(root, io)


def _fsqueue_fsync(root: str, io: IO) -> Storage:
    return FsQueue(root, io, sync="fsync")


def _kv_log(root: str, io: IO) -> Storage:
    return KvQueue.open_log(root, io)


#: Every backend of the project, by name: factory(root, io) for those that run through
#: the I/O seam, factory(root) or factory() for the others.
BACKENDS: dict[str, Factory] = {
    "memory": MemoryStorage,
    "fsqueue": _fsqueue,
    "fsqueue-fsync": _fsqueue_fsync,
    "kv-log": _kv_log,
    "kv-leveldb": KvQueue.open_leveldb,
}


def lockstep(name: str, *, restarts: bool = True) -> type[unittest.TestCase]:
    """The TestCase of the machine on ``BACKENDS[name]``, every rule the backend allows."""
    machine = lockstep_machine(Backend.from_factory(BACKENDS[name], name), restarts=restarts,
                               listing=True, crashes=True)
    case = machine.TestCase
    case.__doc__ = machine.__doc__
    return case


TestLockstepMemory = lockstep("memory", restarts=False)  # no seam: no crash rule
TestLockstepFsqueueCrashes = lockstep("fsqueue")
TestLockstepFsqueueFsyncCrashes = lockstep("fsqueue-fsync")
TestLockstepKvLogCrashes = lockstep("kv-log")
TestLockstepKvLeveldb = lockstep("kv-leveldb")  # no seam: no crash rule


#: The owner token last given to each queue directory by ``_no_commit_dir_fsync``.
_LAST_OWNER: dict[str, int] = {}


def _no_commit_dir_fsync(root: str, io: IO) -> Storage:
    """``deterministic_fs(NoCommitDirFsync)`` whose owner token never repeats in one
    directory: a drained queue keeps no owner's name on disk, so the directory alone
    would give a restarted queue its predecessor's token, and its message ids again
    (which the lockstep refuses: a commit never reuses a message id)."""
    owner = max([*_owners_on_disk(root), _LAST_OWNER.get(root, 0)]) + 1
    _LAST_OWNER[root] = owner
    return NoCommitDirFsync(root, io, owner=f"{owner:016x}", clock=jumpy_clock())


class _FinishKeepsOldSchedules(FsQueue):
    """A send_finish that requeues its cancelled entries with the schedules they had: the
    attempt count and reason of the failed delivery are lost (C5)."""

    def send_finish(self, done=(), cancel=()):  # type: ignore[no-untyped-def]
        return super().send_finish(done, [(h, h.schedule) for h, _ in cancel])


def _lockstep_violation(cls: type[FsQueue], name: str) -> ClauseViolation:
    """What the lockstep finds in a broken filesystem queue (derandomized: the same on
    every run)."""
    machine = lockstep_machine(Backend.from_factory(lambda root, io: cls(root, io), name))
    with pytest.raises(ClauseViolation) as info:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=400, stateful_step_count=30, derandomize=True, database=None,
            phases=[Phase.explicit, Phase.generate], deadline=None, print_blob=False,
            suppress_health_check=list(HealthCheck)))
    return info.value


def test_send_finish_rule_compares_each_step_with_the_model() -> None:
    """The lockstep's send_finish rule folds the steps into the model and compares every
    answer: a batch that keeps the old schedules is C5 on its first cancelled step."""
    found = _lockstep_violation(_FinishKeepsOldSchedules, "fs-finish-keeps-old-schedules")
    assert found.clause == "C5", found
    assert "send_cancel" in found.detail


class _CleanupAllKeepsFiles(FsQueue):
    """A cleanup_all that never looks at the message file's link count: every entry of
    the batch gives up its names as if another still held the file (C8: a message
    released whole by one batch leaves its file behind)."""

    def _release_entry(self, h, *, shared=False):  # type: ignore[no-untyped-def]
        return super()._release_entry(h, shared=shared or self._in_batch)

    _in_batch = False

    def cleanup_all(self, mails):  # type: ignore[no-untyped-def]
        self._in_batch = True
        try:
            return super().cleanup_all(mails)
        finally:
            self._in_batch = False


def test_cleanup_all_rule_compares_each_step_with_the_model() -> None:
    """The lockstep's cleanup_all rule folds the steps into the model, and a batch that
    leaves a released message's file behind is C8 when the queue drains."""
    found = _lockstep_violation(_CleanupAllKeepsFiles, "fs-cleanup-all-keeps-files")
    assert found.clause == "C8", found


def test_crash_rule_catches_a_commit_without_directory_fsync() -> None:
    """NoCommitDirFsync acknowledges an enqueue whose commit rename is not yet durable:
    a power cut during a later operation may lose the message (C1).  Opened as crash
    exploration opens it (owner token and message ids from the directory and the opens
    before, not from a random token and the wall clock), so that the search,
    derandomized, meets the same traces on every run."""
    broken = Backend.from_factory(_no_commit_dir_fsync, "fs-broken-nosync-commit")
    machine = lockstep_machine(broken, crashes=True)
    with pytest.raises(ClauseViolation) as info:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=200, stateful_step_count=30, derandomize=True, database=None,
            phases=[Phase.explicit, Phase.generate], deadline=None, print_blob=False,
            suppress_health_check=list(HealthCheck)))
    # the lost commit is found lost as a queued entry (C1) or as one claimed since (C4)
    assert info.value.clause in ("C1", "C4"), info.value
    assert "lost" in info.value.detail
    for part in ("crash point:", "persistence model:", "crash state key:",
                 "model before the operation:"):
        assert part in info.value.detail
