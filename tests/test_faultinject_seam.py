"""FaultyIO: recording, crash points, injected faults, trace hashes."""

from __future__ import annotations

import errno
import os
import pickle
import threading
from pathlib import Path

import pytest

from faultinject import Crash, FaultPlan, FaultyIO, crash_states, snapshot, trace_hash
from faultinject.seam import public_io_methods
from faultinject.trace import SYNC_CALLS
from queue_ref.io import MUTATING, OsIO, read_file, syncfs_reports_errors, write_file_durable
from tests.faultinject_support import run, write_file


def durable_pair(io: FaultyIO, root: str) -> None:
    io.mkdir(f"{root}/q")
    io.fsync_dir(root)
    write_file_durable(io, f"{root}/q/a", b"alpha")
    write_file_durable(io, f"{root}/q/b", b"beta")


def test_crash_is_a_base_exception_that_except_exception_cannot_swallow(tmp_path: Path) -> None:
    assert issubclass(Crash, BaseException) and not issubclass(Crash, Exception)
    io = FaultyIO(str(tmp_path), FaultPlan(crash_at=0))
    with pytest.raises(Crash) as info:
        try:
            io.mkdir(f"{tmp_path}/d")
        except Exception:  # backend-style handler
            pytest.fail("except Exception caught the crash")
    assert (info.value.call_index, info.value.when) == (0, "before")


def test_crash_before_call_n_does_not_perform_it(tmp_path: Path) -> None:
    io = run(str(tmp_path), durable_pair, FaultPlan(crash_at=1, crash_when="before"))
    # mutating calls: 0 mkdir, 1 fsync_dir, 2 open_create ...
    assert io.crashed and io.mutating_count == 2
    last = io.events[-1]
    assert (last.name, last.crash, last.applied) == ("fsync_dir", "before", False)
    assert os.listdir(tmp_path) == ["q"]

    io = run(str(tmp_path / "q"), lambda io, r: write_file(io, f"{r}/x", b"data"),
             FaultPlan(crash_at=1, crash_when="before"))
    assert (tmp_path / "q" / "x").read_bytes() == b""  # created, write never ran


def test_crash_after_call_n_performs_it(tmp_path: Path) -> None:
    io = run(str(tmp_path), lambda io, r: write_file(io, f"{r}/x", b"data"),
             FaultPlan(crash_at=1, crash_when="after"))
    assert (tmp_path / "x").read_bytes() == b"data"
    write = io.events[-1]
    assert (write.name, write.crash, write.applied, write.result) == ("write", "after", True, 4)
    assert io.crash is not None and io.crash.event_index == write.index


def test_every_call_after_a_crash_raises_crash_and_records_nothing(tmp_path: Path) -> None:
    io = FaultyIO(str(tmp_path), FaultPlan(crash_at=0, crash_when="after"))
    with pytest.raises(Crash):
        io.mkdir(f"{tmp_path}/d")
    recorded = len(io.events)
    for call in (lambda: io.listdir(str(tmp_path)), lambda: io.exists(f"{tmp_path}/d"),
                 lambda: io.mkdir(f"{tmp_path}/e"), lambda: io.close(3)):
        with pytest.raises(Crash) as info:
            call()
        assert info.value.repeated and info.value.call_index == 0
    assert len(io.events) == recorded
    assert not (tmp_path / "e").exists()


def test_a_crash_closes_the_dead_process_files_and_releases_its_locks(tmp_path: Path) -> None:
    lock = f"{tmp_path}/LOCK"
    io = FaultyIO(str(tmp_path), FaultPlan(crash_at=0))
    assert io.lock_exclusive(lock) is not None
    assert OsIO().lock_exclusive(lock) is None  # held
    with pytest.raises(Crash):
        io.mkdir(f"{tmp_path}/d")
    fd = OsIO().lock_exclusive(lock)
    assert fd is not None
    OsIO().unlock(fd)


def test_only_mutating_calls_count_and_events_index_every_call(tmp_path: Path) -> None:
    io = run(str(tmp_path), durable_pair)
    assert [e.index for e in io.events] == list(range(len(io.events)))
    assert io.mutating_count == sum(e.mutating for e in io.events)
    assert all(e.mutating == (e.name in MUTATING) for e in io.events)
    assert {e.name for e in io.events if not e.mutating} >= {"exists", "close"}


def test_events_use_relative_paths_file_ids_and_call_sites(tmp_path: Path) -> None:
    io = run(str(tmp_path), durable_pair)
    by_name = [(e.name, e.args) for e in io.events]
    assert ("mkdir", ("q",)) in by_name and ("fsync_dir", (".",)) in by_name
    assert ("rename", ("q/a.tmp", "q/a")) in by_name
    opens = [e for e in io.events if e.name == "open_create"]
    assert [e.result for e in opens] == ["f0", "f1"]
    assert opens[0].args == ("q/a.tmp", True, False)
    write = next(e for e in io.events if e.name == "write")
    assert (write.args, write.data, write.result) == (("f0",), b"alpha", 5)
    assert str(tmp_path) not in repr([e.args for e in io.events])
    # the site is the caller outside faultinject and queue_ref/io.py: this file
    assert all(e.site.startswith("tests/test_faultinject_seam.py:") for e in io.events)
    assert write.site.endswith("in durable_pair")


def test_rename_noreplace_is_recorded_as_link_then_unlink(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    io = FaultyIO(str(tmp_path))
    io.rename_noreplace(f"{tmp_path}/a", f"{tmp_path}/b")
    assert [(e.name, e.args) for e in io.events] == [("link", ("a", "b")), ("unlink", ("a",))]
    with pytest.raises(FileExistsError):
        (tmp_path / "c").write_bytes(b"y")
        io.rename_noreplace(f"{tmp_path}/c", f"{tmp_path}/b")
    assert io.events[-1].error == "FileExistsError(EEXIST)" and not io.events[-1].applied


def test_real_errors_are_recorded_and_raised(tmp_path: Path) -> None:
    io = FaultyIO(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        io.unlink(f"{tmp_path}/nope")
    e = io.events[-1]
    assert (e.error, e.applied, e.injected) == ("FileNotFoundError(ENOENT)", False, False)


def test_injected_enospc_on_write_can_be_a_short_write(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/x", b"0123456789", fsync=False)

    with pytest.raises(OSError) as info:
        run(str(tmp_path), script, FaultPlan(fail_at=1, fail_errno=errno.ENOSPC, fail_written=4))
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "x").read_bytes() == b"0123"

    sub = tmp_path / "s"
    sub.mkdir()
    io = FaultyIO(str(sub), FaultPlan(fail_at=1, fail_errno=errno.ENOSPC))
    with pytest.raises(OSError):
        script(io, str(sub))
    w = io.events[1]
    assert (w.name, w.error, w.applied, w.injected, w.data) == (
        "write", "OSError(ENOSPC)", False, True, b"")
    assert (sub / "x").read_bytes() == b""


def test_fsync_eio_is_reported_once_and_the_page_cache_keeps_the_data(tmp_path: Path) -> None:
    io = FaultyIO(str(tmp_path), FaultPlan(fail_at=2))  # 0 open_create, 1 write, 2 fsync
    fd = io.open_create(f"{tmp_path}/x")
    io.write(fd, b"payload")
    with pytest.raises(OSError) as info:
        io.fsync(fd)
    assert info.value.errno == errno.EIO
    io.fsync(fd)  # a later fsync of the same file succeeds
    io.close(fd)
    assert read_file(OsIO(), f"{tmp_path}/x") == b"payload"
    failed, again = [e for e in io.events if e.name == "fsync"]
    assert (failed.error, failed.applied, failed.injected) == ("OSError(EIO)", False, True)
    assert (again.error, again.applied) == (None, True)


def test_injected_failure_of_other_calls_does_not_perform_them(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    io = FaultyIO(str(tmp_path), FaultPlan(fail_at=0, fail_errno=errno.EIO))
    with pytest.raises(OSError):
        io.rename(f"{tmp_path}/a", f"{tmp_path}/b")
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_same_script_twice_gives_the_same_trace_hash(tmp_path: Path) -> None:
    roots = [tmp_path / "one", tmp_path / "two", tmp_path / "three"]
    for r in roots:
        r.mkdir()
    h1 = run(str(roots[0]), durable_pair).trace_hash()
    h2 = run(str(roots[1]), durable_pair).trace_hash()
    assert h1 == h2 and len(h1) == 64

    def other(io: FaultyIO, root: str) -> None:
        durable_pair(io, root)
        io.unlink(f"{root}/q/b")

    assert run(str(roots[2]), other).trace_hash() != h1
    crashed = []
    for name in ("c0", "c1"):
        (tmp_path / name).mkdir()
        crashed.append(run(str(tmp_path / name), durable_pair, FaultPlan(crash_at=3)))
    assert trace_hash(crashed[0].events) == trace_hash(crashed[1].events) != h1


def test_faulty_io_records_every_public_call_of_the_seam() -> None:
    missing = [n for n in public_io_methods() if n not in vars(FaultyIO)]
    assert missing == []


def test_bad_plans_and_roots_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        FaultPlan(crash_when="during")
    with pytest.raises(ValueError):
        FaultPlan(crash_at=-1)
    with pytest.raises(ValueError):
        FaultPlan(fail_errno=123456)
    with pytest.raises(ValueError):
        FaultyIO(str(tmp_path / "missing"))


def test_crash_survives_pickling() -> None:
    crash = Crash(4, "after", name="rename", event_index=9)
    back = pickle.loads(pickle.dumps(crash))
    assert (back.call_index, back.when, back.name, back.event_index) == (4, "after", "rename", 9)
    assert str(back) == str(crash)


def test_calls_from_threads_are_serialized_into_one_consistent_trace(tmp_path: Path) -> None:
    io = FaultyIO(str(tmp_path))

    def worker(n: int) -> None:
        for i in range(20):
            write_file_durable(io, f"{tmp_path}/w{n}-{i}", bytes([n]) * 100)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.index for e in io.events] == list(range(len(io.events)))
    (state,) = crash_states(io.initial, io.events, "process-kill")
    assert state.image == snapshot(str(tmp_path)) and len(state.image.files) == 80


def test_a_blocking_lock_waits_outside_the_seam(tmp_path: Path) -> None:
    io = FaultyIO(str(tmp_path))
    lock = f"{tmp_path}/LOCK"
    held = io.lock_exclusive(lock)
    assert held is not None
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(io.lock_exclusive(lock, blocking=True)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting, yet the seam still serves other calls:
    io.unlock(held)
    waiter.join(5)
    assert got and got[0] is not None
    io.unlock(got[0])
    assert [e.name for e in io.events] == ["lock_exclusive", "unlock", "lock_exclusive", "unlock"]


class HalfFullDisk(OsIO):
    """A disk that takes the first 3 bytes of each write, then reports ENOSPC."""

    def write(self, fd: int, data: bytes) -> int:
        os.write(fd, data[:3])
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("append", [False, True])
def test_a_real_short_write_before_an_error_is_recorded(tmp_path: Path, append: bool) -> None:
    (tmp_path / "x").write_bytes(b"old-old")
    io = FaultyIO(str(tmp_path), inner=HalfFullDisk())
    fd = io.open_create(f"{tmp_path}/x", exclusive=False, append=append)
    with pytest.raises(OSError):
        io.write(fd, b"abcdef")
    io.close(fd)
    w = io.events[1]
    assert (w.data, w.applied, w.error, w.injected) == (b"abc", True, "OSError(ENOSPC)", False)
    (state,) = crash_states(io.initial, io.events, "process-kill")
    assert state.image == snapshot(str(tmp_path))
    assert state.image.file("x") == (b"old-oldabc" if append else b"abc-old")


def test_syncfs_is_a_recorded_crash_point_and_pins_are_not_recorded(tmp_path: Path) -> None:
    root = str(tmp_path)
    io = FaultyIO(root, FaultPlan(crash_at=1, crash_when="before"))
    io.pin_dir(root)
    try:
        io.mkdir(f"{root}/d")
        with pytest.raises(Crash):
            io.syncfs(f"{root}/d")
    finally:
        io.unpin_dir(root)
    assert [(e.name, e.args, e.crash) for e in io.events] == [
        ("mkdir", ("d",), None), ("syncfs", ("d",), "before")]
    assert "syncfs" in MUTATING and "syncfs" in SYNC_CALLS


def test_real_syncfs_and_pinned_directories(tmp_path: Path) -> None:
    io = OsIO()
    root = str(tmp_path)
    io.syncfs(root)  # a real syncfs(2) of the test's file system
    io.pin_dir(root)
    io.pin_dir(root)
    fd = io._pins()[root][0]
    io.fsync_dir(root)
    io.syncfs(root)
    io.unpin_dir(root)
    assert io._pins()[root] == [fd, 1]  # counted: still held once
    io.unpin_dir(root)
    assert root not in io._pins()
    with pytest.raises(OSError):
        os.fstat(fd)  # the last unpin closed it
    io.unpin_dir(root)  # unbalanced: nothing to undo


@pytest.mark.parametrize(("release", "ok"), [("5.8.0", True), ("6.18.44-fc-v782", True),
                                             ("5.7.19", False), ("4.19.0-27-amd64", False),
                                             ("junk", False)])
def test_syncfs_is_trusted_only_where_it_reports_writeback_errors(release: str,
                                                                  ok: bool) -> None:
    assert syncfs_reports_errors(release) is ok


def test_a_crash_releases_the_pinned_directories_of_the_dead_process(tmp_path: Path) -> None:
    root = str(tmp_path)
    io = FaultyIO(root, FaultPlan(crash_at=0))
    io.pin_dir(root)
    (fd, count), = io.inner._pins().values()
    with pytest.raises(Crash):
        io.mkdir(f"{root}/d")
    assert io.inner._pins() == {}
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the process
    io.unpin_dir(root)  # the queue's own release, after the crash, is a no-op
    with pytest.raises(Crash):
        io.pin_dir(root)
    assert count == 1


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_large_unlink_is_an_unlink_for_records_and_crashes(tmp_path: Path, when: str) -> None:
    """``unlink_large`` differs from ``unlink`` only in the GIL (``OsIO``): the seam
    records it as an unlink and crashes there like at any other mutating call."""
    (tmp_path / "log").write_bytes(b"x" * 4096)
    io = FaultyIO(str(tmp_path))
    io.unlink_large(f"{tmp_path}/log")
    assert [(e.name, e.args, e.mutating) for e in io.events] == [("unlink", ("log",), True)]
    (tmp_path / "log").write_bytes(b"x")
    io = FaultyIO(str(tmp_path), FaultPlan(crash_at=0, crash_when=when))
    with pytest.raises(Crash):
        io.unlink_large(f"{tmp_path}/log")
    assert (tmp_path / "log").exists() is (when == "before")
