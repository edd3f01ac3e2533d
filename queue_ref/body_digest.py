"""The check a stored body carries: CRC-32 in what a queue writes now, sha256 in what an
older filesystem queue wrote.

A body's digest is written with its message when the message is committed and computed
again over every byte read back; a mismatch is damage (C6), and the last bytes of
altered mail are never handed out.  The digest guards against accidental damage at rest
(a flipped bit, a torn, zeroed or stale range), not against someone who can rewrite the
queue's files (they could rewrite the digest too).  For that, CRC-32 is what ext4,
Btrfs and LevelDB check their blocks with: it detects every error burst of up to 32
bits and every error of one or two bits in a body under 512 MiB, and misses other
damage with a probability of 2**-32.  It costs about 0.15 ms per MB where sha256 costs
0.5-0.7 ms, and a relay computes it twice per message (written, then read back to be
sent), so for large mail the cheaper check is a tenth of the relay's CPU.

A digest is ``crc32:`` and eight hex digits; 64 hex digits are a sha256 (the format
before), still checked as such, so a queue written by an older version opens and
delivers as it is.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping

__all__ = ["BodyDigest", "is_digest", "is_sha256", "recorded_digest"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CRC32 = re.compile(r"crc32:[0-9a-f]{8}")


def is_sha256(digest: str) -> bool:
    """Whether ``digest`` is a sha256 (64 lowercase hex digits: the older format)."""
    return _SHA256.fullmatch(digest) is not None


def is_digest(digest: str) -> bool:
    """Whether ``digest`` is one ``BodyDigest.value`` can give (CRC-32 or sha256)."""
    return _CRC32.fullmatch(digest) is not None or is_sha256(digest)


def recorded_digest(fields: Mapping[str, object], new: str, old: str) -> str:
    """The body digest a record holds: a CRC-32 under ``new``, or a sha256 under ``old``
    (the name older versions wrote it under), exactly one of the two.  ValueError, naming
    the field, for anything else: the record is damaged, not guessed at."""
    if (new in fields) == (old in fields):
        raise ValueError(f"not exactly one of {new} and {old}")
    name, form, want = ((new, _CRC32, "a CRC-32 digest") if new in fields
                        else (old, _SHA256, "a sha256"))
    digest = fields[name]
    if not isinstance(digest, str) or form.fullmatch(digest) is None:
        raise ValueError(f"{name} is not {want}")
    return digest


class BodyDigest:
    """The running digest of a body, fed its bytes in order.  ``like``: a digest already
    recorded, whose kind this one computes (a sha256 for a body an older version wrote);
    None: CRC-32, the kind written now."""

    __slots__ = ("_crc", "_sha")

    def __init__(self, like: str | None = None) -> None:
        self._sha = hashlib.sha256() if like is not None and is_sha256(like) else None
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str:
        """The digest of the bytes fed so far, as it is recorded."""
        if self._sha is not None:
            return self._sha.hexdigest()
        return f"crc32:{self._crc:08x}"
