"""Snapshots of directory trees: what a disk holds, as a value.

A ``DiskImage`` lists directories, regular files (with their bytes), symlinks (with their
targets) and groups of paths that are hard links of one file.  Permissions, owners and times
are not kept: ``materialize`` creates files with mode 0o640 and directories with 0o750, as
the seam does.  Paths are relative, ``/``-separated, sorted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskImage:
    """An immutable directory tree (the root itself is implied)."""

    dirs: tuple[str, ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()
    hardlinks: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def build(
        cls,
        *,
        dirs: Iterable[str] = (),
        files: dict[str, bytes] | None = None,
        symlinks: dict[str, str] | None = None,
        hardlinks: Iterable[tuple[str, ...]] = (),
    ) -> DiskImage:
        """Build an image from plain containers, sorting everything."""
        return cls(
            dirs=tuple(sorted(dirs)),
            files=tuple(sorted((files or {}).items())),
            symlinks=tuple(sorted((symlinks or {}).items())),
            hardlinks=tuple(sorted(tuple(sorted(g)) for g in hardlinks if len(g) > 1)),
        )

    def file(self, path: str) -> bytes | None:
        """The bytes of the regular file at ``path``, or ``None`` if there is none."""
        for p, data in self.files:
            if p == path:
                return data
        return None

    def symlink(self, path: str) -> str | None:
        """The target of the symlink at ``path``, or ``None`` if there is none."""
        for p, target in self.symlinks:
            if p == path:
                return target
        return None

    def paths(self) -> tuple[str, ...]:
        """Every path in the image, sorted."""
        names = list(self.dirs) + [p for p, _ in self.files] + [p for p, _ in self.symlinks]
        return tuple(sorted(names))

    def exists(self, path: str) -> bool:
        return path in self.paths()

    def listdir(self, path: str = ".") -> tuple[str, ...]:
        """Names directly inside directory ``path`` (``"."`` is the root)."""
        prefix = "" if path in (".", "") else path + "/"
        return tuple(sorted(
            p[len(prefix):] for p in self.paths()
            if p.startswith(prefix) and "/" not in p[len(prefix):]
        ))

    def summary(self) -> str:
        """A short human-readable listing (file sizes, not contents)."""
        out = [f"{d}/" for d in self.dirs]
        out += [f"{p} ({len(data)} bytes)" for p, data in self.files]
        out += [f"{p} -> {t}" for p, t in self.symlinks]
        return ", ".join(sorted(out)) or "(empty)"


def snapshot(root: str) -> DiskImage:
    """Read the tree under ``root`` (which must be a directory) into a ``DiskImage``.

    Symlinks are recorded, not followed.  Raises ``ValueError`` on sockets, fifos and devices.
    """
    if not os.path.isdir(root):
        raise ValueError(f"snapshot root {root!r} is not a directory")
    dirs: list[str] = []
    files: dict[str, bytes] = {}
    symlinks: dict[str, str] = {}
    by_inode: dict[tuple[int, int], list[str]] = {}

    def walk(abs_dir: str, rel_dir: str) -> None:
        with os.scandir(abs_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = f"{rel_dir}{entry.name}"
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                dirs.append(rel)
                walk(entry.path, rel + "/")
            elif stat.S_ISLNK(st.st_mode):
                symlinks[rel] = os.readlink(entry.path)
            elif stat.S_ISREG(st.st_mode):
                with open(entry.path, "rb") as f:
                    files[rel] = f.read()
                if st.st_nlink > 1:
                    by_inode.setdefault((st.st_dev, st.st_ino), []).append(rel)
            else:
                raise ValueError(f"snapshot: {entry.path!r} is not a file, directory or symlink")

    walk(root, "")
    return DiskImage.build(
        dirs=dirs, files=files, symlinks=symlinks, hardlinks=list(map(tuple, by_inode.values()))
    )


def materialize(image: DiskImage, dest: str) -> None:
    """Write ``image`` as a real tree at ``dest`` (created if missing; it must be empty).

    After a failure part of the tree may have been written; ``dest`` is then best removed.
    """
    linked_to: dict[str, str] = {}
    for group in image.hardlinks:
        if len({image.file(p) for p in group}) != 1 or image.file(group[0]) is None:
            raise ValueError(f"materialize: hard-link group {group} does not name one file")
        for other in group[1:]:
            linked_to[other] = group[0]
    if os.path.lexists(dest):
        if not os.path.isdir(dest) or os.listdir(dest):
            raise ValueError(f"materialize: {dest!r} exists and is not an empty directory")
    else:
        os.makedirs(dest, 0o750)
    for d in image.dirs:  # sorted, so parents come first
        os.mkdir(os.path.join(dest, d), 0o750)
    for path, data in image.files:
        if path in linked_to:
            continue
        fd = os.open(os.path.join(dest, path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    for path, first in sorted(linked_to.items()):
        os.link(os.path.join(dest, first), os.path.join(dest, path))
    for path, target in image.symlinks:
        os.symlink(target, os.path.join(dest, path))
