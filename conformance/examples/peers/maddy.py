"""maddy's queue order: the metadata is renamed in before the body is fsynced.

Layout (``messages/``): ``<id>.body``; ``<id>.meta`` (JSON: sender, params, recipients
with their first schedules; its presence is the commit); ``<id>.<i>.state`` (JSON:
state and schedule of entry ``i`` once it changed; ``gone`` is a tombstone kept until
the message's last entry is cleaned up).

Everything after the commit is done carefully (temp file, fsync, rename, directory
fsync).  The commit is not: the body is written, the metadata is written to a temp
file, fsynced, renamed in and the directory fsynced, and only then is the body
fsynced.  INFLIGHT lives in memory (as in maddy, a restart retries every recipient).

What the suite shows: a power cut between the metadata's rename and the body's fsync
leaves a queued message whose body is empty, cut short or garbage (C6): the metadata
pointed at bytes that were not yet on disk.  The fix is the other order: fsync the
body, then publish the metadata.
"""

from __future__ import annotations

import json

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


class MaddyQueue(PeerQueue):
    def _setup(self) -> None:
        if not self.io.is_dir(self.path("messages")):
            self.io.mkdir(self.path("messages"))
            self.io.fsync_dir(self.root)

    def _m(self, name: str) -> str:
        return self.path("messages", name)

    def _message_ids(self) -> list[int]:
        return sorted({int(n.split(".")[0]) for n in self.io.listdir(self._m(""))
                       if n.split(".")[0].isdigit()})

    def _durable(self, name: str, data: bytes) -> None:
        write_file(self.io, self._m(name + ".tmp"), data, sync=True)
        self.io.rename(self._m(name + ".tmp"), self._m(name))
        self.io.fsync_dir(self._m(""))

    def _store(self, mid: int, mail_from: str, params: dict[str, str], body: bytes,
               rcpts: list[Recipient]) -> None:
        io = self.io
        fd = io.open_create(self._m(f"{mid}.body"))
        try:
            io.write(fd, body)
            meta = json.dumps({"from": mail_from, "params": params, "rcpts": [
                {"rcpt": r.address, "zone": r.zone, "at": r.schedule.at,
                 "attempts": r.schedule.attempts, "reason": r.schedule.reason}
                for r in rcpts]}).encode()
            self._durable(f"{mid}.meta", meta)  # the message is visible from here...
            io.fsync(fd)  # ...and its body durable only from here
        finally:
            io.close(fd)

    def _meta(self, mid: int) -> dict[str, object]:
        meta: dict[str, object] = json.loads(read_all(self.io, self._m(f"{mid}.meta")))
        return meta

    def _states(self, mid: int) -> list[tuple[str, Schedule]]:
        rcpts = self._meta(mid)["rcpts"]
        assert isinstance(rcpts, list)
        out = []
        for i, r in enumerate(rcpts):
            state, sched = QUEUED, Schedule(r["at"], r["attempts"], r.get("reason", ""))
            name = f"{mid}.{i}.state"
            if self.io.exists(self._m(name)):
                d = json.loads(read_all(self.io, self._m(name)))
                state, sched = d["state"], Schedule(d["at"], d["attempts"], d.get("reason", ""))
            out.append((state, sched))
        return out

    def _entries(self) -> list[Entry]:
        out = []
        for mid in self._message_ids():
            if not self.io.exists(self._m(f"{mid}.meta")):
                continue
            for i, (state, sched) in enumerate(self._states(mid)):
                if state != GONE:
                    out.append(Entry(mid, i, state, sched))
        return out

    def _set(self, e: Entry, state: str, schedule: Schedule) -> None:
        self._durable(f"{e.mid}.{e.index}.state", json.dumps(
            {"state": state, "at": schedule.at, "attempts": schedule.attempts,
             "reason": schedule.reason}).encode())

    def _release(self, e: Entry) -> None:
        states = self._states(e.mid)
        if all(s == GONE for i, (s, _) in enumerate(states) if i != e.index):
            self._remove_message(e.mid)
        else:
            self._set(e, GONE, e.schedule)

    def _remove_message(self, mid: int) -> None:
        io = self.io
        io.unlink(self._m(f"{mid}.meta"))
        for name in io.listdir(self._m("")):
            if name.split(".")[0] == str(mid):
                io.unlink(self._m(name))
        io.fsync_dir(self._m(""))

    def _load(self, mid: int) -> Stored:
        meta = self._meta(mid)
        rcpts = meta["rcpts"]
        params = meta["params"]
        assert isinstance(rcpts, list) and isinstance(params, dict)
        return Stored(str(meta["from"]), params, [(r["rcpt"], r["zone"]) for r in rcpts],
                      read_all(self.io, self._m(f"{mid}.body")))

    def _recover(self) -> RecoveryReport:
        cleaned = removed = 0
        for mid in self._message_ids():
            if not self.io.exists(self._m(f"{mid}.meta")):
                for name in self.io.listdir(self._m("")):
                    if name.split(".")[0] == str(mid):
                        self.io.unlink(self._m(name))
                removed += 1
                continue
            for i, (state, sched) in enumerate(self._states(mid)):
                if state == CLEANUP:
                    self._release(Entry(mid, i, state, sched))
                    cleaned += 1
        for name in self.io.listdir(self._m("")):
            if name.endswith(".tmp"):
                self.io.unlink(self._m(name))
        return RecoveryReport(cleaned=cleaned, uncommitted_removed=removed)

    def _usage(self) -> Footprint:
        names = self.io.listdir(self._m(""))
        size = sum(self.io.lstat(self._m(n)).st_size for n in names if n.endswith(".body"))
        return Footprint(len(names), size)


def factory(root: str, io: IO | None = None) -> MaddyQueue:
    return MaddyQueue(root, io)

