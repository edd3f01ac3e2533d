"""The relay's control socket: the operator commands on a queue only the relay may open.

A KV queue's store is held by one process (no ``Capability.MULTI_PROCESS``).  While the
relay serves it, each of its roots has a Unix socket, ``<root>/relay.ctl`` (mode 0600),
through which ``queue-ref mailq``, ``qshape``, ``show``, ``hold``, ``release``,
``delete``, ``requeue`` and ``flush`` make their Storage calls in the relay
(``queue_ref.operate.relay_control_client``; the wire format is
``queue_ref.operate.relay_control_wire``).  Each call runs in a storage thread on the
root's Storage, as an operator process's call would on a shared queue (C13: entries the
relay claims meanwhile move under it as under any other caller); a listing is read a
batch per request, so the first batch comes at once whatever the queue holds.  (The
commands wake the relay themselves, SIGUSR1, when entries became due.)  A request
that is not one of these, or names a handle this connection was not given, is refused
with an error reply; the connection stays open.  A connection quiet for
``IDLE_TIMEOUT`` is closed, and the relay's stop cuts every connection (a command that
does not read its replies cannot hold it).  A call that meets a failed sync
(``ReopenRequiredError``) makes the relay reopen its queue, as its own calls do.  A
``scan_queue`` listing keeps its last batch of handles only (``mailq`` and ``qshape``
inspect each entry as it comes); the other listings keep theirs for the actions that
follow.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from queue_ref.operate.relay_control_wire import (
    BATCH,
    BODY_PIECE,
    KINDS,
    error_to_wire,
    handle_to_wire,
    meta_to_wire,
    reachable,
    schedule_from_wire,
    socket_path,
)
from queue_ref.relay.queued_body import read_piece
from queue_ref.storage import (
    EntryMeta,
    Handle,
    HeldMail,
    InvalidInputError,
    MailReader,
    MisuseError,
    QueuedMail,
    ReopenRequiredError,
    Storage,
    StorageIOError,
    UnsupportedError,
)

IDLE_TIMEOUT = 300.0  # seconds a connection may wait for its next request

#: The calls that move an entry: the handle they take is spent, the one they return kept.
MOVES: dict[str, Callable[..., Any]] = {
    "hold": lambda s, h, req: s.hold(h),
    "release": lambda s, h, req: s.release(h),
    "drop": lambda s, h, req: s.drop(h),
    "drop_held": lambda s, h, req: s.drop_held(h),
    "cleanup": lambda s, h, req: s.cleanup(h),
    "reschedule": lambda s, h, req: s.reschedule(h, schedule_from_wire(req["schedule"])),
}
#: The listings: handles (or, for ``inflight_entries``, metadata) a batch per request.
LISTINGS: dict[str, Callable[[Storage, dict[str, Any]], Iterator[Any]]] = {
    "list_queue": lambda s, req: s.list_queue(),
    "list_held": lambda s, req: s.list_held(),
    "scan_queue": lambda s, req: s.scan_queue(),
    "list_domain": lambda s, req: s.list_domain(str(req["domain"])),
    "inflight_entries": lambda s, req: s.inflight_entries(),
}


class _Connection:
    """One operator command's handles and listings in progress."""

    def __init__(self) -> None:
        self.handles: dict[tuple[str, str], Handle] = {}
        self.cursors: dict[int, Iterator[Any]] = {}
        #: the handles of the last batch of a ``scan_queue`` listing (``mailq``, ``qshape``
        #: inspect each entry as it comes and keep none): let go at its next batch, so a
        #: listing of the whole queue keeps one batch of handles, not the queue
        self.passing: dict[int, list[tuple[str, str]]] = {}
        #: bodies being read a piece a request (``read_piece``), by handle
        self.readers: dict[tuple[str, str], MailReader] = {}

    def close(self) -> None:
        """The readers left open (a command that stopped reading) closed (a storage
        thread: a reader's close is a storage call)."""
        for reader in self.readers.values():
            with contextlib.suppress(Exception):
                reader.close()
        self.readers.clear()

    def keep(self, h: Any, store: Storage | None = None) -> dict[str, Any]:
        """An item as it goes out; a handle is kept for the requests that name it, and
        with ``store`` its entry's metadata goes with it (what ``inspect_entry`` would
        answer: the commands read it for every entry listed, one request fewer each)."""
        if not isinstance(h, Handle):
            return meta_to_wire(h)  # inflight_entries
        d = handle_to_wire(h)
        self.handles[(d["kind"], h.entry_id)] = h
        if store is not None and isinstance(h, (QueuedMail, HeldMail)):
            with contextlib.suppress(Exception):  # asked for, it answers the error then
                reader = store.inspect_entry(h)
                if reader is not None:
                    with reader:
                        d["meta"] = meta_to_wire(reader.meta)
        return d

    def handle(self, req: dict[str, Any]) -> tuple[tuple[str, str], Any]:
        """The handle a request names, and its key (a move forgets it once it is made:
        a request that fails leaves it, as a store's error leaves a handle live)."""
        ref = req.get("h")
        key = (str(ref.get("kind")), str(ref.get("entry_id"))) if isinstance(ref, dict) \
            else ("", "")
        h = self.handles.get(key)
        if h is None or key[0] not in KINDS:
            raise MisuseError(f"no {key[0] or 'such'} handle for entry {key[1]!r} was given "
                              "on this connection")
        return key, h


class RelayControl:
    """Serves ``relay.ctl`` in ``root`` for the Storage ``store_of()`` gives (None while
    the queue is being reopened); ``on_queue_failed(e)`` (any thread) when a call raised
    ReopenRequiredError, as for the relay's own calls."""

    def __init__(self, root: str, store_of: Callable[[], Storage | None],
                 executor: Executor,
                 on_queue_failed: Callable[[BaseException], None] | None = None,
                 in_delivery: Callable[[], list[EntryMeta]] | None = None,
                 after: Callable[[], None] | None = None) -> None:
        self.root = root
        #: called after each request (a storage thread): the relay logs what the request
        #: set aside in the queue (``DeliveryScheduler.say_set_aside``)
        self._after = after
        #: the entries the relay's jobs hold, for a store that cannot list its inflight
        #: entries itself (the KV queue): ``mailq`` shows them in delivery (``*``)
        self._in_delivery = in_delivery
        self.path = socket_path(root)
        self._store_of = store_of
        self._executor = executor
        self._on_queue_failed = on_queue_failed
        self._server: asyncio.Server | None = None
        self._cursor_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        """Listen (a socket left by a relay that died is replaced: the pid file says this
        relay is the queue's).  OSError when the socket cannot be made."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with reachable(self.root) as path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                sock.bind(path)  # nobody can connect before listen(): mode first
                os.chmod(path, 0o600)  # the queue owner's alone (no process-wide umask)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        except BaseException:
            sock.close()
            raise

    async def close(self) -> None:
        """Stop serving: the connections are cut (a command that does not read its
        replies cannot hold the relay's stop), and the socket removed."""
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(OSError), reachable(self.root) as path:
            os.unlink(path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Connection()
        loop = asyncio.get_running_loop()
        # the command going away or quiet, or sending a line over the limit, ends it
        try:
            with contextlib.suppress(ConnectionError, ValueError, asyncio.IncompleteReadError,
                                     TimeoutError):
                while True:
                    async with asyncio.timeout(IDLE_TIMEOUT):  # a command that went quiet
                        line = await reader.readline()
                    if not line:
                        break
                    call = loop.run_in_executor(self._executor, self._answer, conn, line)
                    try:
                        reply = await asyncio.shield(call)
                    except asyncio.CancelledError:  # the relay stops: its queue closes
                        with contextlib.suppress(Exception):  # after this call, not during
                            await call
                        raise
                    writer.write(json.dumps(reply).encode() + b"\n")
                    await writer.drain()
        finally:
            self._tasks.discard(task)
            if conn.readers:
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self._executor, conn.close)
            if self._closing:  # replies it never read must not hold the stop
                writer.transport.abort()
            else:
                writer.close()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1):
                        await writer.wait_closed()

    def _answer(self, conn: _Connection, line: bytes) -> dict[str, Any]:
        """The reply to one request line (a storage thread)."""
        try:
            req = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            req = None
        if not isinstance(req, dict):
            return error_to_wire(InvalidInputError("a request is one JSON object"))
        try:
            return self._call(conn, req)
        except Exception as e:
            if isinstance(e, ReopenRequiredError) and self._on_queue_failed is not None:
                self._on_queue_failed(e)  # the relay reopens its queue, as after its own
            return error_to_wire(e)
        finally:
            if self._after is not None:
                self._after()

    def _call(self, conn: _Connection, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "more":
            return self._batch(conn, int(req.get("cursor", 0)))
        store = self._store_of()
        if store is None:
            raise StorageIOError("the relay is reopening the queue; run the command again")
        if op == "capabilities":
            return {"r": sorted(c.value for c in store.capabilities)}
        if op in LISTINGS:
            cursor = next(self._cursor_ids)
            try:
                listing = iter(LISTINGS[op](store, req))
            except UnsupportedError:
                if op != "inflight_entries" or self._in_delivery is None:
                    raise
                listing = iter(self._in_delivery())
            conn.cursors[cursor] = listing
            if op == "scan_queue":
                conn.passing[cursor] = []
            return self._batch(conn, cursor)
        if op == "inspect_entry":
            _, h = conn.handle(req)
            reader = store.inspect_entry(h)
            if reader is None:
                return {"r": None}
            with reader:
                return {"r": meta_to_wire(reader.meta)}
        if op == "read_piece":  # the next BODY_PIECE of a body, "" at its end
            key, h = conn.handle(req)
            reader = conn.readers.get(key)
            if reader is not None and req.get("start"):  # read again from the start
                del conn.readers[key]
                reader.close()
                reader = None
            if reader is None:
                reader = store.inspect_entry(h)
                if reader is None:
                    return {"r": None}
                conn.readers[key] = reader
            try:
                piece = read_piece(reader, BODY_PIECE)
            except BaseException:
                del conn.readers[key]
                reader.close()
                raise
            if not piece:
                del conn.readers[key]
                reader.close()
            return {"r": base64.b64encode(piece).decode("ascii")}
        if op in MOVES:
            key, h = conn.handle(req)
            got = MOVES[str(op)](store, h, req)
            del conn.handles[key]  # spent by the move
            return {"r": conn.keep(got) if isinstance(got, Handle) else got}
        raise InvalidInputError(f"unknown request {op!r}")

    def _batch(self, conn: _Connection, cursor: int) -> dict[str, Any]:
        it = conn.cursors.get(cursor)
        if it is None:
            raise MisuseError(f"no listing {cursor} on this connection")
        store = self._store_of()
        passing = conn.passing.get(cursor)
        if passing:  # a scan's last batch: inspected already
            for key in passing:
                conn.handles.pop(key, None)
            passing.clear()
        items = [conn.keep(x, store) for x in itertools.islice(it, BATCH)]
        if passing is not None:
            passing.extend((d["kind"], d["entry_id"]) for d in items)
        end = len(items) < BATCH
        if end:
            del conn.cursors[cursor]
            conn.passing.pop(cursor, None)
        return {"items": items, "end": end, "cursor": cursor}
