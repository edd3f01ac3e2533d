"""Run the scenario a report names again: ``queue-ref certify FACTORY --scenario ID``.

Scenario ids start with the check that found them:

* ``lockstep:<profile>:seed=N`` (also ``restart:``, ``listing:``): the hypothesis run of
  that seed, which finds the same minimal failing sequence again;
* ``process-kill:<seed>:<trial>:<length>``, ``recovery-rerun:...``: the same workload,
  killed during the same call after the same delay;
* ``io-errors:<seed>:<trial>``: the same workload, the same failing call;
* ``linearizable:<profile>:<seed>:<round>``, ``linearizable:race:<race>:<call>``: that
  round's callers with the same plans (run again until it fails, a few times: the
  interleaving is the machine's), or that race with the caller stopped at the same call;
* ``blackbox-power-loss:<seed>:<trial>:<length>:<model>:<point>:<key>``: the workload
  traced again, the named crash state of its first ``point`` calls recovered;
* ``bad-input:<case>``, ``limits:<case>``, ``many-recipients:<n>``, ``threads:<seed>``,
  ``multi-process:<seed>``, ``second-open``, ``reader-elsewhere``, ``streaming:<bytes>``,
  ``bounded-disk:<rounds>``, ``full-disk:<seed>``: that check again;
* ``lifecycle-edges:<op>:<target>:<stop>``: that trial again (the same stop point, or
  the same SIGSTOP delay);
* ``sync-rounds:<A>-vs-<B>:<j>``: A stopped inside its j-th sync call again while B runs;
* ``sync-rounds-crash:<A>-vs-<B>:<j>:<model>:<cut>``: that interleaving again, and every
  state (thorough's bounds) a power cut at that trace index (or ``rest``) leaves;
* anything else is handed to the crash explorer (``conformance.checks.crash_exploration_check``).
"""

from __future__ import annotations

from dataclasses import replace

from conformance import lockstep
from conformance.checks import (
    bad_input_check,
    blackbox_power_loss_check,
    damage_at_rest_check,
    disk_growth_check,
    full_disk_check,
    io_errors_check,
    lifecycle_edges_check,
    limits_check,
    linearizability_check,
    multi_process_check,
    process_kill_check,
    reader_elsewhere_check,
    scale_checks,
    second_open_check,
    streaming_check,
    sync_rounds_check,
    sync_rounds_crash_check,
)
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Finding
from conformance.harness.suite_profiles import QUICK
from conformance.harness.suite_profiles import get as get_profile


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
        return process_kill_check.replay(backend, scenario)
    if head == "io-errors":
        return io_errors_check.replay(backend, scenario)
    if head == "blackbox-power-loss":
        return blackbox_power_loss_check.replay(backend, scenario)
    if head == "bad-input":
        return [f for f in bad_input_check.run(backend).findings if f.scenario == scenario]
    if head == "linearizable":
        return linearizability_check.replay(backend, scenario)
    if head == "limits":
        return limits_check.replay(backend, scenario)
    if head == "many-recipients":
        return scale_checks.many_recipients(backend, replace(QUICK, many_recipients=int(rest)),
                                     0).findings
    if head == "threads":
        return scale_checks.threads(backend, QUICK, int(rest)).findings
    if head == "second-open":
        return second_open_check.replay(backend)
    if head == "full-disk":
        return full_disk_check.replay(backend, scenario)
    if head == "reader-elsewhere":
        return reader_elsewhere_check.replay(backend)
    if head == "multi-process":
        return multi_process_check.run(backend, QUICK, int(rest)).findings
    if head == "lifecycle-edges":
        return lifecycle_edges_check.replay(backend, scenario)
    if head == "damage-at-rest":
        return damage_at_rest_check.replay(backend, scenario)
    if head == "bounded-disk":
        return disk_growth_check.run(backend, replace(QUICK, growth_rounds=int(rest))).findings
    if head == "streaming":
        return streaming_check.run(backend, replace(QUICK, streaming_bytes=int(rest))).findings
    if head == "sync-rounds":
        return sync_rounds_check.replay(backend, scenario)
    if head == "sync-rounds-crash":
        return sync_rounds_crash_check.replay(backend, scenario)
    from conformance.checks import crash_exploration_check

    found: list[Finding] = crash_exploration_check.replay(backend, scenario)
    return found
