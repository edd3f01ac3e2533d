"""Damage to one file of a queue's directory, for damage-at-rest: the ways a file is
damaged (a bit flip, a framing flip, a structure flip outside every body, a truncation, a
tail cut, a removal), where a store's own structure lies among message bodies, which
messages lie whole after a flipped bit, and a copy of a queue directory that keeps its
hard links and symbolic links as they are."""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("bit flip", "framing flip", "truncation", "tail cut", "removal")
NOTHING = "none"  # the deep template's first trial: no damage, everything reads back
STRUCTURE = "structure flip"  # a bit flip outside every body: in the store's own framing
FRAMING = 32  # a framing flip hits one of the last FRAMING bytes of a file
#: Damage that adds a name: a link beside one of the store's (a symbolic link to the same
#: target, or another hard link to the same file), its name's last number 7 more
#: (``queue/<m>.1`` gets ``queue/<m>.8``: an entry the message never had).  Stores link
#: only what they wrote, so a name they did not write is damage too; it must not be
#: served as an entry.
STRAY = "stray link"
#: ``end flip <k>``: the top bit of the k-th byte from a file's end flipped (the sweep
#: picks the first zero byte of each run of zeros among the last FRAMING bytes outside
#: every body): a footer's fields (counts, offsets), small for their width, made large.
END_FLIP = "end flip"


def copy_tree(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` as it is: symbolic links as links, and the names of one
    file as names of one file (hard links), so damage to one name is damage to all of
    them, as on the disk (``shutil.copytree`` would make each name a file of its own)."""
    seen: dict[tuple[int, int], str] = {}
    os.mkdir(dst)
    for d, dirs, names in os.walk(src):
        rel = os.path.relpath(d, src)
        for n in dirs:
            s = os.path.join(d, n)
            if os.path.islink(s):
                os.symlink(os.readlink(s), os.path.join(dst, rel, n))
            else:
                os.mkdir(os.path.join(dst, rel, n))
        for n in names:
            s, t = os.path.join(d, n), os.path.join(dst, rel, n)
            st = os.lstat(s)
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
            elif (st.st_dev, st.st_ino) in seen:
                os.link(seen[(st.st_dev, st.st_ino)], t)
            else:
                shutil.copy2(s, t)
                if st.st_nlink > 1:
                    seen[(st.st_dev, st.st_ino)] = t


def stray_name(name: str) -> str:
    """``name`` with its last run of digits 7 more (``"m.1"`` -> ``"m.8"``), or ``.7``
    added when it has none."""
    m = re.search(r"[0-9]+(?=[^0-9]*$)", name)
    if m is None:
        return name + ".7"
    return f"{name[:m.start()]}{int(m.group()) + 7}{name[m.end():]}"


def files_of(root: str) -> list[str]:
    out = []
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.islink(p) or os.path.isfile(p):
                out.append(os.path.relpath(p, root))
    return sorted(out)


@dataclass(frozen=True)
class Damage:
    what: str  # for the finding
    flipped: int | None = None  # the offset of a flipped bit in a regular file


PIECE = 1024  # bodies are looked for in a file as pieces of this size
#: How far past the last piece found the next one is looked for (a record's header, a
#: key between two chunks); a piece not there is looked for anywhere only every STRIDE.
SLACK = 4096
STRIDE = 64 * 1024


def outside_bodies(data: bytes, bodies: list[bytes]) -> list[tuple[int, int]]:
    """The ranges ``[start, end)`` of ``data`` that hold no piece of a body: a store's own
    structure (keys, lengths, headers, indexes), where a flip is not caught by a body's
    digest.  Bodies are found as aligned pieces of PIECE bytes, each looked for just
    after the last one found (a store keeps a body's chunks in order), else anywhere at
    every STRIDE of the body: linear in the data, whatever part of a body it holds."""
    covered: list[tuple[int, int]] = []
    for body in bodies:
        at: int | None = None  # where the next piece should be, while on the track
        for k in range(0, len(body) - PIECE + 1, PIECE):
            piece = body[k:k + PIECE]
            pos = -1 if at is None else data.find(piece, at, at + PIECE + SLACK)
            if pos < 0 and k % STRIDE == 0:
                pos = data.find(piece)
            if pos < 0:  # not here (a header between two pieces, or not in this file)
                at = None if at is None else at + PIECE
                continue
            covered.append((pos, pos + PIECE))
            at = pos + PIECE
    out: list[tuple[int, int]] = []
    end = 0
    for a, b in sorted(covered):
        if a > end:
            out.append((end, a))
        end = max(end, b)
    if end < len(data):
        out.append((end, len(data)))
    return out


def damage(path: Path, kind: str, rng: random.Random,
           outside: Callable[[bytes], list[tuple[int, int]]] | None = None) -> Damage:
    """Damage ``path`` in place; returns what was done (``outside``: the ranges of a
    file's bytes that hold no body, ``outside_bodies``, where a structure flip lands)."""
    if kind == NOTHING:
        return Damage("nothing damaged")
    if kind == "removal":
        path.unlink()
        return Damage(f"removed {path.name}")
    if kind == STRAY:
        name = stray_name(path.name)
        if path.is_symlink():
            os.symlink(os.readlink(path), path.with_name(name))
            return Damage(f"added {name} beside {path.name}, a link to the same target")
        os.link(path, path.with_name(name))
        return Damage(f"added {name} beside {path.name}, another name of the same file")
    if path.is_symlink():
        target = bytearray(os.readlink(path).encode())
        if kind in ("bit flip", STRUCTURE):
            i = rng.randrange(len(target))
            target[i] ^= 1 << rng.randrange(7)  # stays ASCII: a valid, wrong target
            what = f"flipped a bit of {path.name}'s target"
        else:
            del target[rng.randrange(len(target)):]
            what = f"cut {path.name}'s target to {len(target)} bytes"
        path.unlink()
        os.symlink(bytes(target) or b"x", path)
        return Damage(what)
    data = bytearray(path.read_bytes())
    if not data:
        path.write_bytes(b"\x01")
        return Damage(f"wrote a byte into the empty {path.name}")
    flipped: int | None = None
    if kind.startswith(END_FLIP + " "):
        i = max(0, len(data) - int(kind[len(END_FLIP) + 1:]))
        data[i] ^= 0x80
        what = f"flipped the top bit of byte {i} of {path.name} ({len(data)} bytes)"
        flipped = i
    elif kind == STRUCTURE:
        ranges = outside(bytes(data)) if outside is not None else [(0, len(data))]
        total = sum(b - a for a, b in ranges)
        pick = rng.randrange(total) if total else rng.randrange(len(data))
        i = pick
        for a, b in ranges if total else []:
            if pick < b - a:
                i = a + pick
                break
            pick -= b - a
        data[i] ^= 1 << rng.randrange(8)
        what = (f"flipped bit of byte {i} of {path.name} ({len(data)} bytes), outside every "
                f"body ({total} such bytes)")
        flipped = i
    elif kind == "bit flip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        what = f"flipped bit of byte {i} of {path.name} ({len(data)} bytes)"
        flipped = i
    elif kind == "framing flip":
        # Framing (a record's length or offset) often sits at the end of a file, and as
        # decimal digits in a text format: aim at a digit there when there is one, and
        # flip one of the low four bits (a digit stays a digit, a length grows or shrinks).
        tail = range(max(0, len(data) - FRAMING), len(data))
        digits = [j for j in tail if 0x30 <= data[j] <= 0x39]
        i = rng.choice(digits or list(tail))
        data[i] ^= 1 << rng.randrange(4)
        what = (f"flipped a low bit of byte {i} of {path.name} ({len(data)} bytes), in its "
                f"last {FRAMING}")
        flipped = i
    else:  # a truncation keeps any length; a tail cut loses at most the last quarter
        keep = (rng.randrange(len(data)) if kind == "truncation"
                else len(data) - 1 - rng.randrange(max(1, len(data) // 4)))
        del data[keep:]
        what = f"cut {path.name} to {keep} of its bytes"
    path.write_bytes(bytes(data))
    return Damage(what, flipped)


def held_whole(root: str, bodies: dict[str, bytes]) -> dict[str, str]:
    """The messages whose body lies whole, as one run of bytes, in a regular file under
    ``root`` (the first such file of each, relative to ``root``).  A store that names a
    message lost keeps the damaged files aside for salvage, never deletes them (C6): a
    body whole on the disk before the open must still be whole there after it, unless
    the message was delivered."""
    found: dict[str, str] = {}
    for rel in files_of(root):
        path = os.path.join(root, rel)
        if os.path.islink(path) or len(found) == len(bodies):
            continue
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue  # gone or unreadable: holds nothing
        for m, body in bodies.items():
            if m not in found and body and data.find(body) >= 0:
                found[m] = rel
    return found


#: How far from a flipped bit an id is looked for (the damaged record's other keys), and
#: how long a word must be to be taken for an id: a store writes ids padded or long
#: (``message 00000000000000000042``, hex names), where a short number is anything.
ID_WINDOW = 64 * 1024
ID_WORD = 8


def ids_readable(data: bytes, ids: set[str], at: int) -> set[str]:
    """The ids of ``ids`` (message ids as the store gives them) that ``data`` holds within
    ``ID_WINDOW`` bytes of byte ``at`` (a flipped bit) as a word of their own: a run of
    letters and digits of at least ``ID_WORD`` characters, bounded by other bytes, that is
    the id, leading zeros aside.  A flipped bit changes one byte, so the ids of a damaged
    record's other keys stay readable there, and a store that reads the damaged bytes for
    ids names them."""
    want = {i.encode().lstrip(b"0") or b"0": i for i in ids}
    found: set[str] = set()
    near = data[max(0, at - ID_WINDOW):at + ID_WINDOW]
    for word in re.findall(rb"[0-9A-Za-z]{%d,}" % ID_WORD, near):
        got = want.get(word.lstrip(b"0") or b"0")
        if got is not None:
            found.add(got)
            if len(found) == len(want):
                break
    return found


def after_flip(path: Path, at: int | None, bodies: dict[str, bytes]) -> dict[str, int]:
    """The messages whose body lies whole in the file ``path`` after byte ``at`` and after
    another message's body that lies whole after it (the offset of each): a flip damages
    one record, which may hold the next body after it (its header, the flip's record), but
    not the body after that one.  Those are undamaged records of a log, which recovery
    must keep."""
    if at is None or path.is_symlink() or not path.is_file():
        return {}
    data = path.read_bytes()
    found = sorted((pos, m) for m, body in bodies.items() if (pos := data.find(body)) > at)
    if not found:
        return {}
    first_end = found[0][0] + len(bodies[found[0][1]])
    return {m: pos for pos, m in found[1:] if pos >= first_end}
