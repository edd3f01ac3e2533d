"""Inode-level operations: what a traced call did to the file system.

``faultinject.replay`` turns a trace into these; ``faultinject.inodes`` applies them to a
state.  Every operation names inodes, not paths, so that applying a subset of them (a crash
state) respects identity: a rename moves *that* file, not whatever has the name.

Directory-entry operations carry ``needs``: the trace indexes of the earlier entry
operations without which they cannot take effect as they did in the trace (see
``faultinject.replay``, which computes them).  A crash state that keeps an operation keeps
everything it needs, transitively; so every kept operation finds the state it found in the
trace for the names it touches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Create:
    """A new inode (``kind`` f/d/l) under ``parent``/``name``; ``target`` for symlinks."""

    index: int
    parent: int
    name: str
    ino: int
    kind: str
    target: str = ""
    needs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Link:
    """A second name ``parent``/``name`` for the existing inode ``ino``."""

    index: int
    parent: int
    name: str
    ino: int
    needs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Remove:
    """``unlink`` or ``rmdir`` of ``parent``/``name``, which names ``ino``."""

    index: int
    parent: int
    name: str
    ino: int
    needs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rename:
    """``ino`` moves from ``src_parent``/``src_name`` to ``dst_parent``/``dst_name``, atomically."""

    index: int
    src_parent: int
    src_name: str
    dst_parent: int
    dst_name: str
    ino: int
    needs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Write:
    """``data`` at ``offset`` of file ``ino``.

    ``new_region`` is true when the write reaches past the smallest size the file had since
    its last successful fsync (it needs newly allocated blocks: the ext4 model orders these).
    """

    index: int
    ino: int
    offset: int
    data: bytes
    new_region: bool


@dataclass(frozen=True)
class Truncate:
    index: int
    ino: int
    length: int


@dataclass(frozen=True)
class SyncFile:
    """fsync/fdatasync of ``ino``; ``ok`` false when the call failed."""

    index: int
    ino: int
    ok: bool


@dataclass(frozen=True)
class SyncDir:
    """fsync of directory ``ino``; ``ok`` false when the call failed."""

    index: int
    ino: int
    ok: bool


@dataclass(frozen=True)
class SyncFs:
    """syncfs of the whole file system: every file's data and every directory's entries;
    ``ok`` false when the call failed."""

    index: int
    ok: bool


EntryOp = Create | Link | Remove | Rename
DataOp = Write | Truncate
SyncOp = SyncFile | SyncDir | SyncFs
Op = Create | Link | Remove | Rename | Write | Truncate | SyncFile | SyncDir | SyncFs


def entry_dirs(op: EntryOp) -> tuple[int, ...]:
    """The directories whose entries ``op`` changes (two for a cross-directory rename)."""
    if isinstance(op, Rename):
        if op.src_parent == op.dst_parent:
            return (op.src_parent,)
        return (op.src_parent, op.dst_parent)
    return (op.parent,)
