"""What a TLS session used, in the forms Postfix writes it: the protocol and cipher of
the relay's inbound sessions (``Received:`` and the ``tls`` log record) and of its
deliveries (the ``tls`` field of a delivery record).

Postfix's ``smtpd_tls_received_header = yes`` adds ``(using TLSv1.3 with cipher
TLS_AES_256_GCM_SHA384 (256/256 bits))``; its log says ``Anonymous TLS connection
established from host[addr]: TLSv1.3 with cipher ... (256/256 bits)``.  The two numbers
are the cipher's secret bits and its algorithm's bits; Python's ``SSLObject.cipher()``
gives the first alone, and for every cipher TLS 1.2 and 1.3 negotiate here (AES-GCM,
ChaCha20-Poly1305) the two are equal, so both are the secret bits.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

__all__ = ["CLOSE_GRACE", "NO_TLS", "TlsSummary", "summary_of", "summary_of_session"]

#: the delivery record's ``tls`` field for a session in clear text
NO_TLS = "none"

#: seconds a stopping relay gives a connection it closed to be gone before it aborts it:
#: a TLS close waits for the peer's close_notify, which a peer that reads nothing never
#: sends, and a socket still open when the event loop ends is never closed
CLOSE_GRACE = 1.0


@dataclass(frozen=True)
class TlsSummary:
    version: str  # "TLSv1.3"
    cipher: str  # "TLS_AES_256_GCM_SHA384"
    bits: int  # 256

    def received_comment(self) -> str:
        """``(using TLSv1.3 with cipher TLS_AES_256_GCM_SHA384 (256/256 bits))``"""
        return f"(using {self.version} with cipher {self.cipher} ({self.bits}/{self.bits} bits))"

    def field(self) -> str:
        """The log field: ``TLSv1.3:TLS_AES_256_GCM_SHA384``."""
        return f"{self.version}:{self.cipher}"

    def text(self) -> str:
        """``TLSv1.3 with cipher TLS_AES_256_GCM_SHA384 (256/256 bits)``, as Postfix logs it."""
        return f"{self.version} with cipher {self.cipher} ({self.bits}/{self.bits} bits)"


def summary_of(obj: ssl.SSLObject | ssl.SSLSocket | None) -> TlsSummary | None:
    """The summary of an established TLS session; None for none (or one not finished)."""
    if obj is None:
        return None
    cipher, version = obj.cipher(), obj.version()
    if cipher is None or version is None:
        return None
    return TlsSummary(version, cipher[0], int(cipher[2]))


def summary_of_session(ssl_info: Any) -> TlsSummary | None:
    """The summary of an aiosmtpd session's ``session.ssl`` (the TLS transport's extra
    information after STARTTLS: a mapping with ``ssl_object``), None before STARTTLS."""
    if not ssl_info:
        return None
    obj = ssl_info.get("ssl_object") if hasattr(ssl_info, "get") else None
    return summary_of(obj) if isinstance(obj, (ssl.SSLObject, ssl.SSLSocket)) else None
