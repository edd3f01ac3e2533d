"""An inode-level model of a directory tree, and how operations change it.

``FsState`` keeps directories (name -> inode), file contents, symlink targets and link
counts.  An inode exists apart from its names: one that no name reaches is an orphan,
absent from ``to_image`` (a file whose creation did not persist may still hold data that
was fsynced; nobody can see it).

``apply`` is strict: an operation whose preconditions do not hold (the entry it renames or
removes does not name its inode, the name it creates is taken, the directory it removes is
not empty, the directory it changes does not exist) raises ``ModelError`` and changes
nothing.  Crash states never meet that: they keep, with every operation, the earlier ones
it ``needs`` (``faultinject.ops``) and create the inodes of dropped creations as orphans
(``add_orphan``), so an operation that cannot be applied is a bug of the model or a trace
that does not match its tree.
"""

from __future__ import annotations

import hashlib
import posixpath

from faultinject.disk import DiskImage
from faultinject.fault_errors import ModelError
from faultinject.ops import Create, DataOp, EntryOp, Link, Remove, Rename, Truncate, Write

ROOT = 0
_MAX_SYMLINK_HOPS = 40


def garbage(index: int, n: int) -> bytes:
    """``n`` deterministic pseudo-random bytes standing for a write whose data was lost."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"faultinject garbage {index} {counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


class FsState:
    """A mutable tree of inodes; inode ``ROOT`` is the root directory."""

    __slots__ = ("dirs", "files", "links", "nlink")

    def __init__(self) -> None:
        self.dirs: dict[int, dict[str, int]] = {ROOT: {}}
        self.files: dict[int, bytes] = {}
        self.links: dict[int, str] = {}
        self.nlink: dict[int, int] = {}

    @classmethod
    def from_image(cls, image: DiskImage) -> tuple[FsState, int]:
        """The state of ``image`` and the first free inode number (numbered in path order)."""
        state = cls()
        ino_of: dict[str, int] = {".": ROOT}
        next_ino = ROOT + 1

        def parent_of(path: str) -> tuple[int, str]:
            head, name = posixpath.split(path)
            parent = ino_of.get(head or ".")
            if parent is None or parent not in state.dirs:
                raise ModelError(f"image lists {path!r} but not its directory {head!r}")
            return parent, name

        for d in image.dirs:
            parent, name = parent_of(d)
            state.dirs[next_ino] = {}
            state.dirs[parent][name] = ino_of[d] = next_ino
            next_ino += 1
        leader = {p: g[0] for g in image.hardlinks for p in g}
        for path, data in image.files:
            parent, name = parent_of(path)
            ino = ino_of.get(leader.get(path, path))
            if ino is None:
                ino = next_ino
                next_ino += 1
                state.files[ino] = data
            state.dirs[parent][name] = ino_of[path] = ino
            state.nlink[ino] = state.nlink.get(ino, 0) + 1
        for path, target in image.symlinks:
            parent, name = parent_of(path)
            state.links[next_ino] = target
            state.nlink[next_ino] = 1
            state.dirs[parent][name] = ino_of[path] = next_ino
            next_ino += 1
        return state, next_ino

    def copy(self) -> FsState:
        new = FsState()
        new.dirs = {ino: dict(entries) for ino, entries in self.dirs.items()}
        new.files = dict(self.files)
        new.links = dict(self.links)
        new.nlink = dict(self.nlink)
        return new

    # ---- applying operations --------------------------------------------------------

    def add_orphan(self, op: Create) -> None:
        """Create the inode of ``op`` without a name (a creation a crash state dropped,
        whose inode later kept operations may still write to, link or fill)."""
        if op.kind == "d":
            self.dirs.setdefault(op.ino, {})
            return
        if op.kind == "l":
            self.links[op.ino] = op.target
        else:
            self.files.setdefault(op.ino, b"")
        self.nlink.setdefault(op.ino, 0)

    def apply(self, op: EntryOp | DataOp, *, keep: int | None = None, junk: bool = False) -> None:
        """Apply ``op``; a write keeps only ``keep`` bytes, or holds garbage if ``junk``.

        Raises ``ModelError`` (and changes nothing) when ``op`` cannot happen in this state.
        """
        if isinstance(op, Write):
            self._write(op, keep, junk)
        elif isinstance(op, Truncate):
            self._truncate(op)
        elif isinstance(op, Create):
            self._create(op)
        elif isinstance(op, Link):
            self._link(op)
        elif isinstance(op, Remove):
            self._remove(op)
        else:
            self._rename(op)

    def _dir(self, ino: int, what: str) -> dict[str, int]:
        entries = self.dirs.get(ino)
        if entries is None:
            raise ModelError(f"{what}: directory inode {ino} does not exist")
        return entries

    def _free_name(self, parent: int, name: str, what: str) -> dict[str, int]:
        entries = self._dir(parent, what)
        if name in entries:
            raise ModelError(f"{what}: the name {name!r} is taken (inode {entries[name]})")
        return entries

    def _unname(self, ino: int, what: str) -> None:
        """One name of ``ino`` goes; a directory must be empty (it is then forgotten)."""
        if ino in self.dirs:
            if self.dirs[ino]:
                raise ModelError(f"{what}: directory inode {ino} is not empty "
                                 f"({sorted(self.dirs[ino])})")
            del self.dirs[ino]
        else:
            self.nlink[ino] = self.nlink.get(ino, 1) - 1

    def _create(self, op: Create) -> None:
        entries = self._free_name(op.parent, op.name, f"create #{op.index}")
        if op.kind == "d":
            self.dirs.setdefault(op.ino, {})
        else:
            if op.kind == "l":
                self.links[op.ino] = op.target
            else:
                self.files.setdefault(op.ino, b"")
            self.nlink[op.ino] = self.nlink.get(op.ino, 0) + 1
        entries[op.name] = op.ino

    def _link(self, op: Link) -> None:
        what = f"link #{op.index}"
        if op.ino not in self.files and op.ino not in self.links:
            raise ModelError(f"{what}: inode {op.ino} is not a file or symlink")
        entries = self._free_name(op.parent, op.name, what)
        entries[op.name] = op.ino
        self.nlink[op.ino] = self.nlink.get(op.ino, 0) + 1

    def _named(self, parent: int, name: str, ino: int, what: str) -> dict[str, int]:
        entries = self._dir(parent, what)
        if entries.get(name) != ino:
            raise ModelError(f"{what}: {name!r} names inode {entries.get(name)}, "
                             f"not inode {ino}")
        return entries

    def _remove(self, op: Remove) -> None:
        what = f"remove #{op.index}"
        entries = self._named(op.parent, op.name, op.ino, what)
        self._unname(op.ino, what)
        del entries[op.name]

    def _inside(self, top: int, ino: int) -> bool:
        """Whether directory ``ino`` is ``top`` or lies under it."""
        stack = [top]
        seen: set[int] = set()
        while stack:
            cur = stack.pop()
            if cur == ino:
                return True
            if cur in seen:
                continue
            seen.add(cur)
            stack.extend(c for c in self.dirs.get(cur, {}).values() if c in self.dirs)
        return False

    def _rename(self, op: Rename) -> None:
        what = f"rename #{op.index}"
        src = self._named(op.src_parent, op.src_name, op.ino, what)
        dst = self._dir(op.dst_parent, what)
        if (op.src_parent, op.src_name) == (op.dst_parent, op.dst_name):
            return
        is_dir = op.ino in self.dirs
        if is_dir and self._inside(op.ino, op.dst_parent):
            raise ModelError(f"{what}: directory inode {op.ino} would move under itself")
        old = dst.get(op.dst_name)
        if old == op.ino:
            raise ModelError(f"{what}: {op.dst_name!r} already names inode {op.ino}")
        if old is not None:
            if (old in self.dirs) != is_dir:
                raise ModelError(f"{what}: cannot replace inode {old} by one of another type")
            self._unname(old, what)
        del src[op.src_name]
        dst[op.dst_name] = op.ino

    def _write(self, op: Write, keep: int | None, junk: bool) -> None:
        content = self.files.get(op.ino)
        if content is None:
            raise ModelError(f"write #{op.index}: inode {op.ino} is not a file")
        payload = op.data if keep is None else op.data[:keep]
        if junk:
            payload = garbage(op.index, len(payload))
        if op.offset > len(content):
            content += bytes(op.offset - len(content))
        self.files[op.ino] = content[:op.offset] + payload + content[op.offset + len(payload):]

    def _truncate(self, op: Truncate) -> None:
        content = self.files.get(op.ino)
        if content is None:
            raise ModelError(f"truncate #{op.index}: inode {op.ino} is not a file")
        if op.length <= len(content):
            self.files[op.ino] = content[:op.length]
        else:
            self.files[op.ino] = content + bytes(op.length - len(content))

    # ---- looking up and listing -----------------------------------------------------

    def resolve(self, path: str, *, follow_last: bool) -> tuple[int, str, int | None]:
        """``(parent inode, name, inode or None)`` of a root-relative path.

        Symlinks in the middle are followed (relative targets only), the last one only with
        ``follow_last``.  The root itself resolves to ``(-1, "", ROOT)``.  Raises
        ``ModelError`` when a directory on the way is missing.
        """
        for _ in range(_MAX_SYMLINK_HOPS):
            norm = posixpath.normpath(path)
            if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
                raise ModelError(f"path {path!r} lies outside the root")
            parts = [] if norm == "." else norm.split("/")
            if not parts:
                return -1, "", ROOT
            cur = ROOT
            restart: str | None = None
            for i, name in enumerate(parts):
                entries = self.dirs.get(cur)
                if entries is None:
                    raise ModelError(f"{'/'.join(parts[:i])!r} is not a directory in {path!r}")
                ino = entries.get(name)
                last = i == len(parts) - 1
                if ino is not None and ino in self.links and (follow_last or not last):
                    target = self.links[ino]
                    if posixpath.isabs(target):
                        raise ModelError(f"absolute symlink {target!r} in {path!r}")
                    restart = posixpath.join(*parts[:i], target, *parts[i + 1:])
                    break
                if last:
                    return cur, name, ino
                if ino is None:
                    raise ModelError(f"{'/'.join(parts[:i + 1])!r} is missing in {path!r}")
                cur = ino
            assert restart is not None
            path = restart
        raise ModelError(f"too many symlinks in {path!r}")

    def to_image(self) -> DiskImage:
        """The tree reachable from the root, as a ``DiskImage``."""
        dirs: list[str] = []
        files: dict[str, bytes] = {}
        symlinks: dict[str, str] = {}
        paths_of: dict[int, list[str]] = {}
        seen = {ROOT}
        stack: list[tuple[int, str]] = [(ROOT, "")]
        while stack:
            ino, prefix = stack.pop()
            for name, child in self.dirs[ino].items():
                path = prefix + name
                if child in self.dirs:
                    if child not in seen:
                        seen.add(child)
                        dirs.append(path)
                        stack.append((child, path + "/"))
                elif child in self.links:
                    symlinks[path] = self.links[child]
                elif child in self.files:
                    files[path] = self.files[child]
                    paths_of.setdefault(child, []).append(path)
        groups = [tuple(p) for p in paths_of.values() if len(p) > 1]
        return DiskImage.build(dirs=dirs, files=files, symlinks=symlinks, hardlinks=groups)
