"""What the relay says of TLS and of the queue id: the ``Received:`` header names the
queue id and, under STARTTLS, the protocol and cipher (Postfix's
``smtpd_tls_received_header = yes``).  A real CA and certificates made by ``openssl``,
swaks as the client."""

from __future__ import annotations

import re
import shutil
import smtplib
import subprocess
from pathlib import Path

import pytest

from tests.relay_support import RelayThread, Sink, relay_config
from tests.tls_certs import CertAuthority, have_openssl

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


def test_an_inbound_starttls_session_is_named_in_received(
        tmp_path: Path, cert: tuple[Path, Path]) -> None:
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
            smtpd_tls_cert_file=str(cert[0]), smtpd_tls_key_file=str(cert[1]))) as r:
        tls_id = _swaks(r.port, "--tls")
        plain_id = _swaks(r.port)
        got = {_received(m.data) for m in sink.wait_for(2)}
    m = re.search(r"\(using TLSv1\.[23] with cipher \S+ \((\d+)/\1 bits\)\)", " ".join(got))
    assert m is not None, got
    using = m.group(0)
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
