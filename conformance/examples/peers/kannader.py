"""Kannader's filesystem queue as its book describes it (seed 001), fsync-free as its code is.

Layout::

    data/<mail>/contents              the body
    data/<mail>/<dest>/metadata       JSON: sender, recipient, index, zone, params
    data/<mail>/<dest>/schedule       JSON: at, attempts, reason (replaced by temp + rename)
    queue/<id>    -> ../data/<mail>/<dest>   relative symlinks: the entry's state is
    inflight/<id> -> ...                     the directory its link is in
    cleanup/<id>  -> ...

Enqueue creates ``data/<mail>``, one ``<dest>`` directory per recipient with its
metadata and schedule, writes ``contents``, and commits by creating one symlink in
``queue/`` per recipient.  State changes rename the link between directories.  Cleanup
removes the dest files, the dest directory, the contents when no dest is left, then the
link.  Nothing is ever fsynced, and the commit is one symlink per recipient.

What the suite shows: a crash between two of the commit's symlinks leaves part of the
message queued (C2, even on a process kill); after a power cut acknowledged mail is
lost (C1).  Ids are numbers here (Kannader uses UUIDs) so that runs repeat exactly.
"""

from __future__ import annotations

import json

from conformance.examples.peers._base import (
    CLEANUP,
    INFLIGHT,
    QUEUED,
    Entry,
    PeerQueue,
    Stored,
    read_all,
    write_file,
)
from queue_ref.io import IO
from queue_ref.storage import Footprint, Recipient, RecoveryReport, Schedule

STATE_DIRS = {QUEUED: "queue", INFLIGHT: "inflight", CLEANUP: "cleanup"}


class KannaderQueue(PeerQueue):
    persists_inflight = True

    def _setup(self) -> None:
        for d in ("data", *STATE_DIRS.values()):
            if not self.io.is_dir(self.path(d)):
                self.io.mkdir(self.path(d))

    def _message_ids(self) -> list[int]:
        return [int(n) for n in self.io.listdir(self.path("data")) if n.isdigit()]

    def _store(self, mid: int, mail_from: str, params: dict[str, str], body: bytes,
               rcpts: list[Recipient]) -> None:
        io, mail = self.io, self.path("data", str(mid))
        io.mkdir(mail)
        for i, r in enumerate(rcpts):
            dest = f"{mail}/{i}"
            io.mkdir(dest)
            write_file(io, f"{dest}/schedule", _sched(r.schedule), sync=False)
            write_file(io, f"{dest}/metadata", json.dumps({
                "from": mail_from, "rcpt": r.address, "index": i, "zone": r.zone,
                "params": params}).encode(), sync=False)
        write_file(io, f"{mail}/contents", body, sync=False)
        for i in range(len(rcpts)):  # the commit: one link per recipient
            io.symlink(f"../data/{mid}/{i}", self.path("queue", f"{mid}.{i}"))

    def _entries(self) -> list[Entry]:
        out = []
        for state, d in STATE_DIRS.items():
            for name in self.io.listdir(self.path(d)):
                mid, _, idx = name.partition(".")
                try:
                    sched = json.loads(read_all(self.io, self.path("data", mid, idx,
                                                                   "schedule")))
                    out.append(Entry(int(mid), int(idx), state,
                                     Schedule(sched["at"], sched["attempts"],
                                              sched.get("reason", ""))))
                except (OSError, ValueError, KeyError):
                    continue  # a dangling or half-written link: Kannader skips it too
        return sorted(out, key=lambda e: (e.mid, e.index))

    def _set(self, e: Entry, state: str, schedule: Schedule) -> None:
        if schedule != e.schedule:
            dest = self.path("data", str(e.mid), str(e.index))
            write_file(self.io, f"{dest}/schedule.new", _sched(schedule), sync=False)
            self.io.rename(f"{dest}/schedule.new", f"{dest}/schedule")
        if state != e.state:
            self.io.rename(self.path(STATE_DIRS[e.state], e.id),
                           self.path(STATE_DIRS[state], e.id))

    def _release(self, e: Entry) -> None:
        io = self.io
        mail = self.path("data", str(e.mid))
        dest = f"{mail}/{e.index}"
        for name in io.listdir(dest):
            io.unlink(f"{dest}/{name}")
        io.rmdir(dest)
        if io.listdir(mail) == ["contents"]:
            io.unlink(f"{mail}/contents")
            io.rmdir(mail)
        io.unlink(self.path("cleanup", e.id))

    def _load(self, mid: int) -> Stored:
        mail = self.path("data", str(mid))
        rcpts: list[tuple[str, str]] = []
        meta: dict[str, object] = {}
        for name in sorted(n for n in self.io.listdir(mail) if n.isdigit()):
            meta = json.loads(read_all(self.io, f"{mail}/{name}/metadata"))
            idx = int(str(meta["index"]))
            rcpts += [("", "")] * (idx + 1 - len(rcpts))
            rcpts[idx] = (str(meta["rcpt"]), str(meta["zone"]))
        params = meta.get("params", {})
        return Stored(str(meta.get("from", "")), dict(params) if isinstance(params, dict)
                      else {}, rcpts, read_all(self.io, f"{mail}/contents"))

    def _recover(self) -> RecoveryReport:
        requeued = cleaned = 0
        for e in self._entries():
            if e.state == INFLIGHT:
                self._set(e, QUEUED, e.schedule)
                requeued += 1
            elif e.state == CLEANUP:
                self._release(e)
                cleaned += 1
        return RecoveryReport(requeued=requeued, cleaned=cleaned)

    def _usage(self) -> Footprint:
        objects = size = 0
        for mid in self._message_ids():
            mail = self.path("data", str(mid))
            objects += 1
            if self.io.exists(f"{mail}/contents"):
                size += self.io.lstat(f"{mail}/contents").st_size
        for d in STATE_DIRS.values():
            objects += len(self.io.listdir(self.path(d)))
        return Footprint(objects, size)


def _sched(s: Schedule) -> bytes:
    return json.dumps({"at": s.at, "attempts": s.attempts, "reason": s.reason}).encode()


def factory(root: str, io: IO | None = None) -> KannaderQueue:
    return KannaderQueue(root, io)
