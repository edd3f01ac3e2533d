"""Broken variants that leave names behind outside ``footprint()``: each drains to a
footprint of zero while its directory grows with use.  The bounded-disk check counts
the whole tree and fails each on C8; every other check passes them.  Never use them for
mail.

    queue-ref certify conformance.examples.broken_disk_growth:fs_spare_pool_unbounded \\
        --only bounded-disk
"""

from __future__ import annotations

import os
from collections.abc import Callable

from queue_ref.io import IO
from queue_ref.storage import Storage


def fs_spare_pool_unbounded(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose pool of spare message files ignores its
    capacity: every message cleaned up while others are queued leaves its file behind,
    so after a burst of n messages at once the queue keeps n spare files until it is
    closed, past the 64 it declares (``Limits.pool_files``)."""
    from conformance.crashexplore.broken_fs_variants import _Fsync
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue.spares import Spares

    class NoCapacity(Spares):
        def reserve(self) -> str | None:
            with self._lock:
                self._reserved += 1  # the bug: no check against the capacity
                return f"{self.directory}/spare.{next(self._numbers)}"

    class PoolUnbounded(_Fsync):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, **kw)  # type: ignore[arg-type]
            self._spares.__class__ = NoCapacity

    if io is None:
        return PoolUnbounded(root)
    return deterministic_fs(PoolUnbounded)(root, io)


def fs_dead_owner_lock_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue (``fsync`` mode) whose recovery requeues a dead owner's claims
    and removes its ``tmp/`` directory, but keeps its lock file ``owners/<owner>.lock``:
    one more file for every process that died with the queue open."""
    from conformance.crashexplore.broken_fs_variants import _OwnRecovery
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue.owners import Owners
    from queue_ref.storage import RecoveryReport

    class KeepsDeadLocks(Owners):
        def forget_dead(self, owner: str) -> bool:
            return False  # the bug: the dead owner's lock file stays

    class DeadLocksKept(_OwnRecovery):
        def recover(self) -> RecoveryReport:
            self._owners.__class__ = KeepsDeadLocks
            return super().recover()

    if io is None:
        return DeadLocksKept(root)
    return deterministic_fs(DeadLocksKept)(root, io)


def kv_log_set_aside_every_open(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that moves its live log to ``quarantine/`` at every
    open, as it should only when the log is damaged in the middle: nothing is lost (the
    log's records go to a table first) and nothing is reported, but every open leaves
    one more file."""
    from queue_ref.kv.kv_queue import KvQueue
    from queue_ref.kv.logengine import LogEngine
    from queue_ref.kv.logengine.wal import Replayed

    class SetsAsideEveryLog(LogEngine):
        def _recover(self) -> None:
            super()._recover()
            self._set_aside_log(Replayed(0, 0))  # the bug: an intact log set aside too

    return KvQueue.open_log(root, io, engine=SetsAsideEveryLog)


def _pruning_fs(root: str, io: IO | None,
                removes: Callable[[str, str, set[str], dict[str, str]], bool]) -> Storage:
    """The filesystem queue whose recovery prunes a name ``n`` (at ``link``) of a domain's
    index directory when ``removes(n, link, referenced names, index paths)``."""
    from conformance.crashexplore.explored_backends import deterministic_fs
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.diskutil import if_exists, listdir_or_empty
    from queue_ref.fsqueue.fs_recovery import Recovery
    from queue_ref.fsqueue.layout import DOMAIN_DIR_RE

    class Pruning(Recovery):
        def prune_index(self) -> None:
            refs = self._referenced()
            for d in listdir_or_empty(self.io, self.lay.domains):
                path = os.path.join(self.lay.domains, d)
                if not DOMAIN_DIR_RE.match(d) or not self.io.is_dir(path):
                    continue
                for n in listdir_or_empty(self.io, path):
                    link = os.path.join(path, n)
                    if removes(n, link, refs, self.index_paths):
                        if_exists(self.io.unlink, link)

    class PruningFs(FsQueue):
        recovery = Pruning

    if io is None:
        return PruningFs(root)
    return deterministic_fs(PruningFs)(root, io)


def fs_dead_index_links_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery prunes a domain index link only when it is
    both unreferenced and misplaced (``and`` for ``or``, mutant ``24c04ffb`` of the
    mutation run): the index links of an enqueue whose owner died after linking them,
    before its commit, stay in ``domains/`` for good, three names per dead three-recipient
    enqueue.  Nothing is listed wrongly (``list_domain`` checks each link), and
    ``footprint()`` does not count the index; only bounded-disk, whose killed owners die
    inside a wide enqueue through the I/O seam, sees them (C8)::

        queue-ref certify conformance.examples.broken_disk_growth:fs_dead_index_links_kept \\
            --only bounded-disk
    """
    from queue_ref.fsqueue.layout import DOMAIN_ANCHOR

    def removes(n: str, link: str, refs: set[str], paths: dict[str, str]) -> bool:
        # the bug: ``and`` where either reason is enough
        return n != DOMAIN_ANCHOR and n not in refs and paths.get(n, link) != link

    return _pruning_fs(root, io, removes)


def fs_dead_anchor_kept(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose recovery prunes every unreferenced name of the domain
    index but the anchor's own name and the ones that start with it: the fresh anchor
    ``anchor.<owner>`` of an owner that died while replacing a full anchor (a file system
    of few names per file) stays for good, one name per such death.  Nothing is listed
    wrongly and ``footprint()`` does not count the index; the name count stays within
    bounded-disk's slack, so only its rule on kinds of names, with killed owners on a file
    system of 4 names per file, sees it (C8; mutant ``c3d0be12`` of the mutation run kept
    such anchors too)::

        queue-ref certify conformance.examples.broken_disk_growth:fs_dead_anchor_kept \\
            --only bounded-disk
    """
    from queue_ref.fsqueue.layout import DOMAIN_ANCHOR

    def removes(n: str, link: str, refs: set[str], paths: dict[str, str]) -> bool:
        if n.startswith(DOMAIN_ANCHOR):  # the bug: anchor.<owner> is kept too
            return False
        return n not in refs or paths.get(n, link) != link

    return _pruning_fs(root, io, removes)
