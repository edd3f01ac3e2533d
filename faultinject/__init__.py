"""Fault injection for the I/O seam: record calls, crash at any of them, build post-crash disks.

* ``FaultyIO`` (``seam``): the seam's twin; ``FaultPlan`` says where to crash or fail.
* ``PauseGate`` (``pause``): ``FaultyIO.pause_at(N)`` stops the caller of mutating call N,
  alive, until the gate is released (a competing caller runs meanwhile).
* ``TraceEvent``, ``trace_hash`` (``trace``): the record of a run.
* ``DiskImage``, ``snapshot``, ``materialize`` (``disk``): directory trees as values.
* ``MODELS``, ``crash_states``, ``crash_state``, ``CrashState`` (``models``): the disks a
  process kill or a power cut may leave, per persistence model.

This package imports only ``queue_ref.io`` of the project.
"""

from faultinject.disk import DiskImage, materialize, snapshot
from faultinject.fault_errors import Crash, ModelError
from faultinject.models import (
    MODELS,
    CrashState,
    PersistenceModel,
    crash_state,
    crash_states,
    get_model,
    is_exhaustive,
    pending_count,
)
from faultinject.pause import PauseGate
from faultinject.seam import FaultPlan, FaultyIO
from faultinject.trace import TraceEvent, trace_hash

__all__ = [
    "MODELS",
    "Crash",
    "CrashState",
    "DiskImage",
    "FaultPlan",
    "FaultyIO",
    "ModelError",
    "PauseGate",
    "PersistenceModel",
    "TraceEvent",
    "crash_state",
    "crash_states",
    "get_model",
    "is_exhaustive",
    "materialize",
    "pending_count",
    "snapshot",
    "trace_hash",
]
