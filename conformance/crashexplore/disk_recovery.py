"""Recovering rebuilt disks: open a backend on a crash state's disk and read it back.

* ``recover_image``: materialize a disk image in a fresh directory, open the backend there
  with a plain seam (``ScratchIO``; recovery runs) and read everything back
  (``recovered_queue.inspect``).  Cached per disk image: equal disks recover equally.
* ``recovery_trace``, ``recovery_crash_points``, ``recovery_crash_states``: rerun that
  recovery through ``FaultyIO``, crashing after one of its mutating calls, and rebuild the
  disks the crash may leave (a crash inside recovery, C10).

Every directory made here is removed before the function returns.
"""

from __future__ import annotations

from collections import OrderedDict

from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.recovered_queue import Recovered, inspect
from conformance.crashexplore.traced_runs import Limits, ScratchIO, scratch_dir
from faultinject.disk import DiskImage, materialize
from faultinject.fault_errors import Crash
from faultinject.models import CrashState, crash_states
from faultinject.seam import FaultPlan, FaultyIO
from faultinject.trace import TraceEvent, trace_hash

_CACHE_SIZE = 4096
_recovered: OrderedDict[tuple[str, DiskImage], Recovered] = OrderedDict()


def clear_cache() -> None:
    """Forget every cached recovery (for measurements from a cold start)."""
    _recovered.clear()


def _cached(key: tuple[str, DiskImage]) -> Recovered | None:
    got = _recovered.get(key)
    if got is not None:
        _recovered.move_to_end(key)
    return got


def recover_image(backend: BackendSpec, image: DiskImage) -> Recovered:
    """Open the backend on ``image`` (recovery runs), read everything, drain, measure."""
    key = (backend.name, image)
    got = _cached(key)
    if got is not None:
        return got
    with scratch_dir() as d:
        materialize(image, d)
        rec = inspect(lambda: backend.open(d, ScratchIO()))
    _recovered[key] = rec
    if len(_recovered) > _CACHE_SIZE:
        _recovered.popitem(last=False)
    return rec


def recovery_trace(backend: BackendSpec, image: DiskImage,
                   plan: FaultPlan | None = None) -> tuple[DiskImage, list[TraceEvent], bool]:
    """Open the backend on ``image`` through ``FaultyIO`` with ``plan``.

    Returns the disk before the open, the trace of the open (recovery included; the
    orderly close is not part of it) and whether it crashed.
    """
    with scratch_dir() as d:
        materialize(image, d)
        io = FaultyIO(d, plan, inner=ScratchIO())
        try:
            store = backend.open(d, io)
        except Crash:
            return io.initial, list(io.events), True
        except Exception:
            return io.initial, list(io.events), False
        events = list(io.events)
        store.close()
        return io.initial, events, False


def recovery_crash_points(backend: BackendSpec, image: DiskImage) -> int:
    """How many mutating calls opening (recovering) the queue on ``image`` makes."""
    _, events, _ = recovery_trace(backend, image)
    return sum(1 for e in events if e.mutating)


def recovery_crash_states(backend: BackendSpec, image: DiskImage, index: int, model: str,
                          limits: Limits) -> tuple[list[CrashState], str]:
    """Crash states of a recovery on ``image`` that dies after its mutating call ``index``.

    (Crashing before call ``index + 1`` leaves the same disks, so "after" covers both.)
    Returns the states and the trace hash of the crashed recovery.
    """
    initial, events, crashed = recovery_trace(
        backend, image, FaultPlan(crash_at=index, crash_when="after"))
    if not crashed:
        raise ValueError(f"recovery made fewer than {index + 1} mutating calls")
    states = crash_states(initial, events, model, exhaustive_limit=limits.exhaustive_limit,
                          random_states=limits.random_states, seed=limits.seed)
    return states, trace_hash(events)
