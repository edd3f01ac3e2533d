"""Full disk: a queue on a real, small file system that fills up (C9, C1, C8).

A disk that fills is the fault every queue meets in service, and the one a fault
injected through the I/O seam cannot stand for: how much room a store keeps aside, when
it gives that room back, and what its own writes (a compaction, a journal) need while
the disk is full only show on a file system that really is full.  So the check mounts a
``DISK`` tmpfs in a mount namespace of its own (``unshare``: as root, a private mount
namespace; otherwise a user namespace that maps the caller to root, which Linux allows
without privileges where unprivileged user namespaces are on), in a child process that
runs the backend there and reports each finding; the mount goes with the child.

Three rounds, each on a fresh tmpfs, with incompressible bodies of ``BODY_BYTES`` (a
round that ends with an error reports it and the next one runs):

* **space freed**: another file takes a quarter of the disk; messages are enqueued until
  the store refuses one.  Every refusal must be ``NoSpaceError`` (C9: not a bare
  ``OSError``, not another error, not success); the other file is removed, and without a
  restart the queue takes a new message (C9) and delivers every acknowledged message
  whole (C1), then holds nothing (C8: ``footprint()`` is (0, 0)).
* **filled by another**: the queue holds a little mail and is closed with the disk not
  full; another file then fills the disk.  Opening the queue must work and deliver
  everything (C9: "reopening still works"; a store that keeps room aside must give it
  back at the open, for recovery to write).
* **drained while full** (a backend that declares ``Limits.drains_full_disk``): the queue
  fills the disk itself, delivers half its messages with the disk still full (C9:
  ``send_done`` and ``cleanup`` work), is closed and opened again while still full,
  delivers the rest, and holds nothing.  A backend that declares it cannot drain a full
  disk (the LevelDB queue: its compactions write new tables before freeing the old ones)
  has the first two rounds only, may raise ``NoSpaceError`` while delivering on a full
  disk, and is then restarted once space is freed: it must deliver everything after
  that, and then take new mail (a reserve it keeps aside may refuse new mail while the
  queue's own mail fills the disk); the certificate says so.  Every round ends with the
  drained queue taking a new message and delivering it.
* **small messages drained while full** (a backend that declares it drains a full disk):
  as the last, with thousands of ``SMALL_BODY_BYTES`` bodies, every one delivered and
  cleaned up in one go with the disk still full.  A few big messages leave a store room
  for the few records delivering each writes; thousands of small ones do not, unless it
  gives back what delivered mail took while it drains (the KV log queue took 2,077 and
  raised ``NoSpaceError`` from ``send_done`` before it was empty, until its engine did:
  ``LogEngine.reclaim``).

Every message read back must hold the bytes acknowledged (C6).

Four rounds in all, each on its own tmpfs.  Scenario ``full-disk:<seed>`` (the seed
draws the bodies).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.child_process import Channel, Child, ChildTimeout
from queue_ref.storage import NoSpaceError, Recipient, Schedule, Storage

CHECK = "full-disk"
DISK = "4m"
BODY_BYTES = 20 * 1024
#: The bodies of the small-messages round: about 2,000 of them fill the disk (the KV log
#: queue's), 1,000 (the filesystem queue's: a page per file).
SMALL_BODY_BYTES = 1024
#: Messages enqueued at most before a round says the disk never filled.
MOST = 2000
MOST_SMALL = 20000
STEPS = {
    "space freed": ("mount a 4 MiB tmpfs; another file takes 1 MiB of it",
                    "enqueue 20 KiB messages until one is refused",
                    "remove the other file; enqueue one more without a restart",
                    "deliver and clean up everything"),
    "filled by another": ("mount a 4 MiB tmpfs; enqueue 20 messages of 20 KiB; close",
                          "another file fills the disk",
                          "open the queue again and deliver everything"),
    "drained while full": ("mount a 4 MiB tmpfs; enqueue 20 KiB messages until one is "
                           "refused",
                           "deliver half of them, the disk still full; close",
                           "open the queue again, still full; deliver the rest"),
    "small messages drained while full": (
        "mount a 4 MiB tmpfs; enqueue 1 KiB messages until one is refused",
        "deliver and clean up all of them, the disk still full"),
}


def namespace_command() -> list[str]:
    """The ``unshare`` command a child runs under to mount a tmpfs of its own."""
    if os.geteuid() == 0:
        return ["unshare", "--mount", "--propagation", "private"]
    return ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


def namespace_problem() -> str | None:
    """Why no child can mount a tmpfs here, or None."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    probe = tempfile.mkdtemp(prefix="queue-ref-full-probe-")
    try:
        got = subprocess.run([*namespace_command(), "mount", "-t", "tmpfs", "-o", "size=64k",
                              "tmpfs", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare` failed: {e}"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)
    if got.returncode != 0:
        return (f"a mount namespace with a tmpfs cannot be made here ({got.stderr.strip()}): "
                "run as root, or enable unprivileged user namespaces")
    return None


# ---- in the child ---------------------------------------------------------------------

class _Round:
    """One round in the child: its tmpfs, its bodies, and what it found."""

    def __init__(self, ch: Channel, name: str, mnt: str, rng: random.Random,
                 drains: bool) -> None:
        self.ch, self.name, self.mnt, self.rng = ch, name, mnt, rng
        self.drains = drains  # Limits.drains_full_disk
        self.root = os.path.join(mnt, "q")
        self.bodies: dict[str, bytes] = {}
        self.body_bytes, self.most = ((SMALL_BODY_BYTES, MOST_SMALL) if name.startswith("small")
                                      else (BODY_BYTES, MOST))
        self.refused = ""  # the last NoSpaceError's message
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", mnt],
                       check=True, capture_output=True)

    def fail(self, clause: str, detail: str) -> None:
        self.ch.send({"round": self.name, "clause": clause, "detail": detail})

    def enqueue(self, q: Storage) -> str | None:
        """One message; its id, or None when the store refused it for a full disk (any
        other error is a finding, and raises to end the round)."""
        body = self.rng.randbytes(self.body_bytes)
        n = len(self.bodies)
        try:
            with q.enqueue(f"s{n}@example.org") as enq:
                enq.write(body)
                mid = enq.commit([Recipient(f"r{n}@example.net", Schedule(0))])[0].message_id
        except NoSpaceError as e:
            self.refused = str(e)
            return None
        except Exception as e:
            self.fail("C9", f"enqueue {n + 1} on a filling disk raised {type(e).__name__} "
                            f"({e}), not NoSpaceError")
            raise _Stop from e
        self.bodies[mid] = body
        return mid

    def fill(self, q: Storage) -> None:
        for _ in range(self.most):
            if self.enqueue(q) is None:
                return
        self.fail("C1", f"{self.most} messages of {self.body_bytes} bytes were acknowledged "
                        f"on a {DISK} file system: they cannot all be stored")
        raise _Stop

    def deliver(self, q: Storage, count: int | None, when: str, *,
                restarted: bool = False) -> set[str]:
        """Deliver and clean up ``count`` listed entries (all when None); the messages
        delivered.  A failure is a finding (C9) and ends the round, but a full disk on a
        backend that declares it cannot drain one, before its restart (``_NeedsRestart``)."""
        got: set[str] = set()
        try:
            for h in list(q.list_queue())[:count]:
                f = q.send_start(h)
                if f is None:
                    continue
                with q.read_inflight(f) as r:
                    body = r.read_all()
                want = self.bodies.get(h.message_id)
                if want is None:
                    self.fail("C6", f"{when}: message {h.message_id}, which the queue never "
                                    "acknowledged, was listed")
                elif body != want:
                    self.fail("C6", f"{when}: message {h.message_id} was read back with "
                                    "other bytes")
                done = q.send_done(f)
                got.add(h.message_id)  # delivered: a cleanup left is recovery's to finish
                if done is not None:
                    q.cleanup(done)
        except NoSpaceError as e:
            if not self.drains and not restarted:
                raise _NeedsRestart(got) from e
            self.fail("C9", f"{when}: delivering raised NoSpaceError ({e}): "
                      + ("space was freed and the queue restarted" if restarted else
                         "a full disk leaves the queue drainable (send_done and cleanup "
                         "work)"))
            raise _Stop from e
        except Exception as e:
            self.fail("C9", f"{when}: delivering raised {type(e).__name__} ({e}): a full "
                            "disk leaves the queue drainable (send_done and cleanup work)")
            raise _Stop from e
        return got

    def drain(self, q: Storage, backend: Backend, when: str, again: str,
              free: Callable[[], None] | None = None) -> Storage:
        """Deliver everything and require it all delivered and the queue empty.  A backend
        that declares it cannot drain a full disk and refuses a delivery for one is given
        room (``free``), restarted and drained again (``again``: when that is).  Then
        (``free`` called if it was not) the drained queue must take new mail.  The open
        queue, to close."""
        try:
            got = self.deliver(q, None, when)
        except _NeedsRestart as e:
            got = set(e.args[0])
            if free is not None:
                free()
                free = None
            q = self.restart(q, backend)
            got |= self.deliver(q, None, again, restarted=True)
            when = again
        self.all_delivered(got, when)
        self.empty(q, when)
        if free is not None:  # the other file goes before the queue is asked for new mail
            free()
        self.takes_mail_again(q, when)
        return q

    def restart(self, q: Storage, backend: Backend) -> Storage:
        """Close and reopen a queue that declares it cannot drain a full disk, once space
        is freed (C9: it "works again once space is freed, after a restart if need be")."""
        q.close()
        q = backend.open(self.root)
        self.ch.send({"restarted": self.name})
        return q

    def takes_mail_again(self, q: Storage, when: str) -> None:
        """The drained queue takes a new message and delivers it.  A queue restarted after
        a full disk is asked only once drained: a store that keeps room aside (LevelDB's
        reserve) may refuse new mail until its own mail no longer fills the disk."""
        mid = self.enqueue(q)
        if mid is None:
            self.fail("C9", f"{when}, the drained queue still refuses new mail for a full "
                            f"disk ({self.refused}): it works again once space is freed")
            raise _Stop
        when = f"{when}, a new message"
        if mid not in self.deliver(q, None, when, restarted=True):
            self.fail("C1", f"{when}: the message acknowledged was not delivered")
        self.empty(q, when)

    def all_delivered(self, delivered: set[str], when: str) -> None:
        missing = sorted(set(self.bodies) - delivered)
        if missing:
            self.fail("C1", f"{when}: {len(missing)} acknowledged messages were not delivered "
                            f"(first: {missing[0]})")

    def empty(self, q: Storage, when: str) -> None:
        fp = q.footprint()
        if (fp.objects, fp.bytes) != (0, 0):
            self.fail("C8", f"{when}: the drained queue's footprint is {fp}, not (0, 0)")

    def ballast(self, size: int | None) -> str:
        """Another file of ``size`` bytes, or one that fills the disk (None).  Written
        unbuffered: a short last write is all the disk takes, and nothing is left in a
        buffer for the close to fail on."""
        path = os.path.join(self.mnt, "ballast")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            left = size if size is not None else 1 << 40
            with contextlib.suppress(OSError):  # ENOSPC: the disk is full
                while left > 0:
                    left -= os.write(fd, os.urandom(min(left, 64 * 1024)))
        finally:
            os.close(fd)
        return path


class _Stop(Exception):
    """A round ended at a finding."""


class _NeedsRestart(Exception):
    """A backend that declares it cannot drain a full disk refused a delivery for one:
    what it delivered before (``args[0]``)."""


def _space_freed(r: _Round, backend: Backend) -> None:
    ballast = r.ballast(1 << 20)
    q = backend.open(r.root)
    try:
        r.fill(q)
        if len(r.bodies) < 10:
            r.fail("C9", f"only {len(r.bodies)} messages of {BODY_BYTES} bytes were taken "
                         f"on a {DISK} file system with 3 MiB free")
        os.unlink(ballast)
        if r.enqueue(q) is None and r.drains:
            r.fail("C9", "with a megabyte freed, a new message is still refused for a full "
                         "disk: the queue goes on without a restart once space is freed")
        # declared non-draining: after a full disk it writes again only once reopened
        q = r.drain(q, backend, "after space was freed", "reopened after space was freed")
    finally:
        q.close()


def _filled_by_another(r: _Round, backend: Backend) -> None:
    q = backend.open(r.root)
    try:
        for _ in range(20):
            if r.enqueue(q) is None:
                r.fail("C9", "a message was refused for a full disk on a disk not full")
                raise _Stop
    finally:
        q.close()
    ballast = r.ballast(None)
    try:
        q = backend.open(r.root)
    except Exception as e:
        r.fail("C9", f"opening the queue on a disk another file filled raised "
                     f"{type(e).__name__} ({e}): reopening works on a full disk (a store "
                     "that keeps room aside gives it back at the open, for recovery)")
        raise _Stop from e
    try:  # declared non-draining: delivering needs the other file removed first
        q = r.drain(q, backend, "reopened on a disk another file filled",
                    "reopened once the other file was removed", lambda: os.unlink(ballast))
    finally:
        q.close()


def _drained_while_full(r: _Round, backend: Backend) -> None:
    q = backend.open(r.root)
    try:
        r.fill(q)
        first = r.deliver(q, len(r.bodies) // 2, "with the disk full")
    finally:
        q.close()
    try:
        q = backend.open(r.root)
    except Exception as e:
        r.fail("C9", f"opening the queue again on the full disk raised {type(e).__name__} "
                     f"({e}): reopening works on a full disk")
        raise _Stop from e
    try:
        rest = r.deliver(q, None, "reopened on the full disk")
        r.all_delivered(first | rest, "reopened on the full disk")
        r.empty(q, "reopened on the full disk")
        r.takes_mail_again(q, "reopened on the full disk")
    finally:
        q.close()


def _small_drained_while_full(r: _Round, backend: Backend) -> None:
    q = backend.open(r.root)
    try:
        r.fill(q)
        if len(r.bodies) < 500:
            r.fail("C9", f"only {len(r.bodies)} messages of {r.body_bytes} bytes were taken "
                         f"on a {DISK} file system")
        got = r.deliver(q, None, "with the disk full of small messages")
        r.all_delivered(got, "with the disk full of small messages")
        r.empty(q, "with the disk full of small messages")
        r.takes_mail_again(q, "with the disk full of small messages")
    finally:
        q.close()


#: The rounds a backend that declares it cannot drain a full disk skips.
DRAINING = ("drained while full", "small messages drained while full")
ROUNDS: dict[str, Callable[[_Round, Backend], None]] = {
    "space freed": _space_freed, "filled by another": _filled_by_another,
    "drained while full": _drained_while_full,
    "small messages drained while full": _small_drained_while_full,
}


def _child(ch: Channel, backend: Backend, seed: int, mounts: list[str],
           rounds: list[str], drains: bool) -> None:
    for name, mnt in zip(rounds, mounts, strict=True):
        r = _Round(ch, name, mnt, random.Random(f"{seed}:{name}"), drains)
        try:
            ROUNDS[name](r, backend)
        except _Stop:
            pass  # the round ended at its finding
        except Exception as e:  # the next rounds still run, each on its own tmpfs
            r.fail("C9", f"the round ended with {type(e).__name__} ({e}): on a full disk, "
                         "and once space is freed, a queue raises only its typed errors")
        ch.send({"done": name, "messages": len(r.bodies)})


# ---- in the parent --------------------------------------------------------------------

class _NotRun(Exception):
    """The check cannot run this backend (said in the result's note, as an ERROR)."""


def _run(backend: Backend, seed: int) -> tuple[list[Finding], dict[str, Any], str]:
    scenario = f"{CHECK}:{seed}"
    drains = backend.probe().limits.drains_full_disk
    rounds = [n for n in ROUNDS if drains or n not in DRAINING]
    note = "" if drains else ("the backend declares that it cannot drain a full disk "
                              "(Limits.drains_full_disk): delivering needs free space, and "
                              "after a full disk a restart may be needed once space is "
                              "freed; the drained-while-full rounds were not run")
    mounts = [tempfile.mkdtemp(prefix="queue-ref-full-") for _ in rounds]
    found: list[Finding] = []
    stats: dict[str, Any] = {"rounds": len(rounds)}
    try:
        try:
            child = Child(_child, backend, seed, mounts, rounds, drains,
                          wrapper=namespace_command())
        except ValueError as e:  # a factory that does not pickle: no fresh child for it
            raise _NotRun(str(e)) from e
        with child:
            for msg in child.messages(300.0):
                if "crashed" in msg:
                    found.append(Finding("C9", f"the full-disk child raised {msg['crashed']}",
                                         scenario, NO_CRASH, ()))
                elif "clause" in msg:
                    found.append(Finding(msg["clause"], f"{msg['round']}: {msg['detail']}",
                                         scenario, NO_CRASH, STEPS[msg["round"]]))
                elif "done" in msg:
                    stats[msg["done"]] = msg["messages"]
                elif "restarted" in msg:
                    stats.setdefault("restarted", []).append(msg["restarted"])
    except ChildTimeout as e:
        found.append(Finding("C9", f"the queue hung on a full disk: {e}", scenario, NO_CRASH,
                             ()))
    finally:
        for m in mounts:
            with contextlib.suppress(OSError):
                os.rmdir(m)
    return found, stats, note


def run(backend: Backend, seed: int) -> CheckResult:
    start = time.perf_counter()
    if not backend.takes_root:
        return CheckResult(CHECK, NO_CRASH, Status.UNSUPPORTED,
                           note="the factory takes no directory: nothing on a disk to fill")
    why = namespace_problem()
    if why is not None:
        return CheckResult(CHECK, NO_CRASH, Status.ERROR, note=f"not run: {why}")
    try:
        found, stats, note = _run(backend, seed)
    except _NotRun as e:
        return CheckResult(CHECK, NO_CRASH, Status.ERROR, note=f"not run: {e}")
    return finished(CHECK, NO_CRASH, found, seconds=time.perf_counter() - start, seed=seed,
                    stats=stats, note=note)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    head, _, rest = scenario.partition(":")
    if head != CHECK or not rest.isdigit():
        raise ValueError(f"{scenario!r}: expected {CHECK}:<seed>")
    return run(backend, int(rest)).findings


