"""The conformance suite's parts: clause table, factories, certificate logic, lockstep machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.certify import certificate_report
from conformance.certify.certificate import (
    CERTIFIED,
    KNOWN_FAILURES,
    NOT_CERTIFIED,
    Certificate,
    Expectation,
    load_expectations,
)
from conformance.certify.scenario_replay import replay
from conformance.checks import bad_input_check
from conformance.harness.backend_factory import Backend, FactoryError, load_factory
from conformance.harness.check_catalog import (
    BY_ID,
    CAPABILITY_CLAUSES,
    CHECKS,
    NO_CRASH,
    PROCESS_KILL,
    checks_for,
)
from conformance.harness.check_results import CheckResult, Finding, Status
from conformance.harness.suite_profiles import QUICK
from conformance.lockstep import ClauseViolation, lockstep_machine, run_lockstep
from queue_ref.memory import MemoryStorage
from queue_ref.storage import Capability
from spec.crash import CLAUSES
from tests.conformance_support import DoubleClaim, LeakyCleanup


def test_every_clause_has_a_core_check() -> None:
    for clause in CLAUSES:
        if clause in CAPABILITY_CLAUSES:  # a capability's clause: checked where declared
            checks = checks_for(clause)
            assert checks and all(CAPABILITY_CLAUSES[clause] in c.requires for c in checks)
            continue
        core = [c.id for c in checks_for(clause) if c.level.value == "core"]
        assert core, f"{clause} is tested by no core check"


def test_optional_checks_name_their_capability() -> None:
    for c in CHECKS:
        assert (c.level.value == "optional") == bool(c.requires or c.excludes), c.id


def test_load_factory_forms() -> None:
    assert load_factory("queue_ref.memory:MemoryStorage") is MemoryStorage
    fn = load_factory("conformance.examples.backends:kv_log")
    assert callable(fn)
    b = Backend.from_factory("conformance.examples.sqlite_backend:factory")
    assert b.takes_root and not b.takes_io
    b = Backend.from_factory("conformance.examples.peers.chasquid:factory")
    assert b.takes_io
    b = Backend.from_factory(MemoryStorage)
    assert not b.takes_root and b.name == "queue_ref.memory:MemoryStorage"


@pytest.mark.parametrize("path, message", [
    ("no_colon", "package.module:factory"),
    ("no.such.module:f", "cannot import"),
    ("queue_ref.memory:Nope", "no attribute"),
    ("queue_ref.storage:MAX_ADDRESS", "not callable"),
])
def test_load_factory_errors(path: str, message: str) -> None:
    with pytest.raises(FactoryError, match=message):
        load_factory(path)


def test_factory_with_wrong_arity_is_refused() -> None:
    def three(a: str, b: object, c: object) -> MemoryStorage:
        return MemoryStorage()

    with pytest.raises(FactoryError, match="accepts none of these"):
        Backend.from_factory(three)


def test_factory_not_returning_a_storage_is_refused(tmp_path: Path) -> None:
    def bad(root: str) -> object:
        return {}

    with pytest.raises(FactoryError, match="not a Storage"):
        Backend.from_factory(bad).open(str(tmp_path))  # type: ignore[arg-type]


def test_probe_reads_capabilities() -> None:
    p = Backend.from_factory("conformance.examples.sqlite_backend:factory").probe()
    assert p.storage_class.endswith("SqliteStorage")
    assert Capability.MULTI_PROCESS in p.capabilities


def test_expectations_file(tmp_path: Path) -> None:
    f = tmp_path / "xfail.txt"
    f.write_text("# clause model reason\nC1 process-kill  # memory keeps nothing\nC4\n")
    got = load_expectations(str(f))
    assert got == [Expectation("C1", "process-kill", "memory keeps nothing"),
                   Expectation("C4", "*", "")]
    f.write_text("C99 weak\n")
    with pytest.raises(ValueError, match="C99"):
        load_expectations(str(f))
    f.write_text(json.dumps([{"clause": "C2", "model": "weak", "reason": "r"}]))
    assert load_expectations(str(f)) == [Expectation("C2", "weak", "r")]


def _cert(results: list[CheckResult], expectations: list[Expectation] | None = None,
          models: list[str] | None = None) -> Certificate:
    return Certificate("x:f", "X", [], "quick", models or [PROCESS_KILL], 1, results,
                       expectations or [])


def _passing(models: list[str]) -> list[CheckResult]:
    out = []
    for c in CHECKS:
        cols = [NO_CRASH] if not c.crash else [m for m in models
                                               if c.seam_only or m == PROCESS_KILL]
        for col in cols:
            status = Status.UNSUPPORTED if c.requires else Status.PASS
            out.append(CheckResult(c.id, col, status))
    return out


def test_certificate_status_logic() -> None:
    results = _passing([PROCESS_KILL])
    cert = _cert(results)
    assert cert.status() == CERTIFIED and cert.exit_code() == 0
    assert cert.certified_models() == [PROCESS_KILL]
    m = cert.matrix()
    assert m["C7"][NO_CRASH].status is Status.PASS
    assert "multi-process" in m["C7"][NO_CRASH].unsupported

    bad = Finding("C1", "lost", "process-kill:1:2:40", PROCESS_KILL)
    results[[r.check for r in results].index("process-kill")] = CheckResult(
        "process-kill", PROCESS_KILL, Status.FAIL, [bad])
    cert = _cert(results)
    assert cert.status() == NOT_CERTIFIED and cert.exit_code() == 1
    assert cert.matrix()["C1"][PROCESS_KILL].scenarios == ["process-kill:1:2:40"]
    assert cert.matrix()["C2"][PROCESS_KILL].status is Status.PASS

    cert = _cert(results, [Expectation("C1", "*", "known")])
    assert cert.status() == KNOWN_FAILURES and cert.exit_code() == 3
    cert = _cert(results, [Expectation("C1", "weak", "other model")])
    assert cert.status() == NOT_CERTIFIED


def test_power_loss_models_are_unsupported_without_the_seam() -> None:
    models = [PROCESS_KILL, "weak"]
    cert = _cert(_passing(models), models=models)
    assert cert.unsupported_models() == ["weak"]
    assert cert.certified_models() == [PROCESS_KILL]
    assert cert.matrix()["C1"]["weak"].status is Status.UNSUPPORTED
    assert cert.status() == CERTIFIED
    only_weak = _cert(_passing(["weak"]), models=["weak"])
    assert only_weak.status() == NOT_CERTIFIED
    assert "no crash model could be checked" in only_weak.reasons()[0]


def test_error_counts_as_not_certified() -> None:
    results = _passing([PROCESS_KILL])
    results[0] = CheckResult(results[0].check, NO_CRASH, Status.ERROR, note="boom")
    cert = _cert(results)
    assert cert.status() == NOT_CERTIFIED
    assert any("could not be checked" in r for r in cert.reasons())


def test_certificate_round_trips_and_renders() -> None:
    results = _passing([PROCESS_KILL])
    results.append(CheckResult("lockstep", NO_CRASH, Status.FAIL,
                               [Finding("C7", "claimed <twice>", "lockstep:quick:seed=3",
                                        NO_CRASH, ("enqueue(...)", "send_start(0, 0)"))]))
    cert = _cert(results)
    again = Certificate.from_json(json.loads(json.dumps(cert.to_json())))
    assert again.to_json() == cert.to_json()
    html = certificate_report.html(cert)
    assert "claimed &lt;twice&gt;" in html and "<table>" in html
    assert 'href="#s-lockstep-quick-seed-3"' in html and 'id="s-lockstep-quick-seed-3"' in html
    md = certificate_report.markdown(cert)
    assert "| C7 Exclusive claim | FAIL [lockstep:quick:seed=3]" in md
    assert "--scenario lockstep:quick:seed=3" in md


def test_lockstep_passes_on_memory() -> None:
    assert run_lockstep(Backend.from_factory(MemoryStorage), QUICK, 5) == []


def test_lockstep_runs_without_pytest_machinery() -> None:
    machine = lockstep_machine(MemoryStorage, listing=True)
    run_state_machine_as_test(machine, settings=settings(QUICK.hypothesis_settings(),
                                                         max_examples=5))


def test_lockstep_names_the_clause_of_a_double_claim() -> None:
    found = run_lockstep(Backend.from_factory(DoubleClaim), QUICK, 1)
    assert [f.clause for f in found] == ["C7"]
    assert "send_start" in found[0].steps[-1] or "drain" in found[0].steps[-1]
    # the seed replays the same minimal failure
    again = run_lockstep(Backend.from_factory(DoubleClaim), QUICK, 1)
    assert again == found
    assert found[0].scenario == "lockstep:quick:seed=1"
    assert replay(Backend.from_factory(DoubleClaim), found[0].scenario) == found


def test_lockstep_names_the_clause_of_a_leak() -> None:
    found = run_lockstep(Backend.from_factory(LeakyCleanup), QUICK, 2)
    assert [f.clause for f in found] == ["C8"]


def test_lockstep_machine_raises_clause_violations_under_pytest() -> None:
    machine = lockstep_machine(DoubleClaim)
    with pytest.raises(ClauseViolation) as info:
        run_state_machine_as_test(machine, settings=settings(
            QUICK.hypothesis_settings(), derandomize=True, max_examples=100))
    assert info.value.clause == "C7"


def test_bad_input_passes_on_memory_and_catches_a_double_claim() -> None:
    assert bad_input_check.run(Backend.from_factory(MemoryStorage)).status is Status.PASS
    res = bad_input_check.run(Backend.from_factory(DoubleClaim))
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C7"}
    assert all(f.scenario.startswith("bad-input:") for f in res.findings)


def test_check_ids_are_stable() -> None:
    assert list(BY_ID) == ["lockstep", "restart", "listing", "bad-input", "many-recipients",
                           "limits", "threads", "process-kill", "recovery-rerun", "crash-exploration",
                           "io-errors", "second-open", "multi-process", "reader-elsewhere", "streaming",
                           "damage-at-rest", "hold",
                           "group-commit", "sync-rounds", "sync-rounds-crash", "linearizable",
                           "lifecycle-edges", "bounded-disk", "full-disk", "blackbox-power-loss"]


def _child_echo(ch: object, value: object) -> None:
    from conformance.harness.child_process import Channel

    assert isinstance(ch, Channel)
    ch.send({"got": repr(value), "line": ch.recv()})


@pytest.mark.parametrize("arg", [7, lambda: 7], ids=["fresh-interpreter", "forked"])
def test_child_runs_fresh_or_forked(arg: object) -> None:
    """Picklable targets run in a new interpreter; others in a forked copy."""
    from conformance.harness.child_process import Child

    with Child(_child_echo, arg) as child:
        child.tell("hello")
        msgs = child.drain()
    assert msgs[0]["line"] == "hello" and msgs[-1] == {"end": True}
    assert (child._proc is None) == callable(arg)


@pytest.mark.parametrize("factory", [
    "conformance.examples.backends:fs",
    "conformance.examples.backends:kv_log",
    "conformance.examples.backends:kv_leveldb",
    "conformance.examples.sqlite_backend:factory",
])
def test_a_bad_queue_path_is_refused_by_every_backend(factory: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``""`` and a path with NUL are InvalidInputError (C12); a regular file is a
    QueueError.  The SQLite example once made a queue in the working directory for ``""``;
    nothing is left there now."""
    monkeypatch.chdir(tmp_path)
    res = bad_input_check.run(Backend.from_factory(factory))
    assert res.status is Status.PASS, [f.detail for f in res.findings]
    assert list(tmp_path.iterdir()) == []


def test_a_backend_that_does_not_check_its_path_fails_bad_root(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.chdir(tmp_path)
    res = bad_input_check.run(Backend.from_factory(
        "conformance.examples.broken_backends:sqlite_unchecked_root"))
    assert {f.scenario for f in res.findings} == {"bad-input:bad-root"}
    assert {f.clause for f in res.findings} == {"C12", "C9"}
    details = " | ".join(f.detail for f in res.findings)
    assert "opening the queue at ''" in details and "expected InvalidInputError" in details
    assert "regular file raised NotADirectoryError" in details
    assert list(tmp_path.iterdir()) == []  # the check made its "" queue in a scratch dir
