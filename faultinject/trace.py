"""The record of every call a backend made through the seam.

A ``TraceEvent`` holds what is needed to replay a call on the inode model
(``faultinject.replay``) and to name it in a report.  Events are free of anything that
changes from run to run (absolute paths, fd numbers, inode numbers, times), except
``site``, which points at source code; ``trace_hash`` leaves ``site`` out, so the same
workload run twice (on any root) hashes the same.

``args`` per call (paths relative to the root, ``"."`` for the root; ``fN`` file ids, numbered
in opening order, stand for fds):

==================  ===========================  =====================================
call                args                         result
==================  ===========================  =====================================
open_create         (path, exclusive, append)    file id
open_read           (path,)                      file id
lock_exclusive      (path, blocking)             file id or None
lock_file           (fid, shared, blocking)      bool (taken)
same_file           (fid, path)                  bool
write               (fid,)  data in ``.data``    bytes written
pwrite              (fid, offset)  ``.data``     bytes written (the position stays)
read / pread        (fid, n) / (fid, n, offset)  bytes
fsize               (fid,)                       int
ftruncate           (fid, length)                None
fsync / fdatasync   (fid,)                       None
close / unlock      (fid,)                       None
fsync_dir, syncfs,  (path,)                      None (listdir: tuple of names;
mkdir, rmdir,                                    exists/is_dir/is_symlink: bool;
unlink, listdir...                               lstat: (kind, size), kind in
                                                 file/dir/symlink/other, size 0 for dirs)
rename / link       (src, dst)                   None
symlink             (target, path)               None  (target verbatim)
readlink            (path,)                      str
link_max            (path,)                      int
==================  ===========================  =====================================

``rename_noreplace`` is recorded as the ``link`` and ``unlink`` it is made of.  The seam
itself never records ``pwrite``; traces read from outside the process do
(strace).

When calls come from several threads, each event also says which thread made it
(``thread``) and when it began and ended (``began``, ``ended``: numbers of one counter the
seam takes under its lock at the entry and the exit of every call, not times).  A sync the
seam holds open (``FaultyIO.sync_hold``, ``pause_in_sync``) sits in the trace where it
*began*, so the persistence models count as covered only what came before its start; calls
of other threads made while it was open come after it.  ``OperationSpan`` records one
Storage operation of one thread the same way (``FaultyIO.operation``).  None of these enter
``trace_hash``: they change from run to run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

#: Calls that make data or directory entries durable.
SYNC_CALLS = frozenset({"fsync", "fdatasync", "fsync_dir", "syncfs"})


@dataclass(frozen=True)
class TraceEvent:
    """One call through the seam.

    ``index`` is 0-based over all calls; ``data`` is the bytes that reached the file for a
    ``write`` (a prefix of what was asked when the write failed part way); ``error`` is
    ``"ExceptionName(ERRNO)"`` when the call raised; ``applied`` is false when the call had
    no effect (it failed, or the crash came before it); ``crash`` is ``"before"`` or
    ``"after"`` for the call at which the process died; ``injected`` is true when the
    error was injected by the plan.
    """

    index: int
    name: str
    args: tuple[object, ...]
    data: bytes | None
    result: object
    error: str | None
    site: str
    mutating: bool
    applied: bool
    crash: str | None = None
    injected: bool = False
    thread: int = 0
    began: int = -1
    ended: int = -1  # -1 while a held-open sync has not ended (or never will: a crash)

    def short(self) -> str:
        """A one-line label such as ``#7 rename(queue/a.tmp, queue/a)``."""
        parts = [str(a) for a in self.args]
        if self.data is not None:
            parts.append(f"{len(self.data)} bytes")
        text = f"#{self.index} {self.name}({', '.join(parts)})"
        if self.error is not None:
            text += f" -> {self.error}"
        if self.crash is not None:
            text += f" [crash {self.crash}]"
        return text


@dataclass
class OperationSpan:
    """One Storage operation (``commit``, ``send_done``...) of thread ``thread``, from
    ``began`` to ``ended`` on the seam's counter (``TraceEvent.began``); ``outcome`` is
    ``"ok"`` when it returned, else the name of what it raised (``""`` while it runs)."""

    name: str
    thread: int
    began: int
    ended: int = -1
    outcome: str = ""

    def short(self) -> str:
        return f"{self.name} [{self.began}..{self.ended}] {self.outcome or 'running'}"


def canonical(value: object) -> str:
    """A deterministic text form of an event value (types kept apart)."""
    if value is None:
        return "N"
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, int):
        return f"i{value}"
    if isinstance(value, str):
        return "s" + json.dumps(value)
    if isinstance(value, bytes):
        return "b" + value.hex()
    if isinstance(value, tuple | list):
        return "(" + ",".join(canonical(v) for v in value) + ")"
    raise TypeError(f"cannot put a {type(value).__name__} into a trace hash: {value!r}")


def event_canonical(event: TraceEvent) -> str:
    """The canonical line of one event: every field except ``site``."""
    return canonical((
        event.index, event.name, event.args, event.data, event.result, event.error,
        event.mutating, event.applied, event.crash, event.injected,
    ))


def trace_hash(events: Iterable[TraceEvent]) -> str:
    """SHA-256 (hex) over the canonical lines of ``events``; the same workload gives the same hash."""
    h = hashlib.sha256()
    for event in events:
        h.update(event_canonical(event).encode())
        h.update(b"\n")
    return h.hexdigest()
