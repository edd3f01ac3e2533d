"""benchmarks/campaign.py runs the three ways end to end and reports comparable figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_campaign_benchmark_reports_the_three_ways_and_the_overhead(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "campaign.py"), "--bound", "0",
         "--model", "process-kill", "--rounds", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same_answers"] is True and out["rounds"] == 1
    states = out["single_process"]["states"]
    assert states > 0
    for way in ("single_process", "multiprocess", "spark_local"):
        assert out[way]["states"] == states and out[way]["states_per_second"] > 0
    assert out["spark_overhead"] == round(out["spark_local"]["seconds"]
                                          / out["multiprocess"]["seconds"], 3)
    assert out["spark_local"]["session_start_seconds"] > 0
    assert os.listdir(tmp_path) == []


def test_campaign_benchmark_refuses_bad_parameters(tmp_path: Path) -> None:
    for args, says in ((["--rounds", "0"], "--rounds"), (["--model", "fast"], "model")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "campaign.py"), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
        assert proc.returncode == 2 and says in proc.stderr
