"""The reader-elsewhere check: another process inspects queued mail and reads it in pieces
while this one delivers it and enqueues more.  The filesystem queue passes; a copy of it
whose readers take no shared lock, so that the next messages are written into the files
under them, is caught; backends without the capabilities are unsupported, never passed."""

from __future__ import annotations

import subprocess
import sys

from conformance.certify.scenario_replay import replay
from conformance.certify.suite_runner import certify
from conformance.checks import reader_elsewhere_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status

BROKEN = "conformance.examples.broken_backends"


def test_the_filesystem_queue_passes() -> None:
    res = reader_elsewhere_check.run(Backend.from_factory("conformance.examples.backends:fs"))
    assert res.status is Status.PASS, [f.detail for f in res.findings]
    assert res.stats == {"readers": reader_elsewhere_check.MESSAGES,
                         "read_whole": reader_elsewhere_check.MESSAGES}


def test_files_reused_under_a_reader_elsewhere_are_c9_and_replay() -> None:
    broken = Backend.from_factory(f"{BROKEN}:fs_spare_reused_under_reader")
    res = reader_elsewhere_check.run(broken)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C9"}
    assert all("CorruptionError" in f.detail and f.scenario == "reader-elsewhere"
               for f in res.findings)
    assert res.stats["read_whole"] < reader_elsewhere_check.MESSAGES
    assert {f.clause for f in replay(broken, "reader-elsewhere")} == {"C9"}


def test_the_cli_names_the_check_and_a_backend_without_hold_is_unsupported() -> None:
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "certify",
                          f"{BROKEN}:fs_spare_reused_under_reader", "--only",
                          "reader-elsewhere"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "reader-elsewhere" in out.stdout and "C9" in out.stdout
    cert = certify("conformance.examples.sqlite_backend:factory", only=["reader-elsewhere"],
                   models=["process-kill"])
    (r,) = [c for c in cert.results if c.check == "reader-elsewhere"]
    assert r.status is Status.UNSUPPORTED
