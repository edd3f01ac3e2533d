"""SMTP AUTH both ways against one real, private Postfix (``tests/postfix_instance``) with
Cyrus SASL (a sasldb, PLAIN and LOGIN) and a certificate from a test CA.

The Postfix relays for authenticated clients only (``permit_sasl_authenticated,
reject``; its ``mynetworks`` holds no loopback address) and offers AUTH before STARTTLS
too, so a relay that sent its credentials in clear would be seen doing it.  Mail it
accepts goes to an aiosmtpd sink, except for ``inbound.test``, which its smtp client
takes to the relay under test with its own SASL credentials over TLS.
"""

from __future__ import annotations

import shutil
import smtplib
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from queue_ref.relay.smtpd_sasl_auth import hash_password
from tests.postfix_instance import PrivatePostfix, free_port, instance_dir, postfix_missing
from tests.relay_support import RelayThread, Sink, relay_config
from tests.tls_certs import CertAuthority, have_openssl

pytestmark = pytest.mark.skipif(bool(postfix_missing()) or not have_openssl(),
                                reason=postfix_missing() or "openssl makes the certificates")


@dataclass
class World:
    ca: CertAuthority
    relay_cert: tuple[Path, Path]
    relay_port: int  # where the relay under test listens when Postfix sends to it
    sink: Sink
    postfix: PrivatePostfix


@pytest.fixture(scope="module")
def world():
    base = instance_dir()
    try:
        yield from _world(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _world(base: Path) -> Iterator[World]:
    ca = CertAuthority(base / "ca")
    relay_port = free_port()
    with Sink() as sink:
        pf = PrivatePostfix(base / "postfix", f"[127.0.0.1]:{sink.port}",
                            tls=ca.issue(["postfix-test.localdomain", "127.0.0.1"]),
                            sasl_users={"relayuser": "s3cret"})
        relay_hop = f"[127.0.0.1]:{relay_port}"
        pf.settings.update({
            "mynetworks": "192.0.2.1/32",  # no loopback client relays without AUTH
            "smtpd_relay_restrictions": "permit_sasl_authenticated, reject",
            "smtpd_tls_auth_only": "no",
            "transport_maps": pf.table("transport", {"inbound.test": f"smtp:{relay_hop}"}),
            "smtp_sasl_auth_enable": "yes",
            "smtp_sasl_password_maps": pf.table("sasl_passwd", {relay_hop: "pfuser:pfpass"}),
            "smtp_sasl_security_options": "noanonymous",
            "smtp_sasl_tls_security_options": "noanonymous",
            "smtp_tls_security_level": "may",
            "smtp_tls_policy_maps": pf.table("tls_policy", {relay_hop: "encrypt"}),
        })
        with pf:
            yield World(ca, ca.issue(["relay.test", "127.0.0.1"]), relay_port, sink, pf)


def _smarthost_config(world: World, queue: Path, password: str, **kw):
    hop = f"[127.0.0.1]:{world.postfix.port}"  # the docs' submission smarthost, on loopback
    base = dict(relayhost=hop, smtp_tls_security_level="verify",
                smtp_tls_CAfile=str(world.ca.ca_file), smtp_sasl_auth_enable=True,
                smtp_sasl_password_maps={hop: f"relayuser:{password}"})
    base.update(kw)
    return relay_config(str(queue), log_json=True, **base)


def _send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
        c.sendmail("alice@example.org", [rcpt], f"Subject: to {rcpt}\r\n\r\nhi\r\n".encode())


def _arrived(sink: Sink, rcpt: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while rcpt not in sink.state.rcpts() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rcpt in sink.state.rcpts()


def test_the_relay_authenticates_to_a_postfix_smarthost_over_verified_tls(world, tmp_path):
    with RelayThread(_smarthost_config(world, tmp_path / "q", "s3cret")) as r:
        _send(r.port, "bob@final.test")
        (got,) = r.wait_events(1, "delivery", to="bob@final.test")
    assert got["status"] == "sent", got
    assert _arrived(world.sink, "bob@final.test")
    log = world.postfix.wait_log("sasl_username=relayuser")
    assert "sasl_method=PLAIN, sasl_username=relayuser" in log


def test_a_wrong_password_defers_with_the_servers_reason(world, tmp_path):
    with RelayThread(_smarthost_config(world, tmp_path / "q", "wrong")) as r:
        _send(r.port, "carol@final.test")
        (got,) = r.wait_events(1, "delivery", to="carol@final.test")
    assert got["status"] == "deferred" and got["dsn"] == "4.7.8", got
    assert got["reason"].startswith(
        f"SASL authentication failed; server 127.0.0.1[127.0.0.1]:{world.postfix.port} said: "
        "535 5.7.8 Error: authentication failed"), got["reason"]
    assert "SASL PLAIN authentication failed" in world.postfix.wait_log("PLAIN authentication failed")
    assert not _arrived(world.sink, "carol@final.test", timeout=0.5)


def test_credentials_are_never_sent_in_clear(world, tmp_path):
    """Postfix offers AUTH before STARTTLS; at level ``none`` the relay defers rather
    than send the password (or the mail, which Postfix would refuse unauthenticated)."""
    before = world.postfix.maillog().count("authentication failed")
    with RelayThread(_smarthost_config(world, tmp_path / "q", "s3cret",
                                       smtp_tls_security_level="none")) as r:
        _send(r.port, "dave@final.test")
        (got,) = r.wait_events(1, "delivery", to="dave@final.test")
    assert got["status"] == "deferred" and got["dsn"] == "4.7.0", got
    assert "credentials are sent over TLS only" in got["reason"]
    log = world.postfix.maillog()
    assert log.count("authentication failed") == before
    assert "dave@final.test" not in log  # not even a RCPT
    assert not _arrived(world.sink, "dave@final.test", timeout=0.2)


def test_postfix_relays_into_the_relay_with_smtp_auth(world, tmp_path):
    """Postfix's smtp client, with ``smtp_sasl_auth_enable`` and TLS, relays into the
    relay, whose ``mynetworks`` is empty: only its AUTH lets the mail through."""
    passwords = tmp_path / "smtpd_passwd"
    passwords.write_text(f"# made by python -m queue_ref.relay.smtpd_sasl_auth\n"
                         f"pfuser:{hash_password('pfpass')}\n")
    cert, key = world.relay_cert
    cfg = relay_config(str(tmp_path / "q"), log_json=True, listen=f"127.0.0.1:{world.relay_port}",
                       mynetworks=[], relayhost=f"[127.0.0.1]:{world.sink.port}",
                       smtpd_tls_cert_file=str(cert), smtpd_tls_key_file=str(key),
                       smtpd_sasl_auth_enable=True, smtpd_sasl_password_file=str(passwords))
    with RelayThread(cfg) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:  # no AUTH: no relaying
            c.ehlo("client.test")
            c.mail("alice@example.org")
            assert c.rcpt("erin@inbound.test") == (554, b"5.7.1 <erin@inbound.test>: "
                                                        b"Relay access denied")
        with smtplib.SMTP("127.0.0.1", world.postfix.port, timeout=10) as c:
            c.starttls(context=ssl.create_default_context(cafile=str(world.ca.ca_file)))
            c.login("relayuser", "s3cret")
            c.sendmail("alice@example.org", ["frank@inbound.test"],
                       b"Subject: via postfix\r\n\r\nhi\r\n")
        assert _arrived(world.sink, "frank@inbound.test", timeout=15)
        (auth,) = r.wait_events(1, "auth", status="ok")
        (received,) = r.wait_events(1, "received")
    assert auth["sasl_username"] == "pfuser" and auth["client"] == "127.0.0.1"
    assert auth["sasl_method"] in ("PLAIN", "LOGIN")
    assert received["client"] == "127.0.0.1" and received["from"] == "alice@example.org"
    log = world.postfix.wait_log(f"relay=127.0.0.1[127.0.0.1]:{world.relay_port}")
    assert f"to=<frank@inbound.test>, relay=127.0.0.1[127.0.0.1]:{world.relay_port}" in log
    assert "pfpass" not in "\n".join(r.log_lines)
