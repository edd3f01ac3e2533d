"""Relay access: which client may send to which recipient (Postfix's ``permit_mynetworks,
reject_unauth_destination``), apart from the SMTP session so that it can be checked alone.

* A client is trusted when its address lies in a ``mynetworks`` network.  An IPv4-mapped
  IPv6 address (``::ffff:192.0.2.1``) is the IPv4 address it carries, and a network
  written in that form (Postfix's ``[::ffff:127.0.0.0]/104``) the IPv4 network it covers;
  a zone (``fe80::1%eth0``) is ignored.  IPv6 networks may be written with brackets, as
  Postfix requires (``[::1]/128``), or without.
* A recipient domain is a relay domain when it equals an entry ``d`` of
  ``relay_domains`` or, for an entry ``.d``, ends in ``.d``: Postfix's matching with
  ``relay_domains`` left out of ``parent_domain_matches_subdomains``, the explicit form
  postconf(5) says all features will eventually require.  Domains compare without case,
  without a trailing dot, and in A-label form (``bücher.example`` is
  ``xn--bcher-kva.example``), the name the delivery looks up in the DNS.
* A trusted client may send anywhere; any other only to a relay domain, and only when
  the local part has no sender-specified routing (``%`` or ``!``: ``user%elsewhere@d``),
  as Postfix's ``allow_untrusted_routing = no``: the next hop might forward it on.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Sequence

import dns.exception
import dns.name

__all__ = ["RelayAccess", "canonical_domain", "parse_network"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_MAPPED = ipaddress.ip_network("::ffff:0:0/96")


def parse_network(text: str) -> Network:
    """A ``mynetworks`` entry: ``192.0.2.0/24``, ``192.0.2.1``, ``2001:db8::/32``,
    ``[2001:db8::]/32``, ``[::1]``.  Host bits are ignored (``192.0.2.1/24`` is
    ``192.0.2.0/24``).  Raises ValueError naming the entry."""
    raw = text.strip()
    body = raw
    if body.startswith("["):
        end = body.find("]")
        if end < 0 or (body[end + 1:] and not body[end + 1:].startswith("/")):
            raise ValueError(f"{text!r} is not a network: expected [address]/length")
        body = body[1:end] + body[end + 1:]
    try:
        net: Network = ipaddress.ip_network(body, strict=False)
    except ValueError as e:
        raise ValueError(f"{text!r} is not a network ({e})") from None
    if net.version == 6 and net.prefixlen >= 96 and net.subnet_of(_MAPPED):  # type: ignore[arg-type]
        mapped = net.network_address.ipv4_mapped
        assert mapped is not None
        net = ipaddress.ip_network(f"{mapped}/{net.prefixlen - 96}")
    return net


def canonical_domain(domain: str) -> str:
    """``domain`` as relay access compares it: lower case, no trailing dot, A-labels.
    Raises ValueError when it is no domain name (an empty label, a label the IDNA
    encoding refuses, too long)."""
    name = domain.strip()
    if name.endswith("."):
        name = name[:-1]
    if not name or ".." in name or name.startswith("."):
        raise ValueError(f"{domain!r} is not a domain name")
    if name.isascii():
        if len(name) > 63 and (len(name) > 253
                               or any(len(label) > 63 for label in name.split("."))):
            raise ValueError(f"{domain!r} is not a domain name (a label over 63 octets "
                             "or a name over 253)")
        return name.lower()
    try:  # the name the resolver looks up (dnspython's IDNA codec)
        return dns.name.from_text(name).to_text(omit_final_dot=True).lower()
    except dns.exception.DNSException as e:
        raise ValueError(f"{domain!r} is not a domain name ({e})") from None


class RelayAccess:
    """The decision for one configuration (``mynetworks``, ``relay_domains``)."""

    def __init__(self, mynetworks: Sequence[str], relay_domains: Sequence[str]) -> None:
        """Raises ValueError naming a bad entry."""
        self.networks = [parse_network(n) for n in mynetworks]
        exact: set[str] = set()
        parents: list[str] = []
        for entry in relay_domains:
            if entry.strip().startswith("."):
                parents.append("." + canonical_domain(entry.strip()[1:]))
            else:
                exact.add(canonical_domain(entry))
        self._exact = frozenset(exact)
        self._parents = tuple(parents)
        # client address -> trusted (ipaddress parsing per RCPT cost 2 us)
        self.trusted = functools.lru_cache(maxsize=4096)(self._trusted)

    def _trusted(self, host: str) -> bool:
        """Whether a client at ``host`` (its IP address as the socket gives it) is in
        ``mynetworks``; anything that is no IP address is not."""
        try:
            addr = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if addr.version == 6 and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in n for n in self.networks if n.version == addr.version)

    def relay_domain(self, domain: str) -> bool:
        """Whether anyone may send to ``domain``."""
        try:
            name = canonical_domain(domain)
        except ValueError:
            return False
        return name in self._exact or name.endswith(self._parents)

    def permits(self, host: str, address: str) -> bool:
        """Whether a client at ``host`` may send to ``address`` (``local@domain``)."""
        if self.trusted(host):
            return True
        local, _, domain = address.rpartition("@")
        return self.relay_domain(domain) and not any(c in local for c in "%!@")
