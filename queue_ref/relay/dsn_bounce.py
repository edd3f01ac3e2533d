"""Delivery status notifications (RFC 3464): bounces and delay warnings.

A DSN is a ``multipart/report; report-type=delivery-status`` message to the envelope
sender, sent with the null sender ``<>``: a human-readable part, a
``message/delivery-status`` part (Reporting-MTA, Arrival-Date, then per recipient
Final-Recipient, Action, Status, Remote-MTA, Diagnostic-Code, Last-Attempt-Date) and the
original message's headers as ``text/rfc822-headers``.  Mail with the null sender never
gets one (RFC 5321 6.1, seed 003: "no NDR for an NDR").
"""

from __future__ import annotations

import email.utils
import re
import uuid
from dataclasses import dataclass

__all__ = ["FailedRecipient", "build_dsn", "original_headers"]

MAX_HEADERS = 64 * 1024


@dataclass(frozen=True)
class FailedRecipient:
    address: str
    dsn: str  # e.g. 5.1.1
    diagnostic: str  # the remote reply or our reason
    remote_mta: str  # host name, "" when none answered
    last_attempt: float  # epoch seconds


def original_headers(body: bytes) -> bytes:
    """The header section of a message (up to its first empty line), at most 64 KiB."""
    end = body.find(b"\r\n\r\n")
    head = body if end < 0 else body[:end + 2]
    if len(head) > MAX_HEADERS:
        cut = head.rfind(b"\r\n", 0, MAX_HEADERS)
        head = head[:cut + 2] if cut > 0 else head[:MAX_HEADERS] + b"\r\n"
    return head


def _oneline(text: str) -> str:
    text = " ".join(text.split())
    return re.sub(r"[^\x20-\x7e]", "?", text)[:900]


def _date(ts: float) -> str:
    return email.utils.formatdate(ts, localtime=True)


def build_dsn(*, reporting_mta: str, queue_id: str, sender: str, arrival: float,
              recipients: list[FailedRecipient], original: bytes, now: float,
              action: str = "failed", retry_until: float | None = None) -> bytes:
    """The DSN message's bytes (CRLF line ends).  ``action`` is failed or delayed."""
    boundary = f"{queue_id}.{uuid.uuid4().hex}/{reporting_mta}"
    delayed = action == "delayed"
    subject = ("Delayed Mail (still being retried)" if delayed
               else "Undelivered Mail Returned to Sender")
    lines = [
        f"From: MAILER-DAEMON@{reporting_mta} (Mail Delivery System)",
        f"To: <{sender}>",
        f"Subject: {subject}",
        f"Date: {_date(now)}",
        f"Message-ID: <{uuid.uuid4().hex}@{reporting_mta}>",
        "Auto-Submitted: auto-replied",
        "MIME-Version: 1.0",
        f"Content-Type: multipart/report; report-type=delivery-status;\r\n\tboundary=\"{boundary}\"",
        "",
        "This is a MIME-encapsulated message.",
        "",
        f"--{boundary}",
        "Content-Description: Notification",
        "Content-Type: text/plain; charset=us-ascii",
        "",
        f"This is the mail system at host {reporting_mta}.",
        "",
    ]
    if delayed:
        lines += ["####################################################################",
                  "# THIS IS A WARNING ONLY.  YOU DO NOT NEED TO RESEND YOUR MESSAGE. #",
                  "####################################################################",
                  "",
                  "Your message could not be delivered yet. The mail system will keep trying"
                  + (f" until {_date(retry_until)}." if retry_until else "."),
                  ""]
    else:
        lines += ["I'm sorry to have to inform you that your message could not",
                  "be delivered to one or more recipients. It's attached below.", ""]
    for r in recipients:
        lines.append(f"<{_oneline(r.address)}>: {_oneline(r.diagnostic)}")
    lines += [
        "",
        f"--{boundary}",
        "Content-Description: Delivery report",
        "Content-Type: message/delivery-status",
        "",
        f"Reporting-MTA: dns; {reporting_mta}",
        f"X-Queue-ref-Queue-ID: {queue_id}",
        f"Arrival-Date: {_date(arrival)}",
    ]
    for r in recipients:
        lines += [
            "",
            f"Final-Recipient: rfc822; {_oneline(r.address)}",
            f"Action: {action}",
            f"Status: {r.dsn}",
        ]
        if r.remote_mta:
            lines.append(f"Remote-MTA: dns; {_oneline(r.remote_mta)}")
        kind = "smtp" if re.match(r"[245]\d\d ", r.diagnostic) else "x-queue-ref"
        lines.append(f"Diagnostic-Code: {kind}; {_oneline(r.diagnostic)}")
        lines.append(f"Last-Attempt-Date: {_date(r.last_attempt)}")
        if delayed and retry_until:
            lines.append(f"Will-Retry-Until: {_date(retry_until)}")
    head = "\r\n".join(lines) + "\r\n\r\n"
    headers = original_headers(original)
    eight_bit = any(b > 0x7E for b in headers)
    part = (f"--{boundary}\r\n"
            "Content-Description: Undelivered Message Headers\r\n"
            "Content-Type: text/rfc822-headers\r\n"
            + ("Content-Transfer-Encoding: 8bit\r\n" if eight_bit else "")
            + "\r\n")
    tail = f"\r\n--{boundary}--\r\n"
    return head.encode("ascii") + part.encode("ascii") + headers + tail.encode("ascii")
