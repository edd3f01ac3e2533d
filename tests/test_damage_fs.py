"""Damage in the filesystem queue: a lost message is reported with its entries and its
links kept aside; a stray link is quarantined alone; ``queue-ref repair`` (the rebuild)
puts every intact message back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from queue_ref import Recipient, Schedule
from queue_ref.fsqueue import FsQueue


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
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]  # one recipient: its file was its only copy
    os.unlink(os.path.join(root, "data", victim))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == (victim,)
    assert any(f"{victim}.0" in p for p in report.problems)
    kept = sorted(os.listdir(os.path.join(root, "quarantine")))
    assert f"{victim}.0.link" in kept and f"{victim}.lost.note" in kept  # kept, not deleted
    assert drain(q) == entries(msgs, victim)
    assert repair(root)["lost"] == [victim]  # still named by the repair


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
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[0][0]
    os.symlink(f"../data/{victim}", os.path.join(root, "queue", f"{victim}.7"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == () and report.quarantined == 1
    assert f"{victim}.7.link" in os.listdir(os.path.join(root, "quarantine"))
    assert drain(q) == entries(msgs)  # the valid message keeps moving


def test_a_removed_hard_link_is_restored_so_the_other_cleanup_keeps_the_body(
        tmp_path: Path) -> None:
    """The per-recipient hard links count a message's holders: with one gone, the other
    entry's cleanup would free the file while this entry is still queued."""
    root = str(tmp_path / "q")
    msgs = fill(root)
    victim = msgs[1][0]
    os.unlink(os.path.join(root, "data", f"{victim}.1"))
    q = FsQueue(root)
    report = q.last_recovery
    assert report is not None and report.lost == ()
    assert any(f"{victim}.1" in p and "restored" in p for p in report.problems)
    assert os.stat(os.path.join(root, "data", victim)).st_nlink == 3
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
