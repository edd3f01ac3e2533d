"""Values of the KV queue: JSON records that carry their own checksum.

Every record is a JSON object (sorted keys, no spaces, ASCII) with a field ``k`` naming
its kind and, last, a field ``sum``: the first 16 hex digits of the SHA-256 of the exact
bytes of the object without it (``{...}``, the bytes before ``,"sum":`` plus the closing
brace).  So checking a record hashes its bytes as stored and never re-encodes it, and a
record is written with one JSON encoding.  ``unseal`` refuses a record whose bytes, kind
or fields do not check out by raising ``BadRecord``; the queue then quarantines it.

Body chunks are raw bytes; the metadata record holds the digest of the whole body
(``body_digest``: a CRC-32, or a sha256 in a record an older version wrote), which
``read_inflight`` checks before it hands out the last bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _q
from typing import Any

from queue_ref.body_digest import is_sha256, recorded_digest
from queue_ref.kv import keys
from spec import Schedule

QUEUED = "queued"
INFLIGHT = "inflight"
CLEANUP = "cleanup"
HELD = "held"
STATES = (QUEUED, INFLIGHT, CLEANUP, HELD)


class BadRecord(ValueError):
    """A stored value failed its checksum or does not have the expected shape."""


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)
_SUM_HEAD = b',"sum":"'
_SUM_LEN = 16
_TRAILER = len(_SUM_HEAD) + _SUM_LEN + 2  # ,"sum":"<16 hex>"}


def _sum(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest()[:_SUM_LEN].encode("ascii")


def seal(obj: Mapping[str, object]) -> bytes:
    """The record's bytes, checksum included (``obj`` must not have a ``sum`` field)."""
    return _seal_body(_ENCODER.encode(obj).encode("ascii"))


def _seal_body(body: bytes) -> bytes:
    return body[:-1] + _SUM_HEAD + _sum(body) + b'"}'


# The records written on every operation are formatted directly, in the exact form the
# encoder above gives (sorted keys, no spaces, ASCII), which skips building a dict and
# the encoder's per-call setup.  _q is json's C string quoting.
_ENTRY_FMT = ('{"addr":%s,"at":%d,"e":"%d.%d","k":"entry","n":%d,"owner":%s,"state":%s,'
              '%s"zone":%s}')  # the optional "why":<reason>, field, in sorted place
_DOMAIN_FMT = '{"e":"%d.%d","k":"domain","zone":%s}'
_LIVE_FMT = '{"id":%d,"k":"live","n":%d}'
_CREATED_FMT = '{"at":%d,"id":%d,"k":"created"}'
_META_FMT = ('{"chunks":%d,"created":%d,"digest":%s,"from":%s,"id":%d,"k":"meta","params":%s,'
             '"rcpts":[%s],"size":%d}')
#: The metadata record as versions before the CRC-32 body digest wrote it (a sha256).
_META_FMT_SHA256 = ('{"chunks":%d,"created":%d,"from":%s,"id":%d,"k":"meta","params":%s,'
                    '"rcpts":[%s],"sha256":%s,"size":%d}')


def unseal(raw: bytes, kind: str) -> dict[str, Any]:
    """The fields of a record of ``kind`` (without ``sum``); BadRecord if it fails."""
    cut = len(raw) - _TRAILER
    if cut < 1 or raw[cut:cut + len(_SUM_HEAD)] != _SUM_HEAD or raw[-2:] != b'"}':
        raise BadRecord("not a sealed record")
    body = raw[:cut] + b"}"
    if raw[cut + len(_SUM_HEAD):-2] != _sum(body):
        raise BadRecord("checksum mismatch")
    try:
        obj = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRecord(f"not a JSON record: {e}") from None
    if not isinstance(obj, dict):
        raise BadRecord("not a JSON object")
    if obj.get("k") != kind:
        raise BadRecord(f"expected a {kind} record, found {obj.get('k')!r}")
    return obj


def _get(obj: Mapping[str, Any], name: str, typ: type) -> Any:
    v = obj.get(name)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise BadRecord(f"field {name!r} is not a {typ.__name__}")
    return v


def _schedule(obj: Mapping[str, Any]) -> Schedule:
    why = obj.get("why", "")  # absent: no reason (and every record written before reasons)
    if not isinstance(why, str):
        raise BadRecord("field 'why' is not a str")
    try:
        return Schedule(_get(obj, "at", int), _get(obj, "n", int), why)
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
        """``seal`` of {k: entry, e, state, addr, zone, at, n, owner} and, when the
        schedule has a reason, ``why``: formatted directly."""
        why = self.schedule.reason
        return _seal_body((_ENTRY_FMT % (
            _q(self.address), self.schedule.at, self.mid, self.idx, self.schedule.attempts,
            _q(self.owner), _q(self.state), f'"why":{_q(why)},' if why else "",
            _q(self.zone))).encode("ascii"))

    def moved(self, state: str, *, owner: str = "", schedule: Schedule | None = None) -> EntryRec:
        """The same entry in ``state`` (with ``owner``, and ``schedule`` if given)."""
        return EntryRec(self.mid, self.idx, state, self.address, self.zone,
                        self.schedule if schedule is None else schedule, owner)

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


@dataclass(frozen=True)
class Stored:
    """An entry record as this process wrote it or last checked it: its exact bytes and
    their decoding.  Handles carry one, so an operation that reads the same bytes back
    needs no second decoding (equal bytes passed the checksum already)."""

    raw: bytes
    rec: EntryRec

    @staticmethod
    def of(rec: EntryRec) -> Stored:
        return Stored(rec.encode(), rec)


def domain_value(mid: int, idx: int, zone: str) -> bytes:
    """``seal`` of {k: domain, e, zone}."""
    return _seal_body((_DOMAIN_FMT % (mid, idx, _q(zone))).encode("ascii"))


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
    #: ``body_digest.BodyDigest.value`` of the body: CRC-32, or a sha256 in a record an
    #: older version wrote (written again under its old field name, ``sha256``)
    digest: str
    chunks: int
    created: int
    rcpts: tuple[tuple[str, str], ...]  # (address, zone) per recipient index

    def encode(self) -> bytes:
        """``seal`` of {k: meta, id, from, params, size, digest, chunks, created, rcpts}
        (``sha256`` in place of ``digest`` for a sha256)."""
        params = _ENCODER.encode(dict(self.params)) if self.params else "{}"
        rcpts = ",".join(f"[{_q(a)},{_q(z)}]" for a, z in self.rcpts)
        if is_sha256(self.digest):
            return _seal_body((_META_FMT_SHA256 % (
                self.chunks, self.created, _q(self.mail_from), self.mid, params, rcpts,
                _q(self.digest), self.size)).encode("ascii"))
        return _seal_body((_META_FMT % (
            self.chunks, self.created, _q(self.digest), _q(self.mail_from), self.mid, params,
            rcpts, self.size)).encode("ascii"))

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
        try:  # sha256: written by an older version
            digest = recorded_digest(obj, "digest", "sha256")
        except ValueError as e:
            raise BadRecord(str(e)) from None
        return MetaRec(mid, _get(obj, "from", str), params, _get(obj, "size", int),
                       digest, _get(obj, "chunks", int),
                       _get(obj, "created", int), tuple(rcpts))


def created_value(mid: int, at_ns: int) -> bytes:
    """``seal`` of {k: created, id, at}."""
    return _seal_body((_CREATED_FMT % (at_ns, mid)).encode("ascii"))


def check_created(raw: bytes, mid: int) -> int:
    obj = unseal(raw, "created")
    if obj.get("id") != mid:
        raise BadRecord("creation record of another message")
    at: int = _get(obj, "at", int)
    return at


def live_value(mid: int, n: int) -> bytes:
    """``seal`` of {k: live, id, n}."""
    return _seal_body((_LIVE_FMT % (mid, n)).encode("ascii"))


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
