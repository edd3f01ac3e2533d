"""The damage-at-rest check: the project's backends pass it, each broken variant fails it
with its clause, and the two bugs it found are fixed (a KV log cut short brought back
delivered mail; a removed SQLite database started an empty queue)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance.checks import damage_at_rest_check
from conformance.checks.damage_at_rest_check import _plan
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK, THOROUGH
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import DamagedStoreError, Recipient, Schedule

BROKEN = "conformance.examples.broken_backends"
KV = "conformance.examples.backends:kv_log"
FS = "conformance.examples.backends:fs"


@pytest.mark.parametrize("factory", [
    "conformance.examples.backends:fs",
    "conformance.examples.backends:kv_log",
    "conformance.examples.backends:kv_leveldb",
    "conformance.examples.sqlite_backend:factory",
])
def test_the_projects_backends_pass(factory: str) -> None:
    res = damage_at_rest_check.run(Backend.from_factory(factory), QUICK, 7)
    assert res.status is Status.PASS, [f.detail for f in res.findings]
    assert res.stats["trials"] >= res.stats["files"] > 0


def test_a_reader_that_does_not_check_the_body_is_c6() -> None:
    res = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:fs_unverified_bodies"),
                                   QUICK, 7)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C6"}
    assert all("delivered with other bytes" in f.detail for f in res.findings)
    assert all(":data/" in f.scenario for f in res.findings)


def test_a_kv_queue_that_forgets_its_clean_close_is_c3() -> None:
    res = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:kv_resurrecting"),
                                   QUICK, 7)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C3"}
    assert all(("truncation of" in f.detail or "tail cut of" in f.detail) and ".log" in f.detail
               for f in res.findings)


@pytest.mark.parametrize("seed", [1, 7])
def test_a_store_that_calls_its_damage_a_disk_failure_is_c9(seed: int) -> None:
    """Refusing to open over a damaged engine is right; saying the disk failed (retry
    later) instead of that the store is damaged (repair it) is not.  The project's KV
    queue says DamagedStoreError and passes the same seeds."""
    res = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:kv_damage_as_disk_error"),
                                   QUICK, seed)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C9"}
    assert all("not DamagedStoreError" in f.detail and "StorageIOError" in f.detail
               for f in res.findings)
    real = damage_at_rest_check.run(Backend.from_factory(KV), QUICK, seed)
    assert real.status is Status.PASS and real.stats["refused"] > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_length_read_from_a_damaged_trailer_unchecked_is_caught_and_replayed(
        seed: int) -> None:
    """A trailer whose length is not bounded by its file's size makes opening read at a
    negative offset (EINVAL: the whole queue refused as a disk failure over one damaged
    message).  Framing flips (a digit near the end of a file) find it on every seed; each
    finding replays from its id alone, and the real queue passes that same trial."""
    broken = Backend.from_factory(f"{BROKEN}:fs_envelope_length_unbounded")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C9"}
    first = res.findings[0]
    assert "framing flip" in first.scenario and "Invalid argument" in first.detail
    again = damage_at_rest_check.replay(broken, first.scenario)
    trial = first.scenario.rsplit(":", 1)[0]  # the file's name differs in a new fill
    assert [(f.clause, f.scenario.rsplit(":", 1)[0]) for f in again] == [("C9", trial)]
    assert damage_at_rest_check.replay(Backend.from_factory(FS), first.scenario) == []
    assert damage_at_rest_check.run(Backend.from_factory(FS), QUICK, seed).status is Status.PASS


def test_memory_backend_is_unsupported_not_passed() -> None:
    res = damage_at_rest_check.run(Backend.from_factory("queue_ref.memory:MemoryStorage"),
                                   QUICK, 7)
    assert res.status is Status.UNSUPPORTED


def test_plan_damages_every_file_and_every_way_when_thorough() -> None:
    import random
    files = [f"f{i}" for i in range(40)]
    quick = _plan(files, False, random.Random(1))
    assert {f for f, _ in quick} == set(files) and len(quick) == 160
    thorough = _plan(files, True, random.Random(1))
    assert len(thorough) == len(set(thorough)) == 200
    assert thorough[:160] == quick  # the quick plan is the thorough one cut short
    assert THOROUGH.damage_every_way and not QUICK.damage_every_way


def test_a_log_cut_short_at_rest_does_not_bring_back_delivered_mail(tmp_path) -> None:
    root = str(tmp_path / "q")
    q = KvQueue.open_log(root)
    ids = []
    for i in range(3):
        with q.enqueue("a@example.org") as e:
            e.write(b"body %d" % i)
            ids.append(e.commit([Recipient(f"r{i}@example.net", Schedule(0))])[0])
    first = q.send_start(ids[0])
    assert first is not None
    done = q.send_done(first)
    assert done is not None and q.cleanup(done)
    q.close()
    log = max((p for p in os.listdir(root) if p.endswith(".log")),
              key=lambda p: os.path.getsize(os.path.join(root, p)))
    path = os.path.join(root, log)
    with open(path, "r+b") as f:  # cut the records that finished the first message
        f.truncate(os.path.getsize(path) * 3 // 4)
    q = KvQueue.open_log(root)
    try:
        listed = {h.message_id for h in q.list_queue()}
        assert ids[0].message_id not in listed
        report = q.last_recovery
        assert report is not None and report.damage_found
        assert any("came back after damage at rest" in p for p in report.problems) or (
            ids[0].message_id not in listed and report.lost)
    finally:
        q.close()


def test_a_removed_sqlite_database_is_refused_not_started_empty(tmp_path) -> None:
    from conformance.examples.sqlite_backend import factory
    root = str(tmp_path / "q")
    os.makedirs(root)
    q = factory(root)
    with q.enqueue("a@example.org") as e:
        e.write(b"acknowledged")
        e.commit([Recipient("b@example.net", Schedule(0))])
    q.close()
    os.unlink(os.path.join(root, "queue.sqlite3"))
    with pytest.raises(DamagedStoreError, match="refusing to start an empty one"):
        factory(root)
    assert not os.path.exists(os.path.join(root, "queue.sqlite3"))


def test_the_sqlite_example_names_a_row_whose_recipient_a_flipped_bit_changed(tmp_path) -> None:
    """A bit flipped in the recipient of one entry row (``r1.0`` read as ``r1.1``) would
    deliver that message to someone else; the row's checksum catches it at open: the entry
    is quarantined, its message named lost, and the rest served."""
    from conformance.examples.sqlite_backend import factory

    root = str(tmp_path / "q")
    q = factory(root)
    mids = []
    for i in range(3):
        with q.enqueue("s@example.org") as e:
            e.write(b"body %d" % i)
            mids.append(e.commit([Recipient(f"r{i}.0@example.net", Schedule(0))])[0].message_id)
    q.close()
    path = os.path.join(root, "queue.sqlite3")
    data = bytearray(Path(path).read_bytes())
    at = data.find(b"r1.0@example.net")
    assert at >= 0 and data.find(b"r1.0@example.net", at + 1) == -1
    data[at + 3] ^= 1  # "0" -> "1"
    Path(path).write_bytes(bytes(data))
    q = factory(root)
    try:
        report = q.last_recovery
        assert report is not None and report.lost == (mids[1],)
        assert any("checksum" in p or "damaged" in p for p in report.problems)
        assert sorted(h.message_id for h in q.list_queue()) == sorted([mids[0], mids[2]])
    finally:
        q.close()
