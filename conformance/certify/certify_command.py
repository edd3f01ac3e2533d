"""``queue-ref certify``: certify a Storage backend without pytest.

    queue-ref certify package.module:factory [--model process-kill,weak,ext4-ordered]
        [--profile quick|thorough] [--seed N] [--out DIR] [--expected-failures FILE]
        [--only CHECK,...] [--jobs N] [--check-timeout SECONDS] [--json]
    queue-ref certify package.module:factory --scenario ID [--json]

Writes ``certificate.json``, ``report.md`` and ``report.html`` into ``--out`` (default
``out/certify/<backend>``).  Exit code: 0 certified, 1 not certified, 3 not certified
with known failures only (every failure is in the expected-failures file), 2 usage
errors (a factory that cannot be loaded or cannot open a queue included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time

from conformance.certify import certificate_report
from conformance.certify.certificate import Certificate, load_expectations
from conformance.certify.suite_runner import DEFAULT_MODELS, certify, known_models
from conformance.harness.backend_factory import Backend, FactoryError
from conformance.harness.check_catalog import BY_ID
from conformance.harness.check_results import CheckResult, Finding

#: Default deadline of one check with the quick profile (its checks take seconds to
#: minutes; the slowest, crash exploration, about 3 minutes on 2 cores).
QUICK_CHECK_TIMEOUT = 900.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "certify", help="run the conformance suite on a Storage backend",
        description="Run every conformance check on the backend a factory opens and write "
                    "its certificate (JSON, Markdown, HTML). Exit code 0 only when certified.")
    p.add_argument("factory", help="package.module:factory; factory(root, io) for backends "
                                   "with the I/O seam, factory(root) or factory() otherwise")
    p.add_argument("--model", default=",".join(DEFAULT_MODELS),
                   help="comma-separated crash models (default: %(default)s)")
    p.add_argument("--profile", choices=("quick", "thorough"), default="quick")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the whole run (default: random, printed)")
    p.add_argument("--out", default=None,
                   help="directory for certificate.json, report.md, report.html "
                        "(default: out/certify/<backend>)")
    p.add_argument("--expected-failures", default=None, metavar="FILE",
                   help="lines 'CLAUSE [MODEL] [# reason]'; listed failures lower the "
                        "result to 'not certified, known failures'")
    p.add_argument("--only", default=None,
                   help=f"comma-separated checks to run (of {', '.join(BY_ID)})")
    p.add_argument("--scenario", default=None,
                   help="replay one scenario id from a report instead of certifying")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="worker processes for crash exploration (default: %(default)s)")
    p.add_argument("--check-timeout", type=float, default=None, metavar="SECONDS",
                   help="a check (or the first opening of a queue) still running after "
                        "this long is a hang: reported as an ERROR with where it was "
                        "stuck, the report written, exit 1 (default: 900 with the quick "
                        "profile, none with the thorough one; 0: none)")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop after the first check that fails (the rest are not run)")
    p.add_argument("--json", action="store_true",
                   help="print the certificate as one JSON object on the last line")
    p.set_defaults(func=main)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "backend"


def _line(res: CheckResult) -> str:
    extra = f"  {len(res.findings)} finding(s)" if res.findings else ""
    note = f"  ({res.note.splitlines()[0]})" if res.note else ""
    return (f"  {res.check:18} {res.model:13} {res.status.value:12} "
            f"{res.seconds:7.2f} s{extra}{note}")


def _replay(args: argparse.Namespace) -> int:
    from conformance.certify.scenario_replay import replay

    try:
        backend = Backend.from_factory(args.factory)
        findings = replay(backend, args.scenario)
    except (FactoryError, ValueError) as e:
        print(f"queue-ref certify: {e}", file=sys.stderr)
        return 2
    for f in findings:
        print(_describe(f))
    if not findings:
        print(f"{args.scenario}: no violation this time")
    if args.json:
        print(json.dumps({"scenario": args.scenario,
                          "findings": [f.to_json() for f in findings]}))
    return 1 if findings else 0


def _describe(f: Finding) -> str:
    lines = [f"{f.clause} under {f.model}: {f.detail}  [{f.scenario}]"]
    lines += [f"    {s}" for s in f.steps]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.scenario:
        return _replay(args)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    bad = [m for m in models if m not in known_models()]
    if bad:
        print(f"queue-ref certify: unknown crash model(s) {', '.join(bad)}; known: "
              f"{', '.join(known_models())}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    try:
        expectations = load_expectations(args.expected_failures) \
            if args.expected_failures else []
    except (OSError, ValueError, KeyError) as e:
        print(f"queue-ref certify: cannot read expected failures: {e}", file=sys.stderr)
        return 2
    only = [c.strip() for c in args.only.split(",")] if args.only else None
    print(f"certifying {args.factory}: profile {args.profile}, models {', '.join(models)}, "
          f"seed {seed}", flush=True)
    t = time.perf_counter()
    out = args.out or f"out/certify/{_slug(args.factory)}"
    timeout = (args.check_timeout if args.check_timeout is not None
               else QUICK_CHECK_TIMEOUT if args.profile == "quick" else 0)

    def hung(cert: Certificate) -> None:
        _verdict(cert, certificate_report.write(cert, out), t, json_out=args.json)

    try:
        cert = certify(args.factory, models=models, profile=args.profile, seed=seed,
                       expectations=expectations, only=only, jobs=max(1, args.jobs),
                       fail_fast=args.fail_fast, check_timeout=timeout or None,
                       on_hang=hung, progress=lambda r: print(_line(r), flush=True))
    except (FactoryError, ValueError) as e:
        print(f"queue-ref certify: {e}", file=sys.stderr)
        return 2
    paths = certificate_report.write(cert, out)
    return _verdict(cert, paths, t, json_out=args.json)


def _verdict(cert: Certificate, paths: dict[str, str], t: float, *,
             json_out: bool = False) -> int:
    """Print the verdict and where the report is; the exit code."""
    status = cert.status()
    held = cert.certified_models()
    if status == "certified":
        what = f"CERTIFIED under {', '.join(held)}"
    else:
        what = status.upper() + (f" (every clause holds under {', '.join(held)} only)"
                                 if held else "")
    print(f"\n{what} ({time.perf_counter() - t:.1f} s)")
    for r in cert.reasons()[:20]:
        print(f"  - {r}")
    print(f"report: {paths['report.html']}  (also {paths['report.md']}, "
          f"{paths['certificate.json']})")
    if json_out:
        print(json.dumps(cert.to_json(), separators=(",", ":")))
    return cert.exit_code()
