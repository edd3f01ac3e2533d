"""The SMTP receiver (Postfix's smtpd): aiosmtpd with the relay's policy and limits.

The one promise that matters: ``250 2.0.0 Ok: queued as ID`` is sent only after the
backend's ``commit`` returned, so the message is durable before the client may forget it.
Commits run on the relay's storage threads, never on the event loop, so the commits of
concurrent sessions share the backend's group-commit rounds.  A failed commit leaves
nothing queued (``Enqueuer`` aborts) and answers 451 4.3.0, or 452 4.3.1 on a full disk.

Policy, in Postfix's terms: a client in ``mynetworks`` may send anywhere; any other client
only to ``relay_domains``; everything else gets ``554 5.7.1 Relay access denied``, so the
relay is never an open relay.  A client that authenticated with AUTH
(``smtpd_sasl_auth_enable``: ``smtpd_sasl_auth``, aiosmtpd's authenticator, offered after
STARTTLS only) may send anywhere too; ``smtpd_tls_security_level = encrypt`` refuses
MAIL and the rest before STARTTLS (530 5.7.0).

``ETRN domain`` (RFC 1985), from a client in ``mynetworks`` only: the domain's deferred
mail is made due now (``queue_ref.operate.queue_actions.flush``, through the backend's
domain index where it has one) and the scheduler is woken; ``250`` when mail is waiting,
``251`` when none is, ``459`` for other clients, ``458`` when the queue fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import os
import re
import ssl
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import aiosmtpd.smtp
from aiosmtpd.smtp import MISSING, SMTP, Envelope, Session, syntax

from queue_ref.operate.queue_actions import check_domain, flush, one_line
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.relay_access import RelayAccess
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.smtp_address import fast_path_address, valid_address
from queue_ref.relay.smtp_data_reader import read_data
from queue_ref.relay.smtp_line_folding import wire_ready
from queue_ref.relay.smtpd_sasl_auth import TOO_MANY, SaslAuthenticator
from queue_ref.relay.tls_summary import CLOSE_GRACE, summary_of_session
from queue_ref.storage import (
    InvalidInputError,
    NoSpaceError,
    QueuedMail,
    Recipient,
    ReopenRequiredError,
    Schedule,
    Storage,
)

__all__ = ["NULL_PATH", "RelaySMTP", "SmtpReceiver", "valid_address"]

#: The null reverse-path ``MAIL FROM:<>`` (RFC 5321 4.5.5: bounces and other notifications),
#: as aiosmtpd's parser gives it and as the envelope keeps it until the message is queued
#: (aiosmtpd takes an empty ``mail_from`` for "no MAIL yet"); the queue stores "".
NULL_PATH = "<>"
HARD_ERROR_LIMIT = 20  # Postfix's smtpd_hard_error_limit
LINGER = 5.0  # seconds a hung-up session's input is still read (and dropped)

#: RFC 5321 4.5.1: ``RCPT TO:<Postmaster>`` without a domain, any case, is always taken
POSTMASTER = "postmaster"
#: RFC 6531 3.4 as Postfix's smtpd words it: a UTF-8 path needs MAIL FROM:<...> SMTPUTF8
NEED_SMTPUTF8 = "553 5.6.7 Must declare SMTPUTF8 to send unicode address"

# aiosmtpd's own replies, with the enhanced status codes (RFC 3463) Postfix gives them.
_REWRITES = {
    "500 Command line too long": "500 5.5.2 Error: command line too long",
    "500 Line too long (see RFC5321 4.5.3.1.6)": "500 5.5.2 Error: line too long in DATA",
    "552 Error: Too much mail data": "552 5.3.4 Error: message file too big",
    "552 Error: message size exceeds fixed maximum message size":
        "552 5.3.4 Message size exceeds fixed limit",
    "553 5.1.3 Error: malformed address": "501 5.1.3 Bad recipient address syntax",
}
_BARE_LF = re.compile(rb"(?<!\r)\n")
_CLASS_DEFAULT = {"2": "2.0.0", "4": "4.0.0", "5": "5.5.0"}
_CODE_DEFAULT = {"500": "5.5.2", "501": "5.5.4", "502": "5.5.1", "503": "5.5.1", "504": "5.5.4",
                 "530": "5.7.0", "554": "5.7.0", "555": "5.5.4"}


def _enhance(status: str) -> str:
    status = _REWRITES.get(status, status)
    code, sep, text = status.partition(" ")
    if not sep or len(code) != 3 or not code.isdigit() or code in ("220", "354"):
        return status
    if re.match(r"[245]\.\d{1,3}\.\d{1,3}( |$)", text):
        return status
    enhanced = _CODE_DEFAULT.get(code) or _CLASS_DEFAULT.get(code[0])
    return f"{code} {enhanced} {text}" if enhanced else status


_VERBS = ("smtp_", "auth_", "handle_")


def _verb_names(cls: type) -> list[str]:
    """The names aiosmtpd looks for on a session or a handler of class ``cls`` (kept on
    the class itself, so that each subclass has its own)."""
    names: list[str] | None = cls.__dict__.get("_verb_names")
    if names is None:
        names = sorted({n for base in cls.__mro__ for n in vars(base) if n.startswith(_VERBS)})
        setattr(cls, "_verb_names", names)  # noqa: B010
    return names


#: aiosmtpd's own log (a line per command at INFO, "unrecognised" and timeouts at
#: WARNING): silenced, as its lines would reach standard error through logging's last
#: resort among the relay's records (and break a JSON log); the relay logs what matters
#: itself (``reject``, ``timeout``).
logging.getLogger("mail.log").addHandler(logging.NullHandler())
logging.getLogger("mail.log").propagate = False
#: aiosmtpd closes a session after 5 unknown commands with a 502 of its own; the relay's
#: rule is Postfix's, for every error alike: 421 after ``HARD_ERROR_LIMIT``
#: (``RelaySMTP.push``).  aiosmtpd reads its limit from the module when a session starts.
aiosmtpd.smtp.BOGUS_LIMIT = 1 << 30


class RelaySMTP(SMTP):
    """aiosmtpd's server speaking enhanced status codes, counting errors like Postfix.
    Every 4xx or 5xx reply is logged (``reject``: client, helo, sender, reply), as
    Postfix's ``NOQUEUE: reject:`` lines; ``smtpd_timeout`` bounds each wait for the
    client (a command, or the next bytes of its data: a slow upload goes on), and a
    client that lets it pass gets 421 and a ``timeout`` record."""

    # aiosmtpd looks up its verbs (smtp_*), auth mechanisms (auth_*) and hooks (handle_*)
    # with dir() and inspect.getmembers() for every connection: ~130 us each, 5% of a
    # message's CPU.  dir() of a session (and of the receiver) names those alone, computed
    # once per class.

    def __dir__(self) -> list[str]:
        return _verb_names(type(self))

    def __init__(self, handler: SmtpReceiver, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.receiver = handler
        self.raw_pushes = 0  # replies (EHLO/HELO lines) that take no enhanced code
        self.errors = 0
        self.hung_up = False  # 421 sent: what the client still sends is read and dropped
        #: whether a line of the last DATA began with a dot (``DataRead.dot_lines``)
        self.data_dot_lines = True
        self.in_data = False  # reading a message's data (after 354)
        self._timer_reset = 0.0  # loop time the timeout was last pushed back in DATA
        self._data_bytes = 0  # octets received since the 354

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        fast = fast_path_address(arg)
        if fast is None:
            return super()._getaddr(arg)
        if self.local_part_limit and len(fast[0].rpartition("@")[0]) > self.local_part_limit:
            return None, None
        return fast

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.receiver.sessions.add(self)
        if self.receiver.shutting_down and self._original_transport is None:
            # accepted while the relay stops: close_sessions may already have passed
            task = asyncio.get_running_loop().create_task(self.close_for_shutdown())
            self.receiver.closing.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self.receiver.closing.discard)

    def connection_lost(self, error: Exception | None) -> None:
        self.receiver.sessions.discard(self)
        super().connection_lost(error)
        if self.receiver.on_session_end is not None:
            self.receiver.on_session_end()

    async def push(self, status: Any) -> None:
        if self.hung_up:
            return
        if isinstance(status, bytes):
            status = status.decode("utf-8", "surrogateescape")
        if self.raw_pushes > 0:
            self.raw_pushes -= 1
        else:
            status = _enhance(status)
        await super().push(status)
        if status[:1] in ("4", "5"):
            self.receiver.log_reject(self, status)
        if status[:1] in ("4", "5") and not status.startswith("421"):
            self.errors += 1
            if self.errors >= HARD_ERROR_LIMIT and self.transport is not None:
                await super().push("421 4.7.0 Error: too many errors")
                self.receiver.log_reject(self, "421 4.7.0 Error: too many errors")
                self._hang_up()

    def _timeout_cb(self) -> None:
        """aiosmtpd's timeout (no command, or no data, for ``smtpd_timeout``): say 421
        before the connection is closed, as Postfix's smtpd does, and log it."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self.hung_up:
            with contextlib.suppress(Exception):
                transport.write(  # type: ignore[attr-defined]
                    f"421 4.4.2 {self.hostname} Error: timeout exceeded\r\n"
                    .encode("ascii", "replace"))
            self.receiver.log.emit("timeout", client=_client(self.session),
                                   after="DATA" if self.in_data else "command",
                                   seconds=self._timeout_duration)
        super()._timeout_cb()  # type: ignore[no-untyped-call]

    def data_received(self, data: bytes) -> None:
        """Bytes of a message's data came: its timeout starts again (at most once a
        second, or four times a timeout), so an upload slower than ``smtpd_timeout`` in
        all goes on."""
        if self.in_data:
            self._data_bytes += len(data)
            now = self.loop.time()
            # past the size limit (the reply will be 552) the data no longer buys time:
            # a client cannot hold a session by trickling bytes it knows are dropped
            if now - self._timer_reset >= min(1.0, self._timeout_duration / 4) \
                    and self._data_bytes <= (self.data_size_limit or 0) + PAST_LIMIT_SLACK:
                self._timer_reset = now
                self._reset_timeout()
        super().data_received(data)

    def _hang_up(self) -> None:
        """End the session after its 421 so that the client gets every reply: closing a
        socket with unread input makes the kernel reset the connection and drop the
        replies not yet sent.  So: send FIN after the replies (``write_eof``), read and
        drop what the client still sends (a pipelining client may have sent thousands of
        commands), and close once it closes, or after ``LINGER`` seconds."""
        transport = self.transport
        assert transport is not None
        self.hung_up = True
        # uvloop's transports are no asyncio.WriteTransport: ask for the methods themselves
        can_write_eof = getattr(transport, "can_write_eof", None)
        if can_write_eof is not None and can_write_eof():
            transport.write_eof()  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_later(LINGER, transport.close)
        else:
            transport.close()

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        """aiosmtpd's DATA, with the data read in bulk (``smtp_data_reader``)."""
        if self._decode_data or "DATA" not in self._handle_hooks:
            await super().smtp_DATA(arg)
            return
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        assert self.envelope is not None
        if not self.envelope.rcpt_tos:
            await self.push("503 Error: need RCPT command")
            return
        if arg:
            await self.push("501 Syntax: DATA")
            return
        in_flow = self.receiver.in_flow
        if in_flow is not None:  # delivery behind: the data waits (in_flow_delay at most)
            await in_flow(self.envelope.rcpt_tos, self.receiver.config.in_flow_delay)
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        self.in_data = True
        self._data_bytes = 0
        try:
            # lines of any length, as Postfix's smtpd: delivery folds them (smtp_delivery)
            got = await read_data(self._reader, self.data_size_limit, None)
        except asyncio.CancelledError:  # the connection went away during DATA
            self._writer.close()
            raise
        except asyncio.IncompleteReadError as e:  # the stream ended before the terminator
            # aiosmtpd's way out for a lost connection: it closes the writer and ends
            raise ConnectionResetError("the client's stream ended during DATA") from e
        finally:
            self.in_data = False
        if got.error is not None:
            await self.push(got.error)
            self._set_post_data_state()  # type: ignore[no-untyped-call]
            return
        self.envelope.content = got.content
        self.envelope.original_content = got.content
        self.data_dot_lines = got.dot_lines
        # shielded: a client that hangs up after its final dot does not cut the commit
        # short; the message is committed, logged and delivered, its 250 goes nowhere
        status = await asyncio.shield(self._call_handler_hook("DATA"))
        self._set_post_data_state()  # type: ignore[no-untyped-call]
        await self.push("250 OK" if status is MISSING else status)

    @syntax("AUTH <mechanism>")
    async def smtp_AUTH(self, arg: str) -> None:
        """aiosmtpd's AUTH when ``smtpd_sasl_auth_enable`` is on; a client address with
        ``smtpd_auth_failure_limit`` recent failures gets 421 and is hung up on."""
        auth = self.receiver.auth
        if auth is None:
            await self.push("503 5.5.1 Error: authentication not enabled")
            return
        client = _client_ip(self.session)
        blocked_before = auth.blocked(client)
        if not blocked_before:
            await super().smtp_AUTH(arg)  # the failure reaching the limit is answered 421
        if auth.blocked(client) and self.transport is not None and not self.hung_up:
            auth.log.emit("auth", client=client, status="blocked",
                          reason=f"{auth.failures(client)} failed attempts within "
                                 f"{auth.window:g} s")
            if blocked_before:
                await super().push(TOO_MANY)
            self._hang_up()

    @syntax("ETRN domain")
    async def smtp_ETRN(self, arg: str | None) -> None:
        assert self.session is not None and self.envelope is not None
        await self.push(await self.receiver.etrn(self.session, self.envelope, arg or ""))

    async def close_for_shutdown(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(ConnectionError, RuntimeError):
                await super().push("421 4.3.2 Service shutting down, closing transmission channel")
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        """Drop the connection now: what is not yet sent is discarded.  After STARTTLS
        both the TLS transport and the socket's own are aborted (a TLS close waits for the
        client's close_notify, which a client that does not read never sends)."""
        for transport in (self.transport, self._original_transport):
            if transport is not None:
                transport.abort()  # type: ignore[attr-defined]


def _store_message(store: Storage, mail_from: str, params: dict[str, str],
                   received: tuple[bytes, bytes], body: bytes, rcpts: Sequence[str],
                   named: list[str] | None = None, line_limit: int = 0
                   ) -> tuple[list[QueuedMail], int, bool]:
    """Enqueue and commit (on a storage thread); the handles, the length of the
    ``Received:`` header, whose two parts go either side of `` id QUEUEID`` where the
    backend names the message before commit (``Enqueuer.message_id``, also appended to
    ``named``, so that a failure can be logged with it), and whether that header goes
    out as it is (``wire_ready`` with ``line_limit``).  Nothing stays queued if it
    raises."""
    now = int(time.time())
    with store.enqueue(mail_from, params) as enq:
        message_id = enq.message_id
        if named is not None and message_id:
            named.append(message_id)
        header = received[0] + (f" id {message_id}".encode() if message_id else b"") + received[1]
        enq.write(header)
        enq.write(body)
        handles = enq.commit([Recipient(r, Schedule(now)) for r in rcpts])
        return handles, len(header), wire_ready(header, line_limit)


class SmtpReceiver:
    """aiosmtpd handler: policy, limits, ``Received:``, commit, then 250."""

    def __dir__(self) -> list[str]:  # see RelaySMTP.__dir__
        return _verb_names(type(self))

    def __init__(self, config: RelayConfig, store: Storage, executor: Executor,
                 log: DeliveryLog, on_queued: Callable[..., None],
                 on_commit_time: Callable[[float], None] | None = None,
                 on_etrn: Callable[[str, str], None] | None = None) -> None:
        """``on_queued(handles, wire_ready=...)`` is called with each message committed,
        ``wire_ready`` telling whether its stored body (the ``Received:`` header
        included) goes out as it is (``smtp_line_folding.wire_ready``).
        ``on_etrn(domain, outcome)`` is called after every ETRN that reached the queue
        (outcome "started", "empty" or "failed"); the relay wakes its scheduler there."""
        self.on_etrn = on_etrn
        self.config = config
        self.store = store
        self.executor = executor
        self.log = log
        self.on_queued = on_queued
        self.on_commit_time = on_commit_time
        #: Called with the ReopenRequiredError a commit raised (the relay reopens).
        self.on_queue_failed: Callable[[BaseException], None] | None = None
        #: Awaited with the recipients and ``in_flow_delay`` before each DATA's 354
        #: (the scheduler's ``in_flow``: while delivery is behind, the data waits).
        self.in_flow: Callable[[list[str], float], Awaitable[None]] | None = None
        self.sessions: set[RelaySMTP] = set()
        #: Called as each session ends (a worker tells its master, ``session_handoff``).
        self.on_session_end: Callable[[], None] | None = None
        #: a worker serving one root of the queue: asks the workers serving the others to
        #: flush the domain too; True if the request went out (``session_handoff``)
        self.etrn_elsewhere: Callable[[str], bool] | None = None
        #: close_for_shutdown of sessions accepted while the relay stops, under way
        self.closing: set[asyncio.Task[None]] = set()
        self.shutting_down = False
        self.commits = 0  # commits in progress
        self.access = RelayAccess(config.mynetworks, config.relay_domains)
        self._stamp = (0, "")  # (second, its date for a Received header)
        self._tls: ssl.SSLContext | None = None
        if config.smtpd_tls_cert_file and config.smtpd_tls_security_level != "none":
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(config.smtpd_tls_cert_file, config.smtpd_tls_key_file)
        #: SMTP AUTH (smtpd_sasl_auth_enable): aiosmtpd's authenticator, None when off
        self.auth = SaslAuthenticator(config, log) if config.smtpd_sasl_auth_enable else None

    # ---- the server ----

    def protocol(self) -> RelaySMTP:
        return RelaySMTP(
            self, data_size_limit=self.config.message_size_limit, enable_SMTPUTF8=True,
            hostname=self.config.myhostname, ident="ESMTP queue-ref", tls_context=self._tls,
            require_starttls=self.config.smtpd_tls_security_level == "encrypt",
            authenticator=self.auth, auth_require_tls=self.config.smtpd_tls_auth_only,
            timeout=self.config.smtpd_timeout, loop=asyncio.get_running_loop())

    async def close_sessions(self, timeout: float) -> None:
        """Refuse new transactions, let running commits end (up to ``timeout``), then say
        421 to every session and close it."""
        self.shutting_down = True
        deadline = time.monotonic() + timeout
        while self.commits and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for s in list(self.sessions):
            await s.close_for_shutdown()
        # a closed session is gone once its replies are out and, after STARTTLS, once
        # the client answered the TLS close: a client that reads nothing holds it
        grace = time.monotonic() + CLOSE_GRACE
        while self.sessions and time.monotonic() < grace:
            await asyncio.sleep(0.01)
        for s in list(self.sessions):
            s.abort()
        for _ in range(3):  # the aborted transports' connection_lost runs on the loop
            await asyncio.sleep(0)

    # ---- policy ----

    def _date(self) -> str:
        """The date for a Received header: RFC 5322, local time, made once a second."""
        second = int(time.time())
        if self._stamp[0] != second:
            self._stamp = (second, email.utils.formatdate(second, localtime=True))
        return self._stamp[1]

    async def handle_exception(self, error: Exception) -> str:
        """aiosmtpd's hook for an error raised while it handled a command: an ``error``
        record with the place it came from (a bug), and a reply that tells the client
        nothing of the relay's insides."""
        tb = traceback.extract_tb(error.__traceback__)[-3:]
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                           for f in reversed(tb))
        self.log.emit("error", what="smtpd session", reason=f"{type(error).__name__}: "
                      f"{error} (at {where})")
        return "451 4.3.0 Error: internal error, try again later"

    def log_reject(self, s: RelaySMTP, reply: str) -> None:
        """A ``reject`` record of a 4xx or 5xx reply (Postfix's ``NOQUEUE: reject:``).
        aiosmtpd's reply to an unknown command quotes it; the record does not (a client
        sending credentials after a refused AUTH would have them logged)."""
        reply = _UNKNOWN_COMMAND.sub("command not recognized", reply)
        env = s.envelope
        helo = s.session.host_name if s.session is not None else None
        fields: dict[str, Any] = {"from": env.mail_from if env is not None else None}
        self.log.emit("reject", client=_client(s.session),
                      helo=one_line(helo)[:255] if helo else None,
                      reply=one_line(reply)[:512], **fields)

    def client_trusted(self, session: Session) -> bool:
        peer = session.peer
        host = peer[0] if isinstance(peer, tuple) else ""
        return self.access.trusted(host)

    # ---- aiosmtpd hooks ----

    async def handle_EHLO(self, server: RelaySMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        session.host_name = hostname
        out = [r for r in responses if not r.endswith(" HELP") and not r.endswith("-HELP")
               and (self.auth is not None or not r[4:].startswith("AUTH"))]
        out = [r.replace("250 ", "250-", 1) for r in out]
        out += ["250-PIPELINING", "250-ETRN", "250 ENHANCEDSTATUSCODES"]
        server.raw_pushes = len(out)
        return out

    def handle_STARTTLS(self, server: RelaySMTP, session: Session, envelope: Envelope) -> bool:
        """The handshake is done: one ``tls`` record, as Postfix's smtpd logs "Anonymous
        TLS connection established from ..." (no client certificate is asked for)."""
        tls = summary_of_session(session.ssl)
        if tls is not None:
            self.log.emit("tls", direction="in", client=_client(session),
                          version=tls.version, cipher=tls.cipher, bits=tls.bits)
        return True

    async def handle_HELO(self, server: RelaySMTP, session: Session, envelope: Envelope,
                          hostname: str) -> str:
        session.host_name = hostname
        server.raw_pushes = 1
        return f"250 {self.config.myhostname}"

    async def handle_MAIL(self, server: RelaySMTP, session: Session, envelope: Envelope,
                          address: str, mail_options: list[str]) -> str:
        if self.shutting_down:
            return "421 4.3.2 Service shutting down"
        if address != NULL_PATH and not valid_address(address):
            return "501 5.1.7 Bad sender address syntax"
        if not envelope.smtp_utf8 and not address.isascii():
            return NEED_SMTPUTF8
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Ok"

    async def handle_RCPT(self, server: RelaySMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        limit = self.config.smtpd_recipient_limit
        backend_limit = self.store.limits.max_recipients
        if backend_limit is not None:
            limit = min(limit, backend_limit)
        if len(envelope.rcpt_tos) >= limit:
            return "452 4.5.3 Error: too many recipients"
        if address.lower() == POSTMASTER:  # addressed to us: relay access does not apply
            envelope.rcpt_tos.append(address)  # postmaster_recipient once queued
            envelope.rcpt_options.extend(rcpt_options)
            return "250 2.1.5 Ok"
        if not valid_address(address):
            return "501 5.1.3 Bad recipient address syntax"
        if not envelope.smtp_utf8 and not address.isascii():
            return NEED_SMTPUTF8
        peer = session.peer  # permit_sasl_authenticated, then the relay access rules
        if not session.authenticated and not self.access.permits(
                peer[0] if isinstance(peer, tuple) else "", address):
            return f"554 5.7.1 <{address}>: Relay access denied"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: RelaySMTP, session: Session, envelope: Envelope) -> str:
        if self.shutting_down:
            return "421 4.3.2 Service shutting down"
        body = envelope.original_content or b""
        if b"\x00" in body:
            return "554 5.6.0 Error: message content contains a NUL character"
        # A body that goes out as it is (CRLF only, no line over the delivery's limit, no
        # line that starts with a dot: the DATA reader saw none) is told to the scheduler,
        # whose delivery then sends it without a look.  Else bare LF becomes CRLF (Postfix's
        # smtpd_forbid_bare_newline = normalize), counting first: the substitution costs
        # 17 ms per MB even when there is nothing to change.
        ready = wire_ready(body, self.config.smtp_line_length_limit,
                           dots=server.data_dot_lines)
        if not ready and body.count(b"\n") != body.count(b"\r\n"):
            body = _BARE_LF.sub(b"\r\n", body)
        if _hops(body) + 1 >= self.config.hopcount_limit:  # our Received: counts too
            return "554 5.4.6 Error: too many hops"
        mail_from = "" if envelope.mail_from == NULL_PATH else envelope.mail_from or ""
        postmaster = self.config.postmaster_recipient
        rewritten = [r for r in envelope.rcpt_tos if r.lower() == POSTMASTER]
        rcpts = [postmaster if r.lower() == POSTMASTER else r for r in envelope.rcpt_tos]
        client = _client_ip(session)
        helo = session.host_name or client
        opts = [o.upper() for o in envelope.mail_options]
        proto = ("UTF8SMTP" if envelope.smtp_utf8 else "ESMTP") if session.extended_smtp else "SMTP"
        if session.ssl and session.extended_smtp:
            proto += "S"
        params = {"arrival": f"{time.time():.3f}", "client": client, "helo": helo[:255]}
        if "BODY=8BITMIME" in opts:
            params["body"] = "8BITMIME"
        if envelope.smtp_utf8:
            params["smtputf8"] = "yes"
        stamp = self._date()
        tls = summary_of_session(session.ssl)  # smtpd_tls_received_header = yes
        received = ((f"Received: from {_clean(helo)} ([{client}])\r\n"
                     + (f"\t{tls.received_comment()}\r\n" if tls else "")
                     + f"\tby {self.config.myhostname} (queue-ref) with {proto}"
                     ).encode("utf-8", "surrogateescape"),
                    ((f"\r\n\tfor <{rcpts[0]}>" if len(rcpts) == 1 else "")
                     + f"; {stamp}\r\n").encode("utf-8", "surrogateescape"))
        self.commits += 1
        started = time.perf_counter()
        named: list[str] = []
        try:
            loop = asyncio.get_running_loop()
            handles, header_size, header_ready = await loop.run_in_executor(
                self.executor, _store_message, self.store, mail_from, params, received, body,
                rcpts, named, self.config.smtp_line_length_limit)
        except Exception as e:
            # nothing was queued: the line names the aborted message's id where the backend
            # gave one before commit (else NOQUEUE, as Postfix's), and whose mail it was
            failed = functools.partial(
                self.log.emit, "error", named[0] if named else "NOQUEUE", what="commit",
                **{"from": mail_from}, nrcpt=len(rcpts), client=client)
            if isinstance(e, NoSpaceError):
                failed(reason=f"no space: {e}")
                return "452 4.3.1 Insufficient system storage"
            if isinstance(e, InvalidInputError):
                failed(reason=f"refused by the queue: {e}")
                return "554 5.3.4 Error: the queue refuses this message"
            failed(reason=f"{type(e).__name__}: {e}")  # the client keeps it and retries
            if isinstance(e, ReopenRequiredError) and self.on_queue_failed is not None:
                self.on_queue_failed(e)
            return "451 4.3.0 Error: queue file write error"
        finally:
            self.commits -= 1
        if self.on_commit_time is not None:
            self.on_commit_time(time.perf_counter() - started)
        queue_id = handles[0].message_id
        self.log.emit("received", queue_id, **{"from": mail_from}, size=header_size + len(body),
                      nrcpt=len(rcpts), client=client, helo=helo[:255])
        for orig in rewritten:  # Postfix's delivery lines say orig_to=<postmaster>
            self.log.emit("rewrite", queue_id, to=postmaster, orig_to=orig)
        self.on_queued(handles, wire_ready=ready and header_ready)
        return f"250 2.0.0 Ok: queued as {queue_id}"


    async def etrn(self, session: Session, envelope: Envelope, arg: str) -> str:
        """The reply to ``ETRN arg`` (RFC 1985)."""
        if session.host_name is None:
            return "503 5.5.1 Error: send HELO/EHLO first"
        if envelope.mail_from is not None:
            return "503 5.5.1 Error: MAIL transaction in progress"
        node = arg.strip()
        if not node:
            return "501 5.5.4 Syntax: ETRN domain"
        if node.startswith("#"):
            return f"458 4.3.0 Unable to queue messages for node {node[:64]}: no such queue"
        try:
            domain = check_domain(node.removeprefix("@"))
        except InvalidInputError:
            return "501 5.5.4 Error: invalid parameter syntax"
        if not self.client_trusted(session):
            return f"459 4.7.1 <{domain}>: Node not allowed: client not permitted"
        if self.shutting_down:
            return "421 4.3.2 Service shutting down"
        # the other roots' workers first: they flush whatever this root's flush meets
        elsewhere = self.etrn_elsewhere is not None and self.etrn_elsewhere(domain)
        loop = asyncio.get_running_loop()
        try:
            res = await loop.run_in_executor(self.executor, flush, self.store, domain)
        except Exception as e:
            self.log.emit("error", what="etrn", reason=f"{type(e).__name__}: {e}")
            if self.on_etrn is not None:
                self.on_etrn(domain, "failed")
            return f"458 4.3.0 Unable to queue messages for node {domain}"
        # mail in the other roots is not counted here: asked to flush, they may hold some
        waiting = len(res.changed) + len(res.skipped) + elsewhere
        self.log.emit("etrn", domain=domain, status="started" if waiting else "empty",
                      entries=len(res.changed) + len(res.skipped), other_roots=elsewhere or None,
                      client=_client_ip(session))
        if self.on_etrn is not None:
            self.on_etrn(domain, "started" if waiting else "empty")
        if not waiting:
            return f"251 2.0.0 OK, no messages waiting for node {domain}"
        return f"250 2.0.0 Queuing for node {domain} started"


_UNKNOWN_COMMAND = re.compile(r'command "[^"]*" not recognized')
PAST_LIMIT_SLACK = 1 << 16  # octets of data past message_size_limit that still buy time


def _client(session: Session | None) -> str:
    """A session's client as ``[address]:port`` (``unknown`` without one)."""
    peer = session.peer if session is not None else None
    return f"[{peer[0]}]:{peer[1]}" if isinstance(peer, tuple) else "unknown"


def _client_ip(session: Session | None) -> str:
    """A session's client address alone (``unknown`` without one)."""
    peer = session.peer if session is not None else None
    return peer[0] if isinstance(peer, tuple) else "unknown"


def _hops(body: bytes) -> int:
    """The ``Received:`` headers of a message (CRLF line endings): RFC 5321 6.3's loop
    detection, as Postfix's cleanup counts them for ``hopcount_limit``."""
    if body.startswith(b"\r\n"):
        return 0  # no header section
    end = body.find(b"\r\n\r\n")
    head = body if end < 0 else body[:end]
    return (b"\r\n" + head.lower()).count(b"\r\nreceived:")


def _clean(text: str) -> str:
    """A client-supplied name made safe for a header (no controls, no parentheses)."""
    return re.sub(r"[\x00-\x20\x7f()\[\]\\]", "_", text)[:255] or "unknown"
