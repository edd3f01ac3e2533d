"""Shared helpers for the faultinject tests: run small scripts through FaultyIO."""

from __future__ import annotations

import os
from collections.abc import Callable

from faultinject import MODELS, Crash, CrashState, FaultPlan, FaultyIO, crash_states
from faultinject.disk import DiskImage

Script = Callable[[FaultyIO, str], None]


def run(root: str, script: Script, plan: FaultPlan | None = None) -> FaultyIO:
    """Run ``script(io, root)`` through a FaultyIO on ``root``; a Crash ends it quietly."""
    io = FaultyIO(root, plan)
    try:
        script(io, root)
    except Crash:
        assert io.crashed
    return io


def states(io: FaultyIO, model: str, **kw: int) -> list[CrashState]:
    return crash_states(io.initial, io.events, model, **kw)


def images(io: FaultyIO, model: str, **kw: int) -> list[DiskImage]:
    return [s.image for s in states(io, model, **kw)]


def contents(io: FaultyIO, model: str, path: str, **kw: int) -> set[bytes | None]:
    """Every content ``path`` has in some crash state (``None``: absent)."""
    return {img.file(path) for img in images(io, model, **kw)}


def file_sets(io: FaultyIO, model: str, **kw: int) -> set[frozenset[str]]:
    return {frozenset(p for p, _ in img.files) for img in images(io, model, **kw)}


def write_file(io: FaultyIO, path: str, data: bytes, *, fsync: bool = True,
               exclusive: bool = True, append: bool = False) -> None:
    fd = io.open_create(path, exclusive=exclusive, append=append)
    try:
        io.write(fd, data)
        if fsync:
            io.fsync(fd)
    finally:
        io.close(fd)


def mutating_calls(root_factory: Callable[[], str], script: Script) -> int:
    """How many mutating calls ``script`` makes when it runs to the end."""
    return run(root_factory(), script).mutating_count


def every_crash_point(
    root_factory: Callable[[], str], script: Script
) -> list[tuple[FaultPlan, FaultyIO]]:
    """Run ``script`` once per crash point (before and after each mutating call) and at the end."""
    n = mutating_calls(root_factory, script)
    out = []
    for at in range(n):
        for when in ("before", "after"):
            plan = FaultPlan(crash_at=at, crash_when=when)
            out.append((plan, run(root_factory(), script, plan)))
    out.append((FaultPlan(), run(root_factory(), script)))
    return out


def fresh_dir_factory(
    base: str, setup: Callable[[str], None] | None = None
) -> Callable[[], str]:
    """Each call makes a new directory under ``base`` and runs ``setup`` on it (plain os)."""
    counter = iter(range(1_000_000))

    def make() -> str:
        path = os.path.join(base, f"run{next(counter)}")
        os.mkdir(path)
        if setup is not None:
            setup(path)
        return path

    return make


ALL_MODELS = tuple(MODELS)
POWER_MODELS = ("weak", "ext4-ordered")
