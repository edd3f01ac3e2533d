"""System calls of a traced process, turned into the I/O seam's trace vocabulary.

``to_events`` keeps the calls that touched the directory under test (``root``) and
rewrites each as the ``faultinject.trace.TraceEvent`` the seam would have recorded
(paths relative to the root, ``fN`` file ids for descriptors).  So the crash states of a
black-box backend are built by the very code that builds them for backends of the seam
(``faultinject.models.crash_states``: replay on the inode model, then each persistence
model's choice of what a power cut keeps) and no second crash-state builder exists.

The shapes fit with one addition: strace shows writes at explicit offsets (``pwrite64``,
``pwritev``), which the seam never makes; they become ``pwrite`` events, which
``faultinject.replay`` places at their offset.  A plain ``write`` on a descriptor opened
without ``O_APPEND`` is also recorded as a ``pwrite`` at the position this module
follows (open at 0, ``read``/``write`` advance it, ``lseek`` returns it), so positions
moved by reads are right.

Rewriting, call by call (only calls that succeeded, except failed syncs, which the
models need):

==============================  =====================================================
system call                     event(s)
==============================  =====================================================
open/openat/creat of a file     ``open_create(path, O_EXCL, O_APPEND)`` when it may
                                write or create, then ``ftruncate(f, 0)`` for O_TRUNC of
                                an existing file; ``open_read(path)`` otherwise
open of a directory             none (the descriptor is followed for fsync)
write, writev                   ``write(f)`` (O_APPEND) or ``pwrite(f, position)``
pwrite64, pwritev, pwritev2     ``pwrite(f, offset)``
truncate / ftruncate            ``open_read`` + ``ftruncate`` + ``close`` / ``ftruncate``
rename, renameat, renameat2     ``rename(src, dst)`` (RENAME_EXCHANGE is refused)
link(at), symlink(at)           ``link(src, dst)``, ``symlink(target, path)``
unlink(at), rmdir, mkdir(at)    ``unlink``, ``rmdir``, ``mkdir``
fsync / fdatasync of a file     ``fsync(f)`` / ``fdatasync(f)``
fsync / fdatasync of a dir      ``fsync_dir(path)``
syncfs, sync                    ``syncfs(".")``
close (last alias)              ``close(f)``
==============================  =====================================================

What cannot be seen or modelled is not guessed at: a shared writable ``mmap`` of a file
under the root and ``io_uring_setup`` are listed in ``Events.unseen`` (their writes do
not appear in the trace: a backend that relies on them for durability is judged on
what the trace shows, which is reported); ``fallocate``, ``copy_file_range``,
``sendfile``/``splice`` into a file under the root, RENAME_EXCHANGE, and moves across the
root's boundary raise ``UnmodelledCall``.  ``sync_file_range`` makes nothing durable (it
flushes no metadata and no disk cache) and is ignored.  ``fcntl(F_DUPFD)`` is not
traced (SQLite calls ``fcntl`` for every lock): a descriptor aliased that way and
written to raises ``UnmodelledCall`` ("unknown descriptor").

*Markers*: the child reports each acknowledged operation by writing one JSON line to a
pipe (``conformance.harness.child_process.Channel``).  Those writes are in the trace
too, in order with the backend's calls; ``to_events`` returns them as ``(position,
message)``: the message was sent after the first ``position`` events happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.blackbox.strace_trace import Fd, Syscall, Text, TraceFormatError
from faultinject.trace import TraceEvent
from queue_ref.io import MUTATING


class UnmodelledCall(ValueError):
    """A call changed the directory under test in a way the inode model cannot follow."""


@dataclass
class _Open:
    fid: str
    path: str  # relative path at open time
    is_dir: bool
    append: bool
    pos: int = 0
    aliases: int = 1


@dataclass
class Events:
    """The seam events of a trace, the child's markers among them, and what was unseen."""

    events: list[TraceEvent] = field(default_factory=list)
    markers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    unseen: list[str] = field(default_factory=list)
    calls: int = 0  # system calls read from the trace (all of them)
    root_calls: int = 0  # of which touched the root


def _json_marker(data: bytes) -> dict[str, Any] | None:
    if not data.startswith(b"{") or not data.endswith(b"\n"):
        return None
    try:
        msg = json.loads(data)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


class _Translator:
    def __init__(self, root: str, cwd: str) -> None:
        self.root = os.path.realpath(root)
        self.cwd = cwd
        self.out = Events()
        self.fds: dict[int, _Open] = {}
        self.dirs: set[str] = {"."}
        self.files: set[str] = set()
        self.next_fid = 0
        self.call: Syscall | None = None

    # ---- paths -------------------------------------------------------------------

    def rel(self, path: str | None) -> str | None:
        """``path`` relative to the root ("." for the root), or None outside it."""
        if path is None:
            return None
        p = os.path.normpath(path)
        if p == self.root:
            return "."
        if p.startswith(self.root + "/"):
            return p[len(self.root) + 1:]
        return None

    def at(self, dirfd: Fd | None, path: str) -> str:
        if path.startswith("/"):
            return path
        base = self.cwd if dirfd is None or dirfd.path is None else dirfd.path
        if dirfd is not None and dirfd.num != -100 and dirfd.num in self.fds:
            base = os.path.join(self.root, self.fds[dirfd.num].path)
        return os.path.join(base, path)

    def fail(self, why: str) -> UnmodelledCall:
        c = self.call
        where = f"line {c.line}: {c.name}" if c is not None else "?"
        return UnmodelledCall(f"{where}: {why}")

    # ---- events ------------------------------------------------------------------

    def emit(self, name: str, args: tuple[object, ...], *, data: bytes | None = None,
             result: object = None, ok: bool = True) -> None:
        c = self.call
        error = None if ok else f"OSError({c.errno if c is not None else '?'})"
        site = f"strace:{c.line}:{c.time}" if c is not None else "strace"
        self.out.events.append(TraceEvent(
            index=len(self.out.events), name=name, args=args, data=data, result=result,
            error=error, site=site, mutating=name in MUTATING or name == "pwrite", applied=ok))

    def new_fid(self) -> str:
        self.next_fid += 1
        return f"f{self.next_fid - 1}"

    def moved(self, src: str, dst: str) -> None:
        for group in (self.dirs, self.files):
            for p in sorted(group):
                if p == src or p.startswith(src + "/"):
                    group.discard(p)
                    group.add(dst + p[len(src):])

    # ---- calls -------------------------------------------------------------------

    def run(self, c: Syscall) -> None:
        self.call = c
        self.out.calls += 1
        name = c.name
        if name in ("fsync", "fdatasync", "syncfs"):
            self.sync(c)
            return
        if name == "sync":
            if c.ok:
                self.out.root_calls += 1
                self.emit("syncfs", (".",))
            return
        if not c.ok:
            return
        handler = getattr(self, "call_" + name, None)
        if handler is not None:
            handler(c)

    def touches(self, *paths: str | None) -> bool:
        hit = any(p is not None for p in paths)
        if hit:
            self.out.root_calls += 1
        return hit

    def call_open(self, c: Syscall) -> None:
        self.opened(c, None, c.path(0), c.flags(1))

    def call_openat(self, c: Syscall) -> None:
        self.opened(c, c.fd(0), c.path(1), c.flags(2))

    def call_openat2(self, c: Syscall) -> None:
        how = c.args[2]
        flags = how.get("flags", 0) if isinstance(how, dict) else 0
        self.opened(c, c.fd(0), c.path(1),
                    set(flags.split("|")) if isinstance(flags, str) else set())

    def call_creat(self, c: Syscall) -> None:
        self.opened(c, None, c.path(0), {"O_WRONLY", "O_CREAT", "O_TRUNC"})

    def opened(self, c: Syscall, dirfd: Fd | None, path: str, flags: set[str]) -> None:
        full = c.result_path or self.at(dirfd, path)
        rel = self.rel(full)
        if rel is None or c.result is None:
            return
        self.out.root_calls += 1
        fd = c.result
        if rel in self.dirs or "O_DIRECTORY" in flags:
            self.fds[fd] = _Open("", rel, True, False)
            return
        writes = bool(flags & {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC"})
        fid = self.new_fid()
        append = "O_APPEND" in flags
        existed = rel in self.files
        if writes:
            self.emit("open_create", (rel, "O_EXCL" in flags, append), result=fid)
        else:
            self.emit("open_read", (rel,), result=fid)
        self.files.add(rel)
        self.fds[fd] = _Open(fid, rel, False, append)
        if "O_TRUNC" in flags and existed:
            self.emit("ftruncate", (fid, 0))

    def file(self, c: Syscall, fd: int) -> _Open | None:
        """The open file behind ``fd`` if it is under the root (None otherwise)."""
        got = self.fds.get(fd)
        if got is not None:
            if got.is_dir:
                raise self.fail(f"descriptor {fd} is the directory {got.path!r}")
            self.out.root_calls += 1
            return got
        arg = c.args[0] if c.args else None
        if isinstance(arg, Fd) and self.rel(arg.path) is not None:
            raise self.fail(f"unknown descriptor {fd} for {arg.path!r} (opened in a way "
                            "that is not traced)")
        return None

    def call_close(self, c: Syscall) -> None:
        fd = c.args[0]
        num = fd.num if isinstance(fd, Fd) else fd
        got = self.fds.pop(num, None) if isinstance(num, int) else None
        if got is None:
            return
        got.aliases -= 1
        if got.aliases == 0 and not got.is_dir:
            self.emit("close", (got.fid,))

    def dup_to(self, c: Syscall, new: int | None) -> None:
        fd = c.args[0]
        num = fd.num if isinstance(fd, Fd) else fd
        if not isinstance(num, int) or num not in self.fds or new is None:
            return
        if new in self.fds and new != num:
            self.call_close(Syscall(c.pid, c.time, "close", (new,), 0, None, None, c.line))
        got = self.fds[num]
        got.aliases += 1
        self.fds[new] = got

    def call_dup(self, c: Syscall) -> None:
        self.dup_to(c, c.result)

    call_dup2 = call_dup
    call_dup3 = call_dup

    def call_read(self, c: Syscall) -> None:
        fd = c.args[0]
        num = fd.num if isinstance(fd, Fd) else fd
        got = self.fds.get(num) if isinstance(num, int) else None
        if got is not None and not got.is_dir and c.result is not None:
            got.pos += c.result

    def call_lseek(self, c: Syscall) -> None:
        got = self.fds.get(c.fd(0).num)
        if got is not None and c.result is not None:
            got.pos = c.result

    def data(self, c: Syscall, parts: Sequence[Text]) -> bytes:
        n = c.result or 0
        data = b"".join(p.data for p in parts)
        if len(data) < n:
            raise self.fail(f"the trace shows {len(data)} of the {n} bytes written (strace "
                            "cut the string: raise its -s)")
        return data[:n]

    def put(self, c: Syscall, parts: Sequence[Text], offset: int | None) -> None:
        fd = c.fd(0)
        got = self.file(c, fd.num)
        if got is None:
            if fd.path is not None and fd.path.startswith("pipe:") and len(parts) == 1:
                msg = _json_marker(self.data(c, parts))
                if msg is not None:
                    self.out.markers.append((len(self.out.events), msg))
            return
        data = self.data(c, parts)
        if offset is not None:
            self.emit("pwrite", (got.fid, offset), data=data, result=len(data))
        elif got.append:
            self.emit("write", (got.fid,), data=data, result=len(data))
        else:
            self.emit("pwrite", (got.fid, got.pos), data=data, result=len(data))
            got.pos += len(data)

    def iov(self, c: Syscall, pos: int) -> list[Text]:
        vec = c.args[pos]
        if not isinstance(vec, list):
            raise TraceFormatError(f"line {c.line}: {c.name}: no iovec array")
        out = []
        for item in vec:
            base = item.get("iov_base") if isinstance(item, dict) else None
            if isinstance(base, Text):
                out.append(base)
        return out

    def call_write(self, c: Syscall) -> None:
        self.put(c, [c.text(1)], None)

    def call_pwrite64(self, c: Syscall) -> None:
        self.put(c, [c.text(1)], c.number(3))

    def call_writev(self, c: Syscall) -> None:
        self.put(c, self.iov(c, 1), None)

    def call_pwritev(self, c: Syscall) -> None:
        self.put(c, self.iov(c, 1), c.number(3))

    call_pwritev2 = call_pwritev

    def call_ftruncate(self, c: Syscall) -> None:
        got = self.file(c, c.fd(0).num)
        if got is not None:
            self.emit("ftruncate", (got.fid, c.number(1)))

    def call_truncate(self, c: Syscall) -> None:
        rel = self.rel(self.at(None, c.path(0)))
        if self.touches(rel):
            fid = self.new_fid()
            self.emit("open_read", (rel,), result=fid)
            self.emit("ftruncate", (fid, c.number(1)))
            self.emit("close", (fid,))

    def sync(self, c: Syscall) -> None:
        fd = c.fd(0)
        got = self.fds.get(fd.num)
        if c.name == "syncfs":
            if got is not None or self.rel(fd.path) is not None:
                self.out.root_calls += 1
                self.emit("syncfs", (".",), ok=c.ok)
            return
        if got is None:
            if self.rel(fd.path) is not None and c.ok:
                raise self.fail(f"unknown descriptor {fd.num} for {fd.path!r}")
            return
        self.out.root_calls += 1
        if got.is_dir:
            self.emit("fsync_dir", (got.path,), ok=c.ok)
        else:
            self.emit(c.name, (got.fid,), ok=c.ok)

    def two_paths(self, c: Syscall, src_dir: Fd | None, src: str, dst_dir: Fd | None,
                  dst: str) -> tuple[str, str] | None:
        a = self.rel(self.at(src_dir, src))
        b = self.rel(self.at(dst_dir, dst))
        if (a is None) != (b is None):
            raise self.fail(f"moves {src!r} to {dst!r} across the boundary of the "
                            "directory under test")
        if a is None or b is None:
            return None
        self.out.root_calls += 1
        return a, b

    def renamed(self, pair: tuple[str, str] | None) -> None:
        if pair is not None:
            self.emit("rename", pair)
            self.moved(*pair)

    def call_rename(self, c: Syscall) -> None:
        self.renamed(self.two_paths(c, None, c.path(0), None, c.path(1)))

    def call_renameat(self, c: Syscall) -> None:
        self.renamed(self.two_paths(c, c.fd(0), c.path(1), c.fd(2), c.path(3)))

    def call_renameat2(self, c: Syscall) -> None:
        pair = self.two_paths(c, c.fd(0), c.path(1), c.fd(2), c.path(3))
        if pair is not None and "RENAME_EXCHANGE" in c.flags(4):
            raise self.fail("RENAME_EXCHANGE is not modelled")
        self.renamed(pair)

    def linked(self, pair: tuple[str, str] | None) -> None:
        if pair is not None:
            self.emit("link", pair)
            self.files.add(pair[1])

    def call_link(self, c: Syscall) -> None:
        self.linked(self.two_paths(c, None, c.path(0), None, c.path(1)))

    def call_linkat(self, c: Syscall) -> None:
        self.linked(self.two_paths(c, c.fd(0), c.path(1), c.fd(2), c.path(3)))

    def symlinked(self, target: str, dirfd: Fd | None, path: str) -> None:
        rel = self.rel(self.at(dirfd, path))
        if self.touches(rel):
            self.emit("symlink", (target, rel))

    def call_symlink(self, c: Syscall) -> None:
        self.symlinked(c.path(0), None, c.path(1))

    def call_symlinkat(self, c: Syscall) -> None:
        self.symlinked(c.path(0), c.fd(1), c.path(2))

    def removed(self, rel: str | None, directory: bool) -> None:
        if self.touches(rel):
            assert rel is not None
            self.emit("rmdir" if directory else "unlink", (rel,))
            (self.dirs if directory else self.files).discard(rel)

    def call_unlink(self, c: Syscall) -> None:
        self.removed(self.rel(self.at(None, c.path(0))), False)

    def call_unlinkat(self, c: Syscall) -> None:
        self.removed(self.rel(self.at(c.fd(0), c.path(1))), "AT_REMOVEDIR" in c.flags(2))

    def call_rmdir(self, c: Syscall) -> None:
        self.removed(self.rel(self.at(None, c.path(0))), True)

    def made_dir(self, rel: str | None) -> None:
        if self.touches(rel):
            assert rel is not None
            self.emit("mkdir", (rel,))
            self.dirs.add(rel)

    def call_mkdir(self, c: Syscall) -> None:
        self.made_dir(self.rel(self.at(None, c.path(0))))

    def call_mkdirat(self, c: Syscall) -> None:
        self.made_dir(self.rel(self.at(c.fd(0), c.path(1))))

    def call_mmap(self, c: Syscall) -> None:
        if len(c.args) < 5 or not isinstance(c.args[4], Fd):
            return
        fd = c.args[4]
        got = self.fds.get(fd.num)
        prot, flags = c.flags(2), c.flags(3)
        if got is not None and "PROT_WRITE" in prot and "MAP_SHARED" in flags:
            note = f"writes through a shared mapping of {got.path}"
            if note not in self.out.unseen:
                self.out.unseen.append(note)

    def call_io_uring_setup(self, c: Syscall) -> None:
        if "io_uring" not in self.out.unseen:
            self.out.unseen.append("io_uring (requests submitted through it)")

    def refuse_into_root(self, c: Syscall, pos: int) -> None:
        arg = c.args[pos] if len(c.args) > pos else None
        if isinstance(arg, Fd) and (arg.num in self.fds or self.rel(arg.path) is not None):
            raise self.fail("writes into a file under the root without passing its bytes "
                            "through the trace")

    def call_fallocate(self, c: Syscall) -> None:
        self.refuse_into_root(c, 0)

    def call_copy_file_range(self, c: Syscall) -> None:
        self.refuse_into_root(c, 2)

    def call_sendfile(self, c: Syscall) -> None:
        self.refuse_into_root(c, 0)

    def call_splice(self, c: Syscall) -> None:
        self.refuse_into_root(c, 2)


def to_events(calls: Sequence[Syscall], root: str, cwd: str) -> Events:
    """The seam events of ``calls`` under ``root`` (see the module docstring).

    ``cwd`` is the traced process's working directory (for relative paths).  Raises
    ``UnmodelledCall`` or ``TraceFormatError`` for calls that cannot be followed.
    """
    t = _Translator(root, cwd)
    for c in calls:
        t.run(c)
    return t.out
