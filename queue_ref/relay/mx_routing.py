"""Where a recipient's mail goes (Postfix's trivial-rewrite and the smtp client's DNS).

In order: the static transport map (exact domain, then ``.parent`` entries), the
relayhost, then DNS.  A next hop written ``[host]:port`` is used as it is; without
brackets its MX records are looked up, as Postfix does.

DNS (dnspython's async resolver; nameserver and port configurable):

* MX records by preference, in random order among equal preferences (RFC 5321 5.1);
* no MX record: the domain's own A/AAAA records (implicit MX);
* a null MX (one record ``0 .``, RFC 7505) or NXDOMAIN: a permanent failure, bounced at once;
* SERVFAIL, a timeout, or no usable address for any MX: a temporary failure, deferred.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver

from queue_ref.relay.relay_config import RelayConfig, parse_hostport

__all__ = ["Nexthop", "Route", "Router"]


@dataclass(frozen=True)
class Nexthop:
    """One address to connect to; ``name`` is the host's name for logs and certificate
    checks, ``destination`` the route's (the TLS policy and SASL lookup key)."""

    name: str
    address: str
    port: int
    destination: str = ""

    def __str__(self) -> str:
        return f"{self.name}[{self.address}]:{self.port}"


@dataclass
class Route:
    """Addresses to try in order, or a failure: ``dsn`` 4.x.x defers, 5.x.x bounces."""

    destination: str  # the key of per-destination concurrency and connection reuse
    hosts: list[Nexthop] = field(default_factory=list)
    dsn: str = ""
    reason: str = ""

    @property
    def failed(self) -> bool:
        return not self.hosts


def _ip(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class Router:
    def __init__(self, config: RelayConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()
        if config.dns_nameservers:
            self.resolver = dns.asyncresolver.Resolver(configure=False)
            self.resolver.nameservers = list(config.dns_nameservers)
        else:
            try:
                self.resolver = dns.asyncresolver.Resolver()
            except dns.resolver.NoResolverConfiguration:
                self.resolver = dns.asyncresolver.Resolver(configure=False)
                self.resolver.nameservers = ["127.0.0.1"]
        self.resolver.port = config.dns_port
        self.resolver.timeout = config.dns_timeout
        self.resolver.lifetime = config.dns_timeout
        self._relayhost = (parse_hostport(config.relayhost, "relayhost", config.smtp_port)
                           if config.relayhost else None)
        self._transport = {d: parse_hostport(v, f"transport_maps.{d}", config.smtp_port)
                           for d, v in config.transport_maps.items()}

    def nexthop_for(self, domain: str) -> tuple[str, int, bool] | None:
        """The configured next hop of ``domain`` (transport map, then relayhost), if any."""
        domain = domain.lower().rstrip(".")
        if domain in self._transport:
            return self._transport[domain]
        parts = domain.split(".")
        for i in range(1, len(parts)):
            parent = "." + ".".join(parts[i:])
            if parent in self._transport:
                return self._transport[parent]
        return self._relayhost

    def destination_of(self, domain: str) -> str:
        """The name deliveries to ``domain`` share limits and connections under."""
        hop = self.nexthop_for(domain)
        if hop is None:
            return domain.lower().rstrip(".")
        host, port, bracketed = hop
        return f"[{host}]:{port}" if bracketed else f"{host}:{port}"

    async def route(self, domain: str) -> Route:
        dest = self.destination_of(domain)
        hop = self.nexthop_for(domain)
        if hop is not None:
            host, port, bracketed = hop
            if bracketed or _ip(host):
                return await self._hosts(dest, [host], port)
            return await self._mx(dest, host, port)
        if domain.startswith("[") and domain.endswith("]"):
            inner = domain[1:-1]
            if inner[:5].lower() == "ipv6:":  # the tag in any case (domains come lower-cased)
                inner = inner[5:]
            literal = _ip(inner)
            if literal is None:
                return Route(dest, dsn="5.1.2", reason=f"bad address literal {domain}")
            return Route(dest, [Nexthop(literal, literal, self.config.smtp_port, dest)])
        return await self._mx(dest, domain, self.config.smtp_port)

    async def _mx(self, dest: str, domain: str, port: int) -> Route:
        try:
            answer = await self.resolver.resolve(domain, "MX", search=False)
        except dns.resolver.NXDOMAIN:
            return Route(dest, dsn="5.1.2",
                         reason=f"Host or domain name not found. Name service error for "
                                f"name={domain} type=MX: Host not found")
        except dns.resolver.NoAnswer:
            return await self._hosts(dest, [domain], port, implicit=True)
        except (dns.resolver.NoNameservers, dns.exception.Timeout) as e:
            return Route(dest, dsn="4.4.3",
                         reason=f"Host or domain name not found. Name service error for "
                                f"name={domain} type=MX: {_dns_reason(e)}")
        except dns.exception.DNSException as e:
            return Route(dest, dsn="4.4.3", reason=f"DNS lookup of {domain} failed: {e}")
        records = [(r.preference, r.exchange) for r in answer]
        if any(ex == dns.name.root for _, ex in records):
            if len(records) == 1 and records[0][0] == 0:
                return Route(dest, dsn="5.1.10",
                             reason=f"Domain {domain} does not accept mail (nullMX)")
            records = [(p, ex) for p, ex in records if ex != dns.name.root]
        by_pref: dict[int, list[str]] = {}
        for pref, ex in records:
            by_pref.setdefault(pref, []).append(ex.to_text(omit_final_dot=True))
        names: list[str] = []
        for pref in sorted(by_pref):
            group = by_pref[pref]
            self._rng.shuffle(group)
            names.extend(group)
        return await self._hosts(dest, names, port)

    async def _hosts(self, dest: str, names: list[str], port: int,
                     implicit: bool = False) -> Route:
        hosts: list[Nexthop] = []
        reasons: list[str] = []
        not_found = 0
        limit = self.config.smtp_mx_address_limit
        for name in names:
            literal = _ip(name)
            if literal is not None:
                hosts.append(Nexthop(literal, literal, port, dest))
            else:
                found = 0
                for rdtype in ("A", "AAAA"):
                    try:
                        answer = await self.resolver.resolve(name, rdtype, search=False)
                    except dns.resolver.NXDOMAIN:
                        not_found += 1
                        reasons.append(f"{name}: Host not found")
                        break
                    except dns.resolver.NoAnswer:
                        continue
                    except dns.exception.DNSException as e:
                        reasons.append(f"{name} type={rdtype}: {_dns_reason(e)}")
                        continue
                    for r in answer:
                        hosts.append(Nexthop(name, r.to_text(), port, dest))
                        found += 1
                if not found and not reasons:
                    not_found += 1
                    reasons.append(f"{name}: no A or AAAA record")
            if len(hosts) >= limit:
                break
        if hosts:
            return Route(dest, hosts[:limit])
        if implicit and not_found == len(names):
            return Route(dest, dsn="5.4.4",
                         reason=f"Host or domain name not found. Name service error for "
                                f"name={names[0]} type=A: Host found but no data record of "
                                f"requested type")
        return Route(dest, dsn="4.4.3", reason="; ".join(reasons) or "no address for any MX host")


def _dns_reason(e: Exception) -> str:
    if isinstance(e, dns.exception.Timeout):
        return "Timeout while contacting DNS servers"
    if isinstance(e, dns.resolver.NoNameservers):
        return "Host not found, try again (SERVFAIL)"
    return str(e)
