"""The suite as ``pytest --storage=package.module:factory`` runs it (added by the plugin)."""

from __future__ import annotations

from conformance.certify.pytest_suite import StorageSuite


class TestStorage(StorageSuite):
    """Every check on the factory named by ``--storage``."""
