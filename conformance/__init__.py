"""The conformance suite: certify any Storage backend against the queue contract.

* ``queue-ref certify package.module:factory`` (``conformance.certify_cli``), or
  ``conformance.runner.certify(factory)`` from Python: runs every check, writes a
  certificate (JSON) and reports (Markdown, HTML).
* ``pytest --storage=package.module:factory``, or ``class TestMine(StorageSuite)``:
  the same checks as pytest tests (``conformance.pytest_plugin``).

``StorageSuite`` is imported lazily so that importing this package (the CLI does) does
not import pytest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StorageSuite", "certify"]


def __getattr__(name: str) -> Any:
    if name == "StorageSuite":
        from conformance.suite import StorageSuite

        return StorageSuite
    if name == "certify":
        from conformance.runner import certify

        return certify
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
