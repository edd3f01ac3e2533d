"""Choosing crash states: determinism, keys, exhaustive versus targeted, random workloads."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultinject import (
    Crash,
    FaultPlan,
    FaultyIO,
    ModelError,
    crash_state,
    crash_states,
    is_exhaustive,
    pending_count,
    snapshot,
)
from tests.faultinject_support import POWER_MODELS, run, states, write_file


def many_creates(io: FaultyIO, root: str) -> None:
    io.mkdir(f"{root}/q")
    io.fsync_dir(root)
    for i in range(30):
        write_file(io, f"{root}/q/m{i:02}", b"x" * 600, fsync=(i % 3 == 0))


@pytest.fixture
def big(tmp_path: Path) -> FaultyIO:
    return run(str(tmp_path), many_creates)


@pytest.mark.parametrize("model", POWER_MODELS)
def test_crash_states_are_deterministic_and_keys_rebuild_them(big: FaultyIO, model: str) -> None:
    first = states(big, model)
    assert [s.key for s in first] == [s.key for s in states(big, model)]
    assert len({s.key for s in first}) == len(first) == len({s.image for s in first})
    assert first[0].key == "all" and first[0].image == snapshot(big.root)
    for s in first:
        again = crash_state(big.initial, big.events, model, s.key)
        assert again == s


def test_seeds_change_only_the_random_states(big: FaultyIO) -> None:
    a = {s.key for s in states(big, "weak", random_states=0)}
    b = {s.key for s in states(big, "weak", seed=1)}
    c = {s.key for s in states(big, "weak", seed=2)}
    assert a < b and a < c and b != c


def test_many_pending_operations_use_targeted_states(big: FaultyIO) -> None:
    n = pending_count(big.initial, big.events, "weak")
    assert n > 40
    weak = states(big, "weak", random_states=0)
    keys = {s.key for s in weak}
    units = [e.index for e in big.events if e.name == "open_create"]
    assert f"d{units[5]}~" in " ".join(keys)  # a prefix dropping from the 6th creation on
    assert len(weak) < 12 * n  # not 2**n
    # ext4: the fsync of m27 committed the journal up to it; later creations form prefixes
    ext4 = states(big, "ext4-ordered", random_states=0)
    names = {frozenset(p for p, _ in s.image.files) for s in ext4}
    assert names == {frozenset(f"q/m{j:02}" for j in range(i)) for i in (28, 29, 30)}


def test_few_pending_operations_are_enumerated_exhaustively(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        for name in "abcd":
            write_file(io, f"{root}/{name}", b"", fsync=False)

    io = run(str(tmp_path), script)
    assert len(states(io, "weak")) == 16
    assert len(states(io, "weak", exhaustive_limit=3, random_states=0)) < 16


def test_bad_keys_and_models_are_refused(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        for name in "ab":
            write_file(io, f"{root}/{name}", b"data", fsync=False)

    io = run(str(tmp_path), script)
    creates = [e.index for e in io.events if e.name == "open_create"]
    writes = [e.index for e in io.events if e.name == "write"]
    ok = crash_state(io.initial, io.events, "weak", f"d{creates[0]}")
    assert ok.image.file("a") is None and ok.image.file("b") == b"data"
    for key in ("bogus", "d999", f"d{creates[0]}-d{creates[0]}", f"t{writes[0]}:3", "x1", "",
                f"d{creates[0]}.{creates[0]}"):
        with pytest.raises(ModelError):
            crash_state(io.initial, io.events, "weak", key)
    # ext4: the journal is a prefix; garbage is not a state of the model
    for key in (f"d{creates[0]}", f"g{writes[0]}"):
        with pytest.raises(ModelError):
            crash_state(io.initial, io.events, "ext4-ordered", key)
    with pytest.raises(ValueError):
        crash_states(io.initial, io.events, "zfs")
    with pytest.raises(ValueError):
        crash_states(io.initial, io.events, "weak", exhaustive_limit=-1)


def test_a_trace_from_another_tree_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"")
    io = run(str(tmp_path / "a"), lambda io, root: io.unlink(f"{root}/f"))
    with pytest.raises(ModelError):
        crash_states(snapshot(str(tmp_path / "b")), io.events, "weak")


# ---- random workloads ---------------------------------------------------------------

PATHS = ["a", "b", "d1/a", "d1/b", "d2/c", "l1"]
DIRS = ["d1", "d2"]
SIZES = [0, 5, 513, 4100]

step = st.one_of(
    st.tuples(st.just("mkdir"), st.sampled_from(DIRS)),
    st.tuples(st.just("rmdir"), st.sampled_from(DIRS)),
    st.tuples(st.just("write"), st.sampled_from(PATHS), st.sampled_from(SIZES), st.booleans(),
              st.booleans(), st.booleans()),
    st.tuples(st.just("truncate"), st.sampled_from(PATHS), st.sampled_from(SIZES)),
    st.tuples(st.just("rename"), st.sampled_from(PATHS + DIRS), st.sampled_from(PATHS + DIRS)),
    st.tuples(st.just("noreplace"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("link"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("unlink"), st.sampled_from(PATHS)),
    st.tuples(st.just("symlink"), st.sampled_from(["a", "b", "d1", "d1/a", "zz"]),
              st.sampled_from(PATHS)),
    st.tuples(st.just("fsync_dir"), st.sampled_from([".", *DIRS])),
    st.tuples(st.just("lock"), st.sampled_from(PATHS)),
)


def perform(io: FaultyIO, root: str, s: tuple[object, ...]) -> None:
    kind = s[0]
    p = [f"{root}/{x}" if isinstance(x, str) and kind != "symlink" else x for x in s[1:]]
    if kind == "mkdir":
        io.mkdir(str(p[0]))
    elif kind == "rmdir":
        io.rmdir(str(p[0]))
    elif kind == "write":
        size, append, fsync, exclusive = p[1], p[2], p[3], p[4]
        assert isinstance(size, int)
        write_file(io, str(p[0]), bytes([size % 251]) * size, fsync=bool(fsync),
                   exclusive=bool(exclusive), append=bool(append))
    elif kind == "truncate":
        fd = io.open_create(str(p[0]), exclusive=False)
        try:
            io.ftruncate(fd, int(str(p[1])))
        finally:
            io.close(fd)
    elif kind == "rename":
        io.rename(str(p[0]), str(p[1]))
    elif kind == "noreplace":
        io.rename_noreplace(str(p[0]), str(p[1]))
    elif kind == "link":
        io.link(str(p[0]), str(p[1]))
    elif kind == "unlink":
        io.unlink(str(p[0]))
    elif kind == "symlink":
        io.symlink(str(s[1]), f"{root}/{s[2]}")
    elif kind == "fsync_dir":
        io.fsync_dir(str(p[0]))
    else:
        fd = io.lock_exclusive(str(p[0]))
        if fd is not None:
            io.unlock(fd)


def run_steps(root: str, steps: list[tuple[object, ...]], plan: FaultPlan) -> FaultyIO:
    io = FaultyIO(root, plan)
    try:
        for s in steps:
            with contextlib.suppress(OSError):  # a failure: the script goes on
                perform(io, root, s)
    except Crash:
        pass
    return io


@given(
    steps=st.lists(step, min_size=1, max_size=12),
    crash_at=st.none() | st.integers(0, 30),
    when=st.sampled_from(["before", "after"]),
    fail_at=st.none() | st.integers(0, 30),
)
def test_random_workloads_replay_faithfully(
    steps: list[tuple[object, ...]], crash_at: int | None, when: str, fail_at: int | None
) -> None:
    plan = FaultPlan(crash_at=crash_at, crash_when=when, fail_at=fail_at)
    base = tempfile.mkdtemp(prefix="fi-hyp-")
    try:
        one, two = os.path.join(base, "one"), os.path.join(base, "two")
        os.mkdir(one)
        os.mkdir(two)
        io = run_steps(one, steps, plan)
        again = run_steps(two, steps, FaultPlan(crash_at=crash_at, crash_when=when,
                                                fail_at=fail_at))
        assert io.trace_hash() == again.trace_hash()
        real = snapshot(one)
        (killed,) = crash_states(io.initial, io.events, "process-kill")
        assert killed.image == real
        found = {}
        for model in POWER_MODELS:
            sts = crash_states(io.initial, io.events, model, exhaustive_limit=6, random_states=4)
            assert sts[0].image == real
            for s in sts:
                assert crash_state(io.initial, io.events, model, s.key) == s
            found[model] = {s.image for s in sts}
        exhaustive = all(
            is_exhaustive(io.initial, io.events, m, exhaustive_limit=6) for m in POWER_MODELS
        )
        if exhaustive and not any(e.injected for e in io.events):
            # ext4 data=ordered allows no disk that the weakest model would not allow
            assert found["ext4-ordered"] <= found["weak"]
    finally:
        shutil.rmtree(base)
