"""FsQueue recovery of states that power loss (or a dead process) can leave, built by hand:
duplicate links, orphans, interrupted enqueues and cleanups, half-done quarantines; and
what recovery must not touch while other owners are alive."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.steps import BODY_BUFFER
from queue_ref.storage import Footprint, RecoveryReport, Schedule
from tests.test_fsqueue_support import EMPTY, Crash, CrashIO, put, tree


@pytest.fixture
def root(tmp_path: Any) -> str:
    return str(tmp_path / "q")


def entries(q: FsQueue) -> list[str]:
    return [m.entry_id for m in q.list_queue()]


def opened(root: str) -> tuple[FsQueue, RecoveryReport]:
    """Open (running recovery), check a second recovery finds nothing to do."""
    q = FsQueue(root)
    first = q.last_recovery
    assert first is not None
    assert q.recover() == RecoveryReport(), "recovery is not idempotent"
    return q, first


def link(root: str, d: str, name: str, entry: str) -> None:
    """Give ``entry`` a link ``<d>/<name>``: a hard link to its message file."""
    msgid = entry.rsplit(".", 1)[0]
    os.link(os.path.join(root, "data", msgid), os.path.join(root, d, name))


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are regular files of one inode (read with ``os``)."""
    sa, sb = os.lstat(a), os.lstat(b)
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def drain(q: FsQueue) -> None:
    for m in list(q.list_queue()):
        i = q.send_start(m)
        assert i is not None
        p = q.send_done(i)
        assert p is not None and q.cleanup(p)
    assert q.footprint() == Footprint(0, 0)
    rest = [x for x in tree(q.root, [q.owner]) if x == "quarantine/" or
            not x.startswith(("quarantine/", "tmp/O0/spare."))]
    assert rest == EMPTY


def test_dead_owner_tmp_dir_and_dangling_links_are_removed(root: str) -> None:
    io = CrashIO()
    q = FsQueue(root, io)
    kept = put(q, n=1)
    # Crash at the commit rename: the links are published, the message is in tmp/.
    io.crash_on = lambda name, args: name == "rename" and "/data/" in str(args[1])
    with pytest.raises(Crash):
        put(q, n=2)
    io.kill()
    assert len(os.listdir(os.path.join(root, "queue"))) == 3  # 1 committed, 2 dangling
    q2, report = opened(root)
    assert report.uncommitted_removed == 1
    assert entries(q2) == [kept[0].entry_id]
    assert os.listdir(os.path.join(root, "tmp")) == [q2.owner]
    drain(q2)
    q2.close()


def test_live_owner_enqueue_in_progress_is_left_alone(root: str) -> None:
    a = FsQueue(root)
    enq = a.enqueue("a@b")
    enq.write(b"b" * BODY_BUFFER)  # large enough to be on disk already
    tx = enq._tx  # type: ignore[attr-defined]
    building = os.path.join(root, "tmp", a.owner, tx.msgid)
    os.link(building, os.path.join(root, "queue", f"{tx.msgid}.0"))  # as a commit makes it
    b = FsQueue(root)
    assert b.last_recovery == RecoveryReport()
    assert os.path.getsize(building) == BODY_BUFFER
    assert same_file(os.path.join(root, "queue", f"{tx.msgid}.0"), building)
    assert entries(b) == []  # listers skip the dangling link
    b.close()
    enq.abort()
    a.close()


def test_interrupted_cleanup_is_finished(root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=2)
    p0 = q.drop(h[0])
    p1 = q.drop(h[1])
    assert p0 is not None and p1 is not None
    # Cleanup of entry 1 got as far as unlinking its reference; entry 0 not started.
    os.unlink(os.path.join(root, "data", h[1].entry_id))
    q.close()
    q2, report = opened(root)
    assert report.cleaned == 2
    assert tree(root, [q2.owner]) == EMPTY
    q2.close()


def test_cleanup_link_of_a_finished_cleanup_is_removed(root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=1)
    p = q.drop(h[0])
    assert p is not None
    os.unlink(os.path.join(root, "data", h[0].message_id))  # data gone, link left
    q.close()
    q2, report = opened(root)
    assert report.cleaned == 1 and tree(root, [q2.owner]) == EMPTY
    q2.close()


@pytest.mark.parametrize("dup", ["queue+cleanup", "inflight+cleanup", "queue+inflight",
                                 "inflight+inflight"])
def test_duplicate_links_resolve_to_the_later_state(root: str, dup: str) -> None:
    q = FsQueue(root)
    h = put(q, n=2)
    e = h[0].entry_id
    dead = "0123456789abcdef"
    q.close()
    os.unlink(os.path.join(root, "queue", e))
    first, second = dup.split("+")
    names = {"queue": e, "cleanup": e, "inflight": f"{e}@{dead}"}
    link(root, first, names[first], e)
    link(root, second, names[second] if first != second else f"{e}@{'f' * 16}", e)
    q2, report = opened(root)
    if "cleanup" in dup:
        assert entries(q2) == [h[1].entry_id]  # retired: never back in the queue
        assert report.cleaned == 1
    else:
        assert entries(q2) == [h[0].entry_id, h[1].entry_id]
    assert os.listdir(os.path.join(root, "inflight")) == []
    drain(q2)
    q2.close()


def test_orphans_are_removed(root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=3)
    m = h[0].message_id
    assert q.reschedule(h[1], Schedule(9)) is not None
    kept = put(q, n=1)
    lone = put(q, n=1)
    q.close()
    data = os.path.join(root, "data")
    os.unlink(os.path.join(root, "queue", h[1].entry_id))  # entry 1 has no link now
    open(os.path.join(data, f"{m}.2.{'a' * 16}.tmp"), "wb").close()  # a dead owner's temp
    os.unlink(os.path.join(root, "queue", lone[0].entry_id))  # a message no link names
    q2, report = opened(root)
    assert report.orphans_removed == 4  # reference, schedule record, temp record, message
    assert sorted(n for n in os.listdir(data) if n.startswith(m)) == [m, f"{m}.0", f"{m}.2"]
    assert os.stat(os.path.join(data, m)).st_nlink == 5  # the file, 2 references, 2 links
    assert not os.path.exists(os.path.join(data, lone[0].message_id))
    assert entries(q2) == [h[0].entry_id, h[2].entry_id, kept[0].entry_id]
    drain(q2)
    q2.close()


def test_orphan_removal_waits_while_another_owner_lives(root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=2)
    os.unlink(os.path.join(root, "queue", h[1].entry_id))
    other = FsQueue(root)  # q is alive: not exclusive
    assert other.last_recovery == RecoveryReport()
    assert os.path.exists(os.path.join(root, "data", h[1].entry_id))
    other.close()
    q.close()
    q3, report = opened(root)  # alone now
    assert report.orphans_removed == 1
    drain(q3)
    q3.close()


def test_a_dead_owners_schedule_temp_goes_while_another_owner_lives(root: str) -> None:
    """A process killed inside a reschedule leaves its schedule temp file; a recovery
    beside a live owner removes it (the orphan sweep, which would, waits for an exclusive
    one: a relay worker killed beside live ones would leave it until all restarted, C8),
    and leaves the live owner's temps alone."""
    q = FsQueue(root)
    h = put(q, n=1)
    data = os.path.join(root, "data")
    dead = os.path.join(data, f"{h[0].entry_id}.{'a' * 16}.tmp")  # no lock: a dead owner
    live = os.path.join(data, f"{h[0].entry_id}.{q._owners.me}.tmp")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"half a schedule record")
    other = FsQueue(root)  # q is alive: not exclusive
    assert other.last_recovery.orphans_removed == 1
    assert not os.path.exists(dead)
    assert os.path.exists(live)
    os.unlink(live)
    other.close()
    drain(q)
    assert q.footprint() == Footprint(0, 0)
    q.close()


def test_killed_inflight_owner_is_requeued_with_its_schedule(root: str) -> None:
    io = CrashIO()
    q = FsQueue(root, io)
    h = put(q, n=2)
    r = q.reschedule(h[1], Schedule(77, 4))
    assert r is not None
    assert q.send_start(h[0]) is not None and q.send_start(r) is not None
    io.kill()  # the process dies holding both entries
    q2, report = opened(root)
    assert report.requeued == 2
    assert [(m.entry_id, m.schedule) for m in q2.list_queue()] == [
        (h[0].entry_id, Schedule(0)), (h[1].entry_id, Schedule(77, 4))]
    drain(q2)
    q2.close()


def test_half_done_quarantines_are_finished(root: str) -> None:
    q = FsQueue(root)
    h = put(q, n=2)
    assert q.reschedule(h[0], Schedule(5)) is not None
    g = put(q, n=2)
    assert q.reschedule(g[1], Schedule(6)) is not None
    q.close()
    qdir = os.path.join(root, "quarantine")
    data = os.path.join(root, "data")
    # Message h: file moved to quarantine; schedule record, hard links and links not yet.
    open(os.path.join(qdir, f"{h[0].message_id}.note"), "w").close()
    os.rename(os.path.join(data, h[0].message_id), os.path.join(qdir, f"{h[0].message_id}.msg"))
    # Entry g.1 (g.0 still holds the file): note written, body copied aside, its link
    # unlinked (a hard link kept in quarantine/ would hold the file for good); its
    # schedule record and reference not yet.
    open(os.path.join(qdir, f"{g[1].entry_id}.note"), "w").close()
    shutil.copyfile(os.path.join(data, g[0].message_id),
                    os.path.join(qdir, f"{g[1].entry_id}.msg"))
    os.unlink(os.path.join(root, "queue", g[1].entry_id))
    q2, _ = opened(root)
    assert entries(q2) == [g[0].entry_id]
    assert sorted(os.listdir(qdir)) == sorted([
        f"{h[0].message_id}.note", f"{h[0].message_id}.msg", f"{h[0].entry_id}.link",
        f"{h[1].entry_id}.link", f"{h[0].entry_id}.sched", f"{g[1].entry_id}.note",
        f"{g[1].entry_id}.sched", f"{g[1].entry_id}.msg"])
    assert sorted(os.listdir(data)) == sorted([g[0].message_id, g[0].entry_id])
    # g's file: its name, g.0's reference and link; nothing in quarantine/ holds it
    assert os.stat(os.path.join(data, g[0].message_id)).st_nlink == 3
    with open(os.path.join(qdir, f"{g[1].entry_id}.msg"), "rb") as kept, open(
            os.path.join(data, g[0].message_id), "rb") as shared:
        assert kept.read() == shared.read()  # g.1's body, kept while g.0 holds the file
    drain(q2)
    q2.close()


def test_lock_files_of_dead_owners_are_removed(root: str) -> None:
    q = FsQueue(root)
    put(q, n=1)
    q.close()
    open(os.path.join(root, "owners", f"{'b' * 16}.lock"), "w").close()
    q2, _ = opened(root)
    assert sorted(os.listdir(os.path.join(root, "owners"))) == sorted(
        ["gate.lock", f"{q2.owner}.lock"])
    q2.close()


def test_a_damaged_schedule_record_quarantines_its_entry_and_keeps_the_body(root: str
                                                                           ) -> None:
    """A schedule record that fails its checksum takes its entry out of the queue (C6:
    no entry is delivered with metadata that cannot be trusted) and names the message
    lost.  Releasing that last entry used to delete the message file with it, an intact
    body that nothing could salvage any more; quarantine/ now keeps it under the entry's
    name (damage-at-rest's rule that a store keeps the files it cannot serve found it)."""
    body = b"Subject: kept\r\n\r\nan intact body\r\n"
    q = FsQueue(root)
    (h,) = put(q, n=1, body=body)
    assert q.reschedule(h, Schedule(50, 2)) is not None
    q.close()
    sched = os.path.join(root, "data", f"{h.entry_id}.sched")
    raw = bytearray(Path(sched).read_bytes())
    raw[10] ^= 4
    Path(sched).write_bytes(bytes(raw))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (h.message_id,)
    assert list(q.list_queue()) == []
    q.close()
    kept = os.path.join(root, "quarantine", f"{h.entry_id}.msg")  # the file, renamed
    assert body in Path(kept).read_bytes()
    assert not os.path.exists(os.path.join(root, "data", h.message_id))
    q = FsQueue(root)  # and the next open leaves quarantine/ as it is
    q.close()
    assert body in Path(kept).read_bytes()


def test_a_link_whose_move_to_quarantine_a_power_cut_kept_on_both_sides_goes(
        root: str) -> None:
    q = FsQueue(root)
    (h,) = put(q, n=1)
    q.close()
    os.unlink(os.path.join(root, "data", h.message_id))  # the message's name is lost
    q = FsQueue(root)
    assert q.last_recovery is not None and q.last_recovery.lost == (h.message_id,)
    q.close()
    kept = os.path.join(root, "quarantine", f"{h.entry_id}.link")
    queued = os.path.join(root, "queue", h.entry_id)
    assert not os.path.exists(queued)
    # A power cut persisted the rename queue/ -> quarantine/ in quarantine/ only: both
    # names are left, names of one file.
    os.link(kept, queued)
    q2, _ = opened(root)
    q2.close()
    assert os.listdir(os.path.join(root, "queue")) == []
    assert same_file(kept, os.path.join(root, "quarantine", f"{h.message_id}.unlinked"))
    assert os.stat(kept).st_nlink == 2  # the kept content and its link, nothing more


def test_sibling_cleanups_cut_short_before_the_last_frees_the_file_leave_an_orphan(
        root: str) -> None:
    """Two entries of one message cleaned up at once: each unlinks its reference, sees the
    other's link, unlinks its own link, and the one that then sees the count at one frees
    the file.  The process dies just before that free: the file is left with no link and
    no reference.  Every entry was delivered, so recovery removes it as an orphan; it is
    not reported lost (before, it went to ``quarantine/<msgid>.unlinked``: a false loss
    that ``queue-ref repair`` would have delivered again)."""
    io = CrashIO()
    q = FsQueue(root, io)
    h = put(q, n=2)
    pending = []
    for m in h:
        i = q.send_start(m)
        assert i is not None
        p = q.send_done(i)
        assert p is not None
        pending.append(p)
    msg = os.path.join(root, "data", h[0].message_id)
    link0 = os.path.join(root, "cleanup", h[0].entry_id)
    b_done = threading.Event()
    a_paused = threading.Event()

    def pause_or_crash(name: str, args: tuple[object, ...]) -> bool:
        if threading.current_thread() is not a:
            return False
        if name == "unlink" and args[0] == link0:  # A saw B's link: B runs whole now
            a_paused.set()
            assert b_done.wait(10)
            return False
        return str(args[0]) == msg  # A's free of the file (unlink, or rename to a spare)

    io.crash_on = pause_or_crash
    crashed: list[BaseException] = []

    def run_a() -> None:
        try:
            q.cleanup(pending[0])
        except Crash as c:
            crashed.append(c)

    a = threading.Thread(target=run_a)
    a.start()
    assert a_paused.wait(10)
    assert q.cleanup(pending[1])  # B: unlinks its link, sees A's: not the last
    assert os.lstat(msg).st_nlink == 2
    b_done.set()
    a.join(10)
    assert crashed, "A did not reach the free of the file"
    io.kill()
    assert os.lstat(msg).st_nlink == 1 and os.listdir(os.path.join(root, "cleanup")) == []
    q2, report = opened(root)
    assert report.lost == () and report.damaged_files == () and report.problems == ()
    assert report.orphans_removed == 1
    assert os.listdir(os.path.join(root, "quarantine")) == []
    drain(q2)
    q2.close()


def test_a_message_whose_links_are_gone_but_a_reference_is_left_is_still_lost(
        root: str) -> None:
    """The counterpart: links removed (damage) while a reference is left is mail that
    was never delivered, reported lost and kept for ``queue-ref repair``."""
    q = FsQueue(root)
    h = put(q, n=2)
    q.close()
    for m in h:
        os.unlink(os.path.join(root, "queue", m.entry_id))
    os.unlink(os.path.join(root, "data", h[0].entry_id))  # one reference gone too
    q2, report = opened(root)
    assert report.lost == (h[0].message_id,)
    assert os.path.exists(os.path.join(root, "quarantine", f"{h[0].message_id}.unlinked"))
    q2.close()


def test_a_loss_report_whose_move_a_power_cut_undid_is_not_taken_for_finished_cleanups(
        root: str) -> None:
    """Damage takes both links of a message of two recipients (its references are left):
    recovery reports it lost, writes its note, moves the file to
    ``quarantine/<msgid>.unlinked`` and unlinks the references.  A power cut keeps the
    unlinks but loses the move (neither synced yet), so the file is back in data/ with
    no link and no reference, as finished cleanups leave one.  The next recovery must
    keep it and report it lost again, not remove it (found by a cold review)."""
    q = FsQueue(root)
    h = put(q, n=2)
    q.close()
    msgid = h[0].message_id
    for m in h:
        os.unlink(os.path.join(root, "queue", m.entry_id))
    q = FsQueue(root)
    assert q.last_recovery is not None and q.last_recovery.lost == (msgid,)
    q.close()
    kept = os.path.join(root, "quarantine", f"{msgid}.unlinked")
    assert not os.path.exists(os.path.join(root, "data", f"{msgid}.0"))
    os.rename(kept, os.path.join(root, "data", msgid))  # the power cut undid the move
    q2, report = opened(root)
    assert report.lost == (msgid,)
    assert os.path.exists(kept)
    q2.close()
