"""Reading LevelDB's manifest for the log it names (``queue_ref.kv.leveldb_manifest``):
what real LevelDB writes, read right; anything else answered None, never an exception."""

from __future__ import annotations

import os
from pathlib import Path

import plyvel  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st

from queue_ref.kv import leveldb_manifest as manifest


def _fill(path: str, n: int, **options: object) -> None:
    db = plyvel.DB(path, create_if_missing=True, **options)
    try:
        for i in range(n):
            db.put(b"key %06d" % i, b"v" * 200, sync=i % 50 == 0)
    finally:
        db.close()


def test_the_log_number_is_the_log_leveldb_writes_into(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    _fill(path, 10)
    log, prev = manifest.log_numbers(path) or (None, None)
    assert prev == 0 and log is not None
    logs = sorted(n for n in os.listdir(path) if n.endswith(".log"))
    assert logs == [manifest.log_name(log)]
    assert manifest.missing_log(path) is None
    os.unlink(os.path.join(path, logs[0]))
    assert manifest.missing_log(path) == logs[0]


def test_after_flushes_and_reopenings_the_named_log_is_there(tmp_path: Path) -> None:
    """Many tables, manifests of many edits, a log rotated by the memtable's size: the
    log the manifest names is one LevelDB kept (it may keep a newer one beside it)."""
    path = str(tmp_path / "db")
    for _ in range(3):
        _fill(path, 2000, write_buffer_size=64 * 1024)
    got = manifest.log_numbers(path)
    assert got is not None and got[0] > 3
    assert manifest.missing_log(path) is None
    assert any(n.endswith(".ldb") for n in os.listdir(path))


def test_a_store_without_current_or_with_a_foreign_current_is_not_judged(
        tmp_path: Path) -> None:
    path = tmp_path / "db"
    path.mkdir()
    assert manifest.log_numbers(str(path)) is None
    (path / "CURRENT").write_text("../../etc/passwd\n")
    assert manifest.log_numbers(str(path)) is None
    (path / "CURRENT").write_text("MANIFEST-000009\n")  # names a file that is not there
    assert manifest.missing_log(str(path)) is None


@given(st.binary(max_size=4096))
def test_any_bytes_as_a_manifest_give_an_answer_or_none(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "CURRENT").write_text("MANIFEST-000002\n")
        Path(d, "MANIFEST-000002").write_bytes(data)
        got = manifest.log_numbers(d)
        assert got is None or (got[0] >= 0 and got[1] >= 0)
