"""The queues damage-at-rest damages: how each template is filled, and what it holds.

Two templates, each filled once per run and copied for every trial:

* the small one: ``MESSAGES`` messages of one and two recipients, one of ``LARGE_BODY``
  bytes (a store that writes a body as many records has them damaged one by one, and its
  log passes a megabyte), ``CLEANED`` delivered and cleaned up, an entry of
  ``RESCHEDULED`` others rescheduled (a store that keeps schedules apart has them
  damaged too), and a last message enqueued after all that (a log's last record is a
  commit);
* the deep one: a message of ``DEEP_RCPTS`` recipients and ``DEEP_PARAMS``, a ``DEEP_BODY`` body,
  ``DEEP_DELIVERED`` entries of the first delivered, another ``DEEP_BODY`` body: a
  buffered store goes past its write buffer twice.

Either is filled in this process and the queue closed, or (``killed``) by a child
process that is then killed (SIGKILL) with the queue open: the store is left as after a
crash, with no clean close, so a store that compares what it finds with the record of
its last clean close has none to compare with, and damage meets a store recovering from
a crash.  ``Template`` is what the filler acknowledged, by which trials are judged.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.checks.file_damage import outside_bodies
from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Channel, Child
from queue_ref.storage import Recipient, Schedule, Storage

DOMAIN = "example.net"  # every recipient's: list_domain must give what list_queue gives
MESSAGES = 8
CLEANED = 2  # messages delivered and cleaned up before the damage
RESCHEDULED = 2  # messages one entry of which is rescheduled before the damage
#: One message of the template, with others after it, has a body of LARGE_BODY bytes: a
#: store that writes a body as several records (the KV queues' 64 KiB chunks) has them
#: damaged one by one, and its log passes a megabyte (a checksum or a scan that covers
#: only the start of a large file is met).
LARGE_AT = 5
LARGE_BODY = 2_200_000
#: The deep template: recipients of its first message, size of its two large bodies, and
#: how many of the first message's entries are delivered between the two.
DEEP_RCPTS = 200
DEEP_BODY = 5 << 20
DEEP_DELIVERED = 3
#: The ESMTP parameters of the deep template's first message: 24 KiB of hex digits (a
#: compressing store keeps them nearly as they are), so that its message record fills
#: table blocks of its own, apart from its entries' records, and damage there takes the
#: record and leaves the entries (a store must then not serve entries whose message
#: record is gone, and name the message).
DEEP_PARAMS = {"ENVID": "".join(hashlib.sha256(b"%d" % k).hexdigest() for k in range(375))}


def body_of(i: int) -> bytes:
    return b"Subject: at rest %d\r\n\r\n" % i + (b"line %03d of the body\r\n" % i) * (20 + 13 * i)


def deep_body(i: int, size: int) -> bytes:
    """``size`` bytes of numbered lines: no two chunks of a body alike."""
    head = b"Subject: deep %d\r\n\r\n" % i
    lines = b"".join(b"line %07d of deep body %d\r\n" % (k, i)
                     for k in range(size // 28 + 1))
    return (head + lines)[:size]


@dataclass
class Template:
    """What a template queue holds: message id -> body of the messages still queued,
    entry id -> recipient and -> message id, the messages delivered and cleaned up, and
    the entries delivered (send_done) but not cleaned up."""

    want: dict[str, bytes] = field(default_factory=dict)
    rcpt_of: dict[str, str] = field(default_factory=dict)
    message_of: dict[str, str] = field(default_factory=dict)
    cleaned: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    #: ``outside_bodies`` of each file, by name: every trial's copy holds the same bytes
    outside: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    #: message id -> the number it was filled with (its body is made again from it)
    index_of: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """What a filler that is killed tells the parent (bodies by number)."""
        return {"index_of": self.index_of, "want": sorted(self.want),
                "rcpt_of": self.rcpt_of, "message_of": self.message_of,
                "cleaned": sorted(self.cleaned), "sent": sorted(self.sent)}

    @classmethod
    def from_json(cls, got: dict[str, Any], deep: bool) -> Template:
        t = cls(rcpt_of=dict(got["rcpt_of"]), message_of=dict(got["message_of"]),
                cleaned=set(got["cleaned"]), sent=set(got["sent"]),
                index_of=dict(got["index_of"]))
        t.want = {m: fill_body(t.index_of[m], deep) for m in got["want"]}
        return t

    def structure(self, rel: str) -> Callable[[bytes], list[tuple[int, int]]]:
        """Where file ``rel`` holds no body, computed once for all its trials."""
        def ranges(data: bytes) -> list[tuple[int, int]]:
            if rel not in self.outside:
                self.outside[rel] = outside_bodies(data, list(self.want.values()))
            return self.outside[rel]
        return ranges

    def enqueue(self, store: Storage, i: int, body: bytes, rcpts: int,
                params: dict[str, str] | None = None) -> str:
        addrs = [Recipient(f"r{i}.{k}@{DOMAIN}", Schedule(i)) for k in range(rcpts)]
        with store.enqueue(f"s{i}@example.org", params) as enq:
            enq.write(body)
            handles = enq.commit(addrs)
        self.want[handles[0].message_id] = body
        self.index_of[handles[0].message_id] = i
        for h, r in zip(handles, addrs, strict=True):
            self.rcpt_of[h.entry_id] = r.address
            self.message_of[h.entry_id] = h.message_id
        return handles[0].message_id

    def reschedule(self, store: Storage, message: str) -> None:
        """Give the first listed entry of ``message`` a schedule of its own (a store may
        keep it in a record apart from the message: damage must reach it too)."""
        h = next(h for h in store.list_queue() if h.message_id == message)
        if store.reschedule(h, Schedule(h.schedule.at + 1000, h.schedule.attempts + 1)) is None:
            raise RuntimeError(f"filling the template: entry {h.entry_id} could not be "
                               "rescheduled by the queue's only user")

    def deliver(self, store: Storage, message: str, entries: int | None) -> None:
        """Deliver ``entries`` entries of ``message`` (or all of it, cleaned up)."""
        if entries is None:
            self.cleaned.add(message)
            self.want.pop(message, None)
        done = 0
        for h in list(store.list_queue()):
            if h.message_id != message or (entries is not None and done == entries):
                continue
            f = store.send_start(h)
            finished = store.send_done(f) if f is not None else None
            if finished is None:
                raise RuntimeError(f"filling the template: entry {h.entry_id} could not be "
                                   "claimed and sent by its only user")
            done += 1
            self.sent.add(h.entry_id)
            if entries is None:
                store.cleanup(finished)


def fill_body(i: int, deep: bool) -> bytes:
    """The body of the template's message number ``i``."""
    if deep:
        return body_of(0) if i == 0 else deep_body(i, DEEP_BODY)
    return deep_body(i, LARGE_BODY) if i == LARGE_AT else body_of(i)


def fill(backend: Backend, root: str, deep: bool = False, killed: bool = False) -> Template:
    """A template queue (the deep one when ``deep``), and what it holds.  ``killed``: it
    is filled by a child process that is killed (SIGKILL) once it is filled, instead of
    closing the queue: the store is left as after a crash, with no clean close."""
    if not killed:
        store = backend.open(root)
        try:
            return _fill_open(store, deep)
        finally:
            store.close()
    told = root + ".template.json"
    filled = False
    with Child(_fill_and_wait, backend, root, deep, told) as child:
        for msg in child.messages(600.0):
            if "crashed" in msg:
                raise RuntimeError(f"filling the template in a child failed: {msg['crashed']}")
            if msg.get("filled"):
                filled = True
                break
        child.kill()
    if not filled:
        raise RuntimeError("the child filling the template ended without filling it")
    got = json.loads(Path(told).read_text())
    os.unlink(told)
    return Template.from_json(got, deep)


def _fill_and_wait(ch: Channel, backend: Backend, root: str, deep: bool, told: str) -> None:
    """In a child: fill the template, write what it holds to ``told``, say so, and wait
    to be killed with the queue open."""
    t = _fill_open(backend.open(root), deep)
    Path(told).write_text(json.dumps(t.to_json()))
    ch.send({"filled": True})
    while True:
        time.sleep(1)


def _fill_open(store: Storage, deep: bool) -> Template:
    """Fill the open ``store`` as the template (the deep one when ``deep``)."""
    t = Template()
    if deep:
        first = t.enqueue(store, 0, fill_body(0, deep), DEEP_RCPTS, DEEP_PARAMS)
        t.enqueue(store, 1, fill_body(1, deep), 1)
        t.deliver(store, first, DEEP_DELIVERED)
        t.enqueue(store, 2, fill_body(2, deep), 1)
    else:
        for i in range(MESSAGES - 1):
            t.enqueue(store, i, fill_body(i, deep), 1 + i % 2)
        listed: list[str] = []  # the messages in the order the queue lists them
        for h in store.list_queue():
            if h.message_id not in listed:
                listed.append(h.message_id)
        for m in listed[:CLEANED]:
            t.deliver(store, m, None)
        for m in listed[CLEANED:CLEANED + RESCHEDULED]:
            t.reschedule(store, m)
        # the last message comes after them all: a log's last record is its commit
        # (a flip near the end of a log hits a message, past its first megabyte)
        t.enqueue(store, MESSAGES - 1, fill_body(MESSAGES - 1, deep), 1 + (MESSAGES - 1) % 2)
    return t


SHALLOW_STEPS = (f"fill a queue of {MESSAGES} messages (one of {LARGE_BODY:,} bytes), deliver "
                 f"{CLEANED}, reschedule an entry of {RESCHEDULED} others, close")
DEEP_STEPS = (f"fill a queue with a message of {DEEP_RCPTS} recipients, a {DEEP_BODY >> 20} MiB "
              f"body, deliver {DEEP_DELIVERED} entries of the first, another "
              f"{DEEP_BODY >> 20} MiB body, close")
KILLED = ", kill the filler (SIGKILL)"


