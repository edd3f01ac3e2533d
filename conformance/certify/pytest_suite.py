"""``StorageSuite``: the conformance suite as a pytest base class.

A backend opts in with one line (as with zarr's ``StoreTests``)::

    class TestMine(StorageSuite):
        factory = staticmethod(my_factory)

Each test runs one check of ``conformance.harness.check_catalog.CHECKS`` (the crash checks once per
crash model) through the same runner as ``queue-ref certify``.  A check the backend's
capabilities do not allow is skipped with the reason "unsupported: ..." (never passed);
a finding fails the test with the clause, the scenario id and its steps.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest

from conformance.harness.backend_factory import Backend, Factory, Probe
from conformance.harness.check_catalog import BY_ID, NO_CRASH, PROCESS_KILL
from conformance.harness.check_results import CheckResult, Status
from conformance.harness.suite_profiles import Profile
from conformance.harness.suite_profiles import get as get_profile

DEFAULT_MODELS = ("process-kill", "weak", "ext4-ordered")


def selected_models(config: pytest.Config) -> list[str]:
    raw = config.getoption("storage_models", default=None)
    if not raw:
        return list(DEFAULT_MODELS)
    return [m.strip() for m in raw.split(",") if m.strip()]


def _profile(config: pytest.Config, cls: type[StorageSuite]) -> Profile:
    name = cls.profile or config.getoption("storage_profile", default=None)
    if name is None:
        name = "thorough" if os.environ.get("QUEUE_REF_PROFILE") == "thorough" else "quick"
    return get_profile(name)


class StorageSuite:
    """Subclass with ``factory = staticmethod(f)``; optionally set ``profile``, ``seed``."""

    factory: ClassVar[Factory | str | None] = None
    profile: ClassVar[str | None] = None
    seed: ClassVar[int | None] = None
    _probes: ClassVar[dict[Any, tuple[Backend, Probe]]] = {}

    # ---- plumbing -----------------------------------------------------------------

    def _backend(self, config: pytest.Config) -> tuple[Backend, Probe]:
        cls = type(self)
        fac: Any = cls.__dict__.get("factory", cls.factory)
        if isinstance(fac, staticmethod):
            fac = fac.__func__
        if fac is None:
            fac = config.getoption("storage", default=None)
        if fac is None:
            pytest.fail(f"{cls.__name__} sets no factory and --storage was not given",
                        pytrace=False)
        key = (fac if isinstance(fac, str) else id(fac))
        if key not in StorageSuite._probes:
            backend = Backend.from_factory(fac)
            StorageSuite._probes[key] = (backend, backend.probe())
        return StorageSuite._probes[key]

    def _run(self, request: pytest.FixtureRequest, check: str,
             model: str = NO_CRASH) -> CheckResult:
        from conformance.certify.suite_runner import run_check

        config = request.config
        backend, probe = self._backend(config)
        spec = BY_ID[check]
        if spec.crash and model not in selected_models(config):
            pytest.skip(f"crash model {model} not among --storage-models")
        seed = type(self).seed
        if seed is None:
            seed = config.getoption("storage_seed", default=None) or 0
        res = run_check(spec, model, backend, probe, _profile(config, type(self)), seed)
        if res.status is Status.UNSUPPORTED:
            pytest.skip(f"unsupported: {res.note}")
        if res.status is Status.ERROR:
            pytest.fail(f"{check} could not run: {res.note}", pytrace=False)
        if res.findings:
            lines = [f"{check} under {model}: {len(res.findings)} finding(s)"]
            for f in res.findings:
                lines.append(f"{f.clause} [{f.scenario}] {f.detail}")
                lines += [f"    {s}" for s in f.steps[:40]]
            lines.append(f"replay: queue-ref certify {backend.name} --scenario "
                         f"{res.findings[0].scenario}")
            pytest.fail("\n".join(lines), pytrace=False)
        return res

    # ---- the checks ------------------------------------------------------------------

    def test_lockstep(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "lockstep")

    def test_restart(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "restart")

    def test_listing(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "listing")

    def test_bad_input(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "bad-input")

    def test_many_recipients(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "many-recipients")

    def test_limits(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "limits")

    def test_threads(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "threads")

    def test_process_kill(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "process-kill", PROCESS_KILL)

    def test_recovery_rerun(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "recovery-rerun", PROCESS_KILL)

    def test_crash_exploration(self, request: pytest.FixtureRequest,
                               queue_ref_crash_model: str) -> None:
        self._run(request, "crash-exploration", queue_ref_crash_model)

    def test_io_errors(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "io-errors")

    def test_second_open(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "second-open")

    def test_full_disk(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "full-disk")

    def test_reader_elsewhere(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "reader-elsewhere")

    def test_multi_process(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "multi-process")

    def test_streaming(self, request: pytest.FixtureRequest) -> None:
        self._run(request, "streaming")
