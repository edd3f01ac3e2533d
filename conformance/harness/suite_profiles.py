"""How hard the suite tries: the ``quick`` and ``thorough`` profiles.

``quick`` is for every commit (a backend is certified in about a minute on two cores);
``thorough`` is for a release.  Both run every check; they differ in how many examples,
crash trials and workloads they try, and in whether a failing lockstep run is shrunk to
a minimal one (thorough) or reported as found (quick: the run stops at the first
violating step, so the steps shown end there).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, Verbosity, settings


@dataclass(frozen=True)
class Profile:
    name: str
    lockstep_examples: int
    lockstep_steps: int
    kill_trials: int  # black-box process-kill trials
    kill_ops: int  # length of the workload a killed child runs
    recovery_trials: int
    crash_bound: int  # exhaustive crash exploration: workloads of up to this many calls
    crash_random: int  # random long workloads explored
    crash_random_length: int
    fault_trials: int  # I/O-error injections
    many_recipients: int
    many_full_drain: bool  # lifecycle of every one of the many entries, or of a sample
    streaming_bytes: int
    streaming_peak_limit: int  # bytes of Python heap allowed while streaming
    threads: int
    thread_messages: int
    processes: int
    shrink: bool  # shrink a failing lockstep run to a minimal one (slow: many reruns)
    #: crash every operation after a prefix that reaches its state (full coverage)
    crash_targeted: bool = True
    #: damage at rest: every file in every way (else every file once, in a random way)
    damage_every_way: bool = False
    #: group commit: trials of concurrent enqueuers with one sync failing (the first: none)
    group_commit_trials: int = 6
    #: power cuts per group-commit trial at acknowledgements (None: at every one)
    group_commit_cuts: int | None = 2
    #: linearizable: rounds of callers at once; threads and processes (processes only
    #: with Capability.MULTI_PROCESS) per round; operations per caller; the search bound
    #: (model steps per entry; a search that hits it makes the check an ERROR)
    linearizable_rounds: int = 20
    linearizable_threads: int = 3
    linearizable_processes: int = 2
    linearizable_ops: int = 10
    linearizable_bound: int = 200_000
    #: lifecycle edges: stop points tried per operation (None: every one), on both
    #: targets (one- and two-recipient messages) or one chosen by the seed, and SIGSTOP
    #: trials per operation for a backend without the I/O seam
    edges_stops: int | None = 5
    edges_all_targets: bool = False
    edges_signal_trials: int = 3
    #: black-box power loss (strace): traced workloads, their length, crash points in
    #: flight per workload besides the acknowledgements (0: all), crash states per point
    blackbox_trials: int = 2
    blackbox_length: int = 8
    blackbox_points: int = 12
    blackbox_exhaustive_limit: int = 3
    blackbox_random_states: int = 4
    blackbox_max_states: int = 16
    #: bounded disk: rounds of restarts and of killed owners
    growth_rounds: int = 9
    #: power cuts in sync rounds: at every mutating call (else only at acknowledgements
    #: and at rest), pending operations enumerated in full per cut (beyond: targeted
    #: states), random states added per cut, states judged per cut (0: all built)
    rounds_crash_every_call: bool = False
    rounds_crash_exhaustive_limit: int = 3
    rounds_crash_random_states: int = 2
    rounds_crash_max_states: int = 6

    def hypothesis_settings(self) -> settings:
        phases = [Phase.explicit, Phase.reuse, Phase.generate]
        return settings(
            phases=[*phases, Phase.shrink] if self.shrink else phases,
            max_examples=self.lockstep_examples,
            stateful_step_count=self.lockstep_steps,
            deadline=None,
            database=None,
            derandomize=False,
            print_blob=False,
            verbosity=Verbosity.quiet,
            suppress_health_check=list(HealthCheck),
        )


QUICK = Profile(
    name="quick", lockstep_examples=25, lockstep_steps=25, kill_trials=8, kill_ops=40,
    recovery_trials=3, crash_bound=2, crash_random=2, crash_random_length=8,
    fault_trials=40, many_recipients=10_000, many_full_drain=False,
    streaming_bytes=100 * 1024 * 1024, streaming_peak_limit=16 * 1024 * 1024,
    threads=4, thread_messages=10, processes=3, shrink=False,
)

THOROUGH = Profile(
    name="thorough", lockstep_examples=200, lockstep_steps=60, kill_trials=60,
    kill_ops=120, recovery_trials=20, crash_bound=3, crash_random=20,
    crash_random_length=20, fault_trials=80, many_recipients=10_000, many_full_drain=True,
    streaming_bytes=100 * 1024 * 1024, streaming_peak_limit=16 * 1024 * 1024,
    threads=8, thread_messages=40, processes=4, shrink=True, damage_every_way=True,
    group_commit_trials=30, group_commit_cuts=None,
    linearizable_rounds=200, linearizable_threads=4,
    linearizable_processes=3, linearizable_ops=12, linearizable_bound=2_000_000,
    edges_stops=None, edges_all_targets=True, edges_signal_trials=12, growth_rounds=24,
    blackbox_trials=4, blackbox_length=12, blackbox_points=0,
    blackbox_exhaustive_limit=6, blackbox_random_states=16, blackbox_max_states=0,
    rounds_crash_every_call=True, rounds_crash_exhaustive_limit=6, rounds_crash_random_states=8,
    rounds_crash_max_states=0,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (QUICK, THOROUGH)}


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
