"""Bounded disk: what a drained queue leaves on disk does not grow with use (C8).

``footprint()`` is the backend's own count of what it keeps, so a backend that forgets
something forgets to count it too.  This check counts the queue's whole directory tree
instead (every name: files, directories, links; and the bytes of its regular files, a
file with several names counted once), and judges it after the queue was drained, three
ways, each repeated:

* **at once**: one open queue enqueues more and more messages at once, then delivers
  and cleans up all of them.  What it keeps for reuse (``Limits.pool_files``, the
  filesystem queue's spare files) may stay, up to the declared count; beyond it, names
  that track how many messages were in the queue at once are a leak.
* **restarts**: the queue is closed and opened again, with a little mail each time.
* **killed owners**: a child process opens the queue, enqueues, claims one entry and is
  killed (SIGKILL); the queue is opened again (recovery), drained and closed.  With the
  I/O seam the child first enqueues a message of three recipients and dies inside it,
  right after one of its mutating disk calls (a different one each round), so what a
  commit makes per recipient is left half made; every other such child runs on a file
  system of ``FEW_NAMES`` names per file, so what a store makes when a file is full of
  names (the filesystem queue's fresh domain anchor) is left half made too.  A killed
  round's drained tree may hold no *kind* of name (its path, ids masked) that no clean
  restart round's holds: a leftover that the slack on counts would hide is a new kind.

After each round of the last two the queue is closed and its tree measured.  The tree
may change from round to round (a log-structured store writes new tables and logs), but
the last rounds may not hold more than the first ones plus a small slack: a name left
behind at each open (a dead owner's lock file, a log copied aside every time) shows as a
steady climb.  Scenario ``bounded-disk:<rounds>``.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from conformance.crashexplore.traced_runs import scratch_dir
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.child_process import Channel, Child
from conformance.harness.few_names_io import FewNamesIO
from conformance.harness.stop_gate_io import killing_io
from conformance.harness.suite_profiles import Profile
from queue_ref.io import OsIO
from queue_ref.storage import Recipient, Schedule, Storage

BODY = b"Subject: bounded disk\r\n\r\n" + b"a line of the body\r\n" * 12
#: Names the tree may hold beyond the declared pool after a drain (a log-structured
#: store's tables and logs come and go), and how much the last rounds may exceed the
#: first ones by.
SLACK_NAMES = 16
CLIMB_NAMES = 3
#: Names a killed round's drained tree may hold beyond the most a clean restart left (a
#: log-structured store's tables and logs come and go).
KILLED_SLACK = 2
CLIMB_BYTES = 256 * 1024
#: The bursts hold as many messages as the declared pool has files (at most this many)
#: and 16, 64, 256 more; a larger pool is still the bound the tree is judged by.
MAX_BURST_POOL = 4096


@dataclass(frozen=True)
class Tree:
    names: int
    bytes: int
    #: the kinds of name the tree holds: paths with their ids (runs of digits and of hex
    #: digits) masked, ``domains/#/anchor.#`` for ``domains/3f/anchor.18eb...``
    kinds: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return f"{self.names} names, {self.bytes} bytes"


def measure(root: str) -> Tree:
    """Every name under ``root`` (not ``root`` itself) and the bytes of its regular files,
    each file once however many names it has."""
    names, size = 0, 0
    seen: set[tuple[int, int]] = set()
    kinds: set[str] = set()
    for top, dirs, files in os.walk(root):
        for n in (*dirs, *files):
            names += 1
            kinds.add(name_kind(os.path.relpath(os.path.join(top, n), root)))
            try:
                st = os.lstat(os.path.join(top, n))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                size += st.st_size
    return Tree(names, size, frozenset(kinds))


def name_kind(rel: str) -> str:
    """``rel`` with its ids masked: runs of hex digits that hold a digit, and runs of
    digits (``domains/3f/anchor.18ebc1769b02a4f8`` -> ``domains/#/anchor.#``)."""
    return re.sub(r"[0-9a-f]*[0-9][0-9a-f]*", "#", rel)


def _enqueue(store: Storage, n: int, tag: str) -> None:
    for i in range(n):
        with store.enqueue(f"{tag}{i}@example.org") as enq:
            enq.write(BODY)
            enq.commit([Recipient(f"r{i}@example.net", Schedule(i))])


def drain(store: Storage) -> None:
    """Deliver and clean up everything the queue holds (claims of dead owners too)."""
    claimed = [*store.find_inflight()]
    claimed += [f for f in (store.send_start(h) for h in store.list_queue()) if f is not None]
    for f in claimed:
        p = store.send_done(f)
        if p is not None:
            store.cleanup(p)
    for p in store.find_pending_cleanup():
        store.cleanup(p)


def _climb(series: list[Tree]) -> str | None:
    """Whether the last third of the rounds holds more than the first third plus slack."""
    k = max(1, len(series) // 3)
    first, last = series[:k], series[-k:]
    top_names = max(t.names for t in first)
    top_bytes = max(t.bytes for t in first)
    if min(t.names for t in last) > top_names + CLIMB_NAMES:
        return (f"names climb from at most {top_names} in the first {k} rounds to at least "
                f"{min(t.names for t in last)} in the last {k}")
    if min(t.bytes for t in last) > 2 * top_bytes + CLIMB_BYTES:
        return (f"bytes climb from at most {top_bytes} in the first {k} rounds to at least "
                f"{min(t.bytes for t in last)} in the last {k}")
    return None


def _series(series: list[Tree]) -> str:
    return ", ".join(f"{t.names}/{t.bytes}" for t in series)


def _at_once(backend: Backend, root: str, batches: tuple[int, ...],
             fail: Callable[[str, str], None]) -> dict[str, int]:
    store = backend.open(root)
    try:
        pool = store.limits.pool_files
        for i in range(4):
            _enqueue(store, 1, f"warm{i}.")
            drain(store)
        base = measure(root)
        after: list[tuple[int, Tree]] = []
        for n in (min(pool, MAX_BURST_POOL) + b for b in batches):
            _enqueue(store, n, f"batch{n}.")
            drain(store)
            after.append((n, measure(root)))
    finally:
        store.close()
    top = max(t.names for _, t in after)
    if top > base.names + pool + SLACK_NAMES:
        steps = "; ".join(f"after {n} at once: {t}" for n, t in after)
        fail("C8", f"a drained open queue holds {top - base.names} names more than after "
                   f"messages one at a time ({base}; {steps}); it declares a pool of "
                   f"{pool} files (Limits.pool_files), and may keep {SLACK_NAMES} more")
    return {"at_once_base_names": base.names, "at_once_top_names": top, "pool_files": pool}


def _open_drain_close(backend: Backend, root: str, enqueue: int, tag: str) -> Tree:
    """Open the queue (recovery runs), enqueue ``enqueue`` messages, deliver and clean up
    everything it holds, close it: the tree it leaves."""
    store = backend.open(root)
    try:
        _enqueue(store, enqueue, tag)
        drain(store)
    finally:
        store.close()
    return measure(root)


def _judge(series: list[Tree], what: str, fail: Callable[[str, str], None]) -> None:
    climb = _climb(series)
    if climb:
        fail("C8", f"{what}: the closed queue's tree grows: {climb} (names/bytes after each "
                   f"round: {_series(series)})")


def _restarts(backend: Backend, root: str, rounds: int,
              fail: Callable[[str, str], None]) -> list[Tree]:
    series = [_open_drain_close(backend, root, 3, f"restart{r}.") for r in range(rounds)]
    _judge(series, f"closed and opened {rounds} times, draining a few messages each time",
           fail)
    return series


#: Recipients of the enqueue a doomed owner with the I/O seam dies inside, and the stop
#: points it dies at (round r: the ``r % len``-th), each right after that mutating call:
#: what a commit makes per recipient (hard links, links, domain index links) is met half
#: made, and a dead owner's leftovers that recovery never removes climb round by round.
WIDE_RCPTS = 3
KILL_STOPS = (4, 7, 10, 13, 5, 8, 11, 14, 6, 9, 12, 3)
#: Every other doomed owner runs on a file system of this many names per file (as some
#: are): what a store makes when a file is full of names (the filesystem queue's fresh
#: domain anchor, replacing a full one) is met half made too.  At 7 the wide message's
#: file just holds its names (its own, and a link and a reference per recipient), and
#: the ``FULL_FIRST`` messages before it to the same domain leave its anchor one name
#: short of full, so the wide enqueue's second index link finds it full.
FEW_NAMES = 7
FULL_FIRST = FEW_NAMES - 2


def _doomed_owner(ch: Channel, backend: Backend, root: str, tag: str, stop: int,
                  few_names: bool = False) -> None:
    """Open, enqueue, claim one entry, say so, and wait to be killed; with the I/O seam
    (``stop`` > 0), first die right after mutating call ``stop`` of an enqueue of
    ``WIDE_RCPTS`` recipients (or say so if it finishes before), on a file system of
    ``FEW_NAMES`` names per file when ``few_names``."""
    io = killing_io(FewNamesIO(FEW_NAMES) if few_names else OsIO()) if stop else None
    store = backend.open(root, io) if io is not None else backend.open(root)
    _enqueue(store, FULL_FIRST if few_names else 2, tag)
    for h in store.list_queue():
        if store.send_start(h) is not None:
            break
    if io is not None:
        io.arm(stop)
        with store.enqueue(f"{tag}wide@example.org") as enq:
            enq.write(BODY)
            enq.commit([Recipient(f"w{k}@example.net", Schedule(0))
                        for k in range(WIDE_RCPTS)])
        io.disarm()
    ch.send({"ready": True})
    while True:
        time.sleep(1)


def _killed_owners(backend: Backend, root: str, rounds: int,
                   fail: Callable[[str, str], None]) -> list[Tree]:
    series = []
    for r in range(rounds):
        stop = KILL_STOPS[r % len(KILL_STOPS)] if backend.takes_io else 0
        with Child(_doomed_owner, backend, root, f"killed{r}.", stop, r % 2 == 1) as child:
            for msg in child.messages():  # ends early when the child killed itself
                if "crashed" in msg:
                    fail("C9", f"round {r}: the child failed before it was killed: "
                               f"{msg['crashed']}")
                    return series
                if msg.get("ready"):
                    break
            child.kill()
        series.append(_open_drain_close(backend, root, 0, ""))
    _judge(series, f"a process that opened the queue and enqueued was killed {rounds} "
                   "times, and the queue opened, drained and closed after each", fail)
    return series


def _judge_killed(restarted: list[Tree], killed: list[Tree],
                  fail: Callable[[str, str], None]) -> None:
    """A dead owner leaves nothing that its recovery and a drain keep: after each killed
    round the tree holds at most ``KILLED_SLACK`` names more than the most any clean
    restart round left (a store whose owners' ids repeat, as the seam's deterministic
    openers' do, reuses a leftover's names, so a leak need not climb)."""
    if not restarted or not killed:
        return
    known = frozenset().union(*(t.kinds for t in restarted))
    for r, t in enumerate(killed):
        new_kinds = sorted(t.kinds - known)
        if new_kinds:
            fail("C8", f"after a process was killed inside its enqueue (round {r}) and the "
                       "queue opened, drained and closed, its tree holds names of a kind no "
                       f"clean restart round leaves: {', '.join(new_kinds[:5])}: the dead "
                       "owner's leftovers were kept")
            break
    top = max(t.names for t in restarted)
    over = [(r, t) for r, t in enumerate(killed) if t.names > top + KILLED_SLACK]
    if over:
        r, t = over[0]
        fail("C8", f"after a process was killed inside its enqueue (round {r}) and the queue "
                   f"opened, drained and closed, its tree holds {t.names} names; a clean "
                   f"restart round leaves at most {top}: the dead owner's leftovers were "
                   f"kept (names/bytes after each killed round: {_series(killed)})")


def run(backend: Backend, profile: Profile) -> CheckResult:
    if not backend.takes_root:
        return CheckResult("bounded-disk", NO_CRASH, Status.UNSUPPORTED,
                           note="the factory takes no directory: there is no tree to count")
    start = time.perf_counter()
    findings: list[Finding] = []
    rounds = profile.growth_rounds
    scenario = f"bounded-disk:{rounds}"

    def fail(clause: str, detail: str) -> None:
        findings.append(Finding(clause, detail, scenario, NO_CRASH))

    with scratch_dir("queue-ref-growth-") as root:
        stats = _at_once(backend, root, (16, 64, 256), fail)
    with scratch_dir("queue-ref-growth-") as root:
        restarted = _restarts(backend, root, rounds, fail)
    with scratch_dir("queue-ref-growth-") as root:
        killed = _killed_owners(backend, root, rounds, fail)
    stats["restart_rounds"], stats["killed_rounds"] = len(restarted), len(killed)
    _judge_killed(restarted, killed, fail)
    return finished("bounded-disk", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    stats=stats)
