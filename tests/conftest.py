"""Shared test settings.

Hypothesis profiles, chosen by the environment variable QUEUE_REF_PROFILE:

* ``ci`` (default): few examples, no deadline; keeps the suite within CI's budget.
* ``thorough``: many examples and longer stateful runs, for local runs before a release.

Hypothesis prints the seed of a failing run (``print_blob``) so it can be replayed with
``@reproduce_failure`` or ``--hypothesis-seed``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get("QUEUE_REF_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise RuntimeError(f"QUEUE_REF_PROFILE must be 'ci' or 'thorough', not {PROFILE!r}")
settings.load_profile(PROFILE)


def thorough() -> bool:
    """True when the thorough profile is selected (tests may scale their sizes on it)."""
    return PROFILE == "thorough"


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """With QUEUE_REF_NO_SKIPS=1 (``.ci/run``), a skipped test fails the run: CI installs
    every tool the tests use (``make setup``), so a skip there means a broken setup whose
    tests silently did not run."""
    if os.environ.get("QUEUE_REF_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")  # type: ignore[attr-defined]
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        for rep in skipped[:20]:
            reporter.write_line(f"SKIPPED IN CI: {rep.nodeid}: {rep.longrepr}")
        reporter.write_line(f"{len(skipped)} tests were skipped; with QUEUE_REF_NO_SKIPS=1 "
                            "that fails the run (install what they need: make setup)")
        session.exitstatus = 1  # type: ignore[attr-defined]
