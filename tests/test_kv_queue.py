"""The KV queue (seed 000's layout) on every engine: lifecycle, raw key layout, ordering,
indexes, ids, big bodies, corruption, bad input, recovery, draining to zero."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref.kv import core, keys, kv_records
from queue_ref.kv.base import WriteBatch
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    Capability,
    ClosedError,
    CorruptionError,
    InflightMail,
    InvalidInputError,
    MisuseError,
    NoSpaceError,
    QueuedMail,
    Recipient,
    Schedule,
    StorageIOError,
)
from tests.kv_dict import DictKV, DictStore
from tests.test_fsqueue_body_digest import write_sha256_digests

ENGINES = ["dict", "log", "leveldb"]
DISK_ENGINES = ["log", "leveldb"]


class Env:
    """Opens (and reopens) a queue on one engine; closes whatever it opened."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        self.path = str(path / "db")
        self.store = DictStore()
        self.opened: list[KvQueue] = []

    def open(self, *, recover: bool = True) -> KvQueue:
        if self.kind == "dict":
            q = KvQueue(DictKV(self.store), recover=recover)
        elif self.kind == "log":
            q = KvQueue.open_log(self.path, recover=recover)
        else:
            q = KvQueue.open_leveldb(self.path, recover=recover)
        self.opened.append(q)
        return q

    def reopen(self, q: KvQueue, *, recover: bool = True) -> KvQueue:
        q.close()
        return self.open(recover=recover)

    def close_all(self) -> None:
        for q in self.opened:
            q.close()


@pytest.fixture(params=ENGINES)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    e = Env(request.param, tmp_path)
    yield e
    e.close_all()


@pytest.fixture(params=DISK_ENGINES)
def disk_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    e = Env(request.param, tmp_path)
    yield e
    e.close_all()


@pytest.fixture
def dict_env(tmp_path: Path) -> Iterator[Env]:
    e = Env("dict", tmp_path)
    yield e
    e.close_all()


def rcpt(addr: str, at: int = 0, zone: str = "default") -> Recipient:
    return Recipient(addr, Schedule(at), zone)


def put(q: KvQueue, body: bytes, rcpts: list[Recipient], sender: str = "s@x.org",
        piece: int = 10_000) -> list[QueuedMail]:
    with q.enqueue(sender, {"ENVID": "e1"}) as e:
        for i in range(0, len(body), piece):
            e.write(body[i:i + piece])
        return e.commit(rcpts)


def raw_keys(q: KvQueue) -> set[bytes]:
    return {k for k, _ in q.kv.iterate()}


def mid(n: int) -> bytes:
    return b"%020d" % n


def read_body(q: KvQueue, h: InflightMail) -> bytes:
    with q.read_inflight(h) as r:
        return r.read_all()


def corrupt(q: KvQueue, key: bytes, value: bytes | None = None) -> None:
    """Overwrite a stored value behind the queue's back (a flipped byte by default)."""
    old = q.kv.get(key)
    assert old is not None
    b = WriteBatch()
    if value is None:
        i = len(old) // 2
        value = old[:i] + bytes([old[i] ^ 0x20]) + old[i + 1:]
    b.put(key, value)
    q.kv.write(b)


# ---- lifecycle and layout ---------------------------------------------------------------


def test_full_lifecycle(env: Env) -> None:
    q = env.open()
    body = os.urandom(150_000)
    a, b, c = put(q, body, [rcpt("a@x.org", 5), rcpt("b@y.org", 7, "slow"), rcpt("c@x.org")])
    assert {h.entry_id for h in q.list_queue()} == {a.entry_id, b.entry_id, c.entry_id}
    assert q.reschedule(c, Schedule(9, 1)) is not None
    ia = q.send_start(a)
    assert ia is not None and ia.schedule == Schedule(5)
    with q.read_inflight(ia) as r:
        m = r.meta
        assert (m.mail_from, m.rcpt, m.rcpt_index, m.zone) == ("s@x.org", "a@x.org", 0, "default")
        assert (m.params, m.body_size, m.message_id) == ({"ENVID": "e1"}, 150_000, a.message_id)
        assert r.read_all() == body
    pa = q.send_done(ia)
    assert pa is not None and q.cleanup(pa)
    ib = q.send_start(b)
    assert ib is not None
    qb = q.send_cancel(ib, Schedule(20, 1))
    assert qb is not None and qb.schedule == Schedule(20, 1)
    [again] = [h for h in q.list_zone("slow")]
    assert again.schedule == Schedule(20, 1)
    [pc] = [q.drop(h) for h in q.list_zone("default")]
    pb = q.drop(qb)
    assert pb is not None and pc is not None
    assert sorted(h.entry_id for h in q.find_pending_cleanup()) == sorted(
        [pb.entry_id, pc.entry_id])
    assert q.cleanup(pb) and q.cleanup(pc)
    assert q.footprint().objects == 0 and q.footprint().bytes == 0
    assert raw_keys(q) == {b"seq"}
    assert list(q.list_queue()) == [] and list(q.find_inflight()) == []


def test_key_layout_after_each_operation(env: Env) -> None:
    q = env.open()
    body = b"x" * (64 * 1024 + 10)
    h0, h1 = put(q, body, [rcpt("u@Ex.COM", 3), rcpt("v@ex.com", 4, "z 1")])
    m = mid(int(h0.message_id))
    msg = {b"message " + m + t for t in (b" #", b" *", b" 00000001", b" 00000002")}
    z0, z1 = b"delivery-zone default " + m + b" 000000", b"delivery-zone z%201 " + m + b" 000001"
    d0, d1 = b"domain ex.com " + m + b" 000000", b"domain ex.com " + m + b" 000001"
    live = b"live " + m
    assert raw_keys(q) == {b"seq", live, z0, z1, d0, d1} | msg
    assert q.kv.get(b"message " + m + b" 00000002") == b"x" * 10
    assert kv_records.decode_live(q.kv.get(live) or b"", int(h0.message_id)) == 2
    meta = kv_records.MetaRec.decode(q.kv.get(b"message " + m + b" *") or b"", int(h0.message_id))
    assert meta.rcpts == (("u@Ex.COM", "default"), ("v@ex.com", "z 1"))
    assert meta.digest == f"crc32:{zlib.crc32(body):08x}" and meta.chunks == 2

    i0 = q.send_start(h0)
    assert i0 is not None
    inflight = b"inflight " + m + b" 000000"
    assert raw_keys(q) == {b"seq", live, inflight, z1, d1} | msg
    rec = kv_records.EntryRec.decode(q.kv.get(inflight) or b"", int(h0.message_id), 0, "inflight")
    assert (rec.address, rec.zone, rec.schedule, rec.owner) == (
        "u@Ex.COM", "default", Schedule(3), f"pid {os.getpid()}")

    p0 = q.send_done(i0)
    assert p0 is not None
    c0 = b"cleanup " + m + b" 000000"
    assert raw_keys(q) == {b"seq", live, c0, z1, d1} | msg
    assert q.cleanup(p0)
    assert raw_keys(q) == {b"seq", live, z1, d1} | msg
    assert kv_records.decode_live(q.kv.get(live) or b"", int(h0.message_id)) == 1

    r1 = q.reschedule(h1, Schedule(50, 2))
    assert r1 is not None and raw_keys(q) == {b"seq", live, z1, d1} | msg
    p1 = q.drop(r1)
    assert p1 is not None
    assert raw_keys(q) == {b"seq", live, b"cleanup " + m + b" 000001"} | msg
    assert q.cleanup(p1)
    assert raw_keys(q) == {b"seq"}


@pytest.mark.parametrize("text", ["a@x", "", "é \"q\"\n\\ z", "\udcff", "ü" * 300])
def test_records_formatted_directly_equal_the_generic_encoding(text: str) -> None:
    S = Schedule
    entry = kv_records.EntryRec(12, 3, "inflight", text, text + "z", S(10**18, 7), text)
    assert entry.encode() == kv_records.seal({
        "k": "entry", "e": "12.3", "state": "inflight", "addr": text, "zone": text + "z",
        "at": 10**18, "n": 7, "owner": text})
    assert kv_records.EntryRec.decode(entry.encode(), 12, 3, "inflight") == entry
    assert kv_records.domain_value(12, 3, text) == kv_records.seal(
        {"k": "domain", "e": "12.3", "zone": text})
    assert kv_records.live_value(12, 4) == kv_records.seal({"k": "live", "id": 12, "n": 4})
    assert kv_records.created_value(12, 99) == kv_records.seal({"k": "created", "id": 12, "at": 99})
    for params in ({}, {text: text, "a": "1"}):
        for field, digest in (("digest", "crc32:0a0b0c0d"), ("sha256", "0" * 64)):
            # a CRC-32 now; a sha256 as an older version wrote it, under its old name
            meta = kv_records.MetaRec(12, text, params, 5, digest, 1, 99,
                                      ((text, "d"), ("b", text)))
            assert meta.encode() == kv_records.seal({
                "k": "meta", "id": 12, "from": text, "params": params, "size": 5,
                field: digest, "chunks": 1, "created": 99,
                "rcpts": [[text, "d"], ["b", text]]})
            assert kv_records.MetaRec.decode(meta.encode(), 12) == meta
    base = {"k": "meta", "id": 12, "from": "a", "params": {}, "size": 5, "chunks": 1,
            "created": 99, "rcpts": [["b", "d"]]}
    for fields in ({}, {"digest": "crc32:0a0b0c0d", "sha256": "0" * 64},
                   {"digest": "0" * 64}, {"sha256": "crc32:0a0b0c0d"}, {"digest": "crc32:xyz"}):
        with pytest.raises(kv_records.BadRecord):
            kv_records.MetaRec.decode(kv_records.seal({**base, **fields}), 12)


def test_sync_policy_of_each_batch(dict_env: Env) -> None:
    q = dict_env.open()
    log = dict_env.store.writes
    [h] = put(q, b"small", [rcpt("a@b")])
    assert log[-1][1] is True  # commit
    n = len(log)
    i = q.send_start(h)
    assert i is not None and log[n:] == [(3, False)]
    c = q.send_cancel(i, Schedule(1))
    assert c is not None and log[-1][1] is True
    r = q.reschedule(c, Schedule(2))
    assert r is not None and log[-1] == (1, True)
    i = q.send_start(r)
    assert i is not None
    p = q.send_done(i)
    assert p is not None and log[-1] == (2, True)
    assert q.cleanup(p) and log[-1][1] is False


def test_zone_listing_is_oldest_first_per_zone(env: Env) -> None:
    q = env.open()
    ids = []
    for n in range(6):
        zone = "a" if n % 2 == 0 else "b"
        hs = put(q, b"m%d" % n, [rcpt(f"r{n}@x", 100 - n, zone), rcpt(f"s{n}@x", 0, "a b")])
        ids.append(hs[0].message_id)
    order = [h.message_id for h in q.list_zone("a")]
    assert order == [ids[0], ids[2], ids[4]]
    assert [h.message_id for h in q.list_zone("b")] == [ids[1], ids[3], ids[5]]
    assert [h.message_id for h in q.list_zone("a b")] == ids  # no prefix confusion with "a"
    assert list(q.list_zone("a%20b")) == [] and list(q.list_zone("c")) == []
    # A new schedule or a cancelled send keeps the entry's place (oldest message first).
    first = next(iter(q.list_zone("a")))
    r = q.reschedule(first, Schedule(10_000))
    assert r is not None
    i = q.send_start(r)
    assert i is not None
    assert [h.message_id for h in q.list_zone("a")] == [ids[2], ids[4]]
    assert q.send_cancel(i, Schedule(5)) is not None
    assert [h.message_id for h in q.list_zone("a")] == [ids[0], ids[2], ids[4]]
    assert int(ids[0]) < int(ids[2]) < int(ids[4])


def test_domain_index(env: Env) -> None:
    q = env.open()
    hs = put(q, b"b", [rcpt("a@Example.ORG"), rcpt("b@example.org", zone="z"),
                       rcpt("c@other.net"), rcpt("d@ex ample.org"), rcpt("../..@../x")])
    assert Capability.DOMAIN_INDEX in q.capabilities
    got = [h.entry_id for h in q.list_domain("EXAMPLE.org")]
    assert got == [hs[0].entry_id, hs[1].entry_id]
    assert [h.entry_id for h in q.list_domain("ex ample.org")] == [hs[3].entry_id]
    assert [h.entry_id for h in q.list_domain("../x")] == [hs[4].entry_id]
    assert list(q.list_domain("example")) == [] and list(q.list_domain("")) == []
    i = q.send_start(hs[0])
    assert i is not None
    assert [h.entry_id for h in q.list_domain("example.org")] == [hs[1].entry_id]
    assert q.send_cancel(i, Schedule(3)) is not None
    [h0, h1] = list(q.list_domain("example.org"))
    assert h0.schedule == Schedule(3) and h1.entry_id == hs[1].entry_id
    assert q.drop(h1) is not None
    assert [h.entry_id for h in q.list_domain("example.org")] == [hs[0].entry_id]
    for k in raw_keys(q):  # keys are printable ASCII without NUL or line breaks
        assert all(0x20 <= c < 0x7f for c in k), k


def test_unicode_and_odd_zone_names(env: Env) -> None:
    q = env.open()
    zones = ["ü", "a%b", "x\ud800y", " lead", "-"]
    hs = put(q, b"b", [rcpt(f"u{n}@dömain.de", n, z) for n, z in enumerate(zones)])
    for h, z in zip(hs, zones, strict=True):
        assert [x.entry_id for x in q.list_zone(z)] == [h.entry_id]
    assert len(list(q.list_domain("DÖMAIN.de"))) == len(zones)
    q = env.reopen(q)
    assert q.last_recovery.problems == ()
    i = q.send_start(next(iter(q.list_zone("x\ud800y"))))
    assert i is not None and q.read_inflight(i).meta.zone == "x\ud800y"


# ---- ids --------------------------------------------------------------------------------


def test_ids_are_monotonic_and_unique_across_reopen(env: Env,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "ID_BLOCK", 4)
    q = env.open()
    seen: list[int] = []
    for round_ in range(3):
        for _ in range(6):  # crosses id blocks
            [h] = put(q, b"x", [rcpt("a@b")])
            seen.append(int(h.message_id))
        for h in list(q.list_queue()):  # drain, so no id is visible on disk any more
            p = q.drop(h)
            assert p is not None and q.cleanup(p)
        assert raw_keys(q) == {b"seq"}
        mark = kv_records.decode_seq(q.kv.get(b"seq") or b"")
        assert mark > seen[-1], round_
        q = env.reopen(q)
    assert seen == sorted(set(seen))


def test_ids_survive_a_corrupt_mark(env: Env) -> None:
    q = env.open()
    [h] = put(q, b"x", [rcpt("a@b")])
    corrupt(q, b"seq")
    q = env.reopen(q)
    [h2] = put(q, b"y", [rcpt("a@b")])
    assert int(h2.message_id) > int(h.message_id)


def test_concurrent_enqueues_get_distinct_ids(env: Env) -> None:
    q = env.open()
    out: list[str] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        for j in range(15):
            [h] = put(q, b"%d-%d" % (n, j), [rcpt(f"r{n}@x")])
            with lock:
                out.append(h.message_id)

    ts = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(set(out)) == 60 and len(list(q.list_queue())) == 60


# ---- bodies -----------------------------------------------------------------------------


def test_body_goes_with_the_last_recipient(env: Env) -> None:
    q = env.open()
    hs = put(q, os.urandom(3 * 64 * 1024 - 1), [rcpt("a@x"), rcpt("b@x"), rcpt("c@x")])
    prefix = b"message " + mid(int(hs[0].message_id))
    chunks = {k for k in raw_keys(q) if k.startswith(prefix)}
    assert len(chunks) == 5  # #, * and 3 chunks
    for n, h in enumerate(hs):
        p = q.drop(h)
        assert p is not None and q.cleanup(p)
        left = {k for k in raw_keys(q) if k.startswith(prefix)}
        assert left == (chunks if n < 2 else set())
    assert q.footprint().objects == 0


def test_empty_body_and_exact_chunk_sizes(env: Env) -> None:
    q = env.open()
    for size in (0, 1, 64 * 1024, 64 * 1024 + 1, 2 * 64 * 1024):
        body = os.urandom(size)
        [h] = put(q, body, [rcpt("a@x")], piece=7_777)
        i = q.send_start(h)
        assert i is not None and read_body(q, i) == body
        with q.read_inflight(i) as r:  # small reads
            got = b"".join(iter(lambda: r.read(1000), b""))
        assert got == body


def test_ten_thousand_recipients(env: Env) -> None:
    q = env.open()
    n = 10_000
    rcpts = [rcpt(f"user{i}@d{i % 7}.example", i, f"z{i % 3}") for i in range(n)]
    hs = put(q, b"hello\r\n" * 1000, rcpts)
    assert [h.entry_id for h in hs] == [f"{hs[0].message_id}.{i}" for i in range(n)]
    assert sum(1 for _ in q.list_queue()) == n
    assert [int(h.entry_id.split(".")[1]) for h in q.list_zone("z1")] == list(range(1, n, 3))
    assert sum(1 for _ in q.list_domain("d3.example")) == len(range(3, n, 7))
    for h in hs[:3]:
        i = q.send_start(h)
        assert i is not None
        with q.read_inflight(i) as r:
            assert r.meta.rcpt == rcpts[int(h.entry_id.split(".")[1])].address
            assert r.read_all() == b"hello\r\n" * 1000
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)

    def drain(part: list[QueuedMail]) -> None:
        for h in part:
            p = q.drop(h)
            assert p is not None and q.cleanup(p)

    rest = hs[3:]
    ts = [threading.Thread(target=drain, args=(rest[k::4],)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert q.footprint().objects == 0 and raw_keys(q) == {b"seq"}


def test_hundred_megabyte_body_in_flat_memory(disk_env: Env) -> None:
    q = disk_env.open()
    piece = os.urandom(64 * 1024 - 3)  # misaligned with the chunks on purpose
    count = 100 * 1024 * 1024 // len(piece) + 1
    digest = hashlib.sha256()
    tracemalloc.start()
    try:
        e = q.enqueue("big@x")
        for _ in range(count):
            e.write(piece)
            digest.update(piece)
        [h] = e.commit([rcpt("a@x")])
        enqueue_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        i = q.send_start(h)
        assert i is not None
        got = hashlib.sha256()
        size = 0
        with q.read_inflight(i) as r:
            for b in r:
                got.update(b)
                size += len(b)
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size == count * len(piece) > 100 * 1024 * 1024
    assert got.digest() == digest.digest()
    # Flat: a few chunks beyond what the engine keeps in its memtable while a big body
    # streams in (the log engine: up to ``spill_limit`` of live writes, here the body's
    # last chunks); reading holds nothing in it.
    held = getattr(q.kv, "spill_limit", 0)
    assert enqueue_peak < held + 4 * 1024 * 1024, enqueue_peak
    assert read_peak < 1024 * 1024, read_peak
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    assert q.footprint().objects == 0


# ---- corruption -------------------------------------------------------------------------


def test_corrupt_entry_record_is_quarantined_when_listed(env: Env) -> None:
    q = env.open()
    h0, h1 = put(q, b"body", [rcpt("a@x"), rcpt("b@x")])
    m = mid(int(h0.message_id))
    zkey = b"delivery-zone default " + m + b" 000000"
    corrupt(q, zkey)
    assert [h.entry_id for h in q.list_queue()] == [h1.entry_id]
    assert [k for k, _ in q.quarantined()] == [b"quarantine " + zkey]
    assert kv_records.decode_live(q.kv.get(b"live " + m) or b"", int(h0.message_id)) == 1
    assert q.send_start(h0) is None  # its entry is gone
    assert [h.entry_id for h in q.list_domain("x")] == [h1.entry_id]  # stale key skipped
    i = q.send_start(h1)
    assert i is not None and read_body(q, i) == b"body"
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    assert q.footprint().objects == 0  # the orphaned domain key went with the recount


def test_corrupt_record_in_an_operation_raises(env: Env) -> None:
    q = env.open()
    [h] = put(q, b"body", [rcpt("a@x")])
    corrupt(q, b"delivery-zone default " + mid(int(h.message_id)) + b" 000000", b"{}")
    with pytest.raises(CorruptionError) as ei:
        q.send_start(h)
    assert ei.value.entry_id == h.entry_id and ei.value.quarantined_to
    assert list(q.list_queue()) == []
    q = env.reopen(q)
    assert q.footprint().objects == 0 and len(q.quarantined()) == 1


def test_corrupt_metadata_quarantines_the_message(env: Env) -> None:
    q = env.open()
    body = os.urandom(200_000)
    h0, h1 = put(q, body, [rcpt("a@x"), rcpt("b@y")])
    m = mid(int(h0.message_id))
    corrupt(q, b"message " + m + b" *")
    i = q.send_start(h0)
    assert i is not None
    with pytest.raises(CorruptionError) as ei:
        q.read_inflight(i)
    assert ei.value.entry_id == h0.entry_id
    assert q.footprint().objects == 0
    qkeys = {k for k, _ in q.quarantined()}
    assert b"quarantine message " + m + b" 00000004" in qkeys
    assert b"quarantine delivery-zone default " + m + b" 000001" in qkeys
    assert b"quarantine inflight " + m + b" 000000" in qkeys
    assert q.send_done(i) is None and q.send_start(h1) is None


def test_corrupt_body_is_never_handed_out_whole(env: Env) -> None:
    q = env.open()
    body = os.urandom(5 * 64 * 1024 + 100)
    [h] = put(q, body, [rcpt("a@x")])
    corrupt(q, b"message " + mid(int(h.message_id)) + b" 00000003")
    i = q.send_start(h)
    assert i is not None
    got = bytearray()
    r = q.read_inflight(i)
    with pytest.raises(CorruptionError):
        while b := r.read(4096):
            got += b
    assert len(got) == len(body) - 100  # the last chunk (100 bytes) was held back
    with pytest.raises(CorruptionError):
        r.read(1)  # and stays refused
    r.close()
    with pytest.raises(ClosedError):
        q.read_inflight(i)  # the entry went to quarantine
    assert q.send_done(i) is None and q.footprint().objects == 0
    assert len([k for k, _ in q.quarantined() if k.count(b" ") == 3]) >= 6


def test_missing_chunk_and_truncated_body(env: Env) -> None:
    q = env.open()
    h0, h1 = (put(q, os.urandom(3 * 64 * 1024), [rcpt("a@x")])[0] for _ in range(2))
    b = WriteBatch()
    b.delete(b"message " + mid(int(h0.message_id)) + b" 00000002")
    q.kv.write(b)
    corrupt(q, b"message " + mid(int(h1.message_id)) + b" 00000003", b"short")
    for h in (h0, h1):
        i = q.send_start(h)
        assert i is not None
        with pytest.raises(CorruptionError):
            read_body(q, i)
    assert q.footprint().objects == 0


def test_corrupt_live_count_is_recounted(env: Env) -> None:
    q = env.open()
    hs = put(q, b"body", [rcpt("a@x"), rcpt("b@x"), rcpt("c@x")])
    live = b"live " + mid(int(hs[0].message_id))
    corrupt(q, live, kv_records.live_value(int(hs[0].message_id), 1)[:-3] + b"xx}")
    p = q.drop(hs[0])
    assert p is not None and q.cleanup(p)  # recounts 3, keeps the body
    assert kv_records.decode_live(q.kv.get(live) or b"", int(hs[0].message_id)) == 2
    i = q.send_start(hs[1])
    assert i is not None and read_body(q, i) == b"body"


def test_recovery_quarantines_corrupt_records(env: Env) -> None:
    q = env.open()
    [a] = put(q, b"A", [rcpt("a@x")])
    b0, b1 = put(q, b"B", [rcpt("b@x"), rcpt("c@x")])
    i = q.send_start(b0)
    assert i is not None
    corrupt(q, b"message " + mid(int(a.message_id)) + b" #")
    corrupt(q, b"inflight " + mid(int(b0.message_id)) + b" 000000")
    q = env.reopen(q)
    rep = q.last_recovery
    assert rep.quarantined == 2 and rep.requeued == 0 and len(rep.problems) >= 2
    assert [h.entry_id for h in q.list_queue()] == [b1.entry_id]
    again = q.recover()
    assert again.quarantined == 0 and again.problems == ()


# ---- bad input --------------------------------------------------------------------------


def test_foreign_stale_and_wrong_handles(env: Env) -> None:
    q = env.open()
    other = KvQueue(DictKV())
    mem = MemoryStorage()
    [h] = put(q, b"b", [rcpt("a@x")])
    [oh] = put(other, b"b", [rcpt("a@x")])
    with mem.enqueue("") as e:
        [mh] = e.commit([rcpt("a@x")])
    for bad in (oh, mh):
        with pytest.raises(MisuseError):
            q.send_start(bad)
    with pytest.raises(MisuseError):
        q.send_done(h)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        q.cleanup(h)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        q.reschedule(h, 5)  # type: ignore[arg-type]
    twin = next(iter(q.list_queue()))
    i = q.send_start(h)
    assert i is not None
    with pytest.raises(MisuseError):
        q.send_start(h)  # used
    assert q.send_start(twin) is None  # vanished: another claim won
    with pytest.raises(MisuseError):
        q.read_inflight(h)  # type: ignore[arg-type]
    q2 = env.reopen(q)
    with pytest.raises(ClosedError):
        q.list_queue()
    [h2] = list(q2.list_queue())
    with pytest.raises(MisuseError):
        q2.send_done(i)  # a handle of the queue before the restart
    p = q2.drop(h2)
    assert p is not None
    twins = list(q2.find_pending_cleanup())
    assert q2.cleanup(p) and q2.cleanup(twins[0]) is False
    other.close()


def test_bad_addresses_and_arguments(env: Env) -> None:
    q = env.open()
    for bad in ("a\x00b", "a\nb", "a\rb", 5):
        with pytest.raises(InvalidInputError):
            q.enqueue(bad)  # type: ignore[arg-type]
        with q.enqueue("s@x") as e:
            with pytest.raises(InvalidInputError):
                e.commit([Recipient(bad, Schedule(0))])  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError):
                e.commit([Recipient("ok@x", Schedule(0), bad)])  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            q.list_zone(bad)  # type: ignore[arg-type]
    for params in ({"a": 1}, {"a\x00": "b"}, ["x"]):
        with pytest.raises(InvalidInputError):
            q.enqueue("s@x", params)  # type: ignore[arg-type]
    e = q.enqueue("s@x")
    with pytest.raises(InvalidInputError):
        e.write("text")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        e.commit([])
    with pytest.raises(InvalidInputError):
        e.commit("a@x")  # type: ignore[arg-type]
    e.write(b"still usable")
    [h] = e.commit([rcpt("../../etc/passwd@../..")])
    with pytest.raises(ClosedError):
        e.write(b"more")
    with pytest.raises(ClosedError):
        e.commit([rcpt("a@x")])
    i = q.send_start(h)
    assert i is not None and q.read_inflight(i).meta.rcpt == "../../etc/passwd@../.."
    assert not any(b"passwd" in k for k in raw_keys(q))
    if env.kind != "dict":
        assert sorted(os.listdir(env.path)) == sorted(
            n for n in os.listdir(env.path) if "/" not in n and "passwd" not in n)


def test_closed_queue_and_streams(env: Env) -> None:
    q = env.open()
    [h] = put(q, b"b" * 100_000, [rcpt("a@x")])
    i = q.send_start(h)
    assert i is not None
    r = q.read_inflight(i)
    assert r.read(10) == b"b" * 10
    e = q.enqueue("s@x")
    e.write(b"x")
    q.close()
    q.close()  # idempotent
    for call in (q.list_queue, q.find_inflight, q.find_pending_cleanup, q.recover,
                 q.footprint, lambda: q.enqueue("a@x"), lambda: q.send_done(i),
                 lambda: q.list_zone("default"), lambda: q.list_domain("x")):
        with pytest.raises(ClosedError):
            call()
    with pytest.raises(ClosedError):
        r.read(10)
    with pytest.raises(ClosedError):
        e.write(b"y")
    e.abort()  # still idempotent and quiet
    r.close()


def test_abort_removes_the_chunks(env: Env) -> None:
    q = env.open()
    with q.enqueue("s@x") as e:
        e.write(os.urandom(3 * 1024 * 1024))  # several unsynced chunk batches
        assert any(k.startswith(b"message ") for k in raw_keys(q))
        e.abort()
        e.abort()
    assert raw_keys(q) <= {b"seq"}
    with pytest.raises(RuntimeError), q.enqueue("s@x") as e2:
        e2.write(os.urandom(2 * 1024 * 1024))
        raise RuntimeError("client went away")
    assert raw_keys(q) <= {b"seq"}


# ---- errors from the engine -------------------------------------------------------------


def test_io_errors_give_the_handle_back(dict_env: Env) -> None:
    q = dict_env.open()
    [h] = put(q, b"b", [rcpt("a@x")])
    i = q.send_start(h)
    assert i is not None
    dict_env.store.fail = OSError(errno.EIO, "disk on fire")
    with pytest.raises(StorageIOError) as ei:
        q.send_done(i)
    assert ei.value.handle is i and not isinstance(ei.value, NoSpaceError)
    dict_env.store.fail = OSError(errno.ENOSPC, "full")
    with pytest.raises(NoSpaceError) as ns:
        q.send_cancel(i, Schedule(1))
    assert ns.value.handle is i
    with pytest.raises(NoSpaceError) as ne:
        put(q, b"x" * 10, [rcpt("a@x")])
    assert ne.value.handle is None
    dict_env.store.fail = None
    p = q.send_done(i)  # the handle given back works
    assert p is not None and q.cleanup(p)
    assert q.footprint().objects == 0


# ---- recovery ---------------------------------------------------------------------------


def _mixed_states(q: KvQueue) -> tuple[list[QueuedMail], QueuedMail]:
    hs = put(q, os.urandom(100_000), [rcpt("a@x", 1), rcpt("b@x", 2), rcpt("c@x", 3)])
    i = q.send_start(hs[0])
    assert i is not None
    p = q.drop(hs[1])
    assert p is not None
    [lone] = put(q, b"lone", [rcpt("d@y", 4)])
    i2 = q.send_start(lone)
    assert i2 is not None and q.send_done(i2) is not None
    e = q.enqueue("crashing@x")
    e.write(os.urandom(2 * 1024 * 1024))  # never committed nor aborted
    return hs, lone


def test_reopen_recovers_every_state(env: Env) -> None:
    q = env.open()
    hs, lone = _mixed_states(q)
    q = env.reopen(q)
    rep = q.last_recovery
    assert (rep.requeued, rep.cleaned, rep.uncommitted_removed, rep.quarantined) == (1, 2, 1, 0)
    assert rep.problems == ()
    queued = {h.entry_id: h.schedule for h in q.list_queue()}
    assert queued == {hs[0].entry_id: Schedule(1), hs[2].entry_id: Schedule(3)}
    m = mid(int(hs[0].message_id))
    assert kv_records.decode_live(q.kv.get(b"live " + m) or b"", int(hs[0].message_id)) == 2
    assert not any(mid(int(lone.message_id)) in k for k in raw_keys(q))
    assert not any(k.startswith((b"inflight", b"cleanup")) for k in raw_keys(q))
    before = sorted(q.kv.iterate(b"a", b"s"))  # everything but seq
    again = q.recover()
    assert again == type(again)()
    assert sorted(q.kv.iterate(b"a", b"s")) == before
    [h0] = list(q.list_domain("x"))[:1]
    i = q.send_start(h0)
    assert i is not None and len(read_body(q, i)) == 100_000


def test_open_without_recovery_then_adopt(env: Env) -> None:
    q = env.open()
    hs, _ = _mixed_states(q)
    q = env.reopen(q, recover=False)
    [adopted] = list(q.find_inflight())
    assert adopted.entry_id == hs[0].entry_id and adopted.schedule == Schedule(1)
    assert list(q.find_inflight()) == []  # adopted once
    assert len(read_body(q, adopted)) == 100_000
    assert len(list(q.find_pending_cleanup())) == 2
    rep = q.recover()
    assert (rep.requeued, rep.cleaned, rep.uncommitted_removed) == (0, 2, 1)
    assert [h.entry_id for h in q.find_inflight()] == []
    p = q.send_done(adopted)
    assert p is not None and q.cleanup(p)


def test_recovery_at_runtime_spares_live_work(env: Env) -> None:
    q = env.open()
    [h] = put(q, b"held", [rcpt("a@x")])
    i = q.send_start(h)
    assert i is not None
    e = q.enqueue("s@x")
    body = os.urandom(1_500_000)
    e.write(body)
    rep = q.recover()
    assert (rep.requeued, rep.uncommitted_removed) == (0, 0)
    [h2] = e.commit([rcpt("b@x")])
    i2 = q.send_start(h2)
    assert i2 is not None and read_body(q, i2) == body
    assert read_body(q, i) == b"held" and q.send_done(i) is not None


def test_power_cut_keeps_the_contract(dict_env: Env) -> None:
    q = dict_env.open()
    body = os.urandom(3 * 1024 * 1024)  # chunk batches unsynced, then the synced commit
    a, b = put(q, body, [rcpt("a@x", 1), rcpt("b@x", 2)])
    pb = q.drop(b)  # synced
    assert pb is not None
    assert q.cleanup(pb)  # unsynced: lost below
    ia = q.send_start(a)  # unsynced: lost below
    assert ia is not None
    e = q.enqueue("s@x")
    e.write(os.urandom(2 * 1024 * 1024))
    dict_env.store.power_cut()
    q = dict_env.reopen(q)
    rep = q.last_recovery
    assert (rep.cleaned, rep.requeued, rep.uncommitted_removed, rep.problems) == (1, 0, 0, ())
    [back] = list(q.list_queue())
    assert back.entry_id == a.entry_id and back.schedule == Schedule(1)
    i = q.send_start(back)
    assert i is not None and read_body(q, i) == body
    p = q.send_done(i)
    assert p is not None and q.cleanup(p)
    dict_env.store.power_cut()  # loses the cleanup: recovery finishes it
    q = dict_env.reopen(q)
    assert q.last_recovery.cleaned == 1 and q.last_recovery.problems == ()
    assert q.footprint().objects == 0 and raw_keys(q) == {b"seq"}


def test_synced_batch_carries_earlier_unsynced_ones(dict_env: Env) -> None:
    q = dict_env.open()
    a, b = put(q, b"body", [rcpt("a@x", 1), rcpt("b@x", 2)])
    ia = q.send_start(a)  # unsynced
    assert ia is not None
    e = q.enqueue("s@x")
    e.write(os.urandom(2 * 1024 * 1024))  # unsynced chunks of an uncommitted message
    assert q.reschedule(b, Schedule(9)) is not None  # synced: carries both to disk
    dict_env.store.power_cut()
    q = dict_env.reopen(q)
    rep = q.last_recovery
    assert (rep.requeued, rep.uncommitted_removed, rep.problems) == (1, 1, ())
    assert {h.entry_id: h.schedule for h in q.list_queue()} == {
        a.entry_id: Schedule(1), b.entry_id: Schedule(9)}


def test_reordered_batches_are_repaired(dict_env: Env) -> None:
    """What only an engine breaking the log-order assumption could leave."""
    q = dict_env.open()
    a, b = put(q, b"body", [rcpt("a@x"), rcpt("b@x")])
    i = q.send_start(a)
    assert i is not None and q.send_done(i) is not None
    m = mid(int(a.message_id))
    ghost = WriteBatch()  # the zone key of a send_start that "was lost" came back
    ghost.put(b"delivery-zone default " + m + b" 000000",
              kv_records.EntryRec(int(a.message_id), 0, "queued", "a@x", "default",
                               Schedule(0)).encode())
    ghost.put(b"live " + m, kv_records.live_value(int(a.message_id), 7))
    q.kv.write(ghost)
    q = dict_env.reopen(q)
    assert [h.entry_id for h in q.list_queue()] == [b.entry_id]
    # The ghost zone key is reported; the stored live count (7) above the entries found
    # (1) is recounted without a word, as after cleanups a cut recovery finished.
    assert q.last_recovery.problems == (
        f"removed {b'delivery-zone default ' + m + b' 000000'!r}: entry is also pending cleanup",)
    p = q.drop(next(iter(q.list_queue())))
    assert p is not None and q.cleanup(p)
    assert raw_keys(q) == {b"seq"}


# ---- concurrency, capabilities, draining ------------------------------------------------


def test_one_claim_wins(env: Env) -> None:
    q = env.open()
    hs = put(q, b"b", [rcpt(f"r{n}@x") for n in range(20)])
    copies = [list(q.list_queue()) for _ in range(4)]
    wins: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def race(handles: list[QueuedMail]) -> None:
        barrier.wait()
        for h in handles:
            i = q.send_start(h)
            if i is not None:
                with lock:
                    wins.append(i.entry_id)

    ts = [threading.Thread(target=race, args=(c,)) for c in copies]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(wins) == sorted(h.entry_id for h in hs)


def test_capabilities_per_engine(env: Env) -> None:
    q = env.open()
    caps = {Capability.ZONE_LISTING, Capability.DOMAIN_INDEX, Capability.GROUP_COMMIT,
            Capability.STREAMING_BODIES, Capability.HOLD}
    if env.kind == "log":
        caps.add(Capability.IO_SEAM)
    assert q.capabilities == caps
    assert Capability.MULTI_PROCESS not in type(q).capabilities | q.capabilities


def test_disk_use_near_zero_after_draining(env: Env) -> None:
    q = env.open()
    body = os.urandom(16 * 1024)
    for _ in range(150):
        put(q, body, [rcpt("a@x"), rcpt("b@y")])
    full = q.disk_usage()
    assert full > 150 * 16 * 1024
    for h in list(q.list_queue()):
        i = q.send_start(h)
        assert i is not None
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)
    assert q.footprint().objects == 0 and raw_keys(q) == {b"seq"}
    assert q.compact() is (env.kind != "dict")
    assert q.disk_usage() < 32 * 1024, q.disk_usage()
    q = env.reopen(q)
    assert q.disk_usage() < 32 * 1024 and q.last_recovery == type(q.last_recovery)()


@pytest.mark.parametrize("fail_errno", [errno.ENOSPC, errno.EIO])
def test_a_commit_refused_for_a_full_disk_leaves_nothing_in_the_open_queue(
        tmp_path: Path, fail_errno: int) -> None:
    """A 2.5 MB body streams in as 1 MiB batches of chunks, unsynced; then the commit's
    write fails.  On a full disk the log engine cuts the log back (nothing of the commit
    is in it) and goes on: the chunks must go at once, or a relay retrying a large
    message on a full disk leaves megabytes behind at every try until a restart (C8).  On
    EIO nothing is known: the queue says ReopenRequiredError, and the reopened queue's
    recovery removes the chunks of a message that never committed."""
    from faultinject.seam import FaultPlan, FaultyIO
    from queue_ref.storage import ReopenRequiredError

    body = os.urandom(2_500_000)

    def attempt(root: Path, plan: FaultPlan) -> tuple[FaultyIO, KvQueue, Exception | None]:
        root.mkdir()
        io = FaultyIO(str(root), plan)
        q = KvQueue.open_log(str(root), io)
        error: Exception | None = None
        with q.enqueue("s@example.org") as enq:
            for off in range(0, len(body), 300_001):
                enq.write(body[off:off + 300_001])
            try:
                enq.commit([rcpt("a@x"), rcpt("b@x")])
            except StorageIOError as e:
                error = e
        return io, q, error

    io, q, error = attempt(tmp_path / "count", FaultPlan())
    assert error is None and len(list(q.list_queue())) == 2
    mutating = [e for e in io.events if e.mutating]
    commit_write = max(i for i, e in enumerate(mutating) if e.name == "write")
    q.close()
    _, q, error = attempt(tmp_path / "full", FaultPlan(fail_at=commit_write,
                                                       fail_errno=fail_errno))
    if fail_errno == errno.ENOSPC:
        assert isinstance(error, NoSpaceError)
        assert q.footprint().objects == 0 and list(q.list_queue()) == []
        # and the queue goes on: the same message commits once there is space
        hs = put(q, body, [rcpt("a@x")])
        assert len(hs) == 1
    else:
        assert isinstance(error, ReopenRequiredError)
    q.close()
    q = KvQueue.open_log(str(tmp_path / "full"))
    assert len(list(q.list_queue())) == (1 if fail_errno == errno.ENOSPC else 0)
    q.close()


@pytest.mark.parametrize("old", [False, True], ids=["crc32", "sha256"])
def test_a_body_is_checked_by_the_digest_its_record_holds(
        disk_env: Env, monkeypatch: pytest.MonkeyPatch, old: bool) -> None:
    """A store an older version wrote (a sha256 in each metadata record) opens and
    delivers as it is beside messages written now (a CRC-32); under either digest a
    changed byte in a body chunk is caught before the last bytes are handed out."""
    body = bytes(range(256)) * 600  # three chunks
    q = disk_env.open()
    with monkeypatch.context() as m:
        if old:
            write_sha256_digests(m)
        (h_good,) = put(q, body, [rcpt("a@ex.com")])
        (h_bad,) = put(q, body, [rcpt("b@ex.com")])
    (h_new,) = put(q, body, [rcpt("c@ex.com")])
    for h, kind in ((h_good, old), (h_new, False)):
        meta = kv_records.MetaRec.decode(q.kv.get(keys.meta(int(h.message_id))) or b"",
                                         int(h.message_id))
        assert (meta.digest == hashlib.sha256(body).hexdigest()) is kind
    victim = keys.chunk(int(h_bad.message_id), 2)
    chunk = bytearray(q.kv.get(victim) or b"")
    chunk[100] ^= 1
    batch = WriteBatch()
    batch.put(victim, bytes(chunk))
    q.kv.write(batch, sync=True)
    q = disk_env.reopen(q)
    queued = {h.message_id: h for h in q.list_queue()}
    for h in (h_good, h_new):
        f = q.send_start(queued[h.message_id])
        assert f is not None and read_body(q, f) == body
    f = q.send_start(queued[h_bad.message_id])
    assert f is not None
    with pytest.raises(CorruptionError, match="digest mismatch"):
        read_body(q, f)


def test_a_second_process_taking_the_clean_close_record_first_is_a_locked_queue(
        tmp_path: Path) -> None:
    """Two processes open a cleanly closed KV queue at once: both read the record of its
    clean close before the engine's lock, and the one that renames it second finds it
    gone.  That open is refused as a queue another process holds (not a raw ENOENT),
    keeps no copies of what it compared, and the queue opens whole afterwards."""
    from queue_ref.io import OsIO
    from queue_ref.kv import atrest
    from queue_ref.kv.engine_errors import DatabaseLockedError

    path = str(tmp_path / "kv")
    with KvQueue.open_log(path) as q, q.enqueue("s@example.org", {}) as enq:
        enq.write(b"Subject: race\r\n\r\nbody\r\n")
        (h,) = enq.commit([Recipient("r@example.net", Schedule(0, 0))])

    class OtherOpenedFirst(OsIO):
        """The other opener's rename of the record lands just before ours."""

        def rename(self, src: str, dst: str) -> None:
            if src.endswith(atrest.NAME):
                os.rename(src, dst)
            super().rename(src, dst)

    with pytest.raises(StorageIOError) as refused:
        KvQueue.open_log(path, OtherOpenedFirst())
    assert isinstance(refused.value.__cause__, DatabaseLockedError)
    assert "locked by another open engine" in str(refused.value)
    assert not os.path.exists(os.path.join(path, atrest.QUARANTINE)) or \
        os.listdir(os.path.join(path, atrest.QUARANTINE)) == []
    with KvQueue.open_log(path) as q:
        assert [x.entry_id for x in q.list_queue()] == [h.entry_id]
        assert not (q.last_recovery and q.last_recovery.lost)


def test_scan_merges_zones_and_held_by_message_and_ends_on_a_damaged_zone_key(
        tmp_path: Path) -> None:
    """scan_queue (mailq's listing) gives a message's entries together, whatever their
    delivery zone and whether held; a key whose zone is spelt another way (lower-case
    percent escapes, as damage may leave it) does not send the zone look round forever
    (found by a cold review: the look escaped the zone's name again and landed before
    the key it had found)."""
    q = KvQueue.open_log(str(tmp_path / "q"))
    try:
        mids = []
        for m in range(3):
            with q.enqueue(f"s{m}@example.org") as enq:
                enq.write(b"x\r\n")
                hs = enq.commit([Recipient(f"r{i}@d.example", Schedule(i),
                                           zone=("z\u00e4", "default", "slow")[i % 3])
                                 for i in range(4)])
            mids.append(hs[0].message_id)
            assert q.hold(hs[1]) is not None
        got = [h.entry_id for h in q.scan_queue()]
        assert got == [f"{m}.{i}" for m in mids for i in range(4)]
        (key, value) = next((k, v) for k, v in q._kv.iterate(keys.ZONE, keys.end_of(keys.ZONE))
                            if b"%C3%A4" in k)
        q._kv.put(key.replace(b"%C3%A4", b"%c3%a4"), value)
        listed: list[list[str]] = []
        t = threading.Thread(target=lambda: listed.append(
            sorted(h.entry_id for h in q.scan_queue())), daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "scan_queue did not end"
        assert listed == [sorted([h.entry_id for h in q.list_queue()]
                                 + [h.entry_id for h in q.list_held()])]
    finally:
        q.close()
