"""Small helpers over the I/O seam, and the mapping of OSError to the queue's errors.

Every helper goes through an ``IO``; none calls ``os`` for disk access.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from os.path import join

from queue_ref.io import IO
from queue_ref.storage import Handle, NoSpaceError, ReopenRequiredError, StorageIOError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def storage_error(what: str, e: OSError, handle: Handle | None = None, *,
                  reopen: bool = False) -> StorageIOError:
    """The StorageIOError to raise for ``e``: ReopenRequiredError once a sync failed
    (``reopen``), NoSpaceError for ENOSPC/EDQUOT."""
    cls = (ReopenRequiredError if reopen
           else NoSpaceError if e.errno in _NO_SPACE else StorageIOError)
    return cls(f"{what} failed: {e}", handle)


def if_exists(fn: Callable[[str], object], path: str) -> bool:
    """Run ``fn(path)``; False if the path did not exist (FileNotFoundError), else True."""
    try:
        fn(path)
    except FileNotFoundError:
        return False
    return True


def lstat_or_none(io: IO, path: str) -> os.stat_result | None:
    try:
        return io.lstat(path)
    except FileNotFoundError:
        return None


def listdir_or_empty(io: IO, path: str, *, ordered: bool = True) -> list[str]:
    try:
        return io.listdir(path, ordered=ordered)
    except FileNotFoundError:
        return []


def readlink_or_none(io: IO, path: str) -> str | None:
    """The target of the symlink at ``path``; None if it is missing or not a symlink."""
    try:
        return io.readlink(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.EINVAL:  # not a symlink
            return None
        raise


def write_whole(io: IO, path: str, data: bytes, sync: Callable[[int], None]) -> None:
    """Create ``path`` (it must not exist), write ``data``, ``sync`` the fd, close it."""
    fd = io.open_create(path)
    try:
        io.write(fd, data)
        sync(fd)
    finally:
        io.close(fd)


def copy_whole(io: IO, src: str, dst: str, sync: Callable[[int], None],
               chunk: int = 1 << 20) -> None:
    """Create ``dst`` (it must not exist) with the bytes of ``src``, a chunk at a time,
    ``sync`` it, close both.  Raises FileNotFoundError if ``src`` is gone (``dst`` is
    then not created)."""
    fin = io.open_read(src)
    try:
        fout = io.open_create(dst)
        try:
            pos = 0
            while b := io.pread(fin, chunk, pos):
                io.write(fout, b)
                pos += len(b)
            sync(fout)
        finally:
            io.close(fout)
    finally:
        io.close(fin)


def remove_tree(io: IO, path: str) -> int:
    """Remove ``path`` and everything below it (symlinks are removed, never followed).

    Returns the number of names removed.  Missing names are skipped, so a crash in the
    middle leaves a smaller tree that a second call finishes.
    """
    st = lstat_or_none(io, path)
    if st is None:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return int(if_exists(io.unlink, path))
    n = 0
    for name in listdir_or_empty(io, path):
        n += remove_tree(io, join(path, name))
    return n + int(if_exists(io.rmdir, path))


def tree_usage(io: IO, path: str, *, skip: re.Pattern[str] | None = None
               ) -> tuple[int, int]:
    """(names, bytes of regular files) below ``path``, ``path`` itself not counted, nor
    names directly in it that ``skip`` matches."""
    objects = size = 0
    for name in listdir_or_empty(io, path):
        if skip is not None and skip.match(name):
            continue
        p = join(path, name)
        st = lstat_or_none(io, p)
        if st is None:
            continue
        objects += 1
        if stat.S_ISDIR(st.st_mode):
            o, s = tree_usage(io, p)
            objects += o
            size += s
        elif stat.S_ISREG(st.st_mode):
            size += st.st_size
    return objects, size


def same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two ``stat`` results describe one file (two names of it)."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def is_link_file(io: IO, path: str) -> bool:
    """Whether ``path`` is an entry's link: a regular file (a hard link to its message
    file; recovery checks that it is that file, see fs_recovery.py)."""
    try:
        return stat.S_ISREG(io.lstat(path).st_mode)
    except FileNotFoundError:
        return False
