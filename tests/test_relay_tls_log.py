"""What the relay says of TLS and of the queue id: the ``Received:`` header names the
queue id and, under STARTTLS, the protocol and cipher (Postfix's
``smtpd_tls_received_header = yes``); the log has a ``tls`` record for each inbound TLS
session and each outbound TLS connection, and a delivery's result carries the session's
protocol and cipher.  A real CA and certificates made by ``openssl``, swaks as the client,
an aiosmtpd sink offering STARTTLS as the next hop."""

from __future__ import annotations

import asyncio
import re
import shutil
import smtplib
import subprocess
from pathlib import Path

import pytest

from queue_ref.relay.mx_routing import Nexthop
from queue_ref.relay.smtp_delivery import SmtpDeliverer
from tests.relay_support import RelayThread, Sink, relay_config
from tests.tls_certs import CertAuthority, have_openssl, server_context

pytestmark = pytest.mark.skipif(not have_openssl() or shutil.which("swaks") is None,
                                reason="needs openssl and swaks (Debian)")


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return CertAuthority(tmp_path_factory.mktemp("ca")).issue(["127.0.0.1", "localhost"])


def _swaks(port: int, *extra: str) -> str:
    run = subprocess.run(["swaks", "--server", "127.0.0.1", "--port", str(port), "--from",
                          "a@example.org", "--to", "b@example.net", "--helo", "client.test",
                          *extra], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr
    return re.findall(r"<[~-] +250 2\.0\.0 Ok: queued as (\S+)", run.stdout)[0]


def _received(data: bytes) -> str:
    """The relay's Received: header, unfolded."""
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    first = re.split(r"\r\n(?=\S)", head)[0]
    assert first.startswith("Received: ")
    return " ".join(first.split())


def test_an_inbound_starttls_session_is_logged_and_named_in_received(
        tmp_path: Path, cert: tuple[Path, Path]) -> None:
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
            smtpd_tls_cert_file=str(cert[0]), smtpd_tls_key_file=str(cert[1]))) as r:
        tls_id = _swaks(r.port, "--tls")
        plain_id = _swaks(r.port)
        got = {_received(m.data) for m in sink.wait_for(2)}
        [rec] = r.events("tls")
    assert rec["direction"] == "in" and rec["client"].startswith("[127.0.0.1]:")
    assert rec["version"].startswith("TLSv1.") and rec["cipher"] and rec["bits"] >= 128
    using = f"(using {rec['version']} with cipher {rec['cipher']} ({rec['bits']}/{rec['bits']} bits))"
    assert any(h.startswith(f"Received: from client.test ([127.0.0.1]) {using} by relay.test "
                            f"(queue-ref) with ESMTPS id {tls_id} for <b@example.net>; ")
               for h in got), got
    assert any(h.startswith(f"Received: from client.test ([127.0.0.1]) by relay.test (queue-ref) "
                            f"with ESMTP id {plain_id} for <b@example.net>; ") for h in got), got


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_the_received_header_names_the_queue_id_the_250_reply_gave(
        tmp_path: Path, backend: str) -> None:
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), backend=backend, relayhost=f"[127.0.0.1]:{sink.port}",
            log_json=True)) as r:
        ids = []
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.ehlo()
            for i in range(3):
                assert c.mail("a@example.org")[0] == 250
                for rcpt in ["b@example.net", "c@example.net"][:1 + i % 2]:
                    assert c.rcpt(rcpt)[0] == 250
                code, reply = c.data(b"Subject: %d\r\n\r\nbody\r\n" % i)
                assert code == 250
                ids.append(reply.decode().rpartition(" ")[2])
        got = sink.wait_for(4)  # 1 + 2 + 1 recipients
        sizes = {e["queue_id"]: e["size"] for e in r.events("received")}
    named = {}
    for m in got:
        queue_id = re.search(r" with ESMTP id ([^\s;]+)", _received(m.data))
        assert queue_id is not None, m.data[:300]
        named[queue_id.group(1)] = len(m.data)
    assert sorted(named) == sorted(ids) == sorted(sizes)
    # the logged size counts the header with its id (the sink's copy has the sink's own
    # line endings and nothing more: the relay sends what it queued)
    assert named == sizes


def test_a_delivery_over_starttls_carries_its_protocol_and_cipher(
        tmp_path: Path, cert: tuple[Path, Path]) -> None:
    with Sink(tls_context=server_context(*cert)) as tls_sink, Sink() as plain_sink, \
            RelayThread(relay_config(str(tmp_path / "q"), log_json=True,
                                     relayhost=f"[127.0.0.1]:{tls_sink.port}")) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.sendmail("a@example.org", ["b@example.net"], b"Subject: tls\r\n\r\nbody\r\n")
        [got] = tls_sink.wait_for(1)
        [rec] = r.wait_events(1, "tls", direction="out")
        [delivery] = r.wait_events(1)
        assert got.tls and delivery["status"] == "sent"
        assert delivery["tls"] == f"{rec['version']}:{rec['cipher']}"  # Postfix's TLS line

        async def deliver(port: int) -> str:
            d = SmtpDeliverer(r.relay.config)
            try:
                [res] = await d.deliver([Nexthop("127.0.0.1", "127.0.0.1", port)], "a@example.org",
                                        ["b@example.net"], b"Subject: x\r\n\r\ny\r\n", {})
            finally:
                await d.close()
            assert res.outcome == "sent", res
            return res.tls

        assert asyncio.run(deliver(tls_sink.port)) == f"{rec['version']}:{rec['cipher']}"
        assert asyncio.run(deliver(plain_sink.port)) == "none"
    assert rec["server"] == f"[127.0.0.1]:{tls_sink.port}" or str(tls_sink.port) in rec["server"]
    assert rec["version"].startswith("TLSv1.") and rec["bits"] >= 128
