"""Child processes that run part of a check and talk to the parent over pipes.

The child runs ``target(channel, *args)``: ``channel.send(dict)`` writes one JSON line
to the parent (one ``write`` of less than PIPE_BUF bytes, so a message is whole in the
pipe or absent when the child is killed), ``channel.recv()`` waits for a line from the
parent.

How the child starts:

* *fresh*: a new interpreter (``python -m conformance.harness.child_process``) that unpickles the target
  and its arguments.  Used whenever they pickle (a factory named by module and
  attribute).  The child inherits no threads and no library state: a backend whose
  native library keeps background threads (LevelDB's compaction thread) works in it,
  where it would hang in a forked copy of a parent that already opened it.
* *forked*: ``os.fork``, when the target or its arguments do not pickle (a factory
  defined inside a test function).  The child runs the very objects the parent holds.

Either way the child ends with ``os._exit`` and never returns into the parent's code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: Children started and not yet reaped (``kill_all`` ends them when a run must stop).
_LIVE: set[Child] = set()


def kill_all() -> int:
    """SIGKILL every child still running (with what a wrapper command started under it)
    and reap it; the number killed.  For a run that must end now (a hung check)."""
    live = list(_LIVE)
    for child in live:
        child.kill()
    return len(live)


class ChildTimeout(RuntimeError):
    """The child sent nothing for too long (it hangs); it has been killed."""


class Channel:
    """The child's side: ``send`` to the parent, ``recv`` from it."""

    def __init__(self, out_fd: int, in_fd: int) -> None:
        self._out = out_fd
        self._in = in_fd
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        os.write(self._out, (json.dumps(msg, separators=(",", ":")) + "\n").encode())

    def recv(self) -> str:
        """The next line from the parent ("" when the parent closed its end)."""
        while b"\n" not in self._buf:
            data = os.read(self._in, 4096)
            if not data:
                return ""
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()


def _run(target: Callable[..., None], args: tuple[Any, ...], ch: Channel) -> int:
    try:
        target(ch, *args)
        ch.send({"end": True})
        return 0
    except BaseException as e:
        with contextlib.suppress(OSError):
            ch.send({"crashed": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-1500:]})
        return 1


class Child:
    """A child process running ``target(channel, *args)``."""

    def __init__(self, target: Callable[..., None], *args: Any,
                 wrapper: Sequence[str] = ()) -> None:
        """``wrapper``: a command the fresh interpreter is started under (``strace ...``);
        it must exec its last arguments with the descriptors it was given."""
        self.status: int | None = None
        self._buf = b""
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            payload = _frame(pickle.dumps(list(sys.path))) + _frame(pickle.dumps((target, args)))
        except (pickle.PicklingError, AttributeError, TypeError):
            payload = None
        self._group = bool(wrapper)
        if payload is not None:
            self._spawn(payload, wrapper)
        elif wrapper:
            raise ValueError("a child started under a wrapper command needs a target and "
                             "arguments that pickle (a module-level factory)")
        else:
            self._fork(target, args)

    def _spawn(self, payload: bytes, wrapper: Sequence[str] = ()) -> None:
        r, w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [*wrapper, sys.executable, "-m", "conformance.harness.child_process", str(w)],
                stdin=subprocess.PIPE, pass_fds=(w,), close_fds=True,
                # a wrapper (strace) and what it runs are one process group, killed as one
                start_new_session=self._group)
        finally:
            os.close(w)
        assert self._proc.stdin is not None
        self._proc.stdin.write(payload)
        self._proc.stdin.flush()
        self.pid = self._proc.pid
        self._fd = r
        self._ctl = self._proc.stdin.fileno()
        _LIVE.add(self)

    def _fork(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        r, w = os.pipe()
        cr, cw = os.pipe()
        with warnings.catch_warnings():
            # Forking a process that has threads is deprecated in newer Pythons; the
            # fresh mode above is used whenever the target can be pickled.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                os.close(r)
                os.close(cw)
                code = _run(target, args, Channel(w, cr))
            finally:
                os._exit(code)
        os.close(w)
        os.close(cr)
        self.pid = pid
        self._fd = r
        self._ctl = cw
        _LIVE.add(self)

    def tell(self, line: str) -> None:
        """Send one line to the child (what ``channel.recv`` returns there)."""
        with contextlib.suppress(BrokenPipeError):
            os.write(self._ctl, (line + "\n").encode())

    def messages(self, timeout: float = 120.0) -> Iterator[dict[str, Any]]:
        """Messages as they arrive, until the pipe closes (the child ended or died)."""
        while True:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                yield json.loads(line)
            ready, _, _ = select.select([self._fd], [], [], timeout)
            if not ready:
                self.kill()
                raise ChildTimeout(f"child {self.pid} sent nothing for {timeout:.0f} s")
            data = os.read(self._fd, 65536)
            if not data:
                return
            self._buf += data

    def kill(self) -> None:
        """SIGKILL the child (if still there) and reap it."""
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                if self._group:
                    os.killpg(self.pid, signal.SIGKILL)
                else:
                    os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def wait(self) -> int:
        if self.status is None:
            if self._proc is not None:
                self.status = self._proc.wait()
            else:
                _, self.status = os.waitpid(self.pid, 0)
            _LIVE.discard(self)
        return self.status

    def drain(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Every message left, then reap the child."""
        out = list(self.messages(timeout))
        self.wait()
        return out

    def close(self) -> None:
        self.kill()
        for fd in (self._fd, self._ctl):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sleep_precise(seconds: float) -> None:
    """Sleep ``seconds``, spinning for the last millisecond (kill timing matters)."""
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        b = os.read(fd, n)
        if not b:
            raise EOFError("the parent closed the pipe")
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def _main() -> None:  # pragma: no cover - runs in the fresh child
    code = 1
    try:
        out_fd = int(sys.argv[1])
        sys.path[:] = pickle.loads(_read_exact(0, int.from_bytes(_read_exact(0, 8), "big")))
        target, args = pickle.loads(_read_exact(0, int.from_bytes(_read_exact(0, 8), "big")))
        code = _run(target, args, Channel(out_fd, 0))
    finally:
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    # Run the copy of this module that the target's pickles refer to, not ``__main__``.
    from conformance.harness.child_process import _main as main

    main()
