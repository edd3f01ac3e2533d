"""The relay process: one asyncio loop running the SMTP receiver and the scheduler.

Start and stop live here and only here.  ``Relay.add_service(start, stop)`` adds one more
asyncio server (a control socket, say) started after the SMTP listener and stopped before
it closes; ``wake()`` makes the scheduler list the queue and deliver what is due;
``store`` and ``queue_dir`` are the queue the relay works on.

Signals: SIGTERM and SIGINT stop in order (no new connections; sessions get 421 once
their commits are done; deliveries in progress get ``shutdown_timeout`` to finish, the
rest are put back with ``send_cancel`` and their old schedule; the queue is closed; exit
0).  SIGUSR1 (``queue-ref`` operator tools, ``opener.wake_relay``) and SIGHUP wake the
scheduler.  The process id is in ``relay.pid`` in the queue directory while it runs.

A worker (``worker=i``, one of the processes ``relay_master`` starts for ``processes = N``)
is the same relay with three differences: the master owns ``relay.pid`` and the
signals a terminal sends (a worker stops on SIGTERM alone), it does not listen (the master
accepts and hands it connections, ``handoff``: see ``session_handoff``), and its metrics
port is the configured one plus ``i`` (each worker serves its own figures).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

from queue_ref.kv.engine_errors import held_by_another
from queue_ref.multi_root import MultiRootQueue
from queue_ref.opener import (
    open_queues,
    open_serving,
    relay_on_any,
    remove_relay_pid,
    write_relay_pid,
)
from queue_ref.operate.queue_actions import flush
from queue_ref.relay.delivery_log import DeliveryLog, LogStream
from queue_ref.relay.delivery_scheduler import DeliveryScheduler
from queue_ref.relay.mx_routing import Router
from queue_ref.relay.odmr_server import OdmrServer
from queue_ref.relay.ondemand_probe import OndemandProber
from queue_ref.relay.relay_config import RelayConfig, loop_kind, parse_hostport
from queue_ref.relay.relay_control import RelayControl
from queue_ref.relay.relay_host import RelayStartError
from queue_ref.relay.relay_metrics import RelayMetrics
from queue_ref.relay.session_handoff import SessionInbox
from queue_ref.relay.smtp_delivery import SmtpDeliverer
from queue_ref.relay.smtp_receiver import SmtpReceiver
from queue_ref.storage import Capability, EntryMeta, RecoveryReport, Storage

__all__ = ["Relay", "RelayStartError", "woken"]

#: Threads that make storage calls, in each of two pools: one for the SMTP sessions'
#: commits, one for delivery (claims, outcomes, bounces), so that a 250 never waits for a
#: thread behind delivery work (Postfix too keeps smtpd/cleanup apart from qmgr/smtp).
#: Concurrent commits and transitions share group-commit rounds, but each thread also
#: contends for the GIL with the event loop: one pool of 32 relayed about 7% less than
#: one of 8 (4,000 messages, 20 sessions, 2 processes, paired runs).  Two pools of 8
#: against one: commits 19% shorter, 5% more accepted (3,000 messages, 20 sessions,
#: 1 process, 4 paired runs).
STORAGE_THREADS = 8

Service = Callable[["Relay"], Awaitable[None]]



#: Seconds a starting relay waits for a KV store's lock that another process holds (an
#: operator command that opened the stopped queue a moment before).
LOCK_WAIT = 10.0


def woken(log: DeliveryLog, sig: signal.Signals) -> None:
    """The record of a wake-up by signal (the operator tools send SIGUSR1)."""
    log.emit("relay", what="woken", signal=sig.name,
             reason="the queue is listed again and due mail delivered now"
             + ("; the configuration is read at start only: restart the relay to change it"
                if sig == signal.SIGHUP else ""))


class Relay:
    def __init__(self, config: RelayConfig, *, log_stream: LogStream | None = None,
                 ready_stream: IO[str] | None = None, worker: int | None = None,
                 handoff: socket.socket | None = None, part: int | None = None) -> None:
        self.config = config
        self.worker = worker
        #: the one root of the queue this worker serves (``relay_master._split_roots``);
        #: None: every root
        self.part = part
        #: a worker's channel from its master, which accepts its connections
        #: (``session_handoff``); None: the relay listens itself
        self._inbox: SessionInbox | None = None
        self._handoff = handoff
        self.queue_dirs = config.queue_roots()  # every root of the queue
        self.queue_dir = ",".join(self.queue_dirs)  # as logs name it
        if part is not None:  # the root it serves (in MultiRootQueue's order)
            self.queue_dir = sorted(self.queue_dirs)[part]
        self.log = DeliveryLog(config.log_json, config.log_file, log_stream)
        self._ready_stream = ready_stream
        self.executor = ThreadPoolExecutor(STORAGE_THREADS, thread_name_prefix="relay-storage")
        self.receive_executor = ThreadPoolExecutor(STORAGE_THREADS,
                                                   thread_name_prefix="relay-receive")
        self._store: Storage | None = None
        self.scheduler: DeliveryScheduler | None = None
        self.receiver: SmtpReceiver | None = None
        self.deliverer = SmtpDeliverer(config, self.log)
        self.metrics: RelayMetrics | None = None
        self.smtp_address: tuple[str, int] | None = None
        self.metrics_port: int | None = None
        self._server: asyncio.Server | None = None
        self._services: list[tuple[Service, Service]] = []
        self._started_services: list[Service] = []
        self._controls: list[RelayControl] = []  # control sockets (``relay_control``)
        self._scheduler_task: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._wrote_pid = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._recover_beside: Callable[[], RecoveryReport] | None = None
        self._recovering: asyncio.Task[None] | None = None  # see _recover
        self._stopping = False
        #: the channel from the master failed or closed while it ran (a worker exits non-zero)
        self.channel_lost = False
        self._flushing: set[asyncio.Task[None]] = set()  # ETRNs of other workers
        self.reopens = 0  # times the queue was closed and opened again after a failed sync
        #: the ATRN listener (``odmr_listen``), a service of this relay
        self.odmr = OdmrServer(self) if config.odmr_listen else None
        #: probes of ``ondemand_domains``, a service of this relay
        self.prober = OndemandProber(self) if config.ondemand_domains else None

    @property
    def store(self) -> Storage:
        if self._store is None:
            raise RuntimeError("the relay has not started")
        return self._store

    def add_service(self, start: Service, stop: Service) -> None:
        """Run ``start(relay)`` after the SMTP listener is up, ``stop(relay)`` at shutdown
        (before sessions are closed and the queue is)."""
        self._services.append((start, stop))

    def wake(self) -> None:
        if self.scheduler is not None:
            self.scheduler.wake()

    def _woken(self, sig: signal.Signals) -> None:
        if self.worker is None:  # a worker's wake-ups come from its master, which says so
            woken(self.log, sig)
        self.wake()

    def request_stop(self) -> None:
        if self._stop_requested is not None:
            self._stop_requested.set()

    # ---- start ----

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        other = relay_on_any(self.queue_dirs) if self.worker is None else None
        if other is not None:  # one relay per set of roots: none may share one
            raise RelayStartError(f"another relay (pid {other[0]}) works on {other[1]}")
        deadline = loop.time() + LOCK_WAIT
        while True:
            try:
                if len(self.queue_dirs) == 1 and self.part is None:
                    # a filesystem queue's recovery may come later
                    self._store, self._recover_beside = await loop.run_in_executor(
                        self.executor, open_serving, self.queue_dirs[0], self.config.backend)
                else:
                    self._store = await loop.run_in_executor(self.executor, self._open)
                break
            except Exception as e:
                if held_by_another(e) and loop.time() < deadline:
                    # an operator command opened the stopped store a moment ago: it ends
                    await asyncio.sleep(0.2)
                    continue
                raise RelayStartError(f"cannot open the queue {self.queue_dir} "
                                      f"(backend {self.config.backend}): {e}") from e
        try:
            await self._start_parts(loop)
        except BaseException:
            await self.stop()
            raise

    async def _start_parts(self, loop: asyncio.AbstractEventLoop) -> None:
        store = self.store
        self._loop = loop
        if self.worker is None:
            self._write_pid()
        self.metrics = RelayMetrics(store, self._sizes, self._body_bytes)
        self.scheduler = self._new_scheduler(store)
        self.receiver = SmtpReceiver(self.config, store, self.receive_executor, self.log,
                                     self.scheduler.add, self._committed, self._etrn)
        self.receiver.on_queue_failed = self._queue_failed
        self.receiver.in_flow = self.scheduler.in_flow
        host, port = self.config.listen_address()
        if self._handoff is not None:  # the master listens and hands connections over
            self._inbox = SessionInbox(
                self._handoff, self.receiver.protocol, self._handoff_failed,
                self._handoff_lost, self._etrn_from_elsewhere if self.part is not None else None)
            self._handoff = None
            self.receiver.on_session_end = self._inbox.ended
            if self.part is not None:  # the other roots' workers flush their share
                self.receiver.etrn_elsewhere = self._pass_etrn
            self._inbox.start(loop)
            self.smtp_address = (host, port)
        else:
            try:
                self._server = await loop.create_server(self.receiver.protocol, host, port)
            except OSError as e:
                raise RelayStartError(
                    f"cannot listen on {host}:{port}: {e.strerror or e}") from e
            sockname = self._server.sockets[0].getsockname()
            self.smtp_address = (sockname[0], sockname[1])
        if self.config.metrics_listen:
            mhost, mport, _ = parse_hostport(self.config.metrics_listen, "metrics_listen", 0)
            if mport and self.worker:
                mport += self.worker
            try:
                self.metrics_port = self.metrics.serve(mhost, mport)
            except OSError as e:
                raise RelayStartError(f"cannot serve metrics on {mhost}:{mport}: {e}") from e
        for start, stop in self._services:
            await start(self)
            self._started_services.append(stop)
        if Capability.MULTI_PROCESS not in self.store.capabilities:
            await self._serve_control(loop)
        # the first listing of the queue runs in the background (after the recovery, when
        # it was left to run beside the open queue): mail is accepted and delivered
        # meanwhile, and its end is logged (relay what="queue listed")
        if self._recover_beside is not None:
            self.scheduler.hold_listing()
            self._recovering = loop.create_task(self._recover(self._recover_beside))
            self._recover_beside = None
        self._scheduler_task = loop.create_task(self.scheduler.run())
        if self.worker is None:  # the master says it once for all its workers
            for line in self.config.warnings():
                self.log.emit("warning", what=line)
        self.log.emit("relay", what="started", smtp=f"{host}:{self.smtp_address[1]}",
                      queue=self.queue_dir, backend=self.config.backend, worker=self.worker)

    async def _recover(self, recover: Callable[[], RecoveryReport]) -> None:
        """Run the queue's recovery beside it (``opener.open_serving``), then let the
        scheduler list the queue."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            report = await loop.run_in_executor(self.executor, recover)
        except Exception as e:  # the listing still adopts what dead owners held
            self.log.emit("error", what="recovering the queue", reason=f"{type(e).__name__}: {e}")
        else:
            self.log.emit("relay", what="queue recovered", seconds=round(loop.time() - started, 3),
                          requeued=report.requeued, cleaned=report.cleaned,
                          quarantined=report.quarantined, lost=len(report.lost))
            for problem in report.problems:
                self.log.emit("warning", what=f"recovery: {problem}")
        finally:
            if self.scheduler is not None:
                self.scheduler.release_listing()

    async def _serve_control(self, loop: asyncio.AbstractEventLoop) -> None:
        """A control socket in each root this process holds (``relay_control``): the
        operator commands reach a queue no other process may open."""
        names = self.store.root_names if isinstance(self.store, MultiRootQueue) \
            else [self.queue_dir]
        for i, root in enumerate(names):
            control = RelayControl(root, functools.partial(self._root_store, i), self.executor,
                                   self._queue_failed, functools.partial(self._in_delivery, root),
                                   self._say_set_aside)
            try:
                await control.start()
            except OSError as e:
                self.log.emit("warning", what=f"no control socket in {root} ({e}): operator "
                                              "commands on the queue wait for the relay to stop")
                continue
            self._controls.append(control)

    def _say_set_aside(self) -> None:
        if self.scheduler is not None:
            self.scheduler.say_set_aside()

    def _in_delivery(self, root: str) -> list[EntryMeta]:
        """The entries of ``root`` this process's delivery jobs hold, under the root's own
        ids (any thread): what ``mailq`` shows in delivery when the store cannot list them
        itself."""
        metas = self.scheduler.in_delivery() if self.scheduler is not None else []
        store = self._store
        if not isinstance(store, MultiRootQueue):
            return metas
        return [own for m in metas if (own := store.own_meta(root, m)) is not None]

    def _root_store(self, index: int) -> Storage | None:
        """The Storage of this process's ``index``-th root, None while it is reopened."""
        store = self._store
        if isinstance(store, MultiRootQueue):
            return store.root_stores()[index]
        return store

    def _new_scheduler(self, store: Storage) -> DeliveryScheduler:
        scheduler = DeliveryScheduler(store, self.config, Router(self.config), self.deliverer,
                                      self.log, self.executor, self.metrics)
        scheduler.on_queue_failed = self._queue_failed
        if self.prober is not None:
            scheduler.probing, scheduler.on_parked = self.prober.waiting, self.prober.parked
        return scheduler

    # ---- reopening the queue after a failed sync ----

    def _handoff_failed(self, e: BaseException) -> None:
        """A connection from the master could not become a session."""
        self.log.emit("error", what="taking a connection from the master",
                      reason=f"{type(e).__name__}: {e}")

    def _handoff_lost(self, e: BaseException | None) -> None:
        """The channel from the master failed or closed: no connection will come, so
        this worker stops (the master starts another, or has stopped)."""
        if self._stopping:
            return
        self.log.emit("error", what="the channel from the master",
                      reason=(f"{type(e).__name__}: {e}" if e is not None else "closed")
                      + ": stopping")
        self.channel_lost = True  # the worker exits CHANNEL_LOST: a failure, not a stop
        self.request_stop()

    def _queue_failed(self, e: BaseException) -> None:
        """A queue call raised ReopenRequiredError (from any thread): reopen, once."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._start_reopen, str(e))

    def _start_reopen(self, reason: str) -> None:
        if self._reopening is None and not self._stopping and self._store is not None:
            self._reopening = asyncio.get_running_loop().create_task(self._reopen(reason))

    async def _reopen(self, reason: str) -> None:
        """Postgres's answer to fsyncgate, without the process restart: stop delivering,
        close the queue, open it again (recovery reads what the disk really holds and puts
        back what this relay had claimed), deliver again.  The listener stays; commits
        meanwhile fail on the closed queue and are answered 451.  Opening is retried with
        a growing pause while it fails."""
        loop = asyncio.get_running_loop()
        self.log.emit("relay", what="reopening the queue", reason=reason)
        try:
            assert self.scheduler is not None and self.receiver is not None
            await self.scheduler.stop(self.config.shutdown_timeout)
            if self._scheduler_task is not None:
                self._scheduler_task.cancel()
                await asyncio.gather(self._scheduler_task, return_exceptions=True)
                self._scheduler_task = None
            old, self._store = self._store, None
            if old is not None:
                try:
                    await loop.run_in_executor(self.executor, old.close)
                except Exception as e:
                    self.log.emit("error", what="closing the failed queue", reason=str(e))
            pause = 1.0
            while True:
                try:
                    store = await loop.run_in_executor(self.executor, self._open)
                    break
                except Exception as e:
                    self.log.emit("error", what="reopening the queue",
                                  reason=f"{type(e).__name__}: {e}", retry_in=pause)
                    until = loop.time() + pause
                    while loop.time() < until:
                        if self._stopping:
                            return
                        await asyncio.sleep(0.1)
                    pause = min(pause * 2, 30.0)
            if self._stopping:
                await loop.run_in_executor(self.executor, store.close)
                return
            self._store = store
            self.scheduler = self._new_scheduler(store)
            self.receiver.store = store
            self.receiver.on_queued = self.scheduler.add
            self.receiver.in_flow = self.scheduler.in_flow
            if self.metrics is not None:
                self.metrics.follow(store)
            self._scheduler_task = loop.create_task(self.scheduler.run())
            self.reopens += 1
            self.log.emit("relay", what="reopened the queue", reopens=self.reopens)
        finally:
            self._reopening = None

    def _open(self) -> Storage:
        return open_queues(self.queue_dirs, self.config.backend, part=self.part)

    def _pass_etrn(self, domain: str) -> bool:
        """Ask the workers serving the other roots to flush ``domain`` too."""
        if self._inbox is not None and self._inbox.send_etrn(domain):
            return True
        self.log.emit("error", what="passing on an ETRN", domain=domain,
                      reason="the channel to the master is full or closed: the other "
                             "roots' mail for the domain goes at its own time")
        return False

    def _etrn_from_elsewhere(self, domain: str) -> None:
        """Another worker took an ETRN for ``domain``: flush it in this worker's root."""
        task = asyncio.get_running_loop().create_task(self._flush_for_another(domain))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush_for_another(self, domain: str) -> None:
        if self._stopping:
            return
        if self._store is None:  # being reopened after a failed sync
            self.log.emit("error", what="etrn from another process", domain=domain,
                          reason="the queue is being reopened: its mail for the domain "
                                 "goes at its own time")
            return
        try:
            res = await asyncio.get_running_loop().run_in_executor(
                self.executor, flush, self._store, domain)
        except Exception as e:
            self.log.emit("error", what="etrn from another process", domain=domain,
                          reason=f"{type(e).__name__}: {e}")
            return
        if (res.changed or res.skipped) and self.scheduler is not None:
            self.scheduler.wake()

    def _etrn(self, domain: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.etrn.labels(outcome).inc()
        if self.prober is not None and outcome != "failed":
            self.prober.reachable(domain)
        if outcome == "started" and self.scheduler is not None:
            self.scheduler.wake()

    def _committed(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.commit_seconds.observe(seconds)
            self.metrics.received.inc()

    def _sizes(self) -> dict[str, int]:
        return self.scheduler.sizes() if self.scheduler is not None else {}

    def _body_bytes(self) -> int:
        return self.scheduler.body_bytes if self.scheduler is not None else 0

    def _write_pid(self) -> None:
        for d in self.queue_dirs:
            write_relay_pid(d)
        self._wrote_pid = True

    def _remove_pid(self) -> None:
        if self._wrote_pid:
            for d in self.queue_dirs:
                remove_relay_pid(d)
            self._wrote_pid = False

    def ready_line(self) -> str:
        assert self.smtp_address is not None
        line = (f"queue-ref relay ready: smtp={self.smtp_address[0]}:{self.smtp_address[1]} "
                f"queue={self.queue_dir} backend={self.config.backend} pid={os.getpid()} "
                f"loop={loop_kind(self.config)}")
        if self.metrics_port is not None:
            line += f" metrics={self.metrics_port}"
        if self.odmr is not None and self.odmr.address is not None:
            line += f" odmr={self.odmr.address[0]}:{self.odmr.address[1]}"
        return line

    # ---- stop ----

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = True
        if self._reopening is not None:
            await asyncio.gather(self._reopening, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        if self._inbox is not None:  # what the master handed over gets the 421 too
            self._inbox.drain()
        for control in self._controls:  # no operator call starts from now on
            await control.close()
        self._controls = []
        for stop in reversed(self._started_services):
            try:
                await stop(self)
            except Exception as e:
                self.log.emit("error", what="stopping a service", reason=str(e))
        self._started_services = []
        if self.receiver is not None:
            await self.receiver.close_sessions(self.config.shutdown_timeout)
        if self._flushing:  # ETRNs of other workers: their flush runs on the queue
            await asyncio.gather(*list(self._flushing), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self.scheduler is not None:
            await self.scheduler.stop(self.config.shutdown_timeout)
        if self._scheduler_task is not None:
            self._scheduler_task.cancel()
            await asyncio.gather(self._scheduler_task, return_exceptions=True)
            self._scheduler_task = None
        if self._recovering is not None:  # its thread ends by itself (executor shutdown)
            self._recovering.cancel()
            await asyncio.gather(self._recovering, return_exceptions=True)
            self._recovering = None
        await self.deliverer.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self._store is not None:
            await loop.run_in_executor(self.executor, self._store.close)
            self._store = None
        self._remove_pid()
        self.executor.shutdown(wait=True)
        self.receive_executor.shutdown(wait=True)
        self.log.emit("relay", what="stopped")
        self.log.close()

    # ---- the process ----

    async def run(self) -> None:
        """Start, say ready, serve until SIGTERM or SIGINT, stop in order."""
        loop = asyncio.get_running_loop()
        await self.start()
        assert self._stop_requested is not None
        handlers: dict[signal.Signals, Callable[[], object]] = {
            signal.SIGTERM: self.request_stop, signal.SIGINT: self.request_stop,
            signal.SIGUSR1: functools.partial(self._woken, signal.SIGUSR1),
            signal.SIGHUP: functools.partial(self._woken, signal.SIGHUP)}
        if self.worker is not None:  # the master stops its workers with SIGTERM
            del handlers[signal.SIGINT], handlers[signal.SIGHUP]
        for sig, fn in handlers.items():
            loop.add_signal_handler(sig, fn)
        try:
            out = self._ready_stream or sys.stdout
            out.write(self.ready_line() + "\n")
            out.flush()
            await self._stop_requested.wait()
        finally:
            for sig in handlers:
                loop.remove_signal_handler(sig)
            await self.stop()
