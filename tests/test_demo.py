"""``queue-ref demo``: the real queue at work, with SMTP delivery on loopback, end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conformance.cli import main


def test_demo_delivers_recovers_reuses_and_leaves_nothing(tmp_path: Path,
                                                          capsys: Any) -> None:
    root = tmp_path / "demo"
    assert main(["demo", "--dir", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # bob once; carol after the crash and recovery; then dave and erin
    assert out["delivered_to"] == ["bob@example.net", "carol@example.com",
                                   "dave@example.net", "erin@example.net"]
    assert out["recovery"]["requeued"] == 1
    assert out["footprint_after_drain"] == {"objects": 0, "bytes": 0}
    assert out["spare_file_reused"] is True
    steps = {s["step"].split(".")[0]: s["disk"] for s in out["steps"]}
    assert len(steps) == 12
    # bob's entry in flight: a hard link to the message file, shown with its size and
    # its count of names (the file, 2 references, 2 entry links), as data/<msgid> is
    inflight = [line for line in steps["3"] if line.startswith("inflight/")]
    message = [line for line in steps["3"] if line.startswith("data/") and "." not in
               line.split()[0]]
    assert len(inflight) == 1 and len(message) == 1
    assert inflight[0].endswith(", 5 names)") and inflight[0].split(" ", 1)[1] == (
        message[0].split(" ", 1)[1])
    assert not any(" -> " in line for line in steps["3"])  # no symlink
    assert any(line.startswith("cleanup/") for line in steps["4"])
    assert any("/spare.0 (" in line for line in steps["10"])
    index = [line for line in steps["12"] if line.startswith("domains/")]
    # the domain index holds no link: its directories and each domain's empty anchor
    assert all(line.endswith("/") or line.endswith("/anchor (0 B)") for line in index), index
    assert any(line.endswith("/anchor (0 B)") for line in index)
    assert [line for line in steps["12"] if line not in index] == [
                           "cleanup/", "data/", "held/", "inflight/", "owners/gate.lock (0 B)",
                           "quarantine/", "queue-ref.format (74 B)", "queue/",
                           "tmp/"]  # no message, link or spare


def test_demo_refuses_a_directory_that_is_not_empty(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["demo", "--dir", str(tmp_path)]) == 2
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert "is not empty; pass --force" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv", [["demo", "--bogus"]])
def test_demo_rejects_unknown_options(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
