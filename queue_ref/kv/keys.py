"""Key encoding of the KV queue (the layout of seed 000, extended).

Every key is ASCII bytes made of space-separated fields.  Numbers are zero-padded to a
fixed width, so bytewise order is numeric order and a zone's entries iterate oldest
message first::

    message <id> #                  creation record: the message is committed
    message <id> *                  metadata record (envelope, recipients, body digest)
    message <id> <seq>              body chunk number seq (1, 2, ...), 64 KiB each
    live <id>                       how many entries of the message are not cleaned up
    delivery-zone <zone> <id> <idx> a QUEUED entry (address, schedule)
    domain <domain> <id> <idx>      the same entry, indexed by recipient domain (ETRN)
    inflight <id> <idx>             an INFLIGHT entry (address, zone, schedule, owner)
    held <id> <idx>                 a HELD entry (address, zone, schedule): never claimed
    cleanup <id> <idx>              a PENDING_CLEANUP entry
    seq                             high-water mark of message ids
    quarantine <original key>       bytes that failed their checksum, moved aside

``#`` and ``*`` sort before the digits, so a message's records come before its chunks.
Zones and domains are free text, so they are percent-escaped: the escaped form has no
space, so no zone's prefix is a prefix of another's.  Keys never contain an address
verbatim except through the escaped domain, and nothing here is ever a file name.
"""

from __future__ import annotations

import functools
import re

ID_WIDTH = 20  # message ids: up to 2**64
SEQ_WIDTH = 8  # body chunks: up to 10**8 - 1 chunks of 64 KiB
IDX_WIDTH = 6  # recipients: up to 10**6 - 1 per message

_LIMITS = {w: 10**w for w in (ID_WIDTH, SEQ_WIDTH, IDX_WIDTH)}

MAX_ID = 10**ID_WIDTH - 1
MAX_SEQ = 10**SEQ_WIDTH - 1
MAX_RCPTS = 10**IDX_WIDTH - 1

MESSAGE = b"message "
LIVE = b"live "
ZONE = b"delivery-zone "
DOMAIN = b"domain "
INFLIGHT = b"inflight "
CLEANUP = b"cleanup "
HELD = b"held "
QUARANTINE = b"quarantine "
SEQ = b"seq"

#: Key families that hold queue data (footprint counts these, not seq or quarantine).
DATA_FAMILIES = (MESSAGE, LIVE, ZONE, DOMAIN, INFLIGHT, CLEANUP, HELD)

CREATED = b"#"
META = b"*"
QUARANTINE_MARK = b"!"  # quarantine message <id> ! : the message's chunks go to quarantine

_SAFE = frozenset(b"!\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
                  b"abcdefghijklmnopqrstuvwxyz{|}~")
_ENTRY_ID = re.compile(r"(0|[1-9][0-9]{0,19})\.(0|[1-9][0-9]{0,5})")


class BadKey(ValueError):
    """A key of a known family that does not parse (treated as corruption)."""


@functools.lru_cache(maxsize=4096)
def escape(text: str) -> bytes:
    """Zone or domain as a key field: printable ASCII without space or ``%``."""
    raw = text.encode("utf-8", "surrogatepass")
    return b"".join(bytes([c]) if c in _SAFE else b"%%%02X" % c for c in raw)


def unescape(field: bytes) -> str:
    out = bytearray()
    i = 0
    while i < len(field):
        c = field[i]
        if c == 0x25:  # %
            try:
                out.append(int(field[i + 1:i + 3], 16))
            except ValueError as e:
                raise BadKey(f"bad escape in {field!r}") from e
            i += 3
        else:
            out.append(c)
            i += 1
    return out.decode("utf-8", "surrogatepass")


def num(n: int, width: int) -> bytes:
    if not 0 <= n < (_LIMITS.get(width) or 10**width):
        raise ValueError(f"{n} does not fit in {width} digits")
    return b"%0*d" % (width, n)


def parse_num(field: bytes, width: int) -> int:
    if len(field) != width or not field.isdigit():
        raise BadKey(f"{field!r} is not a {width}-digit number")
    return int(field)


def end_of(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


# ---- message keys ---------------------------------------------------------------------


def message_prefix(mid: int) -> bytes:
    return MESSAGE + num(mid, ID_WIDTH) + b" "


def created(mid: int) -> bytes:
    return message_prefix(mid) + CREATED


def meta(mid: int) -> bytes:
    return message_prefix(mid) + META


def chunk(mid: int, seq: int) -> bytes:
    return message_prefix(mid) + num(seq, SEQ_WIDTH)


def parse_message(key: bytes) -> tuple[int, bytes]:
    """``message <id> <tail>`` -> (id, tail); tail is ``#``, ``*`` or a seq field."""
    parts = key.split(b" ")
    if len(parts) != 3 or parts[0] != MESSAGE.strip():
        raise BadKey(f"not a message key: {key!r}")
    return parse_num(parts[1], ID_WIDTH), parts[2]


def live(mid: int) -> bytes:
    return LIVE + num(mid, ID_WIDTH)


def parse_live(key: bytes) -> int:
    parts = key.split(b" ")
    if len(parts) != 2 or parts[0] != LIVE.strip():
        raise BadKey(f"not a live key: {key!r}")
    return parse_num(parts[1], ID_WIDTH)


# ---- entry keys -----------------------------------------------------------------------


def _entry_tail(mid: int, idx: int) -> bytes:
    return num(mid, ID_WIDTH) + b" " + num(idx, IDX_WIDTH)


def zone_prefix(zone: str) -> bytes:
    return ZONE + escape(zone) + b" "


def zone(zone_name: str, mid: int, idx: int) -> bytes:
    return zone_prefix(zone_name) + _entry_tail(mid, idx)


def domain_of(address: str) -> str:
    """The part after the last ``@``, lower-cased (the whole address if it has none)."""
    return address.rpartition("@")[2].lower()


def domain_prefix(domain: str) -> bytes:
    return DOMAIN + escape(domain) + b" "


def domain(domain_name: str, mid: int, idx: int) -> bytes:
    return domain_prefix(domain_name) + _entry_tail(mid, idx)


def inflight(mid: int, idx: int) -> bytes:
    return INFLIGHT + _entry_tail(mid, idx)


def cleanup(mid: int, idx: int) -> bytes:
    return CLEANUP + _entry_tail(mid, idx)


def held(mid: int, idx: int) -> bytes:
    return HELD + _entry_tail(mid, idx)


def parse_indexed(key: bytes) -> tuple[str, int, int]:
    """``delivery-zone|domain <name> <id> <idx>`` -> (name, id, idx)."""
    parts = key.split(b" ")
    if len(parts) != 4:
        raise BadKey(f"not an indexed entry key: {key!r}")
    return (unescape(parts[1]), parse_num(parts[2], ID_WIDTH),
            parse_num(parts[3], IDX_WIDTH))


def parse_entry(key: bytes) -> tuple[int, int]:
    """``inflight|cleanup <id> <idx>`` -> (id, idx)."""
    parts = key.split(b" ")
    if len(parts) != 3:
        raise BadKey(f"not an entry key: {key!r}")
    return parse_num(parts[1], ID_WIDTH), parse_num(parts[2], IDX_WIDTH)


def quarantine(key: bytes) -> bytes:
    return QUARANTINE + key


def quarantine_mark(mid: int) -> bytes:
    return QUARANTINE + message_prefix(mid) + QUARANTINE_MARK


# ---- ids as the Storage interface shows them ------------------------------------------


def entry_id(mid: int, idx: int) -> str:
    return f"{mid}.{idx}"


def parse_entry_id(eid: str) -> tuple[int, int]:
    m = _ENTRY_ID.fullmatch(eid)
    if m is None:
        raise ValueError(f"not an entry id of this queue: {eid!r}")
    mid, idx = int(m.group(1)), int(m.group(2))
    if mid > MAX_ID or idx > MAX_RCPTS:
        raise ValueError(f"entry id out of range: {eid!r}")
    return mid, idx
