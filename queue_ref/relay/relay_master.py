"""Several relay processes on one queue (``processes = N``): a small Postfix ``master``.

Python runs one thread at a time, so one relay process uses one core.  With
``processes = N`` the master starts N workers, each a whole relay (receiver and scheduler,
``relay_server.Relay(worker=i)``) with its own open queue.  The master listens, accepts
and hands each connection to the worker holding the fewest sessions
(``session_handoff``: SO_REUSEPORT's spread by address hash put five sessions from one
client on one worker in 3 runs of 5).  The
queue's claims are exclusive across processes (C7), so two workers never deliver one entry;
an entry a worker held when it died has a dead owner, and the next scan of any worker
finds it (``find_inflight``) and delivers it.

Before anything listens, the master opens the queue once: recovery runs there.  A backend
that processes cannot share (no ``Capability.MULTI_PROCESS``: the KV queues, whose store
one process holds) needs one root of the queue per process (``queue_directories`` with
two roots for ``processes = 2``): worker i then serves root i alone, under the ids that
root has in the whole queue (``r<i>-``, ``MultiRootQueue(part=i)``), so its logs name
mail as ``mailq`` over every root does.  New mail goes to the root of the worker the
connection was handed to; each worker delivers its own root's mail, and a worker started
again after a death recovers its root.  An ``ETRN`` taken by one worker is passed by the
master to the others, which flush the domain in their roots too.  ODMR (``odmr_listen``,
``ondemand_domains``) needs a domain's mail served from every root by one process, so it
is refused with split roots, as is any other root count, with a message that says how to
fix it (``relay_config.split_roots_problem``, also checked with the configuration).  It
binds the port first (port 0 picks one for all), writes ``relay.pid`` and prints the one
ready line once every worker listens.

Signals to the master: SIGTERM and SIGINT stop every worker in order (each as one relay
stops: 421, deliveries finish or are put back, the queue is closed) and the master exits
0 when they all did; SIGUSR1 and SIGHUP are passed on as SIGUSR1 (look for due mail now).
A worker that dies is logged and started again (after 1 s, doubling to 30 s while it keeps
dying); a worker that cannot start at all stops the start (exit 1, its reason).  Workers
die with the master (``PR_SET_PDEATHSIG``): a killed master leaves no relay behind.

``default_destination_concurrency_limit`` is the whole relay's: each worker takes its
share (``RelayConfig.share``), so a destination sees no more connections than from one
Postfix; ``max_deliveries`` applies per process.
Worker i serves its metrics on the configured port plus i (port 0: each its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import multiprocessing as mp
import os
import resource
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import IO, Any

import setproctitle

from queue_ref.opener import (
    open_queues,
    open_serving,
    relay_on_any,
    remove_relay_pid,
    write_relay_pid,
)
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.relay_config import (
    ConfigError,
    RelayConfig,
    loop_kind,
    run_relay,
    split_roots_problem,
)
from queue_ref.relay.relay_server import Relay, RelayStartError, woken
from queue_ref.relay.session_handoff import Dispatcher, channel_pair
from queue_ref.storage import Capability

__all__ = ["RelayMaster"]

START_TIMEOUT = 120.0  # for every worker to open the queue and listen
PENDING_RETRY = 0.02  # s: a connection no worker could take is tried again after this
_PR_SET_PDEATHSIG = 1


class _ReadyPipe:
    """The worker's ready stream: the ready line goes to the master, not to stdout."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self._conn.send(("ready", self._buf.strip()))
            self._buf = ""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the master's SIGTERM is the only way workers stop
    if os.getppid() == 1:  # the master died before the line above
        os._exit(1)


#: A worker's exit status when its channel from the master failed or closed while the
#: master did not stop it: logged "worker died" (exit 0 is a clean stop of its own).
CHANNEL_LOST = 3


def process_title(config: RelayConfig, role: str, root: int | None = None) -> str:
    """What ``ps`` shows for a relay process (as Postfix's show ``master``, ``qmgr``,
    ``smtpd``): the role, and the queue it serves (``root``: that root of it alone)."""
    roots = config.queue_roots()
    queue = " --queue ".join(roots if root is None else [roots[root]])
    return f"queue-ref relay: {role} --queue {queue}"


def _worker_main(config: RelayConfig, index: int, conn: Connection,
                 handoff: socket.socket, part: bool = False) -> None:
    _die_with_parent()
    # a worker started by spawn would show as "python -c from multiprocessing.spawn ..."
    setproctitle.setproctitle(process_title(  # numbered as the log's ``worker`` field
        config, f"worker {index} of {config.processes}", index if part else None))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches the master
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    relay = Relay(config, worker=index, ready_stream=_ReadyPipe(conn),  # type: ignore[arg-type]
                  handoff=handoff, part=index if part else None)
    try:
        run_relay(config, relay.run())
    except (RelayStartError, ConfigError) as e:
        conn.send(("error", str(e)))
        sys.exit(1)
    sys.exit(CHANNEL_LOST if relay.channel_lost else 0)


@dataclasses.dataclass
class _Worker:
    index: int
    proc: Any = None  # multiprocessing.Process (spawn context)
    conn: Connection | None = None
    ready: str = ""
    started: float = 0.0
    restart_at: float = 0.0
    backoff: float = 1.0


#: the most descriptors the master asks for (``_raise_descriptor_limit``)
DESCRIPTOR_LIMIT = 1 << 16


def _raise_descriptor_limit() -> None:
    """The soft limit of open descriptors raised to the hard one (at most
    ``DESCRIPTOR_LIMIT``): the master holds a copy of each connection it handed over until
    the worker reports on it, some 280 for each stalled worker's channel, and its
    workers (which inherit the limit) one per session."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = DESCRIPTOR_LIMIT if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTOR_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class RelayMaster:
    def __init__(self, config: RelayConfig, *, out: IO[str] | None = None) -> None:
        self.config = config
        self.queue_dirs = config.queue_roots()  # every root of the queue
        self.queue_dir = ",".join(self.queue_dirs)  # as logs name it
        self.out = out or sys.stdout
        self.log = DeliveryLog(config.log_json, config.log_file)
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(i) for i in range(config.processes)]
        self._sock: socket.socket | None = None
        self._dispatch = Dispatcher()
        #: an accepted connection no worker could take yet: while it waits, the master
        #: accepts no more (the kernel's accept queue holds them)
        self._pending: socket.socket | None = None
        self._pending_wait = PENDING_RETRY  # until it is tried again: doubles to 0.5 s
        self._stop = False
        self._wake = 0  # the signal that asked for a wake-up, not yet passed on
        self._wrote_pid = False
        self.worker_config = config
        #: each worker serves root ``index`` of the queue alone (a backend processes
        #: cannot share, ``_split_roots``); False: every worker serves the whole queue
        self.parts = False

    # ---- start ----

    def _check_queue(self) -> None:
        other = relay_on_any(self.queue_dirs)
        if other is not None:  # one relay per set of roots: none may share one
            raise RelayStartError(f"another relay (pid {other[0]}) works on {other[1]}")
        try:  # a recovery left to run beside the queue is each worker's (before it lists)
            if len(self.queue_dirs) == 1:
                store, _ = open_serving(self.queue_dirs[0], self.config.backend)
            else:
                store = open_queues(self.queue_dirs, self.config.backend)
        except Exception as e:
            raise RelayStartError(f"cannot open the queue {self.queue_dir} "
                                  f"(backend {self.config.backend}): {e}") from e
        try:
            if Capability.MULTI_PROCESS not in store.capabilities:
                self._split_roots()
        finally:
            store.close()

    def _split_roots(self) -> None:
        """A backend processes cannot share: each worker serves one root of the queue (as
        many roots as processes), or the start is refused, saying how to fix it."""
        c = self.config
        problem = split_roots_problem(c.backend, c.processes, len(self.queue_dirs),
                                      bool(c.odmr_listen), bool(c.ondemand_domains))
        if problem is not None:
            raise RelayStartError(problem)
        self.parts = True

    def _reserve_port(self) -> None:
        """Bind the address (port 0: the port the workers' Received headers and logs
        name); the master listens on it once every worker is ready."""
        host, port = self.config.listen_address()
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise RelayStartError(f"cannot listen on {host}:{port}: {e}") from e
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise RelayStartError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        self._sock = sock
        bound = sock.getsockname()
        listen = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        self.worker_config = dataclasses.replace(self.config, listen=listen)

    def _write_pid(self) -> None:
        for d in self.queue_dirs:
            write_relay_pid(d)
        self._wrote_pid = True

    def _remove_pid(self) -> None:
        if self._wrote_pid:
            for d in self.queue_dirs:
                remove_relay_pid(d)
            self._wrote_pid = False

    def _spawn(self, w: _Worker) -> int:
        parent, child = self._ctx.Pipe(duplex=False)
        mine, theirs = channel_pair()
        w.proc = self._ctx.Process(target=_worker_main,
                                   args=(self.worker_config, w.index, child, theirs,
                                         self.parts),
                                   name=f"queue-ref-relay-{w.index}", daemon=False)
        try:
            w.proc.start()
        finally:
            child.close()
            theirs.close()
        self._dispatch.attach(w.index, mine)
        w.conn, w.ready, w.started = parent, "", time.monotonic()
        return int(w.proc.pid)

    def _poll_worker(self, w: _Worker) -> str | None:
        """Read what the worker said; its start error if it gave one."""
        while w.conn is not None and w.conn.poll():
            try:
                kind, text = w.conn.recv()
            except (EOFError, OSError):
                w.conn.close()
                w.conn = None
                break
            if kind == "ready":
                w.ready = text
                self._dispatch.set_ready(w.index)
            else:
                return str(text)
        return None

    def _start_all(self) -> None:
        for w in self._workers:
            self._spawn(w)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(w.ready for w in self._workers):
            if self._stop:
                raise RelayStartError("stopped before every worker was ready")
            for w in self._workers:
                error = self._poll_worker(w)
                if error is not None:
                    raise RelayStartError(f"worker {w.index}: {error}")
                if not w.ready and not w.proc.is_alive():
                    raise RelayStartError(f"worker {w.index} exited ({w.proc.exitcode}) "
                                          f"before it was ready")
            if time.monotonic() > deadline:
                raise RelayStartError(f"the workers were not ready within {START_TIMEOUT:.0f} s")
            wait([w.conn for w in self._workers if w.conn is not None and not w.ready]
                 + [w.proc.sentinel for w in self._workers if not w.ready], timeout=0.2)

    def ready_line(self) -> str:
        bound = self.worker_config.listen
        metrics = [f.split("=", 1)[1] for w in self._workers for f in w.ready.split()
                   if f.startswith("metrics=")]
        line = (f"queue-ref relay ready: smtp={bound.replace('[', '').replace(']', '')} "
                f"queue={self.queue_dir} backend={self.config.backend} pid={os.getpid()} "
                f"processes={len(self._workers)} loop={loop_kind(self.config)}")
        if metrics:
            line += f" metrics={','.join(metrics)}"
        return line

    # ---- run ----

    def _on_stop(self, signum: int, frame: object) -> None:
        self._stop = True

    def _on_wake(self, signum: int, frame: object) -> None:
        self._wake = signum

    def run(self) -> int:
        """Start the workers, say ready, supervise until SIGTERM or SIGINT; the exit code."""
        old = {sig: signal.signal(sig, h) for sig, h in (
            (signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop),
            (signal.SIGUSR1, self._on_wake), (signal.SIGHUP, self._on_wake))}
        try:
            setproctitle.setproctitle(process_title(self.config, "master"))
            _raise_descriptor_limit()
            self._check_queue()
            self._reserve_port()
            self._write_pid()
            try:
                self._start_all()
            except RelayStartError:
                self._stop_all()
                raise
            for line in self.config.warnings():
                self.log.emit("warning", what=line)
            self.log.emit("relay", what="started", processes=len(self._workers),
                          smtp=self.worker_config.listen, queue=self.queue_dir,
                          backend=self.config.backend)
            assert self._sock is not None
            self._sock.listen(socket.SOMAXCONN)
            self._sock.setblocking(False)
            self.out.write(self.ready_line() + "\n")
            self.out.flush()
            self._supervise()
            return self._stop_all()
        finally:
            self._remove_pid()
            if self._sock is not None:
                self._sock.close()
            for sig, h in old.items():
                signal.signal(sig, h)
            self.log.close()

    def _supervise(self) -> None:
        while not self._stop:
            if self._wake:
                woken(self.log, signal.Signals(self._wake))
                self._wake = 0
                self._signal_all(signal.SIGUSR1)
            now = time.monotonic()
            for w in self._workers:
                self._poll_worker(w)
                if w.proc is not None and not w.proc.is_alive():
                    code = w.proc.exitcode
                    w.proc.join()
                    if w.conn is not None:
                        w.conn.close()
                        w.conn = None
                    self._dispatch.drop(w.index)
                    self._log_handed_on()
                    if now - w.started > 60:  # it ran a while: not a crash loop
                        w.backoff = 1.0
                    w.proc, w.restart_at = None, now + w.backoff
                    # exit 0: it stopped cleanly (an operator's SIGTERM to the worker
                    # alone); else it died (a signal, exit=-N; its channel lost,
                    # CHANNEL_LOST; an error)
                    self.log.emit("relay", what="worker stopped" if code == 0
                                  else "worker died", worker=w.index, exit=code,
                                  restart_in=w.backoff)
                    w.backoff = min(w.backoff * 2, 30.0)
                if w.proc is None and now >= w.restart_at:
                    pid = self._spawn(w)
                    self.log.emit("relay", what="worker restarted", worker=w.index, worker_pid=pid)
            waits: list[Any] = [w.proc.sentinel for w in self._workers if w.proc is not None]
            waits += [w.conn for w in self._workers if w.conn is not None and not w.ready]
            waits += self._dispatch.sockets()
            waiting = self._pending is not None or bool(self._dispatch.orphans)
            ready = self._dispatch.any_ready()
            if self._sock is not None and not waiting and ready:
                waits.append(self._sock)
            # a signal handler runs in between; a waiting connection is tried again soon,
            # then less often while every channel stays full (stalled workers)
            wait(waits, timeout=self._pending_wait if waiting and ready else 0.5)
            excess = self._dispatch.read_reports()  # sessions ended, before new ones
            self._log_handed_on()
            if excess:
                self.log.emit("error", what="counting sessions",
                              reason=f"workers reported {excess} more ended sessions than "
                                     f"they were handed")
            for index, domain in self._dispatch.unsent_etrn:
                self.log.emit("error", what="passing on an ETRN", worker=index, domain=domain,
                              reason="its channel is full or closed: its mail for the "
                                     "domain goes at its own time")
            self._dispatch.unsent_etrn.clear()
            if self._dispatch.any_ready():
                self._accept()

    def _log_handed_on(self) -> None:
        for index, count, why in self._dispatch.handed_on:
            self.log.emit("relay", what="connections handed on", worker=index,
                          connections=count, reason=why)
        self._dispatch.handed_on.clear()

    def _accept(self) -> None:
        """Hand the connection that waits, then those a worker died before it took
        (``Dispatcher.orphans``), then every one the kernel holds, to the workers
        (``session_handoff``); one no worker can take now waits."""
        assert self._sock is not None
        for _ in range(256):
            conn = self._pending
            if conn is None and self._dispatch.orphans:
                conn = self._dispatch.orphans.popleft()
            if conn is None:
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self.log.emit("error", what="accepting a connection",
                                      reason=e.strerror or str(e))
                        time.sleep(0.1)  # the accept queue keeps them meanwhile
                        return
                    continue  # that connection's own failure (ECONNABORTED...)
            if not self._dispatch.dispatch(conn):
                if self._pending is conn:
                    self._pending_wait = min(self._pending_wait * 2, 0.5)
                self._pending = conn  # every worker's channel is full
                return
            self._pending, self._pending_wait = None, PENDING_RETRY
            conn.close()  # the worker has its own descriptor

    def _signal_all(self, sig: int) -> None:
        for w in self._workers:
            if w.proc is not None and w.proc.is_alive() and w.proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, sig)

    def _stop_all(self) -> int:
        """SIGTERM every worker and wait; 0 when all stopped cleanly."""
        if self._sock is not None:  # no new connections
            self._sock.close()
            self._sock = None
        if self._pending is not None:
            self._pending.close()
            self._pending = None
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout + 30
        code = 0
        for w in self._workers:
            if w.proc is None:
                continue
            while w.proc.is_alive() and time.monotonic() < deadline:
                w.proc.join(0.1)
                # what the stopping workers say they took: the master's copies go, and
                # each session's client sees its end when the worker closes it
                self._dispatch.read_reports()
            if w.proc.is_alive():
                self.log.emit("error", what="stopping", reason=f"worker {w.index} did not stop "
                              f"in time: killed (its entries are found by the next start)")
                w.proc.kill()
                w.proc.join()
                code = 1
            elif w.proc.exitcode != 0:
                code = 1
            if w.conn is not None:
                w.conn.close()
            self._dispatch.drop(w.index)
        self._dispatch.close()  # what no stopping worker took: no worker will answer it
        self.log.emit("relay", what="stopped", processes=len(self._workers))
        return code
