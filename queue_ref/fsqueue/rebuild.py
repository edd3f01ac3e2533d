"""Rebuilding a damaged filesystem queue from its data files and links (``queue-ref repair``).

The queue's recovery already keeps everything damage leaves aside: a committed message
whose file no link names goes to ``quarantine/<msgid>.unlinked`` (also the content of a
message whose own name was removed but a hard link of which remained), links of a message
whose file is gone go to quarantine with a note.  The rebuild, run only while no other
process has the queue open:

1. opens the queue, which runs recovery (the report names every message lost);
2. puts each intact ``quarantine/<msgid>.unlinked`` back in the queue: its envelope and
   body are checked (its digest), then, as a commit does, a reference link per entry (2+
   recipients) and a ``queue/`` link per entry (hard links to the file; other names the
   file has in quarantine/ are removed first, so its link count counts its entries)
   are made durable before one rename to ``data/<msgid>`` publishes them all, with the
   envelope's schedules.  A kill
   before the rename leaves the file in quarantine and links that dangle, which the next
   recovery moves aside again, and a rerun of the repair restores the same message: the
   same result.  Every entry of such a message is queued again, so one that was already
   delivered may be delivered twice (at-least-once), never lost;
3. reports what it restored, and as lost every message the quarantine holds that the
   queue does not (found now or by an earlier recovery).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from queue_ref.body_digest import BodyDigest
from queue_ref.fsqueue.diskutil import if_exists, listdir_or_empty, lstat_or_none, same_inode
from queue_ref.fsqueue.fs_queue import FsQueue
from queue_ref.fsqueue.fs_records import TRAILER_LEN
from queue_ref.fsqueue.layout import MSGID_RE, EntryName
from queue_ref.fsqueue.metadata import Corrupt
from queue_ref.storage import InvalidInputError, RecoveryReport, StorageIOError

UNLINKED = ".unlinked"


@dataclass
class Rebuilt:
    report: RecoveryReport
    actions: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    messages: int = 0
    entries: int = 0


def _intact(q: FsQueue, path: str, msgid: str) -> str:
    """Why the quarantined file cannot be restored; "" if it is intact."""
    try:
        env = q._read_envelope(path, msgid)
    except Corrupt as c:
        return c.reason
    fd = q.io.open_read(path)
    try:
        digest = BodyDigest(env.body_digest)
        pos = 0
        while pos < env.body_size:
            b = q.io.pread(fd, min(1 << 20, env.body_size - pos), pos)
            if not b:
                break
            digest.update(b)
            pos += len(b)
    finally:
        q.io.close(fd)
    if pos != env.body_size or digest.value() != env.body_digest:
        return "body does not match its envelope's digest"
    return ""


def _restore(q: FsQueue, path: str, msgid: str) -> int:
    """Put an intact quarantined message back in the queue; returns its entry count."""
    env = q._read_envelope(path, msgid)
    lay, io = q.layout, q.io
    n = len(env.rcpts)
    st = io.lstat(path)
    if st.st_nlink > 1:  # links of its entries quarantined beside it: the same file
        for name in listdir_or_empty(io, lay.quarantine):
            other = os.path.join(lay.quarantine, name)
            o = lstat_or_none(io, other)
            if other != path and o is not None and same_inode(o, st):
                if_exists(io.unlink, other)
    if n > 1:
        for i in range(n):
            ref = lay.ref(EntryName(msgid, i))
            if_exists(io.unlink, ref)
            io.link(path, ref)
    for i in range(n):
        e = EntryName(msgid, i)
        for d in (lay.queue, lay.held, lay.inflight, lay.cleanup):
            for name in q._links_of_message(d, msgid):
                if name.split("@")[0] == e.entry_id:
                    if_exists(io.unlink, os.path.join(d, name))
        io.link(path, lay.queue_link(e))  # a hard link: the file's count of its entries
    q._sync_dirs(lay.data, lay.queue, lay.held, lay.inflight, lay.cleanup)
    io.rename(path, lay.msg_file(msgid))  # the commit point
    q._sync_dirs(lay.data, lay.quarantine)
    return n


def rebuild(root: str) -> Rebuilt:
    """Recover the queue at ``root`` and put back every intact message recovery set aside
    because no link named it.  StorageIOError if another process has the queue open."""
    if not os.path.isdir(root) or not os.path.isdir(os.path.join(root, "data")):
        raise InvalidInputError(f"{root} is not a filesystem queue (no data/ directory)")
    q = FsQueue(root)
    try:
        others = q._owners.others_alive()
        if others:
            raise StorageIOError(f"the queue at {root} is open in another process "
                                 f"({len(others)} owner(s)); stop it before repairing")
        report = q.last_recovery or RecoveryReport()
        out = Rebuilt(report, [f"recovered the queue: {report.requeued} requeued, "
                               f"{report.cleaned} cleanups finished, {len(report.lost)} "
                               "message(s) reported lost"])
        still: list[str] = []
        for name in sorted(listdir_or_empty(q.io, q.layout.quarantine)):
            msgid = name[:-len(UNLINKED)]
            if not name.endswith(UNLINKED) or not MSGID_RE.match(msgid):
                continue
            path = q.layout.quarantined(name)
            if os.path.lexists(q.layout.msg_file(msgid)):
                still.append(f"{name}: data/{msgid} exists, left in quarantine")
                continue
            if os.path.getsize(path) < TRAILER_LEN:
                still.append(f"{name}: shorter than its trailer, left in quarantine")
                continue
            why = _intact(q, path, msgid)
            if why:
                still.append(f"{name}: {why}; left in quarantine")
                continue
            count = _restore(q, path, msgid)
            out.restored.append(msgid)
            out.actions.append(f"message {msgid}: intact, put back in the queue with its "
                               f"{count} entr{'y' if count == 1 else 'ies'}")
        out.actions += still
        # Every message the quarantine holds and the queue does not: lost, whenever that
        # was found (this open, or an earlier one).
        held = set()
        for name in listdir_or_empty(q.io, q.layout.quarantine):
            for suffix in (".lost.note", ".msg", UNLINKED):
                msgid = name[:-len(suffix)]
                if name.endswith(suffix) and MSGID_RE.match(msgid):
                    held.add(msgid)
        lost = tuple(sorted((set(report.lost) | held) - set(out.restored)
                            - {m for m in held if os.path.lexists(q.layout.msg_file(m))}))
        out.report = replace(report, lost=lost, problems=(*report.problems, *(
            f"message {m} restored from quarantine by repair" for m in out.restored)))
        entries = list(q.list_queue())
        out.messages = len({e.message_id for e in entries})
        out.entries = len(entries)
        return out
    finally:
        q.close()
