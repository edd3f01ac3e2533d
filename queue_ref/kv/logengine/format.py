"""On-disk names and encodings of the log engine (log records, batches, the manifest).

Files in a database directory::

    LOCK               flock'ed while an engine has the DB open (no content)
    CURRENT            "MANIFEST-<n>\\n": names the live manifest; replaced by CURRENT.tmp + rename
    MANIFEST-<n>       the live log number and the live tables, oldest first, each with the
                       run (one table written in pieces) it belongs to (text, CRC line)
    <n>.log            write-ahead log: one framed record per WriteBatch
    <n>.tbl            immutable sorted table (see ``table.py``); written as <n>.tbl.tmp first
    quarantine/        damaged files kept aside (never deleted)

Every number ``<n>`` is 6+ decimal digits and unique over the life of the database.

Log record framing (little endian)::

    u32 length of payload | u32 crc32(length bytes + payload) | payload

Batch payload::

    u32 count, then per operation: u8 kind (1 put, 0 delete) | u32 key length | key
                                   | (put only) u32 value length | value
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

from queue_ref.kv.engine_errors import DatabaseCorruptError

LOCK = "LOCK"
CURRENT = "CURRENT"
QUARANTINE = "quarantine"  # a directory: damaged files kept aside, never deleted
REPAIR = "REPAIR"  # present while ``queue-ref repair`` rebuilds the store (``kv/salvage.py``)
MANIFEST_PREFIX = "MANIFEST-"

_NUMBERED = re.compile(r"^(?:MANIFEST-(\d{6,})|(\d{6,})\.(log|tbl)(\.tmp)?)$")

HEADER = struct.Struct("<II")
_U32 = struct.Struct("<I")
_PUT = 1
_DEL = 0
MAX_RECORD = (1 << 32) - 1

Op = tuple[bytes, bytes | None]


def log_name(number: int) -> str:
    return f"{number:06d}.log"


def table_name(number: int) -> str:
    return f"{number:06d}.tbl"


def manifest_name(number: int) -> str:
    return f"{MANIFEST_PREFIX}{number:06d}"


def parse_name(name: str) -> tuple[str, int] | None:
    """``("log"|"tbl"|"tmp"|"manifest", number)`` for a file of ours, else None."""
    m = _NUMBERED.match(name)
    if m is None:
        return None
    if m.group(1) is not None:
        return "manifest", int(m.group(1))
    kind = "tmp" if m.group(4) else m.group(3)
    return kind, int(m.group(2))


# ---- log records --------------------------------------------------------------------


_OP_HEAD = struct.Struct("<BI")


#: A batch whose values hold this many octets is not joined twice (``encode_batch``): a
#: CRC a part costs less than a second copy of a body's chunks (a batch of small values:
#: the other way round).
_JOIN_ONCE = 256 * 1024


def encode_batch(ops: list[Op]) -> bytes:
    """The framed log record of one batch."""
    head = _OP_HEAD.pack
    u32 = _U32.pack
    parts = [u32(len(ops))]
    add = parts.append
    values = 0  # octets of the values: a batch of a body's chunks is not joined twice
    for key, value in ops:
        if value is None:
            add(head(_DEL, len(key)))
            add(key)
        else:
            add(head(_PUT, len(key)))
            add(key)
            n = len(value)
            values += n
            add(u32(n))
            add(value)
    if values < _JOIN_ONCE:  # one CRC over the payload joined: fewer calls
        payload = b"".join(parts)
        if len(payload) > MAX_RECORD:
            raise ValueError(f"a batch of {len(payload)} bytes exceeds the {MAX_RECORD}-byte "
                             "limit")
        length = u32(len(payload))
        return length + u32(zlib.crc32(payload, zlib.crc32(length))) + payload
    size = sum(map(len, parts))
    if size > MAX_RECORD:
        raise ValueError(f"a batch of {size} bytes exceeds the {MAX_RECORD}-byte limit")
    length = u32(size)
    crc = zlib.crc32(length)
    for part in parts:  # a CRC a part, and the record joined once with its header in
        crc = zlib.crc32(part, crc)  # front (joining the payload first copied it twice)
    return b"".join([length, u32(crc), *parts])


def check_record(header: bytes, payload: bytes) -> bool:
    """Whether ``payload`` matches the CRC in its ``header``."""
    crc: int = HEADER.unpack(header)[1]
    return zlib.crc32(payload, zlib.crc32(header[:4])) == crc


def decode_batch(payload: bytes) -> list[Op] | None:
    """The operations of a CRC-checked payload, or None if its structure is invalid."""
    try:
        (count,) = _U32.unpack_from(payload, 0)
        pos = 4
        ops: list[Op] = []
        for _ in range(count):
            kind, klen = _OP_HEAD.unpack_from(payload, pos)
            pos += 5
            key = payload[pos : pos + klen]
            pos += klen
            if kind == _PUT:
                (vlen,) = _U32.unpack_from(payload, pos)
                pos += 4
                value: bytes | None = payload[pos : pos + vlen]
                pos += vlen
            elif kind == _DEL:
                value = None
            else:
                return None
            if pos > len(payload):
                return None
            ops.append((key, value))
    except struct.error:
        return None
    return ops if pos == len(payload) else None


# ---- manifest ------------------------------------------------------------------------

_MAGIC = "queue-ref-logengine-manifest 1"


@dataclass(frozen=True)
class Manifest:
    """The durable description of the database: what recovery reads first.

    ``runs``: for each table, the id of its run (the pieces of one table written, which
    the engine takes as one table: ``engine.py``), or empty for each a run of its own.  A
    line ``table <n> <size>`` is a table whose run id is its own number (every table a
    manifest without pieces names, as manifests written before there were pieces do);
    ``table <n> <size> <run>`` names the run otherwise.  The tables of one run are next
    to each other.
    """

    next_file: int
    log_number: int
    tables: tuple[tuple[int, int], ...]  # (number, size in bytes), oldest first
    runs: tuple[int, ...] = ()

    def run_ids(self) -> tuple[int, ...]:
        """The run id of each table (its own number unless ``runs`` says otherwise)."""
        return self.runs if self.runs else tuple(n for n, _ in self.tables)

    def encode(self) -> bytes:
        if len(self.run_ids()) != len(self.tables):
            raise ValueError("a manifest needs one run id per table")
        lines = [_MAGIC, f"next_file {self.next_file}", f"log {self.log_number}"]
        lines += [f"table {n} {size}" if run == n else f"table {n} {size} {run}"
                  for (n, size), run in zip(self.tables, self.run_ids(), strict=True)]
        body = "\n".join(lines) + "\n"
        return (body + f"crc {zlib.crc32(body.encode()):08x}\n").encode()

    @staticmethod
    def decode(path: str, data: bytes) -> Manifest:
        try:
            text = data.decode("ascii")
            body, _, tail = text.rpartition("crc ")
            if tail != f"{zlib.crc32(body.encode()):08x}\n":
                raise DatabaseCorruptError(path, "manifest checksum mismatch")
            lines = body.splitlines()
            if not lines or lines[0] != _MAGIC:
                raise DatabaseCorruptError(path, "not a log engine manifest")
            fields = dict(line.split(" ", 1) for line in lines[1:3])
            tables = []
            runs: list[int] = []
            seen: set[int] = set()
            for line in lines[3:]:
                word, number, size, *run = line.split(" ")
                if word != "table" or len(run) > 1:
                    raise DatabaseCorruptError(path, f"unexpected line {line!r}")
                run_id = int(run[0]) if run else int(number)
                if run_id in seen and runs[-1] != run_id:
                    raise DatabaseCorruptError(path, f"run {run_id} is not in one place")
                tables.append((int(number), int(size)))
                runs.append(run_id)
                seen.add(run_id)
            return Manifest(int(fields["next_file"]), int(fields["log"]), tuple(tables),
                            tuple(runs))
        except (UnicodeDecodeError, ValueError, KeyError) as e:
            raise DatabaseCorruptError(path, f"unparseable manifest ({e})") from e
