"""The sync-cover rule and the sync-rounds check: an operation must not return on a sync
that began before its change.  The rule on hand-made traces (pass and fail); a caller
stopped inside a real sync while another makes its change; each riding variant caught on
every pair it rides in, the project's seam backends passing."""

from __future__ import annotations

import os
import threading

import pytest

from conformance.checks import sync_rounds_check
from conformance.crashexplore.traced_runs import ScratchIO
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.sync_cover import uncovered_acks
from faultinject.disk import snapshot
from faultinject.seam import FaultyIO
from faultinject.trace import OperationSpan, TraceEvent

RIDING = "conformance.examples.broken_sync_rounds"
T1, T2 = 1, 2  # the committing thread, the thread whose sync it may ride


def _ev(index: int, name: str, args: tuple[object, ...], thread: int, began: int, ended: int,
        *, data: bytes | None = None, result: object = None, ok: bool = True) -> TraceEvent:
    return TraceEvent(index, name, args, data, result, None if ok else "OSError(EIO)", "test",
                      name != "fsize", ok, thread=thread, began=began, ended=ended)


def _trace(sync_began: int, sync_ended: int, *, sync: str = "syncfs",
           ok: bool = True) -> list[TraceEvent]:
    """T1 creates ``m`` (counter 2..3) and writes it (6..7); T2's sync (in the trace where
    it began) spans ``sync_began..sync_ended``; T1's commit runs 1..20."""
    args: tuple[object, ...] = {"syncfs": (".",), "fsync": ("f0",), "fsync_dir": (".",)}[sync]
    events = [_ev(0, "open_create", ("m", True, False), T1, 2, 3, result="f0"),
              _ev(1, "write", ("f0",), T1, 6, 7, data=b"mail", result=4)]
    events.insert(0 if sync_began < 2 else 1 if sync_began < 6 else 2,
                  _ev(0, sync, args, T2, sync_began, sync_ended, ok=ok))
    return [TraceEvent(i, e.name, e.args, e.data, e.result, e.error, e.site, e.mutating,
                       e.applied, thread=e.thread, began=e.began, ended=e.ended)
            for i, e in enumerate(events)]


def _judge(tmp_path: object, events: list[TraceEvent], op: str = "commit") -> list[str]:
    root = str(tmp_path)
    span = OperationSpan(op, T1, 1, 20, "ok")
    return [f"{u.clause}: {u.detail()}" for u in uncovered_acks(snapshot(root), events, [span])]


def test_a_sync_that_began_after_the_change_covers_it(tmp_path: object) -> None:
    assert _judge(tmp_path, _trace(8, 9)) == []


def test_a_sync_that_began_before_the_change_is_ridden_c1(tmp_path: object) -> None:
    """T2's syncfs began at 4, between T1's create and its write, and ended at 9: it
    covers the name, not the data."""
    found = _judge(tmp_path, _trace(4, 9))
    assert len(found) == 1 and found[0].startswith("C1: commit returned success")
    assert "the data of file" in found[0] and "began at 4" in found[0]


def test_each_operation_names_its_clause_and_a_claim_is_not_judged(tmp_path: object) -> None:
    """A claim lost in a power cut is redone: ``send_start`` need not be durable."""
    assert _judge(tmp_path, _trace(4, 9), "send_done")[0].startswith("C3: send_done")
    assert _judge(tmp_path, _trace(4, 9), "reschedule")[0].startswith("C9: reschedule")
    assert _judge(tmp_path, _trace(4, 9), "send_start") == []


def test_a_directory_fsync_begun_before_the_create_is_ridden(tmp_path: object) -> None:
    found = _judge(tmp_path, _trace(1, 9, sync="fsync_dir"))
    assert len(found) == 1 and "the names in directory" in found[0]  # fsync_dir: names only


def test_a_failed_or_unfinished_sync_is_not_judged_here(tmp_path: object) -> None:
    """A failed sync covers nothing, and no sync ended in time: the rule has nothing to say
    (io-errors and crash exploration judge a missing or failed sync)."""
    assert _judge(tmp_path, _trace(4, 9, ok=False)) == []
    assert _judge(tmp_path, _trace(4, 25)) == []


def test_the_seam_stops_a_caller_inside_a_sync_and_orders_the_trace_by_beginnings(
        tmp_path: object) -> None:
    io = FaultyIO(str(tmp_path), inner=ScratchIO())
    fd = io.open_create(os.path.join(str(tmp_path), "a"))
    gate = io.pause_in_sync(io.sync_count)
    t = threading.Thread(target=lambda: io.syncfs(str(tmp_path)))
    t.start()
    assert gate.wait_reached(5)
    with io.operation("commit") as span:
        io.write(fd, b"late")  # made while the syncfs is open
    gate.release()
    t.join(5)
    sync, write = io.events[1], io.events[2]
    assert (sync.name, write.name) == ("syncfs", "write")
    assert sync.began < write.began < write.ended < sync.ended
    assert span.began < write.began and write.ended < span.ended and span.outcome == "ok"
    assert sync.thread != write.thread


@pytest.mark.parametrize("factory", ["fs", "fs_fsync", "kv_log"])
def test_the_projects_seam_backends_pass(factory: str) -> None:
    backend = Backend.from_factory(f"conformance.examples.backends:{factory}")
    res = sync_rounds_check.run(backend, 1, backend.probe().capabilities)
    assert res.status is Status.PASS, [f.detail for f in res.findings]
    assert res.stats["cases"] >= res.stats["pairs"]


@pytest.mark.parametrize(("variant", "clauses"), [
    ("fs_rides_running_sync", {"C3", "C9"}),
    ("fs_fsync_rides_running_sync", {"C1", "C3", "C9"}),
    ("kv_log_rides_running_sync", {"C1", "C3", "C9"}),
])
def test_a_caller_riding_a_running_sync_is_caught(variant: str, clauses: set[str]) -> None:
    backend = Backend.from_factory(f"{RIDING}:{variant}")
    res = sync_rounds_check.run(backend, 1, backend.probe().capabilities)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == clauses
    assert all("it rode" in f.detail for f in res.findings)


def test_a_rider_passes_the_single_caller_fault_check() -> None:
    from conformance.checks import io_errors_check
    from conformance.harness.suite_profiles import QUICK

    res = io_errors_check.run(Backend.from_factory(f"{RIDING}:fs_rides_running_sync"), QUICK, 46)
    assert res.status is Status.PASS, [f.detail for f in res.findings]


def test_a_scenario_replays_and_a_bad_one_is_refused() -> None:
    backend = Backend.from_factory(f"{RIDING}:kv_log_rides_running_sync")
    found = sync_rounds_check.replay(backend, "sync-rounds:commit-vs-commit:1")
    assert [f.clause for f in found] == ["C1"] and "rode" in found[0].detail
    for bad in ("sync-rounds:commit-vs-flush:0", "sync-rounds:commit:0",
                "sync-rounds:commit-vs-commit:99"):
        with pytest.raises(ValueError, match="sync-rounds"):
            sync_rounds_check.replay(backend, bad)
