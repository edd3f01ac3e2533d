"""The I/O seam: every filesystem call a backend makes goes through one of these objects.

``OsIO`` calls ``os``.  ``faultinject`` provides a twin that records each call, can crash
the program before or after call N, can make a call fail with EIO or ENOSPC, and can
build the disk as a power cut would leave it.  This is LevelDB's ``Env``.

Rules for backends:

* Use only these methods for anything that touches the disk (liveness locks included).
* Paths are absolute ``str``.  File descriptors are plain ints.
* ``MUTATING`` names the calls that change what is on disk; the fault injector puts its
  crash points before and after each of them.

``OsIO`` makes the calls that take microseconds without releasing the GIL (see
``nogil.py``); ``OsIO(release_gil=True)`` releases it around every call, as ``os`` does.
Creating a file or a symlink always releases it: it may allocate an inode, which can
take a millisecond (``nogil.py`` says why).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import re
import stat as stat_mod
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar, cast

from queue_ref import nogil

#: Calls that change persistent state (file data, directory entries) or make it durable.
MUTATING = frozenset({
    "open_create", "write", "ftruncate", "fsync", "fdatasync", "fsync_dir",
    "rename", "link", "symlink", "unlink", "unlink_large", "mkdir", "rmdir", "syncfs",
})


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs``, or None where there is none (ctypes calls release the GIL)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int], int], fn)


_SYNCFS = _load_syncfs()


def syncfs_reports_errors(release: str | None = None) -> bool:
    """Whether ``IO.syncfs`` works here and reports writeback errors.

    Linux has syncfs(2) since 2.6.39, but before 5.8 it returned 0 even when the writeback
    it waited for had failed, which would let a queue acknowledge mail the disk lost.
    ``release`` is a kernel release string (default: this machine's).
    """
    if _SYNCFS is None:
        return False
    m = re.match(r"(\d+)\.(\d+)", release if release is not None else platform.release())
    return m is not None and (int(m[1]), int(m[2])) >= (5, 8)


def create_flags(*, exclusive: bool, append: bool) -> int:
    """``open`` flags of ``IO.open_create``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    if exclusive:
        flags |= os.O_EXCL
    if append:
        flags |= os.O_APPEND
    return flags


#: ``open`` flags of ``IO.open_read``: symlinks are not followed at the last step.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW


class IO:
    """The seam's interface, implemented on the real OS.  Subclasses override calls."""

    # ---- files --------------------------------------------------------------------

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        """Create (or with ``exclusive=False`` open or create) a file for writing."""
        return os.open(path, create_flags(exclusive=exclusive, append=append), 0o640)

    def open_read(self, path: str) -> int:
        """Open an existing file for reading; symlinks are not followed at the last step."""
        return os.open(path, READ_FLAGS)

    def write(self, fd: int, data: bytes) -> int:
        """Write all of ``data`` (looping over short writes); returns its length."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        return done

    def read(self, fd: int, n: int) -> bytes:
        return os.read(fd, n)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def fsize(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    # ---- directories and names ----------------------------------------------------

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creates, renames, unlinks in it) durable."""
        pinned = self._pins().get(path)
        if pinned is not None:
            os.fsync(pinned[0])
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def syncfs(self, path: str) -> None:
        """Make everything on the filesystem that holds ``path`` durable: the data and the
        directory entries of every file, whoever wrote them (Linux ``syncfs(2)``).

        One device flush covers any number of files, which is what lets a queue share it
        between producers.  Raises the writeback error of any file of that filesystem
        since the previous call (check ``syncfs_reports_errors`` before relying on that),
        and OSError(ENOSYS) where the call does not exist.
        """
        if _SYNCFS is None:
            raise OSError(errno.ENOSYS, "syncfs is not available on this system")
        pinned = self._pins().get(path)
        fd = pinned[0] if pinned is not None else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _SYNCFS(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of {path}: {os.strerror(err)}")
        finally:
            if pinned is None:
                os.close(fd)

    def _pins(self) -> dict[str, list[int]]:
        """Directories held open by ``pin_dir``: path -> [fd, count].  Made on first use, so
        that subclasses need not call an ``__init__``."""
        table: dict[str, list[int]] | None = self.__dict__.get("_pin_table")
        if table is None:
            table = self.__dict__["_pin_table"] = {}
        return table

    def pin_dir(self, path: str) -> None:
        """Hold directory ``path`` open, so that ``fsync_dir(path)`` and ``syncfs(path)``
        are one system call each.  Not a change to the disk, and not recorded.

        The caller promises that ``path`` stays the same directory (is not removed or
        replaced) until its matching ``unpin_dir``, and that nobody syncs ``path`` through
        this object while that ``unpin_dir`` runs.  Pins are counted.
        """
        pins = self._pins()
        if path in pins:
            pins[path][1] += 1
        else:
            pins[path] = [os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), 1]

    def unpin_dir(self, path: str) -> None:
        """Undo one ``pin_dir(path)``; the last one closes the descriptor."""
        pins = self._pins()
        entry = pins.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del pins[path]
            os.close(entry[0])

    def rename(self, src: str, dst: str) -> None:
        """Atomic replace of ``dst`` by ``src`` (POSIX rename)."""
        os.rename(src, dst)

    def rename_noreplace(self, src: str, dst: str) -> None:
        """Rename that fails with FileExistsError if ``dst`` exists.

        Built from ``link`` + ``unlink`` so that it works for symlinks on every Linux
        filesystem; the caller must tolerate the short moment where both names exist
        (recovery does: see the backends).
        """
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, follow_symlinks=False)

    def symlink(self, target: str, path: str) -> None:
        os.symlink(target, path)

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def link_max(self, path: str) -> int:
        """How many names one file may have on the file system of ``path`` (ext4: 65000);
        a very large number where the system does not say."""
        try:
            return max(1, os.pathconf(path, "PC_LINK_MAX"))
        except (OSError, ValueError):
            return 2 ** 31 - 1

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def unlink_large(self, path: str) -> None:
        """``unlink`` for a file that may hold many blocks (a message body, a log, a
        table).  The same call with the same effect; ``OsIO`` makes it through ``os``,
        releasing the GIL, however it makes ``unlink``: freeing the blocks takes about
        0.35 ms per MB on ext4 here (9 ms for a 32 MiB log), time in which no other thread,
        a relay's event loop among them, could run."""
        self.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o750)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str, *, ordered: bool = True) -> list[str]:
        """The names in directory ``path``, sorted; ``ordered=False``: in the file
        system's own order, for a caller that orders them itself (sorting a million
        queue names takes 0.4 s on the development machine; a heap of them, 0.04 s)."""
        names = os.listdir(path)
        if ordered:
            names.sort()
        return names

    def iter_names(self, path: str) -> Iterator[str]:
        """The names in directory ``path`` as the file system gives them, read a buffer
        at a time (``os.scandir``): the first comes without reading a big directory whole.
        The directory stays open until the iterator is exhausted or closed.  A name added
        or removed meanwhile may be given or not; any other is given once."""
        with os.scandir(path) as it:
            for entry in it:
                yield entry.name

    def lstat(self, path: str) -> os.stat_result:
        return os.lstat(path)

    def exists(self, path: str) -> bool:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, path: str) -> bool:
        try:
            return stat_mod.S_ISDIR(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    def is_symlink(self, path: str) -> bool:
        try:
            return stat_mod.S_ISLNK(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    # ---- liveness locks (not persistent state) ------------------------------------

    def lock_exclusive(self, path: str, *, blocking: bool = False) -> int | None:
        """Open (creating) ``path`` and take an exclusive flock on it.

        Returns the fd holding the lock, or ``None`` if another open file holds it.
        The lock goes when the fd is closed or the process dies.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        return fd

    def unlock(self, fd: int) -> None:
        os.close(fd)

    def lock_file(self, fd: int, *, shared: bool, blocking: bool = False) -> bool:
        """Take a flock on an open file, shared or exclusive: True once taken; False if
        another open file holds a conflicting one (non-blocking only).  It goes when
        ``fd`` is closed or the process dies.  The filesystem queue's readers of queued
        mail hold a shared one so that no other process reuses a file they read."""
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                        | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not blocking:
                return False
            raise
        return True

    def same_file(self, fd: int, path: str) -> bool:
        """Whether ``path`` (not followed) still names the file open as ``fd``."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


#: Writes up to this size keep the GIL: their cost is a copy into the page cache.
NOGIL_MAX_WRITE = 1 << 16


class OsIO(IO):
    """The real seam: every call goes straight to the operating system.

    Opening for reading, closing, small writes, rename, link and unlink keep the GIL
    where ``nogil.AVAILABLE`` (``holds_gil``); everything else (creating a file or a
    symlink among them), and all of it with ``release_gil=True``, goes through ``os``.
    """

    holds_gil: bool = nogil.AVAILABLE

    def __init__(self, *, release_gil: bool = False) -> None:
        if release_gil:
            self.holds_gil = False

    def open_read(self, path: str) -> int:
        if not self.holds_gil:
            return super().open_read(path)
        return nogil.open(path, READ_FLAGS)

    def write(self, fd: int, data: bytes) -> int:
        if not self.holds_gil or len(data) > NOGIL_MAX_WRITE:
            return super().write(fd, data)
        data = bytes(data)
        done = nogil.write(fd, data)
        while done < len(data):
            done += nogil.write(fd, data[done:])
        return done

    def close(self, fd: int) -> None:
        if self.holds_gil:
            nogil.close(fd)
        else:
            super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        if self.holds_gil:
            nogil.rename(src, dst)
        else:
            super().rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        if self.holds_gil:
            nogil.link(src, dst)
        else:
            super().link(src, dst)

    def unlink(self, path: str) -> None:
        if self.holds_gil:
            nogil.unlink(path)
        else:
            super().unlink(path)

    def unlink_large(self, path: str) -> None:
        if type(self).unlink is not OsIO.unlink:  # a subclass's unlink sees every unlink
            self.unlink(path)
        else:
            os.unlink(path)


_T = TypeVar("_T")


def close_iterator(it: object) -> None:
    """Close an iterator that can be closed (a directory listing holds its descriptor, a
    store's iteration its snapshot, until then); a plain one needs nothing."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


def first_of(items: Iterable[_T]) -> _T | None:
    """The first item of ``items`` (None if there is none), the iterator closed after."""
    it = iter(items)
    try:
        return next(it, None)
    finally:
        close_iterator(it)


def read_file(io: IO, path: str, limit: int = 1 << 20) -> bytes:
    """Read a whole small file through the seam (at most ``limit`` bytes)."""
    fd = io.open_read(path)
    try:
        chunks = []
        total = 0
        while True:
            b = io.read(fd, 65536)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        io.close(fd)


def write_file_durable(io: IO, path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Write a new file by temp, fsync, rename, and (optionally) fsync of its directory."""
    tmp = f"{path}.tmp"
    if io.exists(tmp):
        io.unlink(tmp)
    fd = io.open_create(tmp)
    try:
        io.write(fd, data)
        io.fsync(fd)
    finally:
        io.close(fd)
    io.rename(tmp, path)
    if sync_dir:
        io.fsync_dir(os.path.dirname(path))

