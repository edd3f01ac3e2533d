"""The multi-process check: processes race for the entries of one queue, one is killed
holding claims, and the entries adopted from it must carry their stored schedules."""

from __future__ import annotations

import pytest

from conformance.checks import multi_process_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK

VARIANT = "conformance.examples.broken_backends:fs_adopted_schedule_reset"


@pytest.mark.parametrize("factory", ["conformance.examples.backends:fs",
                                     "conformance.examples.backends:fs_fsync",
                                     "conformance.examples.sqlite_backend:factory"])
def test_the_projects_shared_backends_pass_and_the_killed_process_held_claims(factory):
    for seed in (1, 2):
        res = multi_process_check.run(Backend.from_factory(factory), QUICK, seed)
        assert res.status is Status.PASS, [f.detail for f in res.findings]
        # the killed process always dies holding claims (at least the two reserved
        # messages), and half of what is adopted is put back with send_cancel
        assert res.stats["claimed_by_killed"] >= 4
        assert res.stats["put_back"] >= 2


def test_an_adopted_handle_with_a_fresh_schedule_is_c11_on_every_seed():
    for seed in (1, 2, 3):
        res = multi_process_check.run(Backend.from_factory(VARIANT), QUICK, seed)
        assert res.status is Status.FAIL
        assert {f.clause for f in res.findings} == {"C11"}
        assert "carry a schedule other than the stored one" in res.findings[0].detail
