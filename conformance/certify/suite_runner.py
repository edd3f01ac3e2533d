"""Run every check of ``conformance.harness.check_catalog.CHECKS`` on one backend; build the certificate.

Nothing here needs pytest: ``certify(factory)`` is what ``queue-ref certify`` and the
pytest plugin both call.  Each check gets its own seed derived from the run's seed and
its id, so one check can be run again alone with the same seed (``only=``).
"""

from __future__ import annotations

import datetime
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence

from conformance import lockstep
from conformance.certify.certificate import Certificate, Expectation, environment
from conformance.certify.hang_watchdog import Watchdog
from conformance.checks import (
    bad_input_check,
    blackbox_power_loss_check,
    crash_exploration_check,
    damage_at_rest_check,
    disk_growth_check,
    full_disk_check,
    group_commit_check,
    hold_check,
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
from conformance.harness.backend_factory import Backend, Factory, Probe
from conformance.harness.check_catalog import BY_ID, CHECKS, NO_CRASH, PROCESS_KILL, CheckSpec
from conformance.harness.check_results import CheckResult, Status, finished
from conformance.harness.suite_profiles import Profile
from conformance.harness.suite_profiles import get as get_profile

#: Crash models checked when none are named.
DEFAULT_MODELS = ("process-kill", "weak", "ext4-ordered")

Progress = Callable[[CheckResult], None]


def known_models() -> list[str]:
    """``process-kill`` and the persistence models of ``faultinject``."""
    from faultinject import MODELS

    return list(dict.fromkeys([PROCESS_KILL, *MODELS]))


def check_seed(seed: int, check: str) -> int:
    return zlib.crc32(f"{seed}:{check}".encode())


def _columns(spec: CheckSpec, models: Sequence[str]) -> list[str]:
    if not spec.crash:
        return [NO_CRASH]
    if spec.seam_only or spec.every_model:
        return list(models)
    return [PROCESS_KILL] if PROCESS_KILL in models else []


def _run_one(spec: CheckSpec, model: str, backend: Backend, probe: Probe, profile: Profile,
             seed: int) -> CheckResult:
    s = check_seed(seed, spec.id)
    if spec.id in ("lockstep", "restart", "listing"):
        t = time.perf_counter()
        found = lockstep.run_lockstep(backend, profile, s, check=spec.id,
                                      restarts=spec.id == "restart",
                                      listing=spec.id == "listing")
        return finished(spec.id, NO_CRASH, found, seconds=time.perf_counter() - t, seed=s,
                        stats={"examples": profile.lockstep_examples,
                               "steps": profile.lockstep_steps})
    if spec.id == "bad-input":
        return bad_input_check.run(backend)
    if spec.id == "many-recipients":
        return scale_checks.many_recipients(backend, profile, s)
    if spec.id == "limits":
        return limits_check.run(backend, profile)
    if spec.id == "threads":
        return scale_checks.threads(backend, profile, s)
    if spec.id == "multi-process":
        return multi_process_check.run(backend, profile, s)
    if spec.id == "second-open":
        return second_open_check.run(backend)
    if spec.id == "reader-elsewhere":
        return reader_elsewhere_check.run(backend)
    if spec.id == "streaming":
        return streaming_check.run(backend, profile)
    if spec.id == "group-commit":
        return group_commit_check.run(backend, profile, s)
    if spec.id == "sync-rounds":
        return sync_rounds_check.run(backend, s, probe.capabilities)
    if spec.id == "lifecycle-edges":
        return lifecycle_edges_check.run(backend, profile, s, probe.capabilities)
    if spec.id == "damage-at-rest":
        return damage_at_rest_check.run(backend, profile, s)
    if spec.id == "bounded-disk":
        return disk_growth_check.run(backend, profile)
    if spec.id == "full-disk":
        return full_disk_check.run(backend, s)
    if spec.id == "hold":
        return hold_check.run(backend)
    if spec.id == "linearizable":
        return linearizability_check.run(backend, profile, s, probe.capabilities)
    if spec.id == "process-kill":
        return process_kill_check.run_check(backend, "process-kill", s, profile.kill_trials,
                                  profile.kill_ops)
    if spec.id == "recovery-rerun":
        return process_kill_check.run_check(backend, "recovery-rerun", s, profile.recovery_trials,
                                  profile.kill_ops)
    if spec.id == "io-errors":
        return io_errors_check.run(backend, profile, s)
    if spec.id == "blackbox-power-loss":
        return blackbox_power_loss_check.run(backend, model, profile, s)
    raise ValueError(f"no runner for check {spec.id!r}")


def _unsupported(spec: CheckSpec, model: str, probe: Probe) -> CheckResult | None:
    if spec.supported(probe.capabilities):
        return None
    covered = [c.value for c in spec.excludes if c in probe.capabilities]
    if covered:
        return CheckResult(spec.id, model, Status.UNSUPPORTED,
                           note=f"the backend declares {', '.join(covered)}: the crash "
                                "exploration explores its crashes call by call")
    need = ", ".join(c.value for c in spec.requires if c not in probe.capabilities)
    return CheckResult(spec.id, model, Status.UNSUPPORTED,
                       note=f"the backend does not declare {need}")


def _errored(spec: CheckSpec, model: str, e: Exception, start: float) -> CheckResult:
    return CheckResult(spec.id, model, Status.ERROR,
                       note=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}",
                       seconds=time.perf_counter() - start)


def run_check(spec: CheckSpec, model: str, backend: Backend, probe: Probe, profile: Profile,
              seed: int, jobs: int = 1) -> CheckResult:
    """One check under one column; unsupported or errored checks become results too."""
    skipped = _unsupported(spec, model, probe)
    if skipped is not None:
        return skipped
    start = time.perf_counter()
    try:
        if spec.id == "crash-exploration":
            (res,) = crash_exploration_check.run_all(backend, [model], profile,
                                                     check_seed(seed, spec.id), jobs)
        elif spec.id == "sync-rounds-crash":
            (res,) = sync_rounds_crash_check.run_all(backend, [model], profile,
                                                     check_seed(seed, spec.id),
                                                     probe.capabilities)
        else:
            res = _run_one(spec, model, backend, probe, profile, seed)
    except Exception as e:
        return _errored(spec, model, e, start)
    res.model = model if spec.crash else res.model
    return res


def run_exploration(spec: CheckSpec, models: Sequence[str], backend: Backend, probe: Probe,
                    profile: Profile, seed: int, jobs: int) -> list[CheckResult]:
    """The crash exploration (or sync-rounds-crash) under all ``models`` at once (one
    explorer run; each interleaving run once)."""
    skipped = [_unsupported(spec, m, probe) for m in models]
    if any(s is not None for s in skipped):
        return [s for s in skipped if s is not None]
    start = time.perf_counter()
    try:
        if spec.id == "sync-rounds-crash":
            return sync_rounds_crash_check.run_all(backend, models, profile,
                                                   check_seed(seed, spec.id), probe.capabilities)
        return crash_exploration_check.run_all(backend, models, profile, check_seed(seed, spec.id), jobs)
    except Exception as e:
        return [_errored(spec, m, e, start) for m in models]


def certify(factory: Factory | str | Backend, *, models: Iterable[str] = DEFAULT_MODELS,
            profile: str | Profile = "quick", seed: int = 0,
            expectations: Sequence[Expectation] = (), only: Iterable[str] | None = None,
            progress: Progress | None = None, name: str | None = None,
            jobs: int = 1, fail_fast: bool = False, check_timeout: float | None = None,
            on_hang: Callable[[Certificate], None] | None = None) -> Certificate:
    """Run the suite on ``factory`` and return its certificate.

    With ``check_timeout`` every check (and the first opening of a queue, the probe) must
    finish within that many seconds: one that does not is a hang, reported as an ERROR
    naming the check and where it was stuck; ``on_hang`` gets the certificate so far
    (write it out there), and the process then ends with exit code 1
    (``conformance.certify.hang_watchdog``).

    With ``fail_fast`` the run stops after the first check that fails or errs (the rest
    are not run, so the certificate cannot say "certified"): a quick verdict for mutation
    testing and bisecting, never a full report.

    Raises ``conformance.harness.backend_factory.FactoryError`` when the factory cannot open a queue.
    """
    backend = factory if isinstance(factory, Backend) else Backend.from_factory(factory, name)
    prof = profile if isinstance(profile, Profile) else get_profile(profile)
    models = list(dict.fromkeys(models))
    unknown = [m for m in models if m not in known_models()]
    if unknown:
        raise ValueError(f"unknown crash models {unknown}; known: {', '.join(known_models())}")
    wanted = set(only) if only is not None else None
    if wanted is not None and wanted - set(BY_ID):
        raise ValueError(f"unknown checks {sorted(wanted - set(BY_ID))}; "
                         f"known: {', '.join(BY_ID)}")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    results: list[CheckResult] = []
    probe: Probe | None = None
    current: list[tuple[str, list[str]]] = [("probe", [NO_CRASH])]

    def certificate(done: list[CheckResult]) -> Certificate:
        return Certificate(
            backend=backend.name,
            storage_class=probe.storage_class if probe is not None else "(not opened)",
            capabilities=sorted(c.value for c in probe.capabilities) if probe else [],
            profile=prof.name, models=models, seed=seed, results=done,
            expectations=list(expectations), seconds=time.perf_counter() - t0,
            started=started, environment=environment())

    def hung(name: str, seconds: float, where: str, stack: str) -> None:
        check, cols = current[0]  # the step that is running: the watchdog holds it there
        note = (f"did not finish within {seconds:g} s, stuck in {where}: a hang (a deadlock "
                f"or an endless loop) in the backend or in the check; its stack:\n{stack}")
        stuck = [CheckResult(check, col, Status.ERROR, note=note, seconds=seconds)
                 for col in cols]
        for res in stuck:
            if progress is not None:
                progress(res)
        if on_hang is not None:
            on_hang(certificate([*results, *stuck]))

    watchdog = Watchdog(check_timeout, hung)
    with watchdog.step("probe"):
        probe = backend.probe()
    for spec in CHECKS:
        if wanted is not None and spec.id not in wanted:
            continue
        cols = _columns(spec, models)
        current[0] = (spec.id, cols)
        with watchdog.step(spec.id):
            if spec.id in ("crash-exploration", "sync-rounds-crash"):
                got = run_exploration(spec, cols, backend, probe, prof, seed, jobs)
            else:
                got = [run_check(spec, col, backend, probe, prof, seed, jobs) for col in cols]
        for res in got:
            results.append(res)
            if progress is not None:
                progress(res)
        if fail_fast and any(r.status in (Status.FAIL, Status.ERROR) for r in got):
            break
    return certificate(results)
