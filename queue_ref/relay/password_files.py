"""The password files of the relay's SMTP AUTH: ``smtpd_sasl_password_file`` (salted
scrypt hashes, PHC format) and ``odmr_cram_md5_file`` (shared secrets for CRAM-MD5),
read here apart from the servers that use them, so that ``RelayConfig.validate`` checks
them at start."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

from queue_ref.relay.config_values import ConfigError

__all__ = ["PHC", "load_cram_md5_file", "load_password_file"]

#: a scrypt hash in the PHC string format: ln, r, p, salt, hash
PHC = re.compile(r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,2}),p=(\d{1,2})\$([A-Za-z0-9+/]+)\$([A-Za-z0-9+/]+)")
_USER = re.compile(r"[^\s:\x00-\x1f\x7f]{1,255}")


def _read(key: str, path: str) -> tuple[int, list[str]]:
    """The mode and the lines of the file ``key`` names; ConfigError if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return os.fstat(f.fileno()).st_mode, f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path}: {getattr(e, 'strerror', None) or e}") from None


def _users(key: str, path: str, lines: list[str],
           value: Callable[[str, str], str | None], expected: str) -> dict[str, str]:
    """user -> what ``value(user, rest)`` makes of each ``user:rest`` line (``#``
    comments and blank lines skipped); ConfigError naming the line when it gives None
    (``expected`` says what a line should be) or raises one, or for a user again."""
    users: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, rest = line.partition(":")
        try:
            got = value(user, rest) if sep and _USER.fullmatch(user) else None
        except ConfigError as e:
            raise ConfigError(f"{key}: {path} line {n}: {e}") from None
        if got is None:
            raise ConfigError(f"{key}: {path} line {n}: expected {expected}")
        if user in users:
            raise ConfigError(f"{key}: {path} line {n}: user {user!r} again")
        users[user] = got
    return users


def _scrypt_entry(user: str, entry: str) -> str | None:
    m = PHC.fullmatch(entry)
    if m is None:
        return None
    if not 1 <= int(m.group(1)) <= 20 or int(m.group(2)) < 1 or int(m.group(3)) < 1:
        raise ConfigError("scrypt parameters out of range")
    return entry


def load_password_file(path: str) -> dict[str, str]:
    """user -> hash from a ``user:hash`` file; ConfigError naming the line otherwise."""
    key = "smtpd_sasl_password_file"
    _, lines = _read(key, path)
    return _users(key, path, lines, _scrypt_entry,
                  "user:$scrypt$ln=..,r=..,p=..$SALT$HASH (python -m "
                  "queue_ref.relay.smtpd_sasl_auth USER makes one)")


def load_cram_md5_file(path: str) -> dict[str, str]:
    """user -> shared secret from ``odmr_cram_md5_file`` (``user:secret`` lines, ``#``
    comments); ConfigError naming the line, or when others than its owner may read it
    (CRAM-MD5 needs the secret itself, as the client has it)."""
    key = "odmr_cram_md5_file"
    mode, lines = _read(key, path)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{key}: {path} may be read by others than its owner (chmod 600)")
    return _users(key, path, lines, lambda _user, secret: secret or None, "user:secret")
