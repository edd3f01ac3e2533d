"""The relay's configuration: a TOML file read with ``tomllib``, Postfix's names and defaults.

Every key has a default, so ``queue-ref relay --queue DIR`` runs with no file.  Durations
are seconds, or strings with a unit (``"300s"``, ``"15m"``, ``"4h"``, ``"5d"``).  Unknown
keys are refused (a typo must not silently leave a default in force).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import importlib.util
import ipaddress
import os
import re
import socket
import ssl
import tomllib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from queue_ref.opener import BACKENDS
from queue_ref.relay.config_values import ConfigError, parse_duration, parse_hostport
from queue_ref.relay.relay_access import canonical_domain, parse_network

__all__ = ["EVENT_LOOPS", "ConfigError", "RelayConfig", "default_myhostname", "load_config",
           "loop_kind", "new_event_loop", "parse_duration", "parse_hostport", "run_relay"]

#: the event loops a relay process can run on (``event_loop``)
EVENT_LOOPS = ("auto", "uvloop", "asyncio")



_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(?:\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _check_nexthop(value: str, key: str, default_port: int) -> None:
    """A next hop (``relayhost``, a ``transport_maps`` value) names a host by a host name
    or an IP address, and a port at most once; ConfigError otherwise (a typo would
    otherwise defer every message until it bounces)."""
    host, _, bracketed = parse_hostport(value, key, default_port)
    if not bracketed and value.strip().count(":") > 1:
        raise ConfigError(f"{key}: {value!r}: give the port once, and an IPv6 address in "
                          "brackets ([2001:db8::1]:25)")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return
    if not _HOSTNAME.fullmatch(host) or len(host) > 253:
        raise ConfigError(f"{key}: {host!r} in {value!r} is neither a host name (letters, "
                          "digits and hyphens in dot-separated labels) nor an IP address")


def default_myhostname(mydomain: str = "") -> str:
    """Postfix's default ``myhostname``: the name ``gethostname()`` gives, with
    ``.mydomain`` (``.localdomain`` when that is unset) when it has no dot.  Not
    ``socket.getfqdn()``: on a host whose name does not resolve, that is "localhost"."""
    name = socket.gethostname()
    return name if "." in name else f"{name}.{mydomain or 'localdomain'}"


#: The project's backends whose store one process holds (no ``Capability.MULTI_PROCESS``):
#: with ``processes`` > 1 each worker serves one root (``relay_master``).
UNSHARED_BACKENDS = ("kv-log", "kv-leveldb")


def split_roots_problem(backend: str, processes: int, roots: int, odmr: bool,
                        ondemand: bool) -> str | None:
    """Why ``processes`` workers cannot each serve one of ``roots`` roots of a queue whose
    ``backend`` processes cannot share; None if they can."""
    if roots != processes:
        return (f"backend {backend} cannot be shared by several processes (no multi-process "
                f"capability): give the queue one root per process (queue_directories, or "
                f"--queue once per root: {processes} roots for processes = {processes}; now "
                f"{roots}), each served by one process, or run it with processes = 1")
    if odmr or ondemand:
        both = " and ".join(k for k, on in (("odmr_listen", odmr), ("ondemand_domains", ondemand))
                            if on)
        return (f"{both}: with backend {backend} each process serves one root of the queue, "
                f"while a domain held for an on-demand client is served from every root by "
                f"one process (ATRN hands the client all its mail over one connection; a "
                f"probe's success flushes the domain); run it with processes = 1, or on a "
                f"backend processes share (fs)")
    return None


@dataclass
class RelayConfig:
    """The effective configuration.  Names follow Postfix's main.cf where one exists."""

    # -- where --
    queue: str = ""
    #: Several roots of one queue (``queue_ref.multi_root``): mail spread over them.
    queue_directories: list[str] = field(default_factory=list)
    backend: str = "fs"
    listen: str = "127.0.0.1:2525"
    myhostname: str = ""  # "": gethostname(), with .mydomain when it has no dot
    mydomain: str = ""  # "": myhostname less its first label ("localdomain" if none)
    # -- receiver policy (smtpd) --
    mynetworks: list[str] = field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    relay_domains: list[str] = field(default_factory=list)
    message_size_limit: int = 10_240_000
    smtpd_recipient_limit: int = 1000
    smtpd_timeout: float = 300.0
    postmaster_recipient: str = ""  # where RCPT TO:<postmaster> goes; "": postmaster@myhostname
    hopcount_limit: int = 50  # Received: headers (ours counted) at which DATA gets 554 5.4.6
    smtpd_tls_cert_file: str = ""
    smtpd_tls_key_file: str = ""
    smtpd_tls_security_level: str = "may"  # none, may (STARTTLS with a certificate), encrypt
    smtpd_sasl_auth_enable: bool = False  # AUTH PLAIN and LOGIN; authenticated clients relay
    smtpd_sasl_password_file: str = ""  # user:$scrypt$... lines (smtpd_sasl_auth)
    smtpd_tls_auth_only: bool = True  # AUTH offered only after STARTTLS
    smtpd_auth_failure_limit: int = 5  # failed AUTHs per client within anvil_rate_time_unit
    anvil_rate_time_unit: float = 60.0
    # -- on-demand mail relay (RFC 2645; odmr_server) --
    odmr_listen: str = ""  # ATRN listener, e.g. "0.0.0.0:366"; "": none
    atrn_domains: dict[str, str] = field(default_factory=dict)  # domain -> user who may take it
    odmr_cram_md5_file: str = ""  # user:secret lines: AUTH CRAM-MD5 on the ODMR listener
    #: domains delivered by MX but often unreachable: deferred mail waits for a probe
    ondemand_domains: list[str] = field(default_factory=list)
    # -- routing --
    relayhost: str = ""
    transport_maps: dict[str, str] = field(default_factory=dict)
    dns_nameservers: list[str] = field(default_factory=list)  # empty: /etc/resolv.conf
    dns_port: int = 53
    dns_timeout: float = 5.0
    smtp_port: int = 25  # the port MX hosts are reached on
    smtp_mx_address_limit: int = 5
    # -- delivery (smtp client) --
    smtp_connect_timeout: float = 30.0
    smtp_timeout: float = 300.0
    smtp_tls_security_level: str = "may"  # none, may, encrypt, verify, secure (smtp_tls_policy)
    smtp_tls_CAfile: str = ""  # verify, secure: the CAs trusted (PEM); "": the system's
    smtp_tls_verify_cert_match: str = "hostname"
    smtp_tls_secure_cert_match: str = "nexthop:dot-nexthop"
    smtp_tls_policy_maps: dict[str, Any] = field(default_factory=dict)  # nexthop -> level
    smtp_sasl_auth_enable: bool = False
    smtp_sasl_password_maps: dict[str, str] = field(default_factory=dict)  # nexthop -> user:pw
    smtp_connection_cache_time_limit: float = 2.0
    smtp_line_length_limit: int = 998  # longer lines are folded on delivery; 0: never
    default_destination_concurrency_limit: int = 20
    max_deliveries: int = 100  # Postfix's default_process_limit
    # the most a DATA command waits while delivery to one of its recipient domains is
    # behind (a job for it waits for a delivery slot): mail comes in no faster than it
    # goes out; 0: never (Postfix's in_flow_delay; DeliveryScheduler.in_flow)
    in_flow_delay: float = 1.0
    # -- retries and bounces --
    minimal_backoff_time: float = 300.0
    maximal_backoff_time: float = 4000.0
    backoff_jitter: float = 0.1  # a retry comes up to this fraction of its delay early
    retry_delays: list[float] = field(default_factory=list)  # a fixed schedule instead
    maximal_queue_lifetime: float = 5 * 86400.0
    bounce_queue_lifetime: float = 5 * 86400.0
    delay_warning_time: float = 0.0  # 0: no "delayed" DSN
    double_bounce_recipient: str = ""  # where undeliverable bounces go; "": dropped
    bounce_size_limit: int = 50_000  # the returned message is attached up to this size
    # -- the process --
    processes: int = 1  # relay processes on the queue (receivers and schedulers) behind a master
    event_loop: str = "auto"  # uvloop, asyncio, or auto: uvloop where it is installed
    queue_scan_interval: float = 300.0  # Postfix's queue_run_delay: a full listing
    qmgr_message_active_limit: int = 20_000  # queued entries the scheduler holds at most
    shutdown_timeout: float = 10.0
    log_json: bool = False
    log_file: str = ""  # "": standard error
    metrics_listen: str = ""  # e.g. "127.0.0.1:9125"; "": no metrics

    def __post_init__(self) -> None:
        if not self.myhostname:
            self.myhostname = default_myhostname(self.mydomain)
        if not self.mydomain:
            self.mydomain = self.myhostname.partition(".")[2] or "localdomain"
        if not self.postmaster_recipient:
            self.postmaster_recipient = f"postmaster@{self.myhostname}"

    # ---- checks ----

    def warnings(self) -> list[str]:
        """What is valid but likely wrong: one line each (``--check-config`` prints them,
        the relay logs them at start)."""
        labels = self.myhostname.lower().rstrip(".").split(".")
        if len(labels) < 2:
            why = "is not a fully qualified domain name"
        elif "localhost" in (labels[0], labels[-1]) or labels[-1] == "localdomain":
            why = "is a local name, not a fully qualified domain name others resolve"
        else:
            return []
        return [f"myhostname: {self.myhostname!r} {why}; next hops see it in EHLO and "
                "Received (set myhostname, or mydomain)"]

    def queue_roots(self) -> list[str]:
        """The queue's directories, absolute: ``queue``, or every ``queue_directories``."""
        return [os.path.abspath(d) if d else d
                for d in ([self.queue] if self.queue else self.queue_directories)]

    def validate(self) -> RelayConfig:
        if self.queue and self.queue_directories:
            raise ConfigError("queue and queue_directories are both set: give one directory "
                              "in queue, or every root in queue_directories")
        if not self.queue and not self.queue_directories:
            raise ConfigError("queue: no queue directory (set it in the file or pass --queue)")
        roots = self.queue_roots()
        if any(not d for d in roots) or len(set(roots)) != len(roots):
            raise ConfigError(f"queue_directories: {self.queue_directories!r} has an empty or "
                              "repeated directory")
        self.listen_address()
        for name in ("mydomain", "myhostname"):  # a bad mydomain spoils the default name too
            if not _HOSTNAME.fullmatch(getattr(self, name)) or len(getattr(self, name)) > 253:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not a host name (letters, "
                                  "digits and hyphens in dot-separated labels of 1 to 63)")
        from queue_ref.relay.smtp_address import valid_address

        if not valid_address(self.postmaster_recipient):
            raise ConfigError(f"postmaster_recipient: {self.postmaster_recipient!r} is not an "
                              "address local@domain (where mail to <postmaster> goes)")
        for net in self.mynetworks:
            try:
                parse_network(net)
            except ValueError as e:
                raise ConfigError(f"mynetworks: {e}") from None
        for dom in self.relay_domains:
            try:
                canonical_domain(dom.strip().removeprefix("."))
            except ValueError as e:
                raise ConfigError(f"relay_domains: {e}") from None
        if self.relayhost:
            _check_nexthop(self.relayhost, "relayhost", self.smtp_port)
        for dom, nexthop in self.transport_maps.items():
            if not isinstance(nexthop, str):
                raise ConfigError(f"transport_maps.{dom}: expected a string like \"[host]:port\"")
            _check_nexthop(nexthop, f"transport_maps.{dom}", self.smtp_port)
        for ns in self.dns_nameservers:
            try:
                ipaddress.ip_address(ns)
            except ValueError:
                raise ConfigError(f"dns_nameservers: {ns!r} is not an IP address") from None
        if self.backend not in BACKENDS and ":" not in self.backend:
            raise ConfigError(f"backend: unknown {self.backend!r}: expected one of "
                              f"{', '.join(BACKENDS)} or package.module:factory")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"event_loop: expected one of {', '.join(EVENT_LOOPS)}, "
                              f"not {self.event_loop!r}")
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("event_loop: uvloop is not installed (pip install uvloop, or "
                              "set event_loop = \"asyncio\")")
        if bool(self.smtpd_tls_cert_file) != bool(self.smtpd_tls_key_file):
            raise ConfigError("smtpd_tls_cert_file and smtpd_tls_key_file go together")
        self._validate_tls_and_auth()
        for name in ("message_size_limit", "smtpd_recipient_limit", "hopcount_limit",
                     "default_destination_concurrency_limit", "max_deliveries",
                     "smtp_mx_address_limit", "processes", "qmgr_message_active_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if not 0 <= self.in_flow_delay <= 10:
            raise ConfigError(f"in_flow_delay: from 0 to 10 seconds, not {self.in_flow_delay}")
        if self.bounce_size_limit < 0:
            raise ConfigError("bounce_size_limit: must be at least 0 (0: headers only)")
        if self.smtp_line_length_limit != 0 and self.smtp_line_length_limit < 80:
            raise ConfigError("smtp_line_length_limit: 0 (no folding) or at least 80, not "
                              f"{self.smtp_line_length_limit}")
        if not 1 <= self.dns_port <= 65535 or not 1 <= self.smtp_port <= 65535:
            raise ConfigError("dns_port and smtp_port must be from 1 to 65535")
        if self.processes > 256:
            raise ConfigError(f"processes: at most 256 (got {self.processes})")
        if self.processes > 1 and self.backend in UNSHARED_BACKENDS:
            problem = split_roots_problem(self.backend, self.processes, len(self.queue_roots()),
                                          bool(self.odmr_listen), bool(self.ondemand_domains))
            if problem is not None:
                raise ConfigError(problem)
        if self.maximal_backoff_time < self.minimal_backoff_time:
            raise ConfigError("maximal_backoff_time is below minimal_backoff_time")
        if not 0 <= self.backoff_jitter < 1:
            raise ConfigError("backoff_jitter: must be at least 0 and below 1")
        if self.metrics_listen:
            host, _, _ = parse_hostport(self.metrics_listen, "metrics_listen", 0)
            if host not in ("127.0.0.1", "::1", "localhost"):
                raise ConfigError("metrics_listen: metrics are served on a loopback address only")
        return self

    def share(self, limit: int) -> int:
        """One process's part of a limit of the whole relay
        (``default_destination_concurrency_limit``): of ``processes`` workers, each
        takes ``limit / processes`` rounded down, at least 1, so that a destination sees
        no more connections than its limit, as from one Postfix (unless the limit is
        below the number of processes: then one from each)."""
        return max(1, limit // self.processes)

    def listen_address(self) -> tuple[str, int]:
        host, port, _ = parse_hostport(self.listen, "listen", 25)
        return host, port

    def _validate_tls_and_auth(self) -> None:
        """The TLS policy and SMTP AUTH settings (the client's tables parsed, the CA
        file and the password file read)."""
        from queue_ref.relay.password_files import load_password_file
        from queue_ref.relay.smtp_tls_policy import TlsPolicies

        policies = TlsPolicies(self)
        if self.smtp_tls_CAfile:
            try:
                ssl.create_default_context(cafile=self.smtp_tls_CAfile)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"smtp_tls_CAfile: cannot load {self.smtp_tls_CAfile}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        if policies.passwords and not self.smtp_sasl_auth_enable:
            raise ConfigError("smtp_sasl_password_maps is set but smtp_sasl_auth_enable is not")
        if self.smtpd_tls_security_level not in ("none", "may", "encrypt"):
            raise ConfigError("smtpd_tls_security_level: expected none, may or encrypt, "
                              f"not {self.smtpd_tls_security_level!r}")
        if self.smtpd_tls_security_level == "encrypt" and not self.smtpd_tls_cert_file:
            raise ConfigError("smtpd_tls_security_level = encrypt needs smtpd_tls_cert_file")
        if self.smtpd_sasl_auth_enable:
            if not self.smtpd_sasl_password_file:
                raise ConfigError("smtpd_sasl_auth_enable needs smtpd_sasl_password_file")
            load_password_file(self.smtpd_sasl_password_file)
            if self.smtpd_tls_auth_only and (not self.smtpd_tls_cert_file
                                             or self.smtpd_tls_security_level == "none"):
                raise ConfigError("smtpd_sasl_auth_enable with smtpd_tls_auth_only needs "
                                  "STARTTLS (smtpd_tls_cert_file, smtpd_tls_security_level)")
        elif self.smtpd_sasl_password_file:
            raise ConfigError("smtpd_sasl_password_file is set but smtpd_sasl_auth_enable is not")
        self._validate_odmr()
        if self.smtpd_auth_failure_limit < 1:
            raise ConfigError("smtpd_auth_failure_limit: must be at least 1")
        if self.anvil_rate_time_unit <= 0:
            raise ConfigError("anvil_rate_time_unit: must be above 0")

    def _validate_odmr(self) -> None:
        """``odmr_listen`` and ``atrn_domains``: ATRN needs AUTH, and each domain a user
        of ``smtpd_sasl_password_file``."""
        from queue_ref.relay.password_files import load_password_file

        try:
            self.ondemand_domains = [canonical_domain(d) for d in self.ondemand_domains]
        except ValueError as e:
            raise ConfigError(f"ondemand_domains: {e}") from None
        if (self.atrn_domains or self.odmr_cram_md5_file) and not self.odmr_listen:
            raise ConfigError("atrn_domains or odmr_cram_md5_file is set but odmr_listen is not "
                              "(ATRN is taken there)")
        if not self.odmr_listen:
            return
        parse_hostport(self.odmr_listen, "odmr_listen", 366)
        if not self.smtpd_sasl_auth_enable and not self.odmr_cram_md5_file:
            raise ConfigError("odmr_listen needs smtpd_sasl_auth_enable or odmr_cram_md5_file "
                              "(ATRN requires AUTH)")
        from queue_ref.relay.password_files import load_cram_md5_file

        users = set(load_cram_md5_file(self.odmr_cram_md5_file)) if self.odmr_cram_md5_file \
            else set()
        if users and self.smtpd_tls_auth_only and (not self.smtpd_tls_cert_file
                                                   or self.smtpd_tls_security_level == "none"):
            raise ConfigError("odmr_cram_md5_file with smtpd_tls_auth_only needs STARTTLS "
                              "(smtpd_tls_cert_file, smtpd_tls_security_level)")
        if self.smtpd_sasl_auth_enable:
            users |= set(load_password_file(self.smtpd_sasl_password_file))
        domains: dict[str, str] = {}
        for dom, user in self.atrn_domains.items():
            try:
                name = canonical_domain(dom)
            except ValueError as e:
                raise ConfigError(f"atrn_domains: {e}") from None
            if not isinstance(user, str) or user not in users:
                raise ConfigError(f"atrn_domains.{dom}: {user!r} is not a user of "
                                  "smtpd_sasl_password_file or odmr_cram_md5_file")
            if name in self.ondemand_domains:
                raise ConfigError(f"atrn_domains.{dom}: also in ondemand_domains (ATRN mail "
                                  "is never sent by MX)")
            domains[name] = user
        self.atrn_domains = domains

    def as_dict(self) -> dict[str, Any]:
        """The configuration as plain data, passwords shown as ``(hidden)``."""
        out = dataclasses.asdict(self)
        out["smtp_sasl_password_maps"] = {
            k: v.partition(":")[0] + ":(hidden)" for k, v in self.smtp_sasl_password_maps.items()}
        return out


_DURATIONS = {f.name for f in dataclasses.fields(RelayConfig) if f.type == "float"}
_INTS = {f.name for f in dataclasses.fields(RelayConfig) if f.type == "int"}
_STRS = {f.name for f in dataclasses.fields(RelayConfig) if f.type == "str"}
_BOOLS = {f.name for f in dataclasses.fields(RelayConfig) if f.type == "bool"}
_STR_LISTS = {"mynetworks", "relay_domains", "dns_nameservers", "queue_directories",
              "ondemand_domains"}


def _coerce(key: str, value: object) -> object:
    if key in _DURATIONS:
        return parse_duration(value, key)
    if key in _INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if key in _STRS:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if key in _STR_LISTS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings")
        return list(value)
    if key == "retry_delays":
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of durations")
        return [parse_duration(v, key) for v in value]
    if key == "transport_maps":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of domain = \"[host]:port\"")
        return {str(k).lower(): v for k, v in value.items()}
    if key == "atrn_domains":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of domain = \"user\"")
        return dict(value)
    if key in ("smtp_tls_policy_maps", "smtp_sasl_password_maps"):
        what = "level or { level, match }" if key == "smtp_tls_policy_maps" else "\"user:password\""
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of nexthop = {what}")
        for k, v in value.items():
            if key == "smtp_sasl_password_maps" and not isinstance(v, str):
                raise ConfigError(f"{key}.{k}: expected a string {what}")
        return dict(value)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false")
        return value
    raise ConfigError(f"unknown key {key!r}")


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RelayConfig:
    """The configuration from ``path`` (None: defaults only), then ``overrides``, validated.

    Keys may sit at the top level or in a ``[relay]`` table.  Raises ConfigError.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror}") from None
        table = data.pop("relay", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [relay] must be a table")
        values.update(data)
        values.update(table)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    known = {f.name for f in dataclasses.fields(RelayConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key {key!r}" + (f" in {path}" if path else ""))
        kwargs[key] = _coerce(key, value)
    return RelayConfig(**kwargs).validate()


def loop_kind(config: RelayConfig) -> str:
    """The kind of event loop ``new_event_loop`` makes: uvloop or asyncio."""
    if config.event_loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return config.event_loop


def new_event_loop(config: RelayConfig) -> asyncio.AbstractEventLoop:
    """A new event loop of the kind ``config.event_loop`` names (auto: uvloop where it
    can be imported).  uvloop's loop, written in C over libuv, takes the relay's
    per-message work in the loop (transports, futures, callbacks) at less CPU than
    asyncio's own: in paired bulk runs of the relay benchmark, 3-47% more mail delivered
    per second.  Raises ConfigError when uvloop is named and cannot be imported."""
    if loop_kind(config) == "uvloop":
        try:
            import uvloop
        except ImportError as e:
            raise ConfigError(f"event_loop: uvloop cannot be imported: {e}") from None
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


#: Blocks of at least this many bytes (a big message's body) get a mapping of their own,
#: given back to the system when freed (``give_back_big_buffers``).
BIG_BUFFER = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def give_back_big_buffers() -> None:
    """Fix glibc's mmap threshold at ``BIG_BUFFER``.  Left to itself, glibc raises the
    threshold to the size of the largest block freed (up to 32 MiB), so after one 10 MB
    body the next ones come from the heap, and the heap keeps them: a worker that
    relayed 30 messages of 10 MB (three senders) held 172 MB afterwards, 40 MB at start;
    with the threshold fixed, 52 MB, and its peak was 129 MB instead of 211.  Not glibc
    (no ``mallopt``): nothing to do."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, BIG_BUFFER)


def run_relay(config: RelayConfig, main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` (a relay process's life) to its end on a loop from ``new_event_loop``
    (big buffers given back when freed: ``give_back_big_buffers``)."""
    give_back_big_buffers()
    try:
        loop = new_event_loop(config)
    except ConfigError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(main)
