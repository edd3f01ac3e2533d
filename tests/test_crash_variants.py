"""Sharpness: each broken filesystem queue is caught, on the clause it breaks.

Every variant of ``conformance.crashexplore.broken_fs_variants`` leaves out (or misplaces) one step of the
filesystem queue's protocol.  Exploring its witness workload under every persistence
model must report the variant's clause, and the shortest scenario found must replay by
its id alone.  The two "absorbed" variants show defences that make a step redundant.
The plain exhaustive pass at the bound of the witness finds them too (for a few variants
here; for all of them under the thorough profile).
"""

from __future__ import annotations

import pytest

from conformance.crashexplore.broken_fs_variants import VARIANTS, Variant
from conformance.crashexplore.crash_task import explore_task, task_for
from conformance.crashexplore.exploration import ExploreConfig, Summary, explore
from conformance.crashexplore.reproduction import reproduce
from faultinject.models import MODELS
from tests.conftest import thorough

CAUGHT = [v for v in VARIANTS if v.clause]
ABSORBED = [v for v in VARIANTS if not v.clause]


def _explore_witness(v: Variant) -> Summary:
    s = Summary(ExploreConfig(backend=v.name, models=tuple(MODELS)))
    s.add(explore_task(task_for(v.name, v.witness, tuple(MODELS))))
    return s


@pytest.mark.parametrize("variant", CAUGHT, ids=[v.name for v in CAUGHT])
def test_variant_is_caught_on_its_clause(variant: Variant) -> None:
    s = _explore_witness(variant)
    assert not s.errors
    minimal = s.minimal()
    assert variant.clause in minimal, f"found {s.violations}, expected {variant.clause}"
    # the clause is the main finding, not a side effect
    assert s.violations[variant.clause] >= max(s.violations.values()) // 4
    found = minimal[variant.clause]
    assert found.case.workload == variant.witness[:len(found.case.workload)]
    rep = reproduce(found.scenario)
    assert variant.clause in rep.outcome.clauses
    assert rep.outcome.violations == found.violations
    assert rep.outcome.trace_hash == found.trace_hash
    text = "\n".join(rep.lines())
    assert f"VIOLATION {variant.clause}" in text and found.scenario in text


@pytest.mark.parametrize("variant", ABSORBED, ids=[v.name for v in ABSORBED])
def test_absorbed_variant_breaks_nothing(variant: Variant) -> None:
    s = _explore_witness(variant)
    assert s.states > 100 and not s.errors
    assert not s.failures, [f.scenario for f in s.failures[:3]]


def test_reproduce_prints_the_crash_site_and_what_was_lost() -> None:
    s = _explore_witness(next(v for v in VARIANTS if v.name == "fs-broken-nosync-drop"))
    f = s.minimal()["C3"]
    rep = reproduce(f.scenario)
    assert rep.outcome.scenario == f.scenario
    assert "rename(queue/" in "\n".join(rep.dropped) and "cleanup/" in "\n".join(rep.dropped)
    assert "[call 1]" in "\n".join(rep.dropped)  # the drop's rename, never made durable
    assert rep.crash and " at queue_ref/fsqueue/" in rep.crash
    assert any(line.startswith("m0[0] ") for line in rep.recovered)  # resurrected
    assert rep.to_json()["clauses"] == ["C3"]


# Exhaustive passes (every workload up to the witness's length) over some variants, under
# the cheaper models; every variant whose witness is short enough, and every model, under
# the thorough profile.
_CHEAP = ("fs-broken-nosync-commit", "fs-broken-noorphans", "fs-broken-requeue-unlink-first",
          "fs-broken-swallow-eio")
EXHAUSTIVE = [v for v in CAUGHT if len(v.witness) <= 3 and (thorough() or v.name in _CHEAP)]
EXHAUSTIVE_MODELS = tuple(MODELS) if thorough() else ("process-kill", "ext4-ordered")


@pytest.mark.parametrize("variant", EXHAUSTIVE, ids=[v.name for v in EXHAUSTIVE])
def test_exhaustive_pass_finds_variant(variant: Variant) -> None:
    s = explore(ExploreConfig(backend=variant.name, models=EXHAUSTIVE_MODELS,
                              bound=len(variant.witness), recovery_sample=1))
    assert variant.clause in s.violations, s.violations
    best = s.minimal()[variant.clause]
    assert len(best.case.workload) <= len(variant.witness)
