"""Power loss for backends outside the I/O seam: strace the run, rebuild the crash states.

A backend that does its own I/O (SQLite, a C library, a program in another language) is
run in a child process under strace (``conformance.blackbox.traced_workload``); the
calls it made under its directory become the seam's trace events
(``conformance.blackbox.syscall_events``), and ``faultinject.models.crash_states`` builds
the disks a crash may leave under each persistence model from them, as it does for
backends of the seam (the ALICE approach: the file system's behaviour is modelled, the
application is a black box).

*Crash points*: the position right after the call that acknowledged each workload
operation returned (all of them), plus positions after mutating calls made while an
operation was in flight (all in the thorough profile, a seeded sample in the quick one).
*States*: under ``process-kill`` the one disk where every call persisted; under ``weak``
and ``ext4-ordered`` the states ``crash_states`` chooses (exhaustive when few calls are
pending, else targeted and random ones), of which at most ``max_states`` per point are
recovered in the quick profile (always the one where everything persisted and the one
where the most was lost).

*Oracle*: the crash exploration's own.  Each disk is materialized in a fresh directory,
opened with the backend's factory (recovery runs), read back and drained
(``crashexplore.recovered_queue.inspect``) and judged by ``spec.crash.judge``: every
operation acknowledged before the crash point is there (C1 and the clauses of each
operation), the one in flight happened or not, nothing else; problems met while reading
(C6, C8, ...) are findings too.

Scenario ``blackbox-power-loss:<seed>:<trial>:<length>:<model>:<point>:<key>``: the
workload is traced again and the state ``key`` (``faultinject.explore``) of the first
``point`` events rebuilt; a backend whose calls vary from run to run (random names are
fine, a different number of calls is not) may not reproduce it, which the replay says.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from conformance.blackbox.traced_workload import Recording, record
from conformance.crashexplore.recovered_queue import Recovered, inspect, to_views
from conformance.crashexplore.traced_runs import image_digest, scratch_dir
from conformance.crashexplore.workload_driver import model_before
from conformance.crashexplore.workloads import Workload, random_workload
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.suite_profiles import Profile
from faultinject.disk import DiskImage, materialize
from faultinject.fault_errors import ModelError
from faultinject.models import CrashState, crash_state, crash_states
from spec.crash import judge

CHECK = "blackbox-power-loss"
#: Recordings kept for the other models of the same run (one trace serves every column).
_RECORDINGS: OrderedDict[tuple[str, int, int, int], Recording] = OrderedDict()
_KEEP = 8
#: A workload stops being crashed after this many failing points (the findings of one
#: clause are cut to five anyway; a backend that syncs nothing fails at every point).
FAILING_POINTS = 5


@dataclass(frozen=True)
class Bounds:
    """How much of the trace is crashed: per profile."""

    trials: int
    length: int
    points: int  # crash points in flight per trial besides the acknowledgements (0: all)
    exhaustive_limit: int
    random_states: int
    max_states: int  # states recovered per point and model (0: all chosen)

    @classmethod
    def of(cls, profile: Profile) -> Bounds:
        return cls(profile.blackbox_trials, profile.blackbox_length, profile.blackbox_points,
                   profile.blackbox_exhaustive_limit, profile.blackbox_random_states,
                   profile.blackbox_max_states)


@dataclass
class _Tally:
    points: int = 0
    states: int = 0
    recovered: int = 0
    syscalls: int = 0
    root_syscalls: int = 0
    events: int = 0
    record_seconds: float = 0.0
    unseen: list[str] = field(default_factory=list)


def _trial_workload(seed: int, trial: int, length: int) -> tuple[int, Workload]:
    wseed = random.Random(f"{CHECK}:{seed}:{trial}").randrange(2**32)
    return wseed, random_workload(wseed, length)


def recording(backend: Backend, seed: int, trial: int, length: int, *,
              fresh: bool = False) -> Recording:
    """The traced run of trial ``trial`` (cached for the other models of one run)."""
    key = (backend.name, seed, trial, length)
    got = None if fresh else _RECORDINGS.get(key)
    if got is None:
        _wseed, workload = _trial_workload(seed, trial, length)
        got = record(backend, workload)
        _RECORDINGS[key] = got
        if len(_RECORDINGS) > _KEEP:
            _RECORDINGS.popitem(last=False)
    return got


def crash_points(rec: Recording, limit: int, rng: random.Random) -> list[int]:
    """Acknowledgement points of every call, plus ``limit`` points in flight (0: all)."""
    acks: set[int] = set()
    inside: set[int] = set()
    for i in range(len(rec.workload)):
        w = rec.window(i)
        if w is None:
            continue
        begin, ack = w
        acks.add(ack)
        inside |= {p for p in range(begin + 1, ack) if rec.events[p - 1].mutating}
    rest = sorted(inside - acks)
    if limit and len(rest) > limit:
        rest = sorted(rng.sample(rest, limit))
    return sorted(acks | set(rest))


def pick_states(states: list[CrashState], max_states: int, rng: random.Random
                ) -> list[CrashState]:
    """At most ``max_states`` of ``states`` (0: all): the first (everything kept), the one
    that loses most, and a random sample of the rest, in their order."""
    if not max_states or len(states) <= max_states:
        return states
    most = max(range(len(states)), key=lambda n: (len(states[n].dropped) + len(states[n].torn), -n))
    keep = {0, most}
    others = [n for n in range(len(states)) if n not in keep]
    keep |= set(rng.sample(others, max(0, max_states - len(keep))))
    return [states[n] for n in sorted(keep)]


def _recover(backend: Backend, image: DiskImage, cache: dict[str, Recovered]) -> Recovered:
    """What the backend recovers from ``image`` (cached by the image's digest: the images
    themselves hold whole databases and would fill memory)."""
    key = image_digest(image)
    got = cache.get(key)
    if got is None:
        with scratch_dir("queue-ref-blackbox-state-") as d:
            materialize(image, d)
            got = inspect(lambda: backend.open(d))
        cache[key] = got
    return got


def _steps(rec: Recording, acked: int, in_flight: bool, point: int,
           state: CrashState) -> tuple[str, ...]:
    wl = rec.workload
    out = [f"{i}: {c.describe()}" for i, c in enumerate(wl[:acked])]
    if in_flight:
        out.append(f"{acked}: {wl[acked].describe()}  <- in flight at the crash")
    last = rec.events[point - 1].short() if point else "(nothing yet)"
    out.append(f"power cut after traced call {last} ({rec.events[point - 1].site if point else ''})")
    out.append(f"crash state {state.key}: {state.description}")
    return tuple(out)


def judge_state(backend: Backend, rec: Recording, point: int, state: CrashState,
                scenario: str, cache: dict[str, Recovered]) -> list[Finding]:
    """Findings of the disk ``state`` left by a crash after the first ``point`` events."""
    st = rec.status_at(point)
    pending = st.in_flight(rec.workload)
    before = model_before(rec.workload, st.acked)
    got = _recover(backend, state.image, cache)
    views = to_views(got, st.message_ids, st.entry_keys, before, pending)
    steps = _steps(rec, st.acked, pending is not None, point, state)
    where = f" (power cut under {state.model}, state {state.key})"
    found = [Finding(v.clause, v.detail + where, scenario, state.model, steps)
             for v in judge(before, pending, views)]
    found += [Finding(c, d + where, scenario, state.model, steps) for c, d in got.problems]
    return found


def _no_crash_findings(rec: Recording, scenario: str) -> list[Finding]:
    if rec.divergence is not None:
        clause, detail = rec.divergence
        return [Finding(clause, detail, scenario, NO_CRASH)]
    if rec.child_error is not None:
        return [Finding("C9", f"the traced child failed with no crash injected: "
                              f"{rec.child_error}", scenario, NO_CRASH)]
    return []


def run_trial(backend: Backend, model: str, seed: int, trial: int, bounds: Bounds,
              tally: _Tally) -> list[Finding]:
    rec = recording(backend, seed, trial, bounds.length)
    base = f"{CHECK}:{seed}:{trial}:{bounds.length}"
    tally.syscalls += rec.syscalls
    tally.root_syscalls += rec.root_syscalls
    tally.events += len(rec.events)
    tally.record_seconds += rec.seconds
    tally.unseen += [u for u in rec.unseen if u not in tally.unseen]
    found = _no_crash_findings(rec, base)
    if found:
        return found
    rng = random.Random(f"{base}:{model}")
    cache: dict[str, Recovered] = {}
    initial = DiskImage()
    failing = 0
    for point in crash_points(rec, bounds.points, rng):
        if failing >= FAILING_POINTS:
            break
        tally.points += 1
        try:
            states = crash_states(initial, rec.events[:point], model,
                                  exhaustive_limit=bounds.exhaustive_limit,
                                  random_states=bounds.random_states, seed=point)
        except ModelError as e:
            return [Finding("C9", f"the trace cannot be replayed on the file-system model: "
                                  f"{e}", base, model)]
        for state in pick_states(states, bounds.max_states, rng):
            tally.states += 1
            got = judge_state(backend, rec, point, state, f"{base}:{model}:{point}:{state.key}",
                              cache)
            if got:
                found += got
                failing += 1
                break
    tally.recovered += len(cache)
    return found


def run(backend: Backend, model: str, profile: Profile, seed: int) -> CheckResult:
    """The check under one crash model (a recording serves every model of one run)."""
    if not backend.takes_root:
        return CheckResult(CHECK, model, Status.UNSUPPORTED,
                           note="the factory takes no directory: nothing on disk to trace")
    start = time.perf_counter()
    bounds = Bounds.of(profile)
    tally = _Tally()
    findings: list[Finding] = []
    for trial in range(bounds.trials):
        findings += run_trial(backend, model, seed, trial, bounds, tally)
    note = ""
    if tally.unseen:
        note = ("strace cannot see " + "; ".join(tally.unseen)
                + ": crash states are built from the calls it saw")
    return finished(CHECK, model, findings, seconds=time.perf_counter() - start, seed=seed,
                    note=note,
                    stats={"trials": bounds.trials, "workload_length": bounds.length,
                           "crash_points": tally.points, "states": tally.states,
                           "distinct_disks_recovered": tally.recovered,
                           "syscalls_traced": tally.syscalls,
                           "syscalls_under_root": tally.root_syscalls,
                           "trace_events": tally.events,
                           "record_seconds": round(tally.record_seconds, 3)})


def parse_scenario(scenario: str) -> tuple[int, int, int, str, int, str]:
    """(seed, trial, length, model, point, key) of a scenario id."""
    parts = scenario.split(":")
    if len(parts) != 7 or parts[0] != CHECK:
        raise ValueError(f"{scenario!r} is not a {CHECK} scenario "
                         f"({CHECK}:<seed>:<trial>:<length>:<model>:<point>:<key>)")
    try:
        return (int(parts[1]), int(parts[2]), int(parts[3]), parts[4], int(parts[5]),
                parts[6])
    except ValueError:
        raise ValueError(f"{scenario!r}: seed, trial, length and point must be "
                         "integers") from None


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """Trace the scenario's workload again and judge the state it names."""
    seed, trial, length, model, point, key = parse_scenario(scenario)
    rec = recording(backend, seed, trial, length, fresh=True)
    found = _no_crash_findings(rec, f"{CHECK}:{seed}:{trial}:{length}")
    if found:
        return found
    if point > len(rec.events):
        raise ValueError(f"{scenario!r}: this run made {len(rec.events)} calls under the "
                         f"directory, fewer than the crash point {point}: the backend did "
                         "not repeat its calls")
    try:
        state = crash_state(DiskImage(), rec.events[:point], model, key)
    except ModelError as e:
        raise ValueError(f"{scenario!r}: the state cannot be rebuilt on this run's trace "
                         f"({e}): the backend did not repeat its calls") from e
    return judge_state(backend, rec, point, state, scenario, {})
