"""The log engine's tables in pieces: the runs (pieces of one table) the manifest records.

A review of the first version found runs guessed from key order alone: tables of separate
flushes of ascending keys were taken for one run and never merged.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from queue_ref.kv.engine_errors import DatabaseCorruptError
from queue_ref.kv.logengine import LogEngine
from queue_ref.kv.logengine import format as fmt


def _tables(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".tbl"))


def _manifest(path: str) -> fmt.Manifest:
    name = Path(path, fmt.CURRENT).read_text().strip()
    return fmt.Manifest.decode(name, Path(path, name).read_bytes())


def _pieces(path: str, n: int = 200, **kw: int) -> tuple[LogEngine, dict[bytes, bytes]]:
    """An engine over ``n`` keys of 200 bytes compacted into pieces of about 1 KiB."""
    kv = LogEngine(path, table_limit=1024, **kw)
    model = {b"k%03d" % i: bytes([i % 256]) * 200 for i in range(n)}
    for k, v in model.items():
        kv.put(k, v)
    kv.compact()
    return kv, model


# ---- runs: recorded in the manifest --------------------------------------------------------


def test_separate_flushes_of_ascending_keys_are_merged(tmp_path: Path) -> None:
    """8,000 puts of ascending keys, flushed every 4 KiB: the tables of separate flushes
    are merged by the policy as before there were pieces (main's engine: 4 tables; when runs
    were guessed from key order, each flush's table followed the one before and none was
    merged: 264)."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, memtable_limit=4096)
    try:
        for i in range(8000):
            kv.put(b"k%06d" % i, b"v" * 20)
        assert len(_tables(path)) <= 8
        assert len(set(_manifest(path).run_ids())) == len(_tables(path))
    finally:
        kv.close()
    kv = LogEngine(path, memtable_limit=4096)
    try:
        assert sum(1 for _ in kv.iterate()) == 8000
    finally:
        kv.close()


def test_flushes_in_pieces_are_runs_the_manifest_names(tmp_path: Path) -> None:
    """The same with tables in pieces of 4 KiB: the manifest gives every piece of a table
    written the run of its first piece, runs stay few, and a piece is never taken for part
    of another flush's table."""
    path = str(tmp_path / "db")
    kv = LogEngine(path, memtable_limit=4096, table_limit=4096)
    try:
        model = {}
        for i in range(8000):
            model[b"k%06d" % i] = b"v" * 20
            kv.put(b"k%06d" % i, b"v" * 20)
        man = _manifest(path)
        runs = man.run_ids()
        assert len(set(runs)) <= 8 < len(man.tables)
        assert all(run <= n for (n, _), run in zip(man.tables, runs, strict=True))
    finally:
        kv.close()
    kv = LogEngine(path, memtable_limit=4096, table_limit=4096)
    try:
        assert [t.run for t in kv._tables] == list(runs)
        assert dict(kv.iterate()) == model
    finally:
        kv.close()


def _strip_runs(path: str) -> None:
    """Rewrite the live manifest without run ids, as the engine before pieces were recorded
    wrote it (each table a run of its own); the CRC made to match."""
    name = Path(path, fmt.CURRENT).read_text().strip()
    text = Path(path, name).read_text()
    body = text[: text.rindex("crc ")]
    lines = [" ".join(line.split(" ")[:3]) if line.startswith("table ") else line
             for line in body.splitlines()]
    body = "\n".join(lines) + "\n"
    Path(path, name).write_text(body + f"crc {zlib.crc32(body.encode()):08x}\n")


def test_a_manifest_without_run_ids_opens_each_table_a_run_of_its_own(
        tmp_path: Path) -> None:
    """A manifest written before runs were recorded (``table <n> <size>`` lines only) opens
    with each table a run of its own; a compaction then merges the pieces, and the manifest
    it writes names their runs."""
    path = str(tmp_path / "db")
    kv, model = _pieces(path)
    kv.close()
    assert len(set(_manifest(path).run_ids())) == 1
    _strip_runs(path)
    assert "table" in Path(path, Path(path, fmt.CURRENT).read_text().strip()).read_text()
    pieces = len(_tables(path))
    assert len(set(_manifest(path).run_ids())) == pieces > 1
    kv = LogEngine(path, table_limit=1024)
    try:
        assert len({t.run for t in kv._tables}) == pieces
        assert dict(kv.iterate()) == model
        kv.compact()
        assert len(set(_manifest(path).run_ids())) == 1
        assert dict(kv.iterate()) == model
    finally:
        kv.close()


def test_the_manifest_keeps_run_ids_and_refuses_a_run_split_in_two() -> None:
    m = fmt.Manifest(9, 8, ((1, 10), (2, 10), (5, 10)), (1, 1, 5))
    text = m.encode().decode()
    assert "table 1 10\n" in text and "table 2 10 1\n" in text and "table 5 10\n" in text
    assert fmt.Manifest.decode("m", m.encode()).run_ids() == (1, 1, 5)
    assert fmt.Manifest(9, 8, ((1, 10),)).encode() == fmt.Manifest(9, 8, ((1, 10),), (1,)).encode()
    split = fmt.Manifest(9, 8, ((1, 10), (5, 10), (6, 10)), (1, 5, 1)).encode()
    with pytest.raises(DatabaseCorruptError, match="not in one place"):
        fmt.Manifest.decode("m", split)


def test_pieces_of_one_run_whose_keys_overlap_refuse_to_open(tmp_path: Path) -> None:
    """Reads chain a run's pieces in key order, so a manifest that puts two tables whose
    keys overlap in one run is damage: the open fails instead of reading wrong."""
    path = str(tmp_path / "db")
    kv = LogEngine(path)
    try:
        for k in (b"a", b"b", b"c", b"d"):
            kv.put(k, b"1")
        kv.compact()  # one table
    finally:
        kv.close()
    kv = LogEngine(path, memtable_limit=1)  # every write flushes a table of its own
    try:
        kv.put(b"b", b"3")
    finally:
        kv.close()
    man = _manifest(path)
    assert len(man.tables) == 2
    first = man.tables[0][0]
    name = Path(path, fmt.CURRENT).read_text().strip()
    Path(path, name).write_bytes(
        fmt.Manifest(man.next_file, man.log_number, man.tables, (first, first)).encode())
    with pytest.raises(DatabaseCorruptError, match="not after the piece before"):
        LogEngine(path).close()
