"""``queue-ref repair``: salvage every intact message of a damaged queue.

    queue-ref repair --queue DIR [--backend fs|kv-log|kv-leveldb] [--json]

Run it with the queue stopped.  The filesystem queue is recovered and rebuilt from its data
files and links (``queue_ref.fsqueue.rebuild``); a KV queue's store is salvaged (the log
engine: every intact log record and table block; LevelDB: its own ``RepairDB``;
``queue_ref.kv.salvage``).  Damaged files are kept aside, never deleted.  It prints what
it did and every message it could not save; running it again (also after it was killed)
gives the same queue.  Exit status 0 once the queue is repaired (whatever was lost: see
``lost``), 1 if it could not be (the queue is in use, the disk failed), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from queue_ref.opener import BACKENDS
from queue_ref.storage import InvalidInputError, QueueError, RecoveryReport

_KINDS = ("fs", "kv-log", "kv-leveldb")


def detect_backend(path: str) -> str:
    """The backend whose files are in ``path``; InvalidInputError if it cannot tell."""
    names = set(os.listdir(path))
    if "data" in names and "queue" in names:
        return "fs"
    if "queue-ref.lock" in names or "LOG" in names or any(n.endswith(".ldb") for n in names):
        return "kv-leveldb"
    if any(n.endswith(".tbl") or n.endswith(".log") or n.startswith("MANIFEST-")
           for n in names) or "REPAIR" in names:
        return "kv-log"
    raise InvalidInputError(f"cannot tell which backend wrote {path}: pass --backend")


def _report_dict(r: RecoveryReport) -> dict[str, Any]:
    return {"lost": list(r.lost), "lost_unknown": r.lost_unknown,
            "damaged_files": list(r.damaged_files), "problems": list(r.problems),
            "quarantined": r.quarantined, "requeued": r.requeued}


def run(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.queue)
    if not os.path.isdir(path):
        print(f"queue-ref repair: {args.queue} is not a directory", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "fs-fsync":
        backend = "fs"
    try:
        if backend is None:
            backend = detect_backend(path)
        if backend not in _KINDS:
            raise InvalidInputError(f"repair knows the backends {', '.join(_KINDS)}, "
                                    f"not {backend!r}")
        restored: list[str] = []
        if backend == "fs":
            from queue_ref.fsqueue.rebuild import rebuild

            fs = rebuild(path)
            report, actions, restored = fs.report, fs.actions, fs.restored
            messages, entries = fs.messages, fs.entries
        else:
            from queue_ref.kv.kv_queue import KvQueue

            kv = KvQueue.repair_log(path) if backend == "kv-log" else KvQueue.repair_leveldb(path)
            report, actions, messages, entries = kv.report, kv.actions, kv.messages, kv.entries
    except InvalidInputError as e:
        print(f"queue-ref repair: {e}", file=sys.stderr)
        return 2
    except (QueueError, OSError) as e:
        print(f"queue-ref repair: the queue at {path} could not be repaired: {e}",
              file=sys.stderr)
        if args.json:
            print(json.dumps({"queue": path, "backend": backend, "repaired": False,
                              "error": str(e)}))
        return 1
    print(f"repaired {backend} queue at {path}")
    for a in actions:
        print(f"  {a}")
    for p in report.problems:
        print(f"  problem: {p}")
    if report.lost or report.lost_unknown:
        print(f"  LOST: messages {', '.join(report.lost) or '(none by id)'}"
              + (f"; unknown ids, {report.lost_unknown} records" if report.lost_unknown else ""))
    else:
        print("  nothing lost")
    for f in report.damaged_files:
        print(f"  kept aside: {f}")
    print(f"  the queue holds {messages} message(s), {entries} entr"
          f"{'y' if entries == 1 else 'ies'}")
    if args.json:
        print(json.dumps({"queue": path, "backend": backend, "repaired": True,
                          "actions": actions, "restored": restored, "messages": messages,
                          "entries": entries, **_report_dict(report)}))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "repair", help="salvage every intact message of a damaged queue (queue stopped)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queue", required=True, metavar="DIR", help="the queue's directory")
    p.add_argument("--backend", choices=[b for b in BACKENDS if b in (*_KINDS, "fs-fsync")],
                   help="the backend that wrote it (default: told from its files)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.set_defaults(func=run)
