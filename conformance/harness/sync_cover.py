"""The sync-cover rule: an operation acknowledged by a sync that began before its change.

A sync promises nothing about a change made after it began: the kernel may have written
out the file, or the directory, before the change reached it.  So an operation that
returned success on the strength of a sync must have had, for each thing it changed, a
sync that covers that thing, *began* after the operation's last change to it and *ended*
before the operation returned.  The rule reads a trace of ``faultinject.FaultyIO`` with
its ``OperationSpan`` list (``FaultyIO.operation``), the events' threads and their entry
and exit counters (``TraceEvent.began``/``ended``), replayed on the inode model so that
files are inodes, not names:

* what an operation changed: the calls its thread made between its start and its return:
  writes and truncates change a file's *data* (its inode); creates, links, unlinks and
  renames change the *names* of their parent directories (both, for a rename across two);
* what covers what, as the ``weak`` persistence model has it: an ``fsync``/``fdatasync``
  covers its file's data, an ``fsync_dir`` the names of that directory, a ``syncfs``
  everything; a sync that failed covers nothing;
* which changes it judges: those the operation was *waiting on a sync for*, that is, for
  which a sync covering them ended after the operation's last change to them and before it
  returned (a sync of any thread: a group commit's leader syncs for others).  A change no
  sync ended for (a temp name left to recovery, an unlink recovery finishes) is not judged:
  whether its loss is harmless is the crash exploration's to say, per crash point.

Only operations whose success the contract makes durable are judged (``JUDGED``).  A
finding is a change judged whose covering syncs ended in time all began before it: the
operation rode a sync already running.  The rule needs no luck with timing: it reads the
order of the calls, not a power cut.  It cannot see a change made for the operation by
another thread (a group commit's leader running a caller's step), which counts as the other
thread's; nor a change that no sync covered at all (crash exploration's); nor a sync that
never happened because a backend never asked for one.

A ride needs a sync of *another* thread, open while the operation's thread made its change
(a thread's own sync began after its own earlier calls).  So a trace of one thread has
nothing to judge, and a sync only overlaps anything if the seam holds it open:
``BackgroundSyncHoldIO`` holds open the syncs of every thread but the one driving the
operations, so that a backend's own background thread (a flusher, an early sync it starts
and waits for) shows in the single-threaded checks' traces at no cost to a backend without
one.  ``exposed`` picks, without replaying anything, the acknowledgements the rule can find
uncovered; a check that judges a long trace after every step judges only those.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from faultinject.disk import DiskImage
from faultinject.ops import Create, Link, Remove, Rename, SyncDir, SyncFile, SyncFs, Truncate, Write
from faultinject.replay import replay
from faultinject.seam import FaultPlan, FaultyIO
from faultinject.trace import SYNC_CALLS, OperationSpan, TraceEvent
from queue_ref.io import IO

#: The operations judged: those whose success the contract makes durable (``send_start``
#: and ``cleanup`` are not: a claim or a cleanup lost in a crash is redone after it).
JUDGED = frozenset({"commit", "send_done", "send_cancel", "reschedule", "drop", "hold",
                    "release", "drop_held"})
#: The clause an uncovered acknowledgement breaks, by operation (default C9).
CLAUSE_OF = {"commit": "C1", "send_done": "C3", "drop": "C3", "drop_held": "C3"}

Key = tuple[str, int]  # ("data", inode) or ("names", directory inode)

#: Seconds ``BackgroundSyncHoldIO`` holds open a sync of a thread other than its driver.
BACKGROUND_HOLD = 0.01


class BackgroundSyncHoldIO(FaultyIO):
    """A ``FaultyIO`` whose syncs made by threads other than the one that created it (the
    thread driving the Storage operations) are held open ``background_hold`` seconds, as
    on a disk (``FaultyIO.sync_hold``): a change the driving thread makes meanwhile comes
    after the sync's start in the trace, where the rule sees it.  The driving thread's own
    syncs are held ``sync_hold`` (default 0: nothing else runs while it waits on them), so
    a backend without threads of its own runs as fast, and records the same trace, as
    under ``FaultyIO``."""

    def __init__(self, root: str, plan: FaultPlan | None = None, inner: IO | None = None,
                 *, sync_hold: float = 0.0, background_hold: float = BACKGROUND_HOLD) -> None:
        if background_hold < 0:
            raise ValueError(f"background_hold must be >= 0 seconds, not {background_hold}")
        self.driver = threading.get_ident()
        self.background_hold = background_hold
        super().__init__(root, plan, inner, sync_hold=sync_hold)

    @property
    def sync_hold(self) -> float:
        """How long the calling thread's syncs are held open."""
        if threading.get_ident() == self.driver:
            return self._own_hold
        return self.background_hold

    @sync_hold.setter
    def sync_hold(self, seconds: float) -> None:
        self._own_hold = seconds


def exposed(events: Sequence[TraceEvent], operations: Sequence[OperationSpan]
            ) -> list[OperationSpan]:
    """The judged acknowledgements of ``operations`` during which a sync of another thread
    that was open while some other call was made (an overlap) ended: the only ones
    ``uncovered_acks`` can find uncovered (a ride is such a sync).  Reads the counters
    only, no replay: a trace of one thread, or whose syncs were instants, gives none."""
    spans = [s for s in operations
             if s.outcome == "ok" and s.ended >= 0 and s.name in JUDGED]
    if not spans:
        return []
    overlapping = [(e.thread, e.ended) for e in events
                   if e.name in SYNC_CALLS and e.ended > e.began + 1]
    return [s for s in spans
            if any(t != s.thread and s.began < end < s.ended for t, end in overlapping)]


@dataclass(frozen=True)
class Uncovered:
    """One operation acknowledged without a sync that began after its change to ``key``."""

    clause: str
    operation: OperationSpan
    what: str  # "the data of file #7" / "the names in directory #3 (queue)"
    change: TraceEvent
    rode: TraceEvent  # the covering sync that ended in time but began before the change
    excerpt: tuple[str, ...]

    def detail(self) -> str:
        return (f"{self.operation.name} returned success (thread {self.operation.thread}, "
                f"counter {self.operation.began}..{self.operation.ended}) though no sync "
                f"covering {self.what} began after its change {self.change.short()} "
                f"(at {self.change.ended}): it rode {self.rode.short()}, which began at "
                f"{self.rode.began}, before that change, and ended at {self.rode.ended}; "
                "a power cut right after the acknowledgement may undo it")


def _changes(op: object) -> tuple[Key, ...]:
    if isinstance(op, Write | Truncate):
        return (("data", op.ino),)
    if isinstance(op, Rename):
        return tuple(dict.fromkeys((("names", op.src_parent), ("names", op.dst_parent))))
    if isinstance(op, Create | Link | Remove):
        return (("names", op.parent),)
    return ()


def _covers(op: object, key: Key) -> bool:
    if isinstance(op, SyncFs):
        return op.ok
    if isinstance(op, SyncFile):
        return op.ok and key == ("data", op.ino)
    if isinstance(op, SyncDir):
        return op.ok and key == ("names", op.ino)
    return False


def _excerpt(events: Sequence[TraceEvent], low: int, high: int, limit: int = 40
             ) -> tuple[str, ...]:
    """The events that began in ``[low, high]`` of the counter, by thread, in order."""
    lines = [f"[{e.began}..{e.ended}] thread {e.thread}: {e.short()}"
             for e in sorted(events, key=lambda e: e.began) if low <= e.began <= high]
    if len(lines) > limit:
        lines = [*lines[:limit // 2], f"... {len(lines) - limit} more ...", *lines[-limit // 2:]]
    return tuple(lines)


def uncovered_acks(initial: DiskImage, events: Sequence[TraceEvent],
                   operations: Sequence[OperationSpan]) -> list[Uncovered]:
    """Every acknowledgement of ``operations`` that rode a sync begun before its change
    (see the module docstring); ``events`` is the whole trace of a run that started on
    ``initial``.  Raises ``faultinject.ModelError`` if the trace cannot be replayed."""
    replayed = replay(initial, events)
    ev = replayed.events
    names: dict[int, str] = {}
    for e in events:  # a directory's path, for the report, from the fsync_dir that named it
        if e.name == "fsync_dir" and e.args:
            names.setdefault(e.index, str(e.args[0]))
    changes: list[tuple[TraceEvent, Key]] = []
    syncs: list[tuple[TraceEvent, object]] = []
    dir_path: dict[int, str] = {}
    for op in replayed.ops:
        e = ev[op.index]
        if isinstance(op, SyncFile | SyncDir | SyncFs):
            if e.ended >= 0:
                syncs.append((e, op))
            if isinstance(op, SyncDir) and op.index in names:
                dir_path.setdefault(op.ino, names[op.index])
        else:
            changes.extend((e, k) for k in _changes(op))
    out: list[Uncovered] = []
    for span in operations:
        if span.outcome != "ok" or span.ended < 0 or span.name not in JUDGED:
            continue
        last: dict[Key, TraceEvent] = {}
        for e, k in changes:
            if (e.thread == span.thread and span.began < e.began and e.ended < span.ended
                    and (k not in last or e.began > last[k].began)):
                last[k] = e
        for k, change in last.items():
            ended_in_time = [s for s, op in syncs
                             if _covers(op, k) and change.ended < s.ended < span.ended]
            if not ended_in_time or any(s.began > change.ended for s in ended_in_time):
                continue
            rode = max(ended_in_time, key=lambda s: s.ended)
            what = (f"the data of file #{k[1]}" if k[0] == "data" else
                    f"the names in directory #{k[1]}"
                    + (f" ({dir_path[k[1]]})" if k[1] in dir_path else ""))
            out.append(Uncovered(CLAUSE_OF.get(span.name, "C9"), span, what, change, rode,
                                 _excerpt(events, min(rode.began, change.began), span.ended)))
    return out


def uncovered_on(io: FaultyIO, operations: Sequence[OperationSpan] | None = None
                 ) -> list[Uncovered]:
    """The rule on the trace ``io`` has recorded so far, for ``operations`` (all of its
    spans by default), replaying it only if some of them are ``exposed``.  Raises
    ``faultinject.ModelError`` if the trace cannot be replayed."""
    with io._mutex:  # other threads may still be adding events
        events = list(io.events)
    spans = exposed(events, io.operations if operations is None else operations)
    return uncovered_acks(io.initial, events, spans) if spans else []
