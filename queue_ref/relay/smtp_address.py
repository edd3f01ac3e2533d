"""Mail addresses in their common form, read and written without the email package.

``<dot-atom@domain>`` (ASCII atoms, a domain of letters, digits and hyphens) is how nearly
every reverse and forward path looks.  The email package's parsers handle every form RFC
5321 allows, at a cost: aiosmtpd reads each MAIL and RCPT path with its header parser and
builds a typing.Protocol class on every call (34 us on the development machine), and
aiosmtplib runs ``email.utils.parseaddr`` over each address it sends.  A match of this
form takes under a microsecond; what it matches, those parsers read the same way (a
local part that begins ``=?``, an encoded word to the header parser, is not matched)
(``tests/test_relay_receiver.py`` and ``tests/test_relay_delivery.py`` compare them on
generated input), and anything else still goes to them.
"""

from __future__ import annotations

import re

from queue_ref.storage import MAX_ADDRESS

__all__ = ["PLAIN_ADDRESS", "fast_path_address", "plain_quoted", "valid_address"]

_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
#: an address in its common form, ``local@domain`` without angle brackets
PLAIN_ADDRESS = re.compile(rf"(?:{_ATEXT}\.)*{_ATEXT}@(?:[A-Za-z0-9-]+\.)*[A-Za-z0-9-]+")
# not a local part that begins as an RFC 2047 encoded word: aiosmtpd's parser decodes it
# (``<=?utf-8?q?bob?=@example.net>`` is bob@example.net to it)
_FAST_PATH = re.compile(rf"<(?!=\?)({PLAIN_ADDRESS.pattern})>(?:$| (?=[^\s(]))")


def fast_path_address(arg: str) -> tuple[str, str] | None:
    """``(address, rest)`` as aiosmtpd's ``SMTP._getaddr`` gives them for the argument of
    MAIL FROM: or RCPT TO: (the path, then one space and the parameters, or nothing), for
    a path in its common form; None for anything else."""
    m = _FAST_PATH.match(arg)
    if m is None:
        return None
    return m.group(1), arg[m.end():]


def plain_quoted(address: str) -> bytes | None:
    """``<address>`` as aiosmtplib's ``quote_address`` makes it (``<>`` for the null
    sender), for an address in its common form; None for anything else."""
    if not address:
        return b"<>"
    if PLAIN_ADDRESS.fullmatch(address) is None:
        return None
    return b"<" + address.encode("ascii") + b">"


_LABEL = r"[A-Za-z0-9\u0080-\U0010ffff](?:[A-Za-z0-9\u0080-\U0010ffff-]*[A-Za-z0-9\u0080-\U0010ffff])?"
_DOMAIN = rf"(?:{_LABEL}\.)*{_LABEL}"
# a local part: a dot-string of anything but specials, or an RFC 5321 Quoted-string
# (``"john smith"``, ``"a@b"``, a backslash quoting one printable character)
_LOCAL = r"(?:[^\s@<>()\[\],;:\\\"\x00-\x1f\x7f]+|\"(?:[^\"\\\x00-\x1f\x7f]|\\[\x20-\x7e])*\")"
_ADDRESS = re.compile(_LOCAL + r"@(?:" + _DOMAIN + r"|\[(?:IPv6:)?[0-9A-Fa-f:.]+\])")


def valid_address(address: str) -> bool:
    """A plain ``local@domain`` (or ``local@[literal]``) address the queue can store."""
    return len(address) <= MAX_ADDRESS and _ADDRESS.fullmatch(address) is not None
