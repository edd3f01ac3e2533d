"""Run a workload on a backend in a child process traced by strace; keep the recording.

The child is the process-kill check's kind of child (a fresh interpreter,
``conformance.harness.child_process``) started under ``strace`` with
``strace_trace.STRACE_OPTIONS``.  It opens the queue in an empty directory and runs the
workload through ``crashexplore.workload_driver.Driver``, sending ``{"b": i}`` before
call ``i`` and ``{"a": i, "m": ..., "e": ...}`` (the ids it learnt) once the call
returned: each message is one ``write`` to a pipe, which strace records in order with
the backend's own calls.  That is how a crash point in the trace knows which operations
were acknowledged before it (``Recording.status_at``) without trusting clocks.  The
child ends without closing the queue (a crash is what is tested, not a clean close).

If strace cannot run (missing, or ptrace not permitted), ``BlackBoxUnavailable`` says so
in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from conformance.blackbox.strace_trace import STRACE_OPTIONS, parse_file
from conformance.blackbox.syscall_events import to_events
from conformance.crashexplore.workload_driver import drive_and_report
from conformance.crashexplore.workloads import Workload
from conformance.harness.backend_factory import Backend
from conformance.harness.child_process import Channel, Child
from faultinject.trace import TraceEvent
from spec.model import Call

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


class BlackBoxUnavailable(RuntimeError):
    """strace is missing or cannot trace here."""


@dataclass
class Status:
    """What the child had reported when the first ``position`` events had happened."""

    acked: int = 0  # calls acknowledged (0..acked-1)
    begun: int = -1  # the last call begun
    message_ids: dict[str, int] = field(default_factory=dict)
    entry_keys: dict[str, tuple[int, int]] = field(default_factory=dict)

    def take(self, msg: dict[str, Any]) -> None:
        if "b" in msg:
            self.begun = int(msg["b"])
        elif "a" in msg:
            self.acked = int(msg["a"]) + 1
            self.message_ids.update(msg["m"])
            self.entry_keys.update({k: (v[0], v[1]) for k, v in msg["e"].items()})

    def in_flight(self, workload: Workload) -> Call | None:
        """The call begun and not acknowledged, if any."""
        if self.begun >= self.acked and self.acked < len(workload):
            return workload[self.acked]
        return None


@dataclass
class Recording:
    """One traced run: the seam events of the directory, the markers among them."""

    workload: Workload
    events: list[TraceEvent]
    markers: list[tuple[int, dict[str, Any]]]
    unseen: list[str]
    divergence: tuple[str, str] | None = None
    child_error: str | None = None
    syscalls: int = 0
    root_syscalls: int = 0
    seconds: float = 0.0

    def status_at(self, position: int) -> Status:
        """Acknowledged and begun calls once the first ``position`` events happened."""
        st = Status()
        for pos, msg in self.markers:
            if pos > position:
                break
            st.take(msg)
        return st

    def window(self, call: int) -> tuple[int, int] | None:
        """(position when call ``call`` began, position when it was acknowledged)."""
        begin = next((p for p, m in self.markers if m.get("b") == call), None)
        ack = next((p for p, m in self.markers if m.get("a") == call), None)
        if begin is None or ack is None:
            return None
        return begin, ack


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (strace) goes away."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)


def _traced_child(ch: Channel, backend: Backend, root: str, workload: Workload) -> None:
    """In the traced child: open, run every call, report begin and acknowledgement."""
    _die_with_parent()
    drive_and_report(ch.send, backend.open(root), workload)


def strace_command(output: str) -> list[str]:
    exe = shutil.which("strace")
    if exe is None:
        raise BlackBoxUnavailable("strace is not installed (Debian: apt-get install strace); "
                                  "black-box power loss needs it")
    return [exe, *STRACE_OPTIONS, "-o", output, "--"]


def record(backend: Backend, workload: Workload, *, timeout: float = 300.0) -> Recording:
    """Run ``workload`` on ``backend`` in a child traced by strace (see the module doc)."""
    work = tempfile.mkdtemp(prefix="queue-ref-blackbox-")
    try:
        root = os.path.join(work, "queue")
        os.mkdir(root)
        trace_file = os.path.join(work, "strace.out")
        cmd = strace_command(trace_file)
        t0 = time.perf_counter()
        divergence: tuple[str, str] | None = None
        child_error: str | None = None
        got_any = False
        with Child(_traced_child, backend, root, workload, wrapper=cmd) as child:
            for msg in child.messages(timeout):
                got_any = True
                if "divergence" in msg:
                    divergence = (msg["divergence"], msg["detail"])
                elif "crashed" in msg:
                    child_error = f"{msg['crashed']}\n{msg.get('trace', '')}"
            status = child.wait()
        seconds = time.perf_counter() - t0
        if not os.path.exists(trace_file) or os.path.getsize(trace_file) == 0 or not got_any:
            raise BlackBoxUnavailable(
                f"strace recorded nothing (exit status {status}): is ptrace permitted here "
                "(containers may need CAP_SYS_PTRACE)?")
        calls = parse_file(trace_file)
        events = to_events(calls, root, os.getcwd())
        return Recording(workload, events.events, events.markers, events.unseen, divergence,
                         child_error, events.calls, events.root_calls, seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
