"""Group commit of directory fsyncs: concurrent callers share one fsync per directory.

A caller that changed directory ``D`` (created, renamed or unlinked a name in it) needs an
fsync of ``D`` that *started after* its change; an fsync already running when it arrives
may have read the directory before the change and does not count.  Callers for one
directory form rounds: while round ``r`` runs, every new arrival waits for round ``r + 1``,
which one of them (the leader) runs for all of them when ``r`` ends.  Producers still
fsync their own files themselves; only directory fsyncs are shared.

After a failed round every caller that depended on it gets the error: a later round that
succeeds does not make up for it (the kernel may have dropped the dirty state with the
error, "fsyncgate"), so nobody is told its change is durable on the strength of a retry.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from queue_ref.io import IO

_KEEP_FAILURES = 1 << 16  # failures are rare; keep them long after a slow waiter


@dataclass
class _Dir:
    cond: threading.Condition
    started: int = 0  # rounds begun
    finished: int = 0  # rounds ended (rounds run one at a time, in order)
    running: bool = False
    failures: dict[int, OSError] = field(default_factory=dict)


class GroupSync:
    """Shared directory fsyncs through one I/O seam.  Thread-safe."""

    def __init__(self, io: IO) -> None:
        self.io = io
        self._lock = threading.Lock()
        self._dirs: dict[str, _Dir] = {}
        self.rounds = 0  # fsyncs actually issued (for tests and benchmarks)
        self.requests = 0  # sync() calls served

    def _state(self, path: str) -> _Dir:
        st = self._dirs.get(path)
        if st is None:
            st = self._dirs[path] = _Dir(threading.Condition(self._lock))
        return st

    def sync(self, path: str) -> None:
        """Return once an fsync of ``path`` that started after this call has succeeded.

        Raises the OSError of that fsync if it failed.  A ``BaseException`` (a simulated
        crash) in the leader propagates in the leader; its followers get EIO.
        """
        with self._lock:
            self.requests += 1
            st = self._state(path)
            need = st.started + 1
            while st.finished < need:
                if st.running:
                    st.cond.wait()
                    continue
                st.running = True
                st.started += 1
                rnd = st.started
                self.rounds += 1
                err: OSError | None = OSError(errno.EIO, f"fsync of {path} was interrupted")
                self._lock.release()
                try:
                    self.io.fsync_dir(path)
                    err = None
                except OSError as e:
                    err = e
                finally:
                    self._lock.acquire()
                    st.running = False
                    st.finished = rnd
                    if err is not None:
                        st.failures[rnd] = err
                        for old in [k for k in st.failures if k < rnd - _KEEP_FAILURES]:
                            del st.failures[old]
                    st.cond.notify_all()
            failed = st.failures.get(need)
        if failed is not None:
            raise failed

    def sync_all(self, paths: Iterable[str]) -> None:
        """``sync`` each distinct path, in order; the first failure is raised."""
        seen: set[str] = set()
        for p in paths:
            if p not in seen:
                seen.add(p)
                self.sync(p)
