"""The wire format of a running relay's control socket (``relay_control_client``, and
``queue_ref.relay.relay_control`` which serves it).

A KV queue is opened by one process only, the relay that serves it; the operator
commands (``mailq``, ``hold``, ``flush``...) reach its Storage through a Unix socket in
the queue's directory, ``relay.ctl`` (mode 0600: the queue's owner only).  Each request
is one JSON object on a line: ``op`` (a Storage method), ``h`` (a handle, for the calls
that take one) and the call's other arguments.  The reply is one JSON line: ``r`` (the
result), or ``error`` (the exception's class name in ``queue_ref.storage``, ``message``,
and for ``CorruptionError`` its ``entry_id`` and ``quarantined_to``).  A listing is
answered a batch at a time: ``items`` (up to ``BATCH``), ``end``, and the ``cursor`` a
``{"op": "more", "cursor": N}`` request names for the next batch, so that other
requests may come between two batches (``mailq`` inspects each entry as it is listed).
A listed handle carries its entry's metadata (``meta``, what ``inspect_entry`` answers),
so that inspecting it costs no request: ``mailq`` over 20,000 messages on a running
KV relay took 1.7 s (2.7 s on the stopped queue, which it opens and recovers first;
4.5 s with a request per entry).

A handle goes over as its kind, entry id, message id and schedule; the relay keeps the
handles it handed out on a connection, by kind and entry id, and a request names one
of those (a handle of another connection, or made up, is refused as ``MisuseError``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from queue_ref import storage
from queue_ref.storage import (
    CorruptionError,
    EntryMeta,
    Handle,
    HeldMail,
    PendingCleanupMail,
    QueuedMail,
    QueueError,
    Schedule,
)

CONTROL_SOCKET = "relay.ctl"
BATCH = 500  # listing items per reply line
BODY_PIECE = 1 << 20  # body octets per read_piece reply (a body is never one line)
KINDS: dict[str, type[Handle]] = {"queued": QueuedMail, "held": HeldMail,
                                  "cleanup": PendingCleanupMail}
KIND_OF = {cls: kind for kind, cls in KINDS.items()}


def socket_path(root: str) -> str:
    return os.path.join(root, CONTROL_SOCKET)


#: The longest path a Unix socket is bound or reached by (``sun_path``, 108 octets with
#: its NUL, less a margin).
SUN_PATH_MAX = 100


@contextlib.contextmanager
def reachable(root: str) -> Iterator[str]:
    """A path to ``root``'s control socket short enough to bind or connect to: its own,
    or, for a deep queue directory, through a descriptor of the directory
    (``/proc/self/fd/N/relay.ctl``), valid inside the block."""
    path = socket_path(root)
    if len(os.fsencode(path)) < SUN_PATH_MAX:
        yield path
        return
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{CONTROL_SOCKET}"
    finally:
        os.close(fd)


def schedule_to_wire(s: Schedule) -> list[Any]:
    return [s.at, s.attempts, s.reason]


def schedule_from_wire(v: list[Any]) -> Schedule:
    return Schedule(int(v[0]), int(v[1]), str(v[2]))


def handle_to_wire(h: Handle) -> dict[str, Any]:
    return {"kind": KIND_OF[type(h)], "entry_id": h.entry_id, "message_id": h.message_id,
            "schedule": schedule_to_wire(h.schedule)}


def meta_to_wire(m: EntryMeta) -> dict[str, Any]:
    return {"message_id": m.message_id, "entry_id": m.entry_id, "mail_from": m.mail_from,
            "rcpt": m.rcpt, "rcpt_index": m.rcpt_index, "zone": m.zone,
            "params": dict(m.params), "schedule": schedule_to_wire(m.schedule),
            "body_size": m.body_size, "arrival_ns": m.arrival_ns}


def meta_from_wire(d: dict[str, Any]) -> EntryMeta:
    return EntryMeta(d["message_id"], d["entry_id"], d["mail_from"], d["rcpt"],
                     d["rcpt_index"], d["zone"], dict(d["params"]),
                     schedule_from_wire(d["schedule"]), d["body_size"], d["arrival_ns"])


def error_to_wire(e: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"error": type(e).__name__, "message": str(e)}
    if isinstance(e, CorruptionError):
        out.update(entry_id=e.entry_id, quarantined_to=e.quarantined_to)
    return out


def error_from_wire(d: dict[str, Any]) -> QueueError:
    """The exception a reply names, of its class where ``queue_ref.storage`` has it (a
    QueueError), else a QueueError that names the class."""
    name, message = str(d.get("error")), str(d.get("message", ""))
    cls = getattr(storage, name, None)
    if name == "CorruptionError":
        return CorruptionError(message, str(d.get("entry_id", "")), d.get("quarantined_to"))
    if isinstance(cls, type) and issubclass(cls, QueueError):
        with contextlib.suppress(TypeError):  # a constructor of other arguments
            return cls(message)
    return QueueError(f"the relay answered {name}: {message}")
