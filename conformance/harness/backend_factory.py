"""The backend under test: a factory, how to call it, and what it declares.

A backend author gives the suite a *factory*, named ``package.module:attribute`` (the
attribute may be dotted, e.g. ``KvQueue.open_log``) or passed as a callable:

* ``factory(root, io) -> Storage`` for a backend whose every disk call goes through the
  I/O seam (it declares ``Capability.IO_SEAM``; the suite then explores crashes);
* ``factory(root) -> Storage`` for any other backend (``root`` is an empty directory the
  suite owns; the backend keeps its data there);
* ``factory() -> Storage`` for a backend with no location (an in-memory one): every open
  gives a new, empty queue.

Opening runs recovery (the Storage contract).  ``Backend.probe`` opens one throwaway
queue to read the declared capabilities, so a factory that cannot open fails early
with a clear message.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from queue_ref.io import IO, OsIO
from queue_ref.opener import import_object
from queue_ref.storage import Capability, InvalidInputError, Limits, Storage

Factory = Callable[..., Storage]


class FactoryError(ValueError):
    """The factory cannot be loaded or called the way the suite needs."""


def load_factory(path: str) -> Factory:
    """The callable named ``package.module:attribute`` (attribute may be dotted)."""
    try:
        obj = import_object(path)
    except InvalidInputError as e:
        raise FactoryError(str(e)) from e
    if not callable(obj):
        raise FactoryError(f"{path!r} is not callable")
    return obj


def _binds(fn: Callable[..., object], nargs: int) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return nargs == 1  # a builtin without a signature: assume factory(root)
    try:
        sig.bind(*range(nargs))
    except TypeError:
        return False
    return True


def factory_name(fn: Callable[..., object]) -> str:
    """``module:qualname`` of a callable (how the certificate names the backend)."""
    mod = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}:{qual}"


@dataclass(frozen=True)
class Backend:
    """A factory and how it is called.  Picklable when the factory is (module level)."""

    factory: Factory
    name: str
    takes_io: bool
    takes_root: bool

    @classmethod
    def from_factory(cls, factory: Factory | str, name: str | None = None) -> Backend:
        fn = load_factory(factory) if isinstance(factory, str) else factory
        if not callable(fn):
            raise FactoryError(f"the factory {fn!r} is not callable")
        label = name or (factory if isinstance(factory, str) else factory_name(fn))
        takes_io = _binds(fn, 2)
        takes_root = _binds(fn, 1) or takes_io
        if not takes_root and not _binds(fn, 0):
            raise FactoryError(
                f"{label}: a factory is called as factory(root, io), factory(root) or "
                "factory(); this one accepts none of these")
        return cls(fn, label, takes_io, takes_root)

    def open(self, root: str, io: IO | None = None) -> Storage:
        """Open (and so recover) the queue kept in ``root``, through ``io`` if given."""
        if io is not None:
            if not self.takes_io:
                raise FactoryError(f"{self.name} takes no io argument; it cannot be "
                                   "opened through the I/O seam")
            store = self.factory(root, io)
        elif self.takes_root and _binds(self.factory, 1):
            store = self.factory(root)
        elif self.takes_io:
            store = self.factory(root, OsIO())
        else:
            store = self.factory()
        if not isinstance(store, Storage):
            raise FactoryError(f"{self.name} returned {type(store).__name__}, not a Storage")
        return store

    def opener(self, root: str) -> Callable[[], Storage]:
        """A zero-argument function that opens the queue in ``root``."""
        return lambda: self.open(root)

    def probe(self) -> Probe:
        """Open a throwaway queue once: its class and declared capabilities."""
        root = tempfile.mkdtemp(prefix="queue-ref-probe-")
        try:
            try:
                store = self.open(root)
            except FactoryError:
                raise
            except Exception as e:
                raise FactoryError(
                    f"{self.name} failed to open an empty queue: {type(e).__name__}: {e}"
                ) from e
            try:
                caps = frozenset(store.capabilities)
                kind = f"{type(store).__module__}.{type(store).__qualname__}"
                limits = store.limits
            finally:
                store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if Capability.IO_SEAM in caps and not self.takes_io:
            raise FactoryError(f"{self.name} declares io-seam but its factory takes no io "
                               "argument: give factory(root, io)")
        return Probe(kind, caps, limits)


@dataclass(frozen=True)
class Probe:
    storage_class: str
    capabilities: frozenset[Capability]
    #: what one message may hold (``Storage.limits``)
    limits: Limits = field(default_factory=Limits)

    def has(self, cap: Capability) -> bool:
        return cap in self.capabilities
