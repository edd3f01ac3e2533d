"""Faults and power cuts inside shared group-commit rounds (``Capability.IO_SEAM``).

Several threads enqueue at once through one ``faultinject.FaultyIO``, so that their
commits share sync rounds (a backend that groups its syncs serves several callers with
one).  In each trial one sync call (``fsync``, ``fdatasync``, ``fsync_dir`` or
``syncfs``, the n-th made) fails with EIO, or none does.  Then the power is cut, under
the ``weak`` model (states built from the trace): at the end of the run, and at the
moment each of some acknowledgements was given (``cut_points`` of them per trial, all in
the thorough profile), while the other threads' commits were still on their way, so that
a caller acknowledged by a round that did not cover it is seen.  Each sync is held open
for ``SYNC_SECONDS`` (``FaultyIO.sync_hold``), as on a disk, so callers arrive while it
runs; it sits in the trace where it began, and a power cut at an acknowledgement counts
only the syncs that had ended by then.  Every state is recovered.  Each commit is judged
by its outcome at that moment:

* a commit that **returned** (acknowledged) must be in every recovered state with all
  its recipients and its exact body: C1 (a round whose sync failed acknowledged a caller
  it covered, or a caller whose data arrived after the round's sync began was
  acknowledged by it);
* a commit that **raised** ``StorageIOError`` may be there or not (its id is unknown to
  the caller; atomicity of enqueue is the crash exploration's to judge);
* any other exception breaks C9.

The whole trace is also judged by the sync-cover rule (``conformance.concurrency.
sync_cover``): a commit acknowledged although no sync covering its change began after it
(it rode a round already syncing) is C1 even when no power cut state shows the loss.

Scenario ``group-commit:<seed>:<trial>``: the failing sync's number is drawn from
(seed, trial); thread interleavings are not replayable, so a finding says what each
thread saw.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import random
import threading
import time
from dataclasses import replace

from conformance.crashexplore.disk_recovery import recover_image
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.traced_runs import ScratchIO, scratch_dir
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.suite_profiles import Profile
from conformance.harness.sync_cover import uncovered_acks
from faultinject.fault_errors import ModelError
from faultinject.models import crash_states
from faultinject.seam import FaultPlan, FaultyIO
from faultinject.trace import SYNC_CALLS, TraceEvent
from queue_ref.storage import QueueError, Recipient, Schedule, Storage, StorageIOError

THREADS = 4
PER_THREAD = 3
POWER_LOSS_MODEL = "weak"
EXHAUSTIVE_LIMIT = 4
RANDOM_STATES = 8
SYNC_SECONDS = 0.003


class _SyncFaultIO(FaultyIO):
    """FaultyIO whose ``fail_sync``-th sync call (0-based, any kind) fails with EIO, and
    whose syncs are held open for SYNC_SECONDS: callers that arrive meanwhile queue up for
    the next round, so rounds are shared (without it, scratch syncs are instant)."""

    def __init__(self, root: str, fail_sync: int | None) -> None:
        super().__init__(root, FaultPlan(), inner=ScratchIO(), sync_hold=SYNC_SECONDS)
        self.fail_sync = fail_sync

    def _begin_sync(self, name: str, args: tuple[object, ...]) -> tuple[int, int, int, int]:
        slot = super()._begin_sync(name, args)
        _, mutating_index, number, _ = slot
        if number == self.fail_sync:
            with self._mutex:
                self.plan = FaultPlan(fail_at=mutating_index, fail_errno=errno.EIO)
        return slot


def syncs_ended_by(events: list[TraceEvent], seq: int) -> list[TraceEvent]:
    """``events`` as a power cut at counter ``seq`` leaves them: a sync still open then
    covered nothing."""
    return [replace(e, applied=False, error=None, result=None)
            if e.name in SYNC_CALLS and not 0 <= e.ended <= seq else e for e in events]


def _body(t: int, k: int) -> bytes:
    return b"Subject: round %d.%d\r\n\r\n" % (t, k) + b"group commit body\r\n" * (3 + t + k)


class _Commit:
    def __init__(self, t: int, k: int) -> None:
        self.t, self.k = t, k
        self.rcpts = [Recipient(f"r{t}.{k}.{i}@example.net", Schedule(k)) for i in range(1 + k % 2)]
        self.body = _body(t, k)
        self.message_id: str | None = None
        self.outcome = "not run"  # "acked", "failed", or "raised X"
        self.acked_at = -1  # how many I/O calls had begun when the commit returned
        self.acked_seq = -1  # the seam's counter then


def _enqueuer(store: Storage, io: FaultyIO, commits: list[_Commit],
              start: threading.Barrier) -> None:
    start.wait()
    for c in commits:
        try:
            with io.operation("commit") as span, store.enqueue(f"s{c.t}@example.org") as enq:
                enq.write(c.body)
                handles = enq.commit(c.rcpts)
            c.acked_seq = span.ended  # the calls begun by then are a prefix of the trace
            c.acked_at = sum(1 for e in list(io.events) if e.began <= span.ended)
            c.message_id = handles[0].message_id
            c.outcome = "acked"
        except StorageIOError:
            c.outcome = "failed"
        except QueueError as e:
            c.outcome = f"raised {type(e).__name__}: {e}"
        except Exception as e:
            c.outcome = f"raised {type(e).__name__}: {e}"


def _judge_state(commits: list[_Commit], entries: dict[str, list[tuple[str, str]]],
                 where: str, cut: int | None = None) -> list[tuple[str, str]]:
    """C1 findings of one recovered state; ``cut``: the power went at that value of the
    seam's counter (None: at the end), so only commits acknowledged by then must be
    there."""
    out: list[tuple[str, str]] = []
    for c in commits:
        if c.outcome != "acked" or c.message_id is None:
            continue
        if cut is not None and c.acked_seq > cut:
            continue
        got = entries.get(c.message_id, [])
        want = sorted((r.address, hashlib.sha256(c.body).hexdigest()) for r in c.rcpts)
        if sorted(got) != want:
            out.append(("C1", f"the commit of thread {c.t} (#{c.k}, message "
                              f"{c.message_id}) was acknowledged but {len(got)} of its "
                              f"{len(want)} entries are there intact {where}"))
    return out


def _cuts(commits: list[_Commit], events: int, how_many: int | None,
          rng: random.Random) -> list[int | None]:
    """Where the power goes: the end of the run (None), then at acknowledgements given
    before the last call began (``how_many`` of them, None: all), as the seam's counter
    when each was given (two acknowledgements after the same calls may differ in which
    syncs had ended)."""
    points = sorted({c.acked_seq for c in commits if c.outcome == "acked" and
                     0 <= c.acked_at < events})
    if how_many is not None and len(points) > how_many:
        points = sorted(rng.sample(points, how_many))
    return [None, *points]


def run_trial(backend: Backend, seed: int, number: int, fail_sync: int | None,
              cut_points: int | None = 2) -> list[Finding]:
    scenario = f"group-commit:{seed}:{number}"
    spec = BackendSpec(backend.name, backend.open, f"certified factory {backend.name}")
    commits = [_Commit(t, k) for t in range(THREADS) for k in range(PER_THREAD)]
    found: list[tuple[str, str]] = []
    with scratch_dir("queue-ref-group-") as root:
        io = _SyncFaultIO(root, fail_sync)
        try:
            store = backend.open(root, io)
        except StorageIOError:
            return []  # opening met the fault and said so: nothing acknowledged
        start = threading.Barrier(THREADS)
        threads = [threading.Thread(target=_enqueuer,
                                    args=(store, io, [c for c in commits if c.t == t], start))
                   for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        with contextlib.suppress(QueueError):
            store.close()
        for c in commits:
            if c.outcome.startswith("raised"):
                found.append(("C9", f"the commit of thread {c.t} (#{c.k}) {c.outcome}; "
                                    "expected success or StorageIOError"))
        steps = tuple([f"{THREADS} threads enqueue {PER_THREAD} messages each at once"
                       + (f"; sync call #{fail_sync} fails with EIO" if fail_sync is not None
                          else "; no fault")]
                      + [f"thread {c.t} #{c.k}: {c.outcome}" for c in commits])
        events = list(io.events)
        try:
            found += [(u.clause, u.detail()) for u in
                      uncovered_acks(io.initial, events, io.operations)]
        except ModelError as e:
            found.append(("C9", f"the trace cannot be replayed for the sync-cover rule: {e}"))
        rng = random.Random(f"{scenario}:cuts")
        for cut in _cuts(commits, len(events), cut_points, rng):
            calls = len(events) if cut is None else sum(1 for e in events if e.began <= cut)
            prefix = events if cut is None else syncs_ended_by(events[:calls], cut)
            when = ("at the end of the run" if cut is None else
                    f"at the acknowledgement given after I/O call {calls} of {len(events)} "
                    f"(counter {cut})")
            try:
                states = crash_states(io.initial, prefix, POWER_LOSS_MODEL,
                                      exhaustive_limit=EXHAUSTIVE_LIMIT,
                                      random_states=RANDOM_STATES)
            except ModelError as e:
                found.append(("C9", f"the trace cannot be replayed for a power cut {when}: {e}"))
                break
            got: list[tuple[str, str]] = []
            for st in states:
                rec = recover_image(spec, st.image)
                entries: dict[str, list[tuple[str, str]]] = {}
                for entry in rec.entries:
                    entries.setdefault(entry.message_id, []).append((entry.rcpt,
                                                                     entry.body_digest))
                got = _judge_state(commits, entries, f"after a power cut {when} "
                                   f"({POWER_LOSS_MODEL}, {st.description})", cut)
                if got:
                    break
            if got:
                found += got
                break
    return [Finding(c, d, scenario, NO_CRASH, steps) for c, d in found]


def run(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    start = time.perf_counter()
    findings: list[Finding] = []
    trials = profile.group_commit_trials
    for n in range(trials):
        rng = random.Random(f"group-commit:{seed}:{n}")
        fail_sync = None if n == 0 else rng.randrange(2 + THREADS * PER_THREAD)
        findings += run_trial(backend, seed, n, fail_sync, profile.group_commit_cuts)
    return finished("group-commit", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats={"trials": trials, "threads": THREADS,
                                      "commits_per_trial": THREADS * PER_THREAD,
                                      "cuts_per_trial": (-1 if profile.group_commit_cuts is None
                                                         else profile.group_commit_cuts)})
