"""Invalid arguments raise InvalidInputError (a ValueError) with a clear message, from the
contract's own values to every backend's entry points."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import queue_ref
from queue_ref import InvalidInputError, Recipient, Schedule
from queue_ref.fsqueue import FsQueue
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.logengine import LogEngine
from queue_ref.memory import MemoryStorage


@pytest.mark.parametrize("bad", [-1, 1.5, math.nan, math.inf, -math.inf, True, "3", None])
def test_schedule_rejects_what_is_not_a_non_negative_int(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="non-negative int"):
        queue_ref.Schedule(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="attempts"):
        Schedule(0, bad)  # type: ignore[arg-type]
    with pytest.raises(queue_ref.ScheduleError):
        Schedule(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("opener", [FsQueue, KvQueue.open_log, KvQueue.open_leveldb])
def test_backends_refuse_bad_paths_and_arguments(tmp_path: Path, opener: object) -> None:
    assert callable(opener)
    for bad in ("", 123, "a\x00b"):
        with pytest.raises(InvalidInputError, match="path"):
            opener(bad)
    q = opener(str(tmp_path / "q"))
    try:
        with pytest.raises(InvalidInputError, match="schedule"), q.enqueue("a@example.org") as e:
            e.write(b"x")
            e.commit([Recipient("b@example.org", 5)])  # type: ignore[arg-type]
        with q.enqueue("a@example.org") as e:
            e.write(b"x")
            (h,) = e.commit([Recipient("b@example.org", Schedule(0))])
        with pytest.raises(InvalidInputError):
            q.reschedule(h, -1)  # type: ignore[arg-type]
    finally:
        q.close()


def test_kv_open_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="reserve"):
        KvQueue.open_log(str(tmp_path / "a"), reserve=-5)
    with pytest.raises(InvalidInputError, match="memtable_limit"):
        LogEngine(str(tmp_path / "b"), memtable_limit=0)
    with pytest.raises(InvalidInputError, match="path"):
        LogEngine("")


def test_memory_backend_schedule() -> None:
    q = MemoryStorage()
    with q.enqueue("a@example.org") as e:
        e.write(b"x")
        (h,) = e.commit([Recipient("b@example.org", Schedule(0))])
    with pytest.raises(InvalidInputError):
        q.reschedule(h, "soon")  # type: ignore[arg-type]
