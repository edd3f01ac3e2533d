"""What LevelDB's manifest says about its write-ahead log, read without opening LevelDB.

LevelDB replays, at open, every log file it finds whose number is at least the log number
its manifest names, and says nothing about a log it does not find: a log removed after a
crash (no clean close recorded what the store held) loses every write acknowledged since
the last table was written, without a word.  So the LevelDB engine reads the manifest
first and refuses to open when the log it names is missing (``missing_log``).  A newer
log (LevelDB starts one when its memtable fills, and names it in the manifest only once
the old memtable is a table) is not named anywhere LevelDB keeps: its removal in that
window is not seen here.

The manifest (``CURRENT`` names it) is a LevelDB log file: 32 KiB blocks of records, each
with a 7-byte header (masked CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last; a
block's last 6 bytes or fewer are zero padding), whose payloads are ``VersionEdit``s: a
sequence of varint tags and fields (``version_edit.cc``).  Tag 2 is the log number (9,
the previous log number, is 0 in LevelDB 1.22 and not looked at).  The CRCs are not
checked here: LevelDB checks them itself with ``paranoid_checks``; a manifest that does
not parse cleanly is left to LevelDB to judge, and this module answers None.
"""

from __future__ import annotations

import os

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
#: VersionEdit tags (``version_edit.cc``)
COMPARATOR, LOG_NUMBER, NEXT_FILE, LAST_SEQUENCE = 1, 2, 3, 4
COMPACT_POINTER, DELETED_FILE, NEW_FILE, PREV_LOG_NUMBER = 5, 6, 7, 9
MAX_MANIFEST = 64 << 20


class _Bad(Exception):
    """The bytes do not parse as LevelDB writes them."""


def _records(data: bytes) -> list[bytes]:
    """The payloads of a LevelDB log file's records (a torn last record left out)."""
    out: list[bytes] = []
    partial: bytearray | None = None
    pos = 0
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's trailer
            pos += left
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:  # zero padding (a preallocated or torn end)
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        if len(body) < length or HEADER + length > left:
            break  # a torn tail: the last write, cut short
        pos += HEADER + length
        if kind == FULL and partial is None:
            out.append(bytes(body))
        elif kind == FIRST and partial is None:
            partial = bytearray(body)
        elif kind in (MIDDLE, LAST) and partial is not None:
            partial += body
            if kind == LAST:
                out.append(bytes(partial))
                partial = None
        else:
            raise _Bad(f"record of type {kind} at byte {pos}")
    return out


def _varint(b: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(b) or shift > 63:
            raise _Bad("a varint runs past its record")
        byte = b[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _slice(b: bytes, pos: int) -> int:
    n, pos = _varint(b, pos)
    if pos + n > len(b):
        raise _Bad("a slice runs past its record")
    return pos + n


def _log_numbers(edit: bytes) -> tuple[int | None, int | None]:
    """The log number and previous log number a VersionEdit sets (None: not set)."""
    log = prev = None
    pos = 0
    while pos < len(edit):
        tag, pos = _varint(edit, pos)
        if tag == COMPARATOR:
            pos = _slice(edit, pos)
        elif tag in (LOG_NUMBER, PREV_LOG_NUMBER):
            value, pos = _varint(edit, pos)
            if tag == LOG_NUMBER:
                log = value
            else:
                prev = value
        elif tag in (NEXT_FILE, LAST_SEQUENCE):
            pos = _varint(edit, pos)[1]
        elif tag == COMPACT_POINTER:
            pos = _slice(edit, _varint(edit, pos)[1])
        elif tag == DELETED_FILE:
            pos = _varint(edit, _varint(edit, pos)[1])[1]
        elif tag == NEW_FILE:
            pos = _varint(edit, _varint(edit, _varint(edit, pos)[1])[1])[1]
            pos = _slice(edit, _slice(edit, pos))
        else:
            raise _Bad(f"unknown VersionEdit tag {tag}")
    return log, prev


def log_numbers(path: str) -> tuple[int, int] | None:
    """(log number, previous log number) the current manifest of the LevelDB store in
    ``path`` names last; None if there is no ``CURRENT``, or the manifest is missing,
    too large or does not parse (LevelDB judges those itself)."""
    try:
        with open(os.path.join(path, "CURRENT"), "rb") as f:
            name = f.read(256).decode("ascii").strip()
        if not name.startswith("MANIFEST-") or "/" in name:
            return None
        with open(os.path.join(path, name), "rb") as f:
            data = f.read(MAX_MANIFEST + 1)
    except (OSError, UnicodeDecodeError):
        return None
    if len(data) > MAX_MANIFEST:
        return None
    log = prev = 0
    try:
        for edit in _records(data):
            got_log, got_prev = _log_numbers(edit)
            log = got_log if got_log is not None else log
            prev = got_prev if got_prev is not None else prev
    except _Bad:
        return None
    return log, prev


def log_name(number: int) -> str:
    return f"{number:06d}.log"


def missing_log(path: str) -> str | None:
    """The name of a log file the current manifest says holds writes not yet in a table,
    if it is missing from ``path``; else None."""
    got = log_numbers(path)
    if got is None or not got[0]:  # 0: a store created, or written by RepairDB, not
        return None  # opened since: no log holds writes yet
    name = log_name(got[0])
    return None if os.path.exists(os.path.join(path, name)) else name
