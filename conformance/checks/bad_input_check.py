"""Bad input: every misuse gets its documented error, and changes nothing.

Cases (each one a scenario ``bad-input:<case>``):

* handles: one from another Storage, one consumed already, one of the wrong type, one
  forged by hand -> ``MisuseError``;
* a closed Storage -> ``ClosedError`` from every call, ``close`` again is harmless;
* a committed or aborted Enqueuer -> ``ClosedError`` (or ``MisuseError``);
* addresses with NUL, CR or LF, too long, an empty recipient list, something that is
  not a Recipient, params with NUL -> ``InvalidInputError``;
* a queue path that is empty or holds NUL -> ``InvalidInputError``; one that names a
  regular file -> a ``QueueError`` (backends whose factory takes a root).

After each case the queue lists exactly what it listed before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from queue_ref.storage import (
    MAX_ADDRESS,
    ClosedError,
    InflightMail,
    InvalidInputError,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    QueueError,
    Recipient,
    Schedule,
    Storage,
)


class _Case:
    def __init__(self, name: str, findings: list[Finding]) -> None:
        self.name = name
        self.findings = findings

    def fail(self, detail: str, clause: str = "C9") -> None:
        self.findings.append(Finding(clause, detail, f"bad-input:{self.name}", NO_CRASH))

    def expect(self, what: str, errors: tuple[type[BaseException], ...],
               fn: Callable[[], object], clause: str = "C9") -> None:
        try:
            got = fn()
            if hasattr(got, "__next__"):
                got = list(got)  # type: ignore[call-overload]
        except errors:
            return
        except Exception as e:
            self.fail(f"{what} raised {type(e).__name__}: {e}; expected "
                      f"{' or '.join(t.__name__ for t in errors)}", clause)
            return
        self.fail(f"{what} returned {got!r}; expected "
                  f"{' or '.join(t.__name__ for t in errors)}", clause)


def _enqueue(store: Storage, n: int = 1, tag: str = "m") -> list[QueuedMail]:
    with store.enqueue(f"{tag}@example.org") as enq:
        enq.write(b"Subject: bad input\r\n\r\nbody\r\n")
        return enq.commit([Recipient(f"r{i}.{tag}@example.net", Schedule(10 + i))
                           for i in range(n)])


def _snapshot(store: Storage) -> tuple[list[tuple[str, Schedule]], list[str]]:
    return (sorted((h.entry_id, h.schedule) for h in store.list_queue()),
            sorted(h.entry_id for h in store.find_pending_cleanup()))


def _handle_cases(a: Storage, b: Storage, findings: list[Finding]) -> None:
    qa = _enqueue(a, 2, "a")
    qb = _enqueue(b, 1, "b")
    before = _snapshot(a)

    c = _Case("foreign-handle", findings)
    c.expect("send_start(handle of another Storage)", (MisuseError,),
             lambda: a.send_start(qb[0]), "C7")
    c.expect("drop(handle of another Storage)", (MisuseError,), lambda: a.drop(qb[0]))
    if _snapshot(a) != before:
        c.fail("a foreign handle changed the queue")

    c = _Case("consumed-handle", findings)
    spare = next(h for h in a.list_queue() if h.entry_id == qa[0].entry_id)
    inflight = a.send_start(qa[0])
    if inflight is None:
        c.fail("send_start of a fresh entry answered VANISHED", "API")
        return
    c.expect("send_start(consumed QueuedMail)", (MisuseError,), lambda: a.send_start(qa[0]),
             "C7")
    c.expect("reschedule(consumed QueuedMail)", (MisuseError,),
             lambda: a.reschedule(qa[0], Schedule(5)))
    got = a.send_start(spare)
    if got is not None:
        c.fail("send_start through a second handle of an inflight entry claimed it again",
               "C7")

    c = _Case("wrong-type", findings)
    c.expect("send_done(QueuedMail)", (MisuseError,), lambda: a.send_done(qa[1]))  # type: ignore[arg-type]
    c.expect("cleanup(InflightMail)", (MisuseError,), lambda: a.cleanup(inflight))  # type: ignore[arg-type]
    c.expect("read_inflight(QueuedMail)", (MisuseError,),
             lambda: a.read_inflight(qa[1]))  # type: ignore[arg-type]
    c.expect("send_start(InflightMail)", (MisuseError,), lambda: a.send_start(inflight))  # type: ignore[arg-type]
    c.expect("send_start(a str)", (MisuseError,), lambda: a.send_start("0.0"))  # type: ignore[arg-type]

    c = _Case("forged-handle", findings)
    forged = QueuedMail(qa[1].entry_id, qa[1].message_id, qa[1].schedule, object())
    c.expect("send_start(hand-made QueuedMail)", (MisuseError,), lambda: a.send_start(forged),
             "C7")
    forged_inflight = InflightMail(qa[1].entry_id, qa[1].message_id, qa[1].schedule, None)
    c.expect("send_done(hand-made InflightMail)", (MisuseError,),
             lambda: a.send_done(forged_inflight))

    c = _Case("spent-after-done", findings)
    done = a.send_done(inflight)
    if not isinstance(done, PendingCleanupMail):
        c.fail(f"send_done of an inflight entry returned {done!r}", "API")
        return
    c.expect("read_inflight(InflightMail already sent)", (MisuseError, ClosedError),
             lambda: a.read_inflight(inflight))
    c.expect("send_cancel(InflightMail already sent)", (MisuseError,),
             lambda: a.send_cancel(inflight, Schedule(3)), "C3")
    if not a.cleanup(done):
        c.fail("cleanup of a pending-cleanup entry returned False", "API")
    c.expect("cleanup(consumed PendingCleanupMail)", (MisuseError,), lambda: a.cleanup(done))


def _input_cases(s: Storage, findings: list[Finding]) -> None:
    before = _snapshot(s)
    c = _Case("bad-address", findings)
    for bad in ("a\x00b@example.org", "a@example.org\n", "a\r@example.org"):
        c.expect(f"enqueue(mail_from={bad!r}) then commit", (InvalidInputError,),
                 partial(_enqueue_with, s, bad, [Recipient("r@example.net", Schedule(1))]))
    long_addr = "x" * (MAX_ADDRESS + 1) + "@example.net"
    for rcpt in ("r\x00@example.net", "r@example.net\r\nRCPT TO:<x@y>", "\n", long_addr, ""):
        c.expect(f"commit(rcpt={rcpt[:40]!r})", (InvalidInputError,),
                 partial(_enqueue_with, s, "ok@example.org", [Recipient(rcpt, Schedule(1))]))
    c.expect("commit(zone with newline)", (InvalidInputError,),
             lambda: _enqueue_with(s, "ok@example.org",
                                   [Recipient("r@example.net", Schedule(1), "z\n")]))
    c = _Case("bad-recipients", findings)
    c.expect("commit([])", (InvalidInputError,), lambda: _enqueue_with(s, "ok@example.org", []))
    c.expect("commit(['r@example.net'])", (InvalidInputError,),
             lambda: _enqueue_with(s, "ok@example.org", ["r@example.net"]))  # type: ignore[list-item]
    c.expect("commit('r@example.net')", (InvalidInputError,),
             lambda: _enqueue_with(s, "ok@example.org", "r@example.net"))  # type: ignore[arg-type]
    c.expect("enqueue(params with NUL)", (InvalidInputError,),
             lambda: _enqueue_with(s, "ok@example.org", [Recipient("r@example.net",
                                                                  Schedule(1))],
                                   {"ENVID": "a\x00b"}))
    if _snapshot(s) != before:
        c.fail("a rejected enqueue left entries in the queue", "C2")

    c = _Case("finished-enqueuer", findings)
    enq = s.enqueue("ok@example.org")
    enq.write(b"x")
    enq.commit([Recipient("once@example.net", Schedule(1))])
    c.expect("write() after commit", (ClosedError, MisuseError), lambda: enq.write(b"y"))
    c.expect("commit() twice", (ClosedError, MisuseError),
             lambda: enq.commit([Recipient("twice@example.net", Schedule(1))]), "C2")
    enq2 = s.enqueue("ok@example.org")
    enq2.abort()
    c.expect("commit() after abort", (ClosedError, MisuseError),
             lambda: enq2.commit([Recipient("aborted@example.net", Schedule(1))]), "C2")
    enq2.abort()
    listed = list(s.list_queue())
    if len(listed) != len(before[0]) + 1:
        c.fail(f"after one good commit the queue lists {len(listed)} entries, expected "
               f"{len(before[0]) + 1}", "C2")


def _enqueue_with(s: Storage, mail_from: str, rcpts: list[Recipient],
                  params: dict[str, str] | None = None) -> object:
    enq = s.enqueue(mail_from, params)
    try:
        enq.write(b"body\r\n")
        return enq.commit(rcpts)
    finally:
        enq.abort()


def _closed_cases(s: Storage, findings: list[Finding]) -> None:
    q = _enqueue(s, 1, "closed")[0]
    f = s.send_start(q)
    c = _Case("closed-storage", findings)
    s.close()
    try:
        s.close()
    except Exception as e:
        c.fail(f"close() twice raised {type(e).__name__}: {e}")
    calls: dict[str, Callable[[], object]] = {
        "list_queue": lambda: s.list_queue(),
        "find_inflight": lambda: s.find_inflight(),
        "find_pending_cleanup": lambda: s.find_pending_cleanup(),
        "enqueue": lambda: s.enqueue("x@example.org"),
        "send_cancel": lambda: s.send_cancel(f, Schedule(1)),  # type: ignore[arg-type]
        "read_inflight": lambda: s.read_inflight(f),  # type: ignore[arg-type]
        "recover": s.recover,
        "footprint": s.footprint,
    }
    for name, fn in calls.items():
        c.expect(f"{name} on a closed Storage", (ClosedError,), fn)


def _open_close(backend: Backend, root: str) -> object:
    store = backend.open(root)
    store.close()
    return store


def _root_cases(backend: Backend, findings: list[Finding]) -> None:
    """A queue path that is empty or holds NUL is the caller's mistake (C12:
    ``InvalidInputError``, not whatever the OS says about it); a path that names a
    regular file is refused with a ``QueueError`` (a ``StorageIOError``, say), never a
    bare ``OSError`` or ``ValueError`` that a relay's error handling does not expect."""
    c = _Case("bad-root", findings)
    here = os.getcwd()
    scratch = tempfile.mkdtemp(prefix="queue-ref-badinput-cwd-")
    try:
        os.chdir(scratch)  # a backend that takes "" for "here" makes its queue in scratch
        for bad in ("", "queue\x00dir"):
            c.expect(f"opening the queue at {bad!r}", (InvalidInputError,),
                     partial(_open_close, backend, bad), "C12")
    finally:
        os.chdir(here)
        shutil.rmtree(scratch, ignore_errors=True)
    with tempfile.NamedTemporaryFile(prefix="queue-ref-badinput-") as f:
        c.expect("opening the queue at a regular file", (QueueError,),
                 partial(_open_close, backend, f.name))


def run_check(backend: Backend, roots: Callable[[], str]) -> CheckResult:
    start = time.perf_counter()
    findings: list[Finding] = []
    stores: list[Storage] = []
    try:
        a = backend.open(roots())
        stores.append(a)
        b = backend.open(roots())
        stores.append(b)
        parts: list[Callable[[], None]] = [
            partial(_handle_cases, a, b, findings), partial(_input_cases, a, findings),
            partial(_closed_cases, a, findings)]
        if backend.takes_root:
            parts.append(partial(_root_cases, backend, findings))
        for part in parts:
            try:
                part()
            except QueueError as e:
                findings.append(Finding("C9", f"a valid call raised {type(e).__name__}: {e}",
                                        "bad-input:setup", NO_CRASH))
    finally:
        for st in stores:
            try:
                st.close()
            except Exception as e:
                findings.append(Finding("C9", f"close raised {type(e).__name__}: {e}",
                                        "bad-input:close", NO_CRASH))
    return finished("bad-input", NO_CRASH, findings, seconds=time.perf_counter() - start)


def run(backend: Backend) -> CheckResult:
    dirs: list[str] = []

    def roots() -> str:
        dirs.append(tempfile.mkdtemp(prefix="queue-ref-badinput-"))
        return dirs[-1]

    try:
        return run_check(backend, roots)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
