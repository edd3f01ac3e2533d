"""Crash campaign benchmark: one exploration three ways, and what Spark costs.

The same exploration (default: the filesystem queue, bound 3, weak model, the explorer's
defaults) runs through the single-process explorer, its multiprocess mode (``--jobs``,
default 2) and a Spark campaign in local mode (``local[JOBS]``), in one run; the last
two alternate for ``--rounds`` rounds and the best of each counts (the machine may be
shared).  Printed: states/s of each, Spark's time against the multiprocess mode's (``spark_overhead``:
Spark's seconds / the worker processes' seconds; 1.15 means 15% slower), the time to
start the session and to compute the report's totals with Spark SQL, and whether the
three gave the same states and violations.  The last line printed is one JSON object.

    python benchmarks/campaign.py [--backend fs] [--model weak] [--bound 3] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from conformance.campaign.campaign_plan import (
    CampaignConfig,
    CampaignError,
    code_version,
    open_campaign_dir,
)
from conformance.campaign.campaign_runner import run_campaign
from conformance.campaign.campaign_sql import totals
from conformance.campaign.spark_setup import spark_session
from conformance.crashexplore import disk_recovery
from conformance.crashexplore.exploration import ExploreConfig, explore


def explorer(backend: str, models: tuple[str, ...], bound: int, jobs: int
             ) -> dict[str, object]:
    disk_recovery.clear_cache()
    t0 = time.perf_counter()
    s = explore(ExploreConfig(backend=backend, models=models, bound=bound, jobs=jobs))
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 2), "workloads": s.workloads,
            "crash_points": s.crash_points, "states": s.states,
            "violating_states": s.violating, "states_per_second": round(s.states / dt, 1)}


def campaign(spark: object, backend: str, models: tuple[str, ...], bound: int
             ) -> dict[str, object]:
    disk_recovery.clear_cache()
    with tempfile.TemporaryDirectory(prefix="queue-ref-campaign-bench-") as d:
        out = Path(d) / "c"
        cfg = CampaignConfig(backends=(backend,), models=models, bound=bound,
                             code_version=code_version())
        open_campaign_dir(out, cfg)
        stats = run_campaign(spark, cfg, out)
        t1 = time.perf_counter()
        t = totals(spark, out)
        sql = time.perf_counter() - t1
    return {"seconds": round(stats.seconds, 2), "sql_totals_seconds": round(sql, 2),
            "partitions": stats.partitions, "workloads": t["workloads"],
            "crash_points": t["crash_points"], "states": t["states"],
            "violating_states": t["violating_states"],
            "states_per_second": round(float(t["states"]) / stats.seconds, 1)}


def best(runs: list[dict[str, object]]) -> dict[str, object]:
    """The fastest of the rounds, with every round's seconds."""
    top = dict(min(runs, key=lambda r: float(r["seconds"])))  # type: ignore[arg-type]
    top["rounds_seconds"] = [r["seconds"] for r in runs]
    return top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="fs")
    ap.add_argument("--model", default="weak", help="comma-separated models")
    ap.add_argument("--bound", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of --jobs and Spark, alternating (the best of each counts)")
    args = ap.parse_args()
    if args.bound < 0 or args.jobs < 1 or args.rounds < 1:
        print("error: --bound must be >= 0, --jobs and --rounds >= 1", file=sys.stderr)
        return 2
    models = tuple(args.model.split(","))
    try:
        CampaignConfig(backends=(args.backend,), models=models, bound=args.bound)
    except CampaignError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    one = explorer(args.backend, models, args.bound, 1)
    print(f"single process: {one['states']} states in {one['seconds']}s = "
          f"{one['states_per_second']} states/s", flush=True)
    t0 = time.perf_counter()
    session, _ = spark_session(f"local[{args.jobs}]", app="queue-ref campaign benchmark")
    started = round(time.perf_counter() - t0, 2)
    manys, sparks = [], []
    try:
        for r in range(args.rounds):  # alternating, so that both see the same machine
            manys.append(explorer(args.backend, models, args.bound, args.jobs))
            sparks.append(campaign(session, args.backend, models, args.bound))
            print(f"round {r + 1}: --jobs {args.jobs} {manys[-1]['seconds']}s, Spark "
                  f"local[{args.jobs}] {sparks[-1]['seconds']}s", flush=True)
    finally:
        session.stop()
    many, spark = best(manys), best(sparks)
    spark["session_start_seconds"] = started
    print(f"--jobs {args.jobs}: {many['states']} states in {many['seconds']}s = "
          f"{many['states_per_second']} states/s (best of {args.rounds})")
    print(f"Spark local[{args.jobs}]: {spark['states']} states in {spark['seconds']}s = "
          f"{spark['states_per_second']} states/s (best of {args.rounds}; session start "
          f"{started}s, SQL totals {spark['sql_totals_seconds']}s)", flush=True)
    overhead = float(spark["seconds"]) / float(many["seconds"])  # type: ignore[arg-type]
    same = (one["states"] == many["states"] == spark["states"]
            and one["violating_states"] == many["violating_states"]
            == spark["violating_states"])
    print(f"Spark overhead against --jobs {args.jobs}: {overhead:.2f}x; same answers: {same}")
    print(json.dumps({"backend": args.backend, "models": list(models), "bound": args.bound,
                      "jobs": args.jobs, "rounds": args.rounds, "single_process": one, "multiprocess": many,
                      "spark_local": spark, "spark_overhead": round(overhead, 3),
                      "same_answers": same}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
