"""Black-box power loss: strace traces read exactly, rewritten as seam events, crashed.

The strace runs here are real (Debian's strace traces a real child); the SQLite backend
with ``synchronous=FULL`` must pass under every model, with ``synchronous=OFF`` it must
lose acknowledged mail under ``weak`` (C1) and still pass under ``process-kill``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import replace

import pytest

from conformance.blackbox.strace_trace import STRACE_OPTIONS, TraceFormatError, parse_file, parse_lines
from conformance.blackbox.syscall_events import UnmodelledCall, to_events
from conformance.certify.suite_runner import certify, run_check
from conformance.checks import blackbox_power_loss_check as bb
from conformance.examples.sqlite_backend import SqliteStorage
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import BY_ID
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK, THOROUGH
from faultinject.disk import DiskImage
from faultinject.models import crash_states
from tests.conftest import thorough

SQLITE = "conformance.examples.sqlite_backend:factory"
SYNC_OFF = "conformance.examples.broken_backends:sqlite_sync_off"
PROFILE = THOROUGH if thorough() else replace(QUICK, blackbox_trials=1)


def _hex(data: bytes) -> str:
    return "".join(f"\\x{b:02x}" for b in data)


ACK = b'{"a":0}\n'


ROOT = "/q/root"
MARKER = f'write(1<{_hex(b"pipe:[7]")}>, "{_hex(ACK)}", 8) = 8'


def _lines(*body: str) -> list[str]:
    return [f"100 10:00:00.{n:06d} {b}" for n, b in enumerate(body)]


def test_parser_joins_unfinished_calls_and_reads_exact_bytes() -> None:
    data = b'a"b\n\x00\xff)= x'
    lines = _lines(
        f'openat(AT_FDCWD<{_hex(b"/q")}>, "{_hex(ROOT.encode() + b"/f")}", '
        f"O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = 3<{_hex(ROOT.encode() + b'/f')}>",
        f'write(3<{_hex(ROOT.encode() + b"/f")}>, "{_hex(data)}", {len(data)} <unfinished ...>',
        "--- SIGCHLD {si_signo=SIGCHLD, si_code=CLD_EXITED} ---",
        f"<... write resumed>) = {len(data)}",
        f'unlink("{_hex(b"/nowhere")}") = -1 ENOENT (No such file or directory)',
        f"close(3<{_hex(ROOT.encode() + b'/f')}>(deleted)) = 0",
        "+++ exited with 0 +++",
    )
    calls = list(parse_lines(lines))
    assert [c.name for c in calls] == ["openat", "write", "unlink", "close"]
    op, wr, un, cl = calls
    assert op.path(1) == ROOT + "/f" and op.result == 3 and op.result_path == ROOT + "/f"
    assert op.flags(2) == {"O_WRONLY", "O_CREAT", "O_TRUNC", "O_CLOEXEC"}
    assert op.args[3] == 0o644
    assert wr.text(1).data == data and not wr.text(1).truncated and wr.result == len(data)
    assert not un.ok and un.errno == "ENOENT"
    assert cl.fd(0).deleted and cl.fd(0).path == ROOT + "/f"


def test_parser_reads_iovecs_and_refuses_garbage() -> None:
    (wv,) = parse_lines(_lines(
        f'writev(4<{_hex(b"/x")}>, [{{iov_base="{_hex(b"ab")}", iov_len=2}}, '
        f'{{iov_base="{_hex(b"cde")}", iov_len=3}}], 2) = 5'))
    vec = wv.args[1]
    assert isinstance(vec, list) and [v["iov_len"] for v in vec] == [2, 3]  # type: ignore[index]
    with pytest.raises(TraceFormatError):
        list(parse_lines(["this is not strace"]))
    with pytest.raises(TraceFormatError):
        list(parse_lines(_lines("<... write resumed>) = 1")))


def _events(*body: str) -> list[str]:
    ev = to_events(list(parse_lines(_lines(*body))), ROOT, "/q")
    return [e.short() for e in ev.events]


def _fd(n: int, rel: str) -> str:
    return f"{n}<{_hex((ROOT + '/' + rel).encode())}>"


def _open(rel: str, flags: str, fd: int) -> str:
    return (f'openat(AT_FDCWD<{_hex(b"/q")}>, "{_hex((ROOT + "/" + rel).encode())}", '
            f"{flags}, 0600) = {_fd(fd, rel)}")


def test_positions_truncation_and_directory_syncs_become_seam_events() -> None:
    got = _events(
        _open("a", "O_RDWR|O_CREAT", 3),
        f'write({_fd(3, "a")}, "{_hex(b"hello")}", 5) = 5',
        f"lseek({_fd(3, 'a')}, 1, SEEK_SET) = 1",
        "read(0x3, 0x7ff0, 0x2) = 0x2",
        f'write({_fd(3, "a")}, "{_hex(b"XY")}", 2) = 2',
        f'pwrite64({_fd(3, "a")}, "{_hex(b"Z")}", 1, 9) = 1',
        f"fdatasync({_fd(3, 'a')}) = 0",
        f'openat(AT_FDCWD<{_hex(b"/q")}>, "{_hex(ROOT.encode())}", O_RDONLY|O_CLOEXEC) = '
        f"5<{_hex(ROOT.encode())}>",
        f"fsync(5<{_hex(ROOT.encode())}>) = -1 EIO (Input/output error)",
        f"close({_fd(3, 'a')}) = 0",
        _open("a", "O_WRONLY|O_TRUNC", 3),
        f'rename("{_hex((ROOT + "/a").encode())}", "{_hex((ROOT + "/b").encode())}") = 0',
        MARKER,
        f'openat(AT_FDCWD<{_hex(b"/q")}>, "{_hex(b"/elsewhere")}", O_RDWR|O_CREAT, 0600) = '
        f"6<{_hex(b'/elsewhere')}>",
        f'write(6<{_hex(b"/elsewhere")}>, "{_hex(b"no")}", 2) = 2',
    )
    assert got == [
        "#0 open_create(a, False, False)", "#1 pwrite(f0, 0, 5 bytes)",
        "#2 pwrite(f0, 3, 2 bytes)", "#3 pwrite(f0, 9, 1 bytes)", "#4 fdatasync(f0)",
        "#5 fsync_dir(.) -> OSError(EIO)", "#6 close(f0)", "#7 open_create(a, False, False)",
        "#8 ftruncate(f1, 0)", "#9 rename(a, b)"]
    ev = to_events(list(parse_lines(_lines(
        MARKER))), ROOT, "/q")
    assert ev.markers == [(0, {"a": 0})]


def test_calls_that_cannot_be_followed_are_refused() -> None:
    with pytest.raises(UnmodelledCall, match="across the boundary"):
        _events(f'rename("{_hex(b"/tmp/x")}", "{_hex((ROOT + "/x").encode())}") = 0')
    with pytest.raises(UnmodelledCall, match="raise its -s"):
        _events(_open("a", "O_RDWR|O_CREAT", 3),
                f'write({_fd(3, "a")}, "{_hex(b"abc")}"..., 9) = 9')
    with pytest.raises(UnmodelledCall, match="unknown descriptor"):
        _events(f'write({_fd(9, "a")}, "{_hex(b"abc")}", 3) = 3')


def test_a_real_trace_rebuilds_the_states_a_power_cut_may_leave(tmp_path: object) -> None:
    """strace follows a real program; under weak the unsynced rename may be lost, the
    fsynced data never is; under process-kill everything stays."""
    work = tempfile.mkdtemp(prefix="queue-ref-blackbox-test-")
    root = os.path.join(work, "root")
    os.mkdir(root)
    prog = textwrap.dedent(f"""
        import os
        r = {root!r}
        fd = os.open(os.path.join(r, "tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x" * 5000)
        os.fsync(fd)
        os.close(fd)
        os.rename(os.path.join(r, "tmp"), os.path.join(r, "final"))
        with open(os.path.join(r, "log"), "ab") as f:
            f.write(b"appended")
    """)
    out = os.path.join(work, "trace")
    try:
        subprocess.run(["strace", *STRACE_OPTIONS, "-o", out, sys.executable, "-c", prog],
                       check=True, timeout=60)
        ev = to_events(parse_file(out), root, os.getcwd())
        names = [e.short() for e in ev.events]
        assert names == ["#0 open_create(tmp, True, False)", "#1 pwrite(f0, 0, 5000 bytes)",
                         "#2 fsync(f0)", "#3 close(f0)", "#4 rename(tmp, final)",
                         "#5 open_create(log, False, True)", "#6 write(f1, 8 bytes)",
                         "#7 close(f1)"]
        assert ev.events[1].data == b"x" * 5000
        kill = crash_states(DiskImage(), ev.events, "process-kill")
        assert [s.image.file("final") for s in kill] == [b"x" * 5000]
        weak = crash_states(DiskImage(), ev.events, "weak", exhaustive_limit=8)
        finals = {s.image.file("final") for s in weak}
        assert finals == {None, b"x" * 5000}  # the rename may be lost, never the bytes torn
        assert any(s.image.file("tmp") == b"x" * 5000 for s in weak)
        assert {s.image.file("log") for s in weak} >= {None, b"", b"appended"}
    finally:
        subprocess.run(["rm", "-rf", work], check=True)


@pytest.mark.parametrize("factory", [SQLITE, f"{SQLITE}_wal"])
def test_sqlite_passes_every_model_in_both_journal_modes(factory: str) -> None:
    """The example's default (rollback journal, ``synchronous=EXTRA``) and its WAL mode
    (``synchronous=FULL``) keep every acknowledged operation through a power cut."""
    backend = Backend.from_factory(factory)
    for model in ("process-kill", "weak", "ext4-ordered"):
        res = bb.run(backend, model, PROFILE, 3)
        assert res.status is Status.PASS, [f.detail for f in res.findings]
        assert res.stats["crash_points"] >= 6 and res.stats["states"] >= res.stats["crash_points"]
        assert res.stats["syscalls_under_root"] > 20
    if factory.endswith("_wal"):
        assert "queue.sqlite3-shm" in res.note  # mmap writes are named, not hidden


def test_sqlite_sync_off_loses_acknowledged_mail_under_weak_only() -> None:
    """Through ``certify``: C1 fails under weak, process-kill holds, and the scenario id
    of a finding replays the same loss (the workload traced again)."""
    cert = certify(SYNC_OFF, only=["blackbox-power-loss"], models=["process-kill", "weak"],
                   profile=PROFILE, seed=3)
    m = cert.matrix()
    assert m["C1"]["weak"].status is Status.FAIL
    assert m["C1"]["process-kill"].status is Status.PASS
    assert cert.certified_models() == ["process-kill"]
    weak = next(r for r in cert.results if r.model == "weak")
    c1 = [f for f in weak.findings if f.clause == "C1"]
    assert c1 and all(f.model == "weak" for f in c1)
    assert "lost" in c1[0].detail and any("power cut after" in s for s in c1[0].steps)
    again = bb.replay(Backend.from_factory(SYNC_OFF), c1[0].scenario)
    assert any(f.clause == "C1" for f in again)


def test_the_check_leaves_seam_and_memory_backends_to_other_checks() -> None:
    spec = BY_ID["blackbox-power-loss"]
    seam = Backend.from_factory("conformance.examples.backends:fs")
    res = run_check(spec, "weak", seam, seam.probe(), QUICK, 1)
    assert res.status is Status.UNSUPPORTED and "crash exploration" in res.note
    memory = Backend.from_factory("queue_ref.memory:MemoryStorage")
    res = run_check(spec, "weak", memory, memory.probe(), QUICK, 1)
    assert res.status is Status.UNSUPPORTED and "no directory" in res.note
    with pytest.raises(ValueError, match="not a blackbox-power-loss scenario"):
        bb.replay(seam, "process-kill:1:2:3")


def rollback_full(root: str) -> SqliteStorage:
    """The rollback-journal example with ``synchronous=FULL`` (it was shipped so)."""
    return SqliteStorage(root, journal="delete", synchronous="FULL")


def test_rollback_journal_needs_extra_to_survive_power_loss() -> None:
    """With FULL, SQLite commits a rollback-mode transaction by unlinking its journal
    without syncing the directory: a power cut brings the journal back and undoes an
    acknowledged operation.  The example uses EXTRA, which syncs it, and passes."""
    full = bb.run(Backend.from_factory(rollback_full), "weak", PROFILE, 1)
    assert full.status is Status.FAIL
    assert any("unlink(queue.sqlite3-journal)" in " ".join(f.steps) for f in full.findings)
    extra = bb.run(Backend.from_factory("conformance.examples.sqlite_backend:factory_rollback"),
                   "weak", PROFILE, 1)
    assert extra.status is Status.PASS, [f.detail for f in extra.findings]


def test_parser_reads_every_result_form() -> None:
    calls = list(parse_lines([
        "10:00:00.000001 fsync(3</x>) = 0",  # one process: no pid column
        "7 10:00:00.000002 openat(AT_FDCWD</x>, \"\\x61\", O_RDONLY) = 4</x/a>(deleted)",
        "7 10:00:00.000003 poll_like(0) = 0 (Timeout)",
        "7 10:00:00.000004 fdatasync(5</x/b>) = -1 EIO (Input/output error)",
        "7 10:00:00.000005 write(6</x/c>, \"\\x61\", 1) = ?",
    ]))
    assert [(c.pid, c.name, c.result, c.errno) for c in calls] == [
        (0, "fsync", 0, None), (7, "openat", 4, None), (7, "poll_like", 0, None),
        (7, "fdatasync", -1, "EIO"), (7, "write", None, None)]
    assert calls[1].result_path == "/x/a" and not calls[4].ok


def test_the_kv_queue_on_leveldb_syncs_the_names_leveldb_leaves_unsynced() -> None:
    """LevelDB fdatasyncs its log but never syncs its directory after installing CURRENT
    or creating a log: under weak, a power cut could take the names and acknowledged mail
    with them.  The engine syncs the directory when the names changed; without that the
    check fails it (C1 under weak), with it the same seed passes."""
    broken = certify("conformance.examples.broken_backends:kv_leveldb_names_unsynced",
                     only=["blackbox-power-loss"], models=["weak"], profile=PROFILE, seed=25)
    assert "C1" in {f.clause for r in broken.results for f in r.findings}
    real = certify("conformance.examples.backends:kv_leveldb", only=["blackbox-power-loss"],
                   models=["weak"], profile=PROFILE, seed=25)
    assert real.certified_models() == ["weak"], [f.detail for r in real.results
                                                 for f in r.findings]
