"""Black-box crash tests: the backend runs in a child process that is killed with SIGKILL.

This needs nothing from the backend but its factory, so it is how backends without the
I/O seam are crash-tested (it is the ``process-kill`` crash model: what the kernel
accepted survives, nothing is lost to power failure).

One *trial*: the child opens the queue in a fresh directory and runs a random workload
(``crashexplore.workloads``) through ``crashexplore.workload_driver.Driver``, writing
"begin i" before call ``i`` and "acknowledged i" (with the ids it learnt) after it
returns.  The child kills itself (SIGKILL) at a point drawn from the trial's seed: at the
``n``-th Python function call (``sys.setprofile`` events: Python functions and the C
functions, system calls included, they call) inside workload call ``k``, or when call
``k`` returns, before it is acknowledged, if it makes fewer.  The child is a fresh
interpreter, so the same trial lands on the same instruction every time.  Then the
parent opens the queue (recovery runs), reads every entry
(``crashexplore.recovered_queue.inspect``) and judges the result with the pending-op
oracle of ``spec.crash``: the acknowledged calls all happened, the call that had begun
and was not acknowledged happened or not, nothing else; once drained, nothing is left.
In every other trial of a backend that processes share (``Capability.MULTI_PROCESS``)
the parent holds the queue open in another Storage from before the child starts until
the judging ends: the reopening then recovers beside a live owner, as a relay worker
restarted beside the others does, and must clean up the dead owner's leftovers all the
same (a sweep that only runs when no other owner is alive leaves them behind: C8).
Those trials kill the child inside an enqueue of two or more recipients; a backend with
the I/O seam is then opened through one that SIGKILLs the child right after a mutating
disk call drawn from the first ``KILL_CALLS`` of that enqueue, inside the call.

A *recovery trial* kills a second child at the ``m``-th Python call of opening the
crashed queue (recovery is interrupted), then judges what the third opening shows, and
checks that running ``recover()`` again changes nothing.

Scenario ids: ``process-kill:<seed>:<trial>:<length>`` (and ``recovery-rerun:...``);
``queue-ref certify FACTORY --scenario ID`` runs that one trial again: the same workload
killed at the same Python call (a backend whose own threads race may take another path).
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from conformance.crashexplore.crash_judge import overstated_counts
from conformance.crashexplore.recovered_queue import inspect, to_views
from conformance.crashexplore.workload_driver import drive_and_report, model_before
from conformance.crashexplore.workloads import Workload, random_workload
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH, PROCESS_KILL
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Channel, Child, ChildTimeout
from conformance.harness.stop_gate_io import kill_self, killing_io
from queue_ref.storage import Capability
from spec.crash import judge
from spec.model import Call
from spec.states import Op


@dataclass(frozen=True)
class Trial:
    """Everything that decides one trial, derived from (seed, trial number)."""

    check: str
    seed: int
    number: int
    workload_seed: int
    workload: Workload
    kill_during: int  # index of the call during which the child is killed
    kill_event: int  # the child dies at this Python call inside that call (0: at its end)
    recovery_event: int  # ... at this Python call of the reopening (recovery trials)
    #: another Storage keeps the queue open all along (odd trials of a shared backend)
    beside_live: bool = False
    #: with the I/O seam, the child dies right after this mutating disk call of
    #: ``kill_during`` returns (1-based; 0: at ``kill_event`` instead)
    kill_call: int = 0

    @property
    def scenario(self) -> str:
        return f"{self.check}:{self.seed}:{self.number}:{len(self.workload)}"


#: A kill through the I/O seam lands after one of the first KILL_CALLS mutating calls of
#: an enqueue (a two-recipient commit of the filesystem queue makes 12 to 14), or at its
#: end.
KILL_CALLS = 14


def make_trial(check: str, seed: int, number: int, length: int, shared: bool = False,
               seam: bool = False) -> Trial:
    """Trial ``number`` of ``seed``.  ``shared``: the backend declares
    ``Capability.MULTI_PROCESS``, and its odd trials then run beside a live owner, killed
    inside an enqueue of two or more recipients (other backends keep every trial's kill
    where it was drawn); ``seam``: it declares ``Capability.IO_SEAM`` too, and those kills
    land right after a mutating disk call drawn uniformly (a Python call count spreads
    them over the commit's bookkeeping, and the window between its hard links and its
    rename is hit in few trials)."""
    rng = random.Random(f"{check}:{seed}:{number}")
    wseed = rng.randrange(2**32)
    workload = random_workload(wseed, length)
    kill_during = rng.randrange(len(workload))
    kill_event = rng.choice((0, rng.randrange(1, 100), rng.randrange(1, 400),
                             rng.randrange(1, 1500)))
    recovery_event = rng.choice((1, rng.randrange(1, 200), rng.randrange(1, 1000),
                                 rng.randrange(1, 5000)))
    beside_live = shared and number % 2 == 1
    wide = [i for i, c in enumerate(workload) if c.op is Op.ENQUEUE and len(c.rcpts) >= 2]
    if beside_live and wide:
        # a trial with another owner alive (see _trial) kills inside an enqueue of two or
        # more recipients, whose half-made commit leaves the most for recovery to undo
        kill_during = wide[rng.randrange(len(wide))]
        kill_event = rng.randrange(1, 1200)  # its commit is most of its Python calls
        if seam:
            return Trial(check, seed, number, wseed, workload, kill_during, 0,
                         recovery_event, beside_live, rng.randrange(1, KILL_CALLS + 1))
    return Trial(check, seed, number, wseed, workload, kill_during, kill_event, recovery_event,
                 beside_live)


def parse_scenario(scenario: str) -> tuple[str, int, int, int]:
    """(check, seed, trial number, workload length) of a scenario id."""
    parts = scenario.split(":")
    if len(parts) != 4 or parts[0] not in ("process-kill", "recovery-rerun"):
        raise ValueError(f"{scenario!r} is not a process-kill or recovery-rerun scenario "
                         "(check:seed:trial:length)")
    try:
        return parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        raise ValueError(f"{scenario!r}: seed, trial and length must be integers") from None


def _die_at(event: int) -> None:
    """SIGKILL this process at its ``event``-th Python call from now, in any thread."""
    count = 0

    def profile(frame: object, what: str, arg: object) -> None:
        nonlocal count
        count += 1
        if count >= event:
            kill_self()

    threading.setprofile(profile)  # type: ignore[arg-type]
    sys.setprofile(profile)  # type: ignore[arg-type]


def _run_workload(ch: Channel, backend: Backend, root: str, workload: Workload,
                  kill_during: int, kill_event: int, kill_call: int = 0) -> None:
    """In the child: run the workload, reporting each call's start and acknowledgement;
    die at Python call ``kill_event`` of call ``kill_during`` (or right after its
    mutating disk call ``kill_call``, through the I/O seam), or at its end."""
    # with the seam: stop point ``kill_call`` is right after that mutating call, inside it
    io = killing_io() if kill_call else None

    def before(i: int) -> None:
        if i == kill_during and io is not None:
            io.arm(kill_call)
        elif i == kill_during and kill_event > 0:
            _die_at(kill_event)

    def returned(i: int) -> None:
        if i == kill_during:
            kill_self()  # the call returned; it dies before anyone learns of it

    if not drive_and_report(ch.send, backend.open(root, io), workload, before=before,
                            returned=returned):
        return
    while True:  # wait to be killed: a clean close is not what is tested here
        time.sleep(1)


def _reopen_and_recover(ch: Channel, backend: Backend, root: str, event: int) -> None:
    """In the recovery child: open (recovery runs), recover once more, report; die at
    Python call ``event`` from the start of the opening."""
    ch.send({"opening": True})
    _die_at(event)
    store = backend.open(root)
    ch.send({"opened": True})
    store.recover()
    ch.send({"recovered": True})


@dataclass
class _Run:
    acked: int = 0
    begun: int = -1
    message_ids: dict[str, int] = field(default_factory=dict)
    entry_keys: dict[str, tuple[int, int]] = field(default_factory=dict)
    divergence: tuple[str, str] | None = None
    child_error: str | None = None

    def take(self, msg: dict[str, Any]) -> None:
        if "b" in msg:
            self.begun = msg["b"]
        elif "a" in msg:
            self.acked = msg["a"] + 1
            self.message_ids.update(msg["m"])
            self.entry_keys.update({k: (v[0], v[1]) for k, v in msg["e"].items()})
        elif "divergence" in msg:
            self.divergence = (msg["divergence"], msg["detail"])
        elif "crashed" in msg:
            self.child_error = f"{msg['crashed']}\n{msg.get('trace', '')}"


def _crash_child(backend: Backend, root: str, trial: Trial) -> _Run:
    """Run the workload child; it dies inside call ``trial.kill_during``."""
    state = _Run()
    with Child(_run_workload, backend, root, trial.workload, trial.kill_during,
               trial.kill_event, trial.kill_call) as child:
        for msg in child.messages():
            state.take(msg)
            if "divergence" in msg or "crashed" in msg or "done" in msg:
                child.kill()
        child.kill()
    return state


def _steps(trial: Trial, state: _Run) -> tuple[str, ...]:
    wl = trial.workload
    where = (f"right after its mutating disk call #{trial.kill_call}" if trial.kill_call
             else f"at its Python call #{trial.kill_event}" if trial.kill_event
             else "as it returned, before it was acknowledged")
    out = [f"workload seed {trial.workload_seed} ({len(wl)} calls); killed inside call "
           f"{trial.kill_during} {where} (or at its end, if it made fewer)"]
    out += [f"{i}: {c.describe()}" for i, c in enumerate(wl[:state.acked])]
    if state.begun >= state.acked:
        out.append(f"{state.acked}: {wl[state.acked].describe()}  <- killed inside")
    return tuple(out)


def judge_trial(backend: Backend, root: str, trial: Trial, state: _Run) -> list[Finding]:
    """Findings of the queue left in ``root`` after the run described by ``state``."""
    steps = _steps(trial, state)
    if state.divergence is not None:
        clause, detail = state.divergence
        return [Finding(clause, detail, trial.scenario, NO_CRASH, steps)]
    if state.child_error is not None:
        return [Finding("C9", f"the child failed with no crash injected: "
                              f"{state.child_error}", trial.scenario, NO_CRASH, steps)]
    before = model_before(trial.workload, state.acked)
    pending: Call | None = None
    if state.begun >= state.acked and state.acked < len(trial.workload):
        pending = trial.workload[state.acked]
    rec = inspect(lambda: backend.open(root))
    views = to_views(rec, state.message_ids, state.entry_keys, before, pending)
    found = [Finding(v.clause, v.detail, trial.scenario, PROCESS_KILL, steps)
             for v in judge(before, pending, views)]
    found += [Finding(c, d, trial.scenario, PROCESS_KILL, steps) for c, d in rec.problems]
    if not found:  # counts are judged in a state that is right (crash_judge.judge_crashed)
        found = [Finding(c, d, trial.scenario, PROCESS_KILL, steps)
                 for c, d in overstated_counts(rec, before, pending)]
    return found


def _listing(store: Any) -> tuple[object, ...]:
    return (sorted((h.entry_id, h.schedule) for h in store.list_queue()),
            sorted(h.entry_id for h in store.find_inflight()),
            sorted(h.entry_id for h in store.find_pending_cleanup()))


def run_trial(backend: Backend, trial: Trial) -> list[Finding]:
    """One trial (plain, or with recovery interrupted when ``trial.check`` says so)."""
    return _trial(backend, trial)[0]


def _trial(backend: Backend, trial: Trial) -> tuple[list[Finding], bool]:
    """The findings, and whether the kill landed inside a call (not between two)."""
    root = tempfile.mkdtemp(prefix=f"queue-ref-{trial.check}-")
    bystander = None
    try:
        if trial.beside_live:
            # another owner keeps the queue open all along, so the reopening after the
            # kill is not alone: its recovery must finish what the dead owner left (its
            # half-made commit, hard links included) without the sweep only a queue no
            # one else has open may make, and the drain must leave nothing (C8)
            try:
                bystander = backend.open(root)
            except Exception as e:
                return [Finding("C9", f"opening an empty queue failed: {type(e).__name__}: "
                                      f"{e}", trial.scenario, NO_CRASH, ())], False
        try:
            state = _crash_child(backend, root, trial)
        except ChildTimeout as e:
            return [Finding("C9", f"the workload hung: {e}", trial.scenario, PROCESS_KILL,
                            _steps(trial, _Run()))], False
        inside = state.begun >= state.acked
        if trial.check == "recovery-rerun" and state.divergence is None \
                and state.child_error is None:
            found = _interrupt_recovery(backend, root, trial, state)
            if found:
                return found, inside
        return judge_trial(backend, root, trial, state), inside
    finally:
        try:
            if bystander is not None:
                bystander.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _interrupt_recovery(backend: Backend, root: str, trial: Trial,
                        state: _Run) -> list[Finding]:
    steps = (*_steps(trial, state),
             f"recovery killed at its Python call #{trial.recovery_event}")
    with Child(_reopen_and_recover, backend, root, trial.recovery_event) as child:
        for msg in child.messages():
            if "crashed" in msg:
                return [Finding("C10", f"opening the crashed queue failed: {msg['crashed']}",
                                trial.scenario, PROCESS_KILL, steps)]
    try:
        store = backend.open(root)
    except Exception as e:
        return [Finding("C10", f"opening after an interrupted recovery failed: "
                               f"{type(e).__name__}: {e}", trial.scenario, PROCESS_KILL, steps)]
    try:
        first = _listing(store)
        store.recover()
        second = _listing(store)
    finally:
        store.close()
    if first != second:
        return [Finding("C10", "recover() run on a recovered queue changed it: "
                               f"{first} became {second}", trial.scenario, PROCESS_KILL, steps)]
    return []


def run_check(backend: Backend, check: str, seed: int, trials: int, length: int) -> CheckResult:
    """``trials`` trials of ``check`` ("process-kill" or "recovery-rerun")."""
    start = time.perf_counter()
    findings: list[Finding] = []
    inside = 0
    shared, seam = _shared(backend)
    for n in range(trials):
        found, within = _trial(backend, make_trial(check, seed, n, length, shared, seam))
        findings += found
        inside += within
    failed = len({f.scenario for f in findings})
    return finished(check, PROCESS_KILL, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats={"trials": trials, "failed_trials": failed,
                                      "killed_inside_a_call": inside,
                                      "workload_length": length})


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """Run the trial ``scenario`` names again."""
    check, seed, number, length = parse_scenario(scenario)
    return run_trial(backend, make_trial(check, seed, number, length, *_shared(backend)))


def _shared(backend: Backend) -> tuple[bool, bool]:
    """Whether processes may share the backend's queue (its odd trials run beside a live
    owner), and whether it declares the I/O seam (those kills land at a disk call)."""
    probe = backend.probe()
    return (probe.has(Capability.MULTI_PROCESS),
            probe.has(Capability.IO_SEAM) and backend.takes_io)
