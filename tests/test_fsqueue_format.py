"""The filesystem queue's on-disk format: entries are hard links to their message files.

A queue of the format before (entries as symlinks ``-> ../data/<msgid>``, no
``queue-ref.format``), built by hand from a real queue, is converted by an opening that
has it alone, also after a crash part way through the conversion; beside a live owner
the opening refuses, naming ``queue-ref repair``, and changes nothing.  A message of many
recipients allocates no inode per recipient.  The tree is read with ``os`` directly."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.layout import FORMAT_MARKER, LINK_DIRS
from queue_ref.storage import Footprint, StorageIOError
from tests.test_fsqueue_support import put, rcpts


def msgid_of(link_name: str) -> str:
    """The message id of a link's name (``<msgid>.<i>`` or ``<msgid>.<i>@<owner>``)."""
    return link_name.split("@")[0].rsplit(".", 1)[0]


def links(root: str) -> list[str]:
    """Every name in the link directories, as ``<dir>/<name>``."""
    return sorted(f"{d}/{n}" for d in LINK_DIRS for n in os.listdir(os.path.join(root, d)))


def symlinks(root: str) -> list[str]:
    """Every symlink under ``root``."""
    return sorted(os.path.relpath(os.path.join(p, n), root)
                  for p, ds, fs in os.walk(root) for n in ds + fs
                  if os.path.islink(os.path.join(p, n)))


def to_old_format(root: str, multi: set[str]) -> int:
    """Turn the queue at ``root`` into the format before hard-link entries, by hand: every
    link in queue/, inflight/, cleanup/, held/ replaced by a symlink ``../data/<msgid>``
    (dangling when the message is not committed), every entry of a message of ``multi``
    (2+ recipients) given its reference hard link ``data/<msgid>.<i>``, and
    ``queue-ref.format`` removed.  Returns the number of links replaced."""
    n = 0
    for rel in links(root):
        path = os.path.join(root, rel)
        name = os.path.basename(rel).split("@")[0]
        msgid = msgid_of(name)
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode), rel  # the new format made it
        if msgid in multi:
            ref = os.path.join(root, "data", name)
            if not os.path.exists(ref):
                os.link(path, ref)
        os.unlink(path)
        os.symlink(f"../data/{msgid}", path)
        n += 1
    os.unlink(os.path.join(root, FORMAT_MARKER))
    return n


def snapshot(root: str) -> list[tuple[object, ...]]:
    """What is on disk under ``root`` but owners/: every name with its kind, a symlink's
    target, a file's inode, link count, size and content."""
    out: list[tuple[object, ...]] = []
    for p, ds, fs in os.walk(root):
        rel = os.path.relpath(p, root)
        if rel.split(os.sep)[0] == "owners":
            continue
        for n in sorted(ds + fs):
            path = os.path.join(p, n)
            r = os.path.relpath(path, root)
            if r == "owners":
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out.append((r, "symlink", os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                out.append((r, "dir"))
            else:
                out.append((r, "file", st.st_ino, st.st_nlink, st.st_size,
                            Path(path).read_bytes()))
    return sorted(out, key=lambda t: str(t[0]))


def unchanged(root: str, before: list[tuple[object, ...]]) -> bool:
    """Whether the queue at ``root`` is as ``snapshot`` saw it (a refused opening leaves
    not even its own ``tmp/<owner>/``)."""
    return snapshot(root) == before


def test_an_old_format_queue_is_refused_beside_a_live_owner(tmp_path: Path) -> None:
    """Another owner has the queue open: the opening refuses, naming ``queue-ref repair``,
    and changes nothing on disk (only a queue no one else uses changes format); once the
    other owner is gone, an opening converts it."""
    root = str(tmp_path / "q")
    live = FsQueue(root)
    one = put(live, n=1)
    two = put(live, n=2)
    to_old_format(root, {two[0].message_id})
    before = snapshot(root)
    with pytest.raises(StorageIOError, match="queue-ref repair") as refused:
        FsQueue(root)
    assert "another process has it open" in str(refused.value)
    assert unchanged(root, before)
    with pytest.raises(StorageIOError, match="queue-ref repair"):
        FsQueue(root, recover=False)  # no recovery, so no conversion: refused too
    assert unchanged(root, before)
    assert not os.path.exists(os.path.join(root, FORMAT_MARKER))
    live.close()
    q = FsQueue(root)
    try:
        assert symlinks(root) == []
        assert sorted(m.entry_id for m in q.list_queue()) == sorted(
            h.entry_id for h in one + two)
    finally:
        q.close()


def test_a_queue_opened_without_recovery_refuses_the_old_format_even_alone(
        tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    q = FsQueue(root)
    two = put(q, n=2)
    q.close()
    to_old_format(root, {two[0].message_id})
    before = snapshot(root)
    with pytest.raises(StorageIOError, match="queue-ref repair"):
        FsQueue(root, recover=False)
    assert unchanged(root, before)


def test_a_new_queue_is_marked_and_its_marker_survives_reopening(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    FsQueue(root).close()
    marker = Path(root, FORMAT_MARKER)
    text = marker.read_bytes()
    assert b"hard links" in text
    q = FsQueue(root, recover=False)  # a queue of the current format opens without one
    q.close()
    assert marker.read_bytes() == text


def test_a_hundred_recipients_allocate_no_inode_per_recipient(tmp_path: Path) -> None:
    """Every entry's link, and every entry's reference, is a name of the message file:
    one inode for the whole message.  Its link count counts the entries that hold it;
    the last one's cleanup takes the file away."""
    root = str(tmp_path / "q")
    q = FsQueue(root)
    try:
        with q.enqueue("a@example.org") as enq:
            enq.write(b"Subject: many\r\n\r\nbody\r\n")
            handles = enq.commit(rcpts(100))
        msgid = handles[0].message_id
        msg = os.path.join(root, "data", msgid)
        ino = os.lstat(msg).st_ino
        names = [os.path.join(root, "queue", n) for n in os.listdir(os.path.join(root, "queue"))]
        assert len(names) == 100
        refs = [os.path.join(root, "data", n) for n in os.listdir(os.path.join(root, "data"))
                if n != msgid]
        assert len(refs) == 100
        for path in names + refs:
            st = os.lstat(path)
            assert stat.S_ISREG(st.st_mode) and st.st_ino == ino, path
        inodes = {os.lstat(os.path.join(p, n)).st_ino for p, _, fs in os.walk(root)
                  for n in fs if p.startswith(os.path.join(root, "data"))
                  or p.startswith(os.path.join(root, "queue"))}
        assert inodes == {ino}  # one inode: no symlink, no copy per recipient
        assert symlinks(root) == []
        assert os.lstat(msg).st_nlink == 1 + 100 + 100  # data/<msgid>, links, references
        for h in handles[:99]:
            p = q.drop(h)
            assert p is not None and q.cleanup(p)
        st = os.lstat(msg)
        assert st.st_ino == ino and st.st_nlink == 3  # the last entry's link and reference
        assert os.path.samefile(os.path.join(root, "queue", handles[99].entry_id), msg)
        p = q.drop(handles[99])
        assert p is not None and q.cleanup(p)
        assert not os.path.exists(msg)
        assert os.listdir(os.path.join(root, "data")) == []
        assert os.listdir(os.path.join(root, "queue")) == []
        # the file itself is gone, or kept as a spare of no other name
        spares = [os.path.join(root, "tmp", q.owner, n)
                  for n in os.listdir(os.path.join(root, "tmp", q.owner))]
        assert all(os.lstat(s).st_nlink == 1 for s in spares)
        assert q.footprint() == Footprint(0, 0)
    finally:
        q.close()
