"""Hypothesis strategies of mail data as varied as real mail, within what the contract allows.

The lockstep machine's own data (``machine_state``: a few addresses, random bodies of
fixed sizes, schedules up to 10**9) is kept for shrinking; these add what mail brings:

* ``addresses``: RFC 5321 and RFC 6531 addresses: case-sensitive local parts (``Rcpt``
  and ``rcpt`` are two mailboxes), dot-atoms with every ``atext`` special, quoted local
  parts with spaces, ``@``, escaped quotes and backslashes, UTF-8 local parts and
  domains (composed and decomposed forms, which NFC would merge), upper-case domains and
  domains with a trailing dot (the contract compares domains only lower-cased), IP
  literals, ``Postmaster`` without a domain, a 64-octet local part, a 255-octet domain,
  and an address of exactly ``MAX_ADDRESS`` characters (the contract's limit; RFC 5321
  stops at 256 octets in a path, the contract stores more);
* ``bodies``: empty, with and without a final CRLF, ending in a bare CR or LF, lines of
  dots (``.``, ``..``, ``.\\r\\n``, ``\\r\\n.\\r\\n``), bare CR and bare LF inside, NULs
  and bytes that are not UTF-8 (a body is any bytes), lines of 998, 1001 and 70 000
  octets;
* ``schedules``: times 0 and 1 (the past), now, 2**31-1 and beyond (2038), up to
  ``MAX_SCHEDULE`` (2**63-1, the largest ``validate_schedule`` takes); attempts from 0
  to ``MAX_SCHEDULE``; reasons of UTF-8 up to ``MAX_REASON`` octets (one of exactly
  1000 octets in 2-, 3- and 4-octet characters, one cut to it), with CR, LF and NUL.

What the contract refuses (``refused_addresses``, ``refused_schedules``) must be refused
with ``InvalidInputError`` and leave nothing stored; ``tests/test_mail_data.py`` runs
that property on the project's backends.
"""

from __future__ import annotations

import random
import time

from hypothesis import strategies as st

from queue_ref.storage import MAX_ADDRESS, MAX_REASON, Schedule
from queue_ref.storage import MAX_SCHEDULE as MAX_SCHEDULE

__all__ = ["CORPUS_BODY", "CORPUS_RCPTS", "CORPUS_SCHEDULES", "CORPUS_SENDER", "MAX_DOMAIN",
           "MAX_LOCAL", "NOW", "addresses", "bodies", "draw_address", "draw_body",
           "draw_reason", "draw_schedule", "draw_sender", "fit_address", "reasons",
           "refused_addresses", "refused_schedules", "schedules", "senders"]

#: RFC 5321 4.5.3.1: octets of a local part, and of a domain.
MAX_LOCAL = 64
MAX_DOMAIN = 255
#: "Now", taken once when the module is imported (a due entry's schedule).
NOW = int(time.time())

_ATEXT = "abcXYZ019!#$%&'*+-/=?^_`{|}~"
_UTF8 = "\u00e9\u00c9\u00df\u0130\u03b4\u039b\u7528\u6237\u0436\u212b\U0001f600"
_LDH = "abzABZ09-"

#: Addresses a backend is likely to get wrong, each a mailbox of its own: case, quoting,
#: Unicode forms (``P\u00e9rez`` composed and decomposed, the Angstrom sign), trailing dots,
#: IP literals, the RFC limits and the contract's.
EXAMPLES = (
    "Rcpt@a.example", "RCPT@a.example", "rcpt@A.EXAMPLE.", "rcpt@a.example.",
    '"john doe"@a.example', '"a\\"b"@a.example', '"a@b"@c.example', '"\\\\"@a.example',
    '" "@b.example', "P\u00e9rez@b.example", "Pe\u0301rez@b.example",
    "\u212bngstr\u00f6m@c.example", "\u00c5ngstr\u00f6m@c.example",
    "\u7528\u6237@\u4f8b\u5b50.\u5e7f\u544a", "x@B\u00fccher.example", "x@B\u00dcCHER.example.",
    "\u03b4\u03bf\u03ba\u03b9\u03bc\u03ae@\u03c0\u03b1\u03c1\u03ac\u03b4\u03b5\u03b9\u03b3\u03bc\u03b1.\u03b4\u03bf\u03ba\u03b9\u03bc\u03ae",
    "user@[192.0.2.1]", "user@[IPv6:2001:db8::1]", "Postmaster",
    "L" * MAX_LOCAL + "@" + ".".join(["D" * 63] * 4),
    "\u00e9" * (MAX_LOCAL // 2) + "@b.example",
    "x" * (MAX_ADDRESS - len("@a.example")) + "@a.example",
)


def _octets(s: str) -> int:
    return len(s.encode("utf-8"))


_dot_atoms = st.lists(st.text(st.sampled_from(_ATEXT + _UTF8), min_size=1, max_size=12),
                      min_size=1, max_size=3).map(".".join)
_quoted = st.text(st.sampled_from(' abcXY@."\\' + _UTF8), max_size=16).map(
    lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
local_parts = st.one_of(_dot_atoms, _quoted).filter(lambda s: _octets(s) <= MAX_LOCAL)

_labels = st.one_of(st.text(st.sampled_from(_LDH), min_size=1, max_size=63)
                    .filter(lambda s: s[0] != "-" and s[-1] != "-"),
                    st.text(st.sampled_from(_UTF8 + "abcXY"), min_size=1, max_size=10))
_names = st.builds("{}{}".format, st.lists(_labels, min_size=1, max_size=4).map(".".join),
                   st.sampled_from(("", "."))).filter(lambda s: _octets(s) <= MAX_DOMAIN)
_literals = st.one_of(
    st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: "[{}.{}.{}.{}]".format(*t)),
    st.integers(0, 2**128 - 1).map(lambda n: f"[IPv6:{n:x}::1]"))
domains = st.one_of(_names, _literals)

#: Recipients' and senders' addresses: the examples, then generated ones.
addresses = st.one_of(st.sampled_from(EXAMPLES),
                      st.builds("{}@{}".format, local_parts, domains))
senders = st.one_of(st.just(""), addresses)

_PIECES = (b".", b"..", b".\r\n", b"..\r\n", b"\r\n.\r\n", b"\r", b"\n", b"\r\n", b"\x00",
           b"From me\r\n", "Gr\u00fc\u00dfe \u2603\r\n".encode(), b"\xff\xfe\x80", b" \t",
           b"x" * 78 + b"\r\n")


def _long_line(n: int) -> bytes:
    """A line of ``n`` octets without CRLF (998 is RFC 5322's most, 70 000 spans writes)."""
    return b"y" * n


#: How a body ends: a final CRLF or not, a bare CR or LF, a dot line, the DATA terminator.
ENDINGS = (b"", b"\r\n", b"\r", b"\n", b".", b".\r\n", b"\r\n.\r\n", b"\r\n\r\n")
bodies = st.builds(
    lambda parts, end: b"".join(parts) + end,
    st.lists(st.one_of(st.sampled_from(_PIECES), st.binary(max_size=40),
                       st.sampled_from((998, 1001, 70_000)).map(_long_line)), max_size=8),
    st.sampled_from(ENDINGS))

#: Times: the past, now, 2038 and beyond, the largest; then any the contract allows.
TIMES = (0, 1, NOW, 2**31 - 1, 2**31, 2**32, 2**53 + 1, MAX_SCHEDULE)
COUNTS = (0, 1, 255, 256, 2**31 - 1, 2**32, MAX_SCHEDULE)
#: Reasons of exactly MAX_REASON octets in 2-, 3- and 4-octet characters, one a character
#: past it (Schedule cuts it to whole characters), and the forms NFC would change.
REASON_EXAMPLES = ("", "\u00e9" * (MAX_REASON // 2), "\u2603" * (MAX_REASON // 3) + "a",
                   "\U0001f600" * (MAX_REASON // 4), "a" * (MAX_REASON - 1) + "\u00e9",
                   "421 4.4.2 Pe\u0301rez\r\n", "x\x00y\r\rz\n", "\u212b \u00c5")
reasons = st.one_of(st.sampled_from(REASON_EXAMPLES), st.text(max_size=200))
schedules = st.builds(
    Schedule, st.one_of(st.sampled_from(TIMES), st.integers(0, MAX_SCHEDULE)),
    st.one_of(st.sampled_from(COUNTS), st.integers(0, MAX_SCHEDULE)), reasons)


def fit_address(address: str, limit: int) -> str:
    """``address`` cut to ``limit`` characters (a backend's ``Limits.max_address``), its
    domain kept: the local part loses its start."""
    if len(address) <= limit:
        return address
    local, at, domain = address.rpartition("@")
    keep = limit - len(at) - len(domain)
    if keep <= 0:
        return address[-limit:]
    return local[len(local) - keep:] + at + domain


# ---- plain draws: the same data without the Hypothesis engine -------------------------
#
# Callers that run outside Hypothesis (threads and child processes of the concurrency
# checks) draw from a seeded ``random.Random``: half the time one of the examples above,
# else data made the way the strategies make it.  The same seed gives the same data.

def _draw_text(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _draw_local(rng: random.Random) -> str:
    while True:
        if rng.random() < 0.7:
            local = ".".join(_draw_text(rng, _ATEXT + _UTF8, 1, 12)
                             for _ in range(rng.randint(1, 3)))
        else:
            raw = _draw_text(rng, ' abcXY@."\\' + _UTF8, 0, 16)
            local = '"' + raw.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if _octets(local) <= MAX_LOCAL:
            return local


def _draw_label(rng: random.Random) -> str:
    if rng.random() < 0.7:
        label = _draw_text(rng, _LDH, 1, rng.choice((8, 63)))
        if label[0] == "-":
            label = "a" + label[1:]
        return label[:-1] + "Z" if label[-1] == "-" else label
    return _draw_text(rng, _UTF8 + "abcXY", 1, 10)


def _draw_domain(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.05:
        return "[{}.{}.{}.{}]".format(*(rng.randrange(256) for _ in range(4)))
    if k < 0.1:
        return f"[IPv6:{rng.getrandbits(128):x}::1]"
    while True:
        name = ".".join(_draw_label(rng) for _ in range(rng.randint(1, 4)))
        name += rng.choice(("", "", "."))
        if _octets(name) <= MAX_DOMAIN:
            return name


def draw_address(rng: random.Random) -> str:
    """An address as ``addresses`` gives them: one of ``EXAMPLES`` or a generated one (a
    dot-atom or quoted local part, UTF-8 or not, at a domain of LDH or UTF-8 labels, with
    a trailing dot or not, or an IP literal), within the RFC limits."""
    if rng.random() < 0.5:
        return rng.choice(EXAMPLES)
    return _draw_local(rng) + "@" + _draw_domain(rng)


def draw_sender(rng: random.Random) -> str:
    """A sender: the null sender now and then, else ``draw_address``."""
    return "" if rng.random() < 0.1 else draw_address(rng)


def draw_body(rng: random.Random, *, long_lines: bool = True) -> bytes:
    """A body as ``bodies`` gives them: pieces of mail (dot lines, bare CR and LF, NUL,
    bytes that are not UTF-8), random bytes, now and then a line of 998, 1001 or (with
    ``long_lines``) 70 000 octets, and one of ``ENDINGS``."""
    parts: list[bytes] = []
    for _ in range(rng.randint(0, 8)):
        k = rng.random()
        if k < 0.6:
            parts.append(rng.choice(_PIECES))
        elif k < 0.95:
            parts.append(rng.randbytes(rng.randint(0, 40)))
        else:
            parts.append(_long_line(rng.choice((998, 1001, 70_000) if long_lines
                                               else (998, 1001))))
    return b"".join(parts) + rng.choice(ENDINGS)


#: Characters a drawn reason is made of: ASCII, CR, LF, NUL, tab, 2- to 4-octet UTF-8,
#: and forms NFC would change.
_REASON_CHARS = "abcXYZ 0129.:-<>@\r\n\x00\t" + _UTF8 + "e\u0301\u212b\u00c5\u2603"


def draw_reason(rng: random.Random) -> str:
    """A reason: one of ``REASON_EXAMPLES`` or up to 200 characters of text."""
    if rng.random() < 0.5:
        return rng.choice(REASON_EXAMPLES)
    return _draw_text(rng, _REASON_CHARS, 0, 200)


def draw_schedule(rng: random.Random) -> Schedule:
    """A schedule as ``schedules`` gives them: a time of ``TIMES`` (the past, now, 2038
    and beyond, the largest) or any up to MAX_SCHEDULE, a count likewise, a reason."""
    at = rng.choice(TIMES) if rng.random() < 0.5 else rng.randint(0, MAX_SCHEDULE)
    attempts = rng.choice(COUNTS) if rng.random() < 0.5 else rng.randint(0, MAX_SCHEDULE)
    return Schedule(at, attempts, draw_reason(rng))


#: One message of mail's data that a check reading the queue back can start from, so that
#: a store getting one of its fields wrong fails on every seed: a decomposed UTF-8
#: sender (NFC would compose it), recipients with an upper-case local part, the Angstrom
#: sign (NFC and lower-casing change it) and a domain with a trailing dot, schedules past
#: 2038 and in the past with reasons of CRLF and decomposed UTF-8, and a body of dot
#: lines, bare CR and LF, a NUL, a byte that is not UTF-8 and a final CRLF.
CORPUS_SENDER = "Pe\u0301rez@b.example"
CORPUS_RCPTS = ("Rcpt@a.example", "\u212bngstr\u00f6m@c.example.")
CORPUS_SCHEDULES = (Schedule(2**31, 1, "421 4.4.2 Pe\u0301rez\r\ntimed out"),
                    Schedule(0, 0, "\u212b \u00c5"))
CORPUS_BODY = b"Subject: corpus\r\n\r\n.\r\n..x\r\nbare\rCR, bare\nLF, \x00, \xff\r\nend\r\n"


# ---- what the contract refuses ------------------------------------------------------------

def _with(address: str, bad: str, at: int) -> str:
    i = at % (len(address) + 1)
    return address[:i] + bad + address[i:]


#: Addresses the contract refuses (``validate_address``): NUL, CR or LF anywhere, longer
#: than MAX_ADDRESS characters, not a str.  (An empty recipient is refused too; an empty
#: sender is the null sender.)
refused_addresses: st.SearchStrategy[object] = st.one_of(
    st.builds(_with, addresses, st.sampled_from(("\x00", "\r", "\n", "\r\n")),
              st.integers(0, MAX_ADDRESS)),
    addresses.map(lambda a: "x" * (MAX_ADDRESS + 1 - len(a)) + a if len(a) <= MAX_ADDRESS
                  else a),
    st.sampled_from((b"rcpt@a.example", None, 5, ["rcpt@a.example"])))


def _forged(at: object, attempts: object, reason: object) -> Schedule:
    """A Schedule made past its own checks (as a caller's bug or a pickle may make one)."""
    s = object.__new__(Schedule)
    for name, value in (("at", at), ("attempts", attempts), ("reason", reason)):
        object.__setattr__(s, name, value)
    return s


#: Schedules ``validate_schedule`` refuses: a time or count below 0 or above
#: MAX_SCHEDULE, not an int (a float, a bool), a reason of more than MAX_REASON octets or
#: not encodable as UTF-8 (a lone surrogate), a reason that is not a str.
refused_schedules = st.one_of(
    st.builds(_forged, st.sampled_from((-1, MAX_SCHEDULE + 1, 2**64, 1.5, True, float("nan"))),
              st.just(0), st.just("")),
    st.builds(_forged, st.just(0), st.sampled_from((-1, MAX_SCHEDULE + 1, 2.0, False)),
              st.just("")),
    st.builds(_forged, st.just(0), st.just(0),
              st.sampled_from(("\u00e9" * (MAX_REASON // 2) + "a", "x\ud800y", b"r", None))))
