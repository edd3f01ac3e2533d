"""The password files of the relay's SMTP AUTH: ``smtpd_sasl_password_file`` (salted
scrypt hashes, PHC format) and ``odmr_cram_md5_file`` (shared secrets for CRAM-MD5),
read here apart from the servers that use them, so that ``RelayConfig.validate`` checks
them at start."""

from __future__ import annotations

import os
import re
import stat

from queue_ref.relay.config_values import ConfigError

__all__ = ["PHC", "load_cram_md5_file", "load_password_file"]

#: a scrypt hash in the PHC string format: ln, r, p, salt, hash
PHC = re.compile(r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,2}),p=(\d{1,2})\$([A-Za-z0-9+/]+)\$([A-Za-z0-9+/]+)")
_USER = re.compile(r"[^\s:\x00-\x1f\x7f]{1,255}")


def load_password_file(path: str) -> dict[str, str]:
    """user -> hash from a ``user:hash`` file; ConfigError naming the line otherwise."""
    key = "smtpd_sasl_password_file"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path}: {getattr(e, 'strerror', None) or e}") from None
    users: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, entry = line.partition(":")
        m = PHC.fullmatch(entry)
        if not sep or not _USER.fullmatch(user) or m is None:
            raise ConfigError(f"{key}: {path} line {n}: expected user:$scrypt$ln=..,r=..,p=..$SALT$HASH"
                              " (python -m queue_ref.relay.smtpd_sasl_auth USER makes one)")
        if not 1 <= int(m.group(1)) <= 20 or int(m.group(2)) < 1 or int(m.group(3)) < 1:
            raise ConfigError(f"{key}: {path} line {n}: scrypt parameters out of range")
        if user in users:
            raise ConfigError(f"{key}: {path} line {n}: user {user!r} again")
        users[user] = entry
    return users


def load_cram_md5_file(path: str) -> dict[str, str]:
    """user -> shared secret from ``odmr_cram_md5_file`` (``user:secret`` lines, ``#``
    comments); ConfigError naming the line, or when others than its owner may read it
    (CRAM-MD5 needs the secret itself, as the client has it)."""
    key = "odmr_cram_md5_file"
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path}: {getattr(e, 'strerror', None) or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{key}: {path} may be read by others than its owner (chmod 600)")
    users: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, secret = line.partition(":")
        if not sep or not _USER.fullmatch(user) or not secret:
            raise ConfigError(f"{key}: {path} line {n}: expected user:secret")
        if user in users:
            raise ConfigError(f"{key}: {path} line {n}: user {user!r} again")
        users[user] = secret
    return users
