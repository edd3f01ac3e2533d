"""Another process at the lifecycle edges (``Capability.MULTI_PROCESS``).

One child process, the *actor*, opens the queue and runs one operation; it is stopped in
the middle of it.  While it stands still a second child, the *observer*, opens the same
queue (its recovery runs), lists it, calls ``find_inflight`` and tries ``send_start`` on
every entry it sees.  Then the actor is let go and finishes (an observer that waits for
it, asleep with no CPU used, is held by ``SIGSTOP`` until the actor's operation returned:
who goes next is then not a race, and a replay sees what the run saw); the observer sends what it
claimed (``send_done``, and ``cleanup`` of every other one); both close, and the queue is
reopened and read back (``crashexplore.recovered_queue.inspect``).

Where the actor stops:

* through the I/O seam (``Capability.IO_SEAM``): at every *stop point* of the operation,
  before its first mutating call and after each one (``harness.stop_gate_io``): the
  thorough profile runs stop points 0, 1, 2, ... until the operation finishes without
  reaching one, the quick profile point 0 and a sample of the others (``edges_stops``;
  the quick profile tries one target per operation, drawn from the seed, but both for
  ``enqueue``);
* any other backend: ``SIGSTOP`` after a random delay within the operation's measured
  duration (as process-kill kills it), ``SIGCONT`` after.

Operations: ``open`` (after a killed owner left an inflight entry, a pending cleanup and
an uncommitted enqueue: two processes recover at once), ``enqueue`` (open, body, commit),
``send_start``, ``send_done``, ``send_cancel``, ``reschedule``, ``drop``, ``cleanup``, and
with ``Capability.HOLD`` ``hold`` and ``release``, each on an entry of a one-recipient and
of a two-recipient message; once the actor has opened the queue, another owner starts
an enqueue beside it and goes away without committing it (so the observer's recovery,
beside the live actor, has a dead owner's message file to remove, and must take nothing
the actor's operation made: a commit's hard links before its rename).  Besides its
target the actor holds one more entry INFLIGHT all along (a live owner's claim nobody
else may take).

Judged against ``spec``'s model: the actor's operation and the observer's calls must be
linearizable (the operation takes effect at one point among the observer's calls: what
the observer listed and claimed, and what the operation returned, agree with the model
in that order); the observer lists no entry a live owner holds INFLIGHT (C4), adopts none
with ``find_inflight`` and claims nothing the actor also moved (C7), sees all or nothing
of an enqueue in progress (C2); nothing fails, since no fault is injected; after
reopening the queue is exactly the model's (nothing committed lost: C1/C4, nothing
finished back: C3, nothing quarantined or altered: C6, no leak: C8).

The queue holds mail's data (``lifecycle_edges_actors.PREFIX``: UTF-8, upper-case and
quoted addresses, the null sender, trailing-dot domains, schedules from 0 to the largest
with reasons, bodies with and without a final CRLF), and every field read back is
compared with what was committed, byte for byte: the schedule (its reason too) of every
handle listed, claimed or returned by the operation (C5); the sender, recipient, index,
``meta.body_size`` and body of every entry the observer claimed or delivered (C6), and
``meta.schedule`` against its handle's (C5); the reopened queue's entries likewise.

Scenario ids: ``lifecycle-edges:<op>:<target>:<stop>`` (``<stop>`` a stop point, or
``sig<microseconds>`` for a SIGSTOP delay); ``queue-ref certify FACTORY --scenario ID``
runs that trial again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from conformance.checks.lifecycle_edges_actors import (
    BYSTANDER,
    CHECK,
    HOLD_OPS,
    OPS,
    PREFIX,
    TARGET_KEY,
    TARGETS,
    actor,
    observer,
)
from conformance.checks.lifecycle_edges_judge import Run, Trial, judge_trial
from conformance.crashexplore.recovered_queue import inspect
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Child, sleep_precise
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import Capability, Recipient
from spec.states import Op

#: How long the observer must sit asleep, using no CPU, while the actor stands still before
#: the parent takes it to be waiting (for a lock the actor holds) and lets the actor go.
OBSERVE_WAIT = 0.4
#: Longest the parent lets a busy observer work before it lets the actor go anyway.
OBSERVE_BUSY = 20.0
#: How many times ``replay`` runs a trial that finds nothing before it reports nothing.
REPLAY_TRIES = 5
#: Longest a child may take to answer once it can (a hang is reported, not waited out).
ANSWER_TIMEOUT = 60.0


# ---- the parent ----------------------------------------------------------------------

def _poll(child: Child, timeout: float) -> dict[str, Any] | None:
    """The child's next message, or None if none comes within ``timeout``.  A child that
    ended says so: ``{"exited": status}``."""
    if b"\n" not in child._buf:
        ready, _, _ = select.select([child._fd], [], [], timeout)
        if not ready:
            return None
    got = next(child.messages(ANSWER_TIMEOUT), None)
    return got if got is not None else {"exited": child.wait()}


def _cpu(pid: int) -> tuple[bytes, int] | None:
    """The process's scheduler state and CPU ticks so far, or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _until_quiet(child: Child) -> dict[str, Any] | None:
    """The child's answer, or None once it waits: asleep with no CPU tick gained for
    ``OBSERVE_WAIT`` (or busy past ``OBSERVE_BUSY``).  A slow child on a loaded machine,
    runnable or still burning CPU, is waited for, so that whether a trial's observer
    "waited" does not depend on the load (a replay sees what the run saw)."""
    start = time.monotonic()
    last, quiet_since = _cpu(child.pid), start
    while True:
        seen = _poll(child, OBSERVE_WAIT / 8)
        if seen is not None:
            return seen
        now = time.monotonic()
        if now - start > OBSERVE_BUSY:
            return None
        cur = _cpu(child.pid)
        if cur is None:  # no /proc: a plain wait is all there is
            if now - start >= OBSERVE_WAIT:
                return None
            continue
        if cur[0] in (b"R", b"D") or last is None or cur[1] != last[1]:
            quiet_since = now
        elif now - quiet_since >= OBSERVE_WAIT:
            return None
        last = cur


class Hang(Exception):
    """A child did not answer in time (``who``: the actor or the observer)."""

    def __init__(self, who: str, message: str) -> None:
        super().__init__(message)
        self.who = who


def _answer(child: Child, what: str, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    got = _poll(child, timeout)
    if got is None:
        raise Hang(what, f"the {what} did not answer within {timeout:.0f} s")
    return _checked(got, what)


def _checked(got: dict[str, Any], what: str) -> dict[str, Any]:
    if "crashed" in got:
        raise RuntimeError(f"the {what} failed: {got['crashed']}\n{got.get('trace', '')}")
    if "exited" in got:
        raise RuntimeError(f"the {what} exited (status {got['exited']}) without a word")
    return got


@dataclass
class TrialOutcome:
    findings: list[tuple[str, str]] = field(default_factory=list)
    stopped: bool = False  # the actor was stopped inside the operation
    calls: int = 0  # mutating calls the operation made (seam)
    seconds: float = 0.0  # how long the operation took (unstopped)
    blocked: bool = False  # the observer waited for the actor
    steps: list[str] = field(default_factory=list)


class Bench:
    """The two children (started once, reused by every trial) and where trials run."""

    def __init__(self, backend: Backend, seam: bool) -> None:
        self.backend = backend
        self.seam = seam
        self.base = tempfile.mkdtemp(prefix="queue-ref-edges-")
        self.actor: Child | None = None
        self.observer: Child | None = None
        self.count = 0

    def children(self) -> tuple[Child, Child]:
        if self.actor is None:
            self.actor = Child(actor, self.backend, self.seam)
        if self.observer is None:
            self.observer = Child(observer, self.backend)
        return self.actor, self.observer

    def reset(self) -> None:
        """Kill both children (after a hang or a failure); fresh ones start next time."""
        for c in (self.actor, self.observer):
            if c is not None:
                c.close()
        self.actor = self.observer = None

    def close(self) -> None:
        for c in (self.actor, self.observer):
            if c is not None:
                c.tell(json.dumps({"cmd": "quit"}))
                _reap(c)
        self.actor = self.observer = None
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reap(c: Child) -> None:
    """Wait (a little) for a child told to quit, then make sure it is gone."""
    with contextlib.suppress(Exception):
        for _ in c.messages(10.0):
            pass
    c.close()


def _prefix(backend: Backend, root: str) -> Run:
    run_ = Run()
    store = backend.open(root)
    try:
        for sender, rcpts, body in PREFIX:
            with store.enqueue(sender) as enq:
                enq.write(body)
                got = enq.commit([Recipient(r, s) for r, s in rcpts])
            run_.model, m = run_.model.enqueue(sender, body, list(rcpts))
            run_.msgids[got[0].message_id] = m
            for i, g in enumerate(got):
                run_.keys[g.entry_id] = (m, i)
    finally:
        store.close()
    return run_


def run_trial(bench: Bench, trial: Trial) -> TrialOutcome:
    """One trial: prefix, actor stopped, observer, release, finish, reopen, judge."""
    bench.count += 1
    root = os.path.join(bench.base, f"q{bench.count}")
    os.mkdir(root)
    out = TrialOutcome()
    try:
        _run_trial(bench, trial, root, out)
    except Hang as e:
        # an open (recovery) that never ends is C10; an operation that never returns, API
        clause = "C10" if e.who == "observer" or trial.op == "open" else "API"
        out.findings.append((clause, f"{e} ({_where(out)})"))
        bench.reset()
    except Exception:
        bench.reset()
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _where(out: TrialOutcome) -> str:
    return "; ".join(out.steps) if out.steps else "before the operation"


def _run_trial(bench: Bench, trial: Trial, root: str, out: TrialOutcome) -> None:
    actor, observer = bench.children()
    run_ = _prefix(bench.backend, root)
    op, target = trial.op, trial.target
    if op == "open":
        actor.tell(json.dumps({"cmd": "leave", "root": root,
                               "inflight": run_.ident(BYSTANDER),
                               "pending": run_.ident(TARGET_KEY[target])}))
        left = _answer(actor, "actor")["left"]
        if not all(left):
            raise RuntimeError("the owner that goes away could not claim its entries")
        run_.apply(Op.SEND_START, BYSTANDER)
        run_.apply(Op.SEND_START, TARGET_KEY[target])
        run_.apply(Op.SEND_DONE, TARGET_KEY[target])
    else:
        run_.apply(Op.SEND_START, BYSTANDER)
        key = TARGET_KEY[target]
        if op in ("send_done", "send_cancel", "cleanup"):
            run_.apply(Op.SEND_START, key)
        if op == "cleanup":
            run_.apply(Op.SEND_DONE, key)
        if op == "release":
            run_.apply(Op.HOLD, key)
    actor.tell(json.dumps({"cmd": "run", "root": root, "op": op, "target": target,
                           "stop": trial.stop, "entry": run_.ident(TARGET_KEY[target]),
                           "bystander": run_.ident(BYSTANDER)}))
    first = _stop_actor(bench, actor, trial, out)
    seen: dict[str, Any] | None = None
    result: dict[str, Any] | None = first if "result" in first else None
    if out.stopped:
        observer.tell(json.dumps({"cmd": "observe", "root": root}))
        seen = _until_quiet(observer)
        out.blocked = seen is None
        out.steps.append(f"{op} stopped {first.get('where', '')}".rstrip())
        if seen is None:
            # the observer waits (for the actor): the actor goes on first, alone, so that
            # who takes the queue next is not a race a replay could lose
            os.kill(observer.pid, signal.SIGSTOP)
            _wait_stopped(observer.pid)
            _release(bench, actor, trial)
            if result is None:
                early = _until_quiet(actor)  # None: the actor waits for the observer
                result = None if early is None else _checked(early, "actor")
            os.kill(observer.pid, signal.SIGCONT)
            seen = _answer(observer, "observer")
        else:
            _release(bench, actor, trial)
        if "crashed" in seen or "exited" in seen:
            raise RuntimeError(f"the observer failed: {seen}")
        if result is None:
            result = _answer(actor, "actor")
    assert result is not None
    out.seconds = result.get("seconds", 0.0)
    out.calls = result.get("calls", 0)
    child_claims: dict[str, Any] | None = None
    if op == "open" and "error" not in result["result"]:
        actor.tell("claim")
        child_claims = _answer(actor, "actor")
    if not out.stopped:
        actor.tell("close")
        _answer(actor, "actor")
        return
    observer.tell("finish")
    done = _answer(observer, "observer")
    actor.tell("close")
    _answer(actor, "actor")
    observer.tell("close")
    _answer(observer, "observer")
    out.steps.append(f"the observer's open ({'waited' if out.blocked else 'at once'}): "
                     f"listed {len(seen.get('listed', []))}, claimed "
                     f"{len(seen.get('claimed', {}))}, adopted {len(seen.get('adopted', {}))}")
    out.steps.append(f"{op} returned {json.dumps(result['result'])}")
    rec = inspect(bench.backend.opener(root))
    out.findings.extend(judge_trial(run_, trial, seen, result["result"], child_claims,
                                    done, rec, snapshot=not out.blocked))


def _stop_actor(bench: Bench, actor: Child, trial: Trial, out: TrialOutcome) -> dict[str, Any]:
    """Wait until the actor stands still inside its operation (or finished it)."""
    first = _answer(actor, "actor")
    if bench.seam:
        if "stopped" in first:
            out.stopped = True
            first["where"] = f"{first['when']} {first['call']} (stop point {first['stopped']})"
        return first
    if "starting" not in first:
        return first  # it failed before the operation
    if trial.delay < 0:  # not stopped: only its duration is wanted
        return _answer(actor, "actor")
    sleep_precise(trial.delay)
    os.kill(actor.pid, signal.SIGSTOP)
    _wait_stopped(actor.pid)
    out.stopped = True
    first["where"] = f"by SIGSTOP {trial.delay * 1e6:.0f} us in"
    early = _poll(actor, 0.0)  # it may have finished before the signal
    return early if early is not None else first


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Wait until the kernel shows ``pid`` stopped (a system call under way when SIGSTOP
    came finishes first), so that nothing of it happens while the observer looks."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen = _cpu(pid)
        if seen is None or seen[0] in (b"T", b"t"):
            return  # stopped (or no /proc here: the signal is all there is)
        time.sleep(0.0005)


def _release(bench: Bench, actor: Child, trial: Trial) -> None:
    if bench.seam:
        actor.tell("release")
    else:
        os.kill(actor.pid, signal.SIGCONT)


# ---- the check -------------------------------------------------------------------------

def _ops(caps: frozenset[Capability]) -> list[str]:
    return [o for o in OPS if o not in HOLD_OPS or Capability.HOLD in caps]


def _trials(bench: Bench, ops: list[str], targets: list[str], profile: Profile,
            rng: random.Random) -> Iterator[tuple[Trial, TrialOutcome]]:
    """Every stop point of every operation (seam; the quick profile samples them), or
    random SIGSTOP delays (other backends)."""
    for op in ops:
        # an enqueue of two recipients makes the most steps before its commit point (the
        # filesystem queue's hard links before its rename): both targets, always
        for target in TARGETS if op == "enqueue" else targets:
            if bench.seam:
                points: Iterable[int] = itertools.count()
                if profile.edges_stops is not None:
                    # learn how many stop points there are (0..calls), then sample them
                    probe = run_trial(bench, Trial(op, target, 1 << 30))
                    rest = list(range(1, probe.calls + 1))
                    rng.shuffle(rest)
                    points = [0, *sorted(rest[:max(0, profile.edges_stops - 1)])]
                for stop in points:
                    trial = Trial(op, target, stop)
                    out = run_trial(bench, trial)
                    yield trial, out
                    if not out.stopped or stop > 10_000:
                        break  # past the last stop point
            else:
                probe = run_trial(bench, Trial(op, target, None, -1.0))
                span = max(probe.seconds, 0.0005) * 1.2
                for _ in range(profile.edges_signal_trials):
                    trial = Trial(op, target, None, rng.uniform(0.0, span))
                    yield trial, run_trial(bench, trial)


def run(backend: Backend, profile: Profile, seed: int,
        caps: frozenset[Capability] | None = None) -> CheckResult:
    start = time.perf_counter()
    if caps is None:
        caps = backend.probe().capabilities
    seam = backend.takes_io and Capability.IO_SEAM in caps
    rng = random.Random(seed)
    findings: list[Finding] = []
    stats: dict[str, Any] = {"trials": 0, "stopped": 0, "observer_waited": 0,
                             "mode": "stop points" if seam else "SIGSTOP"}
    targets = list(TARGETS) if profile.edges_all_targets else [rng.choice(TARGETS)]
    with Bench(backend, seam) as bench:
        for trial, out in _trials(bench, _ops(caps), targets, profile, rng):
            stats["trials"] += 1
            stats["stopped"] += out.stopped
            stats["observer_waited"] += out.blocked
            for clause, detail in out.findings:
                findings.append(Finding(clause, detail, trial.scenario, NO_CRASH,
                                        tuple(out.steps)))
    return finished(CHECK, NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of one trial, run again: up to ``REPLAY_TRIES`` times until it fails
    (a SIGSTOP delay lands where it did only as nearly as the machine's timing allows)."""
    parts = scenario.split(":")
    if len(parts) != 4 or parts[0] != CHECK or parts[1] not in OPS or parts[2] not in TARGETS:
        raise ValueError(f"{scenario!r}: expected {CHECK}:<op>:<single|pair>:<stop point "
                         "or sig<microseconds>>")
    op, target, where = parts[1:]
    caps = backend.probe().capabilities
    seam = backend.takes_io and Capability.IO_SEAM in caps
    if where.startswith("sig"):
        trial = Trial(op, target, None, int(where[3:]) / 1e6)
    else:
        trial = Trial(op, target, int(where))
    if seam != (trial.stop is not None):
        raise ValueError(f"{scenario!r}: this backend is stopped "
                         f"{'at stop points' if seam else 'by SIGSTOP'}")
    with Bench(backend, seam) as bench:
        for _ in range(REPLAY_TRIES):
            out = run_trial(bench, trial)
            if out.findings:
                break
    return [Finding(c, d, trial.scenario, NO_CRASH, tuple(out.steps)) for c, d in out.findings]


__all__ = ["CHECK", "replay", "run", "run_trial"]
