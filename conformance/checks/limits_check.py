"""Limits: at and beyond what a backend declares (``Storage.limits``), and invalid values.

In a child process (a hang is a finding too, not a stuck suite), on a fresh queue:

* ``recipients-<N>`` for N = 10,000 and 100,000, exactly the declared ``max_recipients``
  (up to ``AT_LIMIT_MAX``) and one more: within the limit, ``commit`` returns N distinct handles and the queue
  lists N entries (10,000 within a limit is the many-recipients check's); beyond it,
  ``commit`` raises ``InvalidInputError`` whose message says why (it names the
  recipients), nothing is stored (the listing and the footprint after ``abort`` are what
  they were: no half-written message), and the queue takes the next message;
* ``address-at-limit``: a recipient and a sender of exactly ``max_address`` characters are
  stored and read back intact; one more character is refused with ``InvalidInputError``;
* ``body-beyond-limit``: with a declared ``max_body_bytes``, one byte more is refused by
  ``write`` or ``commit`` with ``InvalidInputError`` and nothing is stored;
* ``schedule``: schedules with a negative, float, NaN or infinite time, a negative attempt
  count, or a time beyond 64 bits (forged past ``Schedule``'s own checks, as a caller's
  own schedule type might be) given to ``commit``, ``reschedule`` and ``send_cancel``
  raise ``InvalidInputError`` and change nothing.

A bare ``ValueError`` (or any other exception), a hang, or a success beyond a limit breaks
C9; a half-written message C2; an address not read back as written C6.  Scenario
``limits:<case>``; ``queue-ref certify FACTORY --scenario limits:<case>`` runs the check
again and shows that case's findings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, finished
from conformance.harness.child_process import Channel, Child, ChildTimeout
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import (
    InflightMail,
    InvalidInputError,
    QueuedMail,
    Recipient,
    Schedule,
    Storage,
)

CHECK = "limits"
RECIPIENT_COUNTS = (10_000, 100_000)
#: The many-recipients check covers this count within a limit.
COVERED_ELSEWHERE = 10_000
BODY = b"Subject: limits\r\n\r\nbody\r\n"
#: Seconds one case may take before the child counts as hung.
CASE_TIMEOUT = 300.0

Problems = list[tuple[str, str]]


def forged_schedule(at: object, attempts: object = 0) -> Schedule:
    """A Schedule with any field values, past its constructor's checks."""
    s = object.__new__(Schedule)
    object.__setattr__(s, "at", at)
    object.__setattr__(s, "attempts", attempts)
    return s


BAD_SCHEDULES: tuple[tuple[str, object, object], ...] = (
    ("negative time", -1, 0), ("float time", 1.5, 0), ("NaN time", float("nan"), 0),
    ("infinite time", float("inf"), 0), ("negative attempts", 5, -2),
    ("time beyond 64 bits", 2**64, 0),
)


def _snapshot(store: Storage) -> tuple[object, ...]:
    fp = store.footprint()
    return (sorted((h.entry_id, h.schedule.at, h.schedule.attempts)
                   for h in store.list_queue()), fp.objects, fp.bytes)


def _expect_invalid(what: str, fn: Callable[[], object], problems: Problems,
                    words: tuple[str, ...] = ()) -> bool:
    """``fn`` must raise InvalidInputError (whose message holds one of ``words``)."""
    try:
        got = fn()
    except InvalidInputError as e:
        if words and not any(w in str(e).lower() for w in words):
            problems.append(("C9", f"{what} raised InvalidInputError({str(e)!r}), which does "
                                   f"not say why (expected it to mention {' or '.join(words)})"))
        return True
    except Exception as e:
        problems.append(("C9", f"{what} raised {type(e).__name__}: {e}; expected "
                               "InvalidInputError"))
        return False
    problems.append(("C9", f"{what} returned {type(got).__name__} instead of raising "
                           "InvalidInputError"))
    return False


def _enqueue(store: Storage, rcpts: list[Recipient], mail_from: str = "limits@example.org",
             body: bytes = BODY) -> list[QueuedMail]:
    with store.enqueue(mail_from) as enq:
        enq.write(body)
        return enq.commit(rcpts)


def _still_usable(store: Storage, what: str, problems: Problems) -> None:
    try:
        _enqueue(store, [Recipient("after@example.net", Schedule(1))])
    except Exception as e:
        problems.append(("C9", f"after {what}, a valid enqueue raised {type(e).__name__}: {e}"))


def _recipients(store: Storage, n: int, limit: int | None, problems: Problems) -> None:
    rcpts = [Recipient(f"r{i}@d{i % 97}.example", Schedule(i)) for i in range(n)]
    if limit is not None and n > limit:
        before = _snapshot(store)
        enq = store.enqueue("many@example.org")
        try:
            enq.write(BODY)
            _expect_invalid(f"commit of {n} recipients (declared limit {limit})",
                            lambda: enq.commit(rcpts), problems, ("recipient",))
        finally:
            enq.abort()
        after = _snapshot(store)
        if after != before:
            problems.append(("C2", f"a refused commit of {n} recipients left a half-written "
                                   f"message: the queue lists {len(after[0])} entries "  # type: ignore[arg-type]
                                   f"({len(before[0])} before) and holds {after[1]} objects, "  # type: ignore[arg-type]
                                   f"{after[2]} bytes ({before[1]}, {before[2]} before)"))
        _still_usable(store, f"a refused commit of {n} recipients", problems)
        return
    try:
        got = _enqueue(store, rcpts)
    except Exception as e:
        problems.append(("C9", f"commit of {n} recipients, within the declared limit "
                               f"{limit}, raised {type(e).__name__}: {e}"))
        return
    if len(got) != n or len({h.entry_id for h in got}) != n:
        problems.append(("C2", f"commit of {n} recipients returned {len(got)} handles, "
                               f"{len({h.entry_id for h in got})} distinct"))
        return
    ids = {h.entry_id for h in got}
    listed = sum(1 for h in store.list_queue() if h.entry_id in ids)
    if listed != n:
        problems.append(("C2", f"after a commit of {n} recipients the queue lists {listed}"))


def _address(store: Storage, max_address: int, problems: Problems) -> None:
    domain = "@example.net"
    rcpt = "r" * (max_address - len(domain)) + domain
    sender = "s" * (max_address - len(domain)) + domain
    try:
        (q,) = _enqueue(store, [Recipient(rcpt, Schedule(1))], mail_from=sender)
    except Exception as e:
        problems.append(("C9", f"addresses of exactly {max_address} characters (the declared "
                               f"limit) were refused: {type(e).__name__}: {e}"))
        return
    f = store.send_start(q)
    if not isinstance(f, InflightMail):
        problems.append(("C9", f"send_start of a fresh entry returned {f!r}"))
        return
    with store.read_inflight(f) as r:
        meta, body = r.meta, r.read_all()
    if (meta.rcpt, meta.mail_from, body) != (rcpt, sender, BODY):
        problems.append(("C6", f"addresses of {max_address} characters read back as "
                               f"{len(meta.rcpt)} and {len(meta.mail_from)} characters"))
    before = _snapshot(store)
    _expect_invalid(f"commit of a recipient of {max_address + 1} characters",
                    lambda: _enqueue(store, [Recipient("r" + rcpt, Schedule(1))]), problems)
    _expect_invalid(f"an enqueue from a sender of {max_address + 1} characters",
                    lambda: _enqueue(store, [Recipient("ok@example.net", Schedule(1))],
                                     mail_from="s" + sender), problems)
    if _snapshot(store) != before:
        problems.append(("C2", "a refused over-long address left entries or bytes behind"))


def _body(store: Storage, max_body: int, problems: Problems) -> None:
    before = _snapshot(store)
    enq = store.enqueue("big@example.org")
    try:
        def write_and_commit() -> object:
            left = max_body + 1
            while left:
                n = min(left, 1 << 20)
                enq.write(b"b" * n)
                left -= n
            return enq.commit([Recipient("big@example.net", Schedule(1))])

        _expect_invalid(f"a body of {max_body + 1} bytes (declared limit {max_body})",
                        write_and_commit, problems)
    finally:
        enq.abort()
    if _snapshot(store) != before:
        problems.append(("C2", "a refused over-long body left a half-written message"))


def _schedules(store: Storage, problems: Problems) -> None:
    (q,) = _enqueue(store, [Recipient("sched@example.net", Schedule(7))])
    for what, at, attempts in BAD_SCHEDULES:
        bad = forged_schedule(at, attempts)
        before = _snapshot(store)
        _expect_invalid(f"commit with a schedule of {what}",
                        lambda bad=bad: _enqueue(  # type: ignore[misc]
                            store, [Recipient("bad@example.net", bad)]), problems)
        listed = {h.entry_id: h for h in store.list_queue()}
        q = listed.get(q.entry_id, q)
        if not _expect_invalid(f"reschedule to a schedule of {what}",
                               lambda bad=bad, q=q: store.reschedule(q, bad),  # type: ignore[misc]
                               problems):
            return
        if _snapshot(store) != before:
            problems.append(("C9", f"a refused schedule of {what} changed the queue"))
    listed = {h.entry_id: h for h in store.list_queue()}
    if q.entry_id not in listed:
        problems.append(("C9", "after the refused schedules the entry is no longer listed"))
        return
    f = store.send_start(listed[q.entry_id])
    if not isinstance(f, InflightMail):
        problems.append(("C9", f"send_start of a queued entry returned {f!r}"))
        return
    for what, at, attempts in BAD_SCHEDULES:
        bad = forged_schedule(at, attempts)
        _expect_invalid(f"send_cancel to a schedule of {what}",
                        lambda bad=bad: store.send_cancel(f, bad), problems)  # type: ignore[misc]
        if not any(h.entry_id == f.entry_id for h in store.find_inflight()) \
                and any(h.entry_id == f.entry_id for h in store.list_queue()):
            problems.append(("C9", f"a refused send_cancel to a schedule of {what} put the "
                                   "entry back in the queue"))
            return


#: The largest declared recipient limit committed in full (a limit of millions is
#: tested beyond only).
AT_LIMIT_MAX = 200_000

def cases(limit_recipients: int | None) -> list[str]:
    out = [f"recipients-{n}" for n in RECIPIENT_COUNTS
           if n != COVERED_ELSEWHERE or (limit_recipients is not None and n > limit_recipients)]
    if limit_recipients is not None and limit_recipients + 1 not in RECIPIENT_COUNTS:
        out.append(f"recipients-{limit_recipients + 1}")
    if (limit_recipients is not None and limit_recipients not in RECIPIENT_COUNTS
            and limit_recipients <= AT_LIMIT_MAX):
        out.append(f"recipients-{limit_recipients}")
    return [*out, "address-at-limit", "body-beyond-limit", "schedule"]


def _child(ch: Channel, backend: Backend, root: str, only: str | None) -> None:
    """In the child: each case on a queue of its own, one message per case."""
    store = backend.open(os.path.join(root, "limits"))
    lim = store.limits
    store.close()
    ch.send({"limits": {"max_recipients": lim.max_recipients,
                        "max_address": lim.max_address,
                        "max_body_bytes": lim.max_body_bytes}})
    for case in cases(lim.max_recipients):
        if only is not None and case != only:
            continue
        ch.send({"start": case})
        problems: Problems = []
        t = time.perf_counter()
        store = backend.open(os.path.join(root, case))
        if case.startswith("recipients-"):
            _recipients(store, int(case.split("-")[1]), lim.max_recipients, problems)
        elif case == "address-at-limit":
            _address(store, lim.max_address, problems)
        elif case == "body-beyond-limit":
            if lim.max_body_bytes is not None:
                _body(store, lim.max_body_bytes, problems)
        else:
            _schedules(store, problems)
        store.close()
        ch.send({"case": case, "problems": problems,
                 "seconds": round(time.perf_counter() - t, 3)})


def run(backend: Backend, profile: Profile | None = None, *, only: str | None = None
        ) -> CheckResult:
    """Every case (or the case ``only``)."""
    start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="queue-ref-limits-")
    findings: list[Finding] = []
    stats: dict[str, Any] = {}
    current = "setup"
    try:
        with Child(_child, backend, root, only) as child:
            try:
                for msg in child.messages(timeout=CASE_TIMEOUT):
                    if "limits" in msg:
                        stats.update(msg["limits"])
                    elif "start" in msg:
                        current = msg["start"]
                    elif "case" in msg:
                        stats[f"{msg['case']}_seconds"] = msg["seconds"]
                        findings += [Finding(c, d, f"{CHECK}:{msg['case']}", NO_CRASH)
                                     for c, d in msg["problems"]]
                        current = "setup"
                    elif "crashed" in msg:
                        findings.append(Finding("C9", f"{current}: the check's process failed: "
                                                      f"{msg['crashed']}",
                                                f"{CHECK}:{current}", NO_CRASH))
            except ChildTimeout:
                findings.append(Finding("C9", f"{current}: no answer for {CASE_TIMEOUT:.0f} s "
                                              "(the backend hangs)", f"{CHECK}:{current}",
                                        NO_CRASH))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return finished(CHECK, NO_CRASH, findings, seconds=time.perf_counter() - start,
                    stats=stats)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The case ``limits:<case>`` names, run again."""
    return run(backend, only=scenario.partition(":")[2]).findings
