"""A backend that hangs gets a verdict: ``queue-ref certify --check-timeout`` reports the
check that did not finish, where it was stuck, writes the report and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _certify(tmp_path: Path, factory: str, *args: str) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    t = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "certify", factory, "--seed", "1",
         "--out", str(tmp_path / "out"), *args],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    return run.returncode, run.stdout + run.stderr, time.monotonic() - t


def test_a_check_that_hangs_is_an_error_with_where_it_was_stuck(tmp_path: Path) -> None:
    code, out, took = _certify(tmp_path, "conformance_support:HangsInSendDone",
                               "--only", "lockstep,bad-input", "--check-timeout", "3", "--json")
    assert code == 1, out
    assert took < 110  # the subprocess's own limit is 120 s
    assert "lockstep" in out and "did not finish within 3 s" in out
    assert "NOT CERTIFIED" in out
    cert = json.loads(out.strip().splitlines()[-1])
    (stuck,) = [r for r in cert["checks"] if r["check"] == "lockstep"]
    assert stuck["status"] == "error"
    assert 3.0 <= stuck["seconds"] < 20.0  # given up at its 3 s, not waited out
    assert stuck["note"].startswith("did not finish within 3 s, stuck in send_done (")
    assert "conformance_support.py" in stuck["note"].splitlines()[0]
    assert "_Stuck.event.wait()" in stuck["note"]  # the stack, innermost call last
    assert (tmp_path / "out" / "report.html").exists()
    assert "did not finish within 3 s" in (tmp_path / "out" / "report.md").read_text()


def test_a_probe_that_hangs_is_reported_too(tmp_path: Path) -> None:
    code, out, _ = _certify(tmp_path, "conformance_support:HangsOnClose",
                            "--check-timeout", "3")
    assert code == 1, out
    assert "probe" in out and "did not finish within 3 s" in out
    assert "stuck in close (" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("bad", ["-1", "0.0"])
def test_a_check_timeout_must_be_positive_or_zero_for_none(tmp_path: Path, bad: str) -> None:
    code, out, _ = _certify(tmp_path, "queue_ref.memory:MemoryStorage", "--only", "bad-input",
                            "--check-timeout", bad)
    if bad == "-1":
        assert code == 2 and "positive number of seconds" in out, out
    else:  # 0: no deadline; the check ran
        assert code != 2 and "bad-input          no-crash      pass" in out, out


HANG_WITH_A_CHILD = """
import sys, time
from conformance.certify.hang_watchdog import Watchdog
from conformance.checks.disk_growth_check import _doomed_owner
from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Child

child = Child(_doomed_owner, Backend.from_factory("conformance.examples.backends:fs"),
              sys.argv[1], "hang.", 0)
next(m for m in child.messages() if m.get("ready"))
print(child.pid, flush=True)
with Watchdog(1.0, lambda *a: print("hung in", a[0], flush=True)).step("stuck"):
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_hang_ends_the_check_processes_it_started(tmp_path: Path) -> None:
    """A check's own child processes (a killed owner, a traced workload) do not outlive a
    run the watchdog ended: they are killed with it, not left running."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", HANG_WITH_A_CHILD, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=90)
    assert run.returncode == 1, run.stdout + run.stderr
    pid_line, hung = run.stdout.splitlines()[:2]
    assert hung == "hung in stuck"
    pid = int(pid_line)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"child {pid} still runs after the hang ended the run"
