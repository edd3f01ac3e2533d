"""Real components on loopback for the relay's tests: a DNS server (dnslib), SMTP sinks
(aiosmtpd) that accept, defer, reject or drop chosen recipients, and the relay itself,
in this process (a thread with its own event loop) or as a ``queue-ref relay`` process.

Sink behaviour by the recipient's local part: ``defer...`` gets 450 at RCPT, ``reject...``
550 at RCPT, ``flaky...`` 451 at RCPT the first time it is seen and 250 afterwards,
``drop...`` has the connection closed at the end of DATA (no reply), ``slow...`` waits a
minute before it answers DATA, ``datafail...`` gets a 554 reply to DATA, ``datadefer...``
a 452 reply to DATA; anything else is accepted.  ``SinkState.script`` names the behaviour
of an address (one of ``BEHAVIOURS``) and wins over its local part.  ``SinkState.at``
gives every session a scripted reply (or a dropped connection) at a stage, from the
greeting to the final dot; ``SinkState.without`` leaves keywords out of the EHLO reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session
from dnslib import MX, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.dns import DNSError
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from hypothesis import strategies as st

from queue_ref.opener import open_queue
from queue_ref.operate.queue_actions import EntryInfo, listing
from queue_ref.relay.relay_config import RelayConfig, new_event_loop
from queue_ref.relay.relay_server import Relay

# ---- DNS ----


class _ZoneResolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, zone: dict[str, list[tuple[str, Any]]], silent: set[str],
                 servfail: set[str]) -> None:
        self.zone = zone
        self.silent = silent
        self.servfail = servfail
        self.queries: list[tuple[str, str]] = []

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        q = request.q
        name = str(q.qname).rstrip(".").lower()
        qtype = QTYPE[q.qtype]
        self.queries.append((name, qtype))
        if name in self.silent:
            raise DNSError("never answered")  # the handler sends nothing
        reply = request.reply()
        if name in self.servfail:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        records = self.zone.get(name)
        if records is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for rtype, value in records:
            if rtype != qtype:
                continue
            if rtype == "MX":
                pref, host = value
                reply.add_answer(RR(q.qname, QTYPE.MX, rdata=MX(host, pref), ttl=60))
            elif rtype == "A":
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(value), ttl=60))
        return reply


class DnsServer:
    """A DNS server on 127.0.0.1 (UDP, an ephemeral port) answering from ``zone``:
    ``{"example.com": [("MX", (10, "mx.example.com")), ("A", "127.0.0.1")]}``.  A name
    not in the zone is NXDOMAIN; ``silent`` names never get an answer; ``servfail`` names
    get SERVFAIL."""

    def __init__(self, zone: dict[str, list[tuple[str, Any]]], silent: set[str] | None = None,
                 servfail: set[str] | None = None) -> None:
        self.resolver = _ZoneResolver(zone, silent or set(), servfail or set())
        self.server = DNSServer(self.resolver, port=0, address="127.0.0.1",
                                logger=DNSLogger(log="-request,-reply,-truncated,-error,"
                                                 "-recv,-send,-data", prefix=False))
        self.port: int = self.server.server.server_address[1]

    def __enter__(self) -> DnsServer:
        self.server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.server.server.server_close()


# ---- SMTP sinks ----

#: What a sink can do to a recipient (``SinkState.script``): 250; 450 4.2.0 or 550 5.1.1
#: at RCPT; 452 4.3.1 or 554 5.6.0 after DATA; the connection closed at the end of DATA.
BEHAVIOURS = ("accept", "defer", "reject", "datadefer", "datafail", "drop")


@dataclass
class Received:
    mail_from: str
    rcpts: list[str]
    data: bytes
    peer: str
    tls: bool
    mail_options: list[str] = field(default_factory=list)  # upper case: SMTPUTF8, BODY=...


@dataclass
class SinkState:
    messages: list[Received] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    script: dict[str, str] = field(default_factory=dict)  # address -> one of BEHAVIOURS
    #: the reply of a stage in every session, instead of the sink's own: "connect" (the
    #: greeting; the connection is closed after it), "EHLO", "HELO", "MAIL", "RCPT",
    #: "DATA" (the command; a 354 is followed by the connection closed, a drop in DATA),
    #: "DOT" (after the final dot); a multiline reply's lines joined by CRLF; "drop": the
    #: connection closed instead of a reply
    at: dict[str, str] = field(default_factory=dict)
    without: set[str] = field(default_factory=set)  # EHLO keywords not offered: "8BITMIME"
    #: a pause point: each message waits after its final dot (its delivery stays in
    #: progress) until the event is set, or until it takes one of the semaphore's counts
    hold: threading.Event | threading.Semaphore | None = None
    #: a pause point in the middle of DATA: once a session has read this many octets of
    #: it, the sink reads no more of it until the event is set (the connection's buffers
    #: fill, and the client's writes wait); ``paused`` counts the sessions that stopped
    data_pause: tuple[int, threading.Event] | None = None
    paused: int = 0
    data_commands: int = 0  # DATA commands answered 354 (ended with a message or not)

    def behaviour(self, address: str) -> str:
        """What the sink does to ``address``: its script, else by its local part."""
        with self.lock:
            scripted = self.script.get(address)
        return scripted or address.split("@")[0].lower()

    def rcpts(self) -> list[str]:
        with self.lock:
            return [r for m in self.messages for r in m.rcpts]


class _SinkHandler:
    def __init__(self, state: SinkState) -> None:
        self.state = state

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          options: list[str]) -> str:
        local = self.state.behaviour(address)
        with self.state.lock:
            n = self.state.seen.get(address, 0)
            self.state.seen[address] = n + 1
        if local.startswith("defer"):
            return "450 4.2.0 Mailbox busy, try later"
        if local.startswith("reject"):
            return "550 5.1.1 No such user here"
        if local.startswith("flaky") and n == 0:
            return "451 4.3.0 Temporary trouble"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope, hostname: str,
                          responses: list[str]) -> list[str]:
        session.host_name = hostname
        # PIPELINING as Postfix's smtpd offers it (aiosmtpd reads pipelined commands but
        # does not say so), on every other connection: the relay's client then sends MAIL
        # and its RCPTs as a group on one, a command at a time on the next, and every
        # test drives both paths to the same outcomes
        with self.state.lock:
            odd = self.state.connections % 2 == 1
        if odd:
            responses = [*responses[:-1], "250-PIPELINING", responses[-1]]
        return [r for r in responses if r[4:].split(" ")[0].upper() not in self.state.without]

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        hold = self.state.hold
        while hold is not None and not (hold.is_set() if isinstance(hold, threading.Event)
                                        else hold.acquire(blocking=False)):
            await asyncio.sleep(0.01)
        dot = self.state.at.get("DOT")
        local = "drop" if dot == "drop" else self.state.behaviour(envelope.rcpt_tos[0])
        if dot is not None and dot != "drop":
            return dot
        if local.startswith("drop"):
            assert server.transport is not None
            server.transport.abort()
            return "250 never sent"
        if local.startswith("slow"):
            await asyncio.sleep(60)
        if local.startswith("datafail"):
            return "554 5.6.0 Content rejected"
        if local.startswith("datadefer"):
            return "452 4.3.1 Insufficient system storage"
        with self.state.lock:
            self.state.messages.append(Received(
                "" if envelope.mail_from in (None, "<>") else envelope.mail_from,
                list(envelope.rcpt_tos), envelope.original_content or b"",
                str(session.peer[0]), bool(session.ssl),
                [o.upper() for o in envelope.mail_options]))
        return "250 2.0.0 Ok: kept"


class _Counting(SMTP):
    def __init__(self, handler: _SinkHandler, **kw: Any) -> None:
        super().__init__(handler, **kw)
        with handler.state.lock:
            handler.state.connections += 1
        self.state = handler.state

    async def _stage(self, stage: str) -> bool:
        """Give ``stage``'s scripted reply (``SinkState.at``); False when it has none."""
        reply = self.state.at.get(stage)
        if reply is None:
            return False
        if reply != "drop":
            await self.push(reply)
        if self.transport is not None and (reply == "drop" or reply.startswith("354")):
            self.transport.abort()
        elif self.transport is not None and stage == "connect":
            self.transport.close()
        return True

    async def _handle_client(self) -> None:
        if not await self._stage("connect"):
            await super()._handle_client()

    async def smtp_EHLO(self, arg: str) -> None:
        if not await self._stage("EHLO"):
            await super().smtp_EHLO(arg)

    async def smtp_HELO(self, arg: str) -> None:
        if not await self._stage("HELO"):
            await super().smtp_HELO(arg)

    async def smtp_MAIL(self, arg: str | None) -> None:
        if not await self._stage("MAIL"):
            await super().smtp_MAIL(arg)

    async def smtp_RCPT(self, arg: str | None) -> None:
        if not await self._stage("RCPT"):
            await super().smtp_RCPT(arg)

    async def smtp_DATA(self, arg: str) -> None:
        if await self._stage("DATA"):
            return
        if self.envelope is not None and self.envelope.rcpt_tos and not arg:
            with self.state.lock:
                self.state.data_commands += 1
        pause = self.state.data_pause
        if pause is None:
            await super().smtp_DATA(arg)
            return
        reader = self._reader
        self._reader = _PausingReader(reader, self.state, *pause)  # type: ignore[assignment]
        try:
            await super().smtp_DATA(arg)
        finally:
            self._reader = reader


class _PausingReader:
    """A session's StreamReader that stops for ``gate`` once ``after`` octets of DATA were
    read (``SinkState.data_pause``)."""

    def __init__(self, reader: asyncio.StreamReader, state: SinkState, after: int,
                 gate: threading.Event) -> None:
        self._reader, self._state, self._after, self._gate = reader, state, after, gate
        self._got = 0

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        line = await self._reader.readuntil(separator)
        before, self._got = self._got, self._got + len(line)
        if before < self._after <= self._got and not self._gate.is_set():
            with self._state.lock:
                self._state.paused += 1
            while not self._gate.is_set():
                await asyncio.sleep(0.01)
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class Sink:
    """An aiosmtpd server on ``host`` (a loopback address) in a thread of its own."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, tls_context: Any = None) -> None:
        self.host = host
        self.state = SinkState()
        self._want_port = port
        self._tls = tls_context
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Sink:
        self._thread.start()
        handler = _SinkHandler(self.state)

        async def start() -> asyncio.Server:
            loop = asyncio.get_running_loop()
            return await loop.create_server(
                lambda: _Counting(handler, enable_SMTPUTF8=True, tls_context=self._tls,
                                  loop=loop), self.host, self._want_port)

        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def wait_for(self, n: int, timeout: float = 20.0) -> list[Received]:
        """Wait until the sink holds ``n`` recipients' deliveries."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.state.rcpts()) >= n:
                break
            time.sleep(0.02)
        with self.state.lock:
            return list(self.state.messages)


# ---- raw SMTP dialogues ----

#: a step of ``raw_dialogue`` that closes the connection there, without QUIT
DROP = (b"", -1)


def raw_dialogue(port: int, steps: list[bytes | tuple[bytes, int]], host: str = "127.0.0.1",
                 timeout: float = 10.0) -> list[str]:
    """An SMTP session over a plain socket: the greeting, then each step sent and its
    replies read.  A ``bytes`` step is one command line (CRLF added) with one reply; a
    ``(chunk, n)`` step is sent as it is in one write (pipelined commands, DATA content)
    and has ``n`` replies; ``DROP`` closes the connection.  The replies, greeting first,
    each with all its lines joined by CRLF; the server closing early ends the list."""
    out: list[str] = []
    with socket.create_connection((host, port), timeout=timeout) as s:
        f = s.makefile("rb")

        def reply() -> str | None:
            lines = []
            while True:
                line = f.readline()
                if not line:
                    return None
                lines.append(line.rstrip(b"\r\n").decode("utf-8", "replace"))
                if line[3:4] != b"-":
                    return "\r\n".join(lines)

        replies = [(b"", 1), *((x + b"\r\n", 1) if isinstance(x, bytes) else x for x in steps)]
        for chunk, n in replies:
            if n < 0:
                break
            s.sendall(chunk)
            for _ in range(n):
                got = reply()
                if got is None:
                    return out
                out.append(got)
    return out


def queued_entries(queue: str) -> list[EntryInfo]:
    """The QUEUED and HELD entries of the queue in ``queue`` (no relay running on it), as
    ``queue-ref mailq --json`` lists them, ``schedule.reason`` their last failure."""
    store = open_queue(queue)
    try:
        return [info for _, info in listing(store)]
    finally:
        store.close()


def codes(replies: list[str]) -> str:
    """The reply codes of ``raw_dialogue``'s replies, space-separated."""
    return " ".join(r[:3] for r in replies)


# ---- the relay in this process ----


def relay_config(queue: str, **kw: Any) -> RelayConfig:
    """A test configuration: loopback, port 0, a fast retry schedule."""
    base: dict[str, Any] = dict(
        queue=queue, listen="127.0.0.1:0", myhostname="relay.test", minimal_backoff_time=1.0,
        maximal_backoff_time=2.0, backoff_jitter=0.0, dns_timeout=1.0, shutdown_timeout=5.0,
        smtp_connect_timeout=5.0, smtp_timeout=10.0, smtpd_timeout=30.0)
    base.update(kw)
    return RelayConfig(**base).validate()


def smtp_send(port: int, mail_from: str, rcpts: list[str],
              body: bytes = b"Subject: t\r\n\r\nhi\r\n", options: tuple[str, ...] = ()) -> str:
    """Send one message to the relay on ``port`` with smtplib (every reply must be 2xx);
    the queue id its 250 named."""
    import smtplib

    with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
        c.ehlo("client.test")
        code, msg = c.mail(mail_from, list(options))
        assert code == 250, msg
        for r in rcpts:
            code, msg = c.rcpt(r)
            assert code == 250, (r, code, msg)
        code, msg = c.data(body)
        assert code == 250, msg
        return msg.decode().rsplit(" ", 1)[1]


class RelayThread:
    """A Relay running on an event loop in a thread (``start``/``stop``, no signals)."""

    def __init__(self, config: RelayConfig) -> None:
        self.log_lines: list[str] = []
        self._log = _ListStream(self.log_lines)
        self.relay = Relay(config, log_stream=self._log)
        self._loop = new_event_loop(config)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> RelayThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.relay.start(), self._loop).result(30)
        return self

    @property
    def port(self) -> int:
        assert self.relay.smtp_address is not None
        return self.relay.smtp_address[1]

    def wake(self) -> None:
        self._loop.call_soon_threadsafe(self.relay.wake)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the relay's loop and return its result."""
        async def run() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.relay.stop(), self._loop).result(60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def events(self, event: str = "delivery") -> list[dict[str, Any]]:
        import json

        out = []
        for line in list(self.log_lines):
            rec = json.loads(line)
            if rec["event"] == event:
                out.append(rec)
        return out

    def wait_events(self, n: int, event: str = "delivery", timeout: float = 20.0,
                    **match: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(event)
                     if all(e.get(k) == v for k, v in match.items())]
            if len(found) >= n or time.monotonic() > deadline:
                return found
            time.sleep(0.02)


class _ListStream:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line:
                self.lines.append(line)
        return len(text)

    def flush(self) -> None:
        pass


# ---- the relay as a process ----


class RelayProcess:
    """A ``queue-ref relay`` process whose standard error is read as it comes (a full
    pipe would stop the relay), kept in ``err_lines``."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.err_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err_lines.append(line)

    def stderr(self, timeout: float = 10.0) -> str:
        """Everything the process wrote to standard error (waits for its end)."""
        self._reader.join(timeout)
        return "".join(self.err_lines)

    def wait_log(self, text: str, timeout: float = 30.0) -> bool:
        """Wait until a line of standard error holds ``text`` (the first listing's end:
        ``queue listed``); whether one did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.err_lines)):
            if time.monotonic() > deadline or not self._reader.is_alive():
                return any(text in line for line in list(self.err_lines))
            time.sleep(0.02)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.proc, name)


@contextlib.contextmanager
def relay_process(args: list[str], env: dict[str, str] | None = None,
                  timeout: float = 30.0) -> Iterator[tuple[RelayProcess, int]]:
    """``queue-ref relay ARGS`` as a process; yields it and its SMTP port once ready."""
    cmd = [sys.executable, "-m", "conformance.cli", "relay", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    rp = RelayProcess(proc)
    try:
        port = wait_ready(rp, timeout)
        yield rp, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        rp.stderr(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def wait_ready(rp: RelayProcess, timeout: float = 30.0) -> int:
    """Read the ready line (``... smtp=HOST:PORT ...``) of a relay process; its port."""
    proc = rp.proc
    assert proc.stdout is not None
    result: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        result.append(proc.stdout.readline())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    line = result[0] if result else ""
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"relay did not get ready: {line!r} {rp.stderr()[-2000:]}")
    field_ = next(f for f in line.split() if f.startswith("smtp="))
    return int(field_.rsplit(":", 1)[1])


def plain_addresses() -> st.SearchStrategy[str]:
    """Addresses of the common form ``dot-atom@domain`` (``queue_ref.relay.smtp_address``),
    with local parts that begin as RFC 2047 encoded words among them."""
    atom = st.one_of(st.text("abcXYZ019!#$%&'*+/=?^_`{|}~-", min_size=1, max_size=12),
                     st.sampled_from(["=?utf-8?q?bob?=", "=?us-ascii?q?x=40y?=", "=?x?q??=",
                                      "a=?utf-8?q?b?=", "=?", "?="]))
    label = st.text("aZ09-", min_size=1, max_size=6)
    return st.builds("{}@{}".format, st.lists(atom, min_size=1, max_size=3).map(".".join),
                     st.lists(label, min_size=1, max_size=3).map(".".join))
