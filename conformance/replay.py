"""Run the scenario a report names again: ``queue-ref certify FACTORY --scenario ID``.

Scenario ids start with the check that found them:

* ``lockstep:<profile>:seed=N`` (also ``restart:``, ``listing:``): the hypothesis run of
  that seed, which finds the same minimal failing sequence again;
* ``process-kill:<seed>:<trial>:<length>``, ``recovery-rerun:...``: the same workload,
  killed during the same call after the same delay;
* ``io-errors:<seed>:<trial>``: the same workload, the same failing call;
* ``bad-input:<case>``, ``many-recipients:<n>``, ``threads:<seed>``,
  ``multi-process:<seed>``, ``streaming:<bytes>``: that check again;
* anything else is handed to the crash explorer (``conformance.explore``).
"""

from __future__ import annotations

from dataclasses import replace

from conformance import badinput, faults, killtest, lockstep, multiproc, scale, streaming
from conformance.factory import Backend
from conformance.profiles import QUICK
from conformance.profiles import get as get_profile
from conformance.results import Finding


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of ``scenario`` run again (empty: it did not fail this time)."""
    head, _, rest = scenario.partition(":")
    if head in ("lockstep", "restart", "listing"):
        profile_name, _, seed_part = rest.partition(":")
        if not seed_part.startswith("seed="):
            raise ValueError(f"{scenario!r}: expected {head}:<profile>:seed=N")
        return lockstep.run_lockstep(backend, get_profile(profile_name), int(seed_part[5:]),
                                     check=head,
                                     restarts=head == "restart", listing=head == "listing")
    if head in ("process-kill", "recovery-rerun"):
        return killtest.replay(backend, scenario)
    if head == "io-errors":
        return faults.replay(backend, scenario)
    if head == "bad-input":
        return [f for f in badinput.run(backend).findings if f.scenario == scenario]
    if head == "many-recipients":
        return scale.many_recipients(backend, replace(QUICK, many_recipients=int(rest)),
                                     0).findings
    if head == "threads":
        return scale.threads(backend, QUICK, int(rest)).findings
    if head == "multi-process":
        return multiproc.run(backend, QUICK, int(rest)).findings
    if head == "streaming":
        return streaming.run(backend, replace(QUICK, streaming_bytes=int(rest))).findings
    from conformance import explore

    found: list[Finding] = explore.replay(backend, scenario)
    return found
