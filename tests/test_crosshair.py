"""CrossHair checks the PEP316 contracts (``pre:``/``post:`` in docstrings) of the spec.

CI runs it on ``spec/states.py``, where every path is confirmed in about a second (the
inputs are enums).  The full run, which also covers ``spec/model.py`` (Schedule,
Model.enqueue/apply/restart) and ``spec/delivery_model.py`` (report_to, decide: floats, so
"not confirmed" over all paths, but a counterexample is found when one exists; about four
minutes in all), is ``make crosshair``::

    crosshair check --analysis_kind=PEP316 --per_condition_timeout=5 spec/states.py \
        spec/model.py spec/delivery_model.py

A second test breaks a copy of ``spec/states.py`` and asserts CrossHair catches it, so a
passing run means the contracts were checked, not skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STATES = ROOT / "spec" / "states.py"
TIMEOUT = 50  # seconds; a run takes about one


def crosshair(target: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316",
         "--report_all", "--per_condition_timeout=5", str(target)],
        cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )


def test_crosshair_confirms_states_contracts() -> None:
    out = crosshair(STATES, ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    confirmed = [line for line in out.stdout.splitlines() if "Confirmed over all paths" in line]
    n_conditions = sum(1 for line in STATES.read_text().splitlines()  # pre: is assumed
                       if line.strip().startswith("post:"))
    assert n_conditions >= 8
    assert len(confirmed) == n_conditions, out.stdout


@pytest.mark.parametrize(("original", "broken", "line_of"), [
    ("    EntryState.INFLIGHT: EntryState.QUEUED,\n",
     "    EntryState.INFLIGHT: EntryState.INFLIGHT,\n", "after_restart"),
    ("        return Outcome.MOVED, t.target\n",
     "        return Outcome.MOVED, t.source\n", "step"),
], ids=["restart-keeps-inflight", "move-to-source"])
def test_crosshair_catches_a_broken_table(
    tmp_path: Path, original: str, broken: str, line_of: str
) -> None:
    src = STATES.read_text()
    assert src.count(original) == 1
    target = tmp_path / "states_broken.py"
    target.write_text(src.replace(original, broken))
    out = crosshair(target, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"when calling {line_of}(" in out.stdout
