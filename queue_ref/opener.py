"""Open a queue by backend name, and find the relay that works on it.

Every command that works on a queue (``queue-ref relay``, the operator commands) names it
by a directory and a backend::

    fs            the filesystem queue (default), ``queue_ref.fsqueue.FsQueue``
    fs-fsync      the filesystem queue fsyncing each file in its writer's thread
    kv-log        the KV queue over the Python log engine
    kv-leveldb    the KV queue over real LevelDB (plyvel)
    pkg.module:factory
                  any factory ``queue-ref certify`` accepts, called as ``factory(path)``

A relay working on a queue writes its process id to ``relay.pid`` in the queue's
directory (in each root of a queue over several roots, ``open_queues``); ``wake_relay``
sends it SIGUSR1, which makes it look for due mail at once.
No backend names a file ``relay.pid``, so it lives beside their files untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from queue_ref.io import OsIO
from queue_ref.storage import InvalidInputError, RecoveryReport, Storage

__all__ = [
    "BACKENDS", "PID_FILE", "import_object", "load_backend", "open_queue", "open_queues",
    "open_serving", "read_relay_pid", "relay_on_any", "remove_relay_pid", "wake_relay",
    "write_relay_pid",
]

PID_FILE = "relay.pid"
#: The pid files this process wrote, open and locked (``flock``) while it runs: the lock,
#: not the pid, says that the relay lives (a relay killed by SIGKILL leaves its file, and
#: its pid may be another process's by then).
_HELD_PID_FILES: dict[str, int] = {}


def _fs(path: str) -> Storage:
    from queue_ref.fsqueue import FsQueue

    return FsQueue(path)


def _fs_fsync(path: str) -> Storage:
    from queue_ref.fsqueue import FsQueue

    return FsQueue(path, sync="fsync")


def _kv_log(path: str) -> Storage:
    from queue_ref.kv.kv_queue import KvQueue

    return KvQueue.open_log(path)


def _kv_leveldb(path: str) -> Storage:
    from queue_ref.kv.kv_queue import KvQueue

    return KvQueue.open_leveldb(path)


BACKENDS: dict[str, Callable[[str], Storage]] = {
    "fs": _fs,
    "fs-fsync": _fs_fsync,
    "kv-log": _kv_log,
    "kv-leveldb": _kv_leveldb,
}


def import_object(path: str) -> object:
    """The object named ``package.module:attribute`` (the attribute may be dotted)."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise InvalidInputError(f"expected package.module:factory, got {path!r}")
    try:
        obj: object = importlib.import_module(mod_name)
    except ImportError as e:
        raise InvalidInputError(f"cannot import {mod_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise InvalidInputError(f"{path!r}: {mod_name} has no attribute {attr!r}") from e
    return obj


def load_backend(name: str) -> Callable[[str], Storage]:
    """The opener for a backend name or a ``pkg.module:factory`` path."""
    if name in BACKENDS:
        return BACKENDS[name]
    if ":" not in name:
        raise InvalidInputError(
            f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)} "
            "or package.module:factory")
    factory = import_object(name)
    if not callable(factory):
        raise InvalidInputError(f"backend {name!r} is not callable")

    def open_with_factory(path: str) -> Storage:
        store = factory(path)
        if not isinstance(store, Storage):
            raise InvalidInputError(
                f"backend {name!r} returned a {type(store).__name__}, not a Storage")
        return store

    return open_with_factory


def queue_kind(path: str) -> str | None:
    """Which backend's queue ``path`` holds ("fs", "kv-log", "kv-leveldb"), or None when
    it holds none (or is no directory)."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    if {"data", "queue"} <= names and all(os.path.isdir(os.path.join(path, n))
                                          for n in ("data", "queue")):
        return "fs"
    if "CURRENT" in names and any(n.startswith("MANIFEST-") for n in names) and (
            names & {"queue-ref.reserve", "queue-ref.closed", "queue-ref.lock"}):
        return "kv-leveldb" if names & {"LOG", "queue-ref.lock"} else "kv-log"
    return None


def check_backend(path: str, backend: str) -> None:
    """Refuse to open with ``backend`` a directory that holds another of the project's
    backends' queues: opening it would make a second, empty queue beside the first, whose
    mail then no relay and no command lists.  InvalidInputError, naming the backend to
    use.  A backend of one's own (``module:factory``) is not checked."""
    if backend not in BACKENDS:
        return
    found = queue_kind(path)
    family = "fs" if backend.startswith("fs") else backend
    if found is not None and found != family:
        raise InvalidInputError(
            f"{path} holds a {found} queue, not a {backend} one: give --backend {found} (or "
            f"backend = \"{found}\"); opened as {backend}, its mail would be hidden")


def open_queue(path: str, backend: str = "fs") -> Storage:
    """Open (and so recover) the queue at ``path`` with the named backend; refused if the
    directory holds another backend's queue (``check_backend``)."""
    opener = load_backend(backend)
    check_backend(path, backend)
    return opener(path)


#: The process ``open_serving`` runs the recovery in (ROOT and the sync mode follow).
RECOVERY_COMMAND = [sys.executable, "-m", "queue_ref.fsqueue.recover_child"]


def open_serving(path: str, backend: str = "fs"
                 ) -> tuple[Storage, Callable[[], RecoveryReport] | None]:
    """Open the queue at ``path`` for a relay that takes mail at once, and what is left
    to run before its first listing (None: nothing).

    A filesystem queue every owner of which closed (``FsQueue.dead_owners`` finds none)
    is opened without its recovery, which reads every entry; the function returned runs
    that recovery beside it, through a second open queue (another owner) in a process of
    its own (``queue_ref.fsqueue.recover_child``: its memory goes with it), so it is the
    recovery any process runs beside a live one: not exclusive, concurrent with this
    queue's commits and claims, and what it requeues is listed after it.  A filesystem
    queue a process died holding is opened with its whole recovery (exclusive when no
    other process has it open), as is a queue of any other backend, and a filesystem
    queue of the old format (its recovery converts it, or refuses beside a live process
    and names ``queue-ref repair``)."""
    if backend not in ("fs", "fs-fsync"):
        return open_queue(path, backend), None
    check_backend(path, backend)
    from queue_ref.fsqueue import FsQueue
    from queue_ref.fsqueue.layout import Layout

    sync = "fsync" if backend == "fs-fsync" else None
    lay = Layout(path)
    if os.path.isdir(lay.data) and not os.path.exists(lay.format_marker):
        # the old format: converted at opening
        return FsQueue(path, sync=sync), None
    q = FsQueue(path, recover=False, sync=sync)
    try:
        if q.dead_owners():
            q.recover()
            return q, None
    except BaseException:
        q.close()
        raise

    def recover_beside() -> RecoveryReport:
        from queue_ref.fsqueue.recover_child import report_from_json

        done = subprocess.run([*RECOVERY_COMMAND, path, sync or "default"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the recovery process exited {done.returncode}: "
                               f"{done.stderr.strip()[-500:]}")
        return report_from_json(done.stdout.strip().splitlines()[-1])

    return q, recover_beside


def open_queues(paths: Sequence[str], backend: str = "fs", *,
                part: int | None = None) -> Storage:
    """Open the queue at ``paths``: one directory as ``open_queue``; several as one queue
    over them (``queue_ref.multi_root.MultiRootQueue``), each root opened by the named
    backend; with ``part``, that root of them alone, under its ids in the whole queue."""
    if isinstance(paths, str) or not paths:
        raise InvalidInputError(f"expected a non-empty list of queue directories, got {paths!r}")
    if len(paths) == 1 and part is None:
        return open_queue(paths[0], backend)
    from queue_ref.multi_root import MultiRootQueue

    for path in paths:
        if isinstance(path, str) and path:
            check_backend(path, backend)
    if backend in ("fs", "fs-fsync"):  # syncfs only for roots on file systems of their own
        return MultiRootQueue.open_fs(paths, sync="fsync" if backend == "fs-fsync" else None,
                                      part=part)
    return MultiRootQueue.over(paths, load_backend(backend), part=part)


def relay_on_any(paths: Sequence[str]) -> tuple[int, str] | None:
    """A live relay other than this process working on one of the directories ``paths``
    (its pid and that directory), or None: one relay per set of roots."""
    for path in paths:
        pid = read_relay_pid(path)
        if pid is not None and pid != os.getpid():
            return pid, path
    return None


def read_relay_pid(path: str) -> int | None:
    """The pid of the relay working on the queue at ``path``, if one is alive: the pid
    file's lock is held (``write_relay_pid``).  A file nobody holds was left by a relay
    that died (SIGKILL, a power cut); its pid is not trusted, since the system may have
    given it to another process since."""
    try:
        fd = os.open(os.path.join(path, PID_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if OsIO().lock_file(fd, shared=True):  # nobody holds it: its relay died
            return None
        try:
            pid = int(os.read(fd, 32).decode("ascii").strip() or "0")
        except (ValueError, UnicodeDecodeError):
            return None
        return pid if pid > 0 else None
    finally:
        os.close(fd)


def write_relay_pid(path: str) -> None:
    """Say that this process is the relay working on the queue at ``path``: the pid file
    is written and kept open with an exclusive lock until ``remove_relay_pid`` (or the
    end of this process)."""
    pid_path = os.path.join(path, PID_FILE)
    tmp = f"{pid_path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        OsIO().lock_file(fd, shared=False, blocking=True)  # a new file: nobody else has it
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        os.replace(tmp, pid_path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    old = _HELD_PID_FILES.pop(os.path.abspath(path), None)
    _HELD_PID_FILES[os.path.abspath(path)] = fd
    if old is not None:
        os.close(old)


def remove_relay_pid(path: str) -> None:
    """Remove the relay's pid file at ``path`` if it names this process, and let its
    lock go (best effort)."""
    pid_path = os.path.join(path, PID_FILE)
    with contextlib.suppress(OSError):
        with open(pid_path, encoding="ascii") as f:
            mine = f.read().strip() == str(os.getpid())
        if mine:
            os.unlink(pid_path)
    fd = _HELD_PID_FILES.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)


def wake_relay(path: str) -> bool:
    """Ask the relay working on the queue at ``path`` to look for due mail now."""
    pid = read_relay_pid(path)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return False
    return True
