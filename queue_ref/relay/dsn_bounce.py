"""Delivery status notifications (RFC 3464): bounces and delay warnings.

A DSN is a ``multipart/report; report-type=delivery-status`` message to the envelope
sender, sent with the null sender ``<>``: a human-readable part, a
``message/delivery-status`` part (Reporting-MTA, Arrival-Date, then per recipient
Final-Recipient, Action, Status, Remote-MTA, Diagnostic-Code, Last-Attempt-Date) and the
original message: whole as ``message/rfc822`` when it is at most ``size_limit`` bytes
(Postfix's ``bounce_size_limit``), otherwise its headers as ``text/rfc822-headers`` (and
the text says so).  Mail with the null sender never gets one (RFC 5321 6.1, seed 003: "no
NDR for an NDR").

Internationalized mail (RFC 6533): when the sender, a recipient or the original message
needs SMTPUTF8, the report is ``message/global-delivery-status`` with ``utf-8`` address
types, the original goes as ``message/global`` (or ``message/global-headers``), the
headers carry UTF-8 as they are (RFC 6532), and ``dsn_params`` asks for SMTPUTF8 on the
way out.  A report holding other 8-bit bytes (a legacy 8-bit original) is sent with
BODY=8BITMIME.
"""

from __future__ import annotations

import email.utils
import re
import uuid
from dataclasses import dataclass

__all__ = ["FailedRecipient", "build_dsn", "dsn_params", "needs_smtputf8", "original_headers",
           "original_looked_at"]

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


def original_looked_at(size_limit: int) -> int:
    """How much of an original ``build_dsn`` looks at with this ``size_limit``: given the
    original cut to this length it builds the same report (a longer original is too big
    to attach whole, and its header section is cut at ``MAX_HEADERS``), so a big body is
    read no further for its DSN."""
    return max(size_limit + 1, MAX_HEADERS + 4)


def _oneline(text: str) -> str:
    text = " ".join(text.split())
    return re.sub(r"[^\x20-\x7e]", "?", text)[:900]


def _address(address: str, utf8: bool) -> str:
    """An address for a header or a report field: as it is in internationalized mail,
    controls and line breaks removed; otherwise ASCII (what is not becomes ``?``)."""
    if utf8:
        return re.sub(r"[\x00-\x1f\x7f]", "?", " ".join(address.split()))[:900]
    return _oneline(address)


def needs_smtputf8(sender: str, recipients: list[FailedRecipient], smtputf8: bool) -> bool:
    """Whether a DSN about these addresses is internationalized mail (RFC 6533): an
    address that is not ASCII, or an original message sent with SMTPUTF8."""
    return smtputf8 or not sender.isascii() or any(not r.address.isascii() for r in recipients)


def dsn_params(message: bytes, smtputf8: bool) -> dict[str, str]:
    """The queue parameters a DSN goes out with: SMTPUTF8 for internationalized mail,
    BODY=8BITMIME when it holds 8-bit bytes."""
    out: dict[str, str] = {}
    if smtputf8:
        out["smtputf8"] = "yes"
    if not message.isascii():
        out["body"] = "8BITMIME"
    return out


def _date(ts: float) -> str:
    return email.utils.formatdate(ts, localtime=True)


def build_dsn(*, reporting_mta: str, queue_id: str, sender: str, arrival: float,
              recipients: list[FailedRecipient], original: bytes, now: float,
              action: str = "failed", retry_until: float | None = None,
              size_limit: int = 50_000, smtputf8: bool = False) -> bytes:
    """The DSN message's bytes (CRLF line ends).  ``action`` is failed or delayed; the
    original is attached whole up to ``size_limit`` bytes, else its headers;
    ``smtputf8``: the original was internationalized mail (see ``needs_smtputf8``)."""
    utf8 = needs_smtputf8(sender, recipients, smtputf8)
    boundary = f"{queue_id}.{uuid.uuid4().hex}/{reporting_mta}"
    delayed = action == "delayed"
    whole = len(original) <= size_limit
    subject = ("Delayed Mail (still being retried)" if delayed
               else "Undelivered Mail Returned to Sender")
    lines = [
        f"From: MAILER-DAEMON@{reporting_mta} (Mail Delivery System)",
        f"To: <{_address(sender, utf8)}>",
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
        "Content-Type: text/plain; charset=" + ("utf-8" if utf8 else "us-ascii"),
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
    elif whole:
        lines += ["I'm sorry to have to inform you that your message could not",
                  "be delivered to one or more recipients. It's attached below.", ""]
    else:
        lines += ["I'm sorry to have to inform you that your message could not",
                  "be delivered to one or more recipients. Its headers are attached below;",
                  f"the message itself was larger than {size_limit} bytes.", ""]
    for r in recipients:
        lines.append(f"<{_address(r.address, utf8)}>: {_oneline(r.diagnostic)}")
    lines += [
        "",
        f"--{boundary}",
        "Content-Description: Delivery report",
        "Content-Type: message/" + ("global-delivery-status" if utf8 else "delivery-status"),
        "",
        f"Reporting-MTA: dns; {reporting_mta}",
        f"X-Queue-ref-Queue-ID: {queue_id}",
        f"Arrival-Date: {_date(arrival)}",
    ]
    for r in recipients:
        lines += [
            "",
            f"Final-Recipient: {'utf-8' if utf8 else 'rfc822'}; {_address(r.address, utf8)}",
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
    if whole:
        attached = original if original.endswith(b"\r\n") else original + b"\r\n"
        described, kind = "Undelivered Message", "global" if utf8 else "rfc822"
    else:
        attached = original_headers(original)
        described, kind = "Undelivered Message Headers", ("global-headers" if utf8
                                                          else "rfc822-headers")
    content_type = f"message/{kind}" if kind != "rfc822-headers" else "text/rfc822-headers"
    part = (f"--{boundary}\r\n"
            f"Content-Description: {described}\r\n"
            f"Content-Type: {content_type}\r\n"
            + ("" if attached.isascii() else "Content-Transfer-Encoding: 8bit\r\n")
            + "\r\n")
    tail = f"--{boundary}--\r\n"
    return (head.encode("utf-8" if utf8 else "ascii") + part.encode("ascii") + attached
            + b"\r\n" + tail.encode("ascii"))
