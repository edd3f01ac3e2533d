"""The SMTP client (Postfix's smtp): one transaction for a message's recipients at one
destination, over aiosmtplib, STARTTLS as the next hop's TLS policy says
(``smtp_tls_policy``), SMTP AUTH over TLS where credentials are configured, connections
kept for reuse.

``deliver`` tries the route's addresses in order; it moves to the next on a connection
failure or a greeting that is not 220 (Postfix's smtp_skip_5xx_greeting).  Once a
transaction has begun, each recipient gets the reply that decided its fate: the RCPT
reply when refused, otherwise the reply to the end of DATA.  A connection lost during the
transaction defers the recipients it had not finished (their fate is unknown: at least
once means they are tried again).  A TLS policy or an AUTH that fails at a host is a
failure of that host too (4.7.4 TLS not offered, 4.7.5 no TLS or no trusted certificate,
4.7.x AUTH refused): the next address is tried, and when none succeeds the recipients
are deferred with the reason; mail is never sent in clear, nor credentials, against it.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import time
from dataclasses import dataclass

import aiosmtplib

from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.mx_routing import Nexthop
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.smtp_address import plain_quoted
from queue_ref.relay.smtp_pipelining import pipelined_replies
from queue_ref.relay.smtp_tls_policy import TlsPolicies
from queue_ref.relay.smtp_wire_body import (
    BodyStream,
    BodyUnreadable,
    header_ascii,
    send_stream,
    wire_parts,
)
from queue_ref.relay.tls_summary import CLOSE_GRACE, NO_TLS, summary_of

__all__ = ["RcptResult", "SmtpDeliverer", "dsn_of"]


@dataclass
class RcptResult:
    code: int  # the SMTP reply code; 0 when no server answered (connection failure)
    dsn: str  # the enhanced status code, "4.4.1" for a connection failure
    text: str  # the reply or the failure, for logs and bounces
    relay: str  # the host that answered, "none" when none did
    tls: str = NO_TLS  # the session's "TLSv1.3:CIPHER" (tls_summary), "none" in clear text

    @property
    def outcome(self) -> str:
        """sent, deferred or bounced."""
        if 200 <= self.code < 300:
            return "sent"
        return "bounced" if self.code >= 500 else "deferred"


def dsn_of(code: int, text: str) -> str:
    m = re.match(r"([245])\.(\d{1,3})\.(\d{1,3})\b", text)
    if m and m.group(1) == str(code)[0]:
        return m.group(0)
    return {2: "2.0.0", 4: "4.0.0", 5: "5.0.0"}.get(code // 100, "4.0.0")


def _reply(code: int, message: str) -> str:
    return f"{code} {' '.join(message.split())}"


class _HostRefused(Exception):
    """A host that answered but failed the EHLO handshake, the TLS policy or AUTH:
    ``dsn`` and ``text`` (the host is the relay the delivery log names)."""

    def __init__(self, dsn: str, text: str) -> None:
        super().__init__(text)
        self.dsn = dsn
        self.text = text


class _Conn:
    __slots__ = ("hop", "idle_since", "smtp", "tls")

    def __init__(self, hop: Nexthop, smtp: aiosmtplib.SMTP) -> None:
        self.hop = hop
        self.smtp = smtp
        self.idle_since = time.monotonic()
        #: what the session uses (STARTTLS is done by now), None in clear text
        self.tls = summary_of(smtp.get_transport_info("ssl_object")) if smtp.is_connected else None


class SmtpDeliverer:
    def __init__(self, config: RelayConfig, log: DeliveryLog | None = None) -> None:
        """``log``: where each new connection's TLS session is logged (a ``tls`` record)."""
        self.config = config
        self.log = log
        self.policies = TlsPolicies(config)
        self._idle: dict[Nexthop, list[_Conn]] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.connections_made = 0
        self.connections_reused = 0

    async def _connect(self, hop: Nexthop) -> _Conn:
        c = self.config
        smtp = aiosmtplib.SMTP(
            hostname=hop.address, port=hop.port, local_hostname=c.myhostname,
            timeout=c.smtp_timeout, start_tls=False, validate_certs=False)
        await smtp.connect(timeout=c.smtp_connect_timeout)
        try:
            if smtp.last_ehlo_response is None and smtp.last_helo_response is None:
                await _hello(smtp, hop)
            await self._secure(smtp, hop)
        except BaseException:
            smtp.close()
            raise
        self.connections_made += 1
        conn = _Conn(hop, smtp)
        if self.log is not None and conn.tls is not None:  # Postfix's "TLS connection established"
            self.log.emit("tls", direction="out", server=str(hop), version=conn.tls.version,
                          cipher=conn.tls.cipher, bits=conn.tls.bits)
        return conn

    async def _secure(self, smtp: aiosmtplib.SMTP, hop: Nexthop) -> None:
        """STARTTLS and AUTH on a greeted connection as the hop's policy says; raises
        _HostRefused when the policy cannot be met or AUTH fails."""
        dest = hop.destination or hop.name
        policy = self.policies.policy(dest)
        if policy.level != "none" and smtp.supports_extension("starttls"):
            try:
                await smtp.starttls(tls_context=self.policies.context(policy),
                                    server_hostname=None if hop.name == hop.address
                                    else hop.name)  # SNI: a name, never an address
            except ssl.SSLCertVerificationError as e:
                raise _HostRefused("4.7.5", f"Server certificate not verified: host {hop}: "
                                            f"{e.verify_message}") from None
            except (ssl.SSLError, aiosmtplib.SMTPException) as e:
                if not policy.required:
                    raise  # may: a connection failure, the next address is tried
                raise _HostRefused("4.7.5", f"Cannot start TLS: handshake failure with host "
                                            f"{hop}: {_why(e)}") from None
            bad = self.policies.mismatch(policy, dest, hop.name,
                                         smtp.get_transport_info("peercert"))
            if bad is not None:
                raise _HostRefused("4.7.5", f"Server certificate not verified: host {hop}: {bad}")
            await smtp.ehlo()
        elif policy.required:
            raise _HostRefused("4.7.4", f"TLS is required, but was not offered by host {hop}")
        creds = self.policies.credentials(dest, hop.name)
        if creds is None or not smtp.supports_extension("auth"):
            return
        if smtp.get_transport_info("sslcontext") is None:
            raise _HostRefused("4.7.0", f"SASL authentication to host {hop} refused: "
                                        "credentials are sent over TLS only, and this "
                                        "connection has none (smtp_tls_security_level "
                                        f"{policy.level})")
        try:
            await _login(smtp, *creds)
        except aiosmtplib.SMTPAuthenticationError as e:
            dsn = "4" + dsn_of(e.code, e.message)[1:]
            raise _HostRefused(dsn, f"SASL authentication failed; server {hop} said: "
                                    f"{_reply(e.code, e.message)}") from None

    def _take_idle(self, hop: Nexthop) -> _Conn | None:
        pool = self._idle.get(hop)
        while pool:
            conn = pool.pop()
            if conn.smtp.is_connected:
                self.connections_reused += 1
                return conn
        return None

    def _release(self, conn: _Conn) -> None:
        if not conn.smtp.is_connected:
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.hop, []).append(conn)
        if self._reaper is None:
            loop = asyncio.get_running_loop()
            self._reaper = loop.call_later(self.config.smtp_connection_cache_time_limit,
                                           self._reap)

    def _reap(self) -> None:
        self._reaper = None
        limit = self.config.smtp_connection_cache_time_limit
        now = time.monotonic()
        left = False
        for hop, pool in list(self._idle.items()):
            keep = []
            for conn in pool:
                if now - conn.idle_since >= limit or not conn.smtp.is_connected:
                    task = asyncio.get_running_loop().create_task(_quit(conn.smtp))
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
                else:
                    keep.append(conn)
            if keep:
                self._idle[hop] = keep
                left = True
            else:
                del self._idle[hop]
        if left:
            self._reaper = asyncio.get_running_loop().call_later(limit, self._reap)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        pools, self._idle = self._idle, {}
        await asyncio.gather(*(_quit(c.smtp) for pool in pools.values() for c in pool),
                             *self._closing, return_exceptions=True)

    async def deliver(self, hosts: list[Nexthop], mail_from: str, rcpts: list[str],
                      body: bytes | BodyStream, params: dict[str, str], *,
                      wire_ready: bool = False) -> list[RcptResult]:
        """One result per recipient, in order.  ``wire_ready``: ``body`` is known to hold
        CRLF line breaks only, no line over the line length limit and no line that starts
        with a dot (``smtp_line_folding.wire_ready``), so it is sent as it is, unstuffed
        (``wire_payload``); passed for any other body it would put a bare dot line on the
        wire.  A ``BodyStream`` is read as it is sent; ``BodyUnreadable`` when the queue
        could not give all of it: nothing was delivered, and no other host is tried."""
        failures: list[RcptResult] = []
        for hop in hosts:
            conn = self._take_idle(hop)
            reused = conn is not None
            if conn is None:
                conn = await self._connect_or_fail(hop, failures)
                if conn is None:
                    continue
            results = await self._transaction(conn, mail_from, rcpts, body, params, wire_ready)
            if results is None and reused:
                # A cached connection the server had closed: try once on a new one.
                conn = await self._connect_or_fail(hop, failures)
                if conn is None:
                    continue
                results = await self._transaction(conn, mail_from, rcpts, body, params,
                                                  wire_ready)
            if results is None:
                failures.append(RcptResult(0, "4.4.1", f"lost connection with {hop} before the "
                                                       "transaction", str(hop)))
                continue
            if conn.tls is not None:
                for r in results:
                    r.tls = conn.tls.field()
            return results
        last = failures[-1] if failures else RcptResult(0, "4.4.1", "no host to deliver to", "none")
        return [last for _ in rcpts]

    async def _connect_or_fail(self, hop: Nexthop, failures: list[RcptResult]) -> _Conn | None:
        """A new connection to ``hop``, or None with the reason appended to ``failures``."""
        try:
            return await self._connect(hop)
        except _HostRefused as e:
            failures.append(RcptResult(0, e.dsn, e.text, str(hop)))
        except aiosmtplib.SMTPConnectResponseError as e:  # reached: it is the relay
            failures.append(RcptResult(0, "4.4.1", f"host {hop} refused to talk to me: "
                                                   f"{_reply(e.code, e.message)}", str(hop)))
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as e:
            failures.append(_greeting_failure(hop, e)
                            or RcptResult(0, "4.4.1", f"connect to {hop}: {_why(e)}", "none"))
        return None

    async def _transaction(self, conn: _Conn, mail_from: str, rcpts: list[str],
                           body: bytes | BodyStream, params: dict[str, str],
                           wire_ready: bool = False
                           ) -> list[RcptResult] | None:
        """The results, or None when the connection was found dead before MAIL was answered."""
        smtp, relay = conn.smtp, str(conn.hop)
        options = []
        if params.get("body") == "8BITMIME" and smtp.supports_extension("8bitmime"):
            options.append("BODY=8BITMIME")
        if params.get("smtputf8") and smtp.supports_extension("smtputf8"):
            options.append("SMTPUTF8")
        if smtp.supports_extension("size"):
            options.append(f"SIZE={len(body) if isinstance(body, bytes) else body.size}")
        encoding = "utf-8" if "SMTPUTF8" in options else "ascii"
        try:  # a streamed body is read for its header section: that may fail, or be cut
            downgrade = bool(params.get("smtputf8") and encoding == "ascii"
                             and await _needs_smtputf8(mail_from, rcpts, body))
        except BaseException:
            smtp.close()
            raise
        if downgrade:
            # Postfix's rule (RFC 6531 3.2): mail received with SMTPUTF8 that has UTF-8 in
            # its envelope or headers is not downgraded; nothing is sent, all bounce
            self._release(conn)
            text = f"SMTPUTF8 is required, but was not offered by host {relay}"
            return [RcptResult(550, "5.6.7", text, relay) for _ in rcpts]
        results: list[RcptResult | None] = [None] * len(rcpts)
        stage = "MAIL FROM"
        try:
            group = _pipeline_group(smtp, mail_from, rcpts, options)
            if group is not None:
                piped = await pipelined_replies(smtp, group, 1 + len(rcpts))
                if not piped.replies and piped.error is not None:
                    smtp.close()  # dead before MAIL was answered
                    return None
                mail = piped.replies[0]
                if mail.code != aiosmtplib.SMTPStatus.completed:
                    r = _refusal(mail.code, mail.message, relay)
                    if piped.error is not None or mail.code == _CLOSING:
                        smtp.close()  # the server is closing: not reused
                    else:
                        await _rset(smtp)
                        self._release(conn)
                    return [r for _ in rcpts]
                stage = "RCPT TO"
                accepted = []
                for i, reply in enumerate(piped.replies[1:]):
                    if reply.code in (aiosmtplib.SMTPStatus.completed,
                                      aiosmtplib.SMTPStatus.will_forward):
                        accepted.append(i)
                        continue
                    if reply.code == _CLOSING:  # what follows is not to be trusted
                        raise aiosmtplib.SMTPServerDisconnected(_reply(reply.code,
                                                                       reply.message))
                    results[i] = _refusal(reply.code, reply.message, relay)
                if piped.error is not None:
                    raise piped.error
            else:
                try:
                    await _mail(smtp, mail_from, options, encoding)
                except aiosmtplib.SMTPSenderRefused as e:
                    r = _refusal(e.code, e.message, relay)
                    await _rset(smtp)
                    self._release(conn)
                    return [r for _ in rcpts]
                except (aiosmtplib.SMTPServerDisconnected, ConnectionError):
                    smtp.close()
                    return None
                stage = "RCPT TO"
                accepted = []
                for i, rcpt in enumerate(rcpts):
                    try:
                        await _rcpt(smtp, rcpt, encoding)
                        accepted.append(i)
                    except aiosmtplib.SMTPRecipientRefused as e:
                        results[i] = _refusal(e.code, e.message, relay)
            if not accepted:
                await _rset(smtp)
                self._release(conn)
                return [r for r in results if r is not None]
            stage = "DATA"
            try:
                resp = await _data(smtp, body, self.config.smtp_line_length_limit, wire_ready)
                r = RcptResult(resp.code, dsn_of(resp.code, resp.message),
                               _reply(resp.code, resp.message), relay)
            except aiosmtplib.SMTPDataError as e:
                r = _refusal(e.code, e.message, relay)
                await _rset(smtp)
            for i in accepted:
                results[i] = r
            self._release(conn)
        except (asyncio.CancelledError, BodyUnreadable):
            smtp.close()  # cut short (shutdown, or the queue failed the body): not reused
            raise
        except UnicodeEncodeError:
            smtp.close()
            text = f"{relay} does not support SMTPUTF8 and an address needs it"
            return [x or RcptResult(550, "5.6.7", text, relay) for x in results]
        except _ProtocolError as e:
            smtp.close()
            text = f"protocol error with {relay} after {stage}: {e}"
            return [x or RcptResult(0, "4.5.0", text, relay) for x in results]
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as e:
            smtp.close()
            text = f"lost connection with {relay} while sending {stage}: {_why(e)}"
            return [x or RcptResult(0, "4.4.2", text, relay) for x in results]
        return [x if x is not None else RcptResult(0, "4.4.2", "no reply", relay) for x in results]


#: A reply that says the server is closing the connection (RFC 5321 3.8).
_CLOSING = 421


class _ProtocolError(aiosmtplib.SMTPException):
    """A reply that is neither the one a step expects nor a refusal (4xx, 5xx): a 2xx or
    3xx where MAIL wanted 250, RCPT 250 or 251, DATA 354.  Taken as a refusal, a 2xx
    would count as "sent" for recipients whose body never went out (a stray reply read
    as the answer to DATA, say), so the connection is closed and every recipient not
    settled yet is deferred."""


def _refusal(code: int, message: str, relay: str) -> RcptResult:
    """The result of a refusing reply; ``_ProtocolError`` for one that does not refuse."""
    if code < 400:
        raise _ProtocolError(f"unexpected reply {_reply(code, message)}")
    return RcptResult(code, dsn_of(code, message), _reply(code, message), relay)


def _pipeline_group(smtp: aiosmtplib.SMTP, mail_from: str, rcpts: list[str],
                    options: list[str]) -> bytes | None:
    """MAIL and every RCPT as one group of command lines (RFC 2920), when the server
    offers PIPELINING and every address is in its common, ASCII form; else None (one
    command at a time, through aiosmtplib)."""
    if not smtp.supports_extension("pipelining"):
        return None
    sender = plain_quoted(mail_from)
    quoted = [plain_quoted(r) for r in rcpts]
    if sender is None or None in quoted:
        return None
    head = b" ".join([b"MAIL FROM:" + sender, *(o.encode("ascii") for o in options)])
    return b"".join([head, b"\r\n", *(b"RCPT TO:" + q + b"\r\n" for q in quoted if q)])


async def _needs_smtputf8(mail_from: str, rcpts: list[str], body: bytes | BodyStream) -> bool:
    """Whether the envelope or the header section holds anything but ASCII."""
    return not (mail_from.isascii() and all(r.isascii() for r in rcpts)
                and await header_ascii(body))


async def _data(smtp: aiosmtplib.SMTP, body: bytes | BodyStream, line_limit: int,
                ready: bool = False) -> aiosmtplib.SMTPResponse:
    """DATA, the payload ``wire_parts`` makes (a ``BodyStream`` written a piece at a
    time as it is read: ``send_stream``), and its reply, through the protocol's
    ``write`` and ``read_response``.  Lines longer than ``line_limit`` are folded.  A
    reply to DATA other than 354 that refuses nothing is ``_ProtocolError``, and so is
    a reply that is no refusal given before the end of a streamed body; a refusal, or a
    final reply that is not 2xx, is ``SMTPDataError``."""
    wire = wire_parts(body, line_limit, ready=ready) if isinstance(body, bytes) else None
    start = await smtp.execute_command(b"DATA")
    if start.code != aiosmtplib.SMTPStatus.start_input:
        if start.code < 400:
            raise _ProtocolError(f"unexpected reply to DATA {_reply(start.code, start.message)}")
        raise aiosmtplib.SMTPDataError(start.code, start.message)
    protocol = smtp.protocol
    if protocol is None:
        raise aiosmtplib.SMTPServerDisconnected("Connection lost")
    try:
        if wire is not None:
            for part in wire:
                protocol.write(part)
            # read_response marks a reply as expected before it first yields, so the
            # reply cannot arrive unexpected
            resp = await protocol.read_response(timeout=smtp.timeout)
        else:
            assert isinstance(body, BodyStream)
            resp, early = await send_stream(smtp, body, line_limit, ready)
            if early and resp.code < 400:  # "sent" for a body that did not all go out
                raise _ProtocolError("reply before the end of the message: "
                                     + _reply(resp.code, resp.message))
    except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError):
        smtp.close()
        raise
    if resp.code // 100 != 2:
        raise aiosmtplib.SMTPDataError(resp.code, resp.message)
    return resp


async def _mail(smtp: aiosmtplib.SMTP, sender: str, options: list[str], encoding: str
                ) -> aiosmtplib.SMTPResponse:
    """``smtp.mail(sender, options=options, encoding=encoding)`` on a connection that has
    greeted, without the email package for an address in its common form."""
    quoted = plain_quoted(sender)
    if quoted is None:
        return await smtp.mail(sender, options=options, encoding=encoding)
    resp = await smtp.execute_command(b"MAIL", b"FROM:" + quoted,
                                      *(o.encode("ascii") for o in options))
    if resp.code != aiosmtplib.SMTPStatus.completed:
        raise aiosmtplib.SMTPSenderRefused(resp.code, resp.message, sender)
    return resp


async def _rcpt(smtp: aiosmtplib.SMTP, rcpt: str, encoding: str) -> aiosmtplib.SMTPResponse:
    """``smtp.rcpt(rcpt, encoding=encoding)``, as ``_mail`` is ``smtp.mail``."""
    quoted = plain_quoted(rcpt)
    if quoted is None:
        return await smtp.rcpt(rcpt, encoding=encoding)
    resp = await smtp.execute_command(b"RCPT", b"TO:" + quoted)
    if resp.code not in (aiosmtplib.SMTPStatus.completed, aiosmtplib.SMTPStatus.will_forward):
        raise aiosmtplib.SMTPRecipientRefused(resp.code, resp.message, rcpt)
    return resp


async def _login(smtp: aiosmtplib.SMTP, user: str, password: str) -> None:
    """One AUTH with the first of PLAIN, LOGIN, CRAM-MD5 the server offers (aiosmtplib's
    ``login`` tries each in turn, and a wrong password would count as several failures)."""
    for method in ("plain", "login", "cram-md5"):
        if method in smtp.server_auth_methods:
            await getattr(smtp, "auth_" + method.replace("-", ""))(user, password)
            return
    raise aiosmtplib.SMTPAuthenticationError(
        504, f"5.7.4 no mechanism in common (server offers "
             f"{' '.join(smtp.server_auth_methods) or 'none'}; PLAIN, LOGIN, CRAM-MD5 here)")


async def _hello(smtp: aiosmtplib.SMTP, hop: Nexthop) -> None:
    """EHLO, else HELO; a failure of either is ``_HostRefused`` in Postfix's words (the
    host was reached: it is the relay)."""
    try:
        try:
            await smtp.ehlo()
        except aiosmtplib.SMTPHeloError:
            await smtp.helo()
    except aiosmtplib.SMTPHeloError as e:
        raise _HostRefused("4.4.1", f"host {hop} refused to talk to me: "
                                    f"{_reply(e.code, e.message)} (in reply to HELO)") from e
    except (aiosmtplib.SMTPTimeoutError, TimeoutError) as e:
        raise _HostRefused("4.4.2", f"conversation with {hop} timed out while performing "
                                    "the EHLO handshake") from e
    except (aiosmtplib.SMTPServerDisconnected, ConnectionError) as e:
        raise _HostRefused("4.4.2", f"lost connection with {hop} while performing the "
                                    "EHLO handshake") from e


def _greeting_failure(hop: Nexthop, e: BaseException) -> RcptResult | None:
    """The failure of a connection made that gave no greeting, as Postfix words it (the
    host named as the relay: it was reached); None for a connection not made."""
    if isinstance(e, aiosmtplib.SMTPConnectTimeoutError) \
            and isinstance(e.__cause__, aiosmtplib.SMTPTimeoutError):
        what = f"conversation with {hop} timed out"
    elif isinstance(e, aiosmtplib.SMTPConnectError) \
            and isinstance(e.__cause__, aiosmtplib.SMTPServerDisconnected):
        what = f"lost connection with {hop}"
    else:
        return None
    return RcptResult(0, "4.4.2", f"{what} while receiving the initial server greeting",
                      str(hop))


def _why(e: BaseException) -> str:
    if isinstance(e, aiosmtplib.SMTPResponseException):
        return _reply(e.code, e.message)
    cause = e.__cause__
    if isinstance(e, aiosmtplib.SMTPConnectError) and isinstance(cause, OSError) \
            and cause.errno:  # "Connection refused", not aiosmtplib's wording around it
        return os.strerror(cause.errno)
    text = str(e) or type(e).__name__
    return " ".join(text.split())


async def _rset(smtp: aiosmtplib.SMTP) -> None:
    try:
        await smtp.rset()
    except (TimeoutError, aiosmtplib.SMTPException, OSError):
        smtp.close()


async def _quit(smtp: aiosmtplib.SMTP) -> None:
    """QUIT, and return once the connection is gone.  ``close()`` only starts that: over
    TLS the socket is closed after the server answers the close_notify, later on the
    loop, and a loop that ends first (the relay stopping) leaves the socket open.  A
    connection still there after ``CLOSE_GRACE`` is aborted."""
    protocol, transport = smtp.protocol, smtp.transport
    try:
        async with asyncio.timeout(5):  # not wait_for: see ondemand_probe
            await smtp.quit()
    except (TimeoutError, aiosmtplib.SMTPException, OSError):
        smtp.close()
    if protocol is None or transport is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLOSE_GRACE
    while protocol.transport is not None and loop.time() < deadline:  # None: connection_lost
        await asyncio.sleep(0.01)
    if protocol.transport is not None:
        transport.abort()  # type: ignore[attr-defined]
        await asyncio.sleep(0)
