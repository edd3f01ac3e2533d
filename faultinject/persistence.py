"""Persistence models: which operations a power cut may lose, tear or reorder.

A model looks at the inode-level operations of a trace and splits them into the ones that
are durable for sure (applied to every crash state) and *units*: pending operations, each
with the options a crash may leave it in:

* ``"k"`` kept (persisted whole), ``"d"`` dropped (never reached the disk);
* an ``int`` n: a torn write, of which only the first n bytes reached the disk;
* ``"g"``: the write's size persisted but its bytes are garbage.

A *choice* gives one option per unit (a tuple in unit order).  ``repair`` maps any choice to a
valid one of the model; ``enumerate`` lists every valid choice.  Whatever the model, a choice
is valid only if the set of operations it applies is closed under ``needs``
(``faultinject.ops``): a durable operation makes what it needs durable, a kept one keeps
what it needs.  See docs/persistence-models.md for the assumptions and sources.
"""

from __future__ import annotations

import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from faultinject.ops import (
    DataOp,
    EntryOp,
    Op,
    SyncDir,
    SyncFile,
    SyncFs,
    SyncOp,
    Truncate,
    Write,
    entry_dirs,
)

Opt = str | int
Choice = tuple[Opt, ...]

SECTOR = 512
PAGE = 4096


def tear_points(offset: int, length: int, grains: Sequence[int]) -> tuple[int, ...]:
    """Byte counts at which a write of ``length`` bytes at ``offset`` may tear.

    For each grain (512: a sector, 4096: a page or block), the first and the last file offset
    inside the write that is a multiple of the grain; as counts of bytes kept.
    """
    end = offset + length
    points: set[int] = set()
    for grain in grains:
        first = (offset // grain + 1) * grain
        last = ((end - 1) // grain) * grain
        if first < end:
            points.add(first - offset)
        if last > offset:
            points.add(last - offset)
    return tuple(sorted(points))


@dataclass(frozen=True)
class Unit:
    """A pending operation and what a crash may leave of it.

    ``group`` is ``"free"`` (independent), ``"meta"`` (ext4: part of the journal, persisted
    in order) or ``"chain"`` (ext4: new data of inode ``chain``, persisted in order and only
    when at least ``needs_meta`` pending metadata units persisted).  ``lost`` marks data a
    failed fsync covered.  ``needs`` are the positions (in the unit list) of the earlier
    pending units this one cannot persist without (its operation's ``needs`` that are
    pending); those units are directory-entry operations, with options ``"k"``/``"d"``.
    """

    op: EntryOp | DataOp
    options: tuple[Opt, ...]
    group: str = "free"
    chain: int = -1
    needs_meta: int = 0
    lost: bool = False
    needs: tuple[int, ...] = ()

    @property
    def index(self) -> int:
        return self.op.index


def _random_opt(unit: Unit, rng: random.Random) -> Opt:
    """Kept half of the time, dropped 30%, a torn or garbage variant otherwise."""
    r = rng.random()
    odd = [o for o in unit.options if o not in ("k", "d")]
    if r < 0.5 or (r >= 0.8 and not odd):
        return "k"
    if r < 0.8:
        return "d"
    return rng.choice(odd)


class PersistenceModel(ABC):
    """What a crash may keep of a trace; subclasses define ``units``."""

    name: str = ""
    summary: str = ""
    sources: tuple[str, ...] = ()

    @abstractmethod
    def units(self, ops: Sequence[Op]) -> list[Unit]:
        """The pending operations of ``ops`` (trace order) and their options."""

    def repair(self, units: Sequence[Unit], choice: Choice) -> Choice:
        """The valid choice nearest ``choice`` (options a unit lacks become ``"d"``)."""
        return tuple(o if o in u.options else "d" for u, o in zip(units, choice, strict=True))

    def count(self, units: Sequence[Unit]) -> int:
        """How many choices ``enumerate`` yields."""
        return math.prod(len(u.options) for u in units)

    def enumerate(self, units: Sequence[Unit]) -> Iterator[Choice]:
        """Every valid choice."""
        return itertools.product(*(u.options for u in units))

    def random_choice(self, units: Sequence[Unit], rng: random.Random) -> Choice:
        return tuple(_random_opt(u, rng) for u in units)


class ProcessKill(PersistenceModel):
    name = "process-kill"
    summary = ("The process dies, the kernel survives: every call that took effect persists "
               "(the disk equals the real directory at the crash).")
    sources = ("POSIX: data written and names changed are in the kernel's page and dentry "
               "caches, which outlive the process",)

    def units(self, ops: Sequence[Op]) -> list[Unit]:
        return []


class Weak(PersistenceModel):
    name = "weak"
    summary = ("Power loss on the weakest POSIX file system (ALICE's default): unsynced file "
               "data may be absent, a prefix torn at 512/4096 bytes, or garbage; each unsynced "
               "directory-entry change persists or not, together with the earlier changes it "
               "needs (a durable one makes them durable).")
    sources = ("Pillai et al., All File Systems Are Not Created Equal (ALICE), OSDI 2014",
               "Rebello et al., Can Applications Recover from fsync Failures? (ATC 2020)")

    def units(self, ops: Sequence[Op]) -> list[Unit]:
        covered: set[int] = set()
        lost: set[int] = set()
        pending_data: dict[int, list[int]] = {}
        pending_entries: dict[int, list[int]] = {}
        needs: dict[int, set[int]] = {}
        for op in ops:
            if isinstance(op, Write | Truncate):
                pending_data.setdefault(op.ino, []).append(op.index)
            elif isinstance(op, SyncFile):
                for i in pending_data.pop(op.ino, []):
                    (covered if op.ok else lost).add(i)
            elif isinstance(op, SyncFs):
                for i in [i for ids in pending_data.values() for i in ids]:
                    (covered if op.ok else lost).add(i)
                pending_data.clear()
                for i in {i for ids in pending_entries.values() for i in ids}:
                    if i not in lost and i not in covered:
                        (covered if op.ok else lost).add(i)
                pending_entries.clear()
            elif isinstance(op, SyncDir):
                for i in pending_entries.pop(op.ino, []):
                    if i in lost or i in covered:
                        continue
                    if not op.ok:
                        lost.add(i)
                        continue
                    needs[i].discard(op.ino)
                    if not needs[i]:
                        covered.add(i)
            else:
                needs[op.index] = set(entry_dirs(op))
                for d in needs[op.index]:
                    pending_entries.setdefault(d, []).append(op.index)
        _close_durable(ops, covered)
        out: list[Unit] = []
        pos_of: dict[int, int] = {}
        for op in ops:
            if isinstance(op, SyncOp) or op.index in covered:
                continue
            if isinstance(op, Write):
                options: tuple[Opt, ...] = (
                    "k", "d", *tear_points(op.offset, len(op.data), (SECTOR, PAGE)), "g")
                after: tuple[int, ...] = ()
            else:
                options = ("k", "d")
                after = tuple(pos_of[i] for i in _op_needs(op) if i in pos_of)
            pos_of[op.index] = len(out)
            out.append(Unit(op, options, lost=op.index in lost, needs=after))
        return out

    def repair(self, units: Sequence[Unit], choice: Choice) -> Choice:
        """Options a unit lacks become ``"d"``; then every unit a kept one needs is kept."""
        return _close_kept(units, super().repair(units, choice))

    def count(self, units: Sequence[Unit]) -> int:
        """Independent units multiply; each group of units linked by ``needs`` counts its
        closed choices by search.  Exact when no group has more than ``2 ** 16`` raw
        combinations (always so for the few units that are enumerated exhaustively);
        otherwise that group counts its raw combinations, an upper bound."""
        total = 1
        for group in _groups(units):
            raw = math.prod(len(units[p].options) for p in group)
            if len(group) == 1 or raw > 2 ** 16:
                total *= raw
            else:
                total *= sum(1 for _ in _closed(units, group))
        return total

    def enumerate(self, units: Sequence[Unit]) -> Iterator[Choice]:
        """Every choice whose kept units are closed under ``needs``, in product order."""
        if not any(u.needs for u in units):
            return itertools.product(*(u.options for u in units))
        return _closed(units, list(range(len(units))))

    def random_choice(self, units: Sequence[Unit], rng: random.Random) -> Choice:
        return _close_kept(units, super().random_choice(units, rng))


def _op_needs(op: Op) -> tuple[int, ...]:
    return () if isinstance(op, DataOp | SyncOp) else op.needs


def _close_durable(ops: Sequence[Op], durable: set[int]) -> None:
    """Add to ``durable`` (trace indexes) everything a durable operation needs, transitively:
    an operation that persisted for sure proves that what it acted on persisted."""
    by_index = {op.index: op for op in ops}
    todo = [i for i in durable if i in by_index]
    while todo:
        for j in _op_needs(by_index[todo.pop()]):
            if j not in durable:
                durable.add(j)
                todo.append(j)


def _close_kept(units: Sequence[Unit], choice: Choice) -> Choice:
    """``choice`` with every unit a kept (not dropped) unit needs kept, transitively."""
    out = list(choice)
    for pos in range(len(units) - 1, -1, -1):  # needs point backwards: one pass suffices
        if out[pos] != "d":
            for q in units[pos].needs:
                if out[q] == "d":
                    out[q] = "k"
    return tuple(out)


def _groups(units: Sequence[Unit]) -> list[list[int]]:
    """Positions of units, grouped into the connected parts of the ``needs`` relation."""
    parent = list(range(len(units)))

    def root(p: int) -> int:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for pos, u in enumerate(units):
        for q in u.needs:
            parent[root(pos)] = root(q)
    groups: dict[int, list[int]] = {}
    for pos in range(len(units)):
        groups.setdefault(root(pos), []).append(pos)
    return list(groups.values())


def _closed(units: Sequence[Unit], positions: list[int]) -> Iterator[Choice]:
    """Every assignment of options to ``positions`` (ascending, closed under ``needs``)
    whose kept units have their needs kept; yielded as full-length tuples in product
    order (units outside ``positions`` are ``"d"``)."""
    out: list[Opt] = ["d"] * len(units)

    def walk(i: int) -> Iterator[Choice]:
        if i == len(positions):
            yield tuple(out)
            return
        pos = positions[i]
        for opt in units[pos].options:
            if opt != "d" and any(out[q] == "d" for q in units[pos].needs):
                continue
            out[pos] = opt
            yield from walk(i + 1)
        out[pos] = "d"

    return walk(0)


class Ext4Ordered(PersistenceModel):
    name = "ext4-ordered"
    summary = ("Power loss on ext4 with data=ordered and delayed allocation: metadata "
               "persists as a prefix of the journal, any fsync commits it; new file data "
               "persists in order, never as garbage, only together with the size that shows it.")
    sources = ("Documentation/filesystems/ext4.rst (data=ordered, delalloc, auto_da_alloc)",
               "Pillai et al., ALICE, OSDI 2014, Table 1 (ext4 ordered)",
               "PostgreSQL fsyncgate, 2018; Rebello et al., ATC 2020")

    def units(self, ops: Sequence[Op]) -> list[Unit]:
        committed = 0  # how many metadata operations (trace order) the journal holds for sure
        seen_meta = 0
        frozen = False
        covered: set[int] = set()
        lost: set[int] = set()
        pending: dict[int, list[int]] = {}
        for op in ops:
            if isinstance(op, Write):
                pending.setdefault(op.ino, []).append(op.index)
            elif isinstance(op, SyncOp):
                if isinstance(op, SyncFile):
                    for i in pending.pop(op.ino, []):
                        (covered if op.ok else lost).add(i)
                elif isinstance(op, SyncFs):
                    for i in [i for ids in pending.values() for i in ids]:
                        (covered if op.ok else lost).add(i)
                    pending.clear()
                if op.ok and not frozen:
                    committed = seen_meta
                if isinstance(op, SyncDir | SyncFs) and not op.ok:
                    frozen = True  # a failed journal commit: nothing later is guaranteed
            else:
                seen_meta += 1
        out: list[Unit] = []
        meta_seen = meta_units = 0
        for op in ops:
            if isinstance(op, SyncOp):
                continue
            if not isinstance(op, Write):
                meta_seen += 1
                if meta_seen > committed:
                    out.append(Unit(op, ("k", "d"), group="meta"))
                    meta_units += 1
                continue
            if op.index in covered:
                continue
            if op.new_region and op.index not in lost:
                tears = tear_points(op.offset, len(op.data), (PAGE,))
                out.append(Unit(op, ("k", "d", *tears), group="chain", chain=op.ino,
                                needs_meta=meta_units))
            else:
                tears = tear_points(op.offset, len(op.data), (SECTOR, PAGE))
                out.append(Unit(op, ("k", "d", *tears), lost=op.index in lost))
        return out

    def repair(self, units: Sequence[Unit], choice: Choice) -> Choice:
        out = list(super().repair(units, choice))
        journal = 0
        broken = False
        for pos, u in enumerate(units):
            if u.group == "meta":
                if broken or out[pos] != "k":
                    out[pos] = "d"
                    broken = True
                else:
                    journal += 1
        cut: set[int] = set()
        for pos, u in enumerate(units):
            if u.group == "chain":
                if u.chain in cut or u.needs_meta > journal:
                    out[pos] = "d"
                if out[pos] != "k":
                    cut.add(u.chain)
        return tuple(out)

    def _layout(self, units: Sequence[Unit]) -> tuple[list[int], dict[int, list[int]], list[int]]:
        meta = [p for p, u in enumerate(units) if u.group == "meta"]
        chains: dict[int, list[int]] = {}
        for p, u in enumerate(units):
            if u.group == "chain":
                chains.setdefault(u.chain, []).append(p)
        free = [p for p, u in enumerate(units) if u.group == "free"]
        return meta, chains, free

    def _chain_variants(self, units: Sequence[Unit], positions: list[int],
                        journal: int) -> list[dict[int, Opt]]:
        variants: list[dict[int, Opt]] = [dict.fromkeys(positions, "d")]
        for c, pos in enumerate(positions):
            if units[pos].needs_meta > journal:
                break
            for opt in units[pos].options:
                if opt != "d":
                    v: dict[int, Opt] = dict.fromkeys(positions, "d")
                    v.update(dict.fromkeys(positions[:c], "k"))
                    v[pos] = opt
                    variants.append(v)
        return variants

    def count(self, units: Sequence[Unit]) -> int:
        meta, chains, free = self._layout(units)
        free_count = math.prod(len(units[p].options) for p in free)
        return sum(
            free_count * math.prod(len(self._chain_variants(units, ps, k)) for ps in chains.values())
            for k in range(len(meta) + 1)
        )

    def enumerate(self, units: Sequence[Unit]) -> Iterator[Choice]:
        meta, chains, free = self._layout(units)
        for k in range(len(meta) + 1):
            fixed: dict[int, Opt] = {p: ("k" if i < k else "d") for i, p in enumerate(meta)}
            chain_sets = [self._chain_variants(units, ps, k) for ps in chains.values()]
            free_sets = [[{p: o} for o in units[p].options] for p in free]
            for combo in itertools.product(*chain_sets, *free_sets):
                merged = dict(fixed)
                for part in combo:
                    merged.update(part)
                yield tuple(merged[p] for p in range(len(units)))

    def random_choice(self, units: Sequence[Unit], rng: random.Random) -> Choice:
        meta, chains, free = self._layout(units)
        k = rng.randint(0, len(meta))
        merged: dict[int, Opt] = {p: ("k" if i < k else "d") for i, p in enumerate(meta)}
        for ps in chains.values():
            merged.update(rng.choice(self._chain_variants(units, ps, k)))
        for p in free:
            merged[p] = _random_opt(units[p], rng)
        return tuple(merged[p] for p in range(len(units)))


_ALL: tuple[PersistenceModel, ...] = (ProcessKill(), Weak(), Ext4Ordered())
MODELS: dict[str, PersistenceModel] = {m.name: m for m in _ALL}

__all__ = [
    "MODELS", "Choice", "Ext4Ordered", "Opt", "PersistenceModel", "ProcessKill", "Unit", "Weak",
    "tear_points",
]
