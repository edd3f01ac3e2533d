"""Another process reads queued mail while this one delivers it (``MULTI_PROCESS`` and
``HOLD``, whose ``inspect_entry`` reads without claiming).

An operator's ``queue-ref show`` or ``mailq -v`` runs beside the relay: it opens the queue
in its own process, inspects an entry and reads its body, while the relay delivers that
entry, cleans it up and accepts more mail.  The contract says what an inspection reads is
the entry's state when the call was made (C13), so the reader must get the committed
bytes, whole, whatever the other process did meanwhile.  A queue that recycles the files
of delivered messages (the filesystem queue keeps them as spares and writes the next
messages into them) must not recycle one that a reader elsewhere has open; it cannot see
that reader through anything of its own process.

Steps (nothing is drawn at random; scenario ``reader-elsewhere``):

1. the parent enqueues ``MESSAGES`` messages of one recipient and ``BODY`` bytes each
   (small enough to leave their files as spares);
2. a child process opens the queue, inspects every entry and reads the first
   ``FIRST`` bytes of each, keeping the readers open;
3. the parent delivers and cleans up every entry, then enqueues ``MESSAGES`` short and
   ``MESSAGES`` longer messages (which the recycled files would take);
4. the child reads the rest of each body and reports what it read.

Each reader must return exactly the committed body (C13); a ``CorruptionError`` for the
intact message breaks C9 too (errors split by cause: the message is not damaged, and a
false damage report quarantines and bounces nothing but sends an operator after mail that
is fine).  Opened again, the queue holds the new messages, each once, and names nothing
lost (C6).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import (
    CheckResult,
    Finding,
    Status,
    findings_in_scratch,
    finished,
)
from conformance.harness.child_process import Channel, Child
from queue_ref.storage import (
    CorruptionError,
    MailReader,
    QueueError,
    Recipient,
    Schedule,
    Storage,
)

SCENARIO = "reader-elsewhere"
MESSAGES = 6
BODY = 5_000
FIRST = 4_000
STEPS = (f"enqueue {MESSAGES} messages of one recipient and {BODY:,} bytes",
         f"another process inspects every entry and reads {FIRST:,} bytes of each, readers "
         "kept open",
         f"deliver and clean up every entry, enqueue {MESSAGES} short and {MESSAGES} longer "
         "messages",
         "the other process reads the rest of every body")


def _body(kind: str, i: int, size: int) -> bytes:
    line = b"%s message %d, a line of its body\r\n" % (kind.encode(), i)
    head = b"Subject: %s %d\r\n\r\n" % (kind.encode(), i)
    return (head + line * (size // len(line) + 1))[:size]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reader(ch: Channel, backend: Backend, root: str) -> None:
    store = backend.open(root)
    readers: list[tuple[str, MailReader, bytes]] = []
    try:
        for h in sorted(store.list_queue(), key=lambda h: h.entry_id):
            r = store.inspect_entry(h)
            if r is None:
                ch.send({"none": h.message_id})
                continue
            readers.append((h.message_id, r, r.read(FIRST)))
        ch.send({"holding": [m for m, _, _ in readers]})
        ch.recv()  # the parent delivered everything and enqueued more
        out: dict[str, dict[str, Any]] = {}
        for m, r, head in readers:
            try:
                rest = r.read()
                out[m] = {"sha": _digest(head + rest), "size": len(head) + len(rest)}
            except QueueError as e:
                out[m] = {"error": type(e).__name__, "detail": str(e)[:300],
                          "corrupt": isinstance(e, CorruptionError)}
        ch.send({"read": out})
    finally:
        for _, r, _ in readers:
            r.close()
        store.close()


def _enqueue(store: Storage, kind: str, i: int, size: int) -> tuple[str, bytes]:
    body = _body(kind, i, size)
    with store.enqueue(f"{kind}{i}@example.org") as enq:
        enq.write(body)
        (h,) = enq.commit([Recipient(f"r{i}@example.net", Schedule(i))])
    return h.message_id, body


def _steps(backend: Backend, root: str, stats: dict[str, int]) -> list[tuple[str, str]]:
    fail: list[tuple[str, str]] = []
    store = backend.open(root)
    child: Child | None = None
    later: set[str] = set()
    try:
        want = dict(_enqueue(store, "first", i, BODY) for i in range(MESSAGES))
        child = Child(_reader, backend, root)
        messages = child.messages(120.0)
        holding: list[str] = []
        for msg in messages:
            if "none" in msg:
                fail.append(("C13", f"the other process's inspect_entry of queued message "
                                    f"{msg['none']} returned None with nothing else going on"))
            if "holding" in msg or "crashed" in msg or "end" in msg:
                holding = msg.get("holding", [])
                if "crashed" in msg:
                    fail.append(("C9", f"the reading process raised {msg['crashed']}"))
                break
        if not holding:
            return fail or [("C13", "the other process inspected no entry")]
        stats["readers"] = len(holding)
        for h in list(store.list_queue()):
            f = store.send_start(h)
            if f is None:
                fail.append(("C7", f"the queue's only deliverer could not claim {h.entry_id}"))
                continue
            done = store.send_done(f)
            if done is not None:
                store.cleanup(done)
        for i in range(MESSAGES):
            later |= {_enqueue(store, "short", i, 40)[0], _enqueue(store, "longer", i, 2 * BODY)[0]}
        child.tell("go")
        got: dict[str, dict[str, Any]] = {}
        for msg in messages:
            if "crashed" in msg:
                fail.append(("C9", f"the reading process raised {msg['crashed']}"))
            if "read" in msg or "crashed" in msg or "end" in msg:
                got = msg.get("read", {})
                break
        child.drain(60.0)  # the reader closes its queue and ends before the reopen below
        for m in holding:
            seen = got.get(m)
            if seen is None:
                fail.append(("C13", f"the other process's reader of message {m} reported "
                                    "nothing"))
            elif seen.get("corrupt"):
                fail.append(("C9", f"the other process's reader of message {m} raised "
                                   f"CorruptionError ({seen['detail']}) once the message was "
                                   "delivered here and more mail enqueued: the message is "
                                   "intact; its file was reused under the reader"))
            elif "error" in seen:
                fail.append(("C13", f"the other process's reader of message {m} raised "
                                    f"{seen['error']} ({seen['detail']}): an inspection "
                                    "reads the entry as it was when the call was made"))
            elif (seen["sha"], seen["size"]) != (_digest(want[m]), len(want[m])):
                fail.append(("C13", f"the other process's reader of message {m} read "
                                    f"{seen['size']} bytes that are not its committed "
                                    f"{len(want[m])}: another message's, written into its "
                                    "file after the delivery here"))
        stats["read_whole"] = sum(1 for m in holding if "sha" in got.get(m, {})
                                  and got[m]["sha"] == _digest(want[m]))
    finally:
        if child is not None:
            child.close()
        store.close()
    again = backend.open(root)
    try:
        listed = sorted(h.message_id for h in again.list_queue())
        lost = getattr(getattr(again, "last_recovery", None), "lost", ())
    finally:
        again.close()
    if listed != sorted(later):
        fail.append(("C6", f"opened again, the queue lists {len(listed)} entries; it holds "
                           f"the {len(later)} messages enqueued after the deliveries, once each"))
    if lost:
        fail.append(("C6", f"opened again, the queue names {len(lost)} messages lost (first: "
                           f"{lost[0]}); nothing was damaged"))
    return fail


def replay(backend: Backend) -> list[Finding]:
    return _run(backend, {})


def _run(backend: Backend, stats: dict[str, int]) -> list[Finding]:
    return findings_in_scratch("queue-ref-reader-elsewhere-",
                               lambda root: _steps(backend, root, stats), SCENARIO, STEPS)


def run(backend: Backend) -> CheckResult:
    """Run by the suite for backends with both capabilities (the catalog's ``requires``)."""
    start = time.perf_counter()
    if not backend.takes_root:
        return CheckResult("reader-elsewhere", NO_CRASH, Status.UNSUPPORTED,
                           note="the backend keeps nothing at a location: no other process "
                                "can open its queue")
    stats = {"readers": 0, "read_whole": 0}
    findings = _run(backend, stats)
    return finished("reader-elsewhere", NO_CRASH, findings,
                    seconds=time.perf_counter() - start, stats=stats)
