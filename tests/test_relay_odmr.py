"""On-Demand Mail Relay (RFC 2645) on the relay: mail for an ATRN domain is never sent by
MX; its client connects to ``odmr_listen``, authenticates, says ATRN, and after the 250
the test is the SMTP server on the same socket and the relay delivers to it; outcomes
finish as every delivery's (sent, deferred, bounced); the queue lifetime still bounces
mail no client came for."""

from __future__ import annotations

import base64
import os
import smtplib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from queue_ref.relay.relay_config import ConfigError, RelayConfig
from queue_ref.relay.smtpd_sasl_auth import hash_password
from tests.relay_support import RelayThread, Sink, queued_entries, relay_config, smtp_send
from tests.tls_certs import CertAuthority, have_openssl

PASSWORD = "odmr secret"
DOMAIN = "ondemand.example"


def _password_file(tmp_path: Path) -> str:
    path = tmp_path / "smtpd_passwd"
    path.write_text(f"alice:{hash_password(PASSWORD, ln=10)}\nbob:{hash_password('x', ln=10)}\n")
    return str(path)


def _config(tmp_path: Path, sink: Sink, **kw: object) -> RelayConfig:
    base: dict[str, object] = dict(
        relayhost=f"[127.0.0.1]:{sink.port}", log_json=True, odmr_listen="127.0.0.1:0",
        smtpd_sasl_auth_enable=True, smtpd_sasl_password_file=_password_file(tmp_path),
        smtpd_tls_auth_only=False, atrn_domains={DOMAIN: "alice", "bob.example": "bob"})
    base.update(kw)
    return relay_config(str(tmp_path / "q"), **base)


def _odmr(r: RelayThread, user: str = "alice", password: str = PASSWORD) -> smtplib.SMTP:
    assert r.relay.odmr is not None and r.relay.odmr.address is not None
    c = smtplib.SMTP("127.0.0.1", r.relay.odmr.address[1], timeout=10)
    code, text = c.ehlo("customer.test")
    assert code == 250 and b"ATRN" in text
    if user:
        c.login(user, password)
    return c


def deferred(r: RelayThread, n: int) -> None:
    """Wait until ``n`` deferrals are logged and their entries are back in the queue (a
    deferral is logged just before its ``send_cancel``)."""
    assert len(r.wait_events(n, status="deferred", timeout=10)) >= n
    deadline = time.monotonic() + 10
    while r.call(lambda: r.relay.scheduler.sizes()["inflight"]) and time.monotonic() < deadline:
        time.sleep(0.02)


def serve_turned(sock: socket.socket, replies: dict[str, str], data_reply: str = "",
                 lines: list[str] | None = None, answer_quit: bool = True,
                 midway: Callable[[], None] | None = None
                 ) -> list[tuple[str, list[str], bytes]]:
    """Be the SMTP server on ``sock`` after ATRN's 250: the greeting, then each command
    answered (``replies``: recipient -> its RCPT reply, else 250; ``data_reply``, when
    given, answers DATA instead of 354) until QUIT (unanswered unless ``answer_quit``:
    then until the relay hangs up); the messages taken (sender, recipients accepted,
    content).  ``lines`` gets every command line read; ``midway`` is called once 2 MB of
    a message's data were read (a pause point: the rest waits in the connection)."""
    f = sock.makefile("rb")
    sock.sendall(b"220 customer.test ESMTP\r\n")
    got: list[tuple[str, list[str], bytes]] = []
    mail_from, rcpts = "", []
    while True:
        line = f.readline().decode()
        if not line:
            return got
        if lines is not None:
            lines.append(line.rstrip("\r\n"))
        verb = line[:4].upper()
        if verb == "EHLO":
            sock.sendall(b"250-customer.test\r\n250-8BITMIME\r\n250 SIZE 1000000\r\n")
        elif verb == "MAIL":
            mail_from, rcpts = line.split("<", 1)[1].split(">", 1)[0], []
            sock.sendall(b"250 2.1.0 Ok\r\n")
        elif verb == "RCPT":
            rcpt = line.split("<", 1)[1].split(">", 1)[0]
            reply = replies.get(rcpt, "250 2.1.5 Ok")
            if reply.startswith("250"):
                rcpts.append(rcpt)
            sock.sendall(reply.encode() + b"\r\n")
        elif verb == "DATA" and data_reply:
            sock.sendall(data_reply.encode() + b"\r\n")
        elif verb == "DATA":
            sock.sendall(b"354 go ahead\r\n")
            parts: list[bytes] = []
            size = 0
            while not (parts and parts[-1] == b".\r\n" and (len(parts) == 1
                                                           or parts[-2].endswith(b"\n"))):
                parts.append(f.readline())
                size += len(parts[-1])
                if midway is not None and size >= 2 << 20:
                    midway()
                    midway = None
            data = b"".join(parts)
            got.append((mail_from, rcpts, data))
            sock.sendall(b"250 2.0.0 Ok: taken\r\n")
        elif verb == "QUIT" and answer_quit:
            sock.sendall(b"221 2.0.0 Bye\r\n")
            return got
        elif verb == "QUIT":
            continue
        else:
            sock.sendall(b"250 2.0.0 Ok\r\n")


def test_atrn_domain_mail_waits_then_goes_over_the_turned_connection(tmp_path: Path) -> None:
    with Sink() as sink, RelayThread(_config(tmp_path, sink)) as r:
        smtp_send(r.port, "a@example.org", [f"one@{DOMAIN}", f"defer@{DOMAIN}"])
        smtp_send(r.port, "a@example.org", [f"reject@{DOMAIN}"])
        deferred(r, 3)
        time.sleep(1.5)  # minimal_backoff_time is 1 s: no retry may come
        assert sink.state.connections == 0  # never sent by MX (the relayhost here)
        assert r.events("delivery")[0]["reason"].startswith("on-demand domain")
        with _odmr(r) as c:
            code, text = c.docmd("ATRN", DOMAIN.upper())
            assert (code, text) == (250, b"2.0.0 OK now reversing the connection")
            got = serve_turned(c.sock, {f"defer@{DOMAIN}": "450 4.2.0 busy",
                                        f"reject@{DOMAIN}": "550 5.1.1 no such user"})
        assert [(m, rc) for m, rc, _ in got] == [("a@example.org", [f"one@{DOMAIN}"])]
        assert b"Subject: t" in got[0][2]
        r.wait_events(1, "delivery", status="sent")
        (bounce,) = sink.wait_for(1)  # the bounce of reject@ goes to the sender
        events = {e["to"]: e for e in r.events("delivery")[3:]}
    assert bounce.rcpts == ["a@example.org"]
    assert events[f"one@{DOMAIN}"]["status"] == "sent"
    assert events[f"one@{DOMAIN}"]["relay"] == "odmr[127.0.0.1]"
    assert events[f"defer@{DOMAIN}"]["status"] == "deferred"
    assert events[f"reject@{DOMAIN}"]["status"] == "bounced"
    (left,) = queued_entries(str(tmp_path / "q"))
    assert left.rcpt == f"defer@{DOMAIN}"
    lifetime = r.relay.config.maximal_queue_lifetime
    assert left.schedule.at > time.time() + lifetime - 60  # not retried before its lifetime


def test_atrn_replies(tmp_path: Path) -> None:
    with Sink() as sink, RelayThread(_config(tmp_path, sink)) as r:
        with _odmr(r, user="") as c:
            assert c.docmd("ATRN", DOMAIN)[0] == 530
            assert c.docmd("MAIL", "FROM:<a@example.org>")[0] == 502
            c.login("alice", PASSWORD)
            assert c.docmd("ATRN", "bob.example")[0] == 450  # not alice's
            assert c.docmd("ATRN", f"{DOMAIN},bob.example")[0] == 450
            assert c.docmd("ATRN", "bad domain!")[0] == 501
            assert c.docmd("ATRN", DOMAIN) == (453, b"4.4.0 You have no mail")
            assert c.docmd("ATRN")[0] == 453  # every domain of hers: none has mail
        with _odmr(r, user="bob", password="x") as c:
            assert c.docmd("ATRN", DOMAIN)[0] == 450
        (atrn, *_) = r.wait_events(1, "atrn")
        assert r.relay.odmr is not None and r.relay.odmr.address is not None
        assert r.relay.ready_line().endswith(f" odmr=127.0.0.1:{r.relay.odmr.address[1]}")
    assert atrn["status"] == "refused" and atrn["sasl_username"] == "alice"
    assert sink.state.connections == 0


def test_atrn_domain_mail_bounces_at_its_lifetime(tmp_path: Path) -> None:
    with Sink() as sink, RelayThread(_config(tmp_path, sink, maximal_queue_lifetime=2.0)) as r:
        smtp_send(r.port, "a@example.org", [f"x@{DOMAIN}"])
        (bounce,) = sink.wait_for(1, timeout=15)
        r.wait_events(1, "delivery", status="sent")  # the bounce's delivery
        events = [e for e in r.events("delivery") if e["to"] == f"x@{DOMAIN}"]
    assert bounce.rcpts == ["a@example.org"] and b"x@ondemand.example" in bounce.data
    # one deferral, then the lifetime's bounce
    assert [e["status"] for e in events] == ["deferred", "bounced"]
    assert events[1]["reason"].startswith("message expired: on-demand domain")
    assert sink.state.connections == 1  # the bounce's; the mail itself went nowhere


@pytest.mark.parametrize(("kw", "error"), [
    (dict(atrn_domains={DOMAIN: "alice"}), "atrn_domains or odmr_cram_md5_file is set but"),
    (dict(odmr_listen="127.0.0.1:366"), "odmr_listen needs smtpd_sasl_auth_enable or"),
    (dict(odmr_listen="127.0.0.1:366", smtpd_sasl_auth_enable=True, smtpd_tls_auth_only=False,
          atrn_domains={DOMAIN: "carol"}), "'carol' is not a user"),
    (dict(odmr_listen="127.0.0.1:366", smtpd_sasl_auth_enable=True, smtpd_tls_auth_only=False,
          atrn_domains={"bad..domain": "alice"}), "atrn_domains: 'bad..domain' is not a domain"),
    (dict(odmr_listen="127.0.0.1:x", smtpd_sasl_auth_enable=True, smtpd_tls_auth_only=False),
     "odmr_listen: bad port"),
])
def test_odmr_config_is_checked(tmp_path: Path, kw: dict[str, object], error: str) -> None:
    if kw.get("smtpd_sasl_auth_enable"):
        kw = {**kw, "smtpd_sasl_password_file": _password_file(tmp_path)}
    with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
        relay_config(str(tmp_path / "q"), **kw)


def test_check_config_refuses_a_bad_atrn_table_in_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "relay.toml"
    conf.write_text(f'queue = "{tmp_path / "q"}"\nodmr_listen = "127.0.0.1:3660"\n'
                    'smtpd_sasl_auth_enable = true\nsmtpd_tls_auth_only = false\n'
                    f'smtpd_sasl_password_file = "{_password_file(tmp_path)}"\n'
                    '[atrn_domains]\n"example.com" = "nobody"\n')
    run = subprocess.run([sys.executable, "-m", "conformance.cli", "relay", "--config", str(conf),
                          "--check-config"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "atrn_domains.example.com" in run.stderr


def _cram_file(tmp_path: Path) -> str:
    path = tmp_path / "odmr_secrets"
    path.write_text("# user:secret\nalice:" + PASSWORD + "\n")
    path.chmod(0o600)
    return str(path)


def test_fetchmail_odmr_client_takes_the_domains_mail(tmp_path: Path) -> None:
    """Debian's fetchmail as the ODMR client: EHLO, AUTH CRAM-MD5, ATRN, then it relays
    what the relay sends to its ``smtphost``, a sink standing for the customer's MTA."""
    with Sink() as sink, Sink() as customer, RelayThread(_config(
            tmp_path, sink, odmr_cram_md5_file=_cram_file(tmp_path))) as r:
        smtp_send(r.port, "a@example.org", [f"one@{DOMAIN}", f"two@{DOMAIN}"])
        smtp_send(r.port, "b@example.org", [f"three@{DOMAIN}"])
        deferred(r, 3)
        assert r.relay.odmr is not None and r.relay.odmr.address is not None
        rc = tmp_path / "fetchmailrc"
        rc.write_text(f"poll 127.0.0.1 with protocol ODMR port {r.relay.odmr.address[1]}:\n"
                      f'  user "alice" there with password "{PASSWORD}" is "alice" here\n'
                      f"  smtphost 127.0.0.1/{customer.port}\n  fetchdomains {DOMAIN}\n")
        rc.chmod(0o600)
        env = {**os.environ, "HOME": str(tmp_path), "FETCHMAILHOME": str(tmp_path)}
        run = subprocess.run(["fetchmail", "--nosyslog", "-v", "-f", str(rc)], env=env,
                             capture_output=True, text=True, timeout=60)
        got = customer.wait_for(3, timeout=10)
        r.wait_events(3, "delivery", status="sent")
        auth = r.events("auth")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Turnaround now" in run.stdout + run.stderr
    assert sorted(x for m in got for x in m.rcpts) == [f"one@{DOMAIN}", f"three@{DOMAIN}",
                                                        f"two@{DOMAIN}"]
    assert [a["sasl_method"] for a in auth] == ["CRAM-MD5"] and auth[0]["status"] == "ok"
    assert queued_entries(str(tmp_path / "q")) == []
    assert sink.state.connections == 0


def test_cram_md5_secrets_file_must_be_private(tmp_path: Path) -> None:
    path = _cram_file(tmp_path)
    Path(path).chmod(0o644)
    with pytest.raises(ConfigError, match="may be read by others"):
        relay_config(str(tmp_path / "q"), odmr_listen="127.0.0.1:0", odmr_cram_md5_file=path,
                     smtpd_tls_auth_only=False)


@pytest.mark.skipif(not have_openssl(), reason="openssl makes the certificates")
def test_atrn_after_starttls_turns_the_tls_session(tmp_path: Path) -> None:
    """``smtpd_tls_auth_only``: AUTH only after STARTTLS; the turned session goes on
    inside the TLS session the client started."""
    ca = CertAuthority(tmp_path / "ca")
    cert, key = ca.issue(["relay.test", "127.0.0.1"])
    with Sink() as sink, RelayThread(_config(
            tmp_path, sink, smtpd_tls_auth_only=True, smtpd_tls_cert_file=str(cert),
            smtpd_tls_key_file=str(key))) as r:
        smtp_send(r.port, "a@example.org", [f"tls@{DOMAIN}"])
        deferred(r, 1)
        with _odmr(r, user="") as c:
            assert b"AUTH" not in c.ehlo_resp  # not before STARTTLS
            c.starttls(context=ssl.create_default_context(cafile=str(ca.ca_file)))
            c.ehlo("customer.test")
            c.login("alice", PASSWORD)
            assert c.docmd("ATRN", DOMAIN)[0] == 250
            got = serve_turned(c.sock, {})
        r.wait_events(1, "delivery", status="sent")
    assert [rc for _, rc, _ in got] == [[f"tls@{DOMAIN}"]]
    assert queued_entries(str(tmp_path / "q")) == []


def test_failed_auth_on_the_odmr_port_reaches_the_limit(tmp_path: Path) -> None:
    with Sink() as sink, RelayThread(_config(tmp_path, sink, smtpd_auth_failure_limit=2)) as r:
        with _odmr(r, user="") as c:
            wrong = base64.b64encode(b"\0alice\0wrong").decode()
            assert c.docmd("AUTH", f"PLAIN {wrong}")[0] == 535
            assert c.docmd("AUTH", f"PLAIN {wrong}")[0] == 421
            with pytest.raises(smtplib.SMTPServerDisconnected):
                c.docmd("NOOP")
        with _odmr(r, user="") as c:
            right = base64.b64encode(f"\0alice\0{PASSWORD}".encode()).decode()
            assert c.docmd("AUTH", f"PLAIN {right}")[0] == 421  # blocked for the window


def test_a_data_command_refused_on_the_turned_connection_defers_and_resets(
        tmp_path: Path) -> None:
    """The ATRN client answers DATA with 451: the relay sends no content, resets the
    transaction and quits; the recipient is deferred with that reply, its mail kept."""
    with Sink() as sink, RelayThread(_config(tmp_path, sink)) as r:
        smtp_send(r.port, "a@example.org", [f"one@{DOMAIN}"])
        deferred(r, 1)
        lines: list[str] = []
        with _odmr(r) as c:
            code, _ = c.docmd("ATRN", DOMAIN)
            assert code == 250
            got = serve_turned(c.sock, {}, data_reply="451 4.3.0 try later", lines=lines)
        r.wait_events(2, "delivery", status="deferred")
        last = r.events("delivery")[-1]
    assert got == []
    verbs = [line.split(" ", 1)[0].split(":", 1)[0].upper() for line in lines]
    assert verbs[verbs.index("DATA"):] == ["DATA", "RSET", "QUIT"], lines
    assert last["to"] == f"one@{DOMAIN}" and last["dsn"] == "4.3.0"
    assert "451 4.3.0 try later" in last["reason"]
    (left,) = queued_entries(str(tmp_path / "q"))
    assert left.rcpt == f"one@{DOMAIN}"


def test_a_customer_that_never_answers_quit_is_hung_up_on(tmp_path: Path) -> None:
    """The turned session's QUIT waits 5 s for its reply; then the relay closes the
    connection all the same, with nothing logged as an error (the timeout used to escape
    the ATRN command: aiosmtpd logged a session exception and reset the connection)."""
    with Sink() as sink, RelayThread(_config(tmp_path, sink)) as r:
        smtp_send(r.port, "a@example.org", [f"one@{DOMAIN}"])
        deferred(r, 1)
        lines: list[str] = []
        with _odmr(r) as c:
            assert c.docmd("ATRN", DOMAIN)[0] == 250
            c.sock.settimeout(15)
            started = time.monotonic()
            got = serve_turned(c.sock, {}, lines=lines, answer_quit=False)
            took = time.monotonic() - started
        r.wait_events(1, "delivery", status="sent")
    assert [rc for _, rc, _ in got] == [[f"one@{DOMAIN}"]]
    assert lines[-1] == "QUIT" and 4.5 <= took < 12, took
    assert r.events("error") == []


def test_a_big_message_goes_over_the_turned_connection_a_piece_at_a_time(
        tmp_path: Path) -> None:
    """A 6 MB message for an on-demand domain is read from the queue as it goes out over
    the client's connection (``smtp_wire_body.STREAMED_BODY``): midway through its data,
    the relay holds a piece of it, not all of it; it arrives as it was queued."""
    from queue_ref.relay.smtp_wire_body import STREAM_PIECE

    line = b".dot line, stuffed on the wire " + b"x" * 40 + b"\r\n"
    body = b"Subject: big\r\n\r\n" + line * (6 * 1024 * 1024 // len(line))
    held: list[int] = []
    with Sink() as sink, RelayThread(_config(tmp_path, sink)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as c:
            assert c.sendmail("a@example.org", [f"one@{DOMAIN}"], body) == {}
        deferred(r, 1)
        with _odmr(r) as c:
            assert c.docmd("ATRN", DOMAIN)[0] == 250
            got = serve_turned(c.sock, {}, midway=lambda: held.append(
                r.call(lambda: r.relay.scheduler.body_bytes)))
        r.wait_events(1, "delivery", status="sent")
    [(_, rcpts, data)] = got
    assert rcpts == [f"one@{DOMAIN}"]
    assert data.endswith(b"\r\n" + body.replace(b"\r\n.", b"\r\n..") + b".\r\n")
    assert held and 0 < held[0] <= STREAM_PIECE, held
