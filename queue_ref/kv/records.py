"""Values of the KV queue: JSON records that carry their own checksum.

Every record is a JSON object in canonical form (sorted keys, no spaces, ASCII) with a
field ``k`` naming its kind and a field ``sum``: the first 16 hex digits of the SHA-256 of
the canonical form of the other fields.  ``unseal`` refuses a record whose bytes, kind or
fields do not check out by raising ``BadRecord``; the queue then quarantines it.

Body chunks are raw bytes; the metadata record holds the SHA-256 of the whole body, which
``read_inflight`` checks before it hands out the last bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from queue_ref.kv import keys
from spec import Schedule

QUEUED = "queued"
INFLIGHT = "inflight"
CLEANUP = "cleanup"
STATES = (QUEUED, INFLIGHT, CLEANUP)


class BadRecord(ValueError):
    """A stored value failed its checksum or does not have the expected shape."""


def _canon(obj: Mapping[str, object]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _sum(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]


def seal(obj: Mapping[str, object]) -> bytes:
    """The record's bytes, checksum included."""
    return _canon({**obj, "sum": _sum(_canon(obj))})


def unseal(raw: bytes, kind: str) -> dict[str, Any]:
    """The fields of a record of ``kind`` (without ``sum``); BadRecord if it fails."""
    try:
        obj = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRecord(f"not a JSON record: {e}") from None
    if not isinstance(obj, dict):
        raise BadRecord("not a JSON object")
    got = obj.pop("sum", None)
    if got != _sum(_canon(obj)):
        raise BadRecord("checksum mismatch")
    if obj.get("k") != kind:
        raise BadRecord(f"expected a {kind} record, found {obj.get('k')!r}")
    return obj


def _get(obj: Mapping[str, Any], name: str, typ: type) -> Any:
    v = obj.get(name)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise BadRecord(f"field {name!r} is not a {typ.__name__}")
    return v


def _schedule(obj: Mapping[str, Any]) -> Schedule:
    try:
        return Schedule(_get(obj, "at", int), _get(obj, "n", int))
    except ValueError as e:
        raise BadRecord(str(e)) from None


# ---- entries --------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryRec:
    """One entry, as stored under delivery-zone, inflight or cleanup keys."""

    mid: int
    idx: int
    state: str
    address: str
    zone: str
    schedule: Schedule
    owner: str = ""

    def encode(self) -> bytes:
        return seal({
            "k": "entry", "e": keys.entry_id(self.mid, self.idx), "state": self.state,
            "addr": self.address, "zone": self.zone, "at": self.schedule.at,
            "n": self.schedule.attempts, "owner": self.owner,
        })

    @staticmethod
    def decode(raw: bytes, mid: int, idx: int, state: str) -> EntryRec:
        """Decode and check that the record belongs under the key it was read from."""
        obj = unseal(raw, "entry")
        if obj.get("e") != keys.entry_id(mid, idx):
            raise BadRecord(f"record of entry {obj.get('e')!r} under entry {mid}.{idx}")
        if obj.get("state") != state:
            raise BadRecord(f"record in state {obj.get('state')!r} under a {state} key")
        return EntryRec(mid, idx, state, _get(obj, "addr", str), _get(obj, "zone", str),
                        _schedule(obj), _get(obj, "owner", str))


def domain_value(mid: int, idx: int, zone: str) -> bytes:
    return seal({"k": "domain", "e": keys.entry_id(mid, idx), "zone": zone})


def decode_domain(raw: bytes, mid: int, idx: int) -> str:
    """The zone a domain-index record points at."""
    obj = unseal(raw, "domain")
    if obj.get("e") != keys.entry_id(mid, idx):
        raise BadRecord("domain record of another entry")
    zone: str = _get(obj, "zone", str)
    return zone


# ---- messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class MetaRec:
    """The envelope of a committed message (``message <id> *``)."""

    mid: int
    mail_from: str
    params: Mapping[str, str]
    size: int
    sha256: str
    chunks: int
    created: int
    rcpts: tuple[tuple[str, str], ...]  # (address, zone) per recipient index

    def encode(self) -> bytes:
        return seal({
            "k": "meta", "id": self.mid, "from": self.mail_from, "params": dict(self.params),
            "size": self.size, "sha256": self.sha256, "chunks": self.chunks,
            "created": self.created, "rcpts": [list(r) for r in self.rcpts],
        })

    @property
    def zones(self) -> frozenset[str]:
        return frozenset(z for _, z in self.rcpts)

    @staticmethod
    def decode(raw: bytes, mid: int) -> MetaRec:
        obj = unseal(raw, "meta")
        if obj.get("id") != mid:
            raise BadRecord(f"metadata of message {obj.get('id')!r} under message {mid}")
        params = _get(obj, "params", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise BadRecord("params are not str to str")
        rcpts = []
        for r in _get(obj, "rcpts", list):
            if not (isinstance(r, list) and len(r) == 2
                    and isinstance(r[0], str) and isinstance(r[1], str)):
                raise BadRecord("malformed recipient")
            rcpts.append((r[0], r[1]))
        return MetaRec(mid, _get(obj, "from", str), params, _get(obj, "size", int),
                       _get(obj, "sha256", str), _get(obj, "chunks", int),
                       _get(obj, "created", int), tuple(rcpts))


def created_value(mid: int, at_ns: int) -> bytes:
    return seal({"k": "created", "id": mid, "at": at_ns})


def check_created(raw: bytes, mid: int) -> int:
    obj = unseal(raw, "created")
    if obj.get("id") != mid:
        raise BadRecord("creation record of another message")
    at: int = _get(obj, "at", int)
    return at


def live_value(mid: int, n: int) -> bytes:
    return seal({"k": "live", "id": mid, "n": n})


def decode_live(raw: bytes, mid: int) -> int:
    obj = unseal(raw, "live")
    if obj.get("id") != mid:
        raise BadRecord("live count of another message")
    n: int = _get(obj, "n", int)
    if n < 1:
        raise BadRecord(f"live count {n} < 1")
    return n


def seq_value(next_id: int) -> bytes:
    return seal({"k": "seq", "next": next_id})


def decode_seq(raw: bytes) -> int:
    n: int = _get(unseal(raw, "seq"), "next", int)
    if n < 0:
        raise BadRecord("negative id high-water mark")
    return n
