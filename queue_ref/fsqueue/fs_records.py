"""Checksummed JSON records: the envelope of a message and the schedule of an entry.

A record is one header line and a JSON payload::

    qr-record 1 <sha256 of payload, hex> <payload length>\\n<payload>

Decoding checks the header, the length, the checksum, the record's kind and the type of
every field; any mismatch raises ``RecordError``, which the queue turns into quarantine and
``CorruptionError``.  A torn, truncated, garbage or misplaced record never decodes.

A message file is the body, then its envelope record, then a trailer of ``TRAILER_LEN``
bytes giving the record's length (``qr-envelope <12 digits>\\n``), so the envelope is found
from the end of the file without reading the body.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from queue_ref.body_digest import is_sha256, recorded_digest
from queue_ref.storage import Recipient, Schedule

MAGIC = b"qr-record 1"
TRAILER_MAGIC = b"qr-envelope "
TRAILER_LEN = len(TRAILER_MAGIC) + 13
MAX_RECORD = 10 ** 12 - 1


class RecordError(ValueError):
    """A record failed its checksum or its shape."""


def encode(kind: str, payload: Mapping[str, object]) -> bytes:
    body = json.dumps({"kind": kind, **payload}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode("ascii")
    digest = hashlib.sha256(body).hexdigest().encode("ascii")
    return MAGIC + b" " + digest + b" " + str(len(body)).encode("ascii") + b"\n" + body


def decode(data: bytes, kind: str) -> dict[str, Any]:
    head, sep, body = data.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 4 or b" ".join(parts[:2]) != MAGIC:
        raise RecordError("bad record header")
    if not parts[3].isdigit() or int(parts[3]) != len(body):
        raise RecordError(f"record length {len(body)} does not match its header")
    if hashlib.sha256(body).hexdigest().encode("ascii") != parts[2]:
        raise RecordError("record checksum mismatch")
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise RecordError(f"record is not JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise RecordError(f"record is not a {kind} record")
    return obj


def trailer(record_len: int) -> bytes:
    """The trailer that follows an envelope record of ``record_len`` bytes."""
    if not 0 < record_len <= MAX_RECORD:
        raise ValueError(f"envelope record of {record_len} bytes")
    return TRAILER_MAGIC + b"%012d\n" % record_len


def parse_trailer(data: bytes) -> int:
    """The record length a trailer gives; ``RecordError`` if ``data`` is not a trailer."""
    digits = data[len(TRAILER_MAGIC):-1]
    if (len(data) != TRAILER_LEN or not data.startswith(TRAILER_MAGIC)
            or not data.endswith(b"\n") or not digits.isdigit()):
        raise RecordError("bad message trailer")
    n = int(digits)
    if n == 0:
        raise RecordError("message trailer gives an empty envelope")
    return n


def _int(obj: Mapping[str, Any], key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise RecordError(f"field {key!r} is not a non-negative int")
    return v


def _str(obj: Mapping[str, Any], key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise RecordError(f"field {key!r} is not a string")
    return v


def _schedule(at: object, attempts: object, reason: object = "") -> Schedule:
    try:
        return Schedule(at, attempts, reason)  # type: ignore[arg-type]
    except ValueError as e:
        raise RecordError(str(e)) from e


@dataclass(frozen=True)
class Envelope:
    """Everything about a message except its body bytes and per-entry schedule changes."""

    msgid: str
    mail_from: str
    params: dict[str, str]
    body_size: int
    #: ``body_digest.BodyDigest.value`` of the body: CRC-32, or sha256 in an envelope an
    #: older version wrote (kept under its old field name when written again)
    body_digest: str
    rcpts: tuple[Recipient, ...]

    def encode(self) -> bytes:
        return encode("envelope", {
            "msgid": self.msgid,
            "mail_from": self.mail_from,
            "params": self.params,
            "body_size": self.body_size,
            ("body_sha256" if is_sha256(self.body_digest) else "body_digest"): self.body_digest,
            "rcpts": [[r.address, r.zone, r.schedule.at, r.schedule.attempts]
                      + ([r.schedule.reason] if r.schedule.reason else [])
                      for r in self.rcpts],
        })

    @staticmethod
    def decode(data: bytes, msgid: str) -> Envelope:
        obj = decode(data, "envelope")
        if obj.get("msgid") != msgid:
            raise RecordError(f"envelope belongs to {obj.get('msgid')!r}, not {msgid}")
        params = obj.get("params")
        if not isinstance(params, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise RecordError("envelope params are not a mapping of str to str")
        raw = obj.get("rcpts")
        if not isinstance(raw, list) or not raw:
            raise RecordError("envelope has no recipients")
        rcpts = []
        for r in raw:
            if (not isinstance(r, list) or len(r) not in (4, 5) or not isinstance(r[0], str)
                    or not isinstance(r[1], str) or (len(r) == 5 and not isinstance(r[4], str))):
                raise RecordError("malformed recipient in envelope")
            rcpts.append(Recipient(r[0], _schedule(*r[2:]), r[1]))
        try:  # body_sha256: written by an older version
            digest = recorded_digest(obj, "body_digest", "body_sha256")
        except ValueError as e:
            raise RecordError(f"envelope: {e}") from None
        return Envelope(msgid, _str(obj, "mail_from"), dict(params), _int(obj, "body_size"),
                        digest, tuple(rcpts))


def encode_schedule(entry_id: str, schedule: Schedule) -> bytes:
    """The schedule record: its reason is a field of the same record (written only when
    not empty, so a record without one is also what the format wrote before reasons)."""
    fields: dict[str, object] = {"entry": entry_id, "at": schedule.at,
                                 "attempts": schedule.attempts}
    if schedule.reason:
        fields["reason"] = schedule.reason
    return encode("schedule", fields)


def decode_schedule(data: bytes, entry_id: str) -> Schedule:
    obj = decode(data, "schedule")
    if obj.get("entry") != entry_id:
        raise RecordError(f"schedule record belongs to {obj.get('entry')!r}, not {entry_id}")
    reason = obj.get("reason", "")
    if not isinstance(reason, str):
        raise RecordError("field 'reason' is not a string")
    return _schedule(_int(obj, "at"), _int(obj, "attempts"), reason)
