"""The project's own backends as the crash explorer opens them, with stable names.

A backend is opened by ``BackendSpec.open(root, io)``: a Storage on the queue directory
``root`` whose every disk call goes through ``io``, with recovery run before it returns.
``backend_registry`` names them (``fs``, ``fs-syncfs``, ``fs-fsync``, ``fs-two-roots``,
``kv``, and the broken variants of ``broken_fs_variants``).

Crash exploration reruns a workload once per crash point and compares the traces, so a
backend must make the same calls each run.  The filesystem queue draws a random owner
token and time-based message ids by default; ``deterministic_fs`` opens it with its
``owner`` and ``clock`` parameters instead: an owner token derived from what is already on
disk (one more than every token the directory shows, so it is fresh, as FsQueue requires;
it sorts after them, as a random one almost surely would not) and a clock counting 1, 2,
3... per message.  That changes no protocol step, only names.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queue_ref.io import IO
from queue_ref.storage import Storage

Opener = Callable[[str, IO], Storage]


@dataclass(frozen=True)
class BackendSpec:
    name: str
    open: Opener
    description: str = ""
    module: str = ""  # imported to tell whether the backend is available here


# ---- the filesystem queue, with names that do not change from run to run ---------------

def _owners_on_disk(root: str) -> list[int]:
    """Every owner token found in the names under ``root`` (as ints)."""
    from queue_ref.fsqueue import layout as fl

    found: list[str] = []

    def names(sub: str) -> list[str]:
        try:
            return os.listdir(os.path.join(root, sub))
        except OSError:
            return []

    for n in names("owners"):
        m = fl.OWNER_LOCK_RE.match(n)
        if m:
            found.append(m["owner"])
    found += [n for n in names("tmp") if fl.OWNER_RE.match(n)]
    for n in names("inflight"):
        p = fl.parse_inflight(n)
        if p:
            found += [p[1], fl.owner_of_msgid(p[0].msgid)]
    for sub in ("queue", "held", "cleanup"):
        for n in names(sub):
            e = fl.EntryName.parse(n)
            if e:
                found.append(fl.owner_of_msgid(e.msgid))
    found += [fl.owner_of_msgid(n) for n in names("data") if fl.MSGID_RE.match(n)]
    return [int(t, 16) for t in found]


def jumpy_clock() -> Callable[[], int]:
    """A deterministic clock (nanoseconds) that stalls and steps back, as a wall clock
    under NTP does: 1, 0, 1, 2, 2, 1, 3, 3, 3, 3, 4, 4, ...  (each value read about three times,
    every fourth reading one step behind).  A backend whose ids rest on the clock alone
    repeats them under it."""
    readings = itertools.count(3)

    def clock() -> int:
        i = next(readings)
        return i // 3 - (1 if i % 4 == 0 else 0)

    return clock


def deterministic_fs(cls: Any) -> Opener:
    """An opener of the FsQueue class ``cls`` whose owner token and message ids depend only
    on the directory's contents, so that reruns of a workload make identical calls.

    ``cls`` takes FsQueue's ``owner`` and ``clock`` keyword arguments.  The clock is
    ``jumpy_clock()``: it stalls and steps back as a wall clock does, so every check that
    opens the queue this way also shows that ids stay unique when time misbehaves.
    """

    def open_fs(root: str, io: IO) -> Storage:
        owner = f"{max(_owners_on_disk(root), default=0) + 1:016x}"
        store = cls(root, io, owner=owner, clock=jumpy_clock())
        if not isinstance(store, Storage):
            raise TypeError(f"{cls!r} did not make a Storage")
        return store

    return open_fs


def open_fs(root: str, io: IO) -> Storage:
    """The filesystem queue in its default sync mode."""
    from queue_ref.fsqueue import FsQueue

    return deterministic_fs(FsQueue)(root, io)


def open_fs_mode(mode: str) -> Opener:
    """An opener of the filesystem queue in sync mode ``mode``."""
    def open_fs(root: str, io: IO) -> Storage:
        from queue_ref.fsqueue import FsQueue

        class Mode(FsQueue):
            default_sync = mode

        Mode.__name__ = Mode.__qualname__ = f"FsQueue[{mode}]"
        return deterministic_fs(Mode)(root, io)

    return open_fs


def make_dir(path: str, io: IO) -> None:
    """Create the directory ``path`` durably (its parent fsynced) if it is missing."""
    from queue_ref.storage import InvalidInputError, StorageIOError

    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidInputError(f"a queue path must be a non-empty str without NUL, "
                                f"got {path!r}")
    try:
        if not io.is_dir(path):
            with contextlib.suppress(FileExistsError):
                io.mkdir(path)
            io.fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise StorageIOError(f"creating the directory {path} failed: {e}") from e


def open_fs_two_roots(root: str, io: IO) -> Storage:
    """One queue over two roots, ``root/a`` and ``root/b``, each the filesystem queue in
    ``fsync`` mode (names derived from its own directory), every call of both through
    ``io``: a crash stops both roots at once, wherever either one was.  Both roots are on
    one file system, so not ``syncfs``, as ``MultiRootQueue.open_fs`` chooses: a failed
    ``syncfs`` of one root covers the other's changes too."""
    from queue_ref.multi_root import MultiRootQueue

    make_dir(root, io)
    subs = [os.path.join(root, name) for name in ("a", "b")]
    opener = open_fs_mode("fsync")
    return MultiRootQueue({sub: (lambda sub=sub: opener(sub, io)) for sub in subs})


#: The KV queue's clock, fixed: creation stamps are then the same in every rerun.
KV_CLOCK_NS = 1_700_000_000_000_000_000


def open_kv(root: str, io: IO) -> Storage:
    """The KV queue over the Python log engine, its clock fixed."""
    from queue_ref.kv.kv_queue import KvQueue as queue_cls
    store = queue_cls.open_log(root, io, clock=lambda: KV_CLOCK_NS)
    if not isinstance(store, Storage):
        raise TypeError("KvQueue.open_log did not make a Storage")
    return store
