"""Crash exploration of backends with the I/O seam, through ``conformance.crashexplore``.

The suite hands the backend to the crash explorer (``conformance.crashexplore.exploration``): every
workload of up to ``profile.crash_bound`` calls (and ``profile.crash_random`` random
longer ones) is run through ``faultinject.FaultyIO``, crashed before and after each
mutating call and at rest after its calls returned, the disk rebuilt as each persistence
model allows, recovered and judged;
passing states are crashed again inside recovery, and the last call's fsyncs fail with
EIO once.  The explorer's failures become findings, per model, with its scenario ids
(``<backend>-<model>-<workload>-c<N><b|a>-s<key>`` for a crash inside a call,
``...-rest<K>-s<key>`` for one at rest after K calls returned), which
``queue-ref certify FACTORY --scenario ID`` (or ``queue-ref crash reproduce ID``) rebuilds.

Exploration reruns each workload once per crash point, so the backend must make the
same calls on every run (no random or time-based names while opened through a seam).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from conformance.crashexplore.backend_registry import REGISTRY, UnknownBackendError, resolve
from conformance.crashexplore.crash_scenario import AT_REST, CaseOutcome
from conformance.crashexplore.crash_scenario import NO_CRASH as CRASH_NO_CRASH
from conformance.crashexplore.exploration import ExploreConfig, explore
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.reproduction import reproduce
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.suite_profiles import Profile
from faultinject import MODELS

CHECK = "crash-exploration"
#: Findings per clause and model that get a full step-by-step reproduction.
EXPLAINED = 1


def registry_name(backend: Backend) -> str:
    """The name the crash explorer knows ``backend`` by (registering it if needed).

    A ``module:factory`` name the explorer resolves to the same callable is used as it
    is, so its scenario ids work with ``queue-ref crash reproduce`` too; anything else
    (a callable given to the pytest suite) is registered under a name without ':'.
    """
    try:
        spec = resolve(backend.name)
        if ":" in backend.name and spec.open == backend.factory:
            return backend.name
    except UnknownBackendError:
        pass
    name = "certify/" + re.sub(r"[^A-Za-z0-9._]+", "_", backend.name).strip("_")
    if name not in REGISTRY or REGISTRY[name].open != backend.open:
        REGISTRY[name] = BackendSpec(name, backend.open, f"certified factory {backend.name}")
    return name


def _steps(outcome: CaseOutcome, explain: bool) -> tuple[str, ...]:
    if explain:
        try:
            return tuple(reproduce(outcome.scenario).lines())
        except Exception as e:  # the reproduction is a courtesy; the finding stands
            return (f"(could not rebuild the scenario: {type(e).__name__}: {e})",)
    case = outcome.case
    lines = [f"{i}: {c.describe()}" for i, c in enumerate(case.workload)]
    if case.kind == "rest" or case.when == AT_REST:
        lines.append(f"crash at rest after {case.index} call(s) returned; "
                     f"disk: {outcome.description}")
    else:
        lines.append(f"{case.kind} at mutating call #{case.index} ({case.when}); "
                     f"disk: {outcome.description}")
    return tuple(lines)


def run_all(backend: Backend, models: Sequence[str], profile: Profile, seed: int,
            jobs: int = 1) -> list[CheckResult]:
    """Explore under every persistence model of ``models``; one result per model."""
    seam_models = [m for m in models if m in MODELS]
    if not seam_models:
        return []
    start = time.perf_counter()
    name = registry_name(backend)
    cfg = ExploreConfig(backend=name, models=tuple(seam_models), bound=profile.crash_bound,
                        random=profile.crash_random, random_length=profile.crash_random_length,
                        targeted=profile.crash_targeted,
                        seed=seed % (2**31), jobs=max(1, jobs))
    summary = explore(cfg)
    seconds = time.perf_counter() - start
    explained: dict[tuple[str, str], int] = {}
    per_model: dict[str, list[Finding]] = {m: [] for m in seam_models}
    for f in summary.failures:  # sorted shortest first
        model = f.case.model
        column = NO_CRASH if model == CRASH_NO_CRASH else model
        for clause, detail in f.violations:
            k = (column, clause)
            n = explained.get(k, 0)
            explained[k] = n + 1
            if n >= 5:
                continue
            finding = Finding(clause, detail, f.scenario, column, _steps(f, n < EXPLAINED))
            per_model.setdefault(model if model in per_model else seam_models[0],
                                 []).append(finding)
    out = []
    for m in seam_models:
        st = summary.per_model.get(m)
        stats: dict[str, object] = {
            "workloads": summary.workloads, "bound": cfg.bound, "random": cfg.random,
            "crash_points": st.points if st else 0, "states": st.states if st else 0,
            "recovery_states": st.recovery_states if st else 0,
            "eio_states": st.eio_states if st else 0,
            "distinct_states": len(st.images) if st else 0,
            "violations": dict(st.violations) if st else {},
            "coverage": {op: {"points": row[0], "crashed": row[1], "complete": row[2]}
                         for op, row in sorted(summary.coverage.get(m, {}).items())},
        }
        res = finished(CHECK, m, per_model.get(m, []), seconds=seconds / len(seam_models),
                       seed=seed, stats=stats)
        uncovered = summary.uncovered(m)
        if summary.errors and not res.findings and not (st and st.states):
            res.status = Status.ERROR
            res.note = f"exploration could not run: {summary.errors[0]}"
        elif uncovered and not res.findings:
            # A model is certified only when every operation was crashed at every one of
            # its mutating calls under it.
            res.status = Status.ERROR
            res.note = (f"incomplete coverage under {m}: {', '.join(uncovered)} never crashed "
                        "at every one of its mutating calls (no mutating call through the "
                        "I/O seam, or its crash states could not be built)")
        elif summary.errors:
            res.note = f"{len(summary.errors)} cases could not be built, e.g. {summary.errors[0]}"
        out.append(res)
    return out


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """Rebuild one scenario of the explorer and judge it again."""
    name = registry_name(backend)
    if not scenario.startswith(name + "-"):
        raise ValueError(f"{scenario!r} names another backend than {name!r}")
    rep = reproduce(scenario)
    if rep.outcome.error:
        raise ValueError(f"{scenario}: {rep.outcome.error}")
    model = rep.outcome.case.model
    column = NO_CRASH if model == CRASH_NO_CRASH else model
    steps = tuple(rep.lines())
    return [Finding(c, d, scenario, column, steps) for c, d in rep.outcome.violations]
