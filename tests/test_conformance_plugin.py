"""The pytest plugin, used as a backend author outside the project would use it (pytester).

Inner runs are subprocesses: the suite forks children, and an in-process inner session
would re-import some of the project's modules and not others.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

THIRD_PARTY = '''
from conformance import StorageSuite
from queue_ref.memory import MemoryStorage


class TestMemory(StorageSuite):
    factory = staticmethod(MemoryStorage)
'''

BROKEN = '''
from queue_ref.memory import MemoryStorage
from queue_ref.storage import InflightMail, QueuedMail


class DoubleClaim(MemoryStorage):
    """send_start claims an entry even when another worker holds it."""

    def send_start(self, mail):
        h = self._take(mail, QueuedMail)
        e = self._entries.get(h.entry_id)
        if e is None or e.state == "cleanup":
            return None
        e.state = "inflight"
        return self._issue(InflightMail, h.entry_id, e.message_id, e.schedule)
'''


def test_plugin_is_inert_without_its_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_one():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1)


def test_plugin_adds_its_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*--storage=MODULE:FACTORY*", "*--storage-profile*"])


def test_one_line_opt_in_reports_memory_as_not_durable(pytester: pytest.Pytester) -> None:
    """MemoryStorage passes the semantic checks (limits included) and fails durability (C1) where it is
    tested; what it does not declare is skipped as unsupported, never passed."""
    pytester.makepyfile(test_mine=THIRD_PARTY)
    result = pytester.runpytest_subprocess("--storage-models=process-kill", "-rfs",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=6, failed=3, skipped=7)
    out = result.stdout.str()
    for name in ("test_restart", "test_process_kill", "test_recovery_rerun"):
        assert f"FAILED test_mine.py::TestMemory::{name}" in out
    assert "C1 [process-kill:" in out and "was lost" in out
    assert "replay: queue-ref certify queue_ref.memory:MemoryStorage --scenario" in out
    for cap in ("io-seam", "multi-process", "streaming-bodies"):
        assert f"unsupported: the backend does not declare {cap}" in out
    assert "every open is a new queue" in out  # second-open: no location to open twice
    assert "nothing on a disk to fill" in out  # full-disk: no directory to put on a tmpfs


def test_storage_option_runs_the_suite_on_a_factory(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--storage=conformance.examples.sqlite_backend:factory",
        "--storage-models=process-kill", "-k", "lockstep or bad_input or process_kill",
        "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*3 passed*"])


def test_storage_option_reports_the_clause_of_a_broken_backend(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(broken=BROKEN)
    result = pytester.runpytest_subprocess("--storage=broken:DoubleClaim", "-k", "bad_input",
                                           "-p", "no:randomly")
    result.assert_outcomes(failed=1)
    assert "C7 [bad-input:consumed-handle] send_start through a second handle" in \
        result.stdout.str()


def test_storage_option_with_a_bad_factory_fails_clearly(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--storage=no.such.module:factory", "-k", "bad_input",
                                "-p", "no:randomly")
    result.assert_outcomes(errors=0, failed=1)
    result.stdout.fnmatch_lines(["*cannot import 'no.such.module'*"])
