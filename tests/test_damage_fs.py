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
