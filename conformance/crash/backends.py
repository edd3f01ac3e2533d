"""Backends the crash explorer can drive, by name.

A backend is opened by ``BackendSpec.open(root, io)``: a Storage on the queue directory
``root`` whose every disk call goes through ``io``, with recovery run before it returns.
Names are looked up in ``REGISTRY`` (``fs``, ``kv``, and the broken variants of
``conformance.crash.variants``, which register on import), or given as a dotted path
``package.module:factory`` naming any callable ``factory(root, io) -> Storage``, so a
backend outside this project is explored the same way.

Crash exploration reruns a workload once per crash point and compares the traces, so a
backend must make the same calls each run.  The filesystem queue draws a random owner
token and time-based message ids by default; ``deterministic_fs`` opens it with its
``owner`` and ``clock`` parameters instead: an owner token derived from what is already on
disk (one more than every token the directory shows, so it is fresh, as FsQueue requires;
it sorts after them, as a random one almost surely would not) and a clock counting 1, 2,
3... per message.  That changes no protocol step, only names.
"""

from __future__ import annotations

import importlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conformance.factory import FactoryError, load_factory
from queue_ref.io import IO
from queue_ref.storage import Storage

Opener = Callable[[str, IO], Storage]


@dataclass(frozen=True)
class BackendSpec:
    name: str
    open: Opener
    description: str = ""
    module: str = ""  # imported to tell whether the backend is available here


class UnknownBackendError(ValueError):
    """The name is neither registered nor an importable ``module:factory`` path."""


REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend under ``spec.name`` (replacing one of the same name)."""
    REGISTRY[spec.name] = spec
    return spec


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
    for sub in ("queue", "cleanup"):
        for n in names(sub):
            e = fl.EntryName.parse(n)
            if e:
                found.append(fl.owner_of_msgid(e.msgid))
    found += [fl.owner_of_msgid(n) for n in names("data") if fl.MSGID_RE.match(n)]
    return [int(t, 16) for t in found]


def deterministic_fs(cls: Any) -> Opener:
    """An opener of the FsQueue class ``cls`` whose owner token and message ids depend only
    on the directory's contents, so that reruns of a workload make identical calls.

    ``cls`` takes FsQueue's ``owner`` and ``clock`` keyword arguments; message ids are
    ``<n:016x><n:06x><owner>`` for the n-th message of this opening.
    """

    def open_fs(root: str, io: IO) -> Storage:
        owner = f"{max(_owners_on_disk(root), default=0) + 1:016x}"
        store = cls(root, io, owner=owner, clock=itertools.count(1).__next__)
        if not isinstance(store, Storage):
            raise TypeError(f"{cls!r} did not make a Storage")
        return store

    return open_fs


def _open_fs(root: str, io: IO) -> Storage:
    from queue_ref.fsqueue import FsQueue

    return deterministic_fs(FsQueue)(root, io)


def _open_fs_mode(mode: str) -> Opener:
    def open_fs(root: str, io: IO) -> Storage:
        from queue_ref.fsqueue import FsQueue

        class Mode(FsQueue):
            default_sync = mode

        Mode.__name__ = Mode.__qualname__ = f"FsQueue[{mode}]"
        return deterministic_fs(Mode)(root, io)

    return open_fs


#: The KV queue's clock, fixed: creation stamps are then the same in every rerun.
KV_CLOCK_NS = 1_700_000_000_000_000_000


def _open_kv(root: str, io: IO) -> Storage:
    queue_cls = importlib.import_module("queue_ref.kv.queue").KvQueue
    store = queue_cls.open_log(root, io, clock=lambda: KV_CLOCK_NS)
    if not isinstance(store, Storage):
        raise TypeError("KvQueue.open_log did not make a Storage")
    return store


register(BackendSpec("fs", _open_fs, "the filesystem queue (queue_ref.fsqueue.FsQueue), "
                     "in its default sync mode", "queue_ref.fsqueue"))
register(BackendSpec("fs-syncfs", _open_fs_mode("syncfs"),
                     "the filesystem queue, group commit by syncfs", "queue_ref.fsqueue"))
register(BackendSpec("fs-fsync", _open_fs_mode("fsync"),
                     "the filesystem queue, files fsynced by their writers, directory fsyncs "
                     "shared", "queue_ref.fsqueue"))
register(BackendSpec("kv", _open_kv, "the KV queue over the Python log engine",
                     "queue_ref.kv.queue"))


def _load_variants() -> None:
    # The broken variants register themselves on import.
    importlib.import_module("conformance.crash.variants")


def resolve(name: str) -> BackendSpec:
    """The backend called ``name``, or the factory at the dotted path ``name``."""
    if ":" in name:
        try:
            factory = load_factory(name)
        except FactoryError as e:
            raise UnknownBackendError(str(e)) from e
        return BackendSpec(name, factory, f"factory {name}")
    if name not in REGISTRY:
        _load_variants()
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownBackendError(
            f"unknown backend {name!r}; known: {known}; or give package.module:factory")
    return REGISTRY[name]


def available() -> list[str]:
    """Registered backend names whose code can be imported here."""
    _load_variants()
    out = []
    for name, spec in sorted(REGISTRY.items()):
        if spec.module:
            try:
                importlib.import_module(spec.module)
            except ImportError:
                continue
        out.append(name)
    return out
