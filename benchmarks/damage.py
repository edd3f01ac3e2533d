"""Damage campaign: damage every kind of file each backend writes, and fill its disk.

    python benchmarks/damage.py [--backend fs|kv-log|kv-leveldb|all] [--trials N]
                                [--seed S] [--no-full-disk] [--json]

For each backend and each kind of file it writes, N trials of each damage (one flipped
bit at a random offset, the file cut short at a random length, the file removed) on a
queue of a dozen acknowledged messages that was closed cleanly: then the queue is opened
(if it refuses, ``queue-ref repair``'s salvage runs, as an operator would) and drained,
reading every body.  Every acknowledged message not delivered is either reported (by id
in ``RecoveryReport.lost``, as a ``CorruptionError`` while it was read, or counted in
``lost_unknown``) or lost silently; a body delivered altered is counted apart.  Then N
trials of a full disk per backend on a 4 MiB tmpfs (root only): enqueue until
``NoSpaceError``, free space, go on without a restart, drain; every acknowledged message
must be delivered.  Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from queue_ref import (
    CorruptionError,
    NoSpaceError,
    QueueError,
    Recipient,
    RecoveryReport,
    Schedule,
    Storage,
)
from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.rebuild import rebuild
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import Handle

OPENERS: dict[str, Callable[[str], Storage]] = {
    "fs": FsQueue, "kv-log": KvQueue.open_log, "kv-leveldb": KvQueue.open_leveldb,
}
#: Files each backend writes, by kind: a glob under the queue's directory.
FILES: dict[str, dict[str, str]] = {
    "fs": {"message file": "data/*", "queue link": "queue/*", "owner lock": "owners/*.lock"},
    "kv-log": {"log": "*.log", "table": "*.tbl", "manifest": "MANIFEST-*", "CURRENT": "CURRENT",
               "closed record": "queue-ref.closed"},
    "kv-leveldb": {"log": "*.log", "table": "*.ldb", "manifest": "MANIFEST-*",
                   "CURRENT": "CURRENT", "closed record": "queue-ref.closed"},
}
DAMAGES = ("bit flip", "truncation", "removal")
RETRIES = 5
H = TypeVar("H", bound=Handle)
R = TypeVar("R")
MESSAGES = 12


def body_of(i: int) -> bytes:
    return (b"message %03d " % i) * (40 + 37 * i)


@dataclass
class Row:
    trials: int = 0
    detected: int = 0  # trials whose damage was reported or refused (with the repair named)
    harmless: int = 0  # trials where nothing was lost and nothing needed saying
    refused: int = 0  # trials where opening refused and repair salvaged
    expected: int = 0  # acknowledged messages not yet delivered before the damage
    delivered: int = 0
    reported: int = 0  # messages lost and named (or counted as unknown ids)
    silent: int = 0  # messages lost with no word
    altered: int = 0  # bodies delivered with other bytes
    failed: int = 0  # full disk: trials where the queue could not go on
    notes: list[str] = field(default_factory=list)


def build(backend: str, root: str, rng: random.Random) -> dict[str, bytes]:
    """A queue of MESSAGES acknowledged messages (tables written halfway for the KV
    engines), two of them delivered; closed cleanly.  Returns id -> body still queued."""
    q = OPENERS[backend](root)
    want: dict[str, bytes] = {}
    try:
        for i in range(MESSAGES):
            if i == MESSAGES // 2 and isinstance(q, KvQueue):
                q.compact()
            n = 1 + (i % 2 if backend == "fs" else 0)
            with q.enqueue("from@example.org") as e:
                e.write(body_of(i))
                hs = e.commit([Recipient(f"r{i}.{k}@example.net", Schedule(0)) for k in range(n)])
            want[hs[0].message_id] = body_of(i)
        for h in list(q.list_queue())[:2]:
            f = q.send_start(h)
            assert f is not None
            done = q.send_done(f)
            assert done is not None and q.cleanup(done)
            want.pop(h.message_id, None)
    finally:
        q.close()
    return want


def damage(path: Path, kind: str, rng: random.Random) -> None:
    if kind == "removal":
        path.unlink()
        return
    if path.is_symlink():
        target = bytearray(os.readlink(path).encode())
        if kind == "bit flip":
            i = rng.randrange(len(target))
            target[i] ^= 1 << rng.randrange(7)
        else:
            del target[rng.randrange(len(target)):]
        path.unlink()
        os.symlink(bytes(target) or b"x", path)
        return
    data = bytearray(path.read_bytes())
    if not data:
        path.write_bytes(b"\x01")
        return
    if kind == "bit flip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)):]
    path.write_bytes(bytes(data))


def open_or_repair(backend: str, root: str) -> tuple[Storage, RecoveryReport, bool]:
    """Open the queue; if it refuses, run the repair and open it again."""
    try:
        q = OPENERS[backend](root)
        return q, q.last_recovery or RecoveryReport(), False  # type: ignore[attr-defined]
    except QueueError:
        if backend == "fs":
            report = rebuild(root).report
        elif backend == "kv-log":
            report = KvQueue.repair_log(root).report
        else:
            report = KvQueue.repair_leveldb(root).report
        return OPENERS[backend](root), report, True


def retried(call: Callable[[H], R], handle: H) -> R:
    """``call(handle)``, tried again (with the handle the error gives back) after a
    NoSpaceError, as a relay does: a moment later a compaction may have freed space."""
    for attempt in range(RETRIES):
        try:
            return call(handle)
        except NoSpaceError as e:
            if attempt == RETRIES - 1 or e.handle is None:
                raise
            handle = e.handle  # type: ignore[assignment]
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def drain(q: Storage) -> tuple[dict[str, bytes], set[str]]:
    """Deliver everything: (message id -> body delivered, ids refused as corrupt)."""
    got: dict[str, bytes] = {}
    corrupt: set[str] = set()
    for h in list(q.list_queue()):
        f = retried(q.send_start, h)
        if f is None:
            continue
        try:
            with q.read_inflight(f) as r:
                got[h.message_id] = r.read_all()
        except CorruptionError:
            corrupt.add(h.message_id)
            continue
        done = retried(q.send_done, f)
        if done is not None:
            retried(q.cleanup, done)
    return got, corrupt


def trial(backend: str, what: str, pattern: str, kind: str, rng: random.Random,
          row: Row, base: str) -> None:
    root = os.path.join(base, "q")
    want = build(backend, root, rng)
    files = sorted(p for p in Path(root).glob(pattern) if p.is_file() or p.is_symlink())
    if not files:
        row.notes.append(f"{what}: no such file in this trial")
        return
    damage(rng.choice(files), kind, rng)
    row.trials += 1
    row.expected += len(want)
    try:
        q, report, refused = open_or_repair(backend, root)
    except (QueueError, OSError) as e:
        row.detected += 1
        row.reported += len(want)  # the queue refuses and says why: nothing is silent
        row.notes.append(f"{what}/{kind}: repair failed: {e}")
        return
    try:
        got, corrupt = drain(q)
    finally:
        q.close()
    named = set(report.lost) | corrupt
    missing = set(want) - set(got)
    row.delivered += len(set(want) & set(got))
    row.altered += sum(1 for m, b in got.items() if m in want and b != want[m])
    silent = {m for m in missing if m not in named}
    if silent and report.lost_unknown:
        row.reported += len(silent)  # "unknown ids, N records"
        silent = set()
    row.reported += len(missing) - len(silent)
    row.silent += len(silent)
    row.refused += refused
    if refused or report.damage_found or corrupt or report.quarantined:
        row.detected += 1
    elif not missing:
        row.harmless += 1


def full_disk(backend: str, rng: random.Random) -> tuple[bool, int, int, str]:
    """(passed, acknowledged, lost silently, note) on a 4 MiB tmpfs: another file takes
    1 to 1.5 MiB, the queue fills the rest, that file is removed, the queue goes on."""
    mnt = tempfile.mkdtemp(prefix="queue-ref-damage-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    acked: dict[str, bytes] = {}
    try:
        ballast = Path(mnt) / "ballast"
        ballast.write_bytes(bytes(rng.randrange(1024, 1536) * 1024))
        q = OPENERS[backend](os.path.join(mnt, "q"))
        try:
            for i in range(2000):
                try:
                    with q.enqueue("from@example.org") as e:
                        e.write(body_of(i % 50))
                        h = e.commit([Recipient(f"r{i}@example.net", Schedule(0))])[0]
                    acked[h.message_id] = body_of(i % 50)
                except NoSpaceError:
                    break
            else:
                return False, len(acked), 0, "the disk never filled"
            ballast.unlink()
            with q.enqueue("from@example.org") as e:
                e.write(b"after")
                h = e.commit([Recipient("late@example.net", Schedule(0))])[0]
            acked[h.message_id] = b"after"
            got, corrupt = drain(q)
        finally:
            q.close()
        lost = [m for m in acked if got.get(m) != acked[m] and m not in corrupt]
        return not lost and not corrupt, len(acked), len(lost), ""
    except QueueError as e:  # stuck: nothing is lost (the store keeps it), it cannot go on
        return False, len(acked), 0, f"{type(e).__name__}: {e}"
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        shutil.rmtree(mnt, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="all", choices=[*OPENERS, "all"])
    ap.add_argument("--trials", type=int, default=5, help="trials per file kind and damage")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-full-disk", action="store_true")
    ap.add_argument("--json", action="store_true", help="(the last line is JSON anyway)")
    args = ap.parse_args(argv)
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    rng = random.Random(args.seed)
    backends = list(OPENERS) if args.backend == "all" else [args.backend]
    started = time.monotonic()
    rows: dict[tuple[str, str], Row] = {}
    for backend in backends:
        for what, pattern in FILES[backend].items():
            for kind in DAMAGES:
                row = rows.setdefault((backend, f"{what}: {kind}"), Row())
                for _ in range(args.trials):
                    with tempfile.TemporaryDirectory(prefix="queue-ref-damage-") as base:
                        trial(backend, what, pattern, kind, rng, row, base)
        if not args.no_full_disk and os.geteuid() == 0:
            row = rows.setdefault((backend, "full disk (4 MiB tmpfs)"), Row())
            for _ in range(args.trials):
                ok, acked, lost, note = full_disk(backend, rng)
                row.trials += 1
                row.expected += acked
                row.silent += lost
                if ok:  # NoSpaceError raised, then every message delivered
                    row.detected += 1
                    row.delivered += acked - lost
                else:
                    row.failed += 1
                if note:
                    row.notes.append(note)
    head = ("backend", "damage", "trials", "detected", "harmless", "repaired", "delivered",
            "reported lost", "lost silently", "altered", "stuck")
    lines = [head]
    for (backend, what), r in rows.items():
        lines.append((backend, what, str(r.trials), str(r.detected), str(r.harmless),
                      str(r.refused), f"{r.delivered}/{r.expected}", str(r.reported),
                      str(r.silent), str(r.altered), str(r.failed)))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    silent = sum(r.silent for r in rows.values())
    altered = sum(r.altered for r in rows.values())
    print(json.dumps({
        "seed": args.seed, "trials": args.trials, "seconds": round(time.monotonic() - started, 1),
        "silent_losses": silent, "altered": altered,
        "rows": [{"backend": b, "damage": w, "trials": r.trials, "detected": r.detected,
                  "harmless": r.harmless, "repaired": r.refused, "expected": r.expected,
                  "delivered": r.delivered, "reported_lost": r.reported,
                  "lost_silently": r.silent, "altered": r.altered, "stuck": r.failed,
                  "notes": r.notes[:3]}
                 for (b, w), r in rows.items()]}))
    return 0 if silent == 0 and altered == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
