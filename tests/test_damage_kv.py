"""Damage at rest in both KV engines: what is lost is reported by id, the rest is delivered,
damaged files are kept aside, and ``queue-ref repair`` salvages every intact message."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from queue_ref import DamagedStoreError, Recipient, Schedule, StorageIOError
from queue_ref.kv import salvage
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.kv_recovery import recover

Opener = Callable[[str], KvQueue]
OPENERS: dict[str, Opener] = {"log": KvQueue.open_log, "leveldb": KvQueue.open_leveldb}


def fill(path: str, opener: Opener, n: int = 6, *, compact: bool = False) -> list[str]:
    """``n`` one-recipient messages, acknowledged; returns their ids, oldest first."""
    q = opener(path)
    ids = []
    for i in range(n):
        if compact and i == n // 2:
            q.compact()
        with q.enqueue("from@example.org") as e:
            e.write(b"body %d " % i * 40)
            ids.append(e.commit([Recipient(f"r{i}@example.net", Schedule(0))])[0].message_id)
    q.close()
    return ids


def drain(q: KvQueue) -> list[str]:
    """Deliver every queued entry (reading its whole body); the ids delivered."""
    out = []
    for h in list(q.list_queue()):
        f = q.send_start(h)
        assert f is not None
        with q.read_inflight(f) as r:
            assert r.read_all().startswith(b"body ")
        done = q.send_done(f)
        assert done is not None and q.cleanup(done)
        out.append(h.message_id)
    return out


def filled_and_killed(path: str, opener: Opener) -> None:
    """Three messages enqueued by a child process that then dies without closing the
    queue (``os._exit``: no clean-close record)."""
    pid = os.fork()
    if pid == 0:
        try:
            q = opener(path)
            for i in range(3):
                with q.enqueue("from@example.org") as e:
                    e.write(b"body %d" % i)
                    e.commit([Recipient(f"r{i}@example.net", Schedule(0))])
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def newest(path: str, suffix: str) -> Path:
    return sorted(Path(path).glob(f"*{suffix}"))[-1]


def damage_commit_after_a_crash(path: str, mid: str) -> None:
    """Remove the clean-close record (as after a crash: no record at rest) and flip a bit
    of message ``mid``'s commit record in the newest log, so it fails its CRC."""
    os.unlink(os.path.join(path, "queue-ref.closed"))
    log = newest(path, ".log")
    data = bytearray(log.read_bytes())
    at = data.find(b"message %020d #" % int(mid))
    data[at + 3] ^= 0x01
    log.write_bytes(bytes(data))


def test_a_lost_commit_whose_entry_was_rescheduled_later_is_named(tmp_path: Path) -> None:
    """The commit of message 1 is damaged in the middle of the log; a later, intact
    record rescheduled its entry, so the damaged bytes name a message that later records
    touched.  Recovery removes the rescheduled entry, whose message has no records left
    (the commit wrote them in one batch), and must name the message lost: no clean-close
    record names it after a crash."""
    path = str(tmp_path / "q")
    ids = fill(path, KvQueue.open_log, 3)
    q = KvQueue.open_log(path)
    h = next(h for h in q.list_queue() if h.message_id == ids[1])
    q.reschedule(h, Schedule(3600))
    q.close()
    damage_commit_after_a_crash(path, ids[1])

    q = KvQueue.open_log(path)
    try:
        report = q.last_recovery
        assert report is not None and report.lost == (ids[1],)
        assert any(f"message {int(ids[1])}, whose records are gone, is lost" in p
                   for p in report.problems)
        assert sorted(drain(q)) == sorted([ids[0], ids[2]])
    finally:
        q.close()


@pytest.mark.parametrize("engine", list(OPENERS))
@pytest.mark.parametrize("damage", ["cut", "flip-last"])
def test_damaged_log_tail_at_rest_is_reported_by_id(
    tmp_path: Path, engine: str, damage: str
) -> None:
    path = str(tmp_path / "q")
    opener = OPENERS[engine]
    ids = fill(path, opener)
    log = newest(path, ".log")
    data = bytearray(log.read_bytes())
    if damage == "cut":
        del data[-30:]  # inside the last record: looks like a torn tail
    else:
        data[-20] ^= 0x08
    log.write_bytes(bytes(data))

    try:
        q = opener(path)
    except StorageIOError as e:  # LevelDB's paranoid checks refuse a damaged record
        assert engine == "leveldb" and damage == "flip-last"
        assert f"queue-ref repair --queue {path} --backend kv-leveldb" in str(e)
        # RepairDB reads the log without checking its CRCs: the record is kept with the
        # flipped bit, and the queue's own checks decide (here the bit was in a key of
        # the domain index, which recovery rebuilds): at most that message is lost.
        report = KvQueue.repair_leveldb(path).report
        assert set(report.lost) <= {ids[-1]}
        q = opener(path)
        try:
            assert sorted(drain(q)) == sorted(set(ids) - set(report.lost))
        finally:
            q.close()
        return
    report = q.last_recovery
    try:
        assert report is not None and report.lost == (ids[-1],)
        assert any("changed at rest" in p for p in report.problems)
        kept = [f for f in report.damaged_files if f.endswith(".at-rest")]
        assert kept and (Path(path) / kept[0]).read_bytes() == bytes(data)
        assert sorted(drain(q)) == sorted(ids[:-1])
    finally:
        q.close()
    q = opener(path)
    try:
        assert q.last_recovery is not None and not q.last_recovery.damage_found
    finally:
        q.close()


def test_log_engine_keeps_the_records_after_a_damaged_one(tmp_path: Path) -> None:
    path = str(tmp_path / "q")
    ids = fill(path, KvQueue.open_log)
    damage_commit_after_a_crash(path, ids[2])

    q = KvQueue.open_log(path)
    try:
        report = q.last_recovery
        assert report is not None and report.lost == (ids[2],)
        assert any(f.startswith("quarantine/") for f in report.damaged_files)
        assert sorted(drain(q)) == sorted(ids[:2] + ids[3:])
    finally:
        q.close()


def test_leveldb_refuses_a_damaged_log_and_repair_salvages_the_rest(tmp_path: Path) -> None:
    path = str(tmp_path / "q")
    ids = fill(path, KvQueue.open_leveldb)
    log = newest(path, ".log")
    data = bytearray(log.read_bytes())
    at = data.find(b"message %020d *" % int(ids[2]))
    data[at + 40] ^= 0x01
    log.write_bytes(bytes(data))
    with pytest.raises(DamagedStoreError, match=f"queue-ref repair --queue {path} --backend kv-leveldb"):
        KvQueue.open_leveldb(path)
    done = KvQueue.repair_leveldb(path)
    assert ids[2] in done.report.lost
    assert done.report.damaged_files  # the originals RepairDB replaced, in lost/
    q = KvQueue.open_leveldb(path)
    try:
        delivered = drain(q)
    finally:
        q.close()
    assert sorted(delivered) == sorted(set(ids) - set(done.report.lost))
    assert len(delivered) >= 2  # LevelDB keeps the intact records of the log too


@pytest.mark.parametrize("engine", list(OPENERS))
def test_missing_current_refuses_and_repair_keeps_everything(tmp_path: Path, engine: str) -> None:
    path = str(tmp_path / "q")
    opener = OPENERS[engine]
    ids = fill(path, opener)
    os.unlink(os.path.join(path, "CURRENT"))
    before = sorted(n for n in os.listdir(path) if not n.startswith("queue-ref."))
    with pytest.raises(DamagedStoreError, match=r"CURRENT: missing.*queue-ref repair"):
        opener(path)
    # Nothing created over the old files (the record of the clean close is marked read).
    assert sorted(n for n in os.listdir(path) if not n.startswith("queue-ref.")) == before
    done = KvQueue.repair_log(path) if engine == "log" else KvQueue.repair_leveldb(path)
    assert done.report.lost == () and done.messages == len(ids)
    q = opener(path)
    try:
        assert sorted(drain(q)) == sorted(ids)
    finally:
        q.close()


def test_damaged_table_refuses_then_repair_names_the_lost_messages(tmp_path: Path) -> None:
    path = str(tmp_path / "q")
    ids = fill(path, KvQueue.open_log, compact=True)  # the first half in a table
    table = newest(path, ".tbl")
    data = bytearray(table.read_bytes())
    data[10] ^= 0x20
    table.write_bytes(bytes(data))
    with pytest.raises(DamagedStoreError, match=r"checksum mismatch.*queue-ref repair"):
        KvQueue.open_log(path)
    done = KvQueue.repair_log(path)
    assert done.report.lost == tuple(ids[:3])  # the table's one block held them
    assert any("repair-1/" in f for f in done.report.damaged_files)
    assert (Path(path) / "quarantine" / "repair-1" / table.name).read_bytes() == bytes(data)
    q = KvQueue.open_log(path)
    try:
        assert sorted(drain(q)) == sorted(ids[3:])
    finally:
        q.close()


def test_leveldb_table_cut_short_is_damage_not_a_disk_error(tmp_path: Path) -> None:
    """LevelDB answers a read past the end of a table it maps with EINVAL, an "IO error":
    the queue must say the store is damaged and name the repair, not blame the disk."""
    path = str(tmp_path / "q")
    ids = fill(path, KvQueue.open_leveldb, compact=True)  # the first half in a table
    table = newest(path, ".ldb")
    whole = table.read_bytes()
    table.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DamagedStoreError, match=r"cut short.*queue-ref repair") as e:
        q = KvQueue.open_leveldb(path)
        try:
            drain(q)
        finally:
            q.close()
    assert table.name in str(e.value)
    done = KvQueue.repair_leveldb(path)
    q = KvQueue.open_leveldb(path)
    try:
        served = drain(q)
    finally:
        q.close()
    assert set(ids[3:]) <= set(served)  # the log's half is intact
    # nothing silent: what is not served is named lost
    assert set(ids) - set(served) <= set(done.report.lost), (served, done.report)


class Killed(BaseException):
    pass


class KillAtRename(salvage.OsIO):
    """Stops the program at its ``n``-th rename, as a kill would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def rename(self, src: str, dst: str) -> None:
        self.n -= 1
        if self.n == 0:
            raise Killed
        super().rename(src, dst)


def contents(path: str) -> list[tuple[str, bytes]]:
    q = KvQueue.open_log(path)
    try:
        out = []
        for h in q.list_queue():
            f = q.send_start(h)
            assert f is not None
            with q.read_inflight(f) as r:
                out.append((q.read_inflight(f).meta.rcpt, r.read_all()))
        return sorted(out)
    finally:
        q.close()


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 6])
def test_a_killed_repair_run_again_gives_the_same_queue(tmp_path: Path, kill_at: int) -> None:
    ref = str(tmp_path / "ref")
    path = str(tmp_path / "q")
    for p in (ref, path):
        fill(p, KvQueue.open_log, compact=True)
        os.unlink(os.path.join(p, "CURRENT"))
    KvQueue.repair_log(ref)
    with pytest.raises(Killed):
        KvQueue.repair_log(path, KillAtRename(kill_at))
    with pytest.raises(DamagedStoreError, match="queue-ref repair"):  # never a fresh store
        KvQueue.open_log(path)
    again = KvQueue.repair_log(path)
    assert again.report.lost == ()
    assert contents(path) == contents(ref)
    originals = tmp_path / "q" / "quarantine" / "repair-1"
    assert any(n.endswith(".tbl") for n in os.listdir(originals))  # kept, never deleted


def test_a_recovery_cut_after_finishing_cleanups_reports_nothing_next_time(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "q")
    q = KvQueue.open_leveldb(path)
    with q.enqueue("from@example.org") as e:
        e.write(b"body")
        (h,) = e.commit([Recipient("r@example.net", Schedule(0))])
    f = q.send_start(h)
    assert f is not None
    assert q.send_done(f) is not None  # pending cleanup, live count 1
    q.close()
    q = KvQueue.open_leveldb(path, recover=False)
    run = recover.__globals__["_Run"](q._core)  # a recovery cut after its step 4
    run.messages()
    run.entries()
    q.close()
    q = KvQueue.open_leveldb(path)
    try:
        assert q.last_recovery is not None and q.last_recovery.problems == ()
        assert q.footprint().objects == 0
    finally:
        q.close()


def test_a_log_removed_after_a_crash_is_counted_lost_by_the_repair(tmp_path: Path) -> None:
    """No clean close recorded what the store held (its process died), and the log
    the manifest names is gone: the open refuses, and the repair, which cannot read
    the lost ids, counts what the missing file held in ``lost_unknown`` instead of
    reporting nothing lost."""
    path = str(tmp_path / "q")
    filled_and_killed(path, KvQueue.open_log)
    assert not os.path.exists(os.path.join(path, "queue-ref.closed"))
    os.unlink(newest(path, ".log"))
    with pytest.raises(DamagedStoreError, match="queue-ref repair") as refused:
        KvQueue.open_log(path)
    assert refused.value.repair is not None
    report = refused.value.repair()
    assert report.lost == () and report.lost_unknown == 1
    assert any("is missing" in p for p in report.problems)


def test_a_leveldb_log_removed_after_a_crash_is_refused_and_counted_by_the_repair(
        tmp_path: Path) -> None:
    """LevelDB replays the logs it finds and says nothing about one that is gone: after a
    crash (no clean close recorded what the store held) the queue reads the log number
    from LevelDB's manifest and refuses to open without that log; the repair counts what
    it held in ``lost_unknown``, and the repaired queue opens (empty: everything was in
    the log)."""
    path = str(tmp_path / "q")
    filled_and_killed(path, KvQueue.open_leveldb)
    assert not os.path.exists(os.path.join(path, "queue-ref.closed"))
    log = newest(path, ".log")
    os.unlink(log)
    with pytest.raises(DamagedStoreError, match=os.path.basename(log)) as refused:
        KvQueue.open_leveldb(path)
    assert refused.value.repair is not None
    report = refused.value.repair()
    assert report.lost == () and report.lost_unknown == 1
    assert any("is missing" in p for p in report.problems)
    q = KvQueue.open_leveldb(path)
    try:
        assert list(q.list_queue()) == []
    finally:
        q.close()


def test_a_leveldb_store_with_its_log_opens_after_a_crash(tmp_path: Path) -> None:
    """The same crash with the log in place: nothing refused, every message there."""
    path = str(tmp_path / "q")
    filled_and_killed(path, KvQueue.open_leveldb)
    q = KvQueue.open_leveldb(path)
    try:
        assert len(list(q.list_queue())) == 3
    finally:
        q.close()


def test_a_leveldb_repair_killed_after_repairdb_still_counts_the_missing_log(
        tmp_path: Path) -> None:
    """RepairDB writes a manifest that names no log, so a rerun after a repair that died
    past it would not see the missing log: the repair records it first and forgets it
    only once it is reported."""
    path = str(tmp_path / "q")
    filled_and_killed(path, KvQueue.open_leveldb)
    os.unlink(newest(path, ".log"))

    def dies() -> KvQueue:
        raise KeyboardInterrupt("killed after RepairDB")

    with pytest.raises(KeyboardInterrupt):
        salvage.repair_leveldb(path, dies)
    assert os.path.exists(os.path.join(path, salvage.LOST_LOG))
    done = KvQueue.repair_leveldb(path)
    assert done.report.lost_unknown == 1
    assert not os.path.exists(os.path.join(path, salvage.LOST_LOG))
    assert KvQueue.repair_leveldb(path).report.lost_unknown == 0  # reported once, done
