"""The relay configuration's values and their errors, apart from ``RelayConfig`` so that
the modules ``RelayConfig.validate`` asks (TLS policy, password files, addresses) need not
import it: durations, host:port, and ``ConfigError``."""

from __future__ import annotations

import re

__all__ = ["ConfigError", "parse_duration", "parse_hostport"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


def parse_duration(value: object, key: str) -> float:
    """Seconds from an int, a float or a string like ``"15m"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{key}: a duration cannot be negative ({value})")
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    raise ConfigError(f"{key}: expected a duration like 300, \"15m\" or \"5d\", got {value!r}")


def parse_hostport(value: str, key: str, default_port: int) -> tuple[str, int, bool]:
    """``host``, ``host:port``, ``[host]:port`` or ``[v6addr]:port``: (host, port, bracketed).

    Brackets mean what they mean in Postfix: use this host as it is, no MX lookup.
    """
    value = value.strip()
    bracketed = value.startswith("[")
    if bracketed:
        end = value.find("]")
        if end < 0:
            raise ConfigError(f"{key}: unclosed '[' in {value!r}")
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{key}: expected [host]:port, got {value!r}")
        port_s = rest[1:] if rest else ""
    else:
        host, _, port_s = value.rpartition(":") if ":" in value else (value, "", "")
    if not host:
        raise ConfigError(f"{key}: no host in {value!r}")
    if port_s:
        if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise ConfigError(f"{key}: bad port in {value!r}")
        port = int(port_s)
    else:
        port = default_port
    return host, port, bracketed
