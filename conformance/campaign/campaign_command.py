"""``queue-ref campaign``: crash exploration as Spark jobs, its results as Parquet.

    queue-ref campaign run --backend fs[,kv,...] --model all --bound 4 --out DIR
                           [--after-life N] [--random N --seed S --length L]
                           [--master local[*]|spark://HOST:PORT] [--json]
    queue-ref campaign report DIR [--html FILE] [--json]
    queue-ref campaign diff A B [--json]

``run`` resumes a campaign directory that holds the same parameters (finished partitions
are not run again) and exits 1 if any state violates the contract; ``diff`` exits 1 if
B has violations A has not.  They need the campaign extra
(``pip install 'queue-ref[campaign]'``) and Java 17; without it they say so and exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.campaign.campaign_plan import (
    CampaignConfig,
    CampaignError,
    code_version,
    open_campaign_dir,
)
from conformance.campaign.spark_setup import missing_extra
from conformance.crashexplore.backend_registry import UnknownBackendError
from faultinject.models import MODELS
from spec.crash import CLAUSES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("campaign", help="crash exploration on Spark, results as "
                                               "Parquet (run, report, diff)",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="campaign_command", required=True, metavar="SUBCOMMAND")

    r = sub.add_parser("run", help="run (or resume) a campaign into a directory")
    r.add_argument("--backend", default="fs",
                   help="comma-separated backends: fs, fs-fsync, kv, any name of 'queue-ref "
                        "crash backends', or package.module:factory")
    r.add_argument("--model", default="all", help=f"{', '.join(MODELS)}, or 'all'")
    r.add_argument("--bound", type=int, default=3, help="longest exhaustive workload")
    r.add_argument("--after-life", type=int, default=-1, metavar="BOUND",
                   help="also the workloads of up to BOUND operations after one message's "
                        "whole life (see 'crash explore --help')")
    r.add_argument("--random", type=int, default=0, metavar="N", help="also N random workloads")
    r.add_argument("--length", type=int, default=12, help="calls per random workload")
    r.add_argument("--seed", type=int, default=0, help="seed of the first random workload")
    r.add_argument("--exhaustive-limit", type=int, default=10,
                   help="pending operations up to which every crash state is built (beyond: "
                        "a random sample; each row says which)")
    r.add_argument("--random-states", type=int, default=8,
                   help="random states per crash point beyond the exhaustive limit")
    r.add_argument("--no-recovery", action="store_true", help="do not crash inside recovery")
    r.add_argument("--recovery-sample", type=int, default=3, metavar="K",
                   help="states per crash point whose recovery is crashed (0: all)")
    r.add_argument("--no-eio", action="store_true", help="do not inject EIO into fsyncs")
    r.add_argument("--split", type=int, default=4,
                   help="shards per task that crashes inside several calls (default 4)")
    r.add_argument("--per-partition", type=int, default=2,
                   help="units per partition, one Spark job each (default 2)")
    r.add_argument("--out", required=True, type=Path, help="the campaign directory")
    r.add_argument("--master", default=None,
                   help="Spark master (default local[*], or spark-submit's; "
                        "spark://HOST:PORT for a cluster)")
    r.add_argument("--ui", action="store_true", help="start Spark's web UI")
    r.add_argument("--json", action="store_true", help="print one JSON object last")
    r.set_defaults(func=cmd_run)

    rep = sub.add_parser("report", help="summaries (Spark SQL), an HTML page, JSON totals")
    rep.add_argument("dir", type=Path, help="a campaign directory")
    rep.add_argument("--html", type=Path, default=None,
                     help="where to write the page (default DIR/report.html)")
    rep.add_argument("--master", default=None, help="Spark master (default local[*])")
    rep.add_argument("--json", action="store_true", help="print one JSON object last")
    rep.set_defaults(func=cmd_report)

    d = sub.add_parser("diff", help="new and fixed violations, state counts per model")
    d.add_argument("a", type=Path, help="the campaign directory to compare against")
    d.add_argument("b", type=Path, help="the newer campaign directory")
    d.add_argument("--master", default=None, help="Spark master (default local[*])")
    d.add_argument("--json", action="store_true", help="print one JSON object last")
    d.set_defaults(func=cmd_diff)


def _fail(msg: str) -> int:
    Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(msg)}",
                                                soft_wrap=True)
    return 2


def _config(args: argparse.Namespace) -> CampaignConfig:
    models = tuple(MODELS) if args.model == "all" else tuple(
        m.strip() for m in args.model.split(",") if m.strip())
    return CampaignConfig(
        backends=tuple(b.strip() for b in args.backend.split(",") if b.strip()),
        models=models, bound=args.bound, after_life=args.after_life, random=args.random,
        random_length=args.length, seed=args.seed, exhaustive_limit=args.exhaustive_limit,
        random_states=args.random_states, recovery=not args.no_recovery,
        recovery_sample=args.recovery_sample, eio=not args.no_eio, split=args.split,
        per_partition=args.per_partition, code_version=code_version())


def _session(master: str | None, ui: bool = False) -> tuple[Any, bool]:
    from conformance.campaign.spark_setup import spark_session
    return spark_session(master, ui=ui)


def cmd_run(args: argparse.Namespace) -> int:
    hint = missing_extra()
    if hint:
        return _fail(hint)
    try:
        cfg = _config(args)
        resumed = open_campaign_dir(args.out, cfg)
    except (CampaignError, UnknownBackendError, ValueError) as e:
        return _fail(str(e))
    from conformance.campaign.campaign_runner import run_campaign
    from conformance.campaign.campaign_sql import totals

    try:
        spark, mine = _session(args.master, args.ui)
    except Exception as e:  # no Java, a master that does not answer
        return _fail(f"cannot start Spark on {args.master or 'local[*]'}: "
                     f"{str(e).splitlines()[0]}")
    err = Console(stderr=True, highlight=False)
    try:
        stats = run_campaign(spark, cfg, args.out, console=err)
        if stats.interrupted or stats.failed:
            for f in stats.failed[:5]:
                err.print(f"[red]partition failed:[/red] {f}", soft_wrap=True)
            err.print(f"{stats.skipped + stats.ran} of {stats.partitions} partitions done; "
                      f"run the same command again to resume")
            return 130 if stats.interrupted else 2
        summary = totals(spark, args.out)
    finally:
        if mine:
            spark.stop()
    out = Console(width=max(Console().width, 100), highlight=False)
    out.print(f"campaign {args.out}: {stats.partitions} partitions"
              + (f" ({stats.skipped} finished before, resumed)" if resumed else "")
              + f", {stats.ran} run now in {stats.seconds:.1f}s")
    _print_totals(out, summary)
    if args.json:
        print(json.dumps({**summary, "partitions": stats.partitions,
                          "partitions_resumed": stats.skipped, "partitions_run": stats.ran,
                          "wall_seconds": round(stats.seconds, 2)}, sort_keys=True))
    return 1 if summary["violating_states"] else 0


def _print_totals(out: Console, s: dict[str, Any]) -> None:
    t = Table("model", "points", "states", "in recovery", "after EIO", "distinct", "sampled",
              "violations", min_width=90)
    for m, st in s["by_model"].items():
        bad = ", ".join(f"{k}: {n}" for k, n in st["violations"].items()) or "none"
        t.add_row(m, str(st["crash_points"]), str(st["states"]), str(st["recovery_states"]),
                  str(st["eio_states"]), str(st["distinct_states"]),
                  str(st["sampled_points"]), bad)
    out.print(t)
    out.print(f"workloads {s['workloads']}, crash points {s['crash_points']} "
              f"({s['rest_points']} at rest; + {s['eio_points']} fsyncs failed with EIO), "
              f"states {s['states']}, distinct {s['distinct_states']}, executor time "
              f"{s['seconds']:.1f}s")
    if s["violating_states"]:
        out.print(f"[red]{s['violating_states']} violating states[/red]: " + ", ".join(
            f"{k} ({CLAUSES.get(k, '?')}) {n}" for k, n in s["violations"].items()))
    else:
        out.print("[green]no violations[/green]")


def cmd_report(args: argparse.Namespace) -> int:
    hint = missing_extra()
    if hint:
        return _fail(hint)
    from conformance.campaign.campaign_report_html import render
    from conformance.campaign.campaign_sql import summary

    try:
        spark, mine = _session(args.master)
    except Exception as e:
        return _fail(f"cannot start Spark: {str(e).splitlines()[0]}")
    try:
        s = summary(spark, args.dir)
    except CampaignError as e:
        return _fail(str(e))
    finally:
        if mine:
            spark.stop()
    page = args.html or args.dir / "report.html"
    page.write_text(render(s))
    (args.dir / "summary.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
    out = Console(width=max(Console().width, 100), highlight=False)
    _print_totals(out, s)
    first: dict[str, dict[str, Any]] = {}
    for v in s["violation_list"]:
        for c in v["clauses"]:
            first.setdefault(c, v)
    for c, v in sorted(first.items()):
        out.print(f"  {c}: {v['reproduce']}", soft_wrap=True)
    out.print(f"report: {page}")
    if args.json:
        keep = {k: v for k, v in s.items() if k != "violation_list"}
        keep["violation_list"] = s["violation_list"][:1000]
        keep["report"] = str(page)
        print(json.dumps(keep, sort_keys=True, default=str))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    hint = missing_extra()
    if hint:
        return _fail(hint)
    from conformance.campaign.campaign_sql import diff

    try:
        spark, mine = _session(args.master)
    except Exception as e:
        return _fail(f"cannot start Spark: {str(e).splitlines()[0]}")
    try:
        d = diff(spark, args.a, args.b)
    except CampaignError as e:
        return _fail(str(e))
    finally:
        if mine:
            spark.stop()
    out = Console(width=max(Console().width, 100), highlight=False)
    out.print(f"A {d['a']} ({d['code_version']['a']}, {', '.join(d['backends']['a'])})")
    out.print(f"B {d['b']} ({d['code_version']['b']}, {', '.join(d['backends']['b'])})")
    t = Table("model", "states A", "states B", "delta", "points A", "points B",
              "violating A", "violating B")
    for m, row in d["by_model"].items():
        t.add_row(m, str(row["states"]["a"]), str(row["states"]["b"]),
                  f"{row['states']['delta']:+d}", str(row["crash_points"]["a"]),
                  str(row["crash_points"]["b"]), str(row["violating_states"]["a"]),
                  str(row["violating_states"]["b"]))
    out.print(t)
    for label, key in (("new", "new"), ("fixed", "fixed")):
        rows = d[key]
        out.print(f"{len(rows)} {label} violations")
        for v in rows[:20]:
            out.print(f"  {v['clause']} {v['model']}: {v['reproduce']}", soft_wrap=True)
    if args.json:
        print(json.dumps(d, sort_keys=True))
    return 1 if d["new"] else 0
