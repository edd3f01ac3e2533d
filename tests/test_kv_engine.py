"""The KV engines (``LogEngine`` and ``LevelDBEngine``) against the ``KV`` contract.

Where both engines must behave alike the tests are parametrized over both; the log
engine's own machinery (torn log tails, group commit counted through the I/O seam, failed
fsyncs, reopen cost) is tested through counting and failing ``IO`` subclasses.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from queue_ref.io import MUTATING, OsIO
from queue_ref.kv.base import KV, WriteBatch
from queue_ref.kv.engine_errors import DatabaseCorruptError, DatabaseLockedError
from queue_ref.kv.leveldb import LevelDBEngine
from queue_ref.kv.logengine import LogEngine
from queue_ref.kv.logengine.format import encode_batch
from queue_ref.storage import ClosedError, InvalidInputError, Recipient, Schedule

Engine = LogEngine | LevelDBEngine
Opener = Callable[[str], Engine]

#: A small memtable, so that a few hundred writes cross flushes and merges.
SMALL = 4096


def open_log(path: str) -> Engine:
    return LogEngine(path, memtable_limit=SMALL)


def open_leveldb(path: str) -> Engine:
    return LevelDBEngine(path)


ENGINES = {"log": open_log, "leveldb": open_leveldb}


@pytest.fixture(params=sorted(ENGINES))
def opener(request: pytest.FixtureRequest) -> Opener:
    return ENGINES[request.param]


@pytest.fixture
def db(opener: Opener, tmp_path: Path) -> Iterator[Engine]:
    kv = opener(str(tmp_path / "db"))
    yield kv
    kv.close()


class CountingIO(OsIO):
    """The real seam, counting calls and bytes read; ``sync_delay`` slows each log sync
    down as a real disk would, which widens the window in which writers pile up."""

    def __init__(self, sync_delay: float = 0.0) -> None:
        self.sync_delay = sync_delay
        self.calls: dict[str, int] = {}
        self.read_bytes = 0
        self.log_written = 0
        self.log_synced = 0
        self._mu = threading.Lock()
        self._log_fds: set[int] = set()

    def _count(self, name: str) -> None:
        with self._mu:
            self.calls[name] = self.calls.get(name, 0) + 1

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        fd = super().open_create(path, exclusive=exclusive, append=append)
        if path.endswith(".log"):
            self._log_fds.add(fd)
        return fd

    def write(self, fd: int, data: bytes) -> int:
        n = super().write(fd, data)
        if fd in self._log_fds:
            with self._mu:
                self.log_written += n
        return n

    def fdatasync(self, fd: int) -> None:
        self._count("fdatasync")
        with self._mu:
            covered = self.log_written
        if self.sync_delay:
            time.sleep(self.sync_delay)
        super().fdatasync(fd)
        with self._mu:
            self.log_synced = max(self.log_synced, covered)

    def fsync(self, fd: int) -> None:
        self._count("fsync")
        super().fsync(fd)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        data = super().pread(fd, n, offset)
        with self._mu:
            self.read_bytes += len(data)
        return data

    def read(self, fd: int, n: int) -> bytes:
        data = super().read(fd, n)
        with self._mu:
            self.read_bytes += len(data)
        return data


class FailingIO(OsIO):
    """Fails the ``fail_at``-th call named ``call`` with EIO (after doing nothing)."""

    def __init__(self, call: str, fail_at: int) -> None:
        self.call = call
        self.fail_at = fail_at
        self.seen = 0

    def _maybe_fail(self, name: str) -> None:
        if name == self.call:
            self.seen += 1
            if self.seen == self.fail_at:
                raise OSError(errno.EIO, f"injected EIO in {name}")

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync")
        super().fdatasync(fd)

    def write(self, fd: int, data: bytes) -> int:
        self._maybe_fail("write")
        return super().write(fd, data)

    def rename(self, src: str, dst: str) -> None:
        self._maybe_fail("rename")
        super().rename(src, dst)


def log_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.log"))


# ---- basic operations (both engines) ---------------------------------------------------


def test_put_get_delete(db: KV) -> None:
    assert db.get(b"a") is None
    db.put(b"a", b"1")
    db.put(b"b", b"")
    assert db.get(b"a") == b"1"
    assert db.get(b"b") == b""
    db.put(b"a", b"2")
    assert db.get(b"a") == b"2"
    db.delete(b"a")
    db.delete(b"never-there")
    assert db.get(b"a") is None
    assert list(db.iterate()) == [(b"b", b"")]


def test_batch_applies_in_order_and_at_once(db: KV) -> None:
    db.put(b"old", b"x")
    b = WriteBatch()
    b.put(b"k", b"1")
    b.delete(b"k")
    b.put(b"j", b"first")
    b.put(b"j", b"second")
    b.delete(b"old")
    b.put(b"\x00", b"nul")
    db.write(b)
    assert list(db.iterate()) == [(b"\x00", b"nul"), (b"j", b"second")]
    db.write(WriteBatch())  # an empty batch is a no-op
    assert db.get(b"j") == b"second"


def test_batch_is_atomic_for_a_concurrent_reader(db: KV) -> None:
    """A token moves between keys in one batch: every snapshot sees exactly one token,
    whatever flushes and compactions run meanwhile."""
    db.put(b"token-0000", b"t")
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            seen = [k for k, _ in db.iterate(b"token-", b"token.")]
            if len(seen) != 1:
                errors.append(repr(seen))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(300):
            b = WriteBatch()
            b.delete(b"token-%04d" % i)
            b.put(b"token-%04d" % (i + 1), b"t")
            b.put(b"filler-%04d" % i, bytes(64))
            db.write(b, sync=False)
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert [k for k, _ in db.iterate(b"token-", b"token.")] == [b"token-0300"]


def test_iterate_bounds(db: KV) -> None:
    keys = [b"", b"a", b"ab", b"b", b"b\x00", b"c", b"\xff", b"\xff\xff"]
    b = WriteBatch()
    for k in keys:
        b.put(k, k + b"!")
    db.write(b)
    assert [k for k, _ in db.iterate()] == keys
    assert [k for k, _ in db.iterate(b"a", b"b")] == [b"a", b"ab"]
    assert [k for k, _ in db.iterate(b"aa", b"b\x00")] == [b"ab", b"b"]
    assert [k for k, _ in db.iterate(b"b")] == [b"b", b"b\x00", b"c", b"\xff", b"\xff\xff"]
    assert list(db.iterate(b"c", b"c")) == []
    assert list(db.iterate(b"d", b"a")) == []
    assert list(db.iterate(b"\xff\xff\x00")) == []
    assert dict(db.iterate()) == {k: k + b"!" for k in keys}


def test_reopen_keeps_everything(opener: Opener, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    model: dict[bytes, bytes] = {}
    rng = random.Random(1)
    for _round in range(3):
        kv = opener(path)
        assert dict(kv.iterate()) == model
        for i in range(400):
            k = b"k%03d" % rng.randrange(300)
            if rng.random() < 0.3:
                kv.delete(k, sync=False)
                model.pop(k, None)
            else:
                v = b"v%d" % i * rng.randrange(1, 40)
                kv.put(k, v, sync=i % 50 == 0)
                model[k] = v
        kv.put(b"last", b"synced")
        model[b"last"] = b"synced"
        kv.close()
    kv = opener(path)
    try:
        assert dict(kv.iterate()) == model
        assert all(kv.get(k) == v for k, v in model.items())
    finally:
        kv.close()


def test_closed_engine_refuses_every_call(opener: Opener, tmp_path: Path) -> None:
    kv = opener(str(tmp_path / "db"))
    kv.put(b"a", b"1")
    it = kv.iterate()
    kv.close()
    kv.close()  # idempotent
    with pytest.raises(ClosedError):
        kv.get(b"a")
    with pytest.raises(ClosedError):
        kv.put(b"a", b"2")
    with pytest.raises(ClosedError):
        kv.iterate()
    with pytest.raises(ClosedError):
        kv.disk_usage()
    with pytest.raises(ClosedError):
        next(it)


def test_bad_arguments_are_rejected(db: KV) -> None:
    with pytest.raises(TypeError):
        db.get("a")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        db.write([(b"a", b"1")])  # type: ignore[arg-type]
    b = WriteBatch()
    b.ops.append(("a", b"1"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        db.write(b)
    with pytest.raises(TypeError):
        db.iterate(b"a", "b")  # type: ignore[arg-type]
    assert list(db.iterate()) == []


# ---- many keys against a dict ----------------------------------------------------------


def test_many_keys_across_flushes_match_a_dict(opener: Opener, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    kv = opener(path)
    model: dict[bytes, bytes] = {}
    rng = random.Random(7)
    try:
        for step in range(6000):
            k = b"key-%05d" % rng.randrange(2000)
            if rng.random() < 0.4:
                kv.delete(k, sync=False)
                model.pop(k, None)
            else:
                v = rng.randbytes(rng.choice((0, 10, 100, 2000)))
                kv.put(k, v, sync=False)
                model[k] = v
            if step % 1500 == 0:
                lo = b"key-%05d" % rng.randrange(2000)
                want = sorted((k2, v2) for k2, v2 in model.items() if k2 >= lo)
                assert list(kv.iterate(lo)) == want
        if isinstance(kv, LogEngine):
            assert kv.recovery.tables == 0  # a fresh database...
            kv.close()
            kv = opener(path)
            assert isinstance(kv, LogEngine)
            assert kv.recovery.tables >= 1  # ...that flushed to tables on the way
        assert list(kv.iterate()) == sorted(model.items())
        for k in (b"key-%05d" % i for i in range(0, 2000, 7)):
            assert kv.get(k) == model.get(k)
        kv.compact()
        assert list(kv.iterate()) == sorted(model.items())
    finally:
        kv.close()


KEYS = st.binary(max_size=3).map(lambda b: b"k" + b)
VALUES = st.one_of(st.binary(max_size=8), st.binary(min_size=200, max_size=600))


class KVAgainstDict(RuleBasedStateMachine):
    """An engine and a dict in lockstep, with reopens and compactions in between."""

    open_engine: Opener = staticmethod(open_log)

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kv-sm-")
        self.path = os.path.join(self.dir, "db")
        self.kv = self.open_engine(self.path)
        self.model: dict[bytes, bytes] = {}

    @rule(key=KEYS, value=VALUES, sync=st.booleans())
    def put(self, key: bytes, value: bytes, sync: bool) -> None:
        self.kv.put(key, value, sync=sync)
        self.model[key] = value

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        self.kv.delete(key, sync=False)
        self.model.pop(key, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def delete_existing(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.delete(key)

    @rule(ops=st.lists(st.tuples(KEYS, st.none() | VALUES), max_size=20))
    def batch(self, ops: list[tuple[bytes, bytes | None]]) -> None:
        b = WriteBatch()
        for key, value in ops:
            if value is None:
                b.delete(key)
                self.model.pop(key, None)
            else:
                b.put(key, value)
                self.model[key] = value
        self.kv.write(b)

    @rule()
    def compact(self) -> None:
        self.kv.compact()

    @rule()
    def reopen(self) -> None:
        self.kv.close()
        self.kv = self.open_engine(self.path)

    @rule(key=KEYS)
    def get(self, key: bytes) -> None:
        assert self.kv.get(key) == self.model.get(key)

    @rule(start=KEYS, stop=st.none() | KEYS)
    def scan(self, start: bytes, stop: bytes | None) -> None:
        want = sorted(
            (k, v) for k, v in self.model.items() if k >= start and (stop is None or k < stop)
        )
        assert list(self.kv.iterate(start, stop)) == want

    @invariant()
    def same_contents(self) -> None:
        assert list(self.kv.iterate()) == sorted(self.model.items())

    def teardown(self) -> None:
        self.kv.close()
        shutil.rmtree(self.dir)


class LevelDBAgainstDict(KVAgainstDict):
    open_engine: Opener = staticmethod(open_leveldb)


class TinyLogEngineAgainstDict(KVAgainstDict):
    """A memtable of 300 bytes: nearly every write flushes, so merges run all the time."""

    open_engine: Opener = staticmethod(
        lambda path: LogEngine(path, memtable_limit=300)
    )


TestLogEngineAgainstDict = KVAgainstDict.TestCase
TestTinyLogEngineAgainstDict = TinyLogEngineAgainstDict.TestCase
TestLevelDBAgainstDict = LevelDBAgainstDict.TestCase


# ---- space is given back -----------------------------------------------------------------


def test_deleted_keys_are_dropped_by_compaction(opener: Opener, tmp_path: Path) -> None:
    kv = opener(str(tmp_path / "db"))
    try:
        for round_ in range(2):
            for s in range(0, 3000, 300):
                b = WriteBatch()
                for i in range(s, s + 300):
                    b.put(b"message %06d %d" % (i, round_), os.urandom(1000))
                kv.write(b)
            full = kv.disk_usage()
            assert full > 3_000_000
            for s in range(0, 3000, 300):
                b = WriteBatch()
                for i in range(s, s + 300):
                    b.delete(b"message %06d %d" % (i, round_))
                kv.write(b)
            kv.compact()
            assert list(kv.iterate()) == []
            # LevelDB keeps a text LOG and a MANIFEST of some KB; the log engine ~100 bytes.
            assert kv.disk_usage() < 64 * 1024, kv.disk_usage()
    finally:
        kv.close()


def test_log_engine_drops_dead_data_without_explicit_compaction(tmp_path: Path) -> None:
    """A queue's pattern: values die soon after they are written; disk stays small."""
    kv = LogEngine(str(tmp_path / "db"), memtable_limit=64 * 1024)
    try:
        live: list[bytes] = []
        peak = 0
        for i in range(4000):
            b = WriteBatch()
            key = b"message %08d" % i
            b.put(key, os.urandom(512))
            live.append(key)
            if len(live) > 20:
                b.delete(live.pop(0))
            kv.write(b, sync=False)
            peak = max(peak, kv.disk_usage())
        assert sorted(k for k, _ in kv.iterate()) == live
        # 4000 x 512 bytes went through; at most one log's and two memtables' worth
        # stays on disk (the log's limit is eight memtables: 512 KiB).
        assert peak < kv.log_limit + 2 * kv.memtable_limit, peak
        assert peak < 4000 * 512 // 3, peak
    finally:
        kv.close()


# ---- the log engine's log: torn tails, failed syncs ----------------------------------------


def _write_records(path: str, n: int) -> None:
    kv = LogEngine(path)
    for i in range(n):
        b = WriteBatch()
        b.put(b"r%03d-a" % i, b"x" * 30)
        b.put(b"r%03d-b" % i, b"y" * 30)
        kv.write(b)
    kv.close()


def _records_present(kv: KV, n: int) -> int:
    """How many of records 0..n-1 are present; checks each is all-or-nothing."""
    count = 0
    for i in range(n):
        a, b = kv.get(b"r%03d-a" % i), kv.get(b"r%03d-b" % i)
        assert (a is None) == (b is None), f"record {i} is half applied"
        count += a is not None
    return count


RECORD = len(encode_batch([(b"r000-a", b"x" * 30), (b"r000-b", b"y" * 30)]))


@pytest.mark.parametrize(
    ("damage", "survivors"),
    [
        ("cut-1", 9),  # the last record lost its last byte
        ("cut-header", 9),  # only 5 bytes of the last record's 8-byte header remain
        ("garble-length", 9),  # the last record's length field is garbage
        ("zeros", 10),  # a power cut extended the file with zeros
        ("garbage", 10),  # random bytes after the last record
    ],
)
def test_torn_log_tail_is_dropped_and_truncated(
    tmp_path: Path, damage: str, survivors: int
) -> None:
    path = tmp_path / "db"
    _write_records(str(path), 10)
    (log,) = log_files(path)
    data = bytearray(log.read_bytes())
    assert len(data) == 10 * RECORD
    if damage == "cut-1":
        del data[-1:]
    elif damage == "cut-header":
        del data[9 * RECORD + 5 :]
    elif damage == "garble-last":
        data[-3] ^= 0x40
    elif damage == "garble-length":
        data[9 * RECORD] ^= 0x01
    elif damage == "zeros":
        data += bytes(4096)
    elif damage == "garbage":
        data += random.Random(3).randbytes(100)
    elif damage == "garble-middle":
        data[5 * RECORD + 12] ^= 0xFF
    log.write_bytes(bytes(data))

    kv = LogEngine(str(path))
    try:
        assert _records_present(kv, 10) == survivors
        assert kv.recovery.log_records == survivors
        assert kv.recovery.truncated_bytes == len(data) - survivors * RECORD
        # The tail is cut off on disk, so new records follow the last good one.
        assert log.stat().st_size == survivors * RECORD
        kv.put(b"after", b"repair")
    finally:
        kv.close()
    kv = LogEngine(str(path))
    try:
        assert kv.recovery.truncated_bytes == 0
        assert _records_present(kv, 10) == survivors
        assert kv.get(b"after") == b"repair"
    finally:
        kv.close()


@pytest.mark.parametrize("where", [12, 0, 4, RECORD - 1])  # payload, length, crc, last byte
def test_damage_in_the_middle_of_the_log_keeps_every_intact_record(
    tmp_path: Path, where: int
) -> None:
    path = tmp_path / "db"
    _write_records(str(path), 10)
    (log,) = log_files(path)
    data = bytearray(log.read_bytes())
    data[5 * RECORD + where] ^= 0x10
    log.write_bytes(bytes(data))

    kv = LogEngine(str(path))
    try:
        present = [i for i in range(10) if kv.get(b"r%03d-a" % i) is not None]
        assert present == [0, 1, 2, 3, 4, 6, 7, 8, 9]
        assert _records_present(kv, 10) == 9  # the records after it are kept
        (d,) = kv.damage
        assert "intact records follow" in d.detail
        assert d.sample == bytes(data[5 * RECORD:6 * RECORD])  # the bad record's bytes
        assert d.later_keys == {b"r%03d-%c" % (i, c) for i in range(6, 10) for c in b"ab"}
        kept = Path(d.kept)
        assert kept.parent == path / "quarantine" and kept.read_bytes() == bytes(data)
        assert not log.exists()  # flushed to a table; the damaged log is kept aside
        kv.put(b"after", b"damage")
    finally:
        kv.close()
    kv = LogEngine(str(path))
    try:
        assert kv.damage == []  # reported once: the next open is clean
        assert [i for i in range(10) if kv.get(b"r%03d-a" % i)] == [0, 1, 2, 3, 4, 6, 7, 8, 9]
        assert kv.get(b"after") == b"damage"
    finally:
        kv.close()


@pytest.mark.parametrize("where", [-3, 16, 4])  # payload end, first op, crc
def test_a_whole_last_record_that_fails_its_check_is_damage_not_a_torn_tail(
    tmp_path: Path, where: int
) -> None:
    """The last record is there in the length its header gives, with a byte changed: it
    reached the disk whole (it was acknowledged), so it is reported with its bytes and
    the log kept aside, never cut off as a torn tail without a word."""
    path = tmp_path / "db"
    _write_records(str(path), 10)
    (log,) = log_files(path)
    data = bytearray(log.read_bytes())
    data[9 * RECORD + where if where >= 0 else where] ^= 0x40
    log.write_bytes(bytes(data))
    kv = LogEngine(str(path))
    try:
        assert _records_present(kv, 10) == 9
        (d,) = kv.damage
        assert "last record" in d.detail
        assert d.sample == bytes(data[9 * RECORD:])  # its bytes, ids readable in them
        kept = Path(d.kept)
        assert kept.parent == path / "quarantine" and kept.read_bytes() == bytes(data)
    finally:
        kv.close()


def test_failed_log_sync_stops_writes_until_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    io = FailingIO("fdatasync", fail_at=3)
    kv = LogEngine(path, io)
    kv.put(b"a", b"1")
    kv.put(b"b", b"2")
    with pytest.raises(OSError, match="injected EIO"):
        kv.put(b"c", b"3")
    assert kv.get(b"c") is None  # not trusted, so not shown
    with pytest.raises(OSError, match="failed earlier"):
        kv.put(b"d", b"4")
    assert kv.get(b"a") == b"1"  # reads keep working
    kv.close()
    kv = LogEngine(path)
    try:
        assert kv.get(b"a") == b"1" and kv.get(b"b") == b"2"
        assert kv.get(b"d") is None
        kv.put(b"e", b"5")
        assert kv.get(b"e") == b"5"
    finally:
        kv.close()


def test_failed_flush_keeps_data_and_stops_writes(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    io = FailingIO("rename", fail_at=2)  # 1: CURRENT at creation; 2: the first table
    kv = LogEngine(path, io, memtable_limit=2048)
    model = {}
    with pytest.raises(OSError, match="failed earlier"):
        for i in range(1000):
            kv.put(b"k%04d" % i, bytes(100))
            model[b"k%04d" % i] = bytes(100)
    assert dict(kv.iterate()) == model
    kv.close()
    kv = LogEngine(path, memtable_limit=2048)
    try:
        assert dict(kv.iterate()) == model
        assert not list(Path(path).glob("*.tmp"))  # the half-made table was cleaned up
    finally:
        kv.close()


def test_corrupt_table_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "db"
    kv = LogEngine(str(path))
    kv.put(b"a", b"x" * 100)
    kv.compact()
    kv.close()
    (table,) = path.glob("*.tbl")
    data = bytearray(table.read_bytes())
    data[20] ^= 0x01
    table.write_bytes(bytes(data))
    # Every block is checked when the engine opens: it refuses, names the repair command,
    # and leaves every file as it was.
    before = sorted((p.name, p.read_bytes()) for p in path.iterdir() if p.is_file())
    with pytest.raises(DatabaseCorruptError, match="checksum") as err:
        LogEngine(str(path))
    assert f"queue-ref repair --queue {path} --backend kv-log" in str(err.value)
    assert sorted((p.name, p.read_bytes()) for p in path.iterdir() if p.is_file()) == before


@pytest.mark.parametrize("missing", ["CURRENT", "MANIFEST", "log", "table"])
def test_a_missing_file_never_makes_a_fresh_store_over_old_data(
    tmp_path: Path, missing: str
) -> None:
    path = tmp_path / "db"
    kv = LogEngine(str(path))
    kv.put(b"a", b"x" * 100)
    kv.compact()
    kv.put(b"b", b"y" * 100)
    kv.close()
    victim = {"CURRENT": path / "CURRENT", "MANIFEST": next(path.glob("MANIFEST-*")),
              "log": log_files(path)[0], "table": next(path.glob("*.tbl"))}[missing]
    victim.unlink()
    before = sorted((p.name, p.read_bytes()) for p in path.iterdir() if p.is_file())
    with pytest.raises(DatabaseCorruptError, match="queue-ref repair --queue"):
        LogEngine(str(path))
    assert sorted((p.name, p.read_bytes()) for p in path.iterdir() if p.is_file()) == before


def test_a_creation_cut_before_its_current_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "db"
    LogEngine(str(path)).close()
    (path / "CURRENT").unlink()  # as if the creation had crashed before publishing it
    kv = LogEngine(str(path))
    try:
        kv.put(b"a", b"1")
        assert kv.get(b"a") == b"1"
    finally:
        kv.close()


class Crash(BaseException):
    """The program stops here (a BaseException, as ``except Exception`` must not catch it)."""


class CrashIO(OsIO):
    """Stops the program at its ``crash_at``-th mutating call, before the call, as a
    killed process would; a ``write`` gets half of its bytes out first (a torn write).
    ``die()`` then closes what the dead program held open (its lock included)."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.count = 0
        self.open_fds: set[int] = set()

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        self.open_fds.add(fd)
        return fd

    def lock_exclusive(self, path: str, *, blocking: bool = False) -> int | None:
        fd = super().lock_exclusive(path, blocking=blocking)
        if fd is not None:
            self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.open_fds.discard(fd)
        super().close(fd)

    def unlock(self, fd: int) -> None:
        self.open_fds.discard(fd)
        super().unlock(fd)

    def die(self) -> None:
        for fd in sorted(self.open_fds):
            os.close(fd)
        self.open_fds.clear()

    def _step(self) -> None:
        self.count += 1
        if self.count == self.crash_at:
            raise Crash

    def write(self, fd: int, data: bytes) -> int:
        if self.count + 1 == self.crash_at and len(data) > 1:
            super().write(fd, data[: len(data) // 2])
        self._step()
        return super().write(fd, data)


def _make_step(name: str) -> Callable[..., object]:
    def step(self: CrashIO, *args: object, **kwargs: object) -> object:
        self._step()
        if name in ("fsync", "fdatasync", "fsync_dir"):
            return None  # a killed process loses nothing the kernel has: syncs are moot
        result = getattr(OsIO, name)(self, *args, **kwargs)
        if name == "open_create":
            self.open_fds.add(result)
        return result

    return step


# unlink_large is left to OsIO's own, which calls the stepped unlink: one step, not two
for _name in sorted(MUTATING):
    if _name not in ("write", "unlink_large"):
        setattr(CrashIO, _name, _make_step(_name))


def _crash_workload() -> list[WriteBatch | None]:
    """Batches (None: a compact) that cross flushes, merges, deletes and a compaction."""
    rng = random.Random(11)
    ops: list[WriteBatch | None] = []
    for i in range(14):
        b = WriteBatch()
        for _ in range(rng.randrange(1, 4)):
            k = b"k%02d" % rng.randrange(12)
            if rng.random() < 0.3:
                b.delete(k)
            else:
                b.put(k, b"%d-" % i * rng.randrange(1, 60))
        ops.append(b)
        if i == 9:
            ops.append(None)
    return ops


def _apply(model: dict[bytes, bytes], op: WriteBatch | None) -> dict[bytes, bytes]:
    model = dict(model)
    for key, value in op.ops if op is not None else []:
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    return model


def _run_until_crash(path: str, io: CrashIO, ops: list[WriteBatch | None]) -> int:
    """Runs the workload; returns how many ops returned before the crash (len: none)."""
    done = 0
    try:
        kv = LogEngine(path, io, memtable_limit=300)
        for op in ops:
            if op is None:
                kv.compact()
            else:
                kv.write(op, sync=True)
            done += 1
        kv.close()
    except Crash:
        io.die()
        return done
    return len(ops)


def test_crash_at_every_mutating_call_recovers_a_consistent_state(tmp_path: Path) -> None:
    """Process-kill model: the disk keeps every completed call.  After a crash at each
    mutating call (and a crash inside the recovery that follows), the database holds the
    acknowledged batches, and the interrupted one wholly or not at all."""
    ops = _crash_workload()
    models = [{}]  # models[i]: contents after the first i ops
    for op in ops:
        models.append(_apply(models[-1], op))
    probe = CrashIO(crash_at=0)
    assert _run_until_crash(str(tmp_path / "probe"), probe, ops) == len(ops)
    total = probe.count
    assert total > 60  # flushes, merges and the compaction are in the run
    for crash_at in range(1, total + 1):
        path = str(tmp_path / f"c{crash_at}")
        done = _run_until_crash(path, CrashIO(crash_at), ops)
        allowed = [models[done]] + ([models[done + 1]] if done < len(ops) else [])
        # Crash the first recovery at its first mutating calls too, then recover fully.
        for recovery_crash in (1, 2, 3):
            io = CrashIO(recovery_crash)
            try:
                LogEngine(path, io, memtable_limit=300).close()
            except Crash:
                io.die()
        kv = LogEngine(path, memtable_limit=300)
        try:
            got = dict(kv.iterate())
            assert got in allowed, (crash_at, done, got, allowed)
            kv.put(b"after", b"crash")
        finally:
            kv.close()
        kv = LogEngine(path, memtable_limit=300)
        try:
            assert dict(kv.iterate()) == {**got, b"after": b"crash"}
        finally:
            kv.close()


# ---- concurrency and group commit -------------------------------------------------------


def _hammer(
    kv: KV,
    threads: int,
    per_thread: int,
    before: Callable[[], int] = lambda: 0,
    after: Callable[[int, int], None] = lambda _mark, _n: None,
    unsynced_threads: int = 0,
) -> None:
    """Threads each write ``per_thread`` one-put batches (synced, except in the first
    ``unsynced_threads``); ``after(before(), record length)`` runs when each synced write
    returns.  Then every write must be present."""
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(per_thread):
                b = WriteBatch()
                b.put(b"t%02d-%04d" % (t, i), b"v" * (i % 50))
                sync = t >= unsynced_threads
                mark = before()
                kv.write(b, sync=sync)
                if sync:
                    after(mark, len(encode_batch(b.ops)))
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    got = dict(kv.iterate())
    assert len(got) == threads * per_thread
    for t in range(threads):
        for i in range(per_thread):
            assert got[b"t%02d-%04d" % (t, i)] == b"v" * (i % 50)


def test_concurrent_writers_all_land(opener: Opener, tmp_path: Path) -> None:
    kv = opener(str(tmp_path / "db"))
    try:
        _hammer(kv, threads=8, per_thread=60)
    finally:
        kv.close()


def test_group_commit_shares_syncs_and_nobody_returns_early(tmp_path: Path) -> None:
    io = CountingIO(sync_delay=0.002)
    kv = LogEngine(str(tmp_path / "db"), io)
    failures: list[str] = []

    def synced_on_return(log_before: int, record_len: int) -> None:
        # The record was appended after the log held ``log_before`` bytes, so it ends at
        # or past ``log_before + record_len``; a sync begun after that must have finished.
        if io.log_synced < log_before + record_len:
            failures.append(f"returned with {io.log_synced} of {log_before + record_len} synced")

    try:
        before = io.calls.get("fdatasync", 0)
        # Two threads write unsynced batches: a group led by one of them must still sync
        # for the synced members.
        _hammer(kv, 8, 50, lambda: io.log_written, synced_on_return, unsynced_threads=2)
        syncs = io.calls.get("fdatasync", 0) - before
    finally:
        kv.close()
    assert failures == []
    assert io.log_synced == io.log_written  # the last writes were synced ones
    assert 0 < syncs < 300 // 2, f"{syncs} fdatasyncs for 300 concurrent synced writes"


class GatedIO(CountingIO):
    """Holds the first fdatasync until ``gate`` is set, so writers queue up behind it."""

    def __init__(self, fail_second: bool = False) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.first = True
        self.fail_second = fail_second

    def fdatasync(self, fd: int) -> None:
        if self.first:
            self.first = False
            assert self.gate.wait(30)
        elif self.fail_second:
            raise OSError(errno.EIO, "injected EIO in the group's sync")
        super().fdatasync(fd)


def _queue_writers(
    kv: LogEngine, io: GatedIO, writers: list[tuple[str, bool]]
) -> dict[str, tuple[int, int] | BaseException]:
    """Start the synced writers one by one: the first is held in its sync, the others
    queue behind it; then open the gate.  Returns (synced, written) at each writer's
    return, or its exception.  Each writer puts its name as key and value."""
    queue = kv._writers._queue  # white box: wait until each writer has queued
    seen: dict[str, tuple[int, int] | BaseException] = {}

    def writer(name: str, sync: bool) -> None:
        try:
            kv.put(name.encode(), name.encode(), sync=sync)
        except BaseException as e:
            seen[name] = e
        else:
            seen[name] = (io.log_synced, io.log_written)

    threads = []
    for n, (name, sync) in enumerate(writers):
        threads.append(threading.Thread(target=writer, args=(name, sync)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        # The first writer's group is appended (pending) and its sync held; each later
        # one waits in the queue for the sync lock.
        while not kv._pending if n == 0 else len(queue) < n:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    io.gate.set()
    for t in threads:
        t.join()
    return seen


def _hold_first_sync(kv: LogEngine, io: GatedIO, key: bytes) -> threading.Thread:
    """Start a synced put of ``key`` and return once its sync is held by the gate."""
    t = threading.Thread(target=kv.put, args=(key, b"synced"))
    t.start()
    deadline = time.monotonic() + 30
    while not kv._pending:  # white box: the group is appended, its sync held
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return t


def test_writers_queued_behind_a_sync_share_the_next_one(tmp_path: Path) -> None:
    io = GatedIO()
    kv = LogEngine(str(tmp_path / "db"), io)
    try:
        # a's sync is held while b and c queue; then b leads the group [b, c].
        seen = _queue_writers(kv, io, [("a", True), ("b", True), ("c", True)])
        assert seen["b"] == seen["c"] == (io.log_written, io.log_written)
        assert io.calls["fdatasync"] == 2
        assert (kv.get(b"a"), kv.get(b"b"), kv.get(b"c")) == (b"a", b"b", b"c")
    finally:
        kv.close()


def test_unsynced_write_of_a_key_being_synced_waits_and_stays_in_log_order(
        tmp_path: Path) -> None:
    io = GatedIO()
    kv = LogEngine(str(tmp_path / "db"), io)
    done = threading.Event()

    def unsynced() -> None:
        kv.put(b"k", b"unsynced", sync=False)
        done.set()

    t = _hold_first_sync(kv, io, b"k")
    u = threading.Thread(target=unsynced)
    try:
        u.start()
        assert not done.wait(0.2)  # it queued behind the synced write of the same key
        assert kv.get(b"k") is None  # neither is visible before the sync
        io.gate.set()
        t.join()
        u.join()
        assert kv.get(b"k") == b"unsynced"  # applied after the synced write, as logged
        assert io.calls["fdatasync"] == 1
    finally:
        io.gate.set()
        t.join()
        u.join()
        kv.close()
    kv = LogEngine(str(tmp_path / "db"))
    try:
        assert kv.get(b"k") == b"unsynced"
    finally:
        kv.close()


def test_unsynced_write_does_not_wait_for_another_groups_sync(tmp_path: Path) -> None:
    io = GatedIO()
    kv = LogEngine(str(tmp_path / "db"), io)
    t = _hold_first_sync(kv, io, b"a")
    try:
        kv.put(b"b", b"2", sync=False)  # returns while a's sync is still held
        assert t.is_alive()
        assert kv.get(b"b") == b"2" and kv.get(b"a") is None  # a is not visible before durable
        assert io.log_synced == 0 and io.log_written > 0
        io.gate.set()
        t.join()
        assert kv.get(b"a") == b"synced" and io.log_synced == io.log_written
    finally:
        io.gate.set()
        t.join()
        kv.close()
    kv = LogEngine(str(tmp_path / "db"))
    try:
        assert (kv.get(b"a"), kv.get(b"b")) == (b"synced", b"2")  # the log holds both
    finally:
        kv.close()


def test_failed_group_sync_fails_every_member(tmp_path: Path) -> None:
    io = GatedIO(fail_second=True)
    kv = LogEngine(str(tmp_path / "db"), io)
    try:
        seen = _queue_writers(kv, io, [("a", True), ("b", True), ("c", True)])
        assert isinstance(seen["a"], tuple)
        assert isinstance(seen["b"], OSError) and "injected" in str(seen["b"])
        assert isinstance(seen["c"], OSError) and "in its leader" in str(seen["c"])
        assert kv.get(b"a") == b"a" and kv.get(b"b") is None and kv.get(b"c") is None
        with pytest.raises(OSError, match="failed earlier"):
            kv.put(b"d", b"v")
    finally:
        kv.close()


def test_unsynced_writes_do_not_sync(tmp_path: Path) -> None:
    io = CountingIO()
    kv = LogEngine(str(tmp_path / "db"), io)
    try:
        for i in range(100):
            kv.put(b"k%d" % i, b"v", sync=False)
        assert io.calls.get("fdatasync", 0) == 0
        kv.put(b"last", b"v")
        assert io.calls.get("fdatasync", 0) == 1
        assert io.log_synced == io.log_written
    finally:
        kv.close()


# ---- reopen cost follows live data, not history -------------------------------------------


def test_reopen_reads_live_data_not_history(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    limit = 256 * 1024
    history = 0
    for round_ in range(4):
        io = CountingIO()
        kv = LogEngine(path, io, memtable_limit=limit)
        # Reopening read the live log and the tables' indexes: bounded by the memtable
        # limit, however many rounds came before.
        assert io.read_bytes < 2 * limit, (round_, io.read_bytes, kv.recovery)
        assert kv.recovery.log_bytes <= limit + 64 * 1024
        for phase in ("put", "delete"):
            for s in range(0, 50_000, 1000):
                b = WriteBatch()
                for i in range(s, s + 1000):
                    key = b"key-%08d" % i
                    if phase == "put":
                        b.put(key, b"value-%d-%d" % (round_, i))
                    else:
                        b.delete(key)
                kv.write(b, sync=False)
                history += len(encode_batch(b.ops))
        assert kv.disk_usage() < 4 * limit
        kv.close()
    assert history > 30 * limit
    io = CountingIO()
    kv = LogEngine(path, io, memtable_limit=limit)
    try:
        assert io.read_bytes < 2 * limit
        assert list(kv.iterate()) == []
    finally:
        kv.close()


# ---- one opener per database ----------------------------------------------------------------


_CHILD_OPEN = textwrap.dedent(
    """
    import sys
    from queue_ref.kv.engine_errors import DatabaseLockedError
    from queue_ref.kv.leveldb import LevelDBEngine
    from queue_ref.kv.logengine import LogEngine
    engine = {"log": LogEngine, "leveldb": LevelDBEngine}[sys.argv[1]]
    try:
        engine(sys.argv[2]).close()
    except DatabaseLockedError:
        print("locked")
    else:
        print("opened")
    """
)


def test_second_opener_is_rejected(opener: Opener, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    name = "log" if opener is open_log else "leveldb"
    kv = opener(path)
    kv.put(b"a", b"1")
    try:
        with pytest.raises(DatabaseLockedError, match="locked"):
            opener(path)
        # The failed attempt must not have dropped the first opener's lock.
        child = subprocess.run(
            [sys.executable, "-c", _CHILD_OPEN, name, path],
            capture_output=True, text=True, timeout=60, check=True,
        )
        assert child.stdout.strip() == "locked"
        assert kv.get(b"a") == b"1"
    finally:
        kv.close()
    kv = opener(path)  # free again once closed
    try:
        assert kv.get(b"a") == b"1"
    finally:
        kv.close()


# ---- a killed writer process ------------------------------------------------------------------


_CHILD_WRITE = textwrap.dedent(
    """
    import sys
    from queue_ref.kv.base import WriteBatch
    from queue_ref.kv.leveldb import LevelDBEngine
    from queue_ref.kv.logengine import LogEngine
    if sys.argv[1] == "log":
        kv = LogEngine(sys.argv[2], memtable_limit=8192)
    else:
        kv = LevelDBEngine(sys.argv[2])
    i = 0
    while True:
        b = WriteBatch()
        for j in range(5):
            b.put(b"b%06d-%d" % (i, j), b"%d" % i * 40)
        if i:
            b.delete(b"b%06d-0" % (i - 1))
        kv.write(b)
        print(i, flush=True)
        i += 1
    """
)


def test_killed_writer_loses_no_acknowledged_batch(opener: Opener, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    name = "log" if opener is open_log else "leveldb"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_WRITE, name, path], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    acked = -1
    for line in child.stdout:
        acked = int(line)
        if acked >= 300:
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    kv = opener(path)
    try:
        present = {k for k, _ in kv.iterate()}
        newest = max(int(k[1:7]) for k in present)
        assert newest >= acked  # the child may have gone on a little before it died
        want = {b"b%06d-%d" % (i, j) for i in range(newest + 1) for j in range(1, 5)}
        want.add(b"b%06d-0" % newest)
        assert present == want  # every batch whole, the newest one included
    finally:
        kv.close()


def test_the_kv_queue_says_reopen_after_its_engine_failed_a_sync(tmp_path: Path) -> None:
    """Through the Storage interface the sticky failure is a ReopenRequiredError (a
    StorageIOError), on the failing commit and on every state change after it, so a
    caller such as the relay knows that retrying on this Storage is pointless."""
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.storage import ReopenRequiredError, StorageIOError

    path = str(tmp_path / "q")
    io = FailingIO("fdatasync", fail_at=10 ** 9)
    q = KvQueue.open_log(path, io)
    with q.enqueue("a@example.org") as enq:
        enq.write(b"kept\r\n")
        (kept,) = enq.commit([Recipient("b@example.net", Schedule(0))])
    io.fail_at = io.seen + 1  # the next sync fails
    with pytest.raises(ReopenRequiredError) as ei, q.enqueue("a@example.org") as enq:
        enq.write(b"lost\r\n")
        enq.commit([Recipient("c@example.net", Schedule(0))])
    assert isinstance(ei.value, StorageIOError)
    with pytest.raises(ReopenRequiredError) as ei:
        q.send_start(kept)
    assert ei.value.handle is not None and ei.value.handle.entry_id == kept.entry_id
    q.close()
    q = KvQueue.open_log(path)
    try:
        assert kept.entry_id in [h.entry_id for h in q.list_queue()]  # acknowledged: kept
    finally:
        q.close()


def test_a_failed_directory_sync_fails_the_leveldb_engine_until_reopened(tmp_path) -> None:
    """LevelDB leaves its directory unsynced; the engine syncs it when a synced write
    changed its names.  If that sync fails, the write fails, and so does every later one
    (ReopenRequiredError from the queue): a retried fsync proves nothing about what the
    failed one dropped.  Reopening the queue works again."""
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.storage import Recipient, ReopenRequiredError, Schedule

    root = str(tmp_path / "q")
    q = KvQueue.open_leveldb(root)
    eng = q.kv

    def broken_sync() -> frozenset[str]:
        raise OSError(errno.EIO, "Input/output error")

    eng._names = frozenset()  # as if LevelDB had made a new log since the last sync
    eng._sync_names = broken_sync  # type: ignore[method-assign]
    rcpt = [Recipient("r@example.net", Schedule(0))]
    for _ in range(2):
        with pytest.raises(ReopenRequiredError), q.enqueue("a@example.org") as e:
            e.write(b"body")
            e.commit(rcpt)
    assert eng.failed is not None
    q.close()
    q = KvQueue.open_leveldb(root)
    try:
        with q.enqueue("a@example.org") as e:
            e.write(b"body")
            e.commit(rcpt)
        assert len(list(q.list_queue())) >= 1
    finally:
        q.close()


def _logs(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".log"))


def test_values_put_and_deleted_between_flushes_never_reach_a_table(tmp_path: Path) -> None:
    """Bodies in flight live and die in the memtable: the log's own limit (eight times the
    memtable's unless given) forces a flush, not the dead bytes the log holds; once the
    log passes ``log_limit`` a flush starts a new log, and a live value is kept."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, memtable_limit=64 * 1024)
    assert kv.log_limit == 8 * 64 * 1024
    first = _logs(path)
    for i in range(20):  # 400 KiB through the log, at most 20 KiB live at a time
        kv.put(b"body%02d" % i, os.urandom(20 * 1024))
        kv.delete(b"body%02d" % i)
    kv.put(b"live", b"x" * 100)
    assert _logs(path) == first  # no flush: under the memtable's and the log's limits
    assert not list(Path(path).glob("*.tbl"))
    kv.close()

    kv = LogEngine(path, memtable_limit=64 * 1024, log_limit=100 * 1024)
    try:
        before = _logs(path)
        for i in range(10):  # 200 KiB through the log: past the log's limit
            kv.put(b"body%02d" % i, os.urandom(20 * 1024))
            kv.delete(b"body%02d" % i)
        assert _logs(path) != before  # flushed: a new log
        assert kv.get(b"live") == b"x" * 100
        assert [k for k, _ in kv.iterate()] == [b"live"]
    finally:
        kv.close()


@pytest.mark.parametrize("limits", [{"memtable_limit": 0}, {"log_limit": 0},
                                    {"log_limit": True}, {"log_limit": 1.5}])
def test_engine_limits_must_be_positive_ints(tmp_path: Path, limits: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError, match=next(iter(limits))):
        LogEngine(str(tmp_path / "db"), **limits)  # type: ignore[arg-type]


def test_the_log_limit_is_a_sixteenth_of_a_small_file_system() -> None:
    from queue_ref.kv.logengine.engine import default_log_limit
    mib = 1 << 20
    assert default_log_limit(8 * mib, None) == 64 * mib  # size unknown: eight memtables
    assert default_log_limit(8 * mib, 100 * 1024 * mib) == 64 * mib  # a big disk
    assert default_log_limit(8 * mib, 24 * mib) == 24 * mib // 16  # 1.5 MiB on 24 MiB
    assert default_log_limit(8 * mib, 512 * 1024) == 64 * 1024  # never below 64 KiB


class NoRoomForTables(OsIO):
    """A disk with no room for a new table: creating one fails with ENOSPC."""

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        if path.endswith(".tbl.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().open_create(path, exclusive=exclusive, append=append)


def test_a_log_past_its_limit_opens_on_a_full_disk_and_flushes_once_there_is_room(
        tmp_path: Path) -> None:
    """A store closed with its log past the limit (its last flush found the disk full)
    opens on a still full disk as it is: the flush at opening waits for room, as a
    writer's does; nothing is lost, and the next opening with room flushes."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, memtable_limit=1 << 20, log_limit=1 << 20)
    model = {b"k%03d" % i: os.urandom(1000) for i in range(60)}
    for k, v in model.items():
        kv.put(k, v)
    kv.close()
    before = log_files(tmp_path / "db")
    kv = LogEngine(path, NoRoomForTables(), memtable_limit=1 << 20, log_limit=16 * 1024)
    try:
        assert dict(kv.iterate()) == model
        assert log_files(tmp_path / "db") == before  # not flushed: no room
        kv.put(b"more", b"x")
    finally:
        kv.close()
    kv = LogEngine(path, memtable_limit=1 << 20, log_limit=16 * 1024)
    try:
        assert dict(kv.iterate()) == {**model, b"more": b"x"}
        assert log_files(tmp_path / "db") != before  # flushed at opening
    finally:
        kv.close()

# ---- draining a full disk: tables in pieces, reclaim ------------------------------------


def _filled(path: str, n: int = 40, *, table_limit: int = 1024) -> dict[bytes, bytes]:
    """A store of ``n`` keys of 200 bytes compacted into pieces of about ``table_limit``
    bytes, then most keys deleted or overwritten by synced writes (in the log); the
    contents."""
    kv = LogEngine(path, memtable_limit=4096, table_limit=table_limit)
    try:
        model = {b"k%03d" % i: bytes([i]) * 200 for i in range(n)}
        for k, v in model.items():
            kv.put(k, v)
        kv.compact()
        for i in range(0, n, 4):  # a quarter stays as it was
            for j in (i + 1, i + 2):
                kv.delete(b"k%03d" % j)
                del model[b"k%03d" % j]
            kv.put(b"k%03d" % (i + 3), b"new")
            model[b"k%03d" % (i + 3)] = b"new"
        return model
    finally:
        kv.close()


def _table_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.tbl"))


def test_a_table_past_its_limit_is_written_in_pieces(tmp_path: Path) -> None:
    """A compaction of 8 KB under a table limit of 1 KiB makes pieces of about 1 KiB, each
    a table of its own, which reads, reopening and another compaction take as one table
    (one run: nothing to merge)."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, table_limit=1024)
    try:
        model = {b"k%03d" % i: bytes([i]) * 200 for i in range(40)}
        for k, v in model.items():
            kv.put(k, v)
        kv.compact()
        pieces = sorted(Path(path).glob("*.tbl"))
        assert len(pieces) >= 6
        assert all(p.stat().st_size < 1024 + 400 for p in pieces)
        assert dict(kv.iterate()) == model and kv.get(b"k017") == model[b"k017"]
        kv.compact()  # one run without tombstones: left as it is
        assert sorted(Path(path).glob("*.tbl")) == pieces
    finally:
        kv.close()
    kv = LogEngine(path, table_limit=1024)
    try:
        assert dict(kv.iterate()) == model and kv.recovery.tables == len(pieces)
    finally:
        kv.close()


def test_the_table_limit_is_a_sixty_fourth_of_the_file_system() -> None:
    from queue_ref.kv.logengine.engine import default_table_limit
    mib = 1 << 20
    assert default_table_limit(None) == 8 * mib
    assert default_table_limit(24 * mib) == 384 * 1024  # a quarter of the reserve there
    assert default_table_limit(1024 * mib) == 8 * mib
    assert default_table_limit(1 * mib) == 64 * 1024


def test_reclaim_gives_back_what_deleted_and_overwritten_keys_took(tmp_path: Path) -> None:
    """The old values of deleted and overwritten keys, in pieces written before, go with a
    reclaim (piece by piece, then the memtable flushed alone and the old log deleted): the
    contents are the same, before and after a reopen, and a second reclaim frees nothing."""
    path = str(tmp_path / "db")
    model = _filled(path)
    kv = LogEngine(path, memtable_limit=4096, table_limit=1024)
    try:
        before = _table_bytes(path)
        freed = kv.reclaim()
        assert freed > 0 and _table_bytes(path) < before // 2
        assert dict(kv.iterate()) == model
        assert kv.reclaim() <= 0  # nothing left to give back
        assert dict(kv.iterate()) == model
    finally:
        kv.close()
    assert reopened_contents(path, memtable_limit=4096, table_limit=1024) == model


def reopened_contents(path: str, **kw: int) -> dict[bytes, bytes]:
    """What an engine opened again on ``path`` (with ``kw``) holds."""
    kv = LogEngine(path, **kw)
    try:
        return dict(kv.iterate())
    finally:
        kv.close()


def test_a_reclaim_crashed_anywhere_keeps_the_contents_under_every_model(
        tmp_path: Path) -> None:
    """A reclaim after three unsynced writes (two overwrite values in pieces), crashed
    before and after each of its disk calls, under each persistence model (a power cut
    may lose what was not synced): every disk it may leave opens with the contents before
    it, with a prefix of the unsynced writes applied (they promise nothing, but their
    order holds), and nothing else: no value a reclaim dropped (hidden by a newer write)
    comes back or goes missing.  (A reclaim that let unsynced writes hide values, without
    making them durable first, lost ``k000`` here.)"""
    from faultinject import materialize
    from tests.faultinject_support import ALL_MODELS, every_crash_point, fresh_dir_factory

    holder: dict[str, dict[bytes, bytes]] = {}

    def setup(root: str) -> None:
        holder["model"] = _filled(os.path.join(root, "db"))

    unsynced: list[tuple[bytes, bytes | None]] = [
        (b"k000", b"over"), (b"k004", None), (b"k003", b"again")]

    def script(io: object, root: str) -> None:
        kv = LogEngine(os.path.join(root, "db"), io,  # type: ignore[arg-type]
                       memtable_limit=4096, table_limit=1024)
        for k, v in unsynced:
            if v is None:
                kv.delete(k, sync=False)
            else:
                kv.put(k, v, sync=False)
        kv.reclaim()
        kv.close()

    allowed = []
    (tmp_path / "runs").mkdir()
    points = every_crash_point(fresh_dir_factory(str(tmp_path / "runs"), setup), script)
    model = holder["model"]
    for n in range(len(unsynced) + 1):
        m = dict(model)
        for k, v in unsynced[:n]:
            m.pop(k, None) if v is None else m.__setitem__(k, v)
        allowed.append(m)
    assert len(points) > 40  # the reclaim's piece rewrites and flush are in it
    seen = 0
    for i, (_plan, io) in enumerate(points):
        for m in ALL_MODELS:
            for j, state in enumerate(states_of(io, m)):
                dest = str(tmp_path / f"s{i}-{m}-{j}")
                materialize(state.image, dest)
                kv = LogEngine(os.path.join(dest, "db"), memtable_limit=4096,
                               table_limit=1024)
                try:
                    assert dict(kv.iterate()) in allowed, (i, m, state.description)
                finally:
                    kv.close()
                shutil.rmtree(dest)
                seen += 1
    assert seen > len(points)


def states_of(io: object, model: str) -> list[Any]:
    from tests.faultinject_support import states
    return states(io, model, exhaustive_limit=6, random_states=4)  # type: ignore[arg-type]


def test_a_reclaim_reads_again_only_the_pieces_newer_writes_fall_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a reclaim that went through, the next one reads only the pieces whose key range
    a write since then falls in (and the tables made since): its cost follows what was
    written, not what the store holds.  What it gives back is still all there is."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, memtable_limit=1 << 20, table_limit=1024)
    try:
        model = {b"k%03d" % i: bytes([i]) * 200 for i in range(200)}
        for k, v in model.items():
            kv.put(k, v)
        kv.compact()
        kv.reclaim()
        pieces = len(list(Path(path).glob("*.tbl")))
        assert pieces >= 30
        read: list[int] = []
        still_read = LogEngine._still_read

        def counting(piece: Any, *args: Any) -> Any:
            read.append(piece.number)
            return still_read(piece, *args)

        monkeypatch.setattr(LogEngine, "_still_read", staticmethod(counting))
        for i in (100, 101, 102):
            kv.delete(b"k%03d" % i)
            del model[b"k%03d" % i]
        before = _table_bytes(path)
        assert kv.reclaim() > 0 and _table_bytes(path) < before - 500
        assert 1 <= len(read) <= 6  # of more than 30
        assert dict(kv.iterate()) == model
    finally:
        kv.close()
    kv = LogEngine(path, memtable_limit=1 << 20, table_limit=1024)
    try:
        assert dict(kv.iterate()) == model
    finally:
        kv.close()
