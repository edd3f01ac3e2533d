"""chasquid's queue: one file per message, replaced by temp, fsync, rename; no directory fsync.

Layout: ``queue/m_<id>``, a JSON document with the sender, params, body and every
recipient's state and schedule (chasquid keeps the same in a protobuf, body included).
Every change rewrites the whole file: write ``queue/m_<id>.tmp``, fsync it, rename it
over ``m_<id>``.  The directory is never fsynced.  INFLIGHT lives in memory (chasquid
retries every pending recipient after a restart).  A message whose recipients are all
cleaned up is unlinked.

What the suite shows: the rename that publishes a new message is a change to the
directory, and nothing makes it durable; a power cut after ``commit`` returned can lose
the message (C1).  The same rename publishes ``send_done``: the old file can come back
with the recipient queued again (C3).  The fix is one ``fsync`` of the directory after
each rename (what ``queue_ref.io.write_file_durable`` does).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from conformance.examples.peers._base import (
    CLEANUP,
    QUEUED,
    Entry,
    PeerQueue,
    Stored,
    read_all,
    write_file,
)
from queue_ref.io import IO
from queue_ref.storage import Footprint, Recipient, RecoveryReport, Schedule

GONE = "gone"


class ChasquidQueue(PeerQueue):
    def _setup(self) -> None:
        if not self.io.is_dir(self.path("queue")):
            self.io.mkdir(self.path("queue"))

    def _q(self, name: str) -> str:
        return self.path("queue", name)

    def _message_ids(self) -> list[int]:
        return sorted(int(n[2:]) for n in self.io.listdir(self._q(""))
                      if n.startswith("m_") and n[2:].isdigit())

    def _write(self, mid: int, doc: dict[str, Any]) -> None:
        tmp = self._q(f"m_{mid}.tmp")
        write_file(self.io, tmp, json.dumps(doc).encode(), sync=True)
        self.io.rename(tmp, self._q(f"m_{mid}"))  # no fsync of queue/: the name may not last

    def _doc(self, mid: int) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(read_all(self.io, self._q(f"m_{mid}")))
        return doc

    def _store(self, mid: int, mail_from: str, params: dict[str, str], body: bytes,
               rcpts: list[Recipient]) -> None:
        self._write(mid, {
            "from": mail_from, "params": params, "data": base64.b64encode(body).decode(),
            "rcpts": [{"rcpt": r.address, "zone": r.zone, "state": QUEUED,
                       "at": r.schedule.at, "attempts": r.schedule.attempts,
                       "reason": r.schedule.reason} for r in rcpts]})

    def _entries(self) -> list[Entry]:
        out = []
        for mid in self._message_ids():
            try:
                doc = self._doc(mid)
            except (OSError, ValueError):
                continue  # chasquid logs and skips an unreadable item
            for i, r in enumerate(doc["rcpts"]):
                if r["state"] != GONE:
                    out.append(Entry(mid, i, r["state"], Schedule(r["at"], r["attempts"],
                                                                 r.get("reason", ""))))
        return out

    def _set(self, e: Entry, state: str, schedule: Schedule) -> None:
        doc = self._doc(e.mid)
        doc["rcpts"][e.index].update(state=state, at=schedule.at, attempts=schedule.attempts,
                                     reason=schedule.reason)
        self._write(e.mid, doc)

    def _release(self, e: Entry) -> None:
        doc = self._doc(e.mid)
        doc["rcpts"][e.index]["state"] = GONE
        if all(r["state"] == GONE for r in doc["rcpts"]):
            self.io.unlink(self._q(f"m_{e.mid}"))
        else:
            self._write(e.mid, doc)

    def _load(self, mid: int) -> Stored:
        doc = self._doc(mid)
        return Stored(doc["from"], doc["params"], [(r["rcpt"], r["zone"]) for r in doc["rcpts"]],
                      base64.b64decode(doc["data"]))

    def _recover(self) -> RecoveryReport:
        cleaned = 0
        for e in self._entries():
            if e.state == CLEANUP:
                self._release(e)
                cleaned += 1
        removed = 0
        for name in self.io.listdir(self._q("")):
            if name.endswith(".tmp"):
                self.io.unlink(self._q(name))
                removed += 1
        return RecoveryReport(cleaned=cleaned, orphans_removed=removed)

    def _usage(self) -> Footprint:
        names = self.io.listdir(self._q(""))
        return Footprint(len(names), sum(self.io.lstat(self._q(n)).st_size for n in names))


def factory(root: str, io: IO | None = None) -> ChasquidQueue:
    return ChasquidQueue(root, io)
