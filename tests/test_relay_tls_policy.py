"""The SMTP client's TLS policy (``smtp_tls_security_level``, ``smtp_tls_policy_maps``,
``smtp_tls_CAfile``) against aiosmtpd servers on loopback with certificates from a test
CA, routed by a DNS server on loopback; the receiver's ``smtpd_tls_security_level =
encrypt``; ``--check-config`` on every TLS and AUTH setting."""

from __future__ import annotations

import json
import smtplib
import ssl
import tomllib

import pytest

from queue_ref.relay.relay_config import ConfigError
from queue_ref.relay.smtp_tls_policy import TlsPolicies, cert_names, lookup_keys
from tests.relay_support import DnsServer, RelayThread, Sink, relay_config
from tests.test_relay_process import cli
from tests.tls_certs import CertAuthority, have_openssl, server_context

pytestmark = pytest.mark.skipif(not have_openssl(), reason="openssl makes the test certificates")

ZONE = {
    "tls.test": [("MX", (10, "mx1.tls.test"))],
    "mx1.tls.test": [("A", "127.0.0.1")],
    "plain.test": [("MX", (10, "mx1.tls.test"))],
}


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def certs(ca, tmp_path_factory):
    """Server contexts by name: certificates of the test CA for the MX host, for the
    next-hop domain, for another name; one for the MX host from a CA nobody trusts."""
    stranger = CertAuthority(tmp_path_factory.mktemp("stranger"), "a CA nobody trusts")
    return {"mx": server_context(*ca.issue(["mx1.tls.test"])),
            "nexthop": server_context(*ca.issue(["tls.test"])),
            "other": server_context(*ca.issue(["other.test"])),
            "untrusted": server_context(*stranger.issue(["mx1.tls.test"]))}


def _relay(tmp_path, dns, sink, **kw):
    return RelayThread(relay_config(str(tmp_path / "q"), dns_nameservers=["127.0.0.1"],
                                    dns_port=dns.port, smtp_port=sink.port, log_json=True, **kw))


def _send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
        c.sendmail("alice@example.org", [rcpt], b"Subject: tls policy\r\n\r\nhi\r\n")


def _outcome(r: RelayThread, rcpt: str) -> dict:
    (first,) = r.wait_events(1, "delivery", timeout=15, to=rcpt)[:1]
    return first


@pytest.mark.parametrize("level", ["none", "may", "encrypt", "verify", "secure"])
def test_a_server_without_starttls_gets_mail_only_where_tls_is_optional(tmp_path, ca, level):
    with DnsServer(ZONE) as dns, Sink() as sink, _relay(
            tmp_path, dns, sink, smtp_tls_security_level=level,
            smtp_tls_CAfile=str(ca.ca_file)) as r:
        _send(r.port, "bob@tls.test")
        got = _outcome(r, "bob@tls.test")
    if level in ("none", "may"):
        assert got["status"] == "sent" and len(sink.state.messages) == 1
        assert not sink.state.messages[0].tls
        return
    assert got["status"] == "deferred" and got["dsn"] == "4.7.4"
    assert got["reason"] == (f"TLS is required, but was not offered by host "
                             f"mx1.tls.test[127.0.0.1]:{sink.port}")
    assert sink.state.messages == [] and sink.state.seen == {}  # not even RCPT in clear


CASES = [  # (server certificate, level, table entry's match or None, expected failure or "")
    ("mx", "encrypt", None, ""),
    ("untrusted", "encrypt", None, ""),  # encrypt: no certificate check
    ("mx", "verify", None, ""),
    ("mx", "secure", None, ""),  # dot-nexthop: mx1.tls.test is below tls.test
    ("nexthop", "secure", None, ""),
    ("nexthop", "verify", None, "names tls.test match none of mx1.tls.test"),
    ("other", "verify", None, "names other.test match none of mx1.tls.test"),
    ("other", "secure", None, "names other.test match none of tls.test, .tls.test"),
    ("other", "verify", "hostname:other.test", ""),
    ("untrusted", "verify", None, "unable to get local issuer certificate"),
    ("untrusted", "secure", None, "unable to get local issuer certificate"),
]


@pytest.mark.parametrize(("cert", "level", "match", "failure"), CASES)
def test_certificates_are_checked_as_the_level_says(tmp_path, ca, certs, cert, level, match,
                                                   failure):
    entry = {"level": level} if match is None else {"level": level, "match": match}
    with DnsServer(ZONE) as dns, Sink(tls_context=certs[cert]) as sink, _relay(
            tmp_path, dns, sink, smtp_tls_security_level="may", smtp_tls_CAfile=str(ca.ca_file),
            smtp_tls_policy_maps={"tls.test": entry}) as r:
        _send(r.port, "bob@tls.test")
        got = _outcome(r, "bob@tls.test")
    if not failure:
        assert got["status"] == "sent", got
        assert sink.state.messages[0].tls
        return
    assert got["status"] == "deferred" and got["dsn"] == "4.7.5", got
    assert got["reason"].startswith("Server certificate not verified: host mx1.tls.test[")
    assert failure in got["reason"], got["reason"]
    assert sink.state.messages == [] and sink.state.seen == {}


def test_the_policy_table_is_looked_up_by_destination_and_nexthop(tmp_path, ca):
    """Global ``none``; the table asks TLS of one domain (deferred: the server offers
    none) and leaves the other one plain; a bracketed relayhost is looked up as
    ``[host]:port``."""
    with DnsServer(ZONE) as dns, Sink() as sink:
        with _relay(tmp_path, dns, sink, smtp_tls_security_level="none",
                    smtp_tls_policy_maps={".test": "none", "tls.test": "encrypt"}) as r:
            _send(r.port, "bob@tls.test")
            _send(r.port, "carol@plain.test")
            assert _outcome(r, "carol@plain.test")["status"] == "sent"
            assert _outcome(r, "bob@tls.test")["dsn"] == "4.7.4"
        relayhost = f"[127.0.0.1]:{sink.port}"
        (tmp_path / "2").mkdir()
        with _relay(tmp_path / "2", dns, sink, relayhost=relayhost,
                    smtp_tls_policy_maps={relayhost: "encrypt"}) as r:
            _send(r.port, "dave@plain.test")
            got = _outcome(r, "dave@plain.test")
        assert got["dsn"] == "4.7.4" and "by host 127.0.0.1[127.0.0.1]" in got["reason"]
    assert [m.rcpts for m in sink.state.messages] == [["carol@plain.test"]]


def test_lookup_keys_and_certificate_names():
    assert lookup_keys("[mail.example.net]:587", 25) == ["[mail.example.net]:587"]
    assert lookup_keys("[mail.example.net]:25", 25) == ["[mail.example.net]:25",
                                                        "[mail.example.net]"]
    assert lookup_keys("relay.example.net:25", 25) == [
        "relay.example.net:25", "relay.example.net", ".example.net", ".net"]
    # another port, above or below the default: only the key with that port
    for port in (24, 587, 2525):
        assert lookup_keys(f"relay.example.net:{port}", 25) == [f"relay.example.net:{port}"]
        assert lookup_keys(f"[mail.example.net]:{port}", 25) == [f"[mail.example.net]:{port}"]
    assert lookup_keys("A.Example.COM", 25) == ["a.example.com", ".example.com", ".com"]
    cert = {"subject": ((("commonName", "cn.test"),),),
            "subjectAltName": (("DNS", "*.Example.com"), ("IP Address", "192.0.2.1"))}
    assert cert_names(cert) == ["*.example.com", "192.0.2.1"]
    assert cert_names({"subject": ((("commonName", "cn.test"),),)}) == ["cn.test"]
    policies = TlsPolicies(relay_config("/q", smtp_tls_security_level="verify"))
    verify = policies.policy("example.com")
    assert policies.mismatch(verify, "example.com", "mx.example.com", cert) is None
    assert policies.mismatch(verify, "example.com", "a.mx.example.com", cert) is not None
    assert policies.mismatch(verify, "example.com", "192.0.2.1", cert) is None
    with pytest.raises(ConfigError, match="expected a level"):
        relay_config("/q", smtp_tls_policy_maps={"example.com": "mandatory"})


def test_the_receiver_wants_starttls_before_mail_at_encrypt(tmp_path, ca):
    cert, key = ca.issue(["relay.test", "127.0.0.1"])
    cfg = relay_config(str(tmp_path / "q"), smtpd_tls_cert_file=str(cert),
                       smtpd_tls_key_file=str(key), smtpd_tls_security_level="encrypt")
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("client.test")
        assert c.has_extn("starttls")
        assert c.mail("alice@example.org") == (
            530, b"5.7.0 Must issue a STARTTLS command first")
        assert c.docmd("RCPT TO:<bob@example.org>")[0] == 530
        c.starttls(context=ssl.create_default_context(cafile=str(ca.ca_file)))
        c.ehlo("client.test")
        assert c.mail("alice@example.org")[0] == 250


BAD = [  # (settings, the one line --check-config prints)
    ('smtp_tls_security_level = "mandatory"',
     "smtp_tls_security_level: expected a level (none, may, encrypt, verify, secure), "
     "got 'mandatory'"),
    ('smtp_tls_CAfile = "/nonexistent/ca.pem"',
     "smtp_tls_CAfile: cannot load /nonexistent/ca.pem: No such file or directory"),
    ('smtp_tls_verify_cert_match = "hostname:bad name!"',
     "smtp_tls_verify_cert_match: 'name!' is not hostname, nexthop, dot-nexthop or a name"),
    ('[smtp_tls_policy_maps]\n"[host:25" = "encrypt"',
     "smtp_tls_policy_maps: key '[host:25': unclosed '[' in '[host:25'"),
    ('[smtp_tls_policy_maps]\n"example.com" = { level = "may", match = "nexthop" }',
     "smtp_tls_policy_maps.example.com: match is for the verify and secure levels only"),
    ('[smtp_tls_policy_maps]\n"example.com" = { level = "verify", mach = "nexthop" }',
     "smtp_tls_policy_maps.example.com: unknown field 'mach' (level, match)"),
    ('smtp_tls_policy_maps = "encrypt"',
     "smtp_tls_policy_maps: expected a table of nexthop = level or { level, match }"),
    ('smtp_sasl_auth_enable = true\n[smtp_sasl_password_maps]\n"[smart]:587" = "nocolon"',
     "smtp_sasl_password_maps.[smart]:587: expected \"user:password\""),
    ('smtp_sasl_auth_enable = "yes"', "smtp_sasl_auth_enable: expected true or false"),
    ('[smtp_sasl_password_maps]\n"[smart]:587" = "u:p"',
     "smtp_sasl_password_maps is set but smtp_sasl_auth_enable is not"),
    ('smtpd_tls_security_level = "verify"',
     "smtpd_tls_security_level: expected none, may or encrypt, not 'verify'"),
    ('smtpd_tls_security_level = "encrypt"',
     "smtpd_tls_security_level = encrypt needs smtpd_tls_cert_file"),
    ("smtpd_sasl_auth_enable = true", "smtpd_sasl_auth_enable needs smtpd_sasl_password_file"),
    ('smtpd_sasl_auth_enable = true\nsmtpd_sasl_password_file = "/nonexistent"',
     "smtpd_sasl_password_file: /nonexistent does not exist"),
    ("smtpd_auth_failure_limit = 0", "smtpd_auth_failure_limit: must be at least 1"),
    ("anvil_rate_time_unit = 0", "anvil_rate_time_unit: must be above 0"),
]


@pytest.mark.parametrize(("settings", "line"), BAD)
def test_check_config_refuses_each_bad_tls_or_auth_setting(tmp_path, settings, line):
    f = tmp_path / "relay.toml"
    f.write_text(f'queue = "{tmp_path}/q"\n{settings}\n')
    r = cli("--config", str(f), "--check-config")
    assert r.returncode == 2, r.stdout
    assert r.stderr.strip().splitlines() == [f"queue-ref relay: {line}"]


def test_check_config_shows_the_tls_and_auth_settings_without_passwords(tmp_path, ca):
    f = tmp_path / "relay.toml"
    f.write_text(f'queue = "{tmp_path}/q"\nrelayhost = "[smart.example.net]:587"\n'
                 f'smtp_tls_security_level = "verify"\nsmtp_tls_CAfile = "{ca.ca_file}"\n'
                 'smtp_sasl_auth_enable = true\n'
                 '[smtp_sasl_password_maps]\n"[smart.example.net]:587" = "relay:s3cret"\n'
                 '[smtp_tls_policy_maps]\n"example.com" = { level = "secure", '
                 'match = "nexthop" }\n')
    r = cli("--config", str(f), "--check-config", "--json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)["config"]
    assert cfg["smtp_sasl_password_maps"] == {"[smart.example.net]:587": "relay:(hidden)"}
    assert cfg["smtp_tls_policy_maps"]["example.com"]["level"] == "secure"
    shown = cli("--config", str(f), "--check-config").stdout
    assert "s3cret" not in shown
    assert tomllib.loads(shown)["smtp_tls_policy_maps"] == {
        "example.com": {"level": "secure", "match": "nexthop"}}  # the text is TOML again
