"""``queue-ref certify`` on the in-memory backend (not durable) and the sqlite example."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conformance.cli import main
from tests.browser_support import screenshot


def certify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    code = main(["certify", *args, "--json", "--jobs", "1"])
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1]), out


def cell(cert: dict[str, Any], clause: str, model: str) -> dict[str, Any]:
    got: dict[str, Any] = cert["clauses"][clause]["cells"][model]
    return got


def test_memory_is_not_certified_for_durability(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    code, cert, out = certify(capsys, "queue_ref.memory:MemoryStorage", "--model",
                              "process-kill,weak", "--seed", "3", "--out", str(tmp_path))
    assert code == 1
    assert cert["status"] == "not certified"
    c1 = cell(cert, "C1", "process-kill")
    assert c1["status"] == "fail"
    assert c1["scenarios"] and all(s.startswith(("process-kill:", "recovery-rerun:"))
                                   for s in c1["scenarios"])
    restart = next(r for r in cert["checks"] if r["check"] == "restart")
    assert restart["status"] == "fail"  # an orderly restart keeps nothing either
    assert cell(cert, "C1", "weak")["status"] == "unsupported"  # no I/O seam
    # Without restarts it follows the model (after one, it may even reuse ids: C3).
    lockstep = next(r for r in cert["checks"] if r["check"] == "lockstep")
    assert lockstep["status"] == "pass"
    for clause in ("C2", "C5", "C6", "C7", "C9"):
        assert cell(cert, clause, "no-crash")["status"] == "pass", clause
    checks = {(r["check"], r["model"]): r["status"] for r in cert["checks"]}
    assert checks[("lockstep", "no-crash")] == "pass"
    assert checks[("crash-exploration", "weak")] == "unsupported"
    assert checks[("streaming", "no-crash")] == "unsupported"
    assert cert["unsupported_models"] == ["weak"]
    html = (tmp_path / "report.html").read_text()
    assert "C1 Durable ack" in html and "not certified" in html
    assert (tmp_path / "report.md").read_text().startswith("# Conformance report")
    assert json.loads((tmp_path / "certificate.json").read_text())["seed"] == 3
    assert "NOT CERTIFIED" in out

    # the first scenario replays
    code = main(["certify", "queue_ref.memory:MemoryStorage", "--scenario",
                 c1["scenarios"][0], "--json"])
    replay = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1
    assert {f["clause"] for f in replay["findings"]} <= {"C1", "C4"}
    assert replay["findings"]


def test_expected_failures_lower_the_result(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    xf = tmp_path / "expected.txt"
    xf.write_text("C1   # an in-memory queue keeps nothing\nC4 process-kill\n")
    code, cert, _ = certify(capsys, "queue_ref.memory:MemoryStorage", "--model",
                              "process-kill", "--seed", "3", "--out", str(tmp_path / "r"),
                              "--expected-failures", str(xf),
                              "--only", "process-kill,bad-input")
    assert code == 3
    assert cert["status"] == "not certified, known failures"
    assert cell(cert, "C1", "process-kill")["status"] == "known-failure"
    assert "(expected)" in (tmp_path / "r" / "report.md").read_text()


def test_sqlite_example_is_certified_under_every_model(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    """Process kill by killing a child; power loss (weak, ext4-ordered) by the
    black-box check, which rebuilds crash states from the child's system calls."""
    code, cert, out = certify(capsys, "conformance.examples.sqlite_backend:factory",
                              "--seed", "11", "--out", str(tmp_path))
    assert code == 0, out
    assert cert["status"] == "certified"
    assert cert["certified_models"] == ["process-kill", "weak", "ext4-ordered"]
    assert cert["unsupported_models"] == []
    checks = {(r["check"], r["model"]): r for r in cert["checks"]}
    for name in ("lockstep", "restart", "listing", "bad-input", "many-recipients", "threads",
                 "multi-process", "streaming"):
        assert checks[(name, "no-crash")]["status"] == "pass", name
    assert checks[("process-kill", "process-kill")]["stats"]["killed_inside_a_call"] > 0
    assert checks[("streaming", "no-crash")]["stats"]["read_peak"] < 16 * 2**20
    for model in ("process-kill", "weak", "ext4-ordered"):
        assert checks[("blackbox-power-loss", model)]["status"] == "pass", model
    assert checks[("blackbox-power-loss", "weak")]["stats"]["states"] > 0
    assert "CERTIFIED under process-kill, weak, ext4-ordered" in out


def test_sqlite_rollback_journal_survives_kills(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    code, cert, _ = certify(capsys, "conformance.examples.sqlite_backend:factory_rollback",
                            "--model", "process-kill", "--seed", "5", "--out", str(tmp_path),
                            "--only", "restart,process-kill,recovery-rerun")
    assert code == 0
    assert cert["certified_models"] == ["process-kill"]


@pytest.mark.parametrize("args, message", [
    (["queue_ref.memory:MemoryStorage", "--model", "tornado"], "unknown crash model"),
    (["no.such:factory"], "cannot import"),
    (["queue_ref.memory:MemoryStorage", "--only", "nothing"], "unknown checks"),
])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                             args: list[str], message: str) -> None:
    assert main(["certify", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_fail_fast_stops_at_the_first_failing_check(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    # The in-memory backend keeps nothing across a restart: "restart" (the second check)
    # fails, and nothing after it runs.
    code, cert, _ = certify(capsys, "queue_ref.memory:MemoryStorage", "--model",
                              "process-kill", "--seed", "3", "--out", str(tmp_path),
                              "--fail-fast")
    assert code == 1
    assert cert["status"] == "not certified"
    ran = [r["check"] for r in cert["checks"]]
    assert ran == ["lockstep", "restart"]
    assert cert["checks"][-1]["status"] == "fail"
    assert cell(cert, "C1", "process-kill")["status"] == "not-run"


def test_the_certificate_page_renders_in_a_headless_browser(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The HTML certificate as a person sees it: the LevelDB queue's, with the full-disk
    check's note on the limit it declares, and "not certified" with its reason (no crash
    model was checked)."""
    code, cert, _ = certify(capsys, "conformance.examples.backends:kv_leveldb", "--only",
                            "bad-input,full-disk,second-open", "--seed", "5", "--out",
                            str(tmp_path))
    assert code == 1  # no crash model was checked: not certified, and the page says why
    full = next(r for r in cert["checks"] if r["check"] == "full-disk")
    assert full["status"] == "pass" and "cannot drain a full disk" in full["note"]
    page = tmp_path / "report.html"
    html = page.read_text()
    assert "full-disk" in html and "cannot drain a full disk" in html
    assert len(screenshot(page, tmp_path)) > 50_000  # make certificate-screenshot keeps it
