"""I/O errors (``Capability.IO_SEAM``): a disk call fails; the outcome must be honest.

A short random workload runs through ``faultinject.FaultyIO`` with one mutating call
made to fail (EIO, or ENOSPC with a short write).  The operation containing the failed
call is judged by its *outcome* against the model, never by whether it raised:

* it **failed** with ``StorageIOError`` (``NoSpaceError`` for a full disk): the queue,
  still open right after the error (unless it said ``ReopenRequiredError``), must list
  the queued entries of the model's old state or of its new one, schedules included (a
  failed ``reschedule`` must not leave its entry hidden until the next restart), and
  after a failed enqueue its ``footprint()`` must be what it was before the enqueue
  (C8: nothing left behind that only a restart's recovery would sweep); and the
  queue reopened on the disk as it is (the process restarted; the kernel kept what it
  accepted) and after a power cut right then, must show the operation done or not done,
  never a mixture (the crash condition of ``spec.crash``);
* it **succeeded** (a backend may recover from a fault on an optional step, such as a
  spare file it could not create): the rest of the workload must agree with the model,
  the reopened queue must show exactly the model's state, and a power cut right after
  the operation returned must lose none of it (a success whose fsync failed is not
  durable: C9, "fsyncgate");
* any other exception, or an answer the model does not give (a ``None`` for an entry the
  call should have moved), breaks C9.

Later calls may raise ``StorageIOError`` too (a queue that stops trusting itself until
it is reopened); the first such call is the one judged as failed.

Besides the trials drawn from the seed, a *sweep* fails an enqueue of three recipients at
each of its mutating calls in turn, on every seed (``SWEEPS``).

Scenario ``io-errors:<seed>:<trial>``: workload seed, failing call index and errno, all
drawn from (seed, trial); ``io-errors:sweep:<workload>:<call>`` for the sweep;
``queue-ref certify FACTORY --scenario ID`` runs it again exactly.
"""

from __future__ import annotations

import errno
import random
import time
from dataclasses import dataclass, replace

from conformance.checks.read_faults import replay_read, run_reads
from conformance.crashexplore.crash_judge import judge_recovered
from conformance.crashexplore.disk_recovery import recover_image
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.recovered_queue import inspect, to_views
from conformance.crashexplore.traced_runs import (
    OPEN,
    Run,
    events_through,
    run_workload,
    scratch_dir,
    uncovered,
)
from conformance.crashexplore.workloads import LIFE, Workload, enqueue_call, random_workload
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.suite_profiles import Profile
from faultinject.fault_errors import ModelError
from faultinject.models import MODELS, crash_states
from faultinject.seam import FaultPlan
from queue_ref.storage import (
    NoSpaceError,
    RecoveryReport,
    ReopenRequiredError,
    Storage,
    StorageIOError,
)
from spec.crash import judge
from spec.model import Call, EntryKey, Model, Schedule
from spec.model import run as model_run
from spec.states import EntryState, Op

WORKLOAD_LENGTH = 8
#: The power-loss model the outcome is checked under (the harshest of faultinject's).
POWER_LOSS_MODEL = "weak"
#: Crash states built for the power cut (see ``faultinject.models.crash_states``).
EXHAUSTIVE_LIMIT = 6
RANDOM_STATES = 6


@dataclass(frozen=True)
class FaultTrial:
    seed: int
    number: int
    workload_seed: int
    fail_at: int
    errno_: int
    written: int
    #: (clause, how) the same workload failed with no fault (``CallCount.unfaulted``)
    unfaulted: tuple[str, str] = ("", "")
    #: a sweep trial's (workload, call) (``SWEEPS``); None for a trial drawn by the seed
    sweep: tuple[int, int] | None = None

    @property
    def scenario(self) -> str:
        if self.sweep is not None:
            return f"io-errors:sweep:{self.sweep[0]}:{self.sweep[1]}"
        return f"io-errors:{self.seed}:{self.number}"


def _spec(backend: Backend) -> BackendSpec:
    return BackendSpec(backend.name, backend.open, f"certified factory {backend.name}")


#: The disk calls that make data durable: every odd trial fails one of them, so that a
#: backend which swallows a failed sync is met on every seed (uniform positions hit a sync
#: in about one trial in five, and not at all when a change adds calls elsewhere).
SYNCS = frozenset({"fsync", "fdatasync", "fsync_dir", "syncfs"})


@dataclass(frozen=True)
class CallCount:
    """The mutating calls of a fault-free run (opening included), the positions of the
    syncs among them, and of the calls made inside transitions of existing entries (every
    operation but enqueue)."""

    total: int
    syncs: tuple[int, ...] = ()
    #: operation -> the mutating calls made inside its calls (enqueue excluded)
    transitions: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: the mutating calls made inside enqueues of two or more recipients, syncs excepted
    #: (odd trials fail those)
    shared_enqueues: tuple[int, ...] = ()
    #: the mutating calls made inside the enqueue of a large body, syncs excepted
    large_body: tuple[int, ...] = ()
    #: ... those made while its body was written, before its commit began
    large_stream: tuple[int, ...] = ()
    #: (clause, how) the run failed although no fault was injected (the disk is fine)
    unfaulted: tuple[str, str] = ("", "")


def _call_name(i: int, workload: Workload) -> str:
    return "opening the queue" if i == OPEN else f"call {i} {workload[i].describe()}"


def _count_calls(backend: Backend, workload: Workload) -> CallCount:
    run = run_workload(_spec(backend), workload)
    mutating = [e for e in run.events if e.mutating]
    inside: dict[str, list[int]] = {}
    shared: list[int] = []
    large: list[int] = []
    stream: list[int] = []
    for i, call in enumerate(workload[:len(run.op_ends)]):
        calls = range(run.op_starts[i], run.op_ends[i])
        if call.op is not Op.ENQUEUE and calls:
            inside.setdefault(call.op.value, []).extend(calls)
        elif call.op is Op.ENQUEUE:
            unsynced = [m for m in calls if mutating[m].name not in SYNCS]
            if len(call.body) >= LARGE_MIN:
                # the last large enqueue's (an earlier one is read back after the fault)
                large = unsynced
                stream = [m for m in unsynced if m < run.commit_starts.get(i, run.op_ends[i])]
            elif len(call.rcpts) >= 2:
                shared.extend(unsynced)
    return CallCount(run.mutating_total,
                     tuple(m for m, e in enumerate(mutating) if e.name in SYNCS),
                     tuple((op, tuple(ms)) for op, ms in sorted(inside.items())),
                     tuple(shared), tuple(large), tuple(stream), _unfaulted(run, workload))


def _unfaulted(run: Run, workload: Workload) -> tuple[str, str]:
    """(clause, how) a fault-free run failed, or ("", "")."""
    if run.stopped_in is not None and run.error is not None:
        return ("C9", f"{_call_name(run.stopped_in, workload)} raised "
                      f"{type(run.error).__name__}: {run.error}")
    if run.stopped_in is not None and run.divergence is not None:
        return (run.divergence.clause, f"{_call_name(run.stopped_in, workload)} "
                                       f"diverged from the model: {run.divergence}")
    return ("", "")


#: One trial in eight (``number % 8 == 4``) gives its first two enqueues bodies of this
#: many bytes more, written in pieces of 100-300 KB (``workload_driver.PIECES``), and
#: fails a call made while the last of them streams in or commits: a store that writes a
#: body in batches before the commit (the KV queue: 1 MiB) meets the fault between two of
#: them, and the first large body, acknowledged before, is read back after it (a store
#: that loses bytes carried from one piece to the next is found there).
LARGE_BODY = 1_600_000
LARGE_ENQUEUES = 2
#: A body cut to a declared limit below this is no large body at all.
LARGE_MIN = 128 * 1024


def workload_of(seed: int, number: int, max_body: int | None = None) -> Workload:
    """Trial ``number``'s workload: random; for one trial in eight, its first two
    enqueues carry large bodies (as large as ``max_body``, the backend's declared
    ``Limits.max_body_bytes``, lets them: none larger than a small one when that is
    below 128 KiB)."""
    workload = random_workload(make_trial(seed, number, CallCount(1)).workload_seed,
                               WORKLOAD_LENGTH)
    pad = LARGE_BODY if max_body is None else min(LARGE_BODY, max_body - 4096)
    if number % 8 != 4 or pad < LARGE_MIN:
        return workload
    enqueues = [i for i, c in enumerate(workload) if c.op is Op.ENQUEUE][:LARGE_ENQUEUES]
    return tuple(replace(c, body=c.body + b"L" * pad) if i in enqueues else c
                 for i, c in enumerate(workload))


def _max_body(backend: Backend) -> int | None:
    return backend.probe().limits.max_body_bytes


def make_trial(seed: int, number: int, calls: CallCount) -> FaultTrial:
    """Trial ``number`` of ``seed``: an odd one fails a sync (when the run makes any); one
    in four (``number % 4 == 2``) a call inside a transition of an existing entry, the
    operation drawn first (most disk calls are an enqueue's, so a uniform draw seldom
    fails a ``reschedule`` or a ``send_cancel``); one in eight (``number % 8 == 0``) a
    call inside an enqueue of two or more recipients (what a failed commit must undo is
    largest there); one in eight (``number % 8 == 4``) a call made while a large body
    streams in (``workload_of``), every other one its commit's last call failing for a
    full disk; the rest a mutating call drawn uniformly."""
    rng = random.Random(f"io-errors:{seed}:{number}")
    wseed = rng.randrange(2**32)
    errnos = (errno.EIO, errno.EIO, errno.ENOSPC)
    if number % 2 and calls.syncs:
        fail_at = calls.syncs[rng.randrange(len(calls.syncs))]
    elif number % 4 == 2 and calls.transitions:
        _, inside = calls.transitions[rng.randrange(len(calls.transitions))]
        fail_at = inside[rng.randrange(len(inside))]
    elif number % 8 == 0 and calls.shared_enqueues:
        fail_at = calls.shared_enqueues[rng.randrange(len(calls.shared_enqueues))]
    elif number % 8 == 4 and calls.large_body:
        # half of them the enqueue's last call (its commit, after the body's batches) on
        # a full disk: a relay retrying a large message on a full disk meets it at every
        # try; the other half any call while the body streams in, ENOSPC or EIO
        if number % 16 == 12:
            fail_at, errnos = calls.large_body[-1], (errno.ENOSPC,)
        else:  # a call made while the body streams in (any of the enqueue's if none)
            pool = calls.large_stream or calls.large_body
            fail_at = pool[rng.randrange(len(pool))]
            errnos = (errno.EIO, errno.ENOSPC)
    else:
        fail_at = rng.randrange(max(calls.total, 1))
    return FaultTrial(seed, number, wseed, fail_at, rng.choice(errnos), rng.choice((0, 1, 100)),
                      calls.unfaulted)


@dataclass
class _Outcome:
    """What the faulted run did: which call met the fault, how it and the run ended."""

    faulted: int  # the workload call whose disk call failed (OPEN: opening the queue)
    site: str  # the failed disk call and where it was made
    failed: int | None = None  # the call judged as failed (raised StorageIOError)
    problems: tuple[tuple[str, str], ...] = ()
    #: the failed call's error of the wrong class (judged with the state it left)
    wrong_class: tuple[tuple[str, str], ...] = ()


#: The sweep: the last call of each of these workloads, an enqueue of three recipients, is
#: failed at each of its mutating calls in turn (EIO, and ENOSPC with a short write at
#: every other one), on every seed.  What a failed commit must undo grows call by call
#: (a hard link per recipient, a link, an index link): a store that forgets one of them
#: only when the fault lands between two of them is met at that call, not on the few
#: seeds whose random draw lands there.  The second workload first takes a message
#: through its whole life, so that a store that reuses what a finished message left (the
#: filesystem queue's spare files) fails there too.
SWEEPS: tuple[Workload, ...] = (
    (enqueue_call(0, 1), enqueue_call(1, 3)),
    (*LIFE, enqueue_call(1, 3)),
)


def sweep_trials(backend: Backend) -> list[tuple[FaultTrial, Workload]]:
    """Every trial of the sweep (``SWEEPS``): one per mutating call of each workload's
    last call, found by a fault-free run of it."""
    out = []
    for w, workload in enumerate(SWEEPS):
        inside, unfaulted = _last_call_calls(backend, workload)
        if unfaulted[1]:  # reported once, as the trial of its first call
            inside = range(1)
        out += [(_sweep_trial(w, k, m, unfaulted), workload) for k, m in enumerate(inside)]
    return out


def _last_call_calls(backend: Backend, workload: Workload) -> tuple[range, tuple[str, str]]:
    """The mutating calls (positions in the run) a fault-free run makes inside the
    workload's last call, and how that run failed if it did."""
    run = run_workload(_spec(backend), workload)
    last = len(workload) - 1
    if last >= len(run.op_ends):
        return range(0), _unfaulted(run, workload)
    return range(run.op_starts[last], run.op_ends[last]), _unfaulted(run, workload)


def _sweep_trial(w: int, k: int, fail_at: int, unfaulted: tuple[str, str]) -> FaultTrial:
    errno_, written = (errno.EIO, 0) if k % 2 == 0 else (errno.ENOSPC, 1)
    return FaultTrial(0, k, 0, fail_at, errno_, written, unfaulted, sweep=(w, k))


def _outcome(run: Run, workload: Workload, name: str) -> _Outcome | None:
    ev = next((e for e in run.events if e.injected), None)
    if ev is None:
        return None  # the run made fewer calls than counted: no fault took place
    out = _Outcome(run.call_of_event(ev.index), f"{ev.short()} at {ev.site}")
    where = f"after the injected {name} ({out.site})"
    i = run.stopped_in
    if run.divergence is not None:
        d = run.divergence
        clause = "C9" if d.index == out.faulted else d.clause
        out.problems = ((clause, f"{d} {where}; expected the model's answer or "
                                 "StorageIOError"),)
    elif run.error is not None and i is not None:
        what = _call_name(i, workload)
        if isinstance(run.error, StorageIOError):
            out.failed = i
            out.wrong_class = _error_class(run.error, ev.name, name, what, where) \
                if i == out.faulted else ()
        else:
            out.problems = (("C9", f"{what} raised {type(run.error).__name__}: {run.error} "
                                   f"{where}; expected StorageIOError"),)
    return out


#: The errnos of a full disk: a call that fails on one says ``NoSpaceError``.
NO_SPACE = frozenset({"ENOSPC", "EDQUOT"})


def _error_class(error: StorageIOError, call: str, name: str, what: str,
                 where: str) -> tuple[tuple[str, str], ...]:
    """The error must say what failed (C9: "``NoSpaceError`` for a full disk"): the caller
    acts on it, a relay answering 452 (come back later, the disk is full) or 451 and
    defer, and the operator freeing space or replacing a disk.  A failed sync may say
    ``ReopenRequiredError`` whatever its errno (the data it covered is not trusted), and
    need not say ``NoSpaceError`` (ENOSPC from a sync reports lost writeback); EIO never
    says ``NoSpaceError``."""
    if call in SYNCS and isinstance(error, ReopenRequiredError):
        return ()
    full = isinstance(error, NoSpaceError)
    if name in NO_SPACE and not full and call not in SYNCS:
        return (("C9", f"{what} raised {type(error).__name__}: {error} {where}; "
                       "expected NoSpaceError: the disk is full"),)
    if name not in NO_SPACE and full:
        return (("C9", f"{what} raised NoSpaceError: {error} {where}; the disk failed "
                       f"({name}), it is not full"),)
    return ()


def _steps(trial: FaultTrial, workload: Workload, run: Run, out: _Outcome) -> list[str]:
    name = errno.errorcode[trial.errno_]
    source = (f"sweep workload {trial.sweep[0]}" if trial.sweep is not None
              else f"workload seed {trial.workload_seed}")
    steps = [f"{source}; mutating call #{trial.fail_at} fails with {name}: {out.site}"]
    for i, call in enumerate(workload[:run.returned() + 1]):
        mark = ""
        if i == out.failed:
            mark = "  <- raised StorageIOError"
        elif i == out.faulted:
            mark = f"  <- {name} inside, returned"
        steps.append(f"{i}: {call.describe()}{mark}")
    return steps


def _queued(model: Model, keys: set[EntryKey] | None = None) -> dict[EntryKey, Schedule]:
    return {k: e.schedule for k, e in model.entries.items()
            if e.state is EntryState.QUEUED and (keys is None or k in keys)}


def _live_judge(run: Run, before: Model, pending: Call) -> list[tuple[str, str]]:
    """The queue as it was right after the call failed, without a restart: it lists the
    queued entries of the old state or of the new one (C9: "the entry is then in its old
    or its new state").  Entries the backend never named to the run (those of a failed
    enqueue) are counted: none (old) or every one the enqueue would have made (new)."""
    if run.live_listing_error is not None:
        return [("C9", f"right after the failed call, list_queue raised "
                       f"{run.live_listing_error}; expected a listing or a QueueError")]
    if run.live_queued is None:
        return []
    after, _ = model_run(before, pending)
    known = {run.entry_keys[e]: s for e, s in run.live_queued.items() if e in run.entry_keys}
    unknown = len(run.live_queued) - len(known)
    old = _queued(before)
    new = _queued(after, set(before.entries))
    made = len(set(after.entries) - set(before.entries))
    if (known, unknown) in ((old, 0), (new, made)):
        return []

    def show(q: dict[EntryKey, Schedule], extra: int) -> str:
        items = [f"{k} at={s.at} attempts={s.attempts}" for k, s in sorted(q.items())]
        items += [f"{extra} entries of the failed enqueue"] if extra else []
        return "[" + ", ".join(items) + "]"

    return [("C9", f"right after {pending.describe()} raised StorageIOError, the open "
                   f"queue lists {show(known, unknown)}; its old state lists "
                   f"{show(old, 0)} and its new state {show(new, made)}: a failed call "
                   "must leave its entry in one of them, without waiting for a restart")]


def _leftover_judge(run: Run, i: int, pending: Call) -> list[tuple[str, str]]:
    """A failed enqueue leaves nothing behind once it has raised (C8: "an aborted or
    failed enqueue leaves nothing after abort returns"): the open queue's footprint is
    the one it had before the enqueue began, not merely after the next restart (whose
    recovery would sweep the leftovers, while a queue that stays open keeps them).
    Judged only when the open queue lists the old state: an enqueue that took effect
    before a later step failed is allowed (``_live_judge``) and owns what it stored."""
    before = run.footprints.get(i)
    after = run.live_footprint
    if pending.op is not Op.ENQUEUE or before is None or after is None or after == before:
        return []
    if run.live_queued is None or any(e not in run.entry_keys for e in run.live_queued):
        return []  # the commit took effect before the failure (allowed): nothing to undo
    return [("C8", f"right after {pending.describe()} raised StorageIOError, the open "
                   f"queue's footprint is {after.objects} objects, {after.bytes} bytes; "
                   f"before the enqueue it was {before.objects} objects, {before.bytes} "
                   "bytes: the failed enqueue left storage behind")]


def _restart_judge(backend: Backend, root: str, run: Run, before: Model,
                   pending: Call | None) -> list[tuple[str, str]]:
    """The queue reopened on the disk as the run left it (process restart)."""
    opened: list[Storage] = []

    def open_storage() -> Storage:
        opened.append(backend.open(root))
        return opened[-1]

    rec = inspect(open_storage)
    views = to_views(rec, run.message_ids, run.entry_keys, before, pending)
    report = getattr(opened[0], "last_recovery", None) if opened else None
    return [(v.clause, f"after a restart: {v.detail}") for v in judge(before, pending, views)] \
        + [(c, f"after a restart: {d}") for c, d in rec.problems] \
        + _named_lost_judge(report)


def _named_lost_judge(report: RecoveryReport | None) -> list[tuple[str, str]]:
    """A failed call is no damage: the recovery after it names nothing lost (C6:
    ``lost`` names the messages damage took out of the queue; a message never
    acknowledged, because the enqueue that would have made it raised, was promised to no
    one, and a false name sends the operator, and a bounce to the sender, after mail
    that is fine or never was)."""
    if report is None or not (report.lost or report.lost_unknown):
        return []
    named = f"{len(report.lost)} messages (first: {report.lost[0]})" if report.lost \
        else f"{report.lost_unknown} records of unknown messages"
    why = f" ({report.problems[0]})" if report.problems else ""
    return [("C6", f"after a restart, recovery names {named} lost to damage{why}, but nothing "
                   "was damaged: only a call failed, and the caller was told")]


def _power_cut_judge(spec: BackendSpec, run: Run, cut: int, before: Model,
                     pending: Call | None) -> list[tuple[str, str]]:
    """Power lost once ``run.events[:cut]`` happened: every state the model allows."""
    if POWER_LOSS_MODEL not in MODELS:
        return []
    try:
        states = crash_states(run.initial, run.events[:cut], POWER_LOSS_MODEL,
                              exhaustive_limit=EXHAUSTIVE_LIMIT, random_states=RANDOM_STATES)
    except ModelError as e:
        return [("C9", f"the trace cannot be replayed for a power cut: {e}")]
    for st in states:
        found = judge_recovered(recover_image(spec, st.image), run, before, pending)
        if found:
            return [(c, f"after a power cut ({POWER_LOSS_MODEL}, state {st.key}: "
                        f"{st.description}): {d}") for c, d in found]
    return []


def run_trial(backend: Backend, trial: FaultTrial, workload: Workload) -> list[Finding]:
    spec = _spec(backend)
    plan = FaultPlan(fail_at=trial.fail_at, fail_errno=trial.errno_,
                     fail_written=trial.written)
    name = errno.errorcode[trial.errno_]
    if trial.unfaulted[1]:
        return [Finding(trial.unfaulted[0],
                        f"{trial.unfaulted[1]} with no fault injected (the disk is fine)",
                        trial.scenario, NO_CRASH,
                        (f"workload seed {trial.workload_seed}, no fault injected",
                         *(f"{i}: {c.describe()}" for i, c in enumerate(workload))))]
    with scratch_dir("queue-ref-faults-") as root:
        run = run_workload(spec, workload, plan, root=root)
        # the sync-cover rule on the faulted trace (a failed sync covers nothing); a trace
        # it cannot replay raises ModelError: the check's error, never a pass
        rode = uncovered(run)
        out = _outcome(run, workload, name)
        if out is None:
            return [Finding(c, d, trial.scenario, NO_CRASH, ()) for c, d in rode]
        steps = tuple(_steps(trial, workload, run, out))

        def findings(found: list[tuple[str, str]] | tuple[tuple[str, str], ...]
                     ) -> list[Finding]:
            return [Finding(c, d, trial.scenario, NO_CRASH, steps) for c, d in [*rode, *found]]

        if out.problems:
            return findings(out.problems)
        if run.stopped_in == OPEN:  # opening failed on the fault and said so
            return findings([])  # nothing was acknowledged
        if out.failed is not None:
            # Failed: the state before or after the failed call, nothing else.
            i = out.failed
            before, pending = run.models[i], workload[i]
            found = list(out.wrong_class)
            found += _live_judge(run, before, pending)
            found += _leftover_judge(run, i, pending)
            found += _restart_judge(backend, root, run, before, pending)
            found += _power_cut_judge(spec, run, len(run.events), before, pending)
            return findings(found)
        # Succeeded (and so did every later call): the model's state, durable.
        found = _restart_judge(backend, root, run, run.models[-1], None)
        if 0 <= out.faulted < len(workload):
            cut = events_through(run, out.faulted)
            lost = _power_cut_judge(spec, run, cut, run.models[out.faulted + 1], None)
            found += [("C9", f"call {out.faulted} {workload[out.faulted].describe()} "
                             f"returned success although {out.site} failed with {name}, "
                             f"and a power cut right after it shows {c}: {d}")
                      for c, d in lost]
        return findings(found)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    parts = scenario.split(":")
    if len(parts) == 4 and parts[1] == "read" and parts[3].isdigit():
        return replay_read(backend, parts[2], int(parts[3]))
    if (len(parts) == 4 and parts[1] == "sweep" and parts[2].isdigit()
            and int(parts[2]) < len(SWEEPS) and parts[3].isdigit()):
        w, k = int(parts[2]), int(parts[3])
        trials = {t.sweep: (t, wl) for t, wl in sweep_trials(backend)}
        if (w, k) not in trials:
            made = sum(1 for s in trials if s is not None and s[0] == w)
            raise ValueError(f"{scenario!r}: the last call of sweep workload {w} makes "
                             f"{made} mutating calls on this backend")
        return run_trial(backend, *trials[(w, k)])
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{scenario!r}: expected io-errors:<seed>:<trial>, "
                         f"io-errors:sweep:<0-{len(SWEEPS) - 1}>:<call> or "
                         "io-errors:read:<operation>:<n>")
    seed, number = int(parts[1]), int(parts[2])
    workload = workload_of(seed, number, _max_body(backend))
    trial = make_trial(seed, number, _count_calls(backend, workload))
    return run_trial(backend, trial, workload)


def run(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    start = time.perf_counter()
    findings: list[Finding] = []
    failed = 0
    max_body = _max_body(backend)
    for n in range(profile.fault_trials):
        workload = workload_of(seed, n, max_body)
        trial = make_trial(seed, n, _count_calls(backend, workload))
        got = run_trial(backend, trial, workload)
        failed += bool(got)
        findings += got
    sweep = sweep_trials(backend)
    for trial, workload in sweep:
        got = run_trial(backend, trial, workload)
        failed += bool(got)
        findings += got
    reads, found = run_reads(backend)
    findings += found
    return finished("io-errors", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats={"trials": profile.fault_trials,
                                      "sweep_trials": len(sweep), "failed_trials": failed,
                                      "read_trials": reads,
                                      "failed_read_trials": len({f.scenario for f in found})})
