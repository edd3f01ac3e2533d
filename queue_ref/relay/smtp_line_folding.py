"""Long lines folded for delivery, as Postfix's smtp client does (``smtp_line_length_limit``).

RFC 5321 4.5.3.1.6 allows 998 octets of text per line.  The relay accepts longer lines
(as Postfix's smtpd does, up to ``message_size_limit``) and breaks them when it sends:
a line of more than ``limit`` octets (its CRLF not counted) becomes pieces of ``limit``
octets, each after the first sent on a line of its own that starts with a space
("<CR><LF><SPACE>" inserted, which keeps the damage to MIME small: a folded header is
the same header, a folded base64 line decodes the same).  Every line sent then has at
most ``limit`` octets, the space included.  Removing each inserted "<CR><LF><SPACE>"
gives the line back.

``has_long_line`` is what delivery pays for ordinary mail: one ``bytes.find`` in C per
``(limit + 1) // 2`` octets (0.3 ms per MB of 70-octet lines), where splitting the body
into lines costs 3 ms per MB.
"""

from __future__ import annotations

import re

__all__ = ["LINE_LENGTH_LIMIT", "crlf_only", "dot_lines", "fold_long_lines", "has_long_line",
           "wire_ready"]

#: Postfix's smtp_line_length_limit (RFC 5321's 998 octets of text per line)
LINE_LENGTH_LIMIT = 998
_LINE_BREAK = re.compile(rb"(\r\n|\r|\n)")


def has_long_line(body: bytes, limit: int = LINE_LENGTH_LIMIT) -> bool:
    """Whether a line of ``body`` holds more than ``limit`` octets before its line break.

    Such a line holds a run of over ``limit`` octets without LF, so one of the points
    ``step`` apart falls in it with ``step`` octets of it after: only there is the whole
    line measured."""
    if len(body) <= limit:
        return False
    step = max(1, (limit + 1) // 2)
    find, rfind, n = body.find, body.rfind, len(body)
    p = 0
    while p < n:
        if find(b"\n", p, p + step) < 0:
            start = max(rfind(b"\n", 0, p), rfind(b"\r", 0, p)) + 1
            end = p
            while end < n and body[end] not in b"\r\n":
                nxt = [i for i in (find(b"\n", end), find(b"\r", end)) if i >= 0]
                end = min(nxt) if nxt else n
            if end - start > limit:
                return True
            p = end
        p += step
    return False


#: Every octet but CR and LF (what ``crlf_only`` deletes to see the line breaks alone).
_NOT_CR_LF = bytes(i for i in range(256) if i not in b"\r\n")
#: A CR that something other than LF follows (a literal first: searched for in C).
_CR_ALONE = re.compile(rb"\r[^\n]")


def crlf_only(body: bytes) -> bool:
    """Whether every line break of ``body`` is CRLF (no bare CR or LF): its CRs and LFs
    alone, in order, are CRLF again and again (one ``translate`` that keeps only those,
    two octets a line), and no CR has anything but LF right after it (``a CR . LF`` passes
    the first look).  About 1 ms per MB, on the event loop for each message received;
    counting the CRLFs of the whole body, as this once did, took 1.4 ms."""
    breaks = body.translate(None, _NOT_CR_LF)
    return len(breaks) == 2 * breaks.count(b"\r\n") and _CR_ALONE.search(body) is None


def dot_lines(body: bytes) -> bool:
    """Whether a line of ``body`` starts with ``.`` (dot-stuffing would change it)."""
    return body.startswith(b".") or b"\r\n." in body


def wire_ready(body: bytes, limit: int = LINE_LENGTH_LIMIT, *,
               dots: bool | None = None) -> bool:
    """Whether ``body`` goes out as it is, dot-stuffing included (then only ``.`` CRLF
    follows it): ``crlf_only``, no line of more than ``limit`` octets (0: any length), and
    no line that starts with ``.``.  ``dots``: ``dot_lines(body)`` where the caller knows
    it (the DATA reader tells it, ``smtp_data_reader.DataRead.dot_lines``), else it is
    looked for.  About 1.4 ms per MB."""
    if dot_lines(body) if dots is None else dots:
        return False
    return crlf_only(body) and not (limit and has_long_line(body, limit))


def fold_long_lines(body: bytes, limit: int = LINE_LENGTH_LIMIT) -> bytes:
    """``body`` with every line of more than ``limit`` octets broken by "<CR><LF><SPACE>"
    (the line breaks it has are kept as they are: CRLF, or a bare CR or LF)."""
    if limit < 2:
        raise ValueError(f"a line length limit must be at least 2, got {limit}")
    parts = _LINE_BREAK.split(body)  # text, break, text, break, ..., text
    for i in range(0, len(parts), 2):
        line = parts[i]
        if len(line) > limit:
            pieces = [line[:limit]]
            pieces += [b" " + line[j:j + limit - 1] for j in range(limit, len(line), limit - 1)]
            parts[i] = b"\r\n".join(pieces)
    return b"".join(parts)
