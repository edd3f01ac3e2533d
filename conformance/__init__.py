"""The conformance suite: certify any Storage backend against the queue contract.

* ``queue-ref certify package.module:factory`` (``conformance.certify.certify_command``), or
  ``conformance.certify.suite_runner.certify(factory)`` from Python: runs every check, writes a
  certificate (JSON) and reports (Markdown, HTML).
* ``pytest --storage=package.module:factory``, or ``class TestMine(StorageSuite)``:
  the same checks as pytest tests (``conformance.pytest_plugin``).

Subpackages, each importing only those after it: ``certify`` (runner, certificate,
reports, replay), ``checks`` (one module per check), ``lockstep`` (the state machine),
``crashexplore`` (the crash explorer), ``harness`` (backend under test, check catalog,
results, profiles); ``examples`` holds backends to try.  ``conformance/README.md`` says
where each check is.

``StorageSuite`` is imported lazily so that importing this package (the CLI does) does
not import pytest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StorageSuite", "certify"]


def __getattr__(name: str) -> Any:
    if name == "StorageSuite":
        from conformance.certify.pytest_suite import StorageSuite

        return StorageSuite
    if name == "certify":
        from conformance.certify.suite_runner import certify

        return certify
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
