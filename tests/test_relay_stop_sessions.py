"""A stopping relay lets go of every connection: each SMTP session it accepted gets
``421 4.3.2`` and is closed; a session whose close cannot finish (after STARTTLS the TLS
close waits for the client's close_notify, which a client that reads nothing never sends)
is aborted after ``CLOSE_GRACE``; a connection accepted while the relay stops is closed
too.  The deliverer's cached connections are quit and gone when its ``close()`` returns,
a TLS server that never answers the close_notify included.  Before, such a socket
outlived the event loop: an unclosed transport that the garbage collector found later,
in whatever test ran next."""

from __future__ import annotations

import asyncio
import gc
import smtplib
import socket
import ssl
import threading
import time
import warnings

import pytest

from queue_ref.relay.mx_routing import Nexthop
from queue_ref.relay.smtp_delivery import SmtpDeliverer
from queue_ref.relay.tls_summary import CLOSE_GRACE
from tests.relay_support import RelayThread, relay_config
from tests.tls_certs import CertAuthority, have_openssl, server_context


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CertAuthority(tmp_path_factory.mktemp("ca"))


def _config(tmp_path, ca):
    cert, key = ca.issue(["relay.test", "127.0.0.1"])
    return relay_config(str(tmp_path / "q"), smtpd_tls_cert_file=str(cert),
                        smtpd_tls_key_file=str(key))


def _resource_warnings(run) -> list[str]:
    """What ``run()`` leaves for the garbage collector: the ResourceWarnings of a
    collection right after it."""
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        run()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def _read_to_eof(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


def test_an_idle_session_gets_421_when_the_relay_stops(tmp_path, ca):
    def run() -> None:
        with RelayThread(_config(tmp_path, ca)) as r:
            s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
            assert s.recv(512).startswith(b"220 ")
        assert _read_to_eof(s) == (
            b"421 4.3.2 Service shutting down, closing transmission channel\r\n")
        s.close()
    assert _resource_warnings(run) == []


@pytest.mark.skipif(not have_openssl(), reason="openssl makes the certificates")
def test_a_starttls_session_whose_client_reads_nothing_is_aborted(tmp_path, ca):
    took: list[float] = []

    def run() -> None:
        with RelayThread(_config(tmp_path, ca)) as r:
            c = smtplib.SMTP("127.0.0.1", r.port, timeout=10)
            c.starttls(context=ssl.create_default_context(cafile=str(ca.ca_file)))
            assert c.ehlo("client.test")[0] == 250
            started = time.monotonic()
        took.append(time.monotonic() - started)
        c.sock.close()
    assert _resource_warnings(run) == []
    assert CLOSE_GRACE <= took[0] < CLOSE_GRACE + 5


def test_a_connection_accepted_while_the_relay_stops_is_closed(tmp_path, ca):
    def run() -> None:
        with RelayThread(_config(tmp_path, ca)) as r:
            # the moment between close_sessions' pass over the sessions and the
            # listening socket's close, held open
            r.call(setattr, r.relay.receiver, "shutting_down", True)
            s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
            got = _read_to_eof(s)
            s.close()
        assert got.endswith(b"421 4.3.2 Service shutting down, closing transmission channel\r\n")
    assert _resource_warnings(run) == []


async def _mute_after_quit(tls: ssl.SSLContext, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
    """An SMTP server that offers STARTTLS, accepts one message, answers QUIT with 221
    and then reads nothing more: the client's TLS close_notify is never read, so never
    answered."""
    writer.write(b"220 mx.test ESMTP\r\n")
    secure = False
    while line := await reader.readline():
        verb = line[:4].upper()
        if verb == b"EHLO":
            writer.write(b"250 mx.test\r\n" if secure else b"250-mx.test\r\n250 STARTTLS\r\n")
        elif verb == b"STAR":
            writer.write(b"220 2.0.0 go ahead\r\n")
            await writer.drain()
            await writer.start_tls(tls)
            secure = True
        elif verb == b"DATA":
            writer.write(b"354 go on\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n.\r\n")  # the content, read and dropped
            writer.write(b"250 2.0.0 queued\r\n")
        elif verb == b"QUIT":
            writer.write(b"221 2.0.0 bye\r\n")
            await writer.drain()
            writer.transport.pause_reading()
            await asyncio.sleep(30)
            return
        else:
            writer.write(b"250 2.0.0 ok\r\n")
        await writer.drain()


class _MuteServer:
    """``_mute_after_quit`` on 127.0.0.1, on an event loop of its own in a thread: the
    client's loop ends while the server still holds its side."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.sessions: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = []

    async def _session(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.sessions.append((task, w))
        await _mute_after_quit(self.tls, r, w)

    def __enter__(self) -> int:
        self.thread.start()

        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._session, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return int(self.server.sockets[0].getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for task, w in self.sessions:
                task.cancel()
                w.transport.abort()
            await asyncio.gather(*(t for t, _ in self.sessions), return_exceptions=True)
            self.server.close()
            await self.server.wait_closed()
            await asyncio.sleep(0)
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.mark.skipif(not have_openssl(), reason="openssl makes the certificates")
def test_the_deliverers_close_leaves_no_connection_behind(tmp_path, ca):
    cert, key = ca.issue(["mx.test", "127.0.0.1"])
    took: list[float] = []

    async def deliver(port: int) -> str:
        d = SmtpDeliverer(relay_config(str(tmp_path / "q")))
        try:
            [res] = await d.deliver([Nexthop("127.0.0.1", "127.0.0.1", port)],
                                    "a@example.org", ["b@example.net"], b"Subject: x\r\n\r\ny\r\n",
                                    {})
        finally:
            started = time.monotonic()
            await d.close()
            took.append(time.monotonic() - started)
        assert res.outcome == "sent", res
        return res.tls

    with _MuteServer(server_context(cert, key)) as port:
        def run() -> None:
            assert asyncio.run(deliver(port)).startswith("TLSv1.")
        assert _resource_warnings(run) == []
    assert CLOSE_GRACE <= took[0] < CLOSE_GRACE + 5
