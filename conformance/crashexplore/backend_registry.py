"""Backends the crash explorer can drive, by name.

Names are looked up in ``REGISTRY``: ``fs``, ``fs-syncfs``, ``fs-fsync``, ``fs-two-roots``,
``kv``
(``explored_backends``) and the broken variants ``fs-broken-*`` (``broken_fs_variants``),
or given as a dotted path ``package.module:factory`` naming any callable
``factory(root, io) -> Storage``, so a backend outside this project is explored the same
way.  ``queue-ref certify`` registers the factory it certifies here too
(``checks.crash_exploration_check.registry_name``).
"""

from __future__ import annotations

import importlib

from conformance.crashexplore.broken_fs_variants import VARIANTS
from conformance.crashexplore.explored_backends import (
    BackendSpec,
    deterministic_fs,
    open_fs,
    open_fs_mode,
    open_fs_two_roots,
    open_kv,
)
from conformance.harness.backend_factory import FactoryError, load_factory


class UnknownBackendError(ValueError):
    """The name is neither registered nor an importable ``module:factory`` path."""


REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend under ``spec.name`` (replacing one of the same name)."""
    REGISTRY[spec.name] = spec
    return spec


register(BackendSpec("fs", open_fs, "the filesystem queue (queue_ref.fsqueue.FsQueue), "
                     "in its default sync mode", "queue_ref.fsqueue"))
register(BackendSpec("fs-syncfs", open_fs_mode("syncfs"),
                     "the filesystem queue, group commit by syncfs", "queue_ref.fsqueue"))
register(BackendSpec("fs-fsync", open_fs_mode("fsync"),
                     "the filesystem queue, files fsynced by their writers, directory fsyncs "
                     "shared", "queue_ref.fsqueue"))
register(BackendSpec("fs-two-roots", open_fs_two_roots,
                     "one queue over two filesystem queues (queue_ref.multi_root), new mail "
                     "spread between them", "queue_ref.multi_root"))
register(BackendSpec("kv", open_kv, "the KV queue over the Python log engine",
                     "queue_ref.kv.kv_queue"))
for _v in VARIANTS:
    register(BackendSpec(_v.name, deterministic_fs(_v.cls),
                         f"BROKEN ({_v.clause or 'absorbed'}): "
                         f"{' '.join((_v.cls.__doc__ or '').split())}", "queue_ref.fsqueue"))


def resolve(name: str) -> BackendSpec:
    """The backend called ``name``, or the factory at the dotted path ``name``."""
    if ":" in name:
        try:
            factory = load_factory(name)
        except FactoryError as e:
            raise UnknownBackendError(str(e)) from e
        return BackendSpec(name, factory, f"factory {name}")
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownBackendError(
            f"unknown backend {name!r}; known: {known}; or give package.module:factory")
    return REGISTRY[name]


def available() -> list[str]:
    """Registered backend names whose code can be imported here."""
    out = []
    for name, spec in sorted(REGISTRY.items()):
        if spec.module:
            try:
                importlib.import_module(spec.module)
            except ImportError:
                continue
        out.append(name)
    return out
