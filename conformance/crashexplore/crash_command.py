"""``queue-ref crash``: explore crash states of a backend, reproduce one by its id.

    queue-ref crash explore --backend fs --model weak --bound 3 [--random N --seed S]
                            [--json] [-j JOBS]
    queue-ref crash relay --backend fs --model all [--scenario mixed,utf8] [--every N]
                          [--variant NAME] [--json]
    queue-ref crash reproduce ID [--json]
    queue-ref crash backends

``relay`` crashes the relay's receiver commits and delivery round at every storage call
and judges each recovered state after the relay ran again
(``conformance/crashexplore/relay_crash.py``).  ``explore`` and ``relay`` exit 1 if any
state violates the contract; ``reproduce`` exits 1 if the
scenario violates it (2 if the id cannot be rebuilt).  With ``--json`` the last line of
the output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.crashexplore.backend_registry import REGISTRY, UnknownBackendError, available
from conformance.crashexplore.crash_scenario import ScenarioError
from conformance.crashexplore.exploration import ExploreConfig, Summary, explore, plan
from conformance.crashexplore.reproduction import reproduce
from conformance.crashexplore.traced_runs import Limits
from faultinject.models import MODELS
from spec.crash import CLAUSES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("crash", help="crash exploration of a backend",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="crash_command", required=True, metavar="SUBCOMMAND")

    e = sub.add_parser("explore", help="crash a backend at every mutating call of short "
                                       "workloads and at rest after them, and judge every "
                                       "recovered state")
    _target(e, "weak")
    e.add_argument("--bound", type=int, default=3,
                   help="longest exhaustive workload, in operations (default 3)")
    e.add_argument("--after-life", type=int, default=-1, metavar="BOUND",
                   help="also every workload of up to BOUND operations that follows one "
                        "message's whole life (enqueue, send_start, send_done, cleanup): "
                        "what a backend keeps of a finished message, such as the "
                        "filesystem queue's spare files, is then in use (default: none)")
    e.add_argument("--random", type=int, default=0, metavar="N",
                   help="also N random workloads")
    e.add_argument("--length", type=int, default=12, help="calls per random workload")
    e.add_argument("--seed", type=int, default=0, help="seed of the first random workload")
    e.add_argument("-j", "--jobs", type=int, default=1, help="worker processes")
    e.add_argument("--no-recovery", action="store_true",
                   help="do not crash inside recovery")
    e.add_argument("--recovery-sample", type=int, default=3, metavar="K",
                   help="states per crash point whose recovery is crashed (0: all)")
    e.add_argument("--no-eio", action="store_true", help="do not inject EIO into fsyncs")
    _states(e, 10, 8)
    e.set_defaults(func=cmd_explore)

    rl = sub.add_parser("relay", help="crash the relay's commits and finishing steps at every "
                                      "storage call; run the relay again on each recovered "
                                      "state and judge it by the relay contract")
    _target(rl, "all")
    rl.add_argument("--scenario", default="all",
                    help="relay scenarios, comma-separated, or 'all' (default)")
    rl.add_argument("--every", type=int, default=1, metavar="N",
                    help="crash only every N-th crash point (default 1: all)")
    rl.add_argument("--variant", default="",
                    help="a broken scheduler the exploration must catch, by name")
    _states(rl, 6, 4)
    rl.set_defaults(func=cmd_relay)

    r = sub.add_parser("reproduce", help="rebuild one crash state from its scenario id")
    r.add_argument("scenario", help="a scenario id, as printed by explore")
    r.add_argument("--json", action="store_true", help="print one JSON object last")
    r.set_defaults(func=cmd_reproduce)

    b = sub.add_parser("backends", help="list the backends crash exploration can drive")
    b.set_defaults(func=cmd_backends)


def _target(p: argparse.ArgumentParser, model: str) -> None:
    p.add_argument("--backend", default="fs",
                   help="registered name (see 'crash backends') or package.module:factory")
    p.add_argument("--model", default=model,
                   help=f"persistence model: {', '.join(MODELS)}, or 'all' (default {model})")


def _states(p: argparse.ArgumentParser, exhaustive: int, random_states: int) -> None:
    p.add_argument("--exhaustive-limit", type=int, default=exhaustive,
                   help="pending operations up to which every combination is built")
    p.add_argument("--random-states", type=int, default=random_states,
                   help="random states per crash point beyond that limit")
    p.add_argument("--json", action="store_true", help="print one JSON object last")


def _config(args: argparse.Namespace) -> ExploreConfig:
    models = tuple(MODELS) if args.model == "all" else tuple(
        m.strip() for m in args.model.split(","))
    return ExploreConfig(
        backend=args.backend, models=models, bound=args.bound,
        after_life=args.after_life, random=args.random,
        random_length=args.length, seed=args.seed, jobs=args.jobs,
        limits=Limits(args.exhaustive_limit, args.random_states, 0),
        recovery=not args.no_recovery, recovery_sample=args.recovery_sample,
        eio=not args.no_eio)


def cmd_explore(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        cfg = _config(args)
    except (ValueError, UnknownBackendError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    tasks = plan(cfg)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[states]} states"),
                        TextColumn("[red]{task.fields[bad]}"), TimeElapsedColumn(),
                        console=err, transient=False)
    with progress:
        bar = progress.add_task(f"{cfg.backend} {'+'.join(cfg.models)}", total=len(tasks),
                                states=0, bad="")
        count = {"states": 0, "bad": 0}

        def tick(r: Any) -> None:
            count["states"] += sum(s.states + s.recovery_states + s.eio_states
                                   for m, s in r.per_model.items() if m != "none")
            count["states"] += sum(1 for f in r.failures if f.case.kind != "rest")
            count["bad"] += len(r.failures)
            progress.update(bar, advance=1, states=count["states"],
                            bad=f"{count['bad']} violating" if count["bad"] else "")

        summary = explore(cfg, progress=tick, tasks=tasks)
    _print_summary(Console(width=max(Console().width, 100)), summary)
    if args.json:
        print(json.dumps(summary.to_json(), sort_keys=True))
    return 1 if summary.failures else 0


def _print_summary(out: Console, s: Summary) -> None:
    c = s.config
    out.print(f"[bold]crash exploration of {c.backend}[/bold]: bound {c.bound}"
              + (f", bound {c.after_life} after a whole life" if c.after_life >= 0 else "")
              + (f", {c.random} random workloads of {c.random_length} calls from seed {c.seed}"
                 if c.random else ""))
    t = Table("model", "points", "states", "in recovery", "after EIO", "distinct",
              "violations", min_width=90)
    for m, st in s.per_model.items():
        if m == "none":
            continue
        bad = ", ".join(f"{k}: {n}" for k, n in sorted(st.violations.items())) or "none"
        t.add_row(m, str(st.points), str(st.states), str(st.recovery_states),
                  str(st.eio_states), str(len(st.images)), bad)
    out.print(t)
    out.print(f"workloads {s.workloads}, crash points {s.crash_points} ({s.rest_points} at "
              f"rest, between calls; + {s.eio_points} fsyncs failed with EIO), states "
              f"explored {s.states}, distinct states {s.distinct_states}, "
              f"time {s.seconds:.1f}s")
    rest = s.per_model.get("none")
    if rest is not None and rest.violations:
        out.print(f"[red]without any crash:[/red] {rest.violations}")
    if not s.failures:
        out.print("[green]no violations[/green]")
    else:
        out.print(f"[red]{len(s.failures)} violating states[/red]: "
                  + ", ".join(f"{k} ({CLAUSES.get(k, '?')}) {n}"
                              for k, n in s.violations.items()))
        for clause, f in s.minimal().items():
            out.print(f"  {clause}: queue-ref crash reproduce {f.scenario}")
            out.print(f"      {next(d for c, d in f.violations if c == clause)}")
    for e in s.errors[:10]:
        out.print(f"[yellow]error:[/yellow] {e}")


def cmd_relay(args: argparse.Namespace) -> int:
    from conformance.crashexplore import relay_crash

    err = Console(stderr=True)
    models = tuple(MODELS) if args.model == "all" else tuple(
        m.strip() for m in args.model.split(","))
    scenarios = tuple(relay_crash.SCENARIOS) if args.scenario == "all" else tuple(
        x.strip() for x in args.scenario.split(","))
    if args.every < 1:
        err.print("[red]error:[/red] --every must be at least 1")
        return 2
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                        transient=False)
    try:
        with progress:
            bar = progress.add_task(f"relay on {args.backend}", total=None)

            def tick(done: int, total: int) -> None:
                progress.update(bar, completed=done, total=total)

            res = relay_crash.explore_relay(
                args.backend, scenarios, models, exhaustive_limit=args.exhaustive_limit,
                random_states=args.random_states, every=args.every, variant=args.variant,
                progress=tick)
    except (ValueError, UnknownBackendError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    out = Console(width=max(Console().width, 100))
    out.print(f"[bold]relay crash exploration on {res.backend}[/bold]"
              + (f" (broken scheduler {res.variant})" if res.variant else "")
              + f": scenarios {', '.join(res.scenarios)}; {res.points} crash points, "
              f"{res.states} states ({', '.join(f'{m} {n}' for m, n in res.per_model.items())})"
              f", {res.seconds:.1f}s")
    if not res.findings:
        out.print("[green]no violations of the relay contract[/green]")
    else:
        kinds: dict[str, int] = {}
        for f in res.findings:
            for k, _ in f.violations:
                kinds[k] = kinds.get(k, 0) + 1
        out.print(f"[red]{len(res.findings)} violating states[/red]: "
                  + ", ".join(f"{k} ({relay_crash.KINDS[k]}) {n}" for k, n in kinds.items()))
        for f in res.findings[:5]:
            out.print(f"  queue-ref crash reproduce '{f.scenario}'")
            out.print(f"      {f.violations[0][0]}: {f.violations[0][1]}")
    if args.json:
        print(json.dumps(res.to_json(), sort_keys=True))
    return 1 if res.findings else 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from conformance.crashexplore import relay_crash

    relay = relay_crash.is_relay_scenario(args.scenario)
    unreadable = (ValueError if relay else ScenarioError, UnknownBackendError)
    rep: Any
    try:
        rep = relay_crash.reproduce_relay(args.scenario) if relay else reproduce(args.scenario)
    except unreadable as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        return 2
    for line in rep.lines():
        print(line)
    if args.json:
        print(json.dumps(rep.to_json(), sort_keys=True))
    if relay:
        return 1 if rep.violations else 0
    if rep.outcome.error:
        return 2
    return 0 if rep.ok else 1


def cmd_backends(args: argparse.Namespace) -> int:
    names = available()
    for name in sorted(REGISTRY):
        mark = "" if name in names else "  (not importable here)"
        print(f"{name:28} {REGISTRY[name].description}{mark}")
    return 0

