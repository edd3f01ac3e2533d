"""Crash exploration benchmark: how fast crash states are checked, and the full pass.

Figures, in one run:

* ``states_per_second``: crash states built and judged per second, one process, cold
  caches, bound 2 under the weak model with no recovery crashes and no EIO;
  ``distinct_states_per_second`` counts only distinct disks (each materialized, opened,
  recovered, read back and drained once; equal disks share that work);
* ``bound3_weak_seconds``: wall time of the exhaustive bound-3 exploration of the
  filesystem queue under the weak model with the explorer's defaults (crashes inside
  recovery for a sample of states, EIO in every fsync of the last call), with ``--jobs``
  worker processes; with its counts of crash points, states and distinct states.

The last line printed is one JSON object with every figure.

    python benchmarks/crash_explore.py [--backend fs] [--jobs N] [--bound 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from conformance.crashexplore import disk_recovery
from conformance.crashexplore.exploration import ExploreConfig, explore


def states_per_second(backend: str) -> dict[str, float]:
    disk_recovery.clear_cache()
    t0 = time.perf_counter()
    s = explore(ExploreConfig(backend=backend, models=("weak",), bound=2, recovery=False,
                              eio=False))
    dt = time.perf_counter() - t0
    return {"states": s.states, "distinct_states": s.distinct_states,
            "crash_points": s.crash_points, "seconds": round(dt, 2),
            "states_per_second": round(s.states / dt, 1),
            "distinct_states_per_second": round(s.distinct_states / dt, 1),
            "crash_points_per_second": round(s.crash_points / dt, 1)}


def full_pass(backend: str, bound: int, jobs: int) -> dict[str, object]:
    disk_recovery.clear_cache()
    t0 = time.perf_counter()
    s = explore(ExploreConfig(backend=backend, models=("weak",), bound=bound, jobs=jobs))
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 1), "workloads": s.workloads, "crash_points": s.crash_points,
            "eio_points": s.eio_points, "states": s.states,
            "distinct_states": s.distinct_states, "violations": s.violations,
            "states_per_second": round(s.states / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="fs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bound", type=int, default=3)
    args = ap.parse_args()
    fast = states_per_second(args.backend)
    print(f"one process, bound 2, weak, no recovery crashes: {fast['states']} states in "
          f"{fast['seconds']}s = {fast['states_per_second']} states/s, "
          f"{fast['distinct_states_per_second']} distinct states/s, "
          f"{fast['crash_points_per_second']} crash points/s")
    full = full_pass(args.backend, args.bound, args.jobs)
    print(f"exhaustive bound {args.bound} under weak, {args.jobs} jobs: {full['seconds']}s, "
          f"{full['crash_points']} crash points, {full['states']} states "
          f"({full['distinct_states']} distinct), violations {full['violations'] or 'none'}")
    print(json.dumps({"backend": args.backend, "jobs": args.jobs, "bound": args.bound,
                      "states_per_second": fast["states_per_second"],
                      "distinct_states_per_second": fast["distinct_states_per_second"],
                      "crash_points_per_second": fast["crash_points_per_second"],
                      "bound2_weak": fast, f"bound{args.bound}_weak_seconds": full["seconds"],
                      f"bound{args.bound}_weak": full}, sort_keys=True))


if __name__ == "__main__":
    main()
