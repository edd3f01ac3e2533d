"""Replay a trace on the inode model: ``TraceEvent``s in, inode-level operations out.

The replay follows the real run call by call (file ids to inodes, file positions, O_APPEND)
and checks that every call that succeeded on the real disk is possible in the model;
otherwise it raises ``ModelError`` naming the event (the directory was changed outside the
seam, or a path left the root).  Calls that had no effect (failed, or crashed before) are
skipped, except failed fsyncs, whose failure the persistence models need to know.

Each directory-entry operation gets its ``needs`` (``faultinject.ops``): the last earlier
operation that changed each directory entry (parent inode, name) it reads or writes; for the
removal or replacement of a directory, the last change of every entry that directory ever
had (they emptied it); for the move of a directory, the operations that put the
destination and each of its ancestors where they are (so no crash state can move a
directory under itself).  Inode creation is not a need: a write, or a link, to an inode
whose creation was dropped lands in an orphan inode (``FsState.add_orphan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from faultinject.disk import DiskImage
from faultinject.fault_errors import ModelError
from faultinject.inodes import ROOT, FsState
from faultinject.ops import (
    Create,
    DataOp,
    EntryOp,
    Link,
    Op,
    Remove,
    Rename,
    SyncDir,
    SyncFile,
    SyncFs,
    Truncate,
    Write,
)
from faultinject.trace import TraceEvent


@dataclass
class _Fd:
    ino: int
    pos: int
    append: bool


@dataclass(frozen=True)
class Replayed:
    """The outcome of a replay: ``initial`` state, ``ops`` in trace order, ``final`` state."""

    initial: FsState
    ops: tuple[Op, ...]
    final: FsState
    events: dict[int, TraceEvent]


class _Replayer:
    def __init__(self, initial: DiskImage) -> None:
        self.initial, self.next_ino = FsState.from_image(initial)
        self.state = self.initial.copy()
        self.ops: list[Op] = []
        self.fds: dict[str, _Fd] = {}
        self.low_water: dict[int, int] = {}
        self.event: TraceEvent | None = None
        self.last_change: dict[tuple[int, str], int] = {}  # (dir, name) -> op index
        self.touched: dict[int, set[str]] = {}  # dir -> names ever changed in it
        self.place: dict[int, tuple[int, str]] = {  # dir -> (parent, name) naming it
            child: (parent, name)
            for parent, entries in self.state.dirs.items()
            for name, child in entries.items() if child in self.state.dirs
        }

    def fail(self, why: str) -> ModelError:
        where = self.event.short() if self.event is not None else "?"
        return ModelError(f"cannot replay {where}: {why}")

    def new_ino(self) -> int:
        self.next_ino += 1
        return self.next_ino - 1

    def emit(self, op: EntryOp | DataOp) -> None:
        if not isinstance(op, Write | Truncate):
            op = self.with_needs(op)
        try:
            self.state.apply(op)
        except ModelError as e:
            raise self.fail(f"the model state does not allow it ({e}; changed outside the "
                            "seam?)") from e
        self.ops.append(op)
        if not isinstance(op, Write | Truncate):
            self.record_changes(op)

    def entries_of(self, d: int) -> set[tuple[int, str]]:
        return {(d, n) for n in self.touched.get(d, ())}

    def with_needs(self, op: EntryOp) -> EntryOp:
        """``op`` with its ``needs`` (see the module docstring), from the state before it."""
        keys: set[tuple[int, str]] = set()
        if isinstance(op, Rename):
            keys |= {(op.src_parent, op.src_name), (op.dst_parent, op.dst_name)}
            old = self.state.dirs.get(op.dst_parent, {}).get(op.dst_name)
            if old is not None and old in self.state.dirs:
                keys |= self.entries_of(old)
            if op.ino in self.state.dirs:
                d = op.dst_parent
                while d != ROOT and d in self.place:
                    keys.add(self.place[d])
                    d = self.place[d][0]
        else:
            keys.add((op.parent, op.name))
            if isinstance(op, Remove) and op.ino in self.state.dirs:
                keys |= self.entries_of(op.ino)
        needs = sorted({self.last_change[k] for k in keys if k in self.last_change})
        return replace(op, needs=tuple(needs))

    def record_changes(self, op: EntryOp) -> None:
        if isinstance(op, Rename):
            changed = [(op.src_parent, op.src_name), (op.dst_parent, op.dst_name)]
            if op.ino in self.state.dirs:
                self.place[op.ino] = (op.dst_parent, op.dst_name)
        else:
            changed = [(op.parent, op.name)]
            if isinstance(op, Create) and op.kind == "d":
                self.place[op.ino] = (op.parent, op.name)
            elif isinstance(op, Remove):
                self.place.pop(op.ino, None)
        for key in changed:
            self.last_change[key] = op.index
            self.touched.setdefault(key[0], set()).add(key[1])

    def lw(self, ino: int) -> int:
        return self.low_water.setdefault(ino, len(self.state.files.get(ino, b"")))

    def path_arg(self, value: object) -> str:
        if not isinstance(value, str):
            raise self.fail(f"expected a path, got {value!r}")
        return value

    def fd(self, value: object) -> _Fd:
        fd = self.fds.get(str(value))
        if fd is None:
            raise self.fail(f"unknown file id {value!r} (opened outside the seam?)")
        return fd

    def lookup(self, path: str, *, follow: bool, want: str | None = None) -> tuple[int, str, int]:
        parent, name, ino = self.state.resolve(path, follow_last=follow)
        if ino is None:
            raise self.fail(f"{path!r} does not exist in the model")
        if want == "dir" and ino not in self.state.dirs:
            raise self.fail(f"{path!r} is not a directory in the model")
        if want == "file" and ino not in self.state.files:
            raise self.fail(f"{path!r} is not a regular file in the model")
        return parent, name, ino

    def fresh(self, path: str, *, follow: bool) -> tuple[int, str]:
        parent, name, ino = self.state.resolve(path, follow_last=follow)
        if ino is not None or parent < 0:
            raise self.fail(f"{path!r} already exists in the model")
        return parent, name

    def open_file(self, path: str, *, create: bool, exclusive: bool) -> int:
        parent, name, ino = self.state.resolve(path, follow_last=not exclusive)
        if ino is None:
            if not create:
                raise self.fail(f"{path!r} does not exist in the model")
            ino = self.new_ino()
            self.emit(Create(self.event_index, parent, name, ino, "f"))
            self.low_water[ino] = 0
        elif ino not in self.state.files or (exclusive and create):
            raise self.fail(f"{path!r} cannot be opened as a file in the model")
        return ino

    @property
    def event_index(self) -> int:
        assert self.event is not None
        return self.event.index

    def run(self, event: TraceEvent) -> None:
        self.event = event
        name, args, i = event.name, event.args, event.index
        if name in ("close", "unlock"):
            self.fds.pop(str(args[0]), None)
            return
        if event.crash == "before":
            return
        if name in ("fsync", "fdatasync", "fsync_dir", "syncfs"):
            if event.applied or event.error is not None:
                self.sync(event)
            return
        if not event.applied:
            return
        if name == "open_create":
            ino = self.open_file(self.path_arg(args[0]), create=True, exclusive=bool(args[1]))
            self.fds[str(event.result)] = _Fd(ino, 0, bool(args[2]))
        elif name == "open_read":
            ino = self.lookup(self.path_arg(args[0]), follow=False, want="file")[2]
            self.fds[str(event.result)] = _Fd(ino, 0, False)
        elif name == "lock_exclusive":
            ino = self.open_file(self.path_arg(args[0]), create=True, exclusive=False)
            if event.result is not None:
                self.fds[str(event.result)] = _Fd(ino, 0, False)
        elif name == "write":
            self.write(event)
        elif name == "pwrite":
            self.pwrite(event)
        elif name == "read":
            if isinstance(event.result, bytes):
                self.fd(args[0]).pos += len(event.result)
        elif name == "ftruncate":
            fd = self.fd(args[0])
            length = int(str(args[1]))
            self.low_water[fd.ino] = min(self.lw(fd.ino), length)
            self.emit(Truncate(i, fd.ino, length))
        elif name == "rename":
            sp, sn, ino = self.lookup(self.path_arg(args[0]), follow=False)
            dp, dn, old = self.state.resolve(self.path_arg(args[1]), follow_last=False)
            if old != ino:
                self.emit(Rename(i, sp, sn, dp, dn, ino))
        elif name == "link":
            ino = self.lookup(self.path_arg(args[0]), follow=False)[2]
            dp, dn = self.fresh(self.path_arg(args[1]), follow=False)
            self.emit(Link(i, dp, dn, ino))
        elif name == "symlink":
            dp, dn = self.fresh(self.path_arg(args[1]), follow=False)
            self.emit(Create(i, dp, dn, self.new_ino(), "l", str(args[0])))
        elif name == "mkdir":
            dp, dn = self.fresh(self.path_arg(args[0]), follow=False)
            self.emit(Create(i, dp, dn, self.new_ino(), "d"))
        elif name in ("unlink", "rmdir"):
            dp, dn, ino = self.lookup(self.path_arg(args[0]), follow=False)
            if (ino in self.state.dirs) != (name == "rmdir"):
                raise self.fail(f"{args[0]!r} has the wrong type for {name} in the model")
            self.emit(Remove(i, dp, dn, ino))
        elif name in ("pread", "fsize", "listdir", "iter_names", "lstat", "exists", "is_dir", "is_symlink",
                      "readlink", "link_max", "lock_file", "same_file"):
            return
        else:
            raise self.fail(f"unknown call {name!r}")

    def write(self, event: TraceEvent) -> None:
        fd = self.fd(event.args[0])
        data = event.data or b""
        size = len(self.state.files.get(fd.ino, b""))
        offset = size if fd.append else fd.pos
        if data:
            new_region = offset + len(data) > self.lw(fd.ino)
            self.emit(Write(event.index, fd.ino, offset, data, new_region))
        fd.pos = offset + len(data)

    def pwrite(self, event: TraceEvent) -> None:
        """A write at the offset in ``args[1]``; the file position does not move."""
        fd = self.fd(event.args[0])
        offset = event.args[1]
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise self.fail(f"a pwrite needs an offset >= 0, not {offset!r}")
        data = event.data or b""
        if data:
            new_region = offset + len(data) > self.lw(fd.ino)
            self.emit(Write(event.index, fd.ino, offset, data, new_region))

    def sync(self, event: TraceEvent) -> None:
        ok = event.applied and event.error is None
        if event.name == "syncfs":
            if ok:  # every file's data up to now is durable: writes past it are new regions
                for ino, data in self.state.files.items():
                    self.low_water[ino] = len(data)
            self.ops.append(SyncFs(event.index, ok))
            return
        if event.name == "fsync_dir":
            try:
                ino = self.lookup(self.path_arg(event.args[0]), follow=True, want="dir")[2]
            except ModelError:
                if ok:
                    raise
                return  # it failed on a missing directory: it covered nothing
            self.ops.append(SyncDir(event.index, ino, ok))
            return
        fd = self.fds.get(str(event.args[0]))
        if fd is None:
            if ok:
                raise self.fail(f"unknown file id {event.args[0]!r} (opened outside the seam?)")
            return
        if ok:
            self.low_water[fd.ino] = len(self.state.files.get(fd.ino, b""))
        self.ops.append(SyncFile(event.index, fd.ino, ok))


def replay(initial: DiskImage, events: Sequence[TraceEvent]) -> Replayed:
    """Replay ``events`` (a trace of a run that started on ``initial``); see the module doc."""
    r = _Replayer(initial)
    for pos, event in enumerate(events):
        if event.index != pos:
            raise ModelError(f"trace event #{event.index} found at position {pos}: "
                             "pass the whole trace, in order")
        r.run(event)
    return Replayed(r.initial, tuple(r.ops), r.state, {e.index: e for e in events})
