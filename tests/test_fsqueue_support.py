"""Helpers for the FsQueue tests, and unit tests of its small parts (ids, records, group sync).

The helpers read the real directory tree directly (a backdoor, as zarr's store tests do)
instead of trusting the API under test.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_records import (
    TRAILER_LEN,
    Envelope,
    RecordError,
    decode,
    decode_schedule,
    encode,
    encode_schedule,
    parse_trailer,
    trailer,
)
from queue_ref.fsqueue.groupsync import GroupSync
from queue_ref.fsqueue.layout import EntryName, MessageIds, new_owner, owner_of_msgid
from queue_ref.fsqueue.metadata import EnvelopeCache
from queue_ref.io import MUTATING, OsIO
from queue_ref.storage import QueuedMail, Recipient, Schedule

MSGID = re.compile(r"[0-9a-f]{38}")


# ---- helpers ---------------------------------------------------------------------------


def rcpts(n: int, at: int = 0) -> list[Recipient]:
    return [Recipient(f"user{i}@example.org", Schedule(at + i)) for i in range(n)]


def put(q: FsQueue, n: int = 2, body: bytes = b"Subject: hi\r\n\r\nbody\r\n",
        mail_from: str = "sender@example.com") -> list[QueuedMail]:
    with q.enqueue(mail_from) as enq:
        enq.write(body)
        return enq.commit(rcpts(n))


def _first_name(names: list[str]) -> str:
    """The name a file of several names is shown under: its message file name
    ``data/<msgid>`` if it has one, else ``tmp/<owner>/<msgid>`` (a message being
    committed), else a name outside the link directories (a reference link, quarantine/),
    else the first in order."""
    def rank(r: str) -> tuple[int, str]:
        parts = r.split(os.sep)
        if parts[0] == "data" and MSGID.fullmatch(parts[-1]):
            return 0, r
        if parts[0] == "tmp" and MSGID.fullmatch(parts[-1]):
            return 1, r
        return (3 if parts[0] in ("queue", "inflight", "cleanup", "held") else 2), r
    return min(names, key=rank)


def tree(root: str, owners: Sequence[str] = ()) -> list[str]:
    """Every name under ``root`` except owners/ and the domain index domains/ (see
    ``index_tree``), one line each, with message ids renamed M0, M1... (in id order) and
    the given owner tokens O0, O1...; directories end in /, symlinks show their target.

    A regular file of several names (a message file and its entries' hard links) is
    shown once with its link count (``st_nlink``: every name it has, listed here or not),
    ``data/M0 (5 names)``, under the name
    ``_first_name`` picks; each of its other names shows that name, ``queue/M0.0 =
    data/M0``: a regular file of the same inode (same device and inode number).  A name
    that is a regular file of one name shows alone.  Read with ``os`` directly: a
    backdoor."""
    lines = []
    files: dict[tuple[int, int], list[str]] = {}
    nlinks: dict[tuple[int, int], int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in ("owners", "domains"):
            continue
        for d in dirnames:
            p = os.path.join(dirpath, d)
            r = os.path.relpath(p, root)
            if r in ("owners", "domains"):
                continue
            lines.append(f"{r} -> {os.readlink(p)}" if os.path.islink(p) else f"{r}/")
        for f in filenames:
            p = os.path.join(dirpath, f)
            r = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                files.setdefault((st.st_dev, st.st_ino), []).append(r)
                nlinks[(st.st_dev, st.st_ino)] = st.st_nlink
            else:
                lines.append(f"{r} -> {os.readlink(p)}" if os.path.islink(p) else r)
    for key, names in files.items():
        first = _first_name(names)
        lines.append(f"{first} ({nlinks[key]} names)")
        lines.extend(f"{r} = {first}" for r in names if r != first)
    text = "\n".join(sorted(lines))
    for k, m in enumerate(sorted(set(MSGID.findall(text)))):
        text = text.replace(m, f"M{k}")
    for k, o in enumerate(owners):
        text = text.replace(o, f"O{k}")
    return sorted(text.split("\n")) if text else []


EMPTY = ["cleanup/", "data/", "held/", "inflight/", "quarantine/", "queue-ref.format", "queue/",
         "tmp/", "tmp/O0/"]


def message_parts(path: str) -> tuple[bytes, bytes]:
    """(body, envelope record) of the message file at ``path``, read with ``os``."""
    with open(path, "rb") as f:
        data = f.read()
    n = parse_trailer(data[-TRAILER_LEN:])
    return data[:-TRAILER_LEN - n], data[-TRAILER_LEN - n:-TRAILER_LEN]


def body_digest(q: FsQueue, msgid: str) -> str:
    return hashlib.sha256(message_parts(os.path.join(q.root, "data", msgid))[0]).hexdigest()


class Crash(BaseException):
    """A simulated crash: ``except Exception`` in the backend cannot swallow it."""


class CrashIO(OsIO):
    """Counts mutating calls; raises Crash before call ``crash_at`` (or never).

    Models a process kill: whatever the kernel accepted stays.  ``kill()`` closes every fd
    it handed out (locks included), as the death of the process would.  fsyncs are
    counted but skipped: they change nothing under this model.
    """

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at = crash_at
        self.crash_on: Callable[[str, tuple[object, ...]], bool] | None = None
        self.calls: list[str] = []
        self.fds: set[int] = set()

    def _tick(self, name: str, *args: object) -> None:
        if ((self.crash_at is not None and len(self.calls) == self.crash_at)
                or (self.crash_on is not None and self.crash_on(name, args))):
            raise Crash(f"crash before {name}{args}")
        self.calls.append(name)

    def kill(self) -> None:
        for fd in list(self.fds):
            os.close(fd)
        self.fds.clear()

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        self._tick("open_create", path)
        fd = super().open_create(path, exclusive=exclusive, append=append)
        self.fds.add(fd)
        return fd

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        self.fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.fds.discard(fd)
        super().close(fd)

    def write(self, fd: int, data: bytes) -> int:
        self._tick("write")
        return super().write(fd, data)

    def ftruncate(self, fd: int, length: int) -> None:
        self._tick("ftruncate")
        super().ftruncate(fd, length)

    def fsync(self, fd: int) -> None:
        self._tick("fsync")

    def fsync_dir(self, path: str) -> None:
        self._tick("fsync_dir", path)

    def syncfs(self, path: str) -> None:
        self._tick("syncfs", path)

    def link(self, src: str, dst: str) -> None:
        self._tick("link", src, dst)
        super().link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        self._tick("rename", src, dst)
        super().rename(src, dst)

    def symlink(self, target: str, path: str) -> None:
        self._tick("symlink", path)
        super().symlink(target, path)

    def unlink(self, path: str) -> None:
        self._tick("unlink", path)
        super().unlink(path)

    def unlink_large(self, path: str) -> None:
        self.unlink(path)  # the same step; only the GIL differs

    def mkdir(self, path: str) -> None:
        self._tick("mkdir", path)
        super().mkdir(path)

    def rmdir(self, path: str) -> None:
        self._tick("rmdir", path)
        super().rmdir(path)

    def lock_exclusive(self, path: str, *, blocking: bool = False) -> int | None:
        fd = super().lock_exclusive(path, blocking=blocking)
        if fd is not None:
            self.fds.add(fd)
        return fd

    def unlock(self, fd: int) -> None:
        self.fds.discard(fd)
        super().unlock(fd)


def test_crash_io_counts_every_mutating_call_it_overrides() -> None:
    overridden = {n for n in MUTATING if n in CrashIO.__dict__}
    assert overridden == MUTATING - {"fdatasync"}


# ---- ids and names ---------------------------------------------------------------------


def test_message_ids_are_unique_time_ordered_and_carry_the_owner() -> None:
    owner = new_owner()
    ids = MessageIds(owner)
    got = [ids.next() for _ in range(1000)]
    assert len(set(got)) == 1000
    assert got == sorted(got)
    assert all(MSGID.fullmatch(m) and owner_of_msgid(m) == owner for m in got)


def test_entry_names_parse_only_our_names() -> None:
    m = MessageIds(new_owner()).next()
    assert EntryName.parse(f"{m}.12") == EntryName(m, 12)
    assert EntryName(m, 3).legacy_target == f"../data/{m}"  # the old format's symlinks
    for bad in (f"{m}.012", f"{m}.-1", f"{m}", f"{m}.1.tmp", "../x.0", f"{m}.1/..", ""):
        assert EntryName.parse(bad) is None, bad


# ---- records ---------------------------------------------------------------------------


def test_records_round_trip_and_reject_every_single_byte_flip() -> None:
    data = encode_schedule("e.1", Schedule(7, 2))
    assert decode_schedule(data, "e.1") == Schedule(7, 2)
    for i in range(len(data)):
        flipped = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        with pytest.raises(RecordError):
            decode_schedule(flipped, "e.1")
    for cut in range(len(data)):
        with pytest.raises(RecordError):
            decode_schedule(data[:cut], "e.1")
    with pytest.raises(RecordError):
        decode_schedule(data, "e.2")  # misplaced record
    with pytest.raises(RecordError):
        decode(encode("envelope", {}), "schedule")


def test_trailers_round_trip_and_reject_anything_else() -> None:
    assert parse_trailer(trailer(1234)) == 1234
    assert len(trailer(1)) == TRAILER_LEN
    for bad in (b"", trailer(5)[:-1], trailer(5).replace(b"qr-", b"qx-"),
                trailer(5)[:-2] + b"x\n", b"qr-envelope 000000000000\n"):
        with pytest.raises(RecordError):
            parse_trailer(bad)
    for n in (0, -1, 10 ** 12):
        with pytest.raises(ValueError):
            trailer(n)


def test_envelope_round_trip() -> None:
    env = Envelope("m" * 38, "", {"SIZE": "12"}, 12, "a" * 64,
                   (Recipient("a@b", Schedule(1, 2), "z"), Recipient("../../x", Schedule(0))))
    assert Envelope.decode(env.encode(), "m" * 38) == env
    with pytest.raises(RecordError):
        Envelope.decode(env.encode(), "n" * 38)


# ---- group commit ----------------------------------------------------------------------


class SlowSyncIO(OsIO):
    """Counts syncs (directory fsyncs and syncfs); each takes 20 ms; one may fail.

    While ``gate`` is clear, the first sync blocks in it: a test holds round 1 open until
    the callers it wants in round 2 are all waiting."""

    def __init__(self, fail_round: int = 0, gated: bool = False) -> None:
        self.syncs = 0
        self.paths: list[str] = []
        self.fail_round = fail_round
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.in_round = threading.Event()
        if not gated:
            self.gate.set()

    def _slow(self, path: str) -> None:
        with self.lock:
            self.syncs += 1
            self.paths.append(path)
            n = self.syncs
        self.in_round.set()
        if n == 1:
            assert self.gate.wait(10)
        time.sleep(0.02)
        if n == self.fail_round:
            raise OSError(errno.EIO, "injected")

    def fsync_dir(self, path: str) -> None:
        self._slow(path)

    def syncfs(self, path: str) -> None:
        self._slow(path)


def wait_for_waiters(g: GroupSync, n: int) -> None:
    """Until ``n`` callers wait for the next round (a white-box look at the queue)."""
    deadline = time.monotonic() + 10
    while len(g._waiting) < n:
        assert time.monotonic() < deadline, f"{len(g._waiting)} of {n} callers arrived"
        time.sleep(0.001)


def second_round(g: GroupSync, io: SlowSyncIO, first: threading.Thread,
                 callers: list[threading.Thread]) -> None:
    """Start ``first``, hold its round open (``io`` gated) until every one of ``callers``
    waits for the next round, then let the rounds run; return when all have ended."""
    first.start()
    assert io.in_round.wait(10)
    for t in callers:
        t.start()
    wait_for_waiters(g, len(callers))
    io.gate.set()
    for t in [first, *callers]:
        t.join()


MODES = ["syncfs", "fsync"]


@pytest.mark.parametrize("mode", MODES)
def test_group_sync_shares_rounds_between_threads(tmp_path: str, mode: str) -> None:
    io = SlowSyncIO()
    g = GroupSync(io, mode, str(tmp_path))
    start = threading.Barrier(16)

    def worker() -> None:
        start.wait()
        for _ in range(5):
            g.sync([str(tmp_path)])

    ts = [threading.Thread(target=worker) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert g.requests == 80
    assert io.syncs == g.rounds
    assert io.syncs < 40  # shared: far fewer syncs than callers


def test_fsync_rounds_sync_each_named_directory_once(tmp_path: str) -> None:
    io = SlowSyncIO(gated=True)
    g = GroupSync(io, "fsync", str(tmp_path))
    first = threading.Thread(target=g.sync, args=(["/a"],))
    ts = [threading.Thread(target=g.sync, args=(dirs,))  # they share round 2
          for dirs in (["/b", "/c"], ["/c"], ["/b", "/b"], [])]
    second_round(g, io, first, ts)
    assert io.paths[0] == "/a" and sorted(io.paths[1:]) == ["/b", "/c"]
    assert g.rounds == 2 and g.covers_files is False


def test_syncfs_rounds_cover_files_and_ignore_paths(tmp_path: str) -> None:
    io = SlowSyncIO()
    g = GroupSync(io, "syncfs", str(tmp_path))
    g.sync(["/x", "/y"])
    g.sync()
    assert io.paths == [str(tmp_path), str(tmp_path)] and g.covers_files


@pytest.mark.parametrize("mode", MODES)
def test_group_sync_waits_for_a_round_that_started_after_the_call(tmp_path: str,
                                                                  mode: str) -> None:
    """A caller arriving while a round runs must not be released by that round."""
    io = SlowSyncIO(gated=True)
    g = GroupSync(io, mode, str(tmp_path))
    t = threading.Thread(target=g.sync, args=([str(tmp_path)],))
    t.start()
    assert io.in_round.wait(10)  # the first round is running now
    threading.Timer(0.05, io.gate.set).start()  # it ends while we wait
    g.sync([str(tmp_path)])
    t.join()
    assert io.syncs == 2


@pytest.mark.parametrize("mode", MODES)
def test_group_sync_failure_reaches_every_caller_of_that_round(tmp_path: str,
                                                               mode: str) -> None:
    io = SlowSyncIO(fail_round=2, gated=True)
    g = GroupSync(io, mode, str(tmp_path))
    errors: list[BaseException] = []

    def follower() -> None:
        try:
            g.sync([str(tmp_path)])
        except OSError as e:
            errors.append(e)

    first = threading.Thread(target=g.sync, args=([str(tmp_path)],))
    second_round(g, io, first, [threading.Thread(target=follower) for _ in range(5)])
    assert len(errors) == 5 and io.syncs == 2  # round 2 failed, for all five
    # the failure is sticky: a later change is refused without a sync (a later success
    # would prove nothing about what the kernel dropped), until the queue is reopened
    with pytest.raises(OSError, match="injected"):
        g.sync([str(tmp_path)])
    assert io.syncs == 2
    GroupSync(io, mode, str(tmp_path)).sync([str(tmp_path)])
    assert io.syncs == 3


class DyingSyncIO(SlowSyncIO):
    """The first sync kills its thread with a BaseException (a simulated crash)."""

    def _slow(self, path: str) -> None:
        super()._slow(path)
        if self.syncs == 1:
            raise Crash("died in the sync")


def test_a_crash_in_the_leader_fails_its_followers_and_frees_the_next_round(
        tmp_path: str) -> None:
    io = DyingSyncIO(gated=True)
    g = GroupSync(io, "syncfs", str(tmp_path))
    died: list[BaseException] = []
    errors: list[BaseException] = []

    def leader() -> None:
        try:
            g.sync()
        except Crash as e:
            died.append(e)

    def follower() -> None:
        try:
            g.sync()
        except OSError as e:
            errors.append(e)

    second_round(g, io, threading.Thread(target=leader),
                 [threading.Thread(target=follower) for _ in range(3)])
    # the followers waited for round 2, which ran: they are served, nobody hangs
    assert len(died) == 1 and not errors and io.syncs == 2
    g.sync()
    assert io.syncs == 3


def test_a_step_runs_between_two_rounds_and_its_caller_waits_for_both(tmp_path: str) -> None:
    io = SlowSyncIO()
    g = GroupSync(io, "syncfs", str(tmp_path))
    seen: list[int] = []
    g.sync(then=lambda: seen.append(io.syncs))
    assert seen == [1] and io.syncs == 2  # after the first round, before the second


def test_steps_of_many_callers_share_rounds(tmp_path: str) -> None:
    """Eight commits that arrive while a round runs: their files share round 2, their
    steps are all made by the leader of round 3, which covers them all."""
    io = SlowSyncIO(gated=True)
    g = GroupSync(io, "syncfs", str(tmp_path))
    steps: dict[int, tuple[int, str]] = {}
    returned: dict[int, int] = {}

    def commit(k: int) -> None:
        g.sync(then=lambda: steps.__setitem__(k, (io.syncs, threading.current_thread().name)))
        returned[k] = io.syncs

    second_round(g, io, threading.Thread(target=g.sync),
                 [threading.Thread(target=commit, args=(k,), name=f"c{k}") for k in range(8)])
    assert io.syncs == 3 and g.rounds == 3
    assert {n for n, _ in steps.values()} == {2}  # every step after round 2, before 3
    assert len({name for _, name in steps.values()}) == 1  # made by one leader
    assert set(returned.values()) == {3}


def test_counts_read_during_a_round_show_only_the_callers_served(tmp_path: str) -> None:
    """Read while round 1 is held open and eight callers (four with a step) wait: the
    counts say what the rounds ran and served, never a caller still waiting, and the
    round sizes sum to the callers plus the steps served after a first round."""
    io = SlowSyncIO(gated=True)
    g = GroupSync(io, "syncfs", str(tmp_path))
    first = threading.Thread(target=g.sync)
    first.start()
    assert io.in_round.wait(10)
    callers = [threading.Thread(target=g.sync, kwargs={"then": (lambda: None) if k % 2 else None})
               for k in range(8)]
    for t in callers:
        t.start()
    wait_for_waiters(g, 8)
    assert g.counts() == (0, 0, {})  # round 1 runs: nobody is served yet
    io.gate.set()
    for t in [first, *callers]:
        t.join()
    rounds, served, sizes = g.counts()
    assert (rounds, served) == (3, 9)  # round 1: first; round 2: eight; round 3: four steps
    assert sizes == {1: 1, 8: 1, 4: 1}
    assert sum(k * n for k, n in sizes.items()) == served + 4


@pytest.mark.parametrize("fail_round", [1, 2])
def test_a_failed_round_fails_a_caller_with_a_step(tmp_path: str, fail_round: int) -> None:
    io = SlowSyncIO(fail_round=fail_round)
    g = GroupSync(io, "syncfs", str(tmp_path))
    ran: list[int] = []
    with pytest.raises(OSError, match="injected"):
        g.sync(then=lambda: ran.append(1))
    assert ran == ([] if fail_round == 1 else [1])  # no step after a failed first round
    with pytest.raises(OSError, match="injected"):  # sticky: no later round, no later step
        g.sync(then=lambda: ran.append(2))
    assert io.syncs == fail_round and 2 not in ran


def test_an_error_in_a_step_goes_to_its_caller_alone(tmp_path: str) -> None:
    io = SlowSyncIO()
    g = GroupSync(io, "syncfs", str(tmp_path))

    def fail() -> None:
        raise OSError(errno.ENOSPC, "no room for the link")

    with pytest.raises(OSError, match="no room"):
        g.sync(then=fail)
    g.sync()  # the group goes on, and the error was not anyone else's
    assert io.syncs == 3


def test_a_crash_in_a_step_fails_its_caller_and_frees_the_group(tmp_path: str) -> None:
    io = SlowSyncIO(gated=True)
    g = GroupSync(io, "syncfs", str(tmp_path))
    outcome: dict[str, BaseException | None] = {}

    def run(name: str, **kw: object) -> None:
        try:
            g.sync(**kw)  # type: ignore[arg-type]
            outcome[name] = None
        except BaseException as e:  # recorded for the assertions
            outcome[name] = e

    def die() -> None:
        raise Crash("died in a step")

    second_round(g, io, threading.Thread(target=run, args=("first",)),
                 [threading.Thread(target=run, args=("stepper",), kwargs={"then": die})])
    # the stepper led round 3 and ran its own step there: the crash is its own
    assert outcome["first"] is None and isinstance(outcome["stepper"], Crash)
    g.sync()
    assert io.syncs == 3


def test_a_step_needs_rounds_that_cover_files(tmp_path: str) -> None:
    with pytest.raises(ValueError, match="syncfs"):
        GroupSync(OsIO(), "fsync", str(tmp_path)).sync(then=lambda: None)


def test_unknown_sync_mode_is_refused(tmp_path: str) -> None:
    with pytest.raises(ValueError, match="sync mode"):
        GroupSync(OsIO(), "sync", str(tmp_path))


# ---- the envelope cache ----------------------------------------------------------------


def _env(msgid: str, n: int) -> Envelope:
    return Envelope(msgid, "a@b", {}, 0, "0" * 64, tuple(rcpts(n)))


def test_envelope_cache_is_bounded_by_messages_and_by_recipients() -> None:
    cache = EnvelopeCache(messages=3, recipients=10)
    for k in range(5):
        cache.put(f"m{k}", None, _env(f"m{k}", 1), 100)
    assert len(cache) == 3 and cache.peek("m0") is None and cache.peek("m4") is not None
    cache.put("big", None, _env("big", 9), 100)  # 9 + the newest: m3, m4 are evicted in turn
    assert cache.recipients <= 10 and cache.peek("big") is not None
    cache.put("huge", None, _env("huge", 11), 100)  # larger than the whole cache: not kept
    assert cache.peek("huge") is None and cache.recipients <= 10
    cache.put("big", None, _env("big", 2), 100)  # replacing an entry releases its recipients
    cache.drop("big")
    assert cache.recipients == sum(len(e.rcpts) for e in filter(None, (
        cache.peek(m) for m in ("m0", "m1", "m2", "m3", "m4"))))


def test_envelope_cache_get_needs_the_file_key_peek_does_not() -> None:
    cache = EnvelopeCache()
    env = _env("m", 1)
    cache.put("m", None, env, 4458)  # written by this queue
    assert cache.get("m", (1, 2, 3)) is None and cache.peek("m") is env
    assert cache.file_size("m") == 4458 and cache.file_size("other") is None
    cache.put("m", (1, 2, 3), env, 2)  # read back from disk
    assert cache.get("m", (1, 2, 3)) is env and cache.get("m", (1, 2, 4)) is None
    assert cache.file_size("m") == 2
