"""On-Demand Mail Relay (RFC 2645): ATRN on ``odmr_listen`` (port 366), Postfix has none.

A customer whose host has no fixed address connects, says EHLO, authenticates with
SMTP AUTH (PLAIN or LOGIN against ``smtpd_sasl_password_file``, after STARTTLS where
``smtpd_tls_auth_only`` says so) and sends ``ATRN domain[,domain...]`` (none: every
domain of that user).  Each domain must be one ``atrn_domains`` gives to that user.
The replies are RFC 2645's: ``250`` when mail is waiting, then the roles turn on the
same connection; ``453 4.4.0`` when none is; ``530 5.7.0`` without AUTH; ``450 4.7.1``
for a domain the user may not take (nothing is sent then); ``451 4.3.0`` when the queue
cannot be listed.  No mail is taken here (``MAIL``: 502).

After the turn the relay is the SMTP client: it waits for the customer's 220 greeting,
says EHLO (HELO if refused), and delivers the domains' QUEUED entries (the domain index,
``queue_actions.domain_entries``), one message at a time, through
``DeliveryScheduler.run_job``: claimed with ``send_start`` and finished as every
delivery is (2xx done, 4xx deferred, 5xx bounced), then QUIT.  A connection lost midway
defers the message in hand; the rest stay queued, untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import secrets
import time
from concurrent.futures import Executor
from typing import Any, cast

from aiosmtpd.smtp import MISSING, SMTP, AuthResult, Envelope, LoginPassword, Session, syntax

from queue_ref.operate.queue_actions import check_domain, domain_entries
from queue_ref.relay.password_files import load_cram_md5_file
from queue_ref.relay.relay_config import RelayConfig, parse_hostport
from queue_ref.relay.relay_host import RelayHost, RelayStartError
from queue_ref.relay.smtp_delivery import RcptResult, dsn_of
from queue_ref.relay.smtp_wire_body import BodyStream, WireEncoder, wire_payload
from queue_ref.relay.smtpd_sasl_auth import TOO_MANY, SaslAuthenticator
from queue_ref.storage import InvalidInputError, QueuedMail, Storage

__all__ = ["OdmrServer", "load_cram_md5_file"]

ODMR_PORT = 366  # RFC 2645
_USER = re.compile(r"[^\s:\x00-\x1f\x7f]{1,255}")




class _Lost(Exception):
    """The turned connection ended or timed out."""


class OdmrSMTP(SMTP):
    """One ODMR session: aiosmtpd's ESMTP with AUTH, plus ATRN."""

    def __init__(self, odmr: OdmrServer, **kw: Any) -> None:
        super().__init__(odmr, **kw)
        self.odmr = odmr

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.odmr.sessions.add(self)

    def connection_lost(self, error: Exception | None) -> None:
        self.odmr.sessions.discard(self)
        super().connection_lost(error)

    async def auth_CRAM__MD5(self, _server: Any, args: list[str]) -> AuthResult:
        """RFC 2195 against ``odmr_cram_md5_file`` (fetchmail's ODMR speaks no other)."""
        challenge = f"<{secrets.token_hex(8)}.{int(time.time())}@{self.hostname}>"
        blob = await self.challenge_auth(challenge)
        if blob is MISSING:  # "*": answered already
            return AuthResult(success=False, handled=True)
        assert isinstance(blob, bytes)
        user, _, digest = blob.decode("utf-8", "replace").rpartition(" ")
        secret = self.odmr.cram_secrets.get(user)
        want = hmac.new((secret or "").encode(), challenge.encode(), "md5").hexdigest()
        ok = secret is not None and hmac.compare_digest(want, digest.lower())
        assert self.session is not None
        client = self.session.peer[0] if isinstance(self.session.peer, tuple) else "unknown"
        self.odmr.relay.log.emit("auth", client=client, sasl_method="CRAM-MD5",
                                 sasl_username=re.sub(r"[\x00-\x20\x7f,()=]", "?", user)[:255],
                                 status="ok" if ok else "failed")
        if ok:
            return AuthResult(success=True, auth_data=LoginPassword(user.encode(), b""))
        auth = self.odmr.auth
        if auth is not None:  # counted with the client's PLAIN and LOGIN failures
            auth._failed(client)
            if auth.blocked(client):
                return AuthResult(success=False, handled=False, message=TOO_MANY)
        return AuthResult(success=False, handled=False,
                          message="535 5.7.8 Error: authentication failed: authentication failure")

    async def smtp_AUTH(self, arg: str) -> None:
        """As the receiver's: the failure that reaches ``smtpd_auth_failure_limit`` (per
        client address, both listeners counted together) is answered 421 and the
        session closed; so is any AUTH from that address until the window has passed."""
        auth = self.odmr.auth
        peer = self.session.peer if self.session is not None else None
        client = peer[0] if isinstance(peer, tuple) else "unknown"
        if auth is not None and auth.blocked(client):
            await self.push(TOO_MANY)
        else:
            await super().smtp_AUTH(arg)
            if auth is None or not auth.blocked(client):
                return
        if self.transport is not None:
            self.transport.close()

    async def smtp_MAIL(self, arg: str | None) -> None:
        await self.push("502 5.5.1 Error: no mail is taken on the ODMR port (ATRN only)")

    @syntax("ATRN [domain[,domain...]]")
    async def smtp_ATRN(self, arg: str | None) -> None:
        assert self.session is not None
        reply, handles = await self.odmr.atrn(self.session, arg or "")
        await self.push(reply)
        if handles:
            await self.odmr.turn(self, handles)
            if self.transport is not None:
                self.transport.close()

    # the turned session reads and writes aiosmtpd's own streams (TLS included)

    async def reply(self, timeout: float) -> tuple[int, str]:
        """One reply of the customer's server: its code and its lines (LF between)."""
        lines = []
        while True:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: see ondemand_probe
                    line = await self._reader.readuntil(b"\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    ConnectionError) as e:
                raise _Lost(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
            self._reset_timeout()
            text = line.rstrip(b"\r\n").decode("utf-8", "replace")
            lines.append(text[4:])
            if not text[:3].isdigit():
                raise _Lost(f"not an SMTP reply: {text[:80]!r}")
            if text[3:4] != "-":
                return int(text[:3]), "\n".join(lines)

    async def send_line(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as e:
            raise _Lost(str(e) or type(e).__name__) from e


class _Turned:
    """The relay as the SMTP client on a turned ODMR connection."""

    def __init__(self, proto: OdmrSMTP, config: RelayConfig, relay: str) -> None:
        self.proto = proto
        self.config = config
        self.relay = relay  # as the delivery log names the host: odmr[ADDRESS]
        self.extensions: set[str] = set()
        self.lost = False

    async def command(self, line: str, encoding: str = "ascii") -> tuple[int, str]:
        await self.proto.send_line(line.encode(encoding) + b"\r\n")
        return await self.proto.reply(self.config.smtp_timeout)

    async def start(self) -> None:
        code, text = await self.proto.reply(self.config.smtp_timeout)
        if code != 220:
            raise _Lost(f"greeting {code} {text}")
        code, text = await self.command(f"EHLO {self.config.myhostname}")
        if code == 250:  # the keywords after the first line
            self.extensions = {x.split()[0].upper() for x in text.split("\n")[1:] if x.split()}
        else:
            code, text = await self.command(f"HELO {self.config.myhostname}")
            if code != 250:
                raise _Lost(f"HELO refused: {code} {text}")

    def _result(self, code: int, text: str) -> RcptResult:
        text = " ".join(text.split())
        return RcptResult(code, dsn_of(code, text), f"{code} {text}", self.relay)

    async def send(self, mail_from: str, rcpts: list[str], body: bytes | BodyStream,
                   params: dict[str, str]) -> list[RcptResult]:
        """One transaction: a result per recipient (``DeliveryScheduler.run_job``).  A
        ``BodyStream`` is read as it goes out; ``BodyUnreadable`` when the queue could
        not give all of it (the connection dropped before the final dot)."""
        results: list[RcptResult | None] = [None] * len(rcpts)
        try:
            return await self._transaction(mail_from, rcpts, body, params, results)
        except _Lost as e:
            self.lost = True
            text = f"lost connection with {self.relay}: {e}"
            return [r or RcptResult(0, "4.4.2", text, self.relay) for r in results]

    async def _transaction(self, mail_from: str, rcpts: list[str], body: bytes | BodyStream,
                           params: dict[str, str], results: list[RcptResult | None]
                           ) -> list[RcptResult]:
        opts = ""
        if params.get("body") == "8BITMIME" and "8BITMIME" in self.extensions:
            opts += " BODY=8BITMIME"
        utf8 = bool(params.get("smtputf8")) and "SMTPUTF8" in self.extensions
        if utf8:
            opts += " SMTPUTF8"
        if "SIZE" in self.extensions:
            opts += f" SIZE={len(body) if isinstance(body, bytes) else body.size}"
        enc = "utf-8" if utf8 else "ascii"
        if not all(a.isascii() for a in [mail_from, *rcpts]) and not utf8:
            text = f"SMTPUTF8 is required, but was not offered by host {self.relay}"
            return [RcptResult(550, "5.6.7", text, self.relay) for _ in rcpts]
        code, text = await self.command(f"MAIL FROM:<{mail_from}>{opts}", enc)
        if code != 250:
            await self.command("RSET")
            return [self._result(code, text) for _ in rcpts]
        accepted = []
        for i, rcpt in enumerate(rcpts):
            code, text = await self.command(f"RCPT TO:<{rcpt}>", enc)
            if code in (250, 251):
                accepted.append(i)
            else:
                results[i] = self._result(code, text)
        if accepted:
            code, text = await self.command("DATA")
            if code == 354:
                if isinstance(body, bytes):
                    await self.proto.send_line(
                        wire_payload(body, self.config.smtp_line_length_limit))
                else:
                    await self._stream(body)
                code, text = await self.proto.reply(self.config.smtp_timeout)
            else:
                await self.command("RSET")
            for i in accepted:
                results[i] = self._result(code, text)
        else:
            await self.command("RSET")
        return [r if r is not None else self._result(451, "4.4.2 no reply") for r in results]

    async def _stream(self, body: BodyStream) -> None:
        """The DATA payload of a streamed body, a piece at a time, each written within
        ``smtp_timeout``; cut short (a read that fails, a timeout, a shutdown), the
        connection is dropped before the final dot."""
        encoder = WireEncoder(self.config.smtp_line_length_limit)
        try:
            async with body.pieces() as pieces:
                async for piece in pieces:
                    out = encoder.feed(piece)
                    if out:
                        async with asyncio.timeout(self.config.smtp_timeout):
                            await self.proto.send_line(out)
            await self.proto.send_line(encoder.end())
        except BaseException as e:
            self.lost = True
            if self.proto.transport is not None:  # nothing more is sent: no final dot
                cast(asyncio.WriteTransport, self.proto.transport).abort()
            if isinstance(e, TimeoutError):
                raise _Lost("timed out sending the message body") from e
            raise

    async def quit(self) -> None:
        """QUIT, waiting 5 s at most for the reply: a customer that never answers it is
        hung up on all the same (its mail was finished already)."""
        with contextlib.suppress(_Lost, TimeoutError):
            async with asyncio.timeout(5):
                await self.command("QUIT")


class OdmrServer:
    """The ODMR listener of one relay (``Relay.add_service``), aiosmtpd's handler."""

    def __init__(self, relay: RelayHost) -> None:
        self.relay = relay
        self.config = relay.config
        self.sessions: set[OdmrSMTP] = set()
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None
        self.cram_secrets = load_cram_md5_file(self.config.odmr_cram_md5_file) \
            if self.config.odmr_cram_md5_file else {}
        relay.add_service(self.start, self.stop)

    @property
    def store(self) -> Storage:
        store: Storage = self.relay.store
        return store

    @property
    def executor(self) -> Executor:
        executor: Executor = self.relay.executor
        return executor

    @property
    def auth(self) -> SaslAuthenticator | None:
        """The receiver's AUTH (its password file and its failure counts), if enabled."""
        return self.relay.receiver.auth if self.relay.receiver is not None else None

    def protocol(self) -> OdmrSMTP:
        receiver = self.relay.receiver
        assert receiver is not None
        without = ([] if receiver.auth is not None else ["PLAIN", "LOGIN"]) + (
            [] if self.cram_secrets else ["CRAM-MD5"])
        return OdmrSMTP(self, hostname=self.config.myhostname, ident="ESMTP queue-ref ODMR",
                        tls_context=receiver._tls, authenticator=receiver.auth,
                        auth_exclude_mechanism=without,
                        auth_require_tls=self.config.smtpd_tls_auth_only,
                        timeout=self.config.smtpd_timeout, loop=asyncio.get_running_loop())

    async def start(self, relay: RelayHost) -> None:
        host, port, _ = parse_hostport(self.config.odmr_listen, "odmr_listen", ODMR_PORT)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self.protocol, host, port,
                                                    reuse_port=relay.worker is not None)
        except OSError as e:

            raise RelayStartError(f"cannot listen on {host}:{port} (odmr_listen): "
                                  f"{e.strerror or e}") from e
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        relay.log.emit("relay", what="odmr listening", odmr=f"{host}:{self.address[1]}")

    async def stop(self, relay: RelayHost) -> None:
        if self._server is not None:
            self._server.close()
        for s in list(self.sessions):
            if s.transport is not None:
                s.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # ---- aiosmtpd hooks ----

    async def handle_EHLO(self, server: OdmrSMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        session.host_name = hostname
        out = [r.replace("250 ", "250-", 1) for r in responses
               if not r.endswith(" HELP") and not r.endswith("-HELP")]
        return [*out, "250-ATRN", "250 ENHANCEDSTATUSCODES"]

    # ---- ATRN ----

    async def atrn(self, session: Session, arg: str) -> tuple[str, list[QueuedMail]]:
        """The reply to ``ATRN arg`` and, when it is 250, the entries to deliver."""
        if not session.host_name:
            return "503 5.5.1 Error: send HELO/EHLO first", []
        auth: object = session.auth_data
        if not session.authenticated or not isinstance(auth, LoginPassword):
            return "530 5.7.0 Authentication required", []
        user = auth.login.decode("utf-8", "replace")
        client = session.peer[0] if isinstance(session.peer, tuple) else "unknown"
        mine = sorted(d for d, u in self.config.atrn_domains.items() if u == user)
        try:
            names = [check_domain(n.strip()) for n in arg.split(",")] if arg.strip() else mine
        except InvalidInputError:
            return "501 5.5.4 Syntax: ATRN [domain[,domain...]]", []
        refused = [d for d in names if d not in mine]
        log = self.relay.log
        if refused or not names:
            log.emit("atrn", client=client, sasl_username=user, domains=",".join(names),
                     status="refused")
            what = f"<{refused[0]}> is not an on-demand domain of yours" if refused else \
                "no on-demand domain is yours"
            return f"450 4.7.1 ATRN request refused: {what}", []
        loop = asyncio.get_running_loop()
        try:
            handles = await loop.run_in_executor(self.executor, self._list, names)
        except Exception as e:
            log.emit("error", what="atrn", reason=f"{type(e).__name__}: {e}")
            return "451 4.3.0 Unable to process ATRN request now", []
        log.emit("atrn", client=client, sasl_username=user, domains=",".join(names),
                 status="started" if handles else "empty", queued=len(handles))
        if not handles:
            return "453 4.4.0 You have no mail", []
        return "250 2.0.0 OK now reversing the connection", handles

    def _list(self, domains: list[str]) -> list[QueuedMail]:
        return [h for d in domains for h in domain_entries(self.store, d)]

    async def turn(self, proto: OdmrSMTP, handles: list[QueuedMail]) -> None:
        """Deliver ``handles`` over ``proto``'s connection, the relay the client now."""
        assert proto.session is not None
        peer = proto.session.peer
        turned = _Turned(proto, self.config,
                         f"odmr[{peer[0] if isinstance(peer, tuple) else 'unknown'}]")
        try:
            await turned.start()
        except _Lost as e:  # nothing was claimed: the mail stays queued as it was
            self.relay.log.emit("atrn", client=turned.relay, status="failed", reason=str(e))
            return
        messages: dict[str, list[QueuedMail]] = {}
        for h in handles:
            messages.setdefault(h.message_id, []).append(h)
        for group in messages.values():
            scheduler = self.relay.scheduler
            if turned.lost or scheduler is None:
                break
            await scheduler.run_job(group, turned.send)
        if not turned.lost:
            await turned.quit()
