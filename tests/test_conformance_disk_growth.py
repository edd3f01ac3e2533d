"""The bounded-disk check (C8): the whole directory tree of a drained queue, counted after
bursts, restarts and killed owners, does not grow with use.  The project's backends pass;
three variants whose footprint() drains to zero while their directory grows are caught,
each by the part of the check that meets its leak, and the scenario replays."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from conformance.certify.scenario_replay import replay
from conformance.checks import disk_growth_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import BY_ID
from conformance.harness.suite_profiles import QUICK

GROWTH = "conformance.examples.broken_disk_growth"


@pytest.mark.parametrize("factory", [
    "conformance.examples.backends:fs",
    "conformance.examples.backends:kv_log",
    "conformance.examples.backends:kv_leveldb",
    "conformance.examples.sqlite_backend:factory",
])
def test_the_real_queues_keep_a_bounded_tree(factory: str) -> None:
    res = disk_growth_check.run(Backend.from_factory(factory), QUICK)
    assert res.findings == [], [f.detail for f in res.findings]
    assert res.stats["restart_rounds"] == res.stats["killed_rounds"] == QUICK.growth_rounds


def test_the_filesystem_queue_declares_its_spare_pool() -> None:
    res = disk_growth_check.run(Backend.from_factory("conformance.examples.backends:fs"),
                                replace(QUICK, growth_rounds=3))
    assert res.stats["pool_files"] == 64
    # the pool fills up to what it declares (one spare was already there after messages
    # one at a time), and no further
    assert 63 <= res.stats["at_once_top_names"] - res.stats["at_once_base_names"] <= 64


@pytest.mark.parametrize(("variant", "part"), [
    ("fs_spare_pool_unbounded", "a drained open queue holds"),
    ("fs_dead_owner_lock_kept", "a process that opened the queue"),
    ("kv_log_set_aside_every_open", "closed and opened"),
    ("fs_dead_index_links_kept", "after a process was killed inside its enqueue"),
    ("fs_dead_anchor_kept", "after a process was killed inside its enqueue (round 1)"),
])
def test_a_tree_that_grows_with_use_is_c8(variant: str, part: str) -> None:
    backend = Backend.from_factory(f"{GROWTH}:{variant}")
    res = disk_growth_check.run(backend, QUICK)
    assert res.findings and {f.clause for f in res.findings} == {"C8"}
    assert any(f.detail.startswith(part) for f in res.findings), [f.detail for f in res.findings]
    first = res.findings[0]
    assert first.scenario == f"bounded-disk:{QUICK.growth_rounds}"
    again = replay(backend, first.scenario)
    assert [f.clause for f in again] == [f.clause for f in res.findings]


def test_every_variant_keeps_a_footprint_of_zero() -> None:
    """What makes them slip past the other checks: their own count says nothing is left."""
    for variant in ("fs_spare_pool_unbounded", "fs_dead_owner_lock_kept",
                    "kv_log_set_aside_every_open", "fs_dead_index_links_kept",
                    "fs_dead_anchor_kept"):
        backend = Backend.from_factory(f"{GROWTH}:{variant}")
        root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"growth-{os.getpid()}-{variant}")
        os.makedirs(root)
        try:
            for _ in range(3):
                store = backend.open(root)
                disk_growth_check._enqueue(store, 5, "x")
                disk_growth_check.drain(store)
                fp = store.footprint()
                store.close()
                assert (fp.objects, fp.bytes) == (0, 0), variant
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def test_the_tree_counts_every_name_and_a_linked_file_once(tmp_path: os.PathLike[str]) -> None:
    root = str(tmp_path)
    os.mkdir(os.path.join(root, "d"))
    with open(os.path.join(root, "d", "a"), "wb") as f:
        f.write(b"x" * 100)
    os.link(os.path.join(root, "d", "a"), os.path.join(root, "b"))
    os.symlink("d/a", os.path.join(root, "c"))
    t = disk_growth_check.measure(root)
    assert (t.names, t.bytes) == (4, 100)


def test_a_dead_owners_fresh_anchor_is_a_kind_no_restart_leaves() -> None:
    """The variant keeps one name per owner that died replacing a full anchor: within the
    count's slack, so only the rule on kinds of names sees it, on the few-names round."""
    res = disk_growth_check.run(Backend.from_factory(f"{GROWTH}:fs_dead_anchor_kept"), QUICK)
    assert [f.clause for f in res.findings] == ["C8"]
    assert "names of a kind no clean restart round leaves: domains/#/anchor.#" in \
        res.findings[0].detail


def test_a_name_kind_masks_ids_and_keeps_words() -> None:
    kind = disk_growth_check.name_kind
    assert kind("domains/3f/anchor.18ebc1769b02a4f8") == "domains/#/anchor.#"
    assert kind("queue/18ebc176918f8df4.2") == "queue/#.#"
    assert kind("MANIFEST-000008") == "MANIFEST-#"
    assert kind("queue-ref.closed") == "queue-ref.closed"
    assert kind("data") == "data"


def test_the_check_is_core_and_tests_c8() -> None:
    spec = BY_ID["bounded-disk"]
    assert spec.clauses == ("C8",) and not spec.requires
