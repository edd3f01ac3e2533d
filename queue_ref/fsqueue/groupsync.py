"""Group commit: concurrent callers share the syncs that make their changes durable.

A caller that changed something (wrote a file, created, renamed or unlinked a name) needs
a sync that *started after* its change; one already running when it arrives may have
missed it.  Callers therefore form rounds, run one at a time: a caller arriving while
round ``r`` runs waits for round ``r + 1``, which covers every caller that arrived by the
time it starts.  One of those callers, the *leader*, runs it for all of them; the others
sleep, each on its own lock, and are woken one by one when their round ended, so a round
wakes exactly the callers it served.  When a round ends and callers are waiting, the
oldest of them is woken to lead the next one.

What a round does depends on the mode (``SYNC_MODES``):

* ``"syncfs"``: one ``syncfs(2)`` of the queue's file system.  It makes every caller's
  file data and directory entries durable at once, whatever they were: one device flush
  for the whole round.  Callers need not name anything.
* ``"fsync"``: an fsync of each directory the round's callers named (each once).  File
  data is not shared in this mode: each caller fsyncs its own files itself
  (``FsSteps._sync_file``), in its own thread.

**Two rounds in one wait** (``syncfs`` mode): ``sync(then=step)`` returns once a round
covered the caller's changes, ``step`` ran, and the *next* round covered what ``step``
changed.  The step is run by whoever leads that next round, right before its sync, for
every such caller at once; its caller sleeps through both rounds.  This is how a commit
publishes a message whose file the first round made durable, without waking its thread
in between and without missing the next round while it wakes: each round makes new files
durable and publishes the ones the round before made durable, a pipeline of two stages.
A step runs in another thread while its caller sleeps, so it may use the caller's state;
an OSError it raises goes to its caller alone (whose wait then ends with that round).

After a failed round every caller it served gets the error (and no step of theirs runs);
a later round that succeeds does not make up for it (the kernel may have dropped the
dirty state with the error, "fsyncgate"), so nobody is told its change is durable on the
strength of a retry.  That holds for callers the failed round did not serve too: one
whose change came before the failure but who arrived after the round began would be
served by a later round, whose success proves nothing about a change the kernel may
already have dropped.  So a failure is sticky: every later ``sync`` (and every round
still to run) fails with it, until the queue is reopened (recovery then judges the disk).
A ``BaseException`` in the leader (a simulated crash) propagates in
the leader, and the callers it served, or whose step it was to run, get EIO.
"""

from __future__ import annotations

import collections
import errno
import threading
from collections import deque
from collections.abc import Callable, Iterable

from queue_ref.io import IO

SYNC_MODES = ("syncfs", "fsync")


class _Waiter:
    """One caller: what it needs synced, its step (if any), and the lock it sleeps on
    until served."""

    __slots__ = ("error", "lead", "paths", "then", "wake")

    def __init__(self, paths: tuple[str, ...], then: Callable[[], object] | None) -> None:
        self.paths = paths
        self.then = then
        self.wake: threading.Lock | None = None
        self.lead = False  # woken to lead a round, not served
        self.error: OSError | None = None


class GroupSync:
    """Shared sync rounds through one I/O seam.  Thread-safe.

    ``anchor`` is a path on the queue's file system (``syncfs`` mode syncs the file system
    that holds it).  ``rounds`` and ``requests`` count rounds run and callers served.
    """

    def __init__(self, io: IO, mode: str, anchor: str) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode must be one of {SYNC_MODES}, not {mode!r}")
        self.io = io
        self.mode = mode
        self.anchor = anchor
        self._lock = threading.Lock()
        self._waiting: deque[_Waiter] = deque()
        self._stepping: list[_Waiter] = []  # first round done: their steps run next round
        self._leading = False
        self.rounds = 0
        self.requests = 0
        #: the error of the first failed round: every later sync fails with it
        self.failed: OSError | None = None
        #: how many rounds served n callers, by n (the round sizes, for metrics)
        self.round_sizes: collections.Counter[int] = collections.Counter()

    def counts(self) -> tuple[int, int, dict[int, int]]:
        """(rounds run, callers served, rounds by callers served) read together, so that
        the round sizes sum to the callers served plus the steps served after a first
        round, however the rounds run meanwhile."""
        with self._lock:
            return self.rounds, self.requests, dict(self.round_sizes)

    @property
    def covers_files(self) -> bool:
        """Whether a round makes file data durable too (``syncfs``), so that callers need
        not fsync their files themselves."""
        return self.mode == "syncfs"

    def sync(self, paths: Iterable[str] = (), *, then: Callable[[], object] | None = None
             ) -> None:
        """Return once a round that started after this call has covered ``paths`` (the
        directories whose entries the caller changed; in ``syncfs`` mode, everything),
        and, with ``then``, once ``then`` has run after that round and the next round has
        covered what it changed (``syncfs`` mode only; see the module docstring).

        Raises the OSError of a round that failed.
        """
        if then is not None and not self.covers_files:
            raise ValueError("a step between two rounds needs rounds that cover files "
                             "(syncfs mode)")
        if self.failed is not None:
            raise self.failed
        me = _Waiter(tuple(dict.fromkeys(paths)), then)
        with self._lock:
            if self._leading:
                me.wake = threading.Lock()
                me.wake.acquire()
                self._waiting.append(me)
            else:
                self._leading = True
                me.lead = True
        while True:
            if not me.lead:
                assert me.wake is not None
                me.wake.acquire()  # released by the leader that served us, or to make us lead
                if not me.lead:
                    break
            if self._lead(me):
                break
            # Not served yet: our step is due in the next round, which we lead too.
        if me.error is not None:
            raise me.error

    def _lead(self, me: _Waiter) -> bool:
        """Run one round: the steps of the callers whose first round is done, then the
        sync, for them, ``me`` and everyone waiting.  Wake the callers it served, and
        unless ``me`` still needs the next round, hand the lead to the oldest waiting
        caller (or one whose step is due), or give it up.  True if ``me`` was served."""
        with self._lock:
            stepping, self._stepping = self._stepping, []
            batch = [*([] if me in stepping else [me]), *self._waiting]
            self._waiting.clear()
        served = False
        done: list[_Waiter] = []
        try:
            for w in stepping:
                assert w.then is not None
                try:
                    w.then()
                except OSError as e:
                    w.error = e
            self._round([*batch, *stepping])
            served = True
        finally:
            nxt: list[_Waiter] = []
            if not served:  # a BaseException in this thread: the others cannot know
                for w in (*batch, *stepping):
                    w.error = OSError(errno.EIO, "the sync round was interrupted")
                done = [*stepping, *batch]
            else:
                done = list(stepping)
                for w in batch:
                    (nxt if w.then is not None and w.error is None else done).append(w)
            with self._lock:
                self.rounds += 1
                self.requests += len(batch)  # callers in their first round
                self.round_sizes[len(batch) + len(stepping)] += 1
                self._stepping = nxt
                following: _Waiter | None = None
                if me in done:
                    if self._waiting:
                        following = self._waiting.popleft()
                    elif self._stepping:
                        following = self._stepping[0]  # leads the round of its own step
                    else:
                        self._leading = False
            for w in done:
                if w is not me:
                    w.lead = False
                    assert w.wake is not None
                    w.wake.release()
            if following is not None:
                following.lead = True
                assert following.wake is not None
                following.wake.release()
        return me in done

    def _round(self, batch: list[_Waiter]) -> None:
        """The syncs of one round; records each caller's error on it.  After a failed
        round, every round fails with that error without syncing (see the module)."""
        if self.failed is not None:
            for w in batch:
                w.error = self.failed
            return
        if self.mode == "syncfs":
            try:
                self.io.syncfs(self.anchor)
            except OSError as e:
                self.failed = e
                for w in batch:
                    w.error = e
            return
        failed: dict[str, OSError] = {}
        for path in dict.fromkeys(p for w in batch for p in w.paths):
            try:
                self.io.fsync_dir(path)
            except OSError as e:
                failed[path] = e
        if failed:
            self.failed = next(iter(failed.values()))
            for w in batch:
                w.error = next((failed[p] for p in w.paths if p in failed), self.failed)
