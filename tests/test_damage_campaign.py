"""One trial of every damage kind and of a full disk per backend (``benchmarks/damage.py``
runs many): nothing acknowledged is lost silently, nothing is delivered altered."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "damage.py"


def test_one_trial_of_each_damage_loses_nothing_silently(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = importlib.util.spec_from_file_location("damage_campaign", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["damage_campaign"] = mod
    spec.loader.exec_module(mod)
    code = mod.main(["--trials", "1", "--seed", "7"])
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["silent_losses"] == 0 and last["altered"] == 0, last
    assert code == 0
    kinds = {(r["backend"], r["damage"]) for r in last["rows"]}
    for backend, files in mod.FILES.items():
        for what in files:
            for kind in mod.DAMAGES:
                assert (backend, f"{what}: {kind}") in kinds
    detected = sum(r["detected"] for r in last["rows"])
    assert detected >= len(kinds) * 3 // 4  # most damage is seen (a removed lock is not)
