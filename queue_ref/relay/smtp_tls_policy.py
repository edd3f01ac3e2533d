"""The SMTP client's TLS policy and SMTP AUTH credentials, per next hop (Postfix's
``smtp_tls_security_level``, ``smtp_tls_policy_maps`` and ``smtp_sasl_password_maps``).

Levels, as Postfix's: ``none`` (never STARTTLS), ``may`` (STARTTLS when offered, the
certificate not checked), ``encrypt`` (TLS required, the certificate not checked),
``verify`` and ``secure`` (TLS required, the certificate chain verified against
``smtp_tls_CAfile`` and one of its names matched: ``verify`` by default the MX host's
name, which DNS gave; ``secure`` the next-hop domain or its subdomains, which DNS cannot
forge).  A table entry's ``match`` names the names accepted instead: ``hostname``,
``nexthop``, ``dot-nexthop``, a name, or ``.domain`` for its subdomains.

Lookup keys of both tables, as Postfix forms them from the next hop: ``[host]:port``
(and ``[host]`` when the port is ``smtp_port``) for a bracketed next hop, ``host:port``
(and ``host``) for an unbracketed one, otherwise the recipient domain and then
``.parent`` entries; the password table is looked up by the MX host's name last.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from queue_ref.relay.config_values import ConfigError, parse_hostport

__all__ = ["MATCH_DEFAULTS", "TLS_LEVELS", "TlsPolicies", "TlsPolicy", "cert_names",
           "lookup_keys", "parse_match", "parse_policy"]

#: smtp_tls_security_level values, weakest first
TLS_LEVELS = ("none", "may", "encrypt", "verify", "secure")
#: Postfix's smtp_tls_verify_cert_match and smtp_tls_secure_cert_match defaults
MATCH_DEFAULTS = {"verify": ("hostname",), "secure": ("nexthop", "dot-nexthop")}
_NAME = re.compile(r"\.?[A-Za-z0-9_*](?:[A-Za-z0-9_.*-]*[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]+\]?")


@dataclass(frozen=True)
class TlsPolicy:
    """A level and, for ``verify`` and ``secure``, the names the certificate may carry."""

    level: str
    match: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.level in ("encrypt", "verify", "secure")

    @property
    def verified(self) -> bool:
        return self.level in ("verify", "secure")


def parse_match(value: object, key: str) -> tuple[str, ...]:
    """``"nexthop:dot-nexthop"`` (Postfix's separators: colon, comma, space) or a list."""
    if isinstance(value, str):
        items = [v for v in re.split(r"[\s,:]+", value) if v]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise ConfigError(f"{key}: expected names like \"nexthop:dot-nexthop\", got {value!r}")
    if not items:
        raise ConfigError(f"{key}: no name to match")
    for item in items:
        if item not in ("hostname", "nexthop", "dot-nexthop") and not _NAME.fullmatch(item):
            raise ConfigError(f"{key}: {item!r} is not hostname, nexthop, dot-nexthop or a name")
    return tuple(i.lower() for i in items)


def parse_policy(value: object, key: str, default_match: Mapping[str, tuple[str, ...]]
                 ) -> TlsPolicy:
    """A policy table's value: a level, or a table ``{ level = "...", match = "..." }``."""
    match: object = None
    if isinstance(value, dict):
        unknown = set(value) - {"level", "match"}
        if unknown:
            raise ConfigError(f"{key}: unknown field {sorted(unknown)[0]!r} (level, match)")
        level, match = value.get("level"), value.get("match")
    else:
        level = value
    if level not in TLS_LEVELS:
        raise ConfigError(f"{key}: expected a level ({', '.join(TLS_LEVELS)}), got {level!r}")
    assert isinstance(level, str)
    if match is None:
        return TlsPolicy(level, default_match.get(level, ()))
    if level not in ("verify", "secure"):
        raise ConfigError(f"{key}: match is for the verify and secure levels only")
    return TlsPolicy(level, parse_match(match, f"{key}.match"))


def check_table_key(dest: str, table: str) -> str:
    """A table key as Postfix writes next hops (``[host]:port``, ``host``, ``.domain``),
    lower-cased; ConfigError otherwise."""
    key = dest.strip().lower()
    where = f"{table}: key {dest!r}"
    if not key:
        raise ConfigError(f"{where}: empty")
    if key.startswith("["):
        parse_hostport(key, where, 25)
    elif not _NAME.fullmatch(key.partition(":")[0]) or "*" in key:
        raise ConfigError(f"{where}: expected [host]:port, host, domain or .domain")
    elif ":" in key:
        parse_hostport(key, where, 25)
    return key


def lookup_keys(destination: str, default_port: int) -> list[str]:
    """The keys a next hop is looked up by, most specific first.  ``destination`` is the
    route's: ``[host]:port``, ``host:port`` or a recipient domain."""
    dest = destination.lower()
    if dest.startswith("["):
        host, port, _ = parse_hostport(dest, "destination", default_port)
        return [dest] + ([f"[{host}]"] if port == default_port else [])
    if ":" in dest:
        host, port, _ = parse_hostport(dest, "destination", default_port)
        keys = [dest]
        if port != default_port:
            return keys
        dest = host
    else:
        keys = []
    keys.append(dest)
    labels = dest.split(".")
    keys += ["." + ".".join(labels[i:]) for i in range(1, len(labels))]
    return keys


def nexthop_name(destination: str) -> str:
    """The next-hop domain of a route's destination (what ``nexthop`` matches)."""
    dest = destination.lower()
    if dest.startswith("[") or ":" in dest:
        return parse_hostport(dest, "destination", 25)[0]
    return dest


def cert_names(cert: Mapping[str, Any]) -> list[str]:
    """The DNS names (and IP addresses) a verified peer certificate
    (``SSLSocket.getpeercert()``) is for: its subjectAltName entries, or its subject's
    CN when it has no DNS name."""
    names = [str(v).lower() for k, v in cert.get("subjectAltName", ())
             if k in ("DNS", "IP Address")]
    if not any(k == "DNS" for k, _ in cert.get("subjectAltName", ())):
        for rdn in cert.get("subject", ()):
            names += [str(v).lower() for k, v in rdn if k == "commonName"]
    return names


def _name_matches(cert_name: str, want: str) -> bool:
    """``want`` is a host name, or ``.domain`` for any name below the domain; a cert name
    ``*.d`` stands for one label in front of ``d``."""
    cert_name, want = cert_name.rstrip("."), want.rstrip(".")
    if want.startswith("."):
        if cert_name.startswith("*."):
            return cert_name[1:].endswith(want)
        return cert_name.endswith(want) and len(cert_name) > len(want)
    if cert_name.startswith("*."):
        label, dot, rest = want.partition(".")
        return bool(dot and label) and rest == cert_name[2:]
    try:
        return ipaddress.ip_address(want) == ipaddress.ip_address(cert_name)
    except ValueError:
        return cert_name == want


class TlsSettings(Protocol):
    """The settings the client's TLS policy reads (``RelayConfig`` has them; a protocol, so
    that ``RelayConfig.validate`` can check them here without an import circle)."""

    smtp_port: int
    smtp_sasl_auth_enable: bool
    smtp_sasl_password_maps: dict[str, str]
    smtp_tls_CAfile: str
    smtp_tls_policy_maps: dict[str, Any]
    smtp_tls_secure_cert_match: str
    smtp_tls_verify_cert_match: str
    smtp_tls_security_level: str


class TlsPolicies:
    """The client's policy per next hop, its SSL contexts and its SASL credentials."""

    def __init__(self, config: TlsSettings) -> None:
        self.config = config
        defaults = {**MATCH_DEFAULTS,
                    "verify": parse_match(config.smtp_tls_verify_cert_match,
                                          "smtp_tls_verify_cert_match"),
                    "secure": parse_match(config.smtp_tls_secure_cert_match,
                                          "smtp_tls_secure_cert_match")}
        self.default = parse_policy(config.smtp_tls_security_level, "smtp_tls_security_level",
                                    defaults)
        self.table = {check_table_key(k, "smtp_tls_policy_maps"):
                      parse_policy(v, f"smtp_tls_policy_maps.{k}", defaults)
                      for k, v in config.smtp_tls_policy_maps.items()}
        self.passwords: dict[str, tuple[str, str]] = {}
        for k, v in config.smtp_sasl_password_maps.items():
            user, sep, password = v.partition(":")
            if not sep or not user:
                raise ConfigError(f"smtp_sasl_password_maps.{k}: expected \"user:password\"")
            self.passwords[check_table_key(k, "smtp_sasl_password_maps")] = (user, password)
        self._plain: ssl.SSLContext | None = None
        self._verifying: ssl.SSLContext | None = None

    def policy(self, destination: str) -> TlsPolicy:
        for key in lookup_keys(destination, self.config.smtp_port):
            found = self.table.get(key)
            if found is not None:
                return found
        return self.default

    def credentials(self, destination: str, host_name: str) -> tuple[str, str] | None:
        """(user, password) for this next hop, when ``smtp_sasl_auth_enable`` is on."""
        if not self.config.smtp_sasl_auth_enable:
            return None
        for key in [*lookup_keys(destination, self.config.smtp_port), host_name.lower()]:
            found = self.passwords.get(key)
            if found is not None:
                return found
        return None

    def context(self, policy: TlsPolicy) -> ssl.SSLContext:
        """``may`` and ``encrypt``: no check; ``verify`` and ``secure``: the chain checked
        against ``smtp_tls_CAfile`` (the system's CAs when it is empty), names by
        ``mismatch`` after the handshake."""
        if policy.verified:
            if self._verifying is None:
                ctx = ssl.create_default_context(cafile=self.config.smtp_tls_CAfile or None)
                ctx.check_hostname = False  # several names may do: mismatch() decides
                ctx.verify_mode = ssl.CERT_REQUIRED
                self._verifying = ctx
            return self._verifying
        if self._plain is None:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            self._plain = ctx
        return self._plain

    def mismatch(self, policy: TlsPolicy, destination: str, host_name: str,
                 cert: Mapping[str, Any] | None) -> str | None:
        """None when the verified certificate ``cert`` carries a name ``policy`` accepts;
        otherwise why not."""
        if not policy.verified:
            return None
        names = cert_names(cert or {})
        nexthop = nexthop_name(destination)
        wanted = []
        for m in policy.match:
            if m == "hostname":
                wanted.append(host_name.lower())
            elif m == "nexthop":
                wanted.append(nexthop)
            elif m == "dot-nexthop":
                wanted.append("." + nexthop)
            else:
                wanted.append(m)
        if any(_name_matches(n, w) for n in names for w in wanted):
            return None
        return (f"certificate names {', '.join(names) or '(none)'} match none of "
                f"{', '.join(wanted)}")
