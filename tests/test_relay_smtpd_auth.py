"""The receiver's SMTP AUTH (``smtpd_sasl_auth_enable``): swaks and smtplib as clients of
a relay whose ``mynetworks`` is empty, so that only AUTH lets a loopback client relay;
AUTH after STARTTLS only, failures limited per client address and logged without the
password; the password file and the command that makes its lines."""

from __future__ import annotations

import base64
import shutil
import smtplib
import ssl
import subprocess
import sys

import pytest

from queue_ref.relay.relay_config import ConfigError
from queue_ref.relay.smtpd_sasl_auth import load_password_file, verify_password
from tests.relay_support import RelayThread, Sink, relay_config
from tests.tls_certs import CertAuthority, have_openssl

pytestmark = pytest.mark.skipif(not have_openssl(), reason="openssl makes the certificates")

PASSWORD = "correct horse"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def password_file(tmp_path_factory):
    run = subprocess.run([sys.executable, "-m", "queue_ref.relay.smtpd_sasl_auth", "alice"],
                         input=PASSWORD + "\n", capture_output=True, text=True, check=True)
    path = tmp_path_factory.mktemp("auth") / "smtpd_passwd"
    path.write_text("# user:hash\n\n" + run.stdout)
    return path


def _config(tmp_path, ca, password_file, sink, **kw):
    cert, key = ca.issue(["relay.test", "127.0.0.1"])
    base = dict(mynetworks=[], relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
                smtpd_tls_cert_file=str(cert), smtpd_tls_key_file=str(key),
                smtpd_sasl_auth_enable=True, smtpd_sasl_password_file=str(password_file))
    base.update(kw)
    return relay_config(str(tmp_path / "q"), **base)


def _tls(ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.ca_file))


def _swaks(port: int, rcpt: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["swaks", "--server", f"127.0.0.1:{port}", "--from", "a@example.org",
                           "--to", rcpt, "--tls", *args], capture_output=True, text=True,
                          timeout=30)


@pytest.mark.skipif(shutil.which("swaks") is None, reason="swaks is not installed")
@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_swaks_authenticates_over_starttls_and_relays(tmp_path, ca, password_file, mechanism):
    with Sink() as sink, RelayThread(_config(tmp_path, ca, password_file, sink)) as r:
        denied = _swaks(r.port, "bob@elsewhere.test")
        assert denied.returncode != 0 and "554 5.7.1 <bob@elsewhere.test>: Relay access denied" \
            in denied.stdout
        run = _swaks(r.port, "carol@elsewhere.test", "--auth", mechanism, "--auth-user", "alice",
                     "--auth-password", PASSWORD)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "235 2.7.0 Authentication successful" in run.stdout
        (got,) = sink.wait_for(1)
        (auth,) = r.wait_events(1, "auth")
    assert got.rcpts == ["carol@elsewhere.test"]
    assert auth == {**auth, "client": "127.0.0.1", "sasl_method": mechanism,
                    "sasl_username": "alice", "status": "ok"}


def test_auth_is_offered_only_after_starttls(tmp_path, ca, password_file):
    with Sink() as sink, RelayThread(_config(tmp_path, ca, password_file, sink)) as r, \
            smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("client.test")
        assert not c.has_extn("auth")
        assert c.docmd("AUTH PLAIN")[0] == 538
        c.starttls(context=_tls(ca))
        c.ehlo("client.test")
        assert c.esmtp_features["auth"].split() == ["LOGIN", "PLAIN"]
    (tmp_path / "2").mkdir()
    with Sink() as sink, RelayThread(_config(tmp_path / "2", ca, password_file, sink,
                                             smtpd_tls_auth_only=False)) as r, \
            smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("client.test")
        assert c.esmtp_features["auth"].split() == ["LOGIN", "PLAIN"]
        assert c.login("alice", PASSWORD)[0] == 235


def test_without_smtpd_sasl_auth_enable_no_auth_is_offered(tmp_path, ca):
    cert, key = ca.issue(["relay.test", "127.0.0.1"])
    cfg = relay_config(str(tmp_path / "q"), smtpd_tls_cert_file=str(cert),
                       smtpd_tls_key_file=str(key))
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.starttls(context=_tls(ca))
        c.ehlo("client.test")
        assert not c.has_extn("auth")
        assert c.docmd("AUTH PLAIN AGFsaWNlAHg=") == (
            503, b"5.5.1 Error: authentication not enabled")


def _plain(user: str, password: str) -> str:
    return base64.b64encode(f"\0{user}\0{password}".encode()).decode()


def test_failed_logins_are_limited_per_client_and_logged_without_the_password(
        tmp_path, ca, password_file):
    with Sink() as sink, RelayThread(_config(tmp_path, ca, password_file, sink,
                                             smtpd_auth_failure_limit=3)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.starttls(context=_tls(ca))
            c.ehlo("client.test")
            assert c.docmd("AUTH PLAIN " + _plain("alice", "guess0")) == (
                535, b"5.7.8 Error: authentication failed: authentication failure")
            c.user, c.password = "alice", "guess1"
            with pytest.raises(smtplib.SMTPAuthenticationError) as e:  # LOGIN, once
                c.auth("LOGIN", c.auth_login)
            assert e.value.smtp_code == 535
            assert c.docmd("AUTH PLAIN " + _plain("alice", "guess2")) == (
                421, b"4.7.0 Error: too many failed authentication attempts")
            with pytest.raises(smtplib.SMTPServerDisconnected):
                c.noop()
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:  # a new session: the same
            c.starttls(context=_tls(ca))
            c.ehlo("client.test")
            assert c.docmd("AUTH PLAIN " + _plain("alice", PASSWORD))[0] == 421
        events = r.events("auth")
    failed = [e for e in events if e["status"] == "failed"]
    assert len(failed) == 3
    assert {(e["client"], e["sasl_username"]) for e in failed} == {("127.0.0.1", "alice")}
    assert {e["sasl_method"] for e in failed} <= {"PLAIN", "LOGIN"}
    assert [e["status"] for e in events][-2:] == ["blocked", "blocked"]
    log = "\n".join(r.log_lines)
    assert "guess" not in log and PASSWORD not in log and "horse" not in log


def test_the_password_file_and_its_command(tmp_path, password_file):
    users = load_password_file(str(password_file))
    assert list(users) == ["alice"] and users["alice"].startswith("$scrypt$ln=14,r=8,p=1$")
    assert verify_password(users["alice"], PASSWORD.encode())
    assert not verify_password(users["alice"], b"correct horsE")
    bad = tmp_path / "bad"
    bad.write_text("alice:$scrypt$ln=14,r=8,p=1$c2FsdA$aGFzaA\nbob:plaintext\n")
    with pytest.raises(ConfigError, match=r"bad line 2: expected user:\$scrypt\$"):
        load_password_file(str(bad))
    # scrypt parameters scrypt itself refuses are refused at start, not at the first AUTH
    for params in ("ln=0,r=8,p=1", "ln=21,r=8,p=1", "ln=14,r=0,p=1", "ln=14,r=8,p=0"):
        bad.write_text(f"alice:$scrypt${params}$c2FsdA$aGFzaA\n")
        with pytest.raises(ConfigError, match="scrypt parameters out of range"):
            load_password_file(str(bad))
    run = subprocess.run([sys.executable, "-m", "queue_ref.relay.smtpd_sasl_auth", "a:b"],
                         input="x\n", capture_output=True, text=True)
    assert run.returncode == 2 and "usage:" in run.stderr
