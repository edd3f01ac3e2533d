"""Damage in the filesystem queue: a lost message is reported with its entries and its
links kept aside; a stray link is quarantined alone; ``queue-ref repair`` (the rebuild)
puts every intact message back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from queue_ref import Recipient, RecoveryReport, Schedule
from queue_ref.fsqueue import FsQueue
from tests.test_fsqueue_support import Crash, CrashIO


def fill(root: str) -> list[tuple[str, int]]:
    """Four messages, of 1, 2, 1 and 2 recipients: [(message id, recipients)]."""
    q = FsQueue(root)
    out = []
    for i in range(4):
        n = 1 + i % 2
        with q.enqueue("from@example.org") as e:
            e.write(b"body %d " % i * 40)
            rcpts = [Recipient(f"r{i}.{k}@example.net", Schedule(0)) for k in range(n)]
            out.append((e.commit(rcpts)[0].message_id, n))
    q.close()
    return out


def drain(q: FsQueue) -> list[str]:
    """Deliver every queued entry, reading its whole body; the entry ids delivered."""
    out = []
    for h in list(q.list_queue()):
        f = q.send_start(h)
        assert f is not None
        with q.read_inflight(f) as r:
            assert r.read_all().startswith(b"body ")
        done = q.send_done(f)
        assert done is not None and q.cleanup(done)
        out.append(h.entry_id)
    q.close()
    return sorted(out)


def entries(msgs: list[tuple[str, int]], *skip: str) -> list[str]:
    return sorted(f"{m}.{i}" for m, n in msgs for i in range(n) if m not in skip)


def repair(root: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "repair", "--queue", root,
                          "--json"], capture_output=True, text=True, check=True)
    got: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return got


def test_a_removed_body_is_reported_lost_with_its_entries(tmp_path: Path) -> None:
    """The message file's name is removed; its entry's link is a hard link to the same
    file, so the content survives it: reported lost, kept in quarantine/ (its link
    beside it), never deleted, and put back by the repair."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]  # one recipient: its link is the only other name of its file
    content = Path(root, "data", victim).read_bytes()
    os.unlink(os.path.join(root, "data", victim))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    assert any(f"{victim}.0" in p for p in report.problems)
    quarantine = Path(root, "quarantine")
    kept = sorted(os.listdir(quarantine))
    assert f"{victim}.0.link" in kept and f"{victim}.lost.note" in kept  # kept, not deleted
    assert (quarantine / f"{victim}.unlinked").read_bytes() == content
    assert os.path.samefile(quarantine / f"{victim}.unlinked", quarantine / f"{victim}.0.link")
    assert drain(q) == entries(msgs, victim)
    done = repair(root)
    assert done["restored"] == [victim] and done["lost"] == []
    assert drain(FsQueue(root)) == [f"{victim}.0"]


def test_a_removed_body_of_two_recipients_is_restored_by_repair(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[1][0]  # two recipients: their hard links keep the content
    os.unlink(os.path.join(root, "data", victim))
    q = FsQueue(root)
    assert q.last_recovery is not None and q.last_recovery.lost == (victim,)
    q.close()
    done = repair(root)
    assert done["restored"] == [victim] and done["lost"] == []
    assert drain(FsQueue(root)) == entries(msgs)


def test_removed_links_leave_the_message_in_quarantine_until_repair(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[2][0]
    os.unlink(os.path.join(root, "queue", f"{victim}.0"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    assert report.damaged_files == (f"quarantine/{victim}.unlinked",)
    assert drain(q) == entries(msgs, victim)
    done = repair(root)
    assert done["restored"] == [victim]
    assert drain(FsQueue(root)) == [f"{victim}.0"]


def test_a_stray_link_is_quarantined_alone(tmp_path: Path) -> None:
    """A hard link to the message file under an entry name the message does not have:
    taken out of service with a note and unlinked (kept, it would hold the file for
    good); the message and its real entry are untouched, and the file is freed by the
    real entry's cleanup."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]
    msg = os.path.join(root, "data", victim)
    os.link(msg, os.path.join(root, "queue", f"{victim}.7"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == () and report.quarantined == 1
    quarantine = os.listdir(os.path.join(root, "quarantine"))
    assert f"{victim}.7.note" in quarantine and f"{victim}.7.link" not in quarantine
    assert not os.path.exists(os.path.join(root, "queue", f"{victim}.7"))
    assert os.stat(msg).st_nlink == 2  # the file and its one entry's link
    assert drain(q) == entries(msgs)  # the valid message keeps moving
    assert os.listdir(os.path.join(root, "data")) == []  # and its file was freed


def test_a_stray_symlink_is_junk(tmp_path: Path) -> None:
    """A symlink of an entry name the message does not have (as the old format linked
    entries) is not a link of the current format: junk, moved aside and reported."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]
    os.symlink(f"../data/{victim}", os.path.join(root, "queue", f"{victim}.7"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == ()
    assert any(p.startswith(f"queue/'{victim}.7'") and "symlink" in p for p in report.problems)
    junk = [n for n in os.listdir(os.path.join(root, "quarantine"))
            if n.endswith(f"queue.{victim}.7")]
    assert len(junk) == 1 and os.path.islink(os.path.join(root, "quarantine", junk[0]))
    assert drain(q) == entries(msgs)  # the valid message keeps moving


def test_a_removed_hard_link_is_restored_so_the_other_cleanup_keeps_the_body(
        tmp_path: Path) -> None:
    """An entry's reference ``data/<msgid>.<i>`` is removed: recovery puts it back (an
    entry whose link damage removes is then still known by its reference), and the
    other entry's cleanup keeps the file while this entry is still queued."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[1][0]
    os.unlink(os.path.join(root, "data", f"{victim}.1"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == ()
    assert any(f"{victim}.1" in p and "restored" in p for p in report.problems)
    assert os.path.samefile(os.path.join(root, "data", f"{victim}.1"),
                            os.path.join(root, "data", victim))
    assert os.stat(os.path.join(root, "data", victim)).st_nlink == 5  # 2 references, 2 links
    first = next(h for h in q.list_queue() if h.entry_id == f"{victim}.0")
    f = q.send_start(first)
    assert f is not None
    done = q.send_done(f)
    assert done is not None and q.cleanup(done)
    assert os.path.exists(os.path.join(root, "data", victim))  # entry 1 still needs it
    assert drain(q) == sorted(set(entries(msgs)) - {f"{victim}.0"})


def test_a_hard_link_replaced_by_another_file_is_quarantined_and_restored(
        tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    ref = os.path.join(root, "data", f"{victim}.0")
    os.unlink(ref)
    Path(ref).write_bytes(b"not the message")
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == ()
    assert os.path.samefile(ref, os.path.join(root, "data", victim))
    junk = [n for n in os.listdir(os.path.join(root, "quarantine")) if n.endswith(
        f"data.{victim}.0")]
    assert len(junk) == 1
    assert Path(root, "quarantine", junk[0]).read_bytes() == b"not the message"
    assert drain(q) == entries(msgs)


def test_an_entry_link_replaced_by_a_copy_is_made_a_hard_link_again(tmp_path: Path) -> None:
    """An entry's link replaced by a copy of the message (another inode, the same bytes:
    what ``cp`` without ``-a`` makes): an exclusive recovery makes it a hard link of the
    message file again and reports that; nothing is lost, and the entry's hold on the
    file counts again (the file is freed by the last cleanup, not before)."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    msg = os.path.join(root, "data", victim)
    content = Path(msg).read_bytes()
    link = os.path.join(root, "queue", f"{victim}.1")
    os.unlink(link)
    Path(link).write_bytes(content)
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == () and report.damaged_files == ()
    assert any(p.startswith(f"queue/{victim}.1: a copy of its message file")
               for p in report.problems)
    assert os.listdir(Path(root, "quarantine")) == []
    assert os.path.samefile(link, msg) and os.stat(msg).st_nlink == 5
    assert drain(q) == entries(msgs)
    assert os.listdir(os.path.join(root, "data")) == []


def test_an_entry_link_replaced_by_a_copy_with_other_bytes_is_junk_and_its_entry_lost(
        tmp_path: Path) -> None:
    """A regular file in an entry's place whose bytes differ from its message file (one
    byte changed) is no copy: it is junk, moved aside and reported; the entry, which its
    reference still names, is reported lost with a copy of the body kept for its
    recipient; the other entry is delivered and its cleanup frees the file (the junk
    never counted as a holder: nothing leaks)."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    msg = os.path.join(root, "data", victim)
    content = Path(msg).read_bytes()
    altered = content[:-1] + bytes([content[-1] ^ 1])
    link = os.path.join(root, "queue", f"{victim}.1")
    os.unlink(link)
    Path(link).write_bytes(altered)
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    assert any(p.startswith(f"queue/'{victim}.1'") and "not a hard link" in p
               for p in report.problems)
    quarantine = Path(root, "quarantine")
    junk = [n for n in os.listdir(quarantine) if n.endswith(f"queue.{victim}.1")]
    assert len(junk) == 1 and (quarantine / junk[0]).read_bytes() == altered
    assert (quarantine / f"{victim}.1.msg").read_bytes() == content
    assert not os.path.exists(link) and not os.path.exists(f"{msg}.1")
    assert os.stat(msg).st_nlink == 3  # the file, entry 0's reference and link
    assert drain(q) == sorted(set(entries(msgs)) - {f"{victim}.1"})
    assert os.listdir(os.path.join(root, "data")) == []  # entry 0's cleanup freed it


def test_a_queue_copied_without_its_hard_links_opens_whole(tmp_path: Path) -> None:
    """A stopped queue copied by ``shutil.copytree`` (as ``cp -r`` or ``rsync -a``
    without ``-H``: every hard link becomes a file of its own), with entries queued,
    inflight (its owner killed), held and pending cleanup: the copy opens with every
    link and reference made a hard link of its message file again, nothing lost or
    quarantined, each entry delivered once, and the last cleanup frees each file."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    q = FsQueue(root)
    listed = list(q.list_queue())
    held = next(h for h in listed if h.message_id == msgs[1][0])
    assert q.hold(held) is not None
    done = q.send_start(next(h for h in listed if h.entry_id == f"{msgs[3][0]}.0"))
    assert done is not None and q.send_done(done) is not None  # pending cleanup
    inflight = q.send_start(next(h for h in listed if h.entry_id == f"{msgs[0][0]}.0"))
    assert inflight is not None
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy, symlinks=True)
    q.close()
    data = os.path.join(copy, "data")
    assert all(os.stat(os.path.join(data, m)).st_nlink == 1 for m, _ in msgs)
    c = FsQueue(copy)
    report = c.last_recovery
    assert report is not None and report.lost == () and report.damaged_files == ()
    assert os.listdir(os.path.join(copy, "quarantine")) == []
    assert report.requeued == 1 and report.cleaned == 1
    # each file's names: itself, then a link and (2+ recipients) a reference per entry
    left = {m: 1 + (1 if n == 1 else 2 * n) for m, n in msgs}
    left[msgs[3][0]] -= 2  # entry 0 cleaned up
    assert {m: os.stat(os.path.join(data, m)).st_nlink for m, _ in msgs} == left
    assert c.release(next(h for h in c.list_held())) is not None
    assert drain(c) == sorted(set(entries(msgs)) - {f"{msgs[3][0]}.0"})
    assert os.listdir(data) == []


def test_an_entry_link_replaced_by_a_copy_beside_a_live_owner(tmp_path: Path) -> None:
    """The same damage found by a recovery beside a live owner (not exclusive): the copy
    is junk all the same, and the live queue delivers the other entry and frees the
    file; the next exclusive recovery names the entry lost."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    content = Path(root, "data", victim).read_bytes()
    link = os.path.join(root, "queue", f"{victim}.1")
    os.unlink(link)
    Path(link).write_bytes(content)
    live = FsQueue(root, recover=False)
    q = FsQueue(root)  # live is open: not exclusive
    report = q.last_recovery
    assert report is not None
    assert any(p.startswith(f"queue/'{victim}.1'") for p in report.problems)
    assert drain(q) == sorted(set(entries(msgs)) - {f"{victim}.1"})
    # entry 1's reference still holds the file: entry 0's cleanup kept it
    assert sorted(os.listdir(os.path.join(root, "data"))) == [victim, f"{victim}.1"]
    live.close()
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    # no link names the file now: it is reported and kept whole, for `queue-ref repair`
    assert any(f"message {victim} lost: no link names its file" in p
               for p in report.problems)
    assert (Path(root) / "quarantine" / f"{victim}.unlinked").read_bytes() == content
    q.close()
    assert os.listdir(os.path.join(root, "data")) == []


def test_an_entry_quarantined_for_its_schedule_keeps_a_copy_of_the_body(
        tmp_path: Path) -> None:
    """Its message's other entry is delivered and cleaned up, which frees the file; the
    quarantined entry's recipient still has the body to be sent from."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[1][0]
    content = (Path(root) / "data" / victim).read_bytes()
    q = FsQueue(root)
    h = next(h for h in q.list_queue() if h.entry_id == f"{victim}.0")
    assert q.reschedule(h, Schedule(5)) is not None
    q.close()
    sched = Path(root) / "data" / f"{victim}.0.sched"
    damaged = bytearray(sched.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    sched.write_bytes(bytes(damaged))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,) and report.quarantined == 1
    assert drain(q) == sorted(set(entries(msgs)) - {f"{victim}.0"})
    assert not (Path(root) / "data" / victim).exists()  # freed by entry 1's cleanup
    quarantine = Path(root) / "quarantine"
    assert (quarantine / f"{victim}.0.msg").read_bytes() == content
    assert (quarantine / f"{victim}.0.sched").read_bytes() == bytes(damaged)
    assert not [n for n in os.listdir(quarantine) if n.endswith(".tmp")]


def test_an_entry_whose_link_was_removed_keeps_a_copy_of_the_body(tmp_path: Path) -> None:
    """Entry 0's link is gone: it is named lost, and since entry 1 still holds the file
    (and frees it once delivered), a copy of the body is kept for entry 0's recipient."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    content = (Path(root) / "data" / victim).read_bytes()
    os.unlink(os.path.join(root, "queue", f"{victim}.0"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    assert any(f"{victim}.0.msg" in p for p in report.problems)
    assert drain(q) == sorted(set(entries(msgs)) - {f"{victim}.0"})
    assert not (Path(root) / "data" / victim).exists()
    assert (Path(root) / "quarantine" / f"{victim}.0.msg").read_bytes() == content


def test_a_damaged_envelope_is_reported_lost(tmp_path: Path) -> None:
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[3][0]
    path = Path(root) / "data" / victim
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # in the envelope record
    path.write_bytes(bytes(data))
    q = FsQueue(root)
    assert q.last_recovery is not None and q.last_recovery.lost == (victim,)
    assert (Path(root) / "quarantine" / f"{victim}.msg").read_bytes() == bytes(data)
    assert drain(q) == entries(msgs, victim)


def test_repair_cli_usage_errors(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "conformance.cli", "repair", *args],
                              capture_output=True, text=True)

    assert run("--queue", str(tmp_path / "missing")).returncode == 2
    (tmp_path / "empty").mkdir()
    bad = run("--queue", str(tmp_path / "empty"))
    assert bad.returncode == 2 and "pass --backend" in bad.stderr
    assert run("--queue", str(tmp_path), "--backend", "nope").returncode == 2


def test_a_copied_queue_whose_opening_crashes_at_any_call_opens_whole_next_time(
        tmp_path: Path) -> None:
    """The opening of a copied queue killed before each of its mutating calls in turn
    (each a new copy): the next opening still finds nothing lost or quarantined, and
    every entry is delivered once."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    want = entries(msgs)
    calls = None
    k = 0
    while calls is None or k < calls:
        copy = str(tmp_path / f"copy{k}")
        shutil.copytree(root, copy, symlinks=True)
        io = CrashIO(crash_at=k)
        try:
            FsQueue(copy, io).close()
            calls = len(io.calls)  # the whole opening: a crash before each call was tried
            assert calls == k
        except Crash:
            io.kill()
        q = FsQueue(copy)
        report = q.last_recovery
        assert report is not None and report.lost == (), (k, report)
        assert os.listdir(os.path.join(copy, "quarantine")) == [], k
        assert drain(q) == want, k
        assert os.listdir(os.path.join(copy, "data")) == [], k
        shutil.rmtree(copy)
        k += 1
    assert calls is not None and calls > 10


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_link_beside_a_message_file_that_is_no_regular_file_is_junk_without_a_hang(
        tmp_path: Path, kind: str) -> None:
    """data/<msgid> replaced by a FIFO or a directory, and an empty regular file in an
    entry's place (the same size): recovery does not take the entry for a copy (opening
    a FIFO would block it for good under the gate lock, reading a directory fail the
    opening); the name in data/ is junk, moved to quarantine, and the message is
    reported lost (it was reported only as two junk files, and ``lost`` was empty)."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]
    msg = os.path.join(root, "data", victim)
    os.unlink(msg)
    if kind == "fifo":
        os.mkfifo(msg)
    else:
        os.mkdir(msg)
    link = os.path.join(root, "queue", f"{victim}.0")
    os.unlink(link)
    Path(link).write_bytes(b"")
    result: list[object] = []

    def run() -> None:
        try:
            q = FsQueue(root)
            result.append(q.last_recovery)
            q.close()
        except Exception as e:  # reported below
            result.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "recovery hangs"
    report = result[0]
    assert isinstance(report, RecoveryReport), report
    assert report.lost == (victim,), report
    assert sum(victim in p and "junk" in p for p in report.problems) == 1, report.problems
    assert not os.path.lexists(msg) and not os.path.lexists(link)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_message_whose_file_name_was_replaced_is_reported_lost_and_repair_sends_it_whole(
        tmp_path: Path, kind: str) -> None:
    """data/<msgid> of a one-recipient message replaced by a FIFO, a directory or a
    symlink to a copy, its entry's link (the message's inode) left: recovery moved the
    link to quarantine as junk and reported nothing lost.  Now the replaced name is the
    junk; the message is reported lost with its content kept as <msgid>.unlinked, and
    ``queue-ref repair`` puts it back in the queue, delivered whole."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]
    msg = os.path.join(root, "data", victim)
    body = Path(msg).read_bytes()
    os.unlink(msg)
    if kind == "fifo":
        os.mkfifo(msg)
    elif kind == "directory":
        os.mkdir(msg)
    else:
        Path(tmp_path / "copy").write_bytes(body)
        os.symlink(tmp_path / "copy", msg)
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,), report
    assert any("not a regular file" in p and victim in p for p in report.problems)
    assert victim not in {h.message_id for h in q.list_queue()}
    assert os.path.exists(os.path.join(root, "quarantine", f"{victim}.unlinked"))
    q.close()
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "repair", "--queue", root,
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    q = FsQueue(root)
    try:
        ids = {h.entry_id: h.message_id for h in q.list_queue()}
        assert f"{victim}.0" in ids
        got = q.send_start(next(h for h in q.list_queue() if h.message_id == victim))
        assert got is not None
        with q.read_inflight(got) as r:
            assert r.read_all() == b"body 0 " * 40
    finally:
        q.close()


def test_a_replaced_message_file_is_reported_lost_beside_its_live_owner(tmp_path: Path) -> None:
    """data/<msgid> replaced by a FIFO while the process that enqueued the message still
    has the queue open: another process's recovery (not exclusive) reports it lost, once,
    and keeps its content (step 4 took a dangling link of a live owner for an enqueue in
    progress and hid the message from every listing, lost empty; found by a cold review).
    Repair, once the owner closed, puts it back whole."""
    root = str(tmp_path / "q")
    owner = FsQueue(root)
    with owner.enqueue("a@example.org") as e:
        e.write(b"Subject: x\r\n\r\nbody\r\n")
        mid = e.commit([Recipient(f"r{k}@example.net", Schedule(0)) for k in range(2)])[0].message_id
    msg = os.path.join(root, "data", mid)
    os.unlink(msg)
    os.mkfifo(msg)
    other = FsQueue(root)
    try:
        report = other.last_recovery
        assert report is not None and report.lost == (mid,)
        assert sum(f"message {mid} lost" in p for p in report.problems) == 1, report.problems
        assert os.path.exists(os.path.join(root, "quarantine", f"{mid}.unlinked"))
    finally:
        other.close()
        owner.close()
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "repair", "--queue", root],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    q = FsQueue(root)
    try:
        assert sorted(h.entry_id for h in q.list_queue()) == [f"{mid}.0", f"{mid}.1"]
    finally:
        q.close()


def test_the_content_kept_for_repair_is_the_messages_file_not_a_file_in_an_entrys_place(
        tmp_path: Path) -> None:
    """A FIFO at data/<msgid> of a two-recipient message and an empty file at its entry
    .0: the copy kept as <msgid>.unlinked is the file the other names share (it was the
    first link by name, the empty file, and repair then found it too short)."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = next(m for m, n in msgs if n == 2)
    msg = os.path.join(root, "data", victim)
    os.unlink(msg)
    os.mkfifo(msg)
    link = os.path.join(root, "queue", f"{victim}.0")
    os.unlink(link)
    Path(link).write_bytes(b"")
    q = FsQueue(root)
    assert q.last_recovery is not None and q.last_recovery.lost == (victim,)
    q.close()
    kept = os.path.join(root, "quarantine", f"{victim}.unlinked")
    assert os.path.getsize(kept) > 0
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "repair", "--queue", root],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    q = FsQueue(root)
    try:
        assert sorted(h.entry_id for h in q.list_queue() if h.message_id == victim) == [
            f"{victim}.0", f"{victim}.1"]
    finally:
        q.close()
