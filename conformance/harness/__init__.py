"""What every check of the suite shares: the backend under test (``backend_factory``),
the check catalog (``check_catalog``: which check tests which clause), the results a
check returns (``check_results``), the quick and thorough profiles (``suite_profiles``)
and child processes that run part of a check (``child_process``).

Depends on ``spec``, ``queue_ref`` and ``faultinject`` only; everything else in
``conformance`` builds on it.
"""
