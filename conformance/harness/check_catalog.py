"""Which checks test which clause of the contract, at which level, needing what.

Every clause of ``spec.crash.CLAUSES`` is tested by at least one check (the
module asserts it on import).  A check is *core* (every backend must pass it) or
*optional* (it needs a capability; a backend that does not declare the capability is
reported "unsupported" for it, which is never counted as a pass).

Crash checks run once per crash model:

* ``process-kill``: the process dies (SIGKILL); everything the kernel accepted survives.
* ``weak``, ``ext4-ordered``, ...: power loss under a persistence model of
  ``faultinject`` (unsynced data and directory entries may be lost).  Only backends
  whose disk calls go through the I/O seam (``Capability.IO_SEAM``) can be explored
  under these; for other backends the cells are "unsupported".

Checks that involve no crash report under the column ``no-crash``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from queue_ref.storage import Capability
from spec.crash import CLAUSES

#: The column of checks that involve no crash.
NO_CRASH = "no-crash"
#: The black-box crash model every backend can be tested under.
PROCESS_KILL = "process-kill"
#: Crash models whose states include every state of other models: a crash model is
#: certified only when each model it includes holds too (a backend that fails under
#: process-kill is never "certified under weak").  ``tests/test_conformance_inclusion.py``
#: checks the inclusion on the crash states of the project's backends and broken variants.
INCLUDES: dict[str, tuple[str, ...]] = {
    "weak": ("ext4-ordered", PROCESS_KILL),
    "ext4-ordered": (PROCESS_KILL,),
}
#: Clauses of a capability: only a backend that declares it promises them (its checks
#: are optional; without the capability they are "unsupported", never passed).
CAPABILITY_CLAUSES: dict[str, Capability] = {"C14": Capability.HOLD}
#: Clause ids, in order, plus API for answers that break the interface itself.
API = "API"
ROWS: dict[str, str] = {**CLAUSES, API: "Interface (answers, listings, handles)"}


class Level(enum.Enum):
    CORE = "core"
    OPTIONAL = "optional"


class Kind(enum.Enum):
    LOCKSTEP = "lockstep model test"
    BAD_INPUT = "bad input"
    SCALE = "scale"
    CONCURRENCY = "concurrency"
    PROCESS_KILL = "black-box process kill"
    CRASH_EXPLORATION = "crash exploration"
    FAULTS = "I/O faults"
    STREAMING = "streaming"
    DAMAGE = "damage at rest"
    BLACKBOX_POWER_LOSS = "black-box power loss"


@dataclass(frozen=True)
class CheckSpec:
    id: str
    title: str
    kind: Kind
    clauses: tuple[str, ...]
    level: Level = Level.CORE
    requires: tuple[Capability, ...] = ()
    crash: bool = False  # runs once per crash model
    seam_only: bool = False  # the crash models it covers need the I/O seam
    #: runs under every crash model (power loss included) without the I/O seam
    every_model: bool = False
    #: capabilities that make the check pointless (another check covers the backend)
    excludes: tuple[Capability, ...] = ()

    def supported(self, caps: frozenset[Capability]) -> bool:
        return all(c in caps for c in self.requires) and not any(c in caps for c in self.excludes)


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("lockstep", "backend and model in lockstep under random operations "
              "(hypothesis state machine), stale handles, reads, drain to zero",
              Kind.LOCKSTEP, ("C2", "C3", "C5", "C6", "C7", "C8", "C9", "C13", "C15", "C16",
                              API)),
    CheckSpec("restart", "lockstep with orderly restarts: close and reopen keeps every "
              "acknowledged entry; recovery requeues inflight, finishes cleanups",
              Kind.LOCKSTEP, ("C1", "C3", "C4", "C10", API)),
    CheckSpec("listing", "zone and domain listings agree with the model",
              Kind.LOCKSTEP, (API,), Level.OPTIONAL,
              (Capability.ZONE_LISTING,)),
    CheckSpec("bad-input", "foreign, consumed and wrong-type handles, closed queue, "
              "malformed addresses: the documented error, and nothing changes",
              Kind.BAD_INPUT, ("C9", "C7")),
    CheckSpec("many-recipients", "one message to 10,000 recipients: all listed, each "
              "entry its own recipient, drained to zero", Kind.SCALE, ("C2", "C6", "C8")),
    CheckSpec("limits", "at and beyond the declared limits (10,000 and 100,000 "
              "recipients, address and body sizes) and invalid schedules: InvalidInputError "
              "with a clear message, nothing half-written, no hang", Kind.BAD_INPUT,
              ("C9", "C2", "C6")),
    CheckSpec("threads", "threads racing send_start on the same entries and enqueuing "
              "together: one claim per entry, nothing lost", Kind.CONCURRENCY,
              ("C7", "C2", "C8")),
    CheckSpec("process-kill", "a child process runs a workload and is killed with SIGKILL "
              "at random moments; the reopened queue is judged by the pending-op oracle",
              Kind.PROCESS_KILL, ("C1", "C2", "C3", "C4", "C5", "C6", "C8", "C10"),
              crash=True),
    CheckSpec("recovery-rerun", "recovery itself is killed, then run again: the result is "
              "still one the crash condition allows, and recover() is idempotent",
              Kind.PROCESS_KILL, ("C10", "C1", "C3"), crash=True),
    CheckSpec("crash-exploration", "every crash point of short workloads (and random long "
              "ones) under each persistence model, judged by the pending-op oracle; "
              "crashes inside recovery; fsyncs failing with EIO",
              Kind.CRASH_EXPLORATION,
              ("C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9", "C10", "C15", "C16"),
              Level.OPTIONAL,
              (Capability.IO_SEAM,), crash=True, seam_only=True),
    CheckSpec("io-errors", "a disk call fails with EIO or ENOSPC; the outcome is judged "
              "against the model: failed with StorageIOError and the old or new state, or "
              "succeeded and the new state, after a restart and after a power cut",
              Kind.FAULTS, ("C9", "C2", "C5"), Level.OPTIONAL,
              (Capability.IO_SEAM,)),
    CheckSpec("second-open", "the queue opened again, in the same process and then in "
              "another, while the first open holds a claim: each is refused with a "
              "QueueError or opens without listing or adopting the held entry",
              Kind.CONCURRENCY, ("C4", "C7", "C9")),
    CheckSpec("multi-process", "processes sharing one queue race for the same entries; "
              "entries of a killed owner are found again", Kind.CONCURRENCY,
              ("C7", "C4"), Level.OPTIONAL, (Capability.MULTI_PROCESS,)),
    CheckSpec("reader-elsewhere", "another process inspects queued mail and reads it in "
              "pieces while this one delivers it and enqueues more: every reader gets the "
              "committed bytes, never another message's, never a false CorruptionError",
              Kind.CONCURRENCY, ("C13", "C9", "C6"), Level.OPTIONAL,
              (Capability.MULTI_PROCESS, Capability.HOLD)),
    CheckSpec("streaming", "a 100 MB body enqueued and read back in bounded memory, "
              "byte for byte", Kind.STREAMING, ("C6",), Level.OPTIONAL,
              (Capability.STREAMING_BODIES,)),
    CheckSpec("damage-at-rest", "every file the backend wrote is bit-flipped, cut short or "
              "removed in turn: opening refuses with a typed error or serves the rest, "
              "nothing is delivered altered, every message not delivered is named lost",
              Kind.DAMAGE, ("C6", "C3", "C9")),
    CheckSpec("hold", "hold, release and drop_held: a held entry is never claimed or "
              "listed as queued, keeps its schedule, stays held across reopening; "
              "(crashes inside them: lockstep crash rule and crash exploration)",
              Kind.LOCKSTEP, ("C14",), Level.OPTIONAL, (Capability.HOLD,)),
    CheckSpec("group-commit", "threads enqueue at once so their commits share sync rounds; "
              "one sync fails with EIO; after a power cut (weak) every acknowledged commit "
              "is there whole: a failed round acknowledged no one it covered, and no round "
              "acknowledged data that arrived after its sync began", Kind.FAULTS,
              ("C1", "C9"), Level.OPTIONAL, (Capability.IO_SEAM,)),
    CheckSpec("sync-rounds", "one caller is stopped inside each sync call of its operation "
              "while another makes its change and asks for a sync, for every pair of "
              "operations; no operation may return on a sync that began before its change "
              "(the sync-cover rule on the trace)", Kind.CONCURRENCY, ("C1", "C3", "C9"),
              Level.OPTIONAL, (Capability.IO_SEAM,)),
    CheckSpec("sync-rounds-crash", "sync-rounds' forced interleavings with the power cut "
              "before each of their mutating calls (quick: at acknowledgements) and at rest, "
              "under each persistence model; every operation that had returned shows its new "
              "state after recovery, one in flight its old or new", Kind.CRASH_EXPLORATION,
              ("C1", "C2", "C3", "C4", "C5", "C6", "C8", "C10"), Level.OPTIONAL,
              (Capability.IO_SEAM,), crash=True, seam_only=True),
    CheckSpec("linearizable", "threads and processes do random operations on the few "
              "entries of one queue; the recorded history must be linearizable against the "
              "model (exhaustive Wing-Gong search); with the I/O seam, one caller is stopped "
              "at each mutating call of its transition while another races it; mail's "
              "data, read back and compared byte for byte",
              Kind.CONCURRENCY, ("C7", "C3", "C5", "C6", "C8", API)),
    CheckSpec("lifecycle-edges", "a process is stopped inside each operation (at every "
              "mutating call through the seam, else by SIGSTOP) while another opens the "
              "queue, lists it, finds inflight entries and claims what it sees; then both "
              "finish: linearizable against the model, no live owner's entry requeued or "
              "adopted, nothing claimed twice, lost, quarantined or brought back; mail's "
              "data, read back and compared byte for byte",
              Kind.CONCURRENCY, ("C4", "C7", "C2", "C1", "C3", "C5", "C6"), Level.OPTIONAL,
              (Capability.MULTI_PROCESS,)),
    CheckSpec("bounded-disk", "the queue's whole directory tree, counted after it was "
              "drained: many messages at once (no more than the declared pool left), "
              "repeated restarts, repeated killed owners: it does not grow with use",
              Kind.SCALE, ("C8",)),
    CheckSpec("full-disk", "a real 4 MiB file system (a tmpfs in a mount namespace of a "
              "child) fills up: every refusal is NoSpaceError, the queue goes on once space "
              "is freed, opens on a disk another file filled, and (unless it declares it "
              "cannot) delivers while its own mail fills the disk; nothing is lost",
              Kind.FAULTS, ("C9", "C1", "C6", "C8")),
    CheckSpec("blackbox-power-loss", "a backend outside the I/O seam runs a workload in a "
              "child traced by strace; the disks a power cut may leave at each "
              "acknowledgement and inside operations are rebuilt from its system calls "
              "under each crash model and judged by the pending-op oracle",
              Kind.BLACKBOX_POWER_LOSS, ("C1", "C2", "C3", "C4", "C5", "C6", "C8"),
              Level.OPTIONAL, crash=True, every_model=True, excludes=(Capability.IO_SEAM,)),
)

BY_ID: dict[str, CheckSpec] = {c.id: c for c in CHECKS}


def checks_for(clause: str) -> list[CheckSpec]:
    """The checks that test ``clause``."""
    return [c for c in CHECKS if clause in c.clauses]


def clause_table() -> list[tuple[str, str, list[str]]]:
    """(clause, name, check ids) for every row, in order."""
    return [(k, v, [c.id for c in checks_for(k)]) for k, v in ROWS.items()]


_untested = [k for k in CLAUSES if not checks_for(k)]
if _untested:  # pragma: no cover - a guard on the table above
    raise RuntimeError(f"clauses without a check: {_untested}")
