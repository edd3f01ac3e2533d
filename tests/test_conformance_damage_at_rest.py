"""The damage-at-rest check: the project's backends pass it, each broken variant fails it
with its clause, and the two bugs it found are fixed (a KV log cut short brought back
delivered mail; a removed SQLite database started an empty queue)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from conformance.checks import damage_at_rest_check
from conformance.checks.damage_at_rest_check import _plan
from conformance.checks.file_damage import ID_WINDOW, damage, held_whole, ids_readable
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import Finding, Status
from conformance.harness.suite_profiles import QUICK, THOROUGH
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import DamagedStoreError, Recipient, Schedule

BROKEN = "conformance.examples.broken_backends"


def second_seed(seed: int) -> object:
    """A second seed: run by ``make test-thorough``, not in CI's time budget."""
    return pytest.param(seed, marks=pytest.mark.thorough)


def cleanly_closed(findings: list[Finding]) -> list[Finding]:
    """The findings of the templates closed cleanly (``trial``, ``deep``): a variant's
    bug is judged there as before the killed templates came; what those add (the same bug
    met after a crash) is judged by tests of its own."""
    return [f for f in findings if "killed=" not in f.scenario]
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
    if ":kv_" in factory:  # each refusal declares its repair, and each repair was judged
        assert res.stats["repaired"] == res.stats["refused"] > 0


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


@pytest.mark.parametrize("seed", [1, second_seed(7)])
def test_a_store_that_calls_its_damage_a_disk_failure_is_c9(seed: int) -> None:
    """Refusing to open over a damaged engine is right; saying the disk failed (retry
    later) instead of that the store is damaged (repair it) is not.  The project's KV
    queue says DamagedStoreError and passes the same seeds."""
    res = damage_at_rest_check.run(Backend.from_factory(f"{BROKEN}:kv_damage_as_disk_error"),
                                   QUICK, seed)
    assert res.status is Status.FAIL
    found = cleanly_closed(res.findings)
    assert {f.clause for f in found} == {"C9"}
    assert all("not DamagedStoreError" in f.detail and "StorageIOError" in f.detail
               for f in found)
    real = damage_at_rest_check.run(Backend.from_factory(KV), QUICK, seed)
    assert real.status is Status.PASS and real.stats["refused"] > 0


@pytest.mark.parametrize("seed", [1, second_seed(2), second_seed(3)])
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


@pytest.mark.parametrize("seed", [1, second_seed(4)])
def test_damage_in_the_middle_of_a_log_taken_for_a_torn_tail_is_c6(seed: int) -> None:
    """A log read up to its first damaged record loses every later message.  The clean
    close names them, so none goes silently; but their records are intact, and a flip
    takes out no message whose body lies whole after it.  Extra bit flips of each file
    find it on any seed; the project's KV queue keeps those messages on the same seeds."""
    broken = Backend.from_factory(f"{BROKEN}:kv_mid_log_damage_as_torn_tail")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL
    found = cleanly_closed(res.findings)
    assert {f.clause for f in found} == {"C6"}
    first = found[0]
    assert "lie whole after the flipped byte" in first.detail and ".log" in first.detail
    assert "and the next body" in first.detail
    again = damage_at_rest_check.replay(broken, first.scenario)
    assert [f.detail for f in again] == [first.detail]
    assert damage_at_rest_check.run(Backend.from_factory(KV), QUICK, seed).status is Status.PASS


def test_a_table_miss_read_as_a_tombstone_loses_the_older_tables_keys() -> None:
    """Nothing is damaged: the deep template's first trial reads back a queue of two
    tables whose key ranges overlap, and the older table's message vanishes.  The id
    replays it; the project's KV queue passes that very trial."""
    broken = Backend.from_factory(f"{BROKEN}:kv_table_miss_as_tombstone")
    res = damage_at_rest_check.run(broken, QUICK, 3)
    assert res.status is Status.FAIL
    assert res.stats["deep_trials"] >= 1 and res.stats["deep_files"] >= 1  # the .tbl kind
    c6 = [f for f in cleanly_closed(res.findings) if f.clause == "C6"]
    assert c6 and all(f.scenario == "damage-at-rest:seed=3:deep=0:none:" for f in c6)
    assert "no damage: " in c6[0].detail and "neither delivered nor named lost" in c6[0].detail
    again = damage_at_rest_check.replay(broken, c6[0].scenario)
    assert c6[0].detail in [f.detail for f in again]
    assert damage_at_rest_check.replay(Backend.from_factory(KV), c6[0].scenario) == []


def test_a_half_checked_table_checksum_is_found_by_structure_flips() -> None:
    """Flips in a body are caught by the queue's digests whatever the table's checksum
    does; flips aimed at the table's keys and lengths find the weak checksum."""
    broken = Backend.from_factory(f"{BROKEN}:kv_table_checksum_half_checked")
    res = damage_at_rest_check.run(broken, QUICK, 3)
    assert res.status is Status.FAIL
    deep = [f for f in res.findings if ":deep=" in f.scenario]
    assert deep and all(":structure flip:" in f.scenario and ".tbl" in f.scenario
                        for f in deep)
    assert not [f for f in res.findings if ":trial=" in f.scenario]  # no table there
    # each replay fills a new queue whose creation times differ: whether the damaged
    # block's checksum compares below or above is then a coin, tossed up to 12 times
    again = damage_at_rest_check.replay(broken, deep[0].scenario)
    assert again and all(f.scenario == deep[0].scenario for f in again)
    assert {f.clause for f in again} & {"C6", "C9", "C13"}
    assert damage_at_rest_check.replay(Backend.from_factory(KV), deep[0].scenario) == []


def test_structure_flips_avoid_every_piece_of_a_body() -> None:
    body = bytes(range(256)) * 16  # 4 KiB: four pieces
    other = b"z" * 3000  # two pieces and a tail too short to be one
    data = b"KEY1" + body[:2048] + b"HDR" + body[2048:] + b"KEY2" + other + b"END"
    ranges = damage_at_rest_check.outside_bodies(data, [body, other])
    assert ranges == [(0, 4), (2052, 2055), (4103, 4107), (6155, 7110)]
    structure = b"".join(data[a:b] for a, b in ranges)
    assert structure == b"KEY1HDRKEY2" + b"z" * (3000 - 2048) + b"END"
    assert damage_at_rest_check.outside_bodies(b"only keys", [body]) == [(0, 9)]


def test_a_flip_locates_the_messages_after_it(tmp_path: Path) -> None:
    f = tmp_path / "log"
    f.write_bytes(b"head" + b"AAAA" + b"mid" + b"BBBB" + b"x" + b"DDDD" + b"tail")
    bodies = {"a": b"AAAA", "b": b"BBBB", "c": b"CCCC", "d": b"DDDD"}
    # the first body after the flip may share its record: only the ones after it count
    assert damage_at_rest_check.after_flip(f, 5, bodies) == {"d": 16}
    assert damage_at_rest_check.after_flip(f, 0, bodies) == {"b": 11, "d": 16}
    assert damage_at_rest_check.after_flip(f, 12, bodies) == {}
    assert damage_at_rest_check.after_flip(f, None, bodies) == {}


def test_memory_backend_is_unsupported_not_passed() -> None:
    res = damage_at_rest_check.run(Backend.from_factory("queue_ref.memory:MemoryStorage"),
                                   QUICK, 7)
    assert res.status is Status.UNSUPPORTED


def test_plan_damages_every_file_and_every_way_when_thorough() -> None:
    files = [f"f{i}" for i in range(40)]
    quick = _plan(files, False, random.Random(1))
    assert {f for f, _ in quick} == set(files) and len(quick) == 160
    thorough = _plan(files, True, random.Random(1))
    every_way = thorough[:200]
    assert len(every_way) == len(set(every_way)) == 200
    extra = thorough[200:]  # then more bit flips of every file, at other places
    assert len(extra) == 40 * damage_at_rest_check.EXTRA_FLIPS
    assert {k for _, k in extra} == {"bit flip"} and {f for f, _ in extra} == set(files)
    assert thorough[:160] == quick  # the quick plan is the thorough one cut short
    assert THOROUGH.damage_every_way and not QUICK.damage_every_way
    few = _plan(["log", "CURRENT"], False, random.Random(1))
    assert len(few) == 10 + 2 * damage_at_rest_check.EXTRA_FLIPS  # a few files: all of it


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


def test_a_damage_id_of_another_backend_is_refused_not_replayed_as_something_else() -> None:
    """The id names the trial's kind and file: a plan whose trial N is another damage
    (another backend, another version) says so instead of running it as if it were."""
    with pytest.raises(ValueError, match=r"not a removal of nonexistent\.file"):
        damage_at_rest_check.replay(Backend.from_factory(KV),
                                    "damage-at-rest:seed=1:trial=0:removal:nonexistent.file")
    with pytest.raises(ValueError, match="no trial 100000"):
        damage_at_rest_check.replay(Backend.from_factory(KV),
                                    "damage-at-rest:seed=1:trial=100000:removal:CURRENT")


@pytest.mark.parametrize(("old", "new"), [("body_size", "body_sizf"),
                                          ("TABLE messages", "TABLE messagds")])
def test_a_sqlite_schema_renamed_by_damage_is_refused_as_damaged(tmp_path: Path, old: str,
                                                                  new: str) -> None:
    """A flipped bit in ``sqlite_master`` renames a column (statements then fail with "no
    such column", blamed on nothing) or a table (``CREATE TABLE IF NOT EXISTS`` would
    start an empty one beside it): the SQLite example compares the schema with its own
    and refuses with DamagedStoreError, leaving the file as it was.  Found by the extra
    bit flips of damage-at-rest."""
    import sqlite3

    from conformance.examples.sqlite_backend import factory

    root = str(tmp_path / "q")
    q = factory(root)
    with q.enqueue("a@example.org") as enq:
        enq.write(b"body")
        enq.commit([Recipient("b@example.net", Schedule(0))])
    q.close()
    db = sqlite3.connect(os.path.join(root, "queue.sqlite3"))
    db.execute("PRAGMA writable_schema=ON")
    db.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) WHERE name = 'messages'",
               (old, new))
    db.commit()
    db.close()
    before = Path(root, "queue.sqlite3").read_bytes()
    with pytest.raises(DamagedStoreError, match="is damaged"):
        factory(root)
    assert Path(root, "queue.sqlite3").read_bytes() == before


@pytest.mark.parametrize("seed", [1, second_seed(7)])
def test_a_store_that_starts_afresh_over_its_files_is_c6(seed: int) -> None:
    """A KV engine that creates a new database when ``CURRENT`` is gone (LevelDB's
    ``create_if_missing``) names every message lost from its clean-close record, so
    nothing is lost silently; but the old log, whose bodies ``queue-ref repair`` would
    salvage, is gone.  Only the rule that the files a store cannot serve are kept sees
    it.  The finding replays from its id, and the project's KV queue (which refuses with
    DamagedStoreError and touches nothing) passes that trial."""
    broken = Backend.from_factory(f"{BROKEN}:kv_fresh_over_missing_current")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL
    found = cleanly_closed(res.findings)
    assert {f.clause for f in found} == {"C6"}
    assert all("removal of CURRENT" in f.detail and "gone from it" in f.detail
               for f in found), [f.detail for f in found]
    first = found[0]
    assert ":removal:CURRENT" in first.scenario
    again = damage_at_rest_check.replay(broken, first.scenario)
    assert [f.clause for f in again] == ["C6"]
    assert damage_at_rest_check.replay(Backend.from_factory(KV), first.scenario) == []


def test_held_whole_finds_a_body_only_while_it_is_on_the_disk(tmp_path: Path) -> None:
    body = b"Subject: kept\r\n\r\n" + b"x" * 5000
    (tmp_path / "log").write_bytes(b"header" + body + b"trailer")
    (tmp_path / "link").symlink_to("log")
    assert held_whole(str(tmp_path), {"m": body, "n": body + b"!"}) == {"m": "log"}
    (tmp_path / "log").write_bytes(b"header" + body[:-1])
    assert held_whole(str(tmp_path), {"m": body}) == {}


def test_a_quarantine_that_drops_an_intact_body_is_c6() -> None:
    """The template reschedules an entry of two messages, so their schedule records are
    damaged too.  A queue that deletes the body of a message whose last entry it
    quarantined for such a record names the message lost (nothing silent) but keeps
    nothing to salvage; the finding replays and the real queue passes that trial."""
    broken = Backend.from_factory(f"{BROKEN}:fs_quarantine_drops_body")
    res = damage_at_rest_check.run(broken, QUICK, 7)
    assert res.status is Status.FAIL
    found = cleanly_closed(res.findings)
    assert {f.clause for f in found} == {"C6"}
    # a body no keeper keeps goes with a damaged schedule record, and (the same bug) with
    # an entry whose link damage took while its message's other entry held the file
    assert all("gone from it" in f.detail for f in found)
    first = next(f for f in found if ".sched" in f.scenario)
    assert [f.clause for f in damage_at_rest_check.replay(broken, first.scenario)] == ["C6"]
    assert damage_at_rest_check.replay(Backend.from_factory(FS), first.scenario) == []


def test_a_refusal_declares_the_repair_that_salvages_the_store(tmp_path: Path) -> None:
    """The KV queue refusing a damaged store names ``queue-ref repair`` and carries it:
    running ``DamagedStoreError.repair`` leaves a store that opens and serves the intact
    message, and its report names the one the damage took."""
    root = str(tmp_path / "q")
    q = KvQueue.open_log(root)
    for i in range(2):
        with q.enqueue("s@example.org") as enq:
            enq.write(b"body %d" % i)
            enq.commit([Recipient(f"r{i}@example.net", Schedule(0))])
    q.close()
    os.unlink(os.path.join(root, "CURRENT"))
    with pytest.raises(DamagedStoreError, match="queue-ref repair") as refused:
        KvQueue.open_log(root)
    assert refused.value.repair is not None
    report = refused.value.repair()
    assert report.lost == () and report.lost_unknown == 0
    again = KvQueue.open_log(root)
    try:
        assert len(list(again.list_queue())) == 2
    finally:
        again.close()


@pytest.mark.parametrize("seed", [1, second_seed(26)])
def test_a_repair_that_leaves_a_store_that_cannot_open_is_c6(seed: int) -> None:
    """A repair that writes the salvaged store but keeps its in-progress mark leaves a
    store every open refuses.  The queue itself is the project's: only judging the
    repair a refusal declares sees it, the finding replays, and the project's KV queue
    passes that trial."""
    broken = Backend.from_factory(f"{BROKEN}:kv_repair_keeps_its_mark")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} == {"C6"}
    assert all("the repair it declares raised" in f.detail for f in res.findings), \
        [f.detail for f in res.findings]
    first = res.findings[0]
    assert [f.clause for f in damage_at_rest_check.replay(broken, first.scenario)] == ["C6"]
    assert damage_at_rest_check.replay(Backend.from_factory(KV), first.scenario) == []


def test_a_stray_link_is_added_beside_one_link_of_each_kind_early_in_the_plan() -> None:

    from conformance.checks.file_damage import STRAY, stray_name

    assert stray_name("queue/m1a.1") == "queue/m1a.8"
    assert stray_name("cleanup/0012") == "cleanup/19"
    assert stray_name("link") == "link.7"
    files = [f"f{i}" for i in range(40)] + ["queue/aa.0", "queue/aa.1", "cleanup/bb.0"]
    links = frozenset(files[40:])
    quick = _plan(files, False, random.Random(1), links)
    strays = [f for f, k in quick if k == STRAY]
    assert quick[43:45] == [(f, STRAY) for f in strays[:2]]  # right after every file once
    assert {f.split("/")[0] for f in strays[:2]} == {"queue", "cleanup"}
    thorough = _plan(files, True, random.Random(1), links)
    assert {f for f, k in thorough if k == STRAY} == links  # beside every link in the end
    assert all(f in links for f, k in thorough if k == STRAY)


@pytest.mark.parametrize("seed", [1, second_seed(26)])
def test_a_queue_that_trusts_a_link_name_it_never_wrote_is_c9(seed: int) -> None:
    """Damage that adds a name: a link ``queue/<m>.8`` beside a message of two
    recipients.  A queue that takes the index in the name on trust raises IndexError at
    every listing; the finding replays, and the real queue (which sets the link aside)
    passes that trial."""
    broken = Backend.from_factory(f"{BROKEN}:fs_stray_link_trusted")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL
    stray = [f for f in res.findings if ":stray link:" in f.scenario]
    assert stray and {f.clause for f in stray} == {"C9"}
    assert all("IndexError" in f.detail for f in stray)
    assert [f.clause for f in damage_at_rest_check.replay(broken, stray[0].scenario)] == ["C9"]
    assert damage_at_rest_check.replay(Backend.from_factory(FS), stray[0].scenario) == []


@pytest.mark.parametrize("seed", [1, second_seed(26)])
def test_a_corruption_error_must_name_where_the_damaged_bytes_are_kept(seed: int) -> None:
    """A queue that quarantines the entry being read instead of the message whose body
    failed its checksum says the bytes went to a file that does not exist, and throws
    the damaged message file away.  The finding replays; the real queue passes it."""
    broken = Backend.from_factory(f"{BROKEN}:fs_damaged_body_released")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    kept = [f for f in res.findings if "which does not exist" in f.detail]
    assert kept and {f.clause for f in kept} == {"C6"}
    assert all(".sched" in f.detail for f in kept)
    assert "C6" in [f.clause for f in damage_at_rest_check.replay(broken, kept[0].scenario)]
    assert damage_at_rest_check.replay(Backend.from_factory(FS), kept[0].scenario) == []


def test_a_store_that_names_mail_lost_with_nothing_damaged_is_c6() -> None:
    """A flush that drops deletions while an older table stays out of its merge brings
    delivered entries back; the clean-close record finishes them again, and the open
    names their message lost although nothing was damaged.  The deep template's
    undamaged trial fails it; the real queue passes that trial."""
    broken = Backend.from_factory(f"{BROKEN}:kv_flush_drops_tombstones")
    res = damage_at_rest_check.run(broken, QUICK, 3)
    found = cleanly_closed(res.findings)
    assert [f.clause for f in found] == ["C6"]
    first = found[0]
    assert ":deep=0:none:" in first.scenario and "nothing was damaged" in first.detail
    assert damage_at_rest_check.replay(Backend.from_factory(KV), first.scenario) == []


@pytest.mark.parametrize("seed", [1, second_seed(26)])
def test_entry_links_hold_the_body_when_damage_takes_a_reference(seed: int) -> None:
    """Damage removes one reference hard link ``data/<m>.<i>`` of a message of two
    recipients, and recovery does not give it back (``fs_ref_count_trusted``).  With
    symlink entries that left the file's link count one short, and the other entry's
    cleanup freed the body of the queued one (C6).  Entries are hard links to the message
    file now, so the queued entry's own link still holds it: the variant passes, as the
    real queue does, on the same plan of damage."""
    broken = Backend.from_factory(f"{BROKEN}:fs_ref_count_trusted")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.PASS, res.findings
    assert res.stats["trials"] > 0


@pytest.mark.parametrize("seed", [1, second_seed(26)])
def test_a_queue_that_keeps_no_copy_of_a_shared_body_for_a_lost_entry_is_c6(seed: int
                                                                           ) -> None:
    """An entry set aside (its link damaged, or its schedule record) while its message's
    other entry still holds the file: without a copy in quarantine, that entry's cleanup
    frees the only body the lost recipient had.  The finding replays; the real queue
    keeps a copy and passes it."""
    broken = Backend.from_factory(f"{BROKEN}:fs_shared_body_not_kept")
    res = damage_at_rest_check.run(broken, QUICK, seed)
    assert res.status is Status.FAIL and {f.clause for f in res.findings} == {"C6"}
    gone = [f for f in res.findings if "are gone from it" in f.detail]
    assert gone and any(":queue/" in f.scenario for f in gone)
    assert "C6" in [f.clause for f in damage_at_rest_check.replay(broken, gone[0].scenario)]
    assert damage_at_rest_check.replay(Backend.from_factory(FS), gone[0].scenario) == []


def test_a_leveldb_queue_that_trusts_the_logs_it_finds_loses_mail_after_a_crash() -> None:
    """The killed template: no clean close recorded what the store held, and its log is
    removed.  LevelDB opens without it and says nothing; a queue that does not read the
    manifest for the log it needs serves an empty queue, every message unnamed (C6).
    The real queue refuses, and its repair counts the log in ``lost_unknown``."""
    broken = Backend.from_factory(f"{BROKEN}:kv_leveldb_log_trusted")
    res = damage_at_rest_check.run(broken, QUICK, 26)
    assert [f.clause for f in res.findings] == ["C6"]
    (f,) = res.findings
    assert ":killed=" in f.scenario and ":removal:" in f.scenario and f.scenario.endswith(".log")
    assert "neither delivered nor named lost" in f.detail
    assert res.stats["killed_trials"] > 0
    real = Backend.from_factory("conformance.examples.backends:kv_leveldb")
    assert damage_at_rest_check.replay(real, f.scenario) == []


def test_sqlite_in_wal_mode_drops_transactions_after_wal_damage_after_a_crash() -> None:
    """SQLite reads its WAL up to the first frame that fails its checksum: after a crash
    (no checkpoint) a flipped bit there drops every later transaction, so acknowledged
    mail goes unnamed and delivered mail comes back.  The killed template finds it; the
    example's default (rollback journal) keeps committed data in the database file and
    passes the same trials."""
    wal = Backend.from_factory("conformance.examples.sqlite_backend:factory_wal")
    res = damage_at_rest_check.run(wal, QUICK, 26)
    assert res.status is Status.FAIL
    assert {f.clause for f in res.findings} <= {"C3", "C6"}
    assert all(":killed=" in f.scenario and "-wal" in f.scenario for f in res.findings)
    assert any(f.clause == "C3" and "came back" in f.detail for f in res.findings)


def test_a_log_engine_that_cuts_a_damaged_last_record_loses_mail_after_a_crash() -> None:
    """The killed template: a framing flip in the log's last record, the commit of an
    acknowledged message, with no clean-close record to name it.  An engine that takes
    every bad last record for a torn tail cuts it off without a word (C6); the project's
    engine sees a record whole in its length, reports it as damage and keeps the log."""
    broken = Backend.from_factory(f"{BROKEN}:kv_last_record_as_torn_tail")
    res = damage_at_rest_check.run(broken, QUICK, 1)
    assert res.status is Status.FAIL and {f.clause for f in res.findings} == {"C6"}
    assert all(":killed=" in f.scenario and f.scenario.endswith(".log") for f in res.findings)
    assert any("neither delivered nor named lost" in f.detail for f in res.findings)
    first = res.findings[0]
    assert damage_at_rest_check.replay(Backend.from_factory(KV), first.scenario) == []


def test_ids_readable_finds_an_id_as_a_long_word_of_its_own_near_the_flip() -> None:
    data = b"\x07message 00000000000000000042\x00live 17 00000000000000000005\xffx9y"
    ids = {"42", "5", "17", "9", "7"}
    # "17" and "x9y" are words too, but short: anything holds such numbers
    assert ids_readable(data, ids, 10) == {"42", "5"}
    assert ids_readable(b"message 0000000000000000004\x032", {"42"}, 0) == set()
    assert ids_readable(b"SQLite format 3\x00 line 0000042", {"3", "42"}, 0) == set()
    far = b"message 00000000000000000042" + bytes(ID_WINDOW + 100)
    assert ids_readable(far, {"42"}, len(far) - 1) == set()  # another record, far away
    assert ids_readable(far, {"42"}, 40) == {"42"}


def test_a_deep_plan_sweeps_the_end_of_every_file_of_a_new_kind() -> None:
    """Every file of a kind the small template has none of gets the end flips its
    footer asks for, right after the first files' other ways (in the quick plan too)."""
    files = ["000003.tbl", "000006.tbl", "000007.log", "CURRENT"]
    def ends(rel: str) -> list[int]:
        return [int(rel[:6]), 30]

    plan = damage_at_rest_check._deep_plan(files, {"#.log", "CURRENT"}, False,
                                          random.Random(1), ends)
    sweeps = [(f, k) for f, k in plan if k.startswith("end flip")]
    assert sorted(sweeps) == sorted((f, f"end flip {k}") for f in files[:2]
                                    for k in ends(f))
    assert plan[0] == ("", "none")
    thorough = damage_at_rest_check._deep_plan(files, {"#.log", "CURRENT"}, True,
                                              random.Random(1), ends)
    assert thorough[:len(plan)] == plan  # the quick plan is the thorough one cut short


def test_a_store_that_counts_damaged_bytes_whose_ids_it_could_read_is_c6() -> None:
    """After a crash (the killed template) no clean-close record names what a damaged
    log record held: the store must read the ids out of the damaged bytes.  A store that
    keeps 20 bytes of them counts the record in ``lost_unknown`` and names nobody; the
    ids were readable, so that is C6.  The project's engine names them."""
    broken = Backend.from_factory(f"{BROKEN}:kv_damage_sample_cut")
    res = damage_at_rest_check.run(broken, QUICK, 1)
    assert res.status is Status.FAIL and {f.clause for f in res.findings} == {"C6"}
    assert all(":killed=" in f.scenario for f in res.findings)
    assert all("only counted in lost_unknown" in f.detail for f in res.findings)
    assert damage_at_rest_check.replay(Backend.from_factory(KV), res.findings[0].scenario) == []


def test_a_store_that_never_checks_its_table_footers_keeps_dead_tables_for_good() -> None:
    """A table footer's entry count, unchecked and flipped high, keeps the table out of
    every merge: the store serves every message whole and reports nothing, but once used
    again it keeps the table's dead messages on the disk (C8).  The end-flip sweep of the
    deep template reaches the count; the drain after the unseen damage shows it."""
    broken = Backend.from_factory(f"{BROKEN}:kv_footer_unchecked")
    res = damage_at_rest_check.run(broken, QUICK, 2)
    assert res.status is Status.FAIL and {f.clause for f in res.findings} == {"C8"}
    assert all(":deep=" in f.scenario and ":end flip " in f.scenario for f in res.findings)
    first = res.findings[0]
    assert "used again twice" in first.detail
    assert damage_at_rest_check.replay(Backend.from_factory(KV), first.scenario) == []


def test_the_end_flip_sweep_flips_the_first_zero_of_each_run_outside_bodies(
        tmp_path: Path) -> None:
    from conformance.checks.damage_at_rest_check import _end_flips
    from conformance.checks.damage_templates import Template

    body = b"B" * 2048
    footer = b"\x07\x01\x00\x00\x00\x00\x09\x00\x00" + b"\xff" * 3  # 12 bytes
    (tmp_path / "t").write_bytes(b"\x00" * 40 + body + footer)
    filled = Template()
    filled.want["m"] = body
    # zeros start 10 and 6 bytes from the end; the zeros before the body are not its last 32
    assert _end_flips(str(tmp_path), filled, "t") == [10, 5]
    (tmp_path / "b").write_bytes(b"x" * 10 + b"\x00" * 5000)  # a body of zeros ends it
    filled.want["z"] = b"\x00" * 5000
    assert _end_flips(str(tmp_path), filled, "b") == [32]  # the piece left over, past 4 KiB
    path = tmp_path / "t"
    got = damage(path, "end flip 10", random.Random(0))
    assert got.flipped == len(path.read_bytes()) - 10
    assert path.read_bytes()[-10] == 0x80
