"""io-errors' read trials: a disk call that only reads fails (EIO) inside a read operation.

A failing disk fails reads too: ``stat``, ``readdir`` and ``pread`` return EIO on a bad
sector as writes do.  The queue is filled through ``ReadFaultIO`` (three messages, one of
two recipients and one of a body of ``BODY`` bytes; one entry claimed, one delivered and
awaiting cleanup), then each read operation (``list_queue``, ``scan_queue``, ``find_inflight``,
``find_pending_cleanup``, ``footprint``, reading a claimed body, ``inspect_entry`` and
``list_domain`` where supported) is run once without a fault, counting the read calls it
makes, and then once per trial with one of those calls failing.  C9 requires:

* the operation raises ``StorageIOError`` (the disk failed: retry later), or returns what
  it returned without the fault (a store that answers from memory, or retries, may); a
  raw ``OSError``, a ``CorruptionError`` (the bytes are fine, the disk is not) or an
  answer short of entries (an empty listing on a failing disk) breaks C9;
* the failed read changed nothing: the operation run again without the fault answers as
  before, and the queue lists the same entries in every state (a store that takes a read
  error for damage and quarantines the message loses mail on a transient error: C6).

Scenario ``io-errors:read:<operation>:<n>``: the n-th read call of that operation fails.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import Finding
from queue_ref.io import IO, OsIO
from queue_ref.storage import (
    CorruptionError,
    InflightMail,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
    StorageIOError,
    UnsupportedError,
)

#: The seam's calls that only read (and the checks built on them).
READS = frozenset({"open_read", "read", "pread", "fsize", "readlink", "listdir", "iter_names",
                   "lstat", "exists", "is_dir", "is_symlink", "same_file"})
#: Trials per operation: its read calls evenly spread (the first and last among them).
PER_OPERATION = 6
BODY = 200_000
DOMAIN = "example.net"


class ReadFaultIO(IO):
    """Forwards every call to ``inner``; counts the read calls made while ``counting``,
    and fails the ``fail_at``-th of them (0-based) with EIO."""

    def __init__(self, inner: IO) -> None:
        self.inner = inner
        self.counting = False
        self.reads = 0
        self.fail_at: int | None = None
        self.failed = ""

    def arm(self, fail_at: int | None) -> None:
        self.counting, self.reads, self.fail_at, self.failed = True, 0, fail_at, ""

    def disarm(self) -> None:
        self.counting = False


def _forward(name: str) -> Callable[..., object]:
    def call(self: ReadFaultIO, *args: object, **kwargs: object) -> object:
        if self.counting and name in READS:
            n = self.reads
            self.reads += 1
            if n == self.fail_at:
                self.failed = f"{name} (read call #{n})"
                raise OSError(errno.EIO, f"injected fault in {name} (read call #{n})")
        return getattr(self.inner, name)(*args, **kwargs)
    return call


for _name, _fn in vars(IO).items():
    if callable(_fn) and not _name.startswith("_"):
        setattr(ReadFaultIO, _name, _forward(_name))


@dataclass
class _Queue:
    store: Storage
    io: ReadFaultIO
    claimed: InflightMail
    queued: QueuedMail


class FillFailed(Exception):
    """Filling the trials' queue failed with no fault injected (the disk is fine)."""


def _fill(backend: Backend, root: str) -> _Queue:
    try:
        return _filled(backend, root)
    except Exception as e:
        raise FillFailed(f"{type(e).__name__}: {e}") from e


def _filled(backend: Backend, root: str) -> _Queue:
    io = ReadFaultIO(OsIO())
    store = backend.open(root, io)
    for i, (rcpts, size) in enumerate(((1, 300), (2, 300), (1, BODY))):
        with store.enqueue(f"s{i}@example.org") as enq:
            enq.write(b"Subject: read %d\r\n\r\n" % i + b"r" * size)
            enq.commit([Recipient(f"r{i}.{k}@{DOMAIN}", Schedule(i)) for k in range(rcpts)])
    listed = sorted(store.list_queue(), key=lambda h: (h.schedule.at, h.entry_id))
    claimed = store.send_start(listed[-1])  # the large body's entry
    done = store.send_start(listed[1])  # an entry of the message of two
    if claimed is None or done is None or store.send_done(done) is None:
        raise RuntimeError("filling the read trials' queue: its only user could not claim "
                           "and deliver its entries")
    return _Queue(store, io, claimed, listed[0])


def _operations(q: _Queue) -> dict[str, Callable[[], object]]:
    s = q.store

    def body() -> str:
        with s.read_inflight(q.claimed) as r:
            return hashlib.sha256(r.read_all()).hexdigest()

    def inspect() -> str | None:
        r = s.inspect_entry(q.queued)
        if r is None:
            return None
        with r:
            return hashlib.sha256(r.read_all()).hexdigest()

    # inspect_entry and list_domain raise UnsupportedError where not declared: no trial
    return {
        "list_queue": lambda: sorted(h.entry_id for h in s.list_queue()),
        "scan_queue": lambda: sorted(h.entry_id for h in s.scan_queue()),
        "find_inflight": lambda: sorted(h.entry_id for h in s.find_inflight()),
        "find_pending_cleanup": lambda: sorted(h.entry_id for h in s.find_pending_cleanup()),
        "footprint": s.footprint,
        "read_inflight": body,
        "inspect_entry": inspect,
        "list_domain": lambda: sorted(h.entry_id for h in s.list_domain(DOMAIN)),
    }


OPERATIONS = ("list_queue", "scan_queue", "find_inflight", "find_pending_cleanup", "footprint",
              "read_inflight", "inspect_entry", "list_domain")


def _state(s: Storage) -> tuple[list[str], ...]:
    return (sorted(h.entry_id for h in s.list_queue()),
            sorted(h.entry_id for h in s.find_inflight()),
            sorted(h.entry_id for h in s.find_pending_cleanup()))


def _positions(total: int) -> list[int]:
    if total <= PER_OPERATION:
        return list(range(total))
    return sorted({round(k * (total - 1) / (PER_OPERATION - 1)) for k in range(PER_OPERATION)})


def scenario(op: str, n: int) -> str:
    return f"io-errors:read:{op}:{n}"


def _trial(backend: Backend, op: str, n: int | None) -> tuple[int, list[tuple[str, str]]]:
    """Fill a queue, run ``op`` without a fault (counting its reads), then, unless ``n`` is
    None, with its ``n``-th read failing.  (reads counted, problems)."""
    root = tempfile.mkdtemp(prefix="queue-ref-reads-")
    try:
        q = _fill(backend, root)
        try:
            run = _operations(q).get(op)
            if run is None:
                return 0, []
            q.io.arm(None)
            try:
                want = run()
            except UnsupportedError:
                return 0, []
            finally:
                q.io.disarm()
            total = q.io.reads
            if n is None:
                return total, []
            before = _state(q.store)
            q.io.arm(n)
            try:
                got: object = run()
                error: BaseException | None = None
            except Exception as e:
                got, error = None, e
            finally:
                q.io.disarm()
            where = f"{op} with {q.io.failed or f'read call #{n}'} failing (EIO)"
            found: list[tuple[str, str]] = []
            if not q.io.failed:
                return total, []  # fewer reads than counted: no fault took place
            if error is not None and not isinstance(error, StorageIOError):
                clause = "C9"
                what = ("the disk failed, the bytes did not: a CorruptionError quarantines "
                        "mail on a transient error" if isinstance(error, CorruptionError)
                        else "expected StorageIOError")
                found.append((clause, f"{where} raised {type(error).__name__}: {error}; "
                                      f"{what}"))
            elif error is None and got != want:
                found.append(("C9", f"{where} returned {got!r}; without the fault it returns "
                                    f"{want!r}: a failing disk must be reported, not "
                                    "answered as something else"))
            try:
                again = run()
                after = _state(q.store)
            except Exception as e:
                found.append(("C9", f"after {where}, running it again without a fault "
                                    f"raised {type(e).__name__}: {e}"))
                return total, found
            if again != want:
                found.append(("C9", f"after {where}, running it again without a fault "
                                    f"returns {again!r}, not {want!r} as before"))
            if after != before:
                found.append(("C6", f"after {where}, the queue lists (queued, inflight, "
                                    f"pending cleanup) {after}, before it {before}: a failed "
                                    "read must change nothing"))
            return total, found
        finally:
            q.store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


STEPS = (f"fill a queue: 3 messages (one of two recipients, one of a {BODY:,}-byte body), "
         "claim an entry, deliver another",)


def _finding(op: str, n: int, clause: str, detail: str) -> Finding:
    steps = (*STEPS, f"{op}: its read call #{n} fails with EIO", f"{op} again without a fault")
    return Finding(clause, detail, scenario(op, n), NO_CRASH, steps)


def run_reads(backend: Backend) -> tuple[int, list[Finding]]:
    """Every operation, each at up to ``PER_OPERATION`` of its read calls.  (trials,
    findings)."""
    if not backend.takes_io:
        return 0, []
    trials = 0
    findings: list[Finding] = []
    try:
        for op in OPERATIONS:
            total, _ = _trial(backend, op, None)
            for n in _positions(total):
                trials += 1
                _, found = _trial(backend, op, n)
                findings += [_finding(op, n, c, d) for c, d in found]
    except FillFailed as e:
        findings.append(Finding("C9", f"filling the read trials' queue raised {e} with no "
                                      "fault injected (the disk is fine)",
                                scenario("list_queue", 0), NO_CRASH, STEPS))
    return trials, findings


def replay_read(backend: Backend, op: str, n: int) -> list[Finding]:
    try:
        return [_finding(op, n, c, d) for c, d in _trial(backend, op, n)[1]]
    except FillFailed as e:
        return [Finding("C9", f"filling the read trials' queue raised {e} with no fault "
                              "injected (the disk is fine)", scenario(op, n), NO_CRASH, STEPS)]
