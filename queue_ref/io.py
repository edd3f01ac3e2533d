"""The I/O seam: every filesystem call a backend makes goes through one of these objects.

``OsIO`` calls ``os``.  ``faultinject`` provides a twin that records each call, can crash
the program before or after call N, can make a call fail with EIO or ENOSPC, and can
build the disk as a power cut would leave it.  This is LevelDB's ``Env``.

Rules for backends:

* Use only these methods for anything that touches the disk (liveness locks included).
* Paths are absolute ``str``.  File descriptors are plain ints.
* ``MUTATING`` names the calls that change what is on disk; the fault injector puts its
  crash points before and after each of them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat as stat_mod

#: Calls that change persistent state (file data, directory entries) or make it durable.
MUTATING = frozenset({
    "open_create", "write", "ftruncate", "fsync", "fdatasync", "fsync_dir",
    "rename", "link", "symlink", "unlink", "mkdir", "rmdir",
})


class IO:
    """The seam's interface, implemented on the real OS.  Subclasses override calls."""

    # ---- files --------------------------------------------------------------------

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        """Create (or with ``exclusive=False`` open or create) a file for writing."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        if exclusive:
            flags |= os.O_EXCL
        if append:
            flags |= os.O_APPEND
        return os.open(path, flags, 0o640)

    def open_read(self, path: str) -> int:
        """Open an existing file for reading; symlinks are not followed at the last step."""
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

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
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o750)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

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


class OsIO(IO):
    """The real seam: every call goes straight to ``os``."""


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
