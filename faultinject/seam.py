"""``FaultyIO``: the seam's twin that records every call, crashes and fails on demand.

Every call is performed for real, through ``inner`` (default ``OsIO``), on the real directory
``root``; the disk after a crash is built afterwards from the trace (``faultinject.models``).

Crash and fault points count *mutating* calls (``queue_ref.io.MUTATING``), 0-based:

* ``crash_at=N, crash_when="before"``: call N is not performed; ``Crash`` is raised.
* ``crash_at=N, crash_when="after"``: call N is performed (its error, if any, is dropped);
  ``Crash`` is raised instead of returning.
* ``fail_at=N``: call N raises ``OSError(fail_errno)``.  A failed ``write`` first writes
  ``fail_written`` bytes (a short write, as a full disk gives).  A failed ``fsync``/``fdatasync``
  does nothing to the real file, so the page cache (what reads see) keeps the data, as on
  Linux ext4/XFS; the persistence models treat the data it covered as never durable, even
  after a later successful fsync of the same file ("fsyncgate").  Any other failed call is
  not performed.

After a ``Crash`` every further call raises ``Crash`` (the process is dead) and records
nothing; the files the dead process had open are closed, which releases its flocks.

Calls from several threads are serialized (one at a time, in trace order), so the trace is
the order in which the calls took effect; a blocking ``lock_exclusive`` waits outside that
order and is recorded when it got the lock.

``pause_at(N)`` stops the caller of mutating call N *before* it, alive, until the gate it
returns is released (``faultinject.pause.PauseGate``): the other callers' calls go on
meanwhile, so a harness can run a competing operation inside the paused one.

A sync call (``fsync``, ``fdatasync``, ``fsync_dir``, ``syncfs``) is *held open* when
``sync_hold`` > 0 (it lasts that many seconds, as on a disk) or when ``pause_in_sync(K)``
names it (the K-th sync call from now stops *inside* it, after it began, until the gate is
released): it begins under the lock (its event takes its place in the trace then), the
lock is let go while it is open, so other threads' calls go on and come after it in the
trace, and it is performed, and ends, under the lock again.  So the trace says what a real
sync can promise: nothing about changes made after it began.  Every event records its
thread and the counter values at its entry and exit (``TraceEvent.began``/``ended``);
``operation(name)`` brackets one Storage operation of the calling thread on the same
counter (``operations``), for the sync-cover rule (``conformance.harness.sync_cover``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

import queue_ref.io as qio
from faultinject.disk import DiskImage, snapshot
from faultinject.fault_errors import Crash
from faultinject.pause import PauseGate
from faultinject.trace import SYNC_CALLS, OperationSpan, TraceEvent, trace_hash
from queue_ref.io import IO, MUTATING, OsIO

T = TypeVar("T")

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_IO_FILE = os.path.abspath(qio.__file__)
_PROJECT_DIR = os.path.dirname(_PKG_DIR)


@dataclass
class FaultPlan:
    """Where to crash and where to fail, by index among mutating calls (0-based)."""

    crash_at: int | None = None
    crash_when: str = "before"
    fail_at: int | None = None
    fail_errno: int = errno.EIO
    fail_written: int = 0

    def __post_init__(self) -> None:
        if self.crash_when not in ("before", "after"):
            raise ValueError(f"crash_when must be 'before' or 'after', not {self.crash_when!r}")
        for name in ("crash_at", "fail_at"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, not {value}")
        if self.fail_written < 0:
            raise ValueError(f"fail_written must be >= 0, not {self.fail_written}")
        if self.fail_errno not in errno.errorcode:
            raise ValueError(f"fail_errno {self.fail_errno} is not an errno")


def error_text(exc: BaseException) -> str:
    """``"FileExistsError(EEXIST)"``: a run-independent name for an error."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{type(exc).__name__}({errno.errorcode.get(exc.errno, str(exc.errno))})"
    return type(exc).__name__


def call_site() -> str:
    """``"path/file.py:123 in func"`` of the first frame outside faultinject and queue_ref/io.py."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_PKG_DIR + os.sep) and filename != _IO_FILE:
            if filename.startswith(_PROJECT_DIR + os.sep):
                filename = os.path.relpath(filename, _PROJECT_DIR)
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _stat_summary(st: os.stat_result) -> tuple[str, int]:
    if stat_mod.S_ISREG(st.st_mode):
        return ("file", st.st_size)
    if stat_mod.S_ISLNK(st.st_mode):
        return ("symlink", st.st_size)
    if stat_mod.S_ISDIR(st.st_mode):
        return ("dir", 0)
    return ("other", 0)


class FaultyIO(IO):
    """Records, crashes and fails calls; see the module docstring.

    Attributes: ``events`` (the trace), ``mutating_count``, ``crashed``, ``crash`` (the first
    ``Crash`` raised, or ``None``), ``initial`` (snapshot of ``root`` taken at construction,
    the disk before the workload), ``root``, ``plan``, ``inner``, ``sync_hold`` (seconds a
    sync call is held open), ``sync_count`` (sync calls begun), ``operations`` (the
    ``OperationSpan`` of every ``operation``).
    """

    def __init__(self, root: str, plan: FaultPlan | None = None, inner: IO | None = None,
                 *, sync_hold: float = 0.0) -> None:
        if sync_hold < 0:
            raise ValueError(f"sync_hold must be >= 0 seconds, not {sync_hold}")
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise ValueError(f"FaultyIO root {root!r} is not a directory")
        self.plan = plan if plan is not None else FaultPlan()
        self.inner = inner if inner is not None else OsIO()
        self.events: list[TraceEvent] = []
        self.mutating_count = 0
        self.crashed = False
        self.crash: Crash | None = None
        self.initial: DiskImage = snapshot(self.root)
        self._fids: dict[int, str] = {}
        self._opened = 0
        self._mutex = threading.RLock()
        self._append: set[int] = set()
        self._pinned: list[str] = []
        self._gate: PauseGate | None = None
        self._sync_gate: PauseGate | None = None
        self.sync_hold = sync_hold
        self.sync_count = 0
        self.operations: list[OperationSpan] = []
        self._seq = 0

    # ---- bookkeeping -----------------------------------------------------------------

    def trace_hash(self) -> str:
        return trace_hash(self.events)

    def rel(self, path: str) -> str:
        """``path`` relative to the root (absolute, normalized, if it lies outside)."""
        full = os.path.abspath(path)
        if full == self.root:
            return "."
        if full.startswith(self.root + os.sep):
            return full[len(self.root) + 1:]
        return full

    def _fid(self, fd: int) -> str:
        return self._fids.get(fd, f"?{fd}")

    def _new_fid(self, fd: int) -> str:
        fid = f"f{self._opened}"
        self._opened += 1
        self._fids[fd] = fid
        return fid

    def _die(self, call_index: int, when: str, name: str, event_index: int) -> Crash:
        self.crashed = True
        self.crash = Crash(call_index, when, name=name, event_index=event_index)
        for fd in list(self._fids):
            with contextlib.suppress(OSError):
                self.inner.close(fd)
        self._fids.clear()
        self._append.clear()
        for path in self._pinned:  # the dead process's directory descriptors go too
            with contextlib.suppress(OSError):
                self.inner.unpin_dir(path)
        self._pinned.clear()
        return self.crash

    def _dead(self) -> Crash:
        first = self.crash
        assert first is not None
        return Crash(first.call_index, first.when, name=first.name,
                     event_index=first.event_index, repeated=True)

    def pause_at(self, at: int) -> PauseGate:
        """Stop the caller of mutating call ``at`` before it until the gate is released
        (replaces a gate armed earlier, which is released)."""
        gate = PauseGate(at)
        with self._mutex:
            old, self._gate = self._gate, gate
        if old is not None:
            old.release()
        return gate

    def pause_in_sync(self, at: int) -> PauseGate:
        """Stop the caller of sync call ``at`` (0-based over ``sync_count``) inside it,
        after it began and before it is performed, until the gate is released (replaces a
        gate armed earlier, which is released)."""
        gate = PauseGate(at)
        with self._mutex:
            old, self._sync_gate = self._sync_gate, gate
        if old is not None:
            old.release()
        return gate

    def _tick(self) -> int:
        """The next value of the counter that orders entries and exits (under the lock)."""
        self._seq += 1
        return self._seq

    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[OperationSpan]:
        """Bracket one Storage operation of the calling thread: its span on the seam's
        counter and its outcome (``"ok"``, or the name of the exception it raised)."""
        with self._mutex:
            span = OperationSpan(name, threading.get_ident(), self._tick())
            self.operations.append(span)
        outcome = "ok"
        try:
            yield span
        except BaseException as e:
            outcome = type(e).__name__
            raise
        finally:
            with self._mutex:
                span.ended = self._tick()
                span.outcome = outcome

    def _pause_point(self, name: str) -> None:
        """Stop here if the armed gate names this call (waits outside the lock)."""
        gate = self._gate
        if gate is None or name not in MUTATING:
            return
        with self._mutex:
            hit = (self._gate is gate and not self.crashed
                   and self.mutating_count == gate.at and gate.fire(name))
            if hit:
                self._gate = None
        if hit:
            gate.stop()

    def _call(
        self,
        name: str,
        args: tuple[object, ...],
        run: Callable[[], T],
        *,
        data: bytes | None = None,
        record: Callable[[T], object] = lambda r: r,
        inject: Callable[[OSError], tuple[bytes | None, bool]] | None = None,
        on_error: Callable[[], tuple[bytes | None, bool]] | None = None,
    ) -> T:
        """Run one call with recording, crash points and fault injection.

        ``inject(exc)`` performs the partial effect of an injected failure and returns
        ``(data, applied)``; ``on_error()`` works out the same after a real failure.
        """
        self._pause_point(name)
        if name in SYNC_CALLS and (self.sync_hold > 0 or self._sync_gate is not None):
            slot = self._begin_sync(name, args)
            gate = self._sync_gate
            hit = False
            if gate is not None:
                with self._mutex:
                    hit = self._sync_gate is gate and gate.at == slot[2] and gate.fire(name)
                    if hit:
                        self._sync_gate = None
            if hit:
                gate.stop()  # type: ignore[union-attr]
            if self.sync_hold > 0:
                time.sleep(self.sync_hold)
            with self._mutex:
                return self._call_locked(name, args, run, data=data, record=record,
                                         inject=inject, on_error=on_error, slot=slot)
        with self._mutex:
            if name in SYNC_CALLS:
                self.sync_count += 1
            return self._call_locked(name, args, run, data=data, record=record, inject=inject,
                                     on_error=on_error)

    def _begin_sync(self, name: str, args: tuple[object, ...]) -> tuple[int, int, int, int]:
        """Begin a held-open sync: its place in the trace (an event that says it has not
        ended) and its mutating index, sync number and entry count, as ``slot``."""
        with self._mutex:
            if self.crashed:
                raise self._dead()
            index, m, k = len(self.events), self.mutating_count, self.sync_count
            self.sync_count += 1
            began = self._tick()
            self.events.append(TraceEvent(index, name, args, None, None, None, call_site(),
                                          name in MUTATING, False,
                                          thread=threading.get_ident(), began=began))
            self.mutating_count += name in MUTATING
            return index, m, k, began

    def _call_locked(
        self,
        name: str,
        args: tuple[object, ...],
        run: Callable[[], T],
        *,
        data: bytes | None,
        record: Callable[[T], object],
        inject: Callable[[OSError], tuple[bytes | None, bool]] | None,
        on_error: Callable[[], tuple[bytes | None, bool]] | None,
        slot: tuple[int, int, int, int] | None = None,
    ) -> T:
        """``slot``: the place a held-open sync took when it began (``_begin_sync``)."""
        if self.crashed:
            raise self._dead()
        mutating = name in MUTATING
        thread = threading.get_ident()
        if slot is None:
            index, m, began = len(self.events), self.mutating_count, self._tick()
            if mutating:
                self.mutating_count += 1
        else:
            index, m, _, began = slot
        site = call_site()
        plan = self.plan
        crash_here = mutating and plan.crash_at == m

        def put(event: TraceEvent) -> None:
            if slot is None:
                self.events.append(event)
            else:
                self.events[index] = event

        if crash_here and plan.crash_when == "before":
            put(TraceEvent(index, name, args, data, None, None, site, mutating, False,
                           crash="before", thread=thread, began=began, ended=self._tick()))
            raise self._die(m, "before", name, index)
        exc: OSError | None = None
        injected = False
        result: T | None = None
        if mutating and plan.fail_at == m:
            injected = True
            exc = OSError(plan.fail_errno, f"injected fault in {name} (mutating call #{m})")
            data, applied = inject(exc) if inject is not None else (data, False)
        else:
            try:
                result = run()
                applied = True
            except OSError as e:
                exc = e
                data, applied = on_error() if on_error is not None else (data, False)
        crash = "after" if crash_here else None
        shown = record(result) if exc is None else None  # type: ignore[arg-type]
        put(TraceEvent(
            index, name, args, data, shown, None if exc is None else error_text(exc), site,
            mutating, applied, crash=crash, injected=injected, thread=thread, began=began,
            ended=self._tick(),
        ))
        if crash_here:
            raise self._die(m, "after", name, index)
        if exc is not None:
            raise exc
        return result  # type: ignore[return-value]

    # ---- files --------------------------------------------------------------------

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        fd = self._call(
            "open_create", (self.rel(path), exclusive, append),
            lambda: self.inner.open_create(path, exclusive=exclusive, append=append),
            record=self._new_fid,
        )
        if append:
            self._append.add(fd)
        return fd

    def open_read(self, path: str) -> int:
        return self._call("open_read", (self.rel(path),), lambda: self.inner.open_read(path),
                          record=self._new_fid)

    def _where(self, fd: int) -> int:
        """Where the next byte written to ``fd`` lands (-1 if that cannot be told)."""
        try:
            if fd in self._append:
                return self.inner.fsize(fd)
            return os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:
            return -1

    def write(self, fd: int, data: bytes) -> int:
        data = bytes(data)
        start = self._where(fd)

        def inject(exc: OSError) -> tuple[bytes | None, bool]:
            part = data[:self.plan.fail_written]
            if part:
                self.inner.write(fd, part)
            return part, bool(part)

        def on_error() -> tuple[bytes | None, bool]:
            # A short write may have reached the file before the error.
            end = self._where(fd)
            done = end - start if start >= 0 and end >= 0 else 0
            part = data[:max(0, done)]
            return part, bool(part)

        return self._call("write", (self._fid(fd),), lambda: self.inner.write(fd, data),
                          data=data, inject=inject, on_error=on_error)

    def read(self, fd: int, n: int) -> bytes:
        return self._call("read", (self._fid(fd), n), lambda: self.inner.read(fd, n))

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return self._call("pread", (self._fid(fd), n, offset),
                          lambda: self.inner.pread(fd, n, offset))

    def fsize(self, fd: int) -> int:
        return self._call("fsize", (self._fid(fd),), lambda: self.inner.fsize(fd))

    def ftruncate(self, fd: int, length: int) -> None:
        self._call("ftruncate", (self._fid(fd), length), lambda: self.inner.ftruncate(fd, length))

    def fsync(self, fd: int) -> None:
        self._call("fsync", (self._fid(fd),), lambda: self.inner.fsync(fd))

    def fdatasync(self, fd: int) -> None:
        self._call("fdatasync", (self._fid(fd),), lambda: self.inner.fdatasync(fd))

    def close(self, fd: int) -> None:
        fid = self._fid(fd)
        try:
            self._call("close", (fid,), lambda: self.inner.close(fd))
        finally:
            self._fids.pop(fd, None)
            self._append.discard(fd)

    # ---- directories and names ----------------------------------------------------

    def fsync_dir(self, path: str) -> None:
        self._call("fsync_dir", (self.rel(path),), lambda: self.inner.fsync_dir(path))

    def syncfs(self, path: str) -> None:
        """Recorded with the path it was given; it makes the whole file system durable."""
        self._call("syncfs", (self.rel(path),), lambda: self.inner.syncfs(path))

    def pin_dir(self, path: str) -> None:
        """Forwarded, not recorded: holding a directory open changes nothing on disk.
        Released when the process dies, as its other descriptors are."""
        if self.crashed:
            raise self._dead()
        with self._mutex:
            self.inner.pin_dir(path)
            self._pinned.append(path)

    def unpin_dir(self, path: str) -> None:
        with self._mutex:
            if self.crashed or path not in self._pinned:
                return  # released at the crash (or never pinned here)
            self._pinned.remove(path)
            self.inner.unpin_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self._call("rename", (self.rel(src), self.rel(dst)), lambda: self.inner.rename(src, dst))

    def rename_noreplace(self, src: str, dst: str) -> None:
        """``link`` then ``unlink``, each a recorded call (and a crash point)."""
        self.link(src, dst)
        self.unlink(src)

    def link(self, src: str, dst: str) -> None:
        self._call("link", (self.rel(src), self.rel(dst)), lambda: self.inner.link(src, dst))

    def symlink(self, target: str, path: str) -> None:
        self._call("symlink", (target, self.rel(path)), lambda: self.inner.symlink(target, path))

    def readlink(self, path: str) -> str:
        return self._call("readlink", (self.rel(path),), lambda: self.inner.readlink(path))

    def link_max(self, path: str) -> int:
        return self._call("link_max", (self.rel(path),), lambda: self.inner.link_max(path))

    def unlink(self, path: str) -> None:
        self._call("unlink", (self.rel(path),), lambda: self.inner.unlink(path))

    def unlink_large(self, path: str) -> None:
        """The same step as ``unlink`` for every fault, crash and record."""
        self._call("unlink", (self.rel(path),), lambda: self.inner.unlink_large(path))

    def mkdir(self, path: str) -> None:
        self._call("mkdir", (self.rel(path),), lambda: self.inner.mkdir(path))

    def rmdir(self, path: str) -> None:
        self._call("rmdir", (self.rel(path),), lambda: self.inner.rmdir(path))

    def listdir(self, path: str, *, ordered: bool = True) -> list[str]:
        # recorded sorted: the trace does not depend on the file system's order
        return self._call("listdir", (self.rel(path),),
                          lambda: self.inner.listdir(path, ordered=ordered),
                          record=lambda names: tuple(sorted(names)))

    def iter_names(self, path: str) -> Iterator[str]:
        # one recorded call, like listdir: the trace and the faults do not depend on how
        # far a caller reads
        names = self._call("iter_names", (self.rel(path),),
                           lambda: self.inner.listdir(path, ordered=False),
                           record=lambda got: tuple(sorted(got)))
        return iter(names)

    def lstat(self, path: str) -> os.stat_result:
        return self._call("lstat", (self.rel(path),), lambda: self.inner.lstat(path),
                          record=_stat_summary)

    def exists(self, path: str) -> bool:
        return self._call("exists", (self.rel(path),), lambda: self.inner.exists(path))

    def is_dir(self, path: str) -> bool:
        return self._call("is_dir", (self.rel(path),), lambda: self.inner.is_dir(path))

    def is_symlink(self, path: str) -> bool:
        return self._call("is_symlink", (self.rel(path),), lambda: self.inner.is_symlink(path))

    # ---- liveness locks -----------------------------------------------------------

    def lock_exclusive(self, path: str, *, blocking: bool = False) -> int | None:
        """Recorded; the lock file it may create is a directory entry like any other."""
        if self.crashed:
            raise self._dead()
        existed = self.inner.exists(path)
        # Wait for the lock outside the mutex: the holder may need the seam to let it go.
        got: int | None = None
        failure: OSError | None = None
        try:
            got = self.inner.lock_exclusive(path, blocking=blocking)
        except OSError as e:
            failure = e

        def result() -> int | None:
            if failure is not None:
                raise failure
            return got

        def on_error() -> tuple[bytes | None, bool]:
            return None, not existed and self.inner.exists(path)

        try:
            return self._call(
                "lock_exclusive", (self.rel(path), blocking), result,
                record=lambda fd: None if fd is None else self._new_fid(fd),
                on_error=on_error,
            )
        except Crash:
            if got is not None and got not in self._fids:
                self.inner.unlock(got)  # the process died while it waited
            raise

    def unlock(self, fd: int) -> None:
        fid = self._fid(fd)
        try:
            self._call("unlock", (fid,), lambda: self.inner.unlock(fd))
        finally:
            self._fids.pop(fd, None)


    def lock_file(self, fd: int, *, shared: bool, blocking: bool = False) -> bool:
        """Recorded; a blocking wait happens outside the seam's order, as for
        ``lock_exclusive`` (the holder may need the seam to close its file)."""
        if self.crashed:
            raise self._dead()
        got = False
        failure: OSError | None = None
        try:
            got = self.inner.lock_file(fd, shared=shared, blocking=blocking)
        except OSError as e:
            failure = e

        def result() -> bool:
            if failure is not None:
                raise failure
            return got

        return self._call("lock_file", (self._fid(fd), shared, blocking), result)

    def same_file(self, fd: int, path: str) -> bool:
        return self._call("same_file", (self._fid(fd), self.rel(path)),
                          lambda: self.inner.same_file(fd, path))


def public_io_methods() -> Sequence[str]:
    """Names of the seam's public calls (``FaultyIO`` records each of them)."""
    return sorted(n for n, v in vars(IO).items() if callable(v) and not n.startswith("_"))
