"""Choosing crash states: candidate choices, keys, and building the disk of a choice.

Keys name a choice in terms of trace indexes, so a key read in a report rebuilds the same
state from the same trace: ``"all"`` (every pending operation persisted), otherwise parts
joined by ``-``: ``d3.5~9`` dropped units #3 and #5 to #9 (every pending one in that range),
``t7:512`` write #7 torn after 512 bytes, ``g8`` write #8 left as garbage.  A key is
canonical: ``decode`` rejects any spelling ``encode`` would not produce.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

from faultinject.disk import DiskImage
from faultinject.fault_errors import ModelError
from faultinject.inodes import FsState
from faultinject.ops import Create, DataOp, EntryOp, SyncOp
from faultinject.persistence import Choice, Opt, PersistenceModel, Unit
from faultinject.replay import Replayed

#: "drop op i, keep through j" pairs look at j = i+1 .. i+WINDOW and at the last unit.
WINDOW = 3

_PART = re.compile(r"^([dtg])(.+)$")


def encode(units: Sequence[Unit], choice: Choice) -> str:
    parts: list[str] = []
    runs: list[str] = []
    pos = 0
    while pos < len(units):
        if choice[pos] != "d":
            pos += 1
            continue
        end = pos
        while end + 1 < len(units) and choice[end + 1] == "d":
            end += 1
        a, b = units[pos].index, units[end].index
        runs.append(str(a) if a == b else f"{a}~{b}")
        pos = end + 1
    if runs:
        parts.append("d" + ".".join(runs))
    torn = [f"{u.index}:{o}" for u, o in zip(units, choice, strict=True) if isinstance(o, int)]
    if torn:
        parts.append("t" + ".".join(torn))
    junk = [str(u.index) for u, o in zip(units, choice, strict=True) if o == "g"]
    if junk:
        parts.append("g" + ".".join(junk))
    return "-".join(parts) or "all"


def decode(model: PersistenceModel, units: Sequence[Unit], key: str) -> Choice:
    """The choice ``key`` names; ``ModelError`` if it names no valid state of ``model``."""
    pos_of = {u.index: p for p, u in enumerate(units)}
    out: list[Opt] = ["k"] * len(units)

    def unit_pos(text: str) -> int:
        if not text.isdigit() or int(text) not in pos_of:
            raise ModelError(f"key {key!r}: {text!r} is not a pending operation of this trace "
                             f"under {model.name}")
        return pos_of[int(text)]

    try:
        for part in ([] if key == "all" else key.split("-")):
            m = _PART.match(part)
            if m is None:
                raise ModelError(f"key {key!r}: cannot read {part!r}")
            kind, body = m.groups()
            for item in body.split("."):
                if kind == "d":
                    lo, _, hi = item.partition("~")
                    first, last = unit_pos(lo), unit_pos(hi or lo)
                    for p in range(first, last + 1):
                        out[p] = "d"
                elif kind == "t":
                    idx, _, n = item.partition(":")
                    if not n.isdigit():
                        raise ModelError(f"key {key!r}: bad torn write {item!r}")
                    out[unit_pos(idx)] = int(n)
                else:
                    out[unit_pos(item)] = "g"
    except ValueError as e:
        if isinstance(e, ModelError):
            raise
        raise ModelError(f"key {key!r}: {e}") from e
    choice = tuple(out)
    if model.repair(units, choice) != choice or encode(units, choice) != key:
        raise ModelError(f"key {key!r} does not name a crash state of model {model.name!r} "
                         "for this trace")
    return choice


def candidates(
    model: PersistenceModel,
    units: Sequence[Unit],
    *,
    exhaustive_limit: int,
    random_states: int,
    seed: int,
) -> Iterator[Choice]:
    """Choices to try, in a fixed order (may repeat; the caller deduplicates)."""
    n = len(units)
    yield ("k",) * n
    if n == 0:
        return
    if n <= exhaustive_limit and model.count(units) <= 2 ** exhaustive_limit:
        yield from model.enumerate(units)
        return
    for raw in _targeted(units):
        yield model.repair(units, raw)
    rng = random.Random(seed)
    seen: set[Choice] = set()
    for _ in range(4 * random_states):
        if len(seen) >= random_states:
            break
        choice = model.random_choice(units, rng)
        if choice not in seen:
            seen.add(choice)
            yield choice


def _targeted(units: Sequence[Unit]) -> Iterator[Choice]:
    n = len(units)
    yield ("d",) * n
    for p in range(1, n):  # every prefix
        yield ("k",) * p + ("d",) * (n - p)
    for i in range(n):  # drop op i, keep through j
        for j in sorted({*range(i + 1, min(n, i + WINDOW + 1)), n - 1}):
            if j > i:
                yield ("k",) * i + ("d",) + ("k",) * (j - i) + ("d",) * (n - j - 1)
    for p, u in enumerate(units):  # splits (torn or garbage) of one op
        for opt in u.options:
            if opt not in ("k", "d"):
                yield ("k",) * p + (opt,) + ("k",) * (n - p - 1)
                yield ("k",) * p + (opt,) + ("d",) * (n - p - 1)


class Builder:
    """Builds the disk image of a choice: durable operations, then the chosen pending ones.

    Inodes whose creation is pending exist from the start, as orphans (no name reaches
    them until their creation is applied), so the data of a file whose name did not persist
    lands somewhere nobody sees.  An operation that cannot be applied raises
    ``ModelError``: with the dependency closure of the models (``Unit.needs``) that is a
    bug, never something to skip.
    """

    def __init__(self, replayed: Replayed, units: Sequence[Unit]) -> None:
        self.units = units
        self.pos_of = {u.index: p for p, u in enumerate(units)}
        first = units[0].index if units else None
        self.base = replayed.initial.copy()
        self.tail: list[EntryOp | DataOp] = []
        for op in replayed.ops:
            if isinstance(op, SyncOp):
                continue
            if first is None or op.index < first:
                _apply(self.base, op, "durable")
            else:
                self.tail.append(op)
        for op in self.tail:
            if isinstance(op, Create):
                self.base.add_orphan(op)

    def state(self, choice: Choice) -> FsState:
        s = self.base.copy()
        for op in self.tail:
            pos = self.pos_of.get(op.index)
            opt: Opt = "k" if pos is None else choice[pos]
            if opt == "d":
                continue
            what = "durable" if pos is None else "kept"
            if opt == "k":
                _apply(s, op, what)
            elif opt == "g":
                _apply(s, op, what, junk=True)
            else:
                assert isinstance(opt, int)
                _apply(s, op, what, keep=opt)
        return s

    def image(self, choice: Choice) -> DiskImage:
        return self.state(choice).to_image()


def _apply(state: FsState, op: EntryOp | DataOp, what: str, *, keep: int | None = None,
           junk: bool = False) -> None:
    try:
        state.apply(op, keep=keep, junk=junk)
    except ModelError as e:
        raise ModelError(f"cannot build the crash state: {what} operation #{op.index} does not "
                         f"apply ({e}); its dependencies were not kept") from e


def describe(model: PersistenceModel, replayed: Replayed, units: Sequence[Unit],
             choice: Choice, *, limit: int = 12) -> str:
    """Human-readable: which pending operations were dropped, torn or kept."""
    durable = sum(1 for op in replayed.ops if not isinstance(op, SyncOp)) - len(units)
    head = f"{model.name}: {durable} operation(s) durable"
    if not units:
        return head + "; nothing pending: every applied call persisted"

    def label(u: Unit) -> str:
        text = replayed.events[u.index].short()
        return text + (" (its fsync failed)" if u.lost else "")

    def listing(items: list[str]) -> str:
        shown = items[:limit]
        more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
        return "; ".join(shown) + more

    dropped = [label(u) for u, o in zip(units, choice, strict=True) if o == "d"]
    torn = [f"{label(u)} keeping {o} of {len(getattr(u.op, 'data', b''))} bytes"
            for u, o in zip(units, choice, strict=True) if isinstance(o, int)]
    junk = [label(u) for u, o in zip(units, choice, strict=True) if o == "g"]
    kept = [label(u) for u, o in zip(units, choice, strict=True) if o == "k"]
    if len(kept) == len(units):
        return f"{head}; all {len(units)} pending persisted: " + listing(kept)
    parts = [head, f"{len(units)} pending"]
    if kept:
        parts.append("kept: " + listing(kept))
    if dropped:
        parts.append("dropped: " + listing(dropped))
    if torn:
        parts.append("torn: " + listing(torn))
    if junk:
        parts.append("garbage: " + listing(junk))
    return "; ".join(parts)
