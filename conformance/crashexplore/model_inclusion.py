"""Crash models consistent with each other: every disk a weaker crash can leave is one a
harsher model produces too (``harness.check_catalog.INCLUDES``: process-kill within
ext4-ordered within weak).

The certificate relies on it: a backend that fails under process-kill is never certified
under weak.  ``inclusion_violations`` checks it on one trace prefix (where the including
model's states are enumerated exhaustively); ``workload_inclusion`` on every crash point
of a workload (before and after each mutating call, and at rest after each call).
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.traced_runs import OPEN, run_workload
from conformance.crashexplore.workloads import Workload
from conformance.harness.check_catalog import INCLUDES
from faultinject.disk import DiskImage
from faultinject.models import MODELS, crash_states, is_exhaustive
from faultinject.seam import FaultPlan
from faultinject.trace import TraceEvent

EXHAUSTIVE_LIMIT = 10


def inclusion_violations(initial: DiskImage, events: Sequence[TraceEvent],
                         limit: int = EXHAUSTIVE_LIMIT) -> list[str]:
    """States of an included model that the including model does not produce."""
    out = []
    for col, included in INCLUDES.items():
        if col not in MODELS or not is_exhaustive(initial, events, col,
                                                  exhaustive_limit=limit):
            continue
        allowed = {s.image for s in crash_states(initial, events, col, exhaustive_limit=limit,
                                                 random_states=0)}
        for inc in included:
            if inc not in MODELS:
                continue
            for s in crash_states(initial, events, inc, exhaustive_limit=limit,
                                  random_states=0):
                if s.image not in allowed:
                    out.append(f"a {inc} crash state ({s.key}: {s.description}) is not "
                               f"among the {len(allowed)} {col} states")
    return out


def workload_inclusion(backend: BackendSpec, workload: Workload, *, whole: bool = False,
                       limit: int = EXHAUSTIVE_LIMIT) -> tuple[int, list[str]]:
    """(crash points checked, violations) over the crash points inside the last call of
    ``workload`` (every call and the opening with ``whole``) and at rest after each."""
    ref = run_workload(backend, workload)
    first = OPEN if whole or not workload else len(workload) - 1
    start = 0 if first == OPEN else ref.op_starts[first]
    end = ref.op_ends[-1] if ref.op_ends else ref.open_end
    points = 0
    out: list[str] = []
    for m in range(start, end):
        for when in ("before", "after"):
            run = run_workload(backend, workload, FaultPlan(crash_at=m, crash_when=when))
            if not run.crashed:
                continue
            points += 1
            out += [f"crash {when} #{m}: {v}"
                    for v in inclusion_violations(run.initial, run.events, limit)]
    for n in range(0 if first == OPEN else first + 1, ref.returned() + 1):
        points += 1
        out += [f"at rest after {n} calls: {v}"
                for v in inclusion_violations(ref.initial, ref.events[:ref.rest_cut(n)], limit)]
    return points, out
