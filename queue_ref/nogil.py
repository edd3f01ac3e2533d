"""System calls that take microseconds, made without releasing the GIL.

Every ``os`` function releases the GIL around its system call.  With many threads, each
release hands the interpreter to another thread, and each return waits to get it back:
two context switches for one call.  A message's lifecycle in the filesystem queue makes
about a dozen calls that each take a few microseconds (open, a small write into the page
cache, close, rename, link, unlink), and with 16 producer threads on 2 cores the
handovers cost more than the calls: a third of the CPU time went to switching tasks.
These functions make the same calls through libc with ``ctypes.PyDLL``, which keeps the
GIL, as numpy does for small arrays; calls that wait for the device (fsync, fdatasync,
syncfs, reads, flock) keep going through ``os`` and release it.  In paired runs this
raised the filesystem queue's 16-producer lifecycle rate by about a fifth in syncfs mode.

``OsIO`` does not make the calls that may allocate an inode (creating a file, a symlink)
through here: they can take a millisecond, during which no other thread (a relay's event
loop) could run.  ext4 without a journal skips every recently deleted inode of the block
group when it looks for a free one (``recently_deleted`` in ``fs/ext4/ialloc.c``): on this machine, after a
benchmark run, a symlink took 560-690 us against 19 us for a rename.

Each function behaves as its ``os`` namesake: same arguments, the same ``OSError``
subclass for the same errno (``FileNotFoundError``, ``FileExistsError``...), with the
file names attached, ``ValueError`` for a path with a NUL byte, and a call interrupted by
a signal (EINTR) made again.  ``write`` makes one call and may write less than asked, as
``os.write`` does.  ``AVAILABLE`` is False where libc cannot be called this way (then
``OsIO`` uses ``os``): anywhere but Linux on x86-64 or arm64, where ``open``, a variadic
function, is called like any other.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from collections.abc import Callable
from typing import cast

Fn = Callable[..., int]


def _load() -> dict[str, Fn] | None:
    if not sys.platform.startswith("linux") or platform.machine() not in (
            "x86_64", "AMD64", "aarch64", "arm64"):
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        table = {
            "open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]),
            "close": (ctypes.c_int, [ctypes.c_int]),
            "write": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
            "rename": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p]),
            "link": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p]),
            "unlink": (ctypes.c_int, [ctypes.c_char_p]),
        }
        out: dict[str, Fn] = {}
        for name, (restype, argtypes) in table.items():
            fn = getattr(libc, name)
            fn.restype = restype
            fn.argtypes = argtypes
            out[name] = cast(Fn, fn)
        return out
    except (OSError, AttributeError):
        return None


_C = _load()
AVAILABLE = _C is not None


def _path(p: str) -> bytes:
    b = os.fsencode(p)
    if b"\0" in b:
        raise ValueError("embedded null byte")
    return b


def _call(name: str, *args: object, names: tuple[object, ...] = ()) -> int:
    """Call libc's ``name`` until it is not interrupted; raise its error as ``os`` would."""
    assert _C is not None
    fn = _C[name]
    while True:
        r = fn(*args)
        if r != -1:
            return r
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e), *names)


def open(path: str, flags: int, mode: int = 0o777) -> int:
    return _call("open", _path(path), flags, mode, names=(path,))


def close(fd: int) -> None:
    assert _C is not None
    if _C["close"](fd) == -1:
        e = ctypes.get_errno()
        if e != errno.EINTR:  # Linux has closed the descriptor anyway
            raise OSError(e, os.strerror(e))


def write(fd: int, data: bytes) -> int:
    return _call("write", fd, data, len(data))


def rename(src: str, dst: str) -> None:
    _call("rename", _path(src), _path(dst), names=(src, None, dst))


def link(src: str, dst: str) -> None:
    """A hard link to ``src`` itself, not to what it points to (Linux ``link(2)``)."""
    _call("link", _path(src), _path(dst), names=(src, None, dst))


def unlink(path: str) -> None:
    _call("unlink", _path(path), names=(path,))
