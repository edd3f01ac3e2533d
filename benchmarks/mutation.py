"""How strong is the certifier?  Mutation testing of the backends with cosmic-ray.

    python benchmarks/mutation.py [--backend fs|kv|relay|all] [--sample N] [--seed S]
                                  [--timeout SECONDS] [--work DIR] [--resume]

For each backend, cosmic-ray (``pip install -e '.[mutation]'``) makes every mutant of its
storage code (``queue_ref/fsqueue/`` for the filesystem queue; ``queue_ref/kv/`` with the log
engine for the KV queue), a random sample of ``--sample`` of them is kept (the rest are
marked skipped in cosmic-ray's session), and each is judged by the test command the issue
names: the quick certification of that backend (``queue-ref certify --profile quick
--fail-fast``; the KV queue is certified on its log engine, then on LevelDB).  A mutant
that makes the certificate fail, crash or hang (``--timeout``) is killed; one certified
anyway survived.

``--backend relay`` mutates the relay and the operator commands (``queue_ref/relay/``,
``queue_ref/operate/``; the demo left out) and judges each mutant by their tests
(``RELAY_TESTS``: every relay, operator, RFC 5321 and relay crash-exploration test, with
real servers on loopback), stopping at the first failure.  Run it on an otherwise idle
machine: a test that fails from load counts as a kill.

cosmic-ray changes the source files in place, so it works on a copy of the repository
under ``--work`` (default ``out/mutation``), with that copy first on ``PYTHONPATH``.  The
session is a SQLite file there: ``--resume`` continues an interrupted run.  Mutants inside
type annotations are set aside before sampling and counted as equivalent: every mutated
module has ``from __future__ import annotations``, so an annotation is never evaluated.  Survivors are
written with their diffs to ``<work>/<backend>/survivors.md`` for a person to tell
equivalent mutants (same behaviour, nothing to catch) from real gaps.  The last line is one
JSON object: killed, survived and incompetent per backend, and the kill rate.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Storage code of each backend: the files cosmic-ray mutates (relative to the repository).
#: Repair-only modules (the filesystem rebuild, the KV salvage) are not exercised by
#: certification and are left out; their own tests cover them.
MODULES: dict[str, list[str]] = {
    "fs": ["queue_ref/fsqueue"],
    "kv": ["queue_ref/kv"],
    "relay": ["queue_ref/relay", "queue_ref/operate"],
}
EXCLUDED: dict[str, list[str]] = {
    "fs": ["queue_ref/fsqueue/rebuild.py", "queue_ref/fsqueue/__init__.py"],
    "kv": ["queue_ref/kv/salvage.py", "queue_ref/kv/__init__.py",
           "queue_ref/kv/logengine/__init__.py"],
    "relay": ["queue_ref/relay/__init__.py", "queue_ref/operate/__init__.py",
              "queue_ref/relay/relay_demo.py"],
}
#: The tests that judge a relay mutant (globs relative to the repository).
RELAY_TESTS = ["tests/test_relay_*.py", "tests/test_operate_*.py", "tests/test_rfc5321_*.py"]
#: Certified factories, in the order they are tried (the first failure kills the mutant).
FACTORIES: dict[str, list[str]] = {
    # both sync modes: fsync is the default where syncfs(2) cannot report errors, and
    # its code (a commit's own fsyncs, no pipelined rounds) is not run by the other
    "fs": ["conformance.examples.backends:fs", "conformance.examples.backends:fs_fsync"],
    "kv": ["conformance.examples.backends:kv_log", "conformance.examples.backends:kv_leveldb"],
}


def copy_repo(dest: Path) -> None:
    """The repository's tracked and unignored files, copied to ``dest`` (fresh)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if src.is_file():
            target = dest / os.fsdecode(f)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


#: Files a factory never runs: a mutant there cannot be killed by that factory's
#: certification, so it is not run for it (the log engine is not LevelDB's, and back).
UNREACHED: dict[str, list[str]] = {
    "conformance.examples.backends:kv_log": ["queue_ref/kv/leveldb.py"],
    "conformance.examples.backends:kv_leveldb": ["queue_ref/kv/logengine/*"],
}


#: A check of a mutant still running after this long is a hang (a killed mutant): the
#: certifier says so itself (``--check-timeout``), long before cosmic-ray's timeout.
CHECK_TIMEOUT = 300.0


def kill_script(backend: str, src: Path, seed: int) -> Path:
    """The test command: certify each factory of ``backend``, stopping at the first failure
    (for the relay: its tests, stopping at the first failure).  The mutated file is found
    by comparing the sources with a pristine copy, taken here (before any mutant is
    applied)."""
    pristine = src.parent / "pristine"
    if pristine.exists():
        shutil.rmtree(pristine)
    for m in MODULES[backend]:
        shutil.copytree(src / m, pristine / m, ignore=shutil.ignore_patterns("__pycache__"))
    script = src / f"mutation-kill-{backend}.sh"
    lines = ["#!/bin/sh", "set -e", f'cd "{src}"', f'export PYTHONPATH="{src}"',
             f'mkdir -p "{src}/out"']
    if backend == "relay":
        # A failure counts only if the failing test fails again alone: a test that failed
        # from load passes then, and the mutant counts as survived (the score is not
        # inflated by flakes; a mutant whose effect is itself a race may be undercounted).
        pytest = f'"{sys.executable}" -m pytest -q -p no:cacheprovider -p no:randomly'
        log = f'"{src}/out/pytest.log"'
        lines += [f'tests=$(ls {" ".join(RELAY_TESTS)} 2>/dev/null || true)',
                  f'{pytest} -x -n 2 --timeout 300 $tests >{log} 2>&1 && exit 0',
                  f"failed=$(sed -n 's/^FAILED \\([^ ]*\\).*/\\1/p' {log} | head -n 1)",
                  f'if [ -z "$failed" ]; then tail -n 25 {log}; exit 1; fi',
                  f'{pytest} --timeout 300 "$failed" >{log}.again 2>&1 && '
                  f'{{ echo "flaky, not counted: $failed"; exit 0; }}',
                  f'tail -n 25 {log}.again; exit 1']
        script.write_text("\n".join(lines) + "\n")
        script.chmod(0o755)
        return script
    lines.append(f'changed=$(diff -rq --exclude=__pycache__ "{pristine}/queue_ref" queue_ref '
                 "| sed -n 's/^Files .* and \\(.*\\) differ$/\\1/p')")
    for factory in FACTORIES.get(backend, []):
        run = (f'"{sys.executable}" -m conformance.cli certify {factory} --profile quick '
               f'--fail-fast --jobs 1 --seed {seed} --check-timeout {CHECK_TIMEOUT:g} '
               f'--out "{src}/out/cert" >"{src}/out/certify.log" 2>&1 '
               # the verdict's last lines go to cosmic-ray's record of the mutant: which
               # check killed it, and whether by a timeout (worth a rerun if the machine
               # was busy)
               f'|| {{ tail -n 25 "{src}/out/certify.log"; exit 1; }}')
        skip = UNREACHED.get(factory)
        if skip:
            lines.append(f'case "$changed" in {"|".join(skip)}) ;; *) {run} ;; esac')
        else:
            lines.append(run)
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def write_config(backend: str, src: Path, script: Path, timeout: float) -> Path:
    cfg = src / f"mutation-{backend}.toml"
    excluded = ", ".join(json.dumps(e) for e in EXCLUDED[backend])
    modules = ", ".join(json.dumps(m) for m in MODULES[backend])
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{modules}]\n"
        f"timeout = {timeout}\n"
        f"excluded-modules = [{excluded}]\n"
        f'test-command = "{script}"\n'
        "[cosmic-ray.distributor]\n"
        'name = "local"\n')
    return cfg


def cosmic(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=cwd, check=True)


#: Output recorded for a mutant that lies inside a type annotation.  Every mutated module has
#: ``from __future__ import annotations``, so annotations are strings that never run: such a
#: mutant (``X | None`` made ``X - None``) is equivalent by construction.
ANNOTATION = "equivalent: inside a type annotation, which is never evaluated"


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation in the module at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body):
        return []
    spans: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for node in ast.walk(tree):
        notes: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
        elif isinstance(node, (ast.arg, ast.AnnAssign)):
            notes.append(node.annotation)
        for n in notes:
            if n is not None and n.end_lineno is not None and n.end_col_offset is not None:
                spans.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)))
    return spans


def mark_annotation_mutants(session: Path, src: Path) -> int:
    """Mark the session's mutants that lie inside annotations as skipped (equivalent)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import MutationSpec, WorkerOutcome, WorkResult

    spans: dict[Path, list[tuple[tuple[int, int], tuple[int, int]]]] = {}

    def within(m: MutationSpec) -> bool:
        path = src / m.module_path
        if path not in spans:
            spans[path] = annotation_spans(path)
        start, end = tuple(m.start_pos), tuple(m.end_pos)
        return any(a <= start and end <= b for a, b in spans[path])

    inside: list[str] = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            if item.mutations and all(within(m) for m in item.mutations):
                inside.append(item.job_id)
        if inside:
            db.set_multiple_results(inside, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                       output=ANNOTATION))
    return len(inside)


def sample(session: Path, n: int, seed: int) -> tuple[int, int]:
    """Keep ``n`` random mutants of the session; mark the others skipped.  (total, kept)"""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session), WorkDB.Mode.open) as db:
        ids = sorted(item.job_id for item in db.pending_work_items)
        keep = set(random.Random(seed).sample(ids, min(n, len(ids))))
        skip = [i for i in ids if i not in keep]
        if skip:
            db.set_multiple_results(skip, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                     output="not in the sample"))
        return len(ids), len(keep)


def summarize(backend: str, session: Path, out: Path) -> dict[str, object]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "survived": 0, "incompetent": 0, "pending": 0,
              "annotation_equivalent": 0}
    by_op: dict[str, dict[str, int]] = {}
    survivors: list[str] = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        done = {job_id: res for job_id, res in db.results}
        for item in db.work_items:
            res = done.get(item.job_id)
            if res is not None and res.worker_outcome == WorkerOutcome.SKIPPED:
                if res.output == ANNOTATION:
                    counts["annotation_equivalent"] += 1
                continue
            if res is None:
                counts["pending"] += 1
                continue
            if res.worker_outcome != WorkerOutcome.NORMAL or res.test_outcome is None:
                verdict = "incompetent"
            elif res.test_outcome == TestOutcome.SURVIVED:
                verdict = "survived"
            elif res.test_outcome == TestOutcome.INCOMPETENT:
                verdict = "incompetent"
            else:
                verdict = "killed"
            counts[verdict] += 1
            for m in item.mutations:
                op = by_op.setdefault(m.operator_name.split("/")[-1],
                                      {"killed": 0, "survived": 0, "incompetent": 0})
                op[verdict] += 1
                if verdict == "survived":
                    survivors.append(
                        f"## {item.job_id}: {m.module_path}:{m.start_pos[0]} "
                        f"({m.operator_name})\n\n```diff\n{res.diff or ''}\n```\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "survivors.md").write_text(
        f"# Surviving mutants of the {backend} backend\n\n" + "\n".join(survivors))
    judged = counts["killed"] + counts["survived"]
    return {**counts, "kill_rate": round(counts["killed"] / judged, 4) if judged else None,
            "by_operator": by_op}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("fs", "kv", "relay", "all"), default="all",
                    help="all: fs and kv (relay is run on its own)")
    ap.add_argument("--sample", type=int, default=150, help="mutants per backend")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--work", default=str(ROOT / "out" / "mutation"))
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        print("mutation.py: cosmic-ray is not installed: pip install -e '.[mutation]'",
              file=sys.stderr)
        return 2
    backends = ["fs", "kv"] if args.backend == "all" else [args.backend]
    work = Path(args.work).resolve()
    result: dict[str, object] = {"seed": args.seed, "sample": args.sample}
    t0 = time.monotonic()
    for backend in backends:
        here = work / backend
        src = here / "src"
        session = here / "session.sqlite"
        if not (args.resume and session.exists()):
            copy_repo(src)
            script = kill_script(backend, src, args.seed)
            cfg = write_config(backend, src, script, args.timeout)
            session.unlink(missing_ok=True)
            cosmic("init", str(cfg), str(session), cwd=src)
            annotations = mark_annotation_mutants(session, src)
            total, kept = sample(session, args.sample, args.seed)
            print(f"{backend}: {total + annotations} mutants, {annotations} inside annotations "
                  f"(equivalent), {kept} of the other {total} sampled", flush=True)
        cfg = src / f"mutation-{backend}.toml"
        started = time.monotonic()
        cosmic("exec", str(cfg), str(session), cwd=src)
        summary = summarize(backend, session, here)
        summary["seconds"] = round(time.monotonic() - started, 1)
        result[backend] = summary
        print(f"{backend}: killed {summary['killed']}, survived {summary['survived']}, "
              f"incompetent {summary['incompetent']}, kill rate {summary['kill_rate']} "
              f"(survivors: {here / 'survivors.md'})", flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
