"""The recovery a relay runs beside its open filesystem queue, in a process of its own.

    python -m queue_ref.fsqueue.recover_child ROOT SYNC

opens the queue at ROOT (``SYNC``: ``syncfs``, ``fsync`` or ``default``) as another
owner, which runs its recovery, closes it, and prints the ``RecoveryReport`` as one JSON
object.  A process of its own, so that what the recovery holds while it reads every
entry (each link's name and path: about 500 bytes an entry) is given back to the system
when it ends instead of staying in the relay, and so that it does not contend with the
relay's event loop for one interpreter (``queue_ref.opener.open_serving``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from queue_ref.fsqueue.fs_queue import FsQueue
from queue_ref.storage import RecoveryReport


def report_json(report: RecoveryReport) -> str:
    return json.dumps(dataclasses.asdict(report))


def report_from_json(text: str) -> RecoveryReport:
    """The report ``report_json`` printed; ValueError for anything else."""
    data: Any = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"not a recovery report: {text[:200]!r}")
    fields = {f.name: f for f in dataclasses.fields(RecoveryReport)}
    if set(data) - set(fields):
        raise ValueError(f"unknown fields of a recovery report: {sorted(set(data) - set(fields))}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in data.items()}
    return RecoveryReport(**values)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("syncfs", "fsync", "default"):
        print("usage: python -m queue_ref.fsqueue.recover_child ROOT syncfs|fsync|default",
              file=sys.stderr)
        return 2
    with FsQueue(argv[0], sync=None if argv[1] == "default" else argv[1]) as q:
        report = q.last_recovery or RecoveryReport()
    print(report_json(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
