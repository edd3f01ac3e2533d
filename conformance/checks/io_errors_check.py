"""I/O errors (``Capability.IO_SEAM``): a disk call fails, the backend must say so.

A short random workload runs through ``faultinject.FaultyIO`` with one mutating call
made to fail (EIO, or ENOSPC with a short write).  The operation containing the failed
call must raise ``StorageIOError`` (``NoSpaceError`` may stand for ENOSPC): returning
success after a failed write, fsync, rename or link is reporting a durable effect that
may not be durable (C9, "fsyncgate"), and any other exception breaks the error
contract (C9).  Then the queue is closed and opened again on the disk as it is (the
process restarted; the kernel kept what it accepted): it must show the operation done
or not done, never a mixture (judged like a crash inside it, C2/C5).

Scenario ``io-errors:<seed>:<trial>``: workload seed, failing call index and errno.
"""

from __future__ import annotations

import errno
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

from conformance.crashexplore.recovered_queue import inspect, to_views
from conformance.crashexplore.workload_driver import Divergence, Driver, spare_plan
from conformance.crashexplore.workloads import Workload, random_workload
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.suite_profiles import Profile
from faultinject import FaultPlan, FaultyIO
from queue_ref.storage import StorageIOError
from spec.crash import judge
from spec.model import Call, Model

#: Calls whose failure means data or names may not be on disk as the operation wanted.
PERSISTING = frozenset({"write", "fsync", "fdatasync", "fsync_dir", "syncfs", "rename", "link",
                        "symlink", "open_create", "mkdir", "ftruncate"})
WORKLOAD_LENGTH = 8


@dataclass(frozen=True)
class FaultTrial:
    seed: int
    number: int
    workload_seed: int
    fail_at: int
    errno_: int
    written: int

    @property
    def scenario(self) -> str:
        return f"io-errors:{self.seed}:{self.number}"


def _count_calls(backend: Backend, workload: Workload) -> int:
    """Mutating calls of a fault-free run (opening included)."""
    root = tempfile.mkdtemp(prefix="queue-ref-faults-")
    try:
        io = FaultyIO(root)
        store = backend.open(root, io)
        try:
            d = Driver(store)
            plan = spare_plan(workload)
            model = Model()
            for i, call in enumerate(workload):
                model = d.step(i, model, call)
                if i in plan:
                    d.take_spares(plan[i])
        finally:
            store.close()
        return io.mutating_count
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_trial(seed: int, number: int, total: int) -> FaultTrial:
    rng = random.Random(f"io-errors:{seed}:{number}")
    return FaultTrial(seed, number, rng.randrange(2**32), rng.randrange(max(total, 1)),
                      rng.choice((errno.EIO, errno.EIO, errno.ENOSPC)), rng.choice((0, 1, 100)))


def run_trial(backend: Backend, trial: FaultTrial, workload: Workload) -> list[Finding]:
    root = tempfile.mkdtemp(prefix="queue-ref-faults-")
    plan = FaultPlan(fail_at=trial.fail_at, fail_errno=trial.errno_,
                     fail_written=trial.written)
    name = errno.errorcode[trial.errno_]
    steps = [f"workload seed {trial.workload_seed}; mutating call #{trial.fail_at} fails "
             f"with {name}"]
    try:
        io = FaultyIO(root, plan)
        try:
            store = backend.open(root, io)
        except (StorageIOError, OSError):
            return []  # the fault hit opening the queue, and opening said so
        d = Driver(store)
        spares = spare_plan(workload)
        model = Model()
        pending: Call | None = None
        found: list[Finding] = []

        def fail(clause: str, detail: str) -> None:
            found.append(Finding(clause, detail, trial.scenario, NO_CRASH, tuple(steps)))

        try:
            for i, call in enumerate(workload):
                steps.append(f"{i}: {call.describe()}")
                before_calls = io.mutating_count
                try:
                    model = d.step(i, model, call)
                except StorageIOError:
                    pending = call
                    steps[-1] += f"  <- raised StorageIOError ({name})"
                    break
                except Divergence as e:
                    if io.mutating_count > trial.fail_at >= before_calls:
                        pending = call
                        steps[-1] += f"  <- answered wrongly after the {name}"
                        fail("C9", f"after an injected {name} the backend answered "
                                   f"wrongly instead of raising StorageIOError: {e.detail}")
                        break
                    fail(e.clause, e.detail)
                    return found
                except Exception as e:
                    steps[-1] += f"  <- raised {type(e).__name__}"
                    fail("C9", f"{call.describe()} raised {type(e).__name__}: {e} after an "
                               f"injected {name}; expected StorageIOError")
                    pending = call
                    break
                if io.mutating_count > trial.fail_at >= before_calls:
                    ev = next((e for e in io.events if e.injected), None)
                    if ev is not None and ev.name in PERSISTING:
                        fail("C9", f"{call.describe()} returned success although "
                                   f"{ev.short()} failed (at {ev.site})")
                if i in spares:
                    d.take_spares(spares[i])
        finally:
            try:
                store.close()
            except (StorageIOError, OSError):
                pass  # close failed on the injected fault and said so
            except Exception as e:
                fail("C9", f"close after the fault raised {type(e).__name__}: {e}")
        if pending is None and not found:
            return []
        steps.append("restart: the queue is opened again on the disk as it is")
        rec = inspect(lambda: backend.open(root))
        views = to_views(rec, d.message_ids, d.entry_keys, model, pending)
        for v in judge(model, pending, views):
            fail(v.clause, v.detail)
        for c, detail in rec.problems:
            fail(c, detail)
        return found
    finally:
        shutil.rmtree(root, ignore_errors=True)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    _, seed, number = scenario.split(":")
    rng_trial = make_trial(int(seed), int(number), 1)
    workload = random_workload(rng_trial.workload_seed, WORKLOAD_LENGTH)
    trial = make_trial(int(seed), int(number), _count_calls(backend, workload))
    return run_trial(backend, trial, workload)


def run(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    start = time.perf_counter()
    findings: list[Finding] = []
    failed = 0
    for n in range(profile.fault_trials):
        wseed = make_trial(seed, n, 1).workload_seed
        workload = random_workload(wseed, WORKLOAD_LENGTH)
        trial = make_trial(seed, n, _count_calls(backend, workload))
        got = run_trial(backend, trial, workload)
        failed += bool(got)
        findings += got
    return finished("io-errors", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats={"trials": profile.fault_trials, "failed_trials": failed})
