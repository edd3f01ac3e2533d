"""The real disk, on a file system of few names per file (as some are: the filesystem
queue gives a message of n recipients n + 1 names, and replaces a domain anchor that is
full of them).  For checks and broken variants that need a file to fill with names."""

from __future__ import annotations

import errno
import os

from queue_ref.io import OsIO


class FewNamesIO(OsIO):
    """The real disk, holding at most ``names`` names per file: ``link`` beyond them
    fails with EMLINK, and ``link_max`` says so."""

    def __init__(self, names: int) -> None:
        super().__init__()
        self.names = names

    def link_max(self, path: str) -> int:
        return self.names

    def link(self, src: str, dst: str) -> None:
        if os.lstat(src).st_nlink >= self.names:
            raise OSError(errno.EMLINK, os.strerror(errno.EMLINK), dst)
        super().link(src, dst)
