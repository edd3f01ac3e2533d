"""Which post-crash disks each persistence model allows, on classic crash-consistency patterns."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from faultinject import MODELS, FaultPlan, FaultyIO, ModelError, crash_state, get_model, snapshot
from faultinject.explore import Builder
from faultinject.persistence import tear_points
from faultinject.replay import replay
from queue_ref.io import write_file_durable
from tests.faultinject_support import (
    ALL_MODELS,
    POWER_MODELS,
    contents,
    every_crash_point,
    file_sets,
    fresh_dir_factory,
    images,
    run,
    states,
    write_file,
)

NEW = b"new contents " * 40  # 520 bytes: crosses one sector boundary
OLD = b"old"


def with_queue_dir(io: FaultyIO, root: str) -> None:
    io.mkdir(f"{root}/q")
    io.fsync_dir(root)


def test_models_are_registered_with_sources() -> None:
    assert {"process-kill", "weak", "ext4-ordered"} <= set(MODELS)
    for name, model in MODELS.items():
        assert model.name == name and model.summary and model.sources


def test_process_kill_state_is_the_real_directory_at_every_crash_point(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        with_queue_dir(io, root)
        write_file_durable(io, f"{root}/q/a", NEW, sync_dir=False)
        lock = io.lock_exclusive(f"{root}/q/LOCK")
        assert lock is not None
        io.rename_noreplace(f"{root}/q/a", f"{root}/q/b")
        io.symlink("b", f"{root}/q/link")
        io.unlock(lock)

    for _plan, io in every_crash_point(fresh_dir_factory(str(tmp_path)), script):
        (only,) = states(io, "process-kill")
        assert only.key == "all" and only.image == snapshot(io.root)
        for model in POWER_MODELS:
            assert states(io, model)[0].image == snapshot(io.root)


def test_durable_create_survives_every_model(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        with_queue_dir(io, root)
        write_file_durable(io, f"{root}/q/a", NEW)

    io = run(str(tmp_path), script)
    for model in ALL_MODELS:
        assert contents(io, model, "q/a") == {NEW}


def test_no_dir_fsync_bug_loses_the_new_name_on_power_loss(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        with_queue_dir(io, root)
        write_file_durable(io, f"{root}/q/a", NEW, sync_dir=False)

    io = run(str(tmp_path), script)
    assert contents(io, "process-kill", "q/a") == {NEW}
    for model in POWER_MODELS:
        found = contents(io, model, "q/a")
        assert found == {None, NEW}, model  # the data was fsynced: never torn
        assert {img.file("q/a.tmp") for img in images(io, model)} == {None, NEW}


def test_fsync_of_a_file_does_not_persist_its_name_in_the_weak_model(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/f", NEW)  # create, write, fsync file; no directory fsync

    io = run(str(tmp_path), script)
    assert contents(io, "weak", "f") == {None, NEW}
    assert contents(io, "ext4-ordered", "f") == {NEW}  # ext4's fsync commits the journal


def rename_before_fsync(io: FaultyIO, root: str) -> None:
    """The bug: the temp file is renamed over the old one before its data is fsynced."""
    write_file(io, f"{root}/q/a.tmp", NEW, fsync=False)
    io.rename(f"{root}/q/a.tmp", f"{root}/q/a")
    io.fsync_dir(f"{root}/q")


def replace_correctly(io: FaultyIO, root: str) -> None:
    write_file_durable(io, f"{root}/q/a", NEW)


def with_old_file(root: str) -> None:
    Path(root, "q").mkdir()
    Path(root, "q", "a").write_bytes(OLD)


def test_rename_before_fsync_exposes_empty_torn_or_garbage_files(tmp_path: Path) -> None:
    with_old_file(str(tmp_path))
    io = run(str(tmp_path), rename_before_fsync)
    assert contents(io, "process-kill", "q/a") == {NEW}
    weak = contents(io, "weak", "q/a")
    assert {b"", NEW[:512], NEW} <= weak  # empty and torn at the sector
    assert any(c is not None and len(c) == len(NEW) and c != NEW for c in weak)  # garbage
    assert OLD not in weak  # the directory fsync made the rename durable
    # ext4 data=ordered with delalloc: the infamous zero-length file, but never garbage
    assert contents(io, "ext4-ordered", "q/a") == {b"", NEW}


def test_correct_replace_leaves_old_or_new_at_every_crash_point(tmp_path: Path) -> None:
    runs = every_crash_point(fresh_dir_factory(str(tmp_path), with_old_file), replace_correctly)
    seen: dict[str, set[bytes | None]] = {m: set() for m in ALL_MODELS}
    for _plan, io in runs:
        for model in ALL_MODELS:
            seen[model] |= contents(io, model, "q/a")
    for model in ALL_MODELS:
        assert seen[model] == {OLD, NEW}, model


def test_the_same_bug_shows_at_some_crash_point(tmp_path: Path) -> None:
    runs = every_crash_point(fresh_dir_factory(str(tmp_path), with_old_file), rename_before_fsync)
    bad = {c for _p, io in runs for c in contents(io, "ext4-ordered", "q/a")} - {OLD, NEW}
    assert bad == {b""}


def test_eio_from_fsync_means_the_data_is_never_durable(tmp_path: Path) -> None:
    """fsyncgate: a failed fsync drops the data; a later successful fsync does not bring it back."""

    def script(io: FaultyIO, root: str) -> None:
        with_queue_dir(io, root)
        fd = io.open_create(f"{root}/q/a.tmp")
        io.write(fd, NEW)
        try:
            io.fsync(fd)
        except OSError as e:
            assert e.errno == errno.EIO
            io.fsync(fd)  # retried: succeeds, as on Linux
        io.close(fd)
        io.rename(f"{root}/q/a.tmp", f"{root}/q/a")
        io.fsync_dir(f"{root}/q")

    (tmp_path / "ok").mkdir()
    (tmp_path / "eio").mkdir()
    control = run(str(tmp_path / "ok"), script)
    failed = run(str(tmp_path / "eio"), script, FaultPlan(fail_at=4))  # mkdir, fsync_dir, open, write
    assert [e.name for e in failed.events if e.injected] == ["fsync"]
    assert (tmp_path / "eio" / "q" / "a").read_bytes() == NEW  # the page cache still has it
    assert contents(failed, "process-kill", "q/a") == {NEW}
    for model in POWER_MODELS:
        assert contents(control, model, "q/a") == {NEW}
        lost = contents(failed, model, "q/a")
        assert b"" in lost and NEW in lost and None not in lost, model
    assert any("fsync failed" in s.description for s in states(failed, "weak"))


def test_torn_writes_tear_at_sector_and_page_boundaries(tmp_path: Path) -> None:
    big = bytes(range(256)) * 40  # 10240 bytes

    def script(io: FaultyIO, root: str) -> None:
        fd = io.open_create(f"{root}/f")
        io.fsync_dir(root)
        io.write(fd, big)
        io.close(fd)

    io = run(str(tmp_path), script)
    assert tear_points(0, len(big), (512, 4096)) == (512, 4096, 8192, 9728)
    weak = contents(io, "weak", "f")
    assert {b"", big[:512], big[:4096], big[:8192], big[:9728], big} <= weak
    assert len(weak) == 7  # plus one garbage variant
    assert contents(io, "ext4-ordered", "f") == {b"", big[:4096], big[:8192], big}


def test_o_append_log_keeps_its_synced_prefix(tmp_path: Path) -> None:
    records = [bytes([65 + i]) * 700 for i in range(5)]

    def script(io: FaultyIO, root: str) -> None:
        fd = io.open_create(f"{root}/log", append=True)
        io.fsync_dir(root)
        for i, rec in enumerate(records):
            io.write(fd, rec)
            if i == 1:
                io.fdatasync(fd)
        io.close(fd)

    io = run(str(tmp_path), script)
    full = b"".join(records)
    synced = full[:1400]
    for model in POWER_MODELS:
        logs = contents(io, model, "log", exhaustive_limit=3)
        assert all(log is not None and log.startswith(synced) for log in logs), model
        assert full in logs and synced in logs
    # ext4: appended data persists in order, never as holes or garbage
    assert all(full.startswith(log or b"") for log in contents(io, "ext4-ordered", "log"))
    weak = contents(io, "weak", "log")
    assert any(not full.startswith(log or b"") for log in weak)


def test_weak_model_respects_directory_dependencies(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        io.mkdir(f"{root}/d")
        write_file(io, f"{root}/d/f", NEW)
        io.fsync_dir(f"{root}/d")  # but not the root: d itself may vanish

    io = run(str(tmp_path), script)
    imgs = images(io, "weak")
    assert {img.exists("d") for img in imgs} == {True, False}
    assert all(img.file("d/f") == (NEW if img.exists("d") else None) for img in imgs)


def test_a_rename_cannot_persist_without_the_creation_it_moves(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/tmp", b"x", fsync=True)
        io.rename(f"{root}/tmp", f"{root}/x")

    io = run(str(tmp_path), script)
    assert file_sets(io, "weak") == {frozenset(), frozenset({"tmp"}), frozenset({"x"})}


def test_cross_directory_rename_needs_both_directories_synced(tmp_path: Path) -> None:
    def setup(io: FaultyIO, root: str) -> None:
        io.mkdir(f"{root}/a")
        io.mkdir(f"{root}/b")
        io.fsync_dir(root)
        write_file(io, f"{root}/a/x", NEW)
        io.fsync_dir(f"{root}/a")
        io.rename(f"{root}/a/x", f"{root}/b/x")
        io.fsync_dir(f"{root}/b")

    (tmp_path / "half").mkdir()
    (tmp_path / "both").mkdir()
    half = run(str(tmp_path / "half"), setup)
    assert file_sets(half, "weak") == {frozenset({"a/x"}), frozenset({"b/x"})}  # atomic

    def synced_both(io: FaultyIO, root: str) -> None:
        setup(io, root)
        io.fsync_dir(f"{root}/a")

    both = run(str(tmp_path / "both"), synced_both)
    assert file_sets(both, "weak") == {frozenset({"b/x"})}
    assert file_sets(half, "ext4-ordered") == {frozenset({"b/x"})}


def test_ext4_persists_metadata_as_a_journal_prefix(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        for name in ("a", "b", "c"):
            write_file(io, f"{root}/{name}", b"", fsync=False)

    io = run(str(tmp_path), script)
    prefixes = {frozenset("abc"[:n]) for n in range(4)}
    assert file_sets(io, "ext4-ordered") == prefixes
    assert len(file_sets(io, "weak")) == 8  # every subset


def test_ext4_fsync_commits_earlier_metadata_of_other_files(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/a", b"", fsync=False)
        write_file(io, f"{root}/b", b"b", fsync=True)
        write_file(io, f"{root}/c", b"", fsync=False)

    io = run(str(tmp_path), script)
    assert file_sets(io, "ext4-ordered") == {frozenset("ab"), frozenset("abc")}


@pytest.mark.parametrize("model", ALL_MODELS)
def test_lock_files_and_hard_links_appear_in_crash_states(tmp_path: Path, model: str) -> None:
    def script(io: FaultyIO, root: str) -> None:
        fd = io.lock_exclusive(f"{root}/LOCK")
        assert fd is not None
        write_file(io, f"{root}/a", b"x")
        io.link(f"{root}/a", f"{root}/b")
        io.fsync_dir(root)

    io = run(str(tmp_path), script)
    for img in images(io, model):
        assert img.hardlinks == (("a", "b"),) and img.file("LOCK") == b""


# ---- dependencies: a durable operation never goes, and brings what it acts on --------------

def three_dirs(root: str) -> None:
    for d in ("q", "i", "c"):
        Path(root, d).mkdir()
    Path(root, "q", "x").write_bytes(OLD)


def move_twice(io: FaultyIO, root: str) -> None:
    """The queue's claim then completion: rename q/x -> i/x unsynced, then i/x -> c/x with
    both directories fsynced (the second rename is durable)."""
    io.rename(f"{root}/q/x", f"{root}/i/x")
    io.rename(f"{root}/i/x", f"{root}/c/x")
    io.fsync_dir(f"{root}/i")
    io.fsync_dir(f"{root}/c")


def test_a_durable_rename_makes_the_rename_it_moves_durable(tmp_path: Path) -> None:
    three_dirs(str(tmp_path))
    io = run(str(tmp_path), move_twice)
    for model in ALL_MODELS:
        assert file_sets(io, model) == {frozenset({"c/x"})}, model
        assert contents(io, model, "c/x") == {OLD}
    # the first rename is not pending any more: it is durable with the second
    assert all(not s.dropped for s in states(io, "weak"))


def test_a_rename_chain_keeps_its_dependencies_when_pending(tmp_path: Path) -> None:
    three_dirs(str(tmp_path))

    def script(io: FaultyIO, root: str) -> None:
        io.rename(f"{root}/q/x", f"{root}/i/x")
        io.rename(f"{root}/i/x", f"{root}/c/x")  # no fsync at all

    io = run(str(tmp_path), script)
    # never both names of one file, never the second move without the first
    assert file_sets(io, "weak") == {frozenset({"q/x"}), frozenset({"i/x"}), frozenset({"c/x"})}
    first, second = [e.index for e in io.events if e.name == "rename"]
    only_first = crash_state(io.initial, io.events, "weak", f"d{second}")
    assert only_first.image.file("i/x") == OLD
    with pytest.raises(ModelError):  # the second kept without the first: not a state
        crash_state(io.initial, io.events, "weak", f"d{first}")


def test_the_builder_refuses_a_choice_that_breaks_a_dependency(tmp_path: Path) -> None:
    three_dirs(str(tmp_path))

    def script(io: FaultyIO, root: str) -> None:
        io.rename(f"{root}/q/x", f"{root}/i/x")
        io.rename(f"{root}/i/x", f"{root}/c/x")

    io = run(str(tmp_path), script)
    model = get_model("weak")
    replayed = replay(io.initial, io.events)
    units = model.units(replayed.ops)
    assert [u.needs for u in units] == [(), (0,)]
    assert model.repair(units, ("d", "k")) == ("k", "k")
    assert model.count(units) == len(list(model.enumerate(units))) == 3
    with pytest.raises(ModelError, match="does not apply"):
        Builder(replayed, units).image(("d", "k"))  # never skipped silently


def test_a_durable_unlink_makes_the_names_it_removes_durable(tmp_path: Path) -> None:
    def setup(root: str) -> None:
        Path(root, "d1").mkdir()
        Path(root, "d2").mkdir()

    setup(str(tmp_path))

    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/d1/a", NEW)  # d1 never fsynced
        io.rename(f"{root}/d1/a", f"{root}/d2/a")
        io.unlink(f"{root}/d2/a")
        io.fsync_dir(f"{root}/d2")

    io = run(str(tmp_path), script)
    for model in POWER_MODELS:
        assert file_sets(io, model) == {frozenset()}, model


def test_a_durable_rmdir_makes_the_moves_out_of_the_directory_durable(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        io.mkdir(f"{root}/d")
        io.fsync_dir(root)
        write_file(io, f"{root}/d/f", NEW)
        io.fsync_dir(f"{root}/d")
        io.rename(f"{root}/d/f", f"{root}/f")
        io.rmdir(f"{root}/d")
        io.fsync_dir(root)  # rmdir and the rename's new name durable; d never fsynced again

    io = run(str(tmp_path), script)
    for model in POWER_MODELS:
        imgs = images(io, model)
        assert {img.paths() for img in imgs} == {("f",)}, model


def test_fsynced_data_of_a_file_whose_name_was_lost_is_invisible_not_an_error(
        tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        io.mkdir(f"{root}/t")
        io.mkdir(f"{root}/d")
        io.fsync_dir(root)
        write_file(io, f"{root}/t/x", NEW)  # data fsynced; t/ is not: the name may go
        io.link(f"{root}/t/x", f"{root}/d/x")
        io.fsync_dir(f"{root}/d")  # the second name is durable, with the data

    io = run(str(tmp_path), script)
    weak = images(io, "weak")
    assert {img.file("t/x") for img in weak} == {None, NEW}
    assert {img.file("d/x") for img in weak} == {NEW}


def test_a_directory_never_moves_under_itself_in_a_crash_state(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        io.mkdir(f"{root}/x")
        io.mkdir(f"{root}/x/y")
        io.fsync_dir(root)
        io.fsync_dir(f"{root}/x")
        io.rename(f"{root}/x/y", f"{root}/y")
        io.rename(f"{root}/x", f"{root}/y/x")  # only possible once y left x

    io = run(str(tmp_path), script)
    for model in POWER_MODELS:
        assert {img.dirs for img in images(io, model)} == {
            ("y", "y/x"), ("x", "y"), ("x", "x/y")}, model


# ---- syncfs: one call makes the whole file system durable ---------------------------------


def unsynced_tree(io: FaultyIO, root: str) -> None:
    """Two directories, files in each, a rename across them: nothing fsynced."""
    io.mkdir(f"{root}/a")
    io.mkdir(f"{root}/b")
    write_file(io, f"{root}/a/x", NEW, fsync=False)
    write_file(io, f"{root}/a/y", OLD, fsync=False)
    io.rename(f"{root}/a/y", f"{root}/b/y")
    io.symlink("../a/x", f"{root}/b/link")


def test_syncfs_makes_every_file_and_name_durable(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        unsynced_tree(io, root)
        io.syncfs(root)

    io = run(str(tmp_path), script)
    assert [e.name for e in io.events if e.mutating][-1] == "syncfs"
    for model in ALL_MODELS:
        (only,) = images(io, model)
        assert only.file("a/x") == NEW and only.file("b/y") == OLD, model
        assert only.file("a/y") is None and ("b/link", "../a/x") in only.symlinks, model


def test_without_syncfs_the_same_tree_may_lose_anything(tmp_path: Path) -> None:
    io = run(str(tmp_path), unsynced_tree)
    weak = images(io, "weak")
    assert {img.file("a/x") for img in weak} >= {None, b"", NEW}
    assert any(img.file("a/x") not in (None, NEW) and img.file("a/x") != b"" for img in weak)


def test_writes_after_a_syncfs_are_pending_again(tmp_path: Path) -> None:
    def script(io: FaultyIO, root: str) -> None:
        unsynced_tree(io, root)
        io.syncfs(root)
        fd = io.open_create(f"{root}/a/x", exclusive=False, append=True)
        io.write(fd, b"more")
        io.close(fd)
        io.unlink(f"{root}/b/y")

    io = run(str(tmp_path), script)
    for model in POWER_MODELS:
        assert contents(io, model, "a/x") >= {NEW, NEW + b"more"}, model
        assert contents(io, model, "b/y") == {OLD, None}, model
    # the appended bytes are a new region: ext4 never shows them as garbage
    assert contents(io, "ext4-ordered", "a/x") <= {NEW, NEW + b"more"}


def test_a_failed_syncfs_makes_nothing_durable_not_even_after_a_retry(tmp_path: Path) -> None:
    """fsyncgate for the whole file system: what a failed syncfs covered is never trusted."""

    def script(io: FaultyIO, root: str) -> None:
        write_file(io, f"{root}/x", NEW, fsync=False)
        try:
            io.syncfs(root)
        except OSError as e:
            assert e.errno == errno.EIO
            io.syncfs(root)  # retried: succeeds, as on Linux

    (tmp_path / "ok").mkdir()
    (tmp_path / "eio").mkdir()
    control = run(str(tmp_path / "ok"), script)
    failed = run(str(tmp_path / "eio"), script, FaultPlan(fail_at=2))  # open, write, syncfs
    assert [e.name for e in failed.events if e.injected] == ["syncfs"]
    for model in POWER_MODELS:
        assert contents(control, model, "x") == {NEW}, model
        lost = contents(failed, model, "x")
        assert None in lost and NEW in lost, model
    assert contents(failed, "process-kill", "x") == {NEW}
