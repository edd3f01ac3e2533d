"""DiskImage snapshots and their materialization."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from faultinject import DiskImage, materialize, snapshot


def make_tree(root: Path) -> None:
    (root / "data").mkdir()
    (root / "queue").mkdir()
    (root / "queue" / "empty").mkdir()
    (root / "data" / "m1").write_bytes(b"message one")
    (root / "data" / "zero").write_bytes(b"")
    os.link(root / "data" / "m1", root / "data" / "m1-again")
    os.symlink("../data/m1", root / "queue" / "m1")
    os.symlink("nowhere", root / "dangling")


def test_snapshot_records_dirs_files_symlinks_and_hard_links(tmp_path: Path) -> None:
    make_tree(tmp_path)
    img = snapshot(str(tmp_path))
    assert img.dirs == ("data", "queue", "queue/empty")
    assert img.file("data/m1") == b"message one" and img.file("data/zero") == b""
    assert img.symlink("queue/m1") == "../data/m1" and img.symlink("dangling") == "nowhere"
    assert img.hardlinks == (("data/m1", "data/m1-again"),)
    assert img.listdir() == ("dangling", "data", "queue")
    assert img.listdir("queue") == ("empty", "m1")
    assert img.exists("queue/empty") and not img.exists("queue/m2")
    assert "data/m1 (11 bytes)" in img.summary()


def test_materialize_then_snapshot_gives_the_same_image(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    make_tree(tmp_path / "src")
    img = snapshot(str(tmp_path / "src"))
    materialize(img, str(tmp_path / "dst"))
    assert snapshot(str(tmp_path / "dst")) == img
    dst = tmp_path / "dst" / "data"
    assert os.stat(dst / "m1").st_ino == os.stat(dst / "m1-again").st_ino


def test_images_are_values(tmp_path: Path) -> None:
    a = DiskImage.build(dirs=["d"], files={"d/x": b"1"}, symlinks={"l": "d/x"})
    b = DiskImage.build(files={"d/x": b"1"}, symlinks={"l": "d/x"}, dirs=["d"])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert DiskImage() == snapshot(str(tmp_path))


def test_materialize_refuses_a_non_empty_destination(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"")
    with pytest.raises(ValueError):
        materialize(DiskImage(), str(tmp_path))


def test_snapshot_refuses_special_files_and_missing_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        snapshot(str(tmp_path / "missing"))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        with pytest.raises(ValueError):
            snapshot(str(tmp_path))
    finally:
        sock.close()
