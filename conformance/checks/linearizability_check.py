"""Check ``linearizable``: concurrent callers on one entry keep the model (C7 and around it).

Rounds: a small queue (two messages of two recipients, and what the callers enqueue) is
worked on at once by several threads sharing one Storage and, when the backend declares
``Capability.MULTI_PROCESS``, by child processes with Storages of their own.  Each caller
does a few random operations (``conformance.concurrency.history_workers``) through the
handles it holds, so they collide on the same entries; then each gives back what it
holds (reading its claims back first), and the queue is drained: ``list_domain`` of
every domain committed to (with ``Capability.DOMAIN_INDEX``; the setup's domains are
listed before the callers start too), then every entry left claimed, read back and
sent.  The whole recorded history must be linearizable against
``spec``'s model (``conformance.concurrency.linearizability``: an exhaustive
Wing-Gong/Lowe search per entry, bounded; a search that hits its bound makes the check
an ERROR, never a pass), every schedule handed back being the model's with its reason
(C5), every listing listing what the model holds (API); nothing may be left once
everything is cleaned up (C8), and what a read gives back must be what was committed
(the sender, the recipient and the body, byte for byte: C6).

The data is mail's (``conformance.harness.mail_data``): the first message of every
round is the corpus (a decomposed UTF-8 sender, an upper-case local part, the Angstrom
sign, a domain with a trailing dot, a schedule past 2038, reasons with CRLF, a body of
dot lines, bare CR and LF and a final CRLF), the rest is drawn from the round's seed.

Targeted races (backends with ``Capability.IO_SEAM``): ``conformance.concurrency.paused_races``
stops one caller before each mutating call of its transition and runs a competing call.

Scenario ids, replayed with ``queue-ref certify FACTORY --scenario ID``:

* ``linearizable:<profile>:<seed>:<round>``: the round's callers with the same plans
  (same seeds, so the same choices); the interleaving is the machine's, so the replay
  runs the round up to ``REPLAY_TRIES`` times and reports the first failing history;
* ``linearizable:race:<race>:<k>``: the race with A stopped at the same call, which is
  deterministic.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conformance.concurrency.history_workers import (
    Mail,
    Worker,
    WorkerPlan,
    drain,
    worker_process,
)
from conformance.concurrency.linearizability import Recorded, Verdict, check_history
from conformance.concurrency.paused_races import BY_NAME, RaceRun, run_all, run_race
from conformance.crashexplore.traced_runs import scratch_base
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.child_process import Child
from conformance.harness.mail_data import (
    CORPUS_BODY,
    CORPUS_RCPTS,
    CORPUS_SCHEDULES,
    CORPUS_SENDER,
    fit_address,
)
from conformance.harness.suite_profiles import QUICK, Profile
from conformance.harness.suite_profiles import get as get_profile
from queue_ref.storage import Capability

CHECK = "linearizable"
#: How often a replay runs a round again to see its failure once more.
REPLAY_TRIES = 10


def _plan_seed(seed: int, rnd: int, worker: str) -> int:
    return zlib.crc32(f"{seed}:{rnd}:{worker}".encode())


def _collect(child: Child, tag: str, into: list[dict[str, Any]]) -> dict[str, Any]:
    for msg in child.messages():
        if "crashed" in msg:
            raise RuntimeError(f"a worker process failed: {msg['crashed']}\n{msg.get('trace', '')}")
        into.append(msg)
        if tag in msg:
            return msg
    raise RuntimeError(f"a worker process ended before it sent {tag!r}")


def _ops(msgs: list[dict[str, Any]]) -> list[Recorded]:
    return [Recorded.from_json(d) for m in msgs for d in m.get("ops", ())]


@contextmanager
def _workers(backend: Backend, n: int) -> Iterator[list[Child]]:
    children = [Child(worker_process, backend) for _ in range(n)]
    try:
        yield children
    finally:
        for c in children:
            c.tell("stop")
        for c in children:
            c.close()


def _domains(history: list[Recorded]) -> list[str]:
    """The domains of every recipient committed in ``history``, as committed."""
    return sorted({r.rpartition("@")[2] for rec in history if rec.call == "enqueue"
                   for r in rec.rcpts})


def run_round(backend: Backend, hold: bool, seed: int, rnd: int, threads: int, ops: int,
              children: list[Child], domains: bool = False
              ) -> tuple[list[Recorded], list[tuple[str, str]]]:
    """One round; its history and the problems seen outside the model.  ``domains``: the
    backend declares ``Capability.DOMAIN_INDEX``."""
    root = tempfile.mkdtemp(prefix="queue-ref-linearizable-", dir=scratch_base())
    store = backend.open(root)
    errors: list[BaseException] = []
    try:
        setup = Worker(store, WorkerPlan("setup", _plan_seed(seed, rnd, "setup"), 0, hold))
        limit = store.limits.max_address
        corpus = Mail(fit_address(CORPUS_SENDER, limit),
                      tuple(fit_address(r, limit) for r in CORPUS_RCPTS), CORPUS_BODY)
        # the corpus (mail's data the draws may miss) read back before the race: a store
        # that keeps it otherwise than committed is found on every seed
        setup.read_back(setup.enqueue(2, CORPUS_SCHEDULES, corpus))
        setup.enqueue(2, [setup.draw_schedule(), setup.draw_schedule()])
        if domains:  # before anyone moves them: each domain lists its entries
            for d in _domains(setup.history):
                setup.listing("list_domain", d)
        for k, c in enumerate(children):  # one at a time: opening is no race of this check
            plan = WorkerPlan(f"p{k}", _plan_seed(seed, rnd, f"p{k}"), ops, hold, domains)
            c.tell(json.dumps({"root": root, "plan": plan.to_json()}))
            _collect(c, "ready", [])
        workers = [Worker(store, WorkerPlan(f"t{k}", _plan_seed(seed, rnd, f"t{k}"), ops,
                                            hold, domains))
                   for k in range(threads)]
        line = threading.Barrier(threads + 1)

        def go(w: Worker) -> None:
            try:
                line.wait()
                w.run()
            except BaseException as e:
                errors.append(e)

        running = [threading.Thread(target=go, args=(w,), daemon=True) for w in workers]
        for t in running:
            t.start()
        for c in children:
            c.tell("go")
        line.wait()
        for t in running:
            t.join(120)
            if t.is_alive():
                raise RuntimeError("a worker thread still runs after 120 s (deadlock)")
        if errors:
            raise errors[0]
        got: list[dict[str, Any]] = []
        for c in children:
            _collect(c, "ran", got)
        history = setup.history + [r for w in workers for r in w.history] + _ops(got)
        for w in workers:
            history += w.finish()
        problems = setup.problems + [p for w in workers for p in w.problems]
        for c in children:
            c.tell("finish")
            msgs: list[dict[str, Any]] = []
            _collect(c, "closed", msgs)
            history += _ops(msgs)
            problems += [(cl, d) for m in msgs for cl, d in m.get("problems", ())]
        left = drain(store, hold, _domains(history))
        history += left.history
        problems += left.problems
        fp = store.footprint()
        if fp.objects or fp.bytes:
            problems.append(("C8", f"after every caller finished and the queue was drained, "
                                   f"{fp.objects} objects, {fp.bytes} bytes remain"))
        return history, problems
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _errors_of(history: list[Recorded]) -> list[tuple[str, str]]:
    return [("C9", f"{r.call} by {r.worker} raised {r.error} (no fault was injected)")
            for r in history if r.outcome == "error"]


def _judge_round(history: list[Recorded], problems: list[tuple[str, str]], verdict: Verdict,
                 scenario: str) -> list[Finding]:
    out = [Finding(c, d, scenario, NO_CRASH) for c, d in problems + _errors_of(history)]
    if verdict.linearizable is False:
        what = ("a read gave back other data than committed" if verdict.clause == "C6"
                else "the history is not linearizable")
        out.append(Finding(verdict.clause, f"{what}: {verdict.detail}", scenario, NO_CRASH,
                           verdict.lines))
    return out


def _judge_race(run: RaceRun) -> list[Finding]:
    where = f"{run.race.name}, A stopped before its call {run.k}"
    where += f" ({run.paused_call})" if run.reached else " (A made fewer calls)"
    out = [Finding(c, f"{where}: {d}", run.scenario, NO_CRASH)
           for c, d in run.problems + _errors_of(run.history)]
    if run.verdict.linearizable is False:
        out.append(Finding(run.verdict.clause, f"{where}: {run.verdict.detail}", run.scenario,
                           NO_CRASH, run.verdict.lines))
    return out


def run(backend: Backend, profile: Profile, seed: int,
        capabilities: frozenset[Capability]) -> CheckResult:
    start = time.perf_counter()
    hold = Capability.HOLD in capabilities
    domains = Capability.DOMAIN_INDEX in capabilities
    procs = profile.linearizable_processes if Capability.MULTI_PROCESS in capabilities else 0
    findings: list[Finding] = []
    unknown: list[str] = []
    stats: dict[str, Any] = {"rounds": 0, "threads": profile.linearizable_threads,
                             "processes": procs, "histories": 0, "calls": 0,
                             "largest_history": 0, "contended_calls": 0,
                             "search_steps": 0, "largest_search": 0,
                             "races": 0, "race_runs": 0, "race_calls_paused": 0}
    with _workers(backend, procs) as children:
        for rnd in range(profile.linearizable_rounds):
            history, problems = run_round(backend, hold, seed, rnd,
                                          profile.linearizable_threads,
                                          profile.linearizable_ops, children, domains)
            verdict = check_history(history, profile.linearizable_bound)
            stats["rounds"] += 1
            stats["histories"] += 1
            stats["calls"] += len(history)
            stats["largest_history"] = max(stats["largest_history"], len(history))
            stats["contended_calls"] += verdict.contended
            stats["search_steps"] += verdict.steps
            stats["largest_search"] = max(stats["largest_search"], verdict.steps)
            if verdict.linearizable is None:
                unknown.append(f"{CHECK}:{profile.name}:{seed}:{rnd}: {verdict.detail}")
            findings += _judge_round(history, problems, verdict,
                                     f"{CHECK}:{profile.name}:{seed}:{rnd}")
    if Capability.IO_SEAM in capabilities:
        runs = run_all(backend, hold, profile.linearizable_bound,
                       multi=Capability.MULTI_PROCESS in capabilities)
        stats["races"] = len({r.race.name for r in runs})
        stats["race_runs"] = len(runs)
        stats["race_calls_paused"] = sum(r.reached for r in runs)
        for r in runs:
            stats["histories"] += 1
            stats["calls"] += len(r.history)
            stats["contended_calls"] += r.verdict.contended
            stats["search_steps"] += r.verdict.steps
            stats["largest_search"] = max(stats["largest_search"], r.verdict.steps)
            if r.verdict.linearizable is None:
                unknown.append(f"{r.scenario}: {r.verdict.detail}")
            findings += _judge_race(r)
    seconds = time.perf_counter() - start
    if unknown and not findings:
        return CheckResult(CHECK, NO_CRASH, Status.ERROR, seconds=seconds, seed=seed,
                           stats=stats, note="the linearizability search hit its bound, so "
                           "the history is neither passed nor failed: " + "; ".join(unknown[:3]))
    return finished(CHECK, NO_CRASH, findings, seconds=seconds, seed=seed, stats=stats)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of ``scenario`` run again (empty: it did not fail this time)."""
    parts = scenario.split(":")
    if len(parts) == 4 and parts[1] == "race":
        race = BY_NAME.get(parts[2])
        if race is None or not parts[3].isdigit():
            raise ValueError(f"{scenario!r}: expected {CHECK}:race:<race>:<call>, races: "
                             f"{', '.join(BY_NAME)}")
        return _judge_race(run_race(backend, race, int(parts[3]), QUICK.linearizable_bound))
    if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
        raise ValueError(f"{scenario!r}: expected {CHECK}:<profile>:<seed>:<round> or "
                         f"{CHECK}:race:<race>:<call>")
    prof = get_profile(parts[1])
    seed, rnd = int(parts[2]), int(parts[3])
    caps = backend.probe().capabilities
    hold = Capability.HOLD in caps
    procs = prof.linearizable_processes if Capability.MULTI_PROCESS in caps else 0
    with _workers(backend, procs) as children:
        for _ in range(REPLAY_TRIES):
            history, problems = run_round(backend, hold, seed, rnd, prof.linearizable_threads,
                                          prof.linearizable_ops, children,
                                          Capability.DOMAIN_INDEX in caps)
            found = _judge_round(history, problems,
                                 check_history(history, prof.linearizable_bound), scenario)
            if found:
                return found
    return []
