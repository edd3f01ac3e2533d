"""Relay access (``queue_ref.relay.relay_access``) against a reference written here from
Postfix's documented semantics, and a few of its answers over SMTP from 127.0.0.1 and ::1.

The reference, from postconf(5) of Postfix 3.7 (``man 5 postconf``):

* ``mynetworks``: "a list of network addresses or network/netmask patterns ... The
  netmask specifies the number of bits in the network part of a host address"; "IP
  version 6 address information must be specified inside [] in the mynetworks value".
  A client matches when its address and the pattern's agree in the netmask's leading
  bits.  The SMTP server takes an IPv4-mapped client address (``::ffff:a.b.c.d``) for
  the IPv4 address it carries, so a mapped pattern covers the IPv4 network within it.
* ``relay_domains``: "What destination domains (and subdomains thereof) this system will
  relay mail to ... Pattern matching of domain names is controlled by the presence or
  absence of "relay_domains" in the parent_domain_matches_subdomains parameter value."
  ``parent_domain_matches_subdomains``: "A list of Postfix features where the pattern
  "example.com" also matches subdomains of example.com, instead of requiring an explicit
  ".example.com" pattern ... eventually, all Postfix features are expected to require
  explicit ".example.com" style patterns".  The relay takes that explicit form (Postfix's
  default still lists relay_domains there): ``d`` is d alone, ``.d`` its subdomains.
  Domain names compare without case and without a trailing dot; a U-label and its
  A-label (``bücher`` and ``xn--bcher-kva``) are one label (RFC 5890), compared here as
  the stdlib's IDNA 2003 ToASCII gives them.
* ``reject_unauth_destination``: "Reject the request unless ... the resolved RCPT TO
  domain matches $relay_domains or a subdomain thereof, and contains no sender-specified
  routing (user@elsewhere@domain)"; ``allow_untrusted_routing`` (default no): "Forward
  mail with sender-specified routing (user[@%!]remote[@%!]site) from untrusted clients
  to destinations matching $relay_domains."  ``permit_mynetworks`` comes first.
"""

from __future__ import annotations

import encodings.idna
import ipaddress
import smtplib
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_ref.relay.relay_access import RelayAccess
from queue_ref.relay.relay_config import ConfigError
from tests.relay_support import RelayThread, relay_config

# ---- the reference ----


def ref_network(pattern: str) -> tuple[int, int, int]:
    """(version, network bits as an int, prefix length) of a mynetworks pattern."""
    text = pattern.replace("[", "").replace("]", "")
    addr_s, _, length_s = text.partition("/")
    addr = ipaddress.ip_address(addr_s)
    bits = 32 if addr.version == 4 else 128
    length = int(length_s) if length_s else bits
    value = int(addr)
    if addr.version == 6 and length >= 96 and value >> 32 == 0xFFFF:  # ::ffff:a.b.c.d
        return 4, value & 0xFFFFFFFF, length - 96
    return addr.version, value, length


def ref_trusted(client: str, mynetworks: list[str]) -> bool:
    addr = ipaddress.ip_address(client.split("%")[0])
    version, value = addr.version, int(addr)
    if version == 6 and value >> 32 == 0xFFFF:
        version, value = 4, value & 0xFFFFFFFF
    bits = 32 if version == 4 else 128
    for pattern in mynetworks:
        v, net, length = ref_network(pattern)
        if v == version and value >> (bits - length) == net >> (bits - length):
            return True
    return False


def ref_domain(name: str) -> str:
    return ".".join(encodings.idna.ToASCII(label).decode("ascii").lower()
                    for label in name.rstrip(".").split("."))


def ref_relay_domain(domain: str, relay_domains: list[str]) -> bool:
    name = ref_domain(domain)
    for entry in relay_domains:
        if entry.startswith("."):
            if name.endswith("." + ref_domain(entry[1:])):
                return True
        elif name == ref_domain(entry):
            return True
    return False


def ref_permits(client: str, rcpt: str, mynetworks: list[str],
                relay_domains: list[str]) -> bool:
    if ref_trusted(client, mynetworks):  # permit_mynetworks
        return True
    local, _, domain = rcpt.rpartition("@")
    routed = any(c in local for c in "@%!")
    return ref_relay_domain(domain, relay_domains) and not routed  # reject_unauth_destination


# ---- strategies ----

IPV4 = st.ip_addresses(v=4).map(str)
IPV6 = st.ip_addresses(v=6).map(str)


@st.composite
def client_and_networks(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A client address (IPv4, IPv6, IPv4-mapped, with a zone) and mynetworks patterns,
    some of them built around the client so that both answers come up."""
    kind = draw(st.sampled_from(["v4", "v6", "mapped", "zone", "loopback"]))
    if kind == "v4":
        client = draw(IPV4)
    elif kind == "v6":
        client = draw(IPV6)
    elif kind == "mapped":
        client = "::ffff:" + draw(IPV4)
    elif kind == "zone":
        client = "fe80::" + format(draw(st.integers(1, 0xFFFF)), "x") + "%eth0"
    else:
        client = draw(st.sampled_from(["127.0.0.1", "::1", "::ffff:127.0.0.1"]))
    addr = ipaddress.ip_address(client.split("%")[0])
    near = addr.ipv4_mapped if addr.version == 6 and addr.ipv4_mapped else addr

    def around(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> st.SearchStrategy[str]:
        bits = 32 if a.version == 4 else 128
        return st.integers(0, bits).flatmap(lambda n: st.sampled_from(_forms(a, n)))

    pattern = st.one_of(
        around(near), around(addr),
        IPV4.flatmap(lambda a: around(ipaddress.ip_address(a))),
        IPV6.flatmap(lambda a: around(ipaddress.ip_address(a))),
        st.sampled_from(["0.0.0.0/0", "::/0", "[::]/0", "127.0.0.0/8", "[::1]/128", "::1",
                         "[::ffff:127.0.0.0]/104", "10.0.0.0/8", "fe80::/10"]))
    return client, draw(st.lists(pattern, max_size=4))


def _forms(a: ipaddress.IPv4Address | ipaddress.IPv6Address, length: int) -> list[str]:
    """Ways to write the network of ``length`` bits around ``a`` (host bits kept in some:
    both Postfix and the relay ignore them), and its IPv4-mapped form."""
    net = ipaddress.ip_network(f"{a}/{length}", strict=False)
    if a.version == 4:
        mapped = f"[::ffff:{net.network_address}]/{length + 96}"
        forms = [f"{net.network_address}/{length}", f"{a}/{length}", mapped]
        return forms + ([str(a)] if length == 32 else [])
    forms = [f"[{net.network_address}]/{length}", f"{net.network_address}/{length}",
             f"[{a}]/{length}"]
    return forms + ([f"[{a}]"] if length == 128 else [])


BASES = ["example.org", "example.com", "mail.example.org", "bücher.example",
         "xn--bcher-kva.example", "a.b.c"]
LOOKALIKES = ["example.org.evil.com", "evil-example.org", "xexample.org", "example.org.",
              "sub.example.org", "a.sub.example.org", "example.orgx", "org", "evil.com",
              "BÜCHER.example", "sub.bücher.example", "sub.xn--bcher-kva.example",
              "bucher.example", "example.com.", "b.c", "x.a.b.c"]


def _case(draw: st.DrawFn, text: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if f else c for c, f in zip(text, flips, strict=True))


@st.composite
def domains_and_rcpt(draw: st.DrawFn) -> tuple[list[str], str]:
    """relay_domains entries (exact and leading-dot, any case, a trailing dot, U-labels
    and A-labels) and a recipient whose domain is near them (equal, a subdomain, a
    look-alike), its local part now and then with sender-specified routing."""
    entries = []
    for base in draw(st.lists(st.sampled_from(BASES), max_size=3)):
        entry = draw(st.sampled_from(["", "."])) + _case(draw, base)
        entries.append(entry + draw(st.sampled_from(["", "."])))
    domain = draw(st.one_of(
        st.sampled_from(BASES + LOOKALIKES),
        st.sampled_from(BASES).map(lambda b: "x." + b),
        st.sampled_from(BASES).map(lambda b: b + ".evil.com"),
        st.sampled_from(BASES).map(lambda b: "evil" + b)))
    domain = _case(draw, domain)
    local = draw(st.sampled_from(["bob", "Bob.Smith", "bob%evil.com", "evil.com!bob",
                                  "a+tag", "x%y"]))
    return entries, f"{local}@{domain}"


# ---- the decision function against the reference ----


@given(client_and_networks())
def test_trusted_matches_postfix_mynetworks(case: tuple[str, list[str]]) -> None:
    client, networks = case
    access = RelayAccess(networks, [])
    assert access.trusted(client) == ref_trusted(client, networks), (client, networks)


@given(domains_and_rcpt())
def test_relay_domain_matches_postfix_relay_domains(case: tuple[list[str], str]) -> None:
    entries, rcpt = case
    access = RelayAccess([], entries)
    domain = rcpt.rpartition("@")[2]
    assert access.relay_domain(domain) == ref_relay_domain(domain, entries), (entries, domain)


@given(client_and_networks(), domains_and_rcpt())
def test_permits_matches_permit_mynetworks_reject_unauth_destination(
        clients: tuple[str, list[str]], domains: tuple[list[str], str]) -> None:
    client, networks = clients
    entries, rcpt = domains
    got = RelayAccess(networks, entries).permits(client, rcpt)
    assert got == ref_permits(client, rcpt, networks, entries), (client, networks, entries, rcpt)


def test_examples_of_the_reference() -> None:
    """Pinned answers, so that the reference itself cannot drift."""
    assert ref_trusted("::ffff:127.0.0.1", ["127.0.0.0/8"])
    assert ref_trusted("127.0.0.1", ["[::ffff:127.0.0.0]/104"])
    assert not ref_trusted("::1", ["0.0.0.0/0"]) and ref_trusted("::1", ["[::]/0"])
    assert not ref_trusted("192.0.2.1", [])
    assert ref_relay_domain("x.example.org", [".example.org"])
    assert not ref_relay_domain("example.org", [".example.org"])
    assert not ref_relay_domain("example.org.evil.com", ["example.org", ".example.org"])
    assert not ref_relay_domain("evil-example.org", [".example.org"])
    assert ref_relay_domain("XN--BCHER-KVA.example", ["Bücher.example."])
    assert not ref_permits("192.0.2.1", "bob%evil.com@example.org", [], ["example.org"])


def test_bad_entries_are_refused_with_their_name() -> None:
    for networks, match in [(["nonsense"], "nonsense"), (["[::1"], r"\[::1"),
                            (["10.0.0.0/33"], "10.0.0.0/33"), (["!10.0.0.0/8"], "!10")]:
        with pytest.raises(ConfigError, match=f"mynetworks: .*{match}"):
            relay_config("/tmp/q", mynetworks=networks)
    for domains in (["a..b"], ["."], [""], ["x" * 64 + ".example"]):
        with pytest.raises(ConfigError, match=r"relay_domains: .*not a domain name"):
            relay_config("/tmp/q", relay_domains=domains)
    cfg = relay_config("/tmp/q", mynetworks=["[::1]/128", "[2001:db8::]/32", "[::1]"],
                       relay_domains=["Example.ORG.", ".bücher.example"])
    assert cfg.mynetworks == ["[::1]/128", "[2001:db8::]/32", "[::1]"]


# ---- over SMTP ----


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# (client, mynetworks, relay_domains, MAIL options, recipient, code)
E2E = [
    ("127.0.0.1", ["192.0.2.0/24"], ["example.org"], [], "bob@example.org", 250),
    ("127.0.0.1", ["192.0.2.0/24"], ["example.org"], [], "bob@example.org.evil.com", 554),
    ("127.0.0.1", ["192.0.2.0/24"], [".example.org"], [], "bob@evil-example.org", 554),
    ("127.0.0.1", ["192.0.2.0/24"], ["example.org"], [], "bob%evil.com@example.org", 554),
    ("127.0.0.1", ["[::ffff:127.0.0.0]/104"], [], [], "bob@anywhere.test", 250),
    ("127.0.0.1", ["::/0"], [], [], "bob@anywhere.test", 554),
    ("127.0.0.1", [], ["xn--bcher-kva.example"], ["SMTPUTF8"], "bob@Bücher.example", 250),
    ("::1", ["[::1]/128"], [], [], "bob@anywhere.test", 250),
    ("::1", ["127.0.0.0/8", "0.0.0.0/0"], [], [], "bob@anywhere.test", 554),
    ("::1", ["127.0.0.0/8"], ["Bücher.example."], [], "bob@XN--BCHER-KVA.example", 250),
    ("::1", ["2001:db8::/32"], [".example.org"], [], "bob@example.org", 554),
]


@pytest.mark.parametrize(("client", "networks", "domains", "options", "rcpt", "code"), E2E)
def test_relay_access_over_smtp(tmp_path: Path, client: str, networks: list[str],
                                domains: list[str], options: list[str], rcpt: str,
                                code: int) -> None:
    if client == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    assert ref_permits(client, rcpt, networks, domains) == (code == 250)
    listen = "[::1]:0" if client == "::1" else "127.0.0.1:0"
    cfg = relay_config(str(tmp_path / "q"), listen=listen, mynetworks=networks,
                       relay_domains=domains, relayhost="[127.0.0.1]:9")
    with RelayThread(cfg) as r, smtplib.SMTP(client, r.port, timeout=10) as c:
        c.ehlo("client.test")
        assert c.mail("alice@example.net", options)[0] == 250
        if "SMTPUTF8" in options:
            c.command_encoding = "utf-8"
        got, msg = c.rcpt(rcpt)
        assert got == code, msg
        if code == 554:
            assert msg == f"5.7.1 <{rcpt}>: Relay access denied".encode()
