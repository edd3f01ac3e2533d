"""The Storage of a queue a running relay holds, reached through its control socket.

A KV queue is opened by one process only: while the relay serves it, ``queue-ref mailq``,
``qshape``, ``show``, ``hold``, ``release``, ``delete``, ``requeue`` and ``flush`` make
their Storage calls in the relay, through ``<queue>/relay.ctl``
(``relay_control_wire``), and print what they would print on a stopped queue.  Only the
calls those commands make are here (the listings, ``inspect_entry``, ``reschedule``,
``hold``, ``release``, ``drop``, ``drop_held``, ``cleanup``); the others raise
``UnsupportedError``: mail goes in and out through the relay itself.

A handle is this Storage's own (used once, like any), and names the relay's handle for
the same entry on this connection.  When the connection breaks the call raises
``StorageIOError``; when the relay is stopped, the next command opens the queue itself.
"""

from __future__ import annotations

import base64
import functools
import json
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from queue_ref.operate.relay_control_wire import (
    BODY_PIECE,
    KIND_OF,
    error_from_wire,
    meta_from_wire,
    reachable,
    schedule_from_wire,
    schedule_to_wire,
)
from queue_ref.storage import (
    Capability,
    ClosedError,
    Enqueuer,
    EntryMeta,
    Footprint,
    Handle,
    HeldMail,
    InflightMail,
    MailReader,
    MisuseError,
    PendingCleanupMail,
    QueuedMail,
    RecoveryReport,
    Schedule,
    Storage,
    StorageIOError,
    UnsupportedError,
)

H = TypeVar("H", bound=Handle)
TIMEOUT = 60.0  # seconds a reply may take (a listing's batch, a move's sync)


class RelayControlStorage(Storage):
    """The queue at ``root``, served by the relay running on it (see the module)."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(TIMEOUT)
        try:
            with reachable(root) as path:
                self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise
        self._file = self._sock.makefile("rwb")
        self._prefetched: tuple[Handle, EntryMeta] | None = None  # see ``_listed``
        caps = self._call("capabilities")
        self.capabilities = frozenset(Capability(c) for c in caps)

    # ---- the wire ----

    def _send(self, op: str, **args: Any) -> None:
        self._check_open()
        try:
            self._file.write(json.dumps({"op": op, **args}).encode() + b"\n")
            self._file.flush()
        except OSError as e:
            raise StorageIOError(f"the relay's control socket: {e}") from e

    def _reply(self) -> dict[str, Any]:
        try:
            line = self._file.readline()
        except OSError as e:
            raise StorageIOError(f"the relay's control socket: {e}") from e
        if not line.endswith(b"\n"):
            raise StorageIOError("the relay closed its control socket (it is stopping?)")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise error_from_wire(reply)
        return reply

    def _reply_to(self, op: str, **args: Any) -> dict[str, Any]:
        self._send(op, **args)
        return self._reply()

    def _call(self, op: str, **args: Any) -> Any:
        return self._reply_to(op, **args).get("r")

    def _stream(self, op: str, **args: Any) -> Iterator[Any]:
        """The items of a listing, a batch per request (other calls may come between
        two batches: ``mailq`` inspects each entry as it is listed)."""
        reply = self._reply_to(op, **args)
        while True:
            yield from reply["items"]
            if reply["end"]:
                return
            reply = self._reply_to("more", cursor=reply["cursor"])

    def _ref(self, h: Handle, cls: type[H]) -> dict[str, Any]:
        self._take(h, cls)  # checks it is ours, live, of its kind; spends it
        return {"kind": KIND_OF[cls], "entry_id": h.entry_id}

    def _handle(self, d: dict[str, Any] | None, cls: type[H]) -> H | None:
        if d is None:
            return None
        return self._issue(cls, d["entry_id"], d["message_id"],
                           schedule_from_wire(d["schedule"]))

    def _listed(self, d: dict[str, Any], cls: type[H]) -> H:
        """A listed handle; the metadata that came with it is kept for its
        ``inspect_entry`` (until the next listed handle: the commands inspect each entry
        as it is listed)."""
        h = self._handle(d, cls)
        assert h is not None
        meta = d.get("meta")
        self._prefetched = (h, meta_from_wire(meta)) if meta is not None else None
        return h

    def _handles(self, op: str, cls: type[H], **args: Any) -> Iterator[H]:
        for d in self._stream(op, **args):
            yield self._listed(d, cls)

    # ---- what the operator commands call ----

    def list_queue(self) -> Iterator[QueuedMail]:
        return self._handles("list_queue", QueuedMail)

    def list_held(self) -> Iterator[HeldMail]:
        return self._handles("list_held", HeldMail)

    def list_domain(self, domain: str) -> Iterator[QueuedMail]:
        return self._handles("list_domain", QueuedMail, domain=domain)

    def scan_queue(self) -> Iterator[QueuedMail | HeldMail]:
        for d in self._stream("scan_queue"):
            yield self._listed(d, HeldMail) if d["kind"] == "held" \
                else self._listed(d, QueuedMail)

    def inflight_entries(self) -> Iterator[EntryMeta]:
        return (meta_from_wire(d) for d in self._stream("inflight_entries"))

    def inspect_entry(self, mail: QueuedMail | HeldMail) -> MailReader | None:
        self._peek(mail, type(mail))
        ref = {"kind": KIND_OF[type(mail)], "entry_id": mail.entry_id}
        fetch = functools.partial(self._call, "read_piece", h=ref)
        if self._prefetched is not None and self._prefetched[0] is mail:
            return _RemoteReader(self._prefetched[1], fetch)
        got = self._call("inspect_entry", h=ref)
        if got is None:
            return None
        return _RemoteReader(meta_from_wire(got), fetch)

    def reschedule(self, mail: QueuedMail, schedule: Schedule) -> QueuedMail | None:
        return self._handle(self._call("reschedule", h=self._ref(mail, QueuedMail),
                                       schedule=schedule_to_wire(schedule)), QueuedMail)

    def hold(self, mail: QueuedMail) -> HeldMail | None:
        return self._handle(self._call("hold", h=self._ref(mail, QueuedMail)), HeldMail)

    def release(self, mail: HeldMail) -> QueuedMail | None:
        return self._handle(self._call("release", h=self._ref(mail, HeldMail)), QueuedMail)

    def drop(self, mail: QueuedMail) -> PendingCleanupMail | None:
        return self._handle(self._call("drop", h=self._ref(mail, QueuedMail)),
                            PendingCleanupMail)

    def drop_held(self, mail: HeldMail) -> PendingCleanupMail | None:
        return self._handle(self._call("drop_held", h=self._ref(mail, HeldMail)),
                            PendingCleanupMail)

    def cleanup(self, mail: PendingCleanupMail) -> bool:
        return bool(self._call("cleanup", h=self._ref(mail, PendingCleanupMail)))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._file.close()
            finally:
                self._sock.close()

    # ---- what goes through the relay itself ----

    def _not_here(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"{what}: not through the relay's control socket (the relay "
                                "itself takes and delivers mail)")

    def find_inflight(self) -> Iterator[InflightMail]:
        raise self._not_here("find_inflight")

    def find_pending_cleanup(self) -> Iterator[PendingCleanupMail]:
        raise self._not_here("find_pending_cleanup")

    def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
        raise self._not_here("enqueue")

    def read_inflight(self, mail: InflightMail) -> MailReader:
        raise self._not_here("read_inflight")

    def send_start(self, mail: QueuedMail) -> InflightMail | None:
        raise self._not_here("send_start")

    def send_done(self, mail: InflightMail) -> PendingCleanupMail | None:
        raise self._not_here("send_done")

    def send_cancel(self, mail: InflightMail, schedule: Schedule) -> QueuedMail | None:
        raise self._not_here("send_cancel")

    def recover(self) -> RecoveryReport:
        raise self._not_here("recover")

    def footprint(self) -> Footprint:
        raise self._not_here("footprint")


class _RemoteReader(MailReader):
    """The metadata of an entry, and its body fetched from the relay as it is read, a
    piece (``BODY_PIECE``) a request: neither side holds a big body whole (``mailq``
    reads metadata only)."""

    def __init__(self, meta: EntryMeta, fetch: Callable[..., Any]) -> None:
        self.meta = meta
        self._fetch = fetch
        self._piece = b""
        self._at = 0
        self._end = False
        self._started = False
        self._closed = False

    def read(self, n: int = -1) -> bytes:
        if self._closed:
            raise ClosedError("this MailReader is closed")
        if n < 0:
            return b"".join(iter(lambda: self.read(BODY_PIECE), b""))
        while self._at >= len(self._piece) and not self._end:
            # the first piece starts the body again, whatever an earlier reader left
            got = self._fetch(start=not self._started)
            self._started = True
            if got is None:
                raise MisuseError(f"entry {self.meta.entry_id} moved while it was read")
            self._piece, self._at = base64.b64decode(got), 0
            self._end = not self._piece
        out = self._piece[self._at:self._at + n]
        self._at += len(out)
        return out

    def close(self) -> None:
        self._closed = True
        self._piece = b""
