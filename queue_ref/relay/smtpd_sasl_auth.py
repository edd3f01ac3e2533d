"""SMTP AUTH for the receiver (Postfix's ``smtpd_sasl_auth_enable``): PLAIN and LOGIN
checked against ``smtpd_sasl_password_file``, failures limited and logged.

The file has one ``user:hash`` line per user (``#`` comments and blank lines allowed);
the hash is salted scrypt in the PHC string format, ``$scrypt$ln=14,r=8,p=1$SALT$HASH``
(base64 without padding).  ``python -m queue_ref.relay.smtpd_sasl_auth USER`` reads a
password from standard input (or asks for it on a terminal) and prints the line.

``SaslAuthenticator`` is aiosmtpd's ``authenticator``: it is called on the event loop,
and scrypt takes 40-100 ms, so a password it has verified is remembered as a keyed
BLAKE2 digest (the key made at start and kept in memory only) and the user's next
login costs microseconds.  Failures are counted per client address over
``anvil_rate_time_unit``; from ``smtpd_auth_failure_limit`` on, the session gets ``421``
and is closed, and so does every AUTH from that address until the window has passed.
Each attempt is logged (event ``auth``: client, sasl_method, sasl_username, status),
never the password.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import hmac
import os
import re
import sys
import time
from collections import deque
from typing import Any

from aiosmtpd.smtp import AuthResult, Envelope, LoginPassword, Session

from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.password_files import PHC, load_password_file
from queue_ref.relay.relay_config import RelayConfig

__all__ = ["TOO_MANY", "SaslAuthenticator", "hash_password", "load_password_file", "verify_password"]

_USER = re.compile(r"[^\s:\x00-\x1f\x7f]{1,255}")
#: the reply to the failure that reaches the limit, and to AUTH from a client past it
TOO_MANY = "421 4.7.0 Error: too many failed authentication attempts"
_MAX_CLIENTS = 10_000  # client addresses whose failures are remembered
#: checked for an unknown user (no password matches it)
_DUMMY = "$scrypt$ln=14,r=8,p=1$" + "A" * 22 + "$" + "A" * 43


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str, ln: int = 14, r: int = 8, p: int = 1) -> str:
    """A salted scrypt hash of ``password`` (N = 2**ln) in the PHC string format."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode("utf-8"), salt=salt, n=1 << ln, r=r, p=p, dklen=32)
    return f"$scrypt$ln={ln},r={r},p={p}${_b64(salt)}${_b64(digest)}"


def verify_password(entry: str, password: bytes) -> bool:
    """Whether ``password`` is the one ``entry`` (from ``hash_password``) was made of."""
    m = PHC.fullmatch(entry)
    if m is None:
        return False
    ln, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
    want = _unb64(m.group(5))
    got = hashlib.scrypt(password, salt=_unb64(m.group(4)), n=1 << ln, r=r, p=p,
                         dklen=len(want), maxmem=256 << 20)
    return hmac.compare_digest(got, want)




def _printable(text: str) -> str:
    return re.sub(r"[\x00-\x20\x7f,()=]", "?", text)[:255]


class SaslAuthenticator:
    """aiosmtpd's ``authenticator`` for the relay's receiver."""

    def __init__(self, config: RelayConfig, log: DeliveryLog) -> None:
        self.users = load_password_file(config.smtpd_sasl_password_file)
        self.log = log
        self.limit = config.smtpd_auth_failure_limit
        self.window = config.anvil_rate_time_unit
        self._failures: dict[str, deque[float]] = {}
        self._key = os.urandom(32)
        self._verified: dict[str, bytes] = {}  # user -> keyed digest of its verified password

    def _digest(self, user: str, password: bytes) -> bytes:
        return hashlib.blake2b(user.encode("utf-8") + b"\x00" + password, key=self._key).digest()

    def failures(self, client: str) -> int:
        """Failed attempts from ``client`` within the window."""
        times = self._failures.get(client)
        if not times:
            return 0
        cutoff = time.monotonic() - self.window
        while times and times[0] < cutoff:
            times.popleft()
        if not times:
            del self._failures[client]
            return 0
        return len(times)

    def blocked(self, client: str) -> bool:
        return self.failures(client) >= self.limit

    def _failed(self, client: str) -> None:
        if len(self._failures) >= _MAX_CLIENTS and client not in self._failures:
            for other in list(self._failures):
                self.failures(other)  # drops the clients whose failures are old
            if len(self._failures) >= _MAX_CLIENTS:
                self._failures.pop(next(iter(self._failures)))
        self._failures.setdefault(client, deque()).append(time.monotonic())

    def check(self, user: str, password: bytes) -> bool:
        entry = self.users.get(user)
        if entry is None:
            verify_password(_DUMMY, password)  # an unknown user takes as long as a known one
            return False
        digest = self._digest(user, password)
        known = self._verified.get(user)
        if known is not None and hmac.compare_digest(known, digest):
            return True
        if not verify_password(entry, password):
            return False
        self._verified[user] = digest
        return True

    def __call__(self, server: Any, session: Session, envelope: Envelope, mechanism: str,
                 auth_data: Any) -> AuthResult:
        peer = session.peer
        client = peer[0] if isinstance(peer, tuple) else "unknown"
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        user = auth_data.login.decode("utf-8", "replace")
        ok = self.check(user, auth_data.password)
        self.log.emit("auth", client=client, sasl_method=mechanism,
                      sasl_username=_printable(user), status="ok" if ok else "failed")
        if ok:
            return AuthResult(success=True, auth_data=auth_data)
        self._failed(client)
        return AuthResult(success=False, handled=False,
                          message=TOO_MANY if self.blocked(client) else
                          "535 5.7.8 Error: authentication failed: authentication failure")


def main(argv: list[str] | None = None) -> int:
    """``python -m queue_ref.relay.smtpd_sasl_auth USER``: a password file line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not _USER.fullmatch(args[0]):
        print("usage: python -m queue_ref.relay.smtpd_sasl_auth USER  (the password on standard "
              "input; USER without spaces or colons)", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {args[0]}: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("smtpd_sasl_auth: empty password", file=sys.stderr)
        return 2
    print(f"{args[0]}:{hash_password(password)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
