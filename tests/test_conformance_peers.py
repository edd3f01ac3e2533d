"""The suite rejects each re-created peer protocol with the right clause, reproducibly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.certify.certificate import NOT_CERTIFIED
from conformance.certify.scenario_replay import replay
from conformance.certify.suite_runner import certify
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK

#: Exhaustive workloads of up to two calls, no random ones: enough to show each flaw.
SMALL = replace(QUICK, crash_bound=2, crash_random=0)

CASES = [
    # (peer, crash model, clause the suite must name)
    ("kannader", "process-kill", "C2"),  # one symlink per recipient: partial enqueue
    ("kannader", "weak", "C1"),  # no fsync at all
    ("maddy", "weak", "C6"),  # metadata published before the body is durable
    ("chasquid", "weak", "C1"),  # rename without a directory fsync
    ("zonemta", "weak", "C1"),  # unsynced log writes
]


@pytest.mark.parametrize("peer, model, clause", CASES,
                         ids=[f"{p}-{m}-{c}" for p, m, c in CASES])
def test_peer_is_rejected_with_the_right_clause(peer: str, model: str, clause: str) -> None:
    factory = f"conformance.examples.peers.{peer}:factory"
    cert = certify(factory, models=[model], profile=SMALL, seed=1,
                   only=["crash-exploration"], jobs=1)
    assert cert.status() == NOT_CERTIFIED
    cell = cert.matrix()[clause][model]
    assert cell.status is Status.FAIL, cert.reasons()
    assert cell.scenarios
    scenario = cell.scenarios[0]
    assert scenario.startswith(f"{factory}-{model}-")
    again = replay(Backend.from_factory(factory), scenario)
    assert clause in {f.clause for f in again}, again
    steps = next(f.steps for r in cert.results for f in r.findings if f.scenario == scenario)
    assert steps, "a finding comes with the steps that lead to it"


def test_peers_survive_what_they_do_handle() -> None:
    """Under a process kill, chasquid's and maddy's protocols hold (their flaws need a
    power cut): the suite does not accuse them of what they get right."""
    for peer in ("chasquid", "maddy"):
        cert = certify(f"conformance.examples.peers.{peer}:factory", models=["process-kill"],
                       profile=SMALL, seed=1, only=["crash-exploration"], jobs=1)
        assert cert.certified_models() == ["process-kill"], (peer, cert.reasons())
