"""Crash models consistent with each other: process-kill states are ext4-ordered states are
weak states, on the project's backends and the broken variants; and a backend failing
under process-kill is never certified under weak."""

from __future__ import annotations

import pytest

from conformance.certify.certificate import Certificate
from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.broken_fs_variants import VARIANTS, Variant
from conformance.crashexplore.model_inclusion import workload_inclusion
from conformance.crashexplore.workloads import LIFE, targeted_workloads
from conformance.harness.check_catalog import CHECKS, NO_CRASH, PROCESS_KILL
from conformance.harness.check_results import CheckResult, Finding, Status
from spec.states import Op

BROKEN = "conformance.examples.broken_backends"


@pytest.mark.parametrize("backend", ["fs", "fs-fsync", "kv"])
def test_every_process_kill_state_is_an_ext4_ordered_and_a_weak_state(backend: str) -> None:
    spec = resolve(backend)
    points = 0
    for wl in [*targeted_workloads(), LIFE]:
        n, bad = workload_inclusion(spec, wl)
        assert bad == [], (backend, wl, bad[:3])
        points += n
    assert points > 50


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_the_inclusion_holds_on_the_broken_variants(variant: Variant) -> None:
    n, bad = workload_inclusion(resolve(variant.name), variant.witness)
    assert n > 0 and bad == []


@pytest.mark.parametrize("factory", ["swallow_eio", "fs_done_outside_seam"])
def test_the_inclusion_holds_on_the_broken_backends(factory: str) -> None:
    done = next(wl for wl in targeted_workloads() if wl[-1].op is Op.SEND_DONE)
    n, bad = workload_inclusion(resolve(f"{BROKEN}:{factory}"), done)
    assert n > 0 and bad == []


def test_a_backend_failing_process_kill_is_never_certified_under_weak() -> None:
    models = [PROCESS_KILL, "weak", "ext4-ordered"]
    results = []
    for c in CHECKS:
        cols = [NO_CRASH] if not c.crash else [m for m in models
                                               if c.seam_only or m == PROCESS_KILL]
        results += [CheckResult(c.id, col, Status.PASS) for col in cols]
    cert = Certificate("x:f", "X", ["io-seam"], "quick", models, 1, results)
    assert cert.certified_models() == models
    pk = [r.check for r in results].index("process-kill")
    results[pk] = CheckResult("process-kill", PROCESS_KILL, Status.FAIL,
                              [Finding("C1", "lost", "process-kill:1:2:40", PROCESS_KILL)])
    cert = Certificate("x:f", "X", ["io-seam"], "quick", models, 1, results)
    assert cert.matrix()["C1"]["weak"].status is Status.PASS  # weak's own checks passed
    assert cert.certified_models() == []
    reasons = cert.reasons()
    assert any("not certified under weak: it includes every state process-kill" in r
               for r in reasons)
    assert any("not certified under ext4-ordered" in r for r in reasons)
