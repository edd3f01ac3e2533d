"""The delivery scheduler (Postfix's qmgr): due entries in, outcomes out.

The scheduler keeps the queued entries it knows in a heap ordered by due time.  It learns
of entries from the receiver (the handles ``commit`` returned: a new message is taken at
once), from its own ``send_cancel`` calls, and from a full listing (``list_queue``) at
start, on ``wake()`` (SIGUSR1, operator tools) and every ``queue_scan_interval`` (as
Postfix's qmgr scans its deferred queue).  Between those it sleeps until the earliest due
time: it never polls the queue.

The heap is a bounded window (Postfix's active queue, ``qmgr_message_active_limit``): a
listing runs in a storage thread while delivery goes on and keeps only the earliest due
entries; when it left some in the queue, the queue is listed again once they are due and
the window holds none due before them (or is half empty).  The end of the first listing
is logged (``relay what="queue listed"``); the relay does not wait for it to take mail.

A *job* is one message's due entries: claimed with ``send_start`` (one storage thread hop
for all of them), the body read once, the recipients grouped by domain, each group sent
in one SMTP transaction under a per-destination and a global concurrency limit, then
every outcome finished in one more hop:

* 2xx: ``send_done`` and ``cleanup``;
* 4xx or no connection: ``send_cancel`` with the next retry time (``retry_backoff``),
  unless the message is older than its lifetime: then it is bounced;
* 5xx: a bounce.

A job's transitions are made in one ``send_finish`` (C15): a message to a hundred
recipients pays one durable step for its outcomes, not a hundred.

A bounce is enqueued and committed *before* its failed entries are finished, so a crash in
between can duplicate a bounce but never lose one.  If the bounce cannot be built or
committed, the failed entries go back to the queue instead (tried again later, never lost).

Mail for an ATRN domain (``atrn_domains``), and for an on-demand domain
(``ondemand_domains``) while its probe is due, is deferred without a connection; the
deferred entries of both are put back due at the end of their lifetime, not at a retry
time (``odmr_server`` and ``ondemand_probe`` make them due or take them).  ``run_job``
runs a job whose delivery is given (ATRN's turned connection), claimed and finished here.

Nothing a job claims stays claimed.  An unexpected error at any step (routing, the SMTP
client, building a bounce, a backend call that raises what it should not) is logged with
the message's queue id (``error``, ``what=delivery job: STEP``), counted
(``queue_ref_relay_job_errors``), and the entries it concerns are deferred like a failed
attempt: back in the queue with the next retry time, so the queue lifetime still ends
them with a bounce.  A transition that cannot be made at all (its call keeps failing) is
remembered and tried again at every scan of the queue (``queue_scan_interval``, or a
wake), so an entry is never left inflight until a restart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.dsn_bounce import (
    FailedRecipient,
    build_dsn,
    dsn_params,
    needs_smtputf8,
    original_looked_at,
)
from queue_ref.relay.mx_routing import Router
from queue_ref.relay.queued_body import QueuedBody, read_piece, storage_call
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.relay_metrics import RelayMetrics
from queue_ref.relay.retry_backoff import RetryPolicy
from queue_ref.relay.smtp_delivery import RcptResult, SmtpDeliverer
from queue_ref.relay.smtp_wire_body import STREAMED_BODY, BodyStream, BodyUnreadable
from queue_ref.storage import (
    Capability,
    CorruptionError,
    EntryMeta,
    Finished,
    InflightMail,
    PendingCleanupMail,
    QueuedMail,
    QueueError,
    Recipient,
    ReopenRequiredError,
    Schedule,
    Storage,
    StorageIOError,
)

__all__ = ["DeliveryScheduler"]

#: why mail for an ATRN domain (``atrn_domains``) is deferred whenever a scan finds it due
ATRN_WAIT = "on-demand domain: waiting for its client to connect and say ATRN"
#: why mail for an on-demand domain (``ondemand_domains``) is deferred while it is probed
PROBE_WAIT = "on-demand domain: unreachable at its last probe; mail waits for the next"
#: Message ids ``add(..., wire_ready=True)`` keeps for the jobs that claim them.
WIRE_READY_KEPT = 4096
FINISH_RETRIES = (0.2, 1.0, 3.0)  # waits between tries of a transition that hit an I/O error
#: A body bigger than this, claimed while its destination is behind, is read only once
#: its job's delivery has a slot (``_body``), and a job waiting for a slot lets go of one
#: it holds (unless another domain of it is on the wire with it): jobs held up behind a
#: slow or hung next hop (up to ``max_deliveries`` of them) do not each hold a whole
#: message in memory.
WAITING_BODY_KEPT = 256 * 1024


def _domain(rcpt: str) -> str:
    """A recipient's domain, lower-cased: what delivery groups, routes and throttles by."""
    return rcpt.rpartition("@")[2].lower()


@dataclass
class _Entry:
    mail: InflightMail
    rcpt: str
    schedule: Schedule
    meta: EntryMeta | None = None  # as the claim read it (``in_delivery``)


@dataclass
class _Job:
    message_id: str
    mail_from: str
    params: dict[str, str]
    #: None while the job let go of it (``WAITING_BODY_KEPT``); read again when needed
    body: bytes | None
    entries: list[_Entry] = field(default_factory=list)
    #: the body goes out as it is (``DeliveryScheduler.add``'s ``wire_ready``)
    wire_ready: bool = False
    #: entry ids whose outcome was handed to the queue (finished, or put back)
    settled: set[str] = field(default_factory=set)
    size: int = 0  # the body's length, also while the job does not hold it
    #: the body was found damaged when read again: the message is quarantined (every
    #: entry of it: none is delivered, put back or bounced from now on)
    damaged: bool = False
    #: entries put back when the body could not be read again (``_unreadable``)
    back: list[QueuedMail] = field(default_factory=list)
    #: the job's domains that hold a delivery slot (and use the body), that wait for one
    sending: int = 0
    waiting: int = 0
    #: the bodies being streamed to the job's domains (``streamed``)
    streams: list[QueuedBody] = field(default_factory=list)
    #: the body was read to its end (its digest checked) by a stream of this job
    verified: bool = False

    def __post_init__(self) -> None:
        if self.body is not None:
            self.size = len(self.body)

    @property
    def streamed(self) -> bool:
        """The body is never held whole: it is read as it goes out (``STREAMED_BODY``)."""
        return self.size > STREAMED_BODY

    def found_damaged(self) -> bool:
        """``damaged``, as another thread may have set it since the caller looked."""
        return self.damaged

    def let_go(self) -> None:
        """Drop a big body while a domain of the job waits for a slot and none holds one
        (none is on the wire with it)."""
        if self.waiting and not self.sending and self.size > WAITING_BODY_KEPT:
            self.body = None

    @property
    def arrival(self) -> float:
        try:
            return float(self.params.get("arrival", ""))
        except ValueError:
            return 0.0


class DeliveryScheduler:
    def __init__(self, store: Storage, config: RelayConfig, router: Router,
                 deliverer: SmtpDeliverer, log: DeliveryLog, executor: Executor,
                 metrics: RelayMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.router = router
        self.deliverer = deliverer
        self.log = log
        self.executor = executor
        self.metrics = metrics
        self.clock = clock
        self.retry = RetryPolicy(config)
        #: Called (from any thread) with the ReopenRequiredError a queue call raised.
        self.on_queue_failed: Callable[[BaseException], None] | None = None
        #: ``ondemand_domains``: whether a domain's mail waits for its probe (the event
        #: loop), and ``on_parked(domain)`` after its mail was deferred (a storage thread)
        self.probing: Callable[[str], bool] | None = None
        self.on_parked: Callable[[str], None] | None = None
        self._heap: list[tuple[int, int, str, QueuedMail]] = []
        self._latest: dict[str, QueuedMail] = {}  # entry id -> the handle to use
        self._claimed: set[str] = set()  # entry ids our jobs hold inflight
        #: messages this process's receiver stored with a body that goes out as it is
        #: (``smtp_line_folding.wire_ready``), taken by the job that claims them; at most
        #: WIRE_READY_KEPT, oldest first out (another process of a shared queue may
        #: deliver a message, and its id is never taken here)
        self._wire_ready: dict[str, None] = {}
        self._wire_ready_lock = threading.Lock()
        self._scanning = False
        #: while a listing runs: entries pushed (and not claimed since), entries claimed
        self._added_in_scan: dict[str, QueuedMail] = {}
        self._taken_in_scan: set[str] = set()
        self._scan_task: asyncio.Task[None] | None = None
        #: The due time from which the last listing kept no entry (the window was full:
        #: more entries were queued than ``qmgr_message_active_limit``), else None.
        self._window_end: int | None = None
        self.listed = 0  # QUEUED entries the last listing found (the window holds the earliest)
        self._seq = itertools.count()
        self._event = asyncio.Event()
        self._rescan = True
        self._may_list = True  # False until release_listing() after hold_listing()
        self.scanned = asyncio.Event()  # set once the first listing of the queue is done
        self._stopping = False
        self._jobs: set[asyncio.Task[None]] = set()
        self._claimed_jobs: dict[int, _Job] = {}  # id -> a job between claim and its end
        self.max_deliveries = config.max_deliveries  # this process's own
        #: this process's part of a destination's limit (``RelayConfig.share``)
        self.destination_limit = config.share(config.default_destination_concurrency_limit)
        self._global = asyncio.Semaphore(self.max_deliveries)
        self._destinations: dict[str, asyncio.Semaphore] = {}
        #: by destination (``Router.destination_of``: a domain's next hop, the relayhost,
        #: else the domain): jobs whose delivery waits for a slot, turns saved (a job got
        #: its slot while no DATA waited), the DATA commands waiting (``in_flow``)
        self._behind: collections.Counter[str] = collections.Counter()
        self._turns: collections.Counter[str] = collections.Counter()
        self._inflow: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self.in_flow_waits = 0  # DATA commands that waited
        self._started = self.clock()
        self.held: int | None = None  # held entries at the last scan (Capability.HOLD)
        self.counts = {"sent": 0, "deferred": 0, "bounced": 0, "expired": 0}
        self.job_errors = 0  # unexpected errors met by delivery jobs
        # transitions that could not be made: (what, call, args), tried again at each scan
        self._unfinished: list[tuple[str, Callable[..., object], tuple[object, ...]]] = []
        self._unfinished_lock = threading.Lock()

    # ---- what others call ----

    def add(self, handles: list[QueuedMail], *, wire_ready: bool = False) -> None:
        """Queued entries to deliver when due (new commits, entries put back).
        ``wire_ready``: the receiver found that their message's stored body goes out as
        it is (``smtp_line_folding.wire_ready``: CRLF line breaks only, no line over the
        limit, no line that starts with a dot), so the delivery sends it with no check
        and no dot-stuffing (about 2 ms per MB)."""
        if wire_ready and handles:
            with self._wire_ready_lock:
                self._wire_ready[handles[0].message_id] = None
                while len(self._wire_ready) > WIRE_READY_KEPT:
                    del self._wire_ready[next(iter(self._wire_ready))]
        for h in handles:
            self._push(h)
        self._event.set()

    @property
    def behind(self) -> int:
        """Jobs whose delivery waits for a slot (each domain of a job counts)."""
        return sum(self._behind.values())

    async def in_flow(self, rcpts: Iterable[str], delay: float) -> None:
        """Wait while delivery to the destination of one of ``rcpts`` (the message's
        recipients) is behind, at most ``delay`` seconds (Postfix's ``in_flow_delay``; the
        receiver, before it takes the data).  A recipient's destination is where its
        domain's mail goes as configured (its transport map entry, else the relayhost:
        every domain sent through one smarthost shares it), else the domain (no DNS is
        asked here).  Behind: a job for the destination waits for a delivery slot (its
        concurrency limit, or ``max_deliveries``), so its mail comes in faster than it
        goes out.  Each such job that gets its slot lets the longest waiting DATA for the
        destination go, or saves the turn for the next one (up to the destination's
        limit), one message in for one out, as Postfix's queue manager hands its cleanup
        processes a token per message it takes; once none waits, every DATA goes.  Mail
        for other destinations never waits.  Mail taken faster
        than it can be sent waits in the queue (the time from 250 to delivery grows)
        and in claimed jobs (which hold no body over ``WAITING_BODY_KEPT`` while they
        wait)."""
        if delay <= 0 or not self._behind:
            return
        # only once mail is behind; not for mail that waits for its client (ATRN) or its
        # probe (on-demand): it takes no delivery slot
        domains = {_domain(r) for r in rcpts} - self.config.atrn_domains.keys()
        destinations = {self.router.destination_of(d) for d in domains
                        if self.probing is None or not self.probing(d)}
        domain = next((d for d in destinations if self._behind[d]), None)
        if domain is None:
            return
        if self._turns[domain]:
            self._turns[domain] -= 1
            return
        self.in_flow_waits += 1
        if self.metrics is not None:
            self.metrics.in_flow_waits.inc()
        turn = asyncio.get_running_loop().create_future()
        waiting = self._inflow.setdefault(domain, collections.deque())
        waiting.append(turn)
        try:
            with contextlib.suppress(TimeoutError):  # waited the whole delay: it goes
                async with asyncio.timeout(delay):
                    await turn  # cancelled with the wait (the timeout, the session gone)
        finally:
            with contextlib.suppress(ValueError):
                waiting.remove(turn)  # gone already if it was let go
            if not waiting and self._inflow.get(domain) is waiting:
                del self._inflow[domain]

    def _is_behind(self, rcpt: str) -> bool:
        """Whether a job for ``rcpt``'s destination waits for a slot now (read from a
        storage thread: a hint, as the answer may change at once)."""
        return self.router is not None and \
            self._behind.get(self.router.destination_of(_domain(rcpt)), 0) > 0

    def _lagging(self, domain: str, n: int) -> None:
        """``n`` more (or fewer) jobs for the destination ``domain`` wait for a slot; one
        fewer lets a waiting DATA go (``in_flow``)."""
        self._behind[domain] += n
        if self._behind[domain] <= 0:
            del self._behind[domain]
            self._turns.pop(domain, None)
        if n > 0:
            return
        waiting = self._inflow.get(domain)
        everyone = domain not in self._behind  # none waits: every DATA goes
        let_go = False
        while waiting and (everyone or not let_go):
            turn = waiting.popleft()
            if not turn.done():  # done: given up (its DATA is leaving)
                turn.set_result(None)
                let_go = True
        if not let_go and not everyone:
            self._turns[domain] = min(self._turns[domain] + 1, self.destination_limit)
        if waiting is not None and not waiting:
            del self._inflow[domain]

    def wake(self) -> None:
        """List the queue again and deliver what is due now (SIGUSR1, operator tools)."""
        self._rescan = True
        self._event.set()

    def hold_listing(self) -> None:
        """List the queue only after ``release_listing`` (a recovery runs beside it
        first); new commits are delivered meanwhile."""
        self._may_list = False

    def release_listing(self) -> None:
        """List the queue now, and from now on as usual."""
        self._may_list = True
        self.wake()

    def sizes(self) -> dict[str, int]:
        """Entries by state: queued and inflight as the scheduler holds them now, held as
        its last scan of the queue found them (backends with Capability.HOLD)."""
        queued = len(self._latest)
        if self._window_end is not None:  # and those the window left in the queue
            queued += max(0, self.listed - self.config.qmgr_message_active_limit)
        out = {"queued": queued, "inflight": len(self._claimed) + self.unfinished()}
        if self.held is not None:
            out["held"] = self.held
        return out

    @property
    def body_bytes(self) -> int:
        """Bytes of message bodies this process's delivery jobs hold in memory now."""
        held = 0
        for j in list(self._claimed_jobs.values()):
            body = j.body  # once: a job may let go of it meanwhile (another thread reads)
            held += len(body) if body is not None else 0
            held += sum(s.held() for s in list(j.streams))
        return held

    def in_delivery(self) -> list[EntryMeta]:
        """The entries this scheduler's jobs hold inflight now, as their claim read them
        (any thread: a copy of the jobs is taken first)."""
        return [e.meta for j in list(self._claimed_jobs.values()) for e in list(j.entries)
                if e.meta is not None]

    def _push(self, h: QueuedMail) -> None:
        if h.entry_id in self._claimed:
            # a job holds the entry (a listing found it before the receiver's handle came):
            # this handle is stale, and the job pushes whatever follows it
            return
        if self._scanning:
            self._added_in_scan[h.entry_id] = h
        self._latest[h.entry_id] = h
        heapq.heappush(self._heap, (h.schedule.at, next(self._seq), h.entry_id, h))

    # ---- the loop ----

    async def run(self) -> None:
        next_scan = 0.0
        try:
            while not self._stopping:
                self._event.clear()
                if self._scan_task is None and self._may_list and (
                        self._rescan or time.monotonic() >= next_scan
                        or self._window_drained()):
                    self._rescan = False
                    self._scan_task = asyncio.get_running_loop().create_task(self._scan())
                    next_scan = time.monotonic() + self.config.queue_scan_interval
                self._dispatch()
                wait = next_scan - time.monotonic()
                if self._heap and len(self._jobs) < self.max_deliveries:
                    wait = min(wait, self._heap[0][0] - self.clock())
                end = self._window_end
                if end is not None and self._scan_task is None and end > self.clock():
                    wait = min(wait, end - self.clock())  # the entries left in the queue
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(wait, 0.01)):  # see ondemand_probe
                            await self._event.wait()
                else:
                    await asyncio.sleep(0)
        finally:
            if self._scan_task is not None:
                self._scan_task.cancel()
                await asyncio.gather(self._scan_task, return_exceptions=True)

    def _window_drained(self) -> bool:
        """Whether the last listing left entries in the queue (the window was full), they
        are due, and the window holds none due before them or is half empty: the next
        are read now."""
        end = self._window_end
        if end is None or self.clock() < end:
            return False
        return (not self._heap or self._heap[0][0] > end
                or len(self._latest) <= self.config.qmgr_message_active_limit // 2)

    async def _scan(self) -> None:
        """List the queue in a storage thread while delivery goes on; then the window is
        the ``qmgr_message_active_limit`` earliest entries listed, with what was added
        meanwhile (less what was claimed meanwhile)."""
        loop = asyncio.get_running_loop()
        self._scanning = True
        self._added_in_scan = {}
        self._taken_in_scan = set()
        try:
            listed, total = await loop.run_in_executor(self.executor, self._list_window)
        except Exception as e:  # logged; the next scan (a wake, the interval) tries again
            if not self._stopping:
                self.log.emit("error", what="list_queue", reason=f"{type(e).__name__}: {e}")
                self._queue_error(e)
            return
        finally:
            self._scanning = False
            self._scan_task = None
            self._event.set()
        taken = self._taken_in_scan | self._claimed
        latest = {h.entry_id: h for h in listed if h.entry_id not in taken}
        latest.update(self._added_in_scan)  # pushed meanwhile and not claimed since
        self._added_in_scan = {}
        self._taken_in_scan = set()
        limit = self.config.qmgr_message_active_limit
        self.listed = total
        self._window_end = max(h.schedule.at for h in listed) if total > limit else None
        self._latest = latest
        self._heap = [(h.schedule.at, next(self._seq), h.entry_id, h) for h in latest.values()]
        heapq.heapify(self._heap)
        if not self.scanned.is_set():
            self.scanned.set()
            self.log.emit("relay", what="queue listed", queued=total, window=len(latest))

    def _list(self) -> list[QueuedMail]:
        """The entries one scan of the queue takes into the window (a storage thread)."""
        return self._list_window()[0]

    def _list_window(self) -> tuple[list[QueuedMail], int]:
        """The ``qmgr_message_active_limit`` earliest due QUEUED entries and how many were
        listed in all, in one pass that keeps no more than those (a bounded heap whose
        top, the latest kept, gives way to each earlier entry found)."""
        limit = self.config.qmgr_message_active_limit
        kept: list[tuple[int, int, QueuedMail]] = []  # due times negated: the latest on top
        seq = itertools.count()
        total = 0

        def keep(h: QueuedMail) -> None:
            nonlocal total
            total += 1
            item = (-h.schedule.at, -next(seq), h)
            if len(kept) < limit:
                heapq.heappush(kept, item)
            elif item > kept[0]:
                heapq.heapreplace(kept, item)

        for h in self._retry_unfinished():
            keep(h)
        for h in self.store.list_queue():
            if self._stopping:
                break
            keep(h)
        if Capability.HOLD in self.store.capabilities:
            self.held = sum(1 for _ in self.store.list_held())
        try:  # entries of other processes of a shared queue that died holding them
            for inflight in self.store.find_inflight():
                queued = self.store.send_cancel(inflight, inflight.schedule)
                if queued is not None:
                    keep(queued)
        except QueueError as e:
            self.log.emit("error", what="find_inflight", reason=str(e))
            self._queue_error(e)
        self.say_set_aside()
        return [h for _, _, h in kept], total

    def say_set_aside(self) -> None:
        """Log what the queue quarantined without raising since it was last asked (a
        listing or a claim that found an entry damaged: ``Storage.set_aside``), one
        ``error`` record each (``what=damaged``): no damage passes in silence (any
        thread)."""
        for x in self.store.set_aside():
            self.log.emit("error", x.message_id, what="damaged", entry_id=x.entry_id,
                          reason=f"set aside: {x.reason}")

    def _dispatch(self) -> None:
        now = self.clock()
        due: dict[str, list[QueuedMail]] = {}
        while self._heap and self._heap[0][0] <= now:
            if self._heap[0][3].message_id not in due and \
                    len(self._jobs) + len(due) >= self.max_deliveries:
                break  # a new job would pass the limit; a message's next entry joins its job
            _, _, entry_id, h = heapq.heappop(self._heap)
            if self._latest.get(entry_id) is not h:
                continue  # superseded by a newer handle, or taken (``_take``)
            self._take(entry_id)
            due.setdefault(h.message_id, []).append(h)
        for message_id, handles in due.items():
            task = asyncio.get_running_loop().create_task(self._job(handles), name=message_id)
            self._jobs.add(task)
            task.add_done_callback(self._job_done)

    def _take(self, entry_id: str) -> None:
        """Claim ``entry_id`` for a job of ours: out of the window (its heap item is
        passed over when popped), and out of what a listing running now brings back."""
        self._latest.pop(entry_id, None)
        self._claimed.add(entry_id)
        if self._scanning:  # the listing may have seen it queued, or it came since
            self._taken_in_scan.add(entry_id)
            self._added_in_scan.pop(entry_id, None)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.log.emit("error", task.get_name(), what="delivery job",
                          reason=f"{type(exc).__name__}: {exc}")
        self._event.set()

    async def stop(self, timeout: float) -> None:
        """Stop taking entries; let jobs finish within ``timeout``; put the rest back."""
        self._stopping = True
        self._event.set()
        if self._jobs:
            self.log.emit("relay", what="stopping", deliveries=len(self._jobs),
                          reason=f"waiting up to {timeout:g} s (shutdown_timeout) for the "
                                 "deliveries in progress")
            _, pending = await asyncio.wait(set(self._jobs), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
                self.log.emit("relay", what="deliveries cut short", deliveries=len(pending),
                              reason="still running at shutdown_timeout; their entries are "
                                     "back in the queue with the schedule they had")

    # ---- one job ----

    async def run_job(self, handles: list[QueuedMail],
                      send: Callable[[str, list[str], bytes | BodyStream, dict[str, str]],
                                     Awaitable[list[RcptResult]]]) -> None:
        """Deliver one message's ``handles`` with ``send(mail_from, rcpts, body, params)``
        (one result per recipient) instead of by route: ATRN, over the connection its
        client opened (``odmr_server``).  Claimed, finished and put back as a scheduled
        job is; entries a job of ours holds already are left out."""
        handles = [h for h in handles if h.entry_id not in self._claimed]
        if not handles:
            return
        for h in handles:  # the window's own handles of these are stale from now on
            self._take(h.entry_id)

        async def over(job: _Job) -> list[tuple[_Entry, RcptResult]]:
            rcpts = [e.rcpt for e in job.entries]
            try:
                if job.streamed and not job.found_damaged():
                    got = await self._stream(job, job.entries, lambda stream: send(
                        job.mail_from, rcpts, stream, job.params))
                    return [] if got is None else list(zip(job.entries, got, strict=True))
                body = await self._body(job, job.entries)
                if body is None:  # quarantined, or back in the queue
                    return []
                results = await send(job.mail_from, rcpts, body, job.params)
                return list(zip(job.entries, results, strict=True))
            except Exception as e:  # CancelledError goes on up, as in _deliver_domain
                self._job_error("deliver", job.message_id, e)
                text = f"internal error in the relay: {type(e).__name__}: {e}"
                return [(en, RcptResult(0, "4.3.0", text, "none")) for en in job.entries]

        await self._job(handles, over)

    async def _job(self, handles: list[QueuedMail],
                   deliver: Callable[[_Job], Awaitable[list[tuple[_Entry, RcptResult]]]]
                   | None = None) -> None:
        loop = asyncio.get_running_loop()
        ids = [h.entry_id for h in handles]
        job: _Job | None = None
        back: list[QueuedMail] = []  # the handles the job queues again, pushed as it ends
        try:
            claim = loop.run_in_executor(self.executor, self._claim, handles)
            try:
                job = await asyncio.shield(claim)
            except asyncio.CancelledError:
                job = await claim
                if job is not None:
                    back = await loop.run_in_executor(self.executor, self._put_back, job)
                raise
            if job is None:
                return
            self._claimed_jobs[id(job)] = job
            try:
                outcomes = await (deliver or self._deliver)(job)
            except asyncio.CancelledError:
                back = await loop.run_in_executor(self.executor, self._put_back, job)
                raise
            finish = loop.run_in_executor(self.executor, self._finish, job, outcomes)
            try:
                back = await asyncio.shield(finish)
            except asyncio.CancelledError:
                back = await finish
                raise
        finally:
            # the entries let go first: a handle pushed while a job holds its entry is
            # stale (``_push``), and these are the ones that follow the job's
            self._claimed.difference_update(ids)
            if job is not None:
                self._claimed_jobs.pop(id(job), None)
                back = back + job.back
            self.add(back)

    def _claim(self, handles: list[QueuedMail]) -> _Job | None:
        """send_start every entry, read the body once (a storage thread; a body over
        ``WAITING_BODY_KEPT`` for a destination that is behind later, with the slot:
        ``_body``)."""
        job: _Job | None = None
        for h in handles:
            try:
                mail = self.store.send_start(h)
            except QueueError as e:
                self.log.emit("error", h.message_id, what="send_start", entry_id=h.entry_id,
                              reason=f"{type(e).__name__}: {e}")
                self._queue_error(e)
                continue
            except Exception as e:  # the claim's outcome is unknown: the scan takes it back
                self._job_error("claim", h.message_id, e, h.entry_id)
                continue
            if mail is None:
                continue  # another worker took it, or an operator changed it
            try:
                with self.store.read_inflight(mail) as reader:
                    meta = reader.meta
                    if job is None:
                        with self._wire_ready_lock:
                            ready = mail.message_id in self._wire_ready
                            self._wire_ready.pop(mail.message_id, None)
                        # a big body for a destination that is behind is read once its
                        # delivery has a slot (``_body``): a job that waits holds none, and
                        # none is read twice; otherwise now, outside the slot; one over
                        # STREAMED_BODY is never held: read as it goes out
                        later = meta.body_size > STREAMED_BODY or (
                            meta.body_size > WAITING_BODY_KEPT and self._is_behind(meta.rcpt))
                        body = None if later else reader.read_all()
                        job = _Job(mail.message_id, meta.mail_from, dict(meta.params), body,
                                   wire_ready=ready, size=meta.body_size)
            except CorruptionError as e:
                self.log.emit("error", mail.message_id, what="read", entry_id=mail.entry_id,
                              reason=f"quarantined: {e}")
                continue
            except Exception as e:
                self._unreadable(mail.message_id, [mail], e, "claim")
                continue
            job.entries.append(_Entry(mail, meta.rcpt, mail.schedule, meta))
        self.say_set_aside()  # a claim that found an entry damaged answers None
        if job is None or not job.entries:
            return None
        if job.arrival < self._started and any(e.schedule.attempts == 0 for e in job.entries):
            # queued before this relay started and never tried: a message committed just
            # before a crash or a stop has no ``received`` line of ours; this is its first
            # (Postfix's qmgr: "from=<...>, size=..., nrcpt=... (queue active)")
            self.log.emit("active", job.message_id, **{"from": job.mail_from},
                          size=job.size, nrcpt=len(job.entries))
        return job

    async def _deliver(self, job: _Job) -> list[tuple[_Entry, RcptResult]]:
        by_domain: dict[str, list[_Entry]] = {}
        for e in job.entries:
            by_domain.setdefault(_domain(e.rcpt), []).append(e)
        groups = await asyncio.gather(*(self._deliver_domain(job, d, es)
                                        for d, es in by_domain.items()))
        return [pair for g in groups for pair in g]

    async def _deliver_domain(self, job: _Job, domain: str, entries: list[_Entry]
                              ) -> list[tuple[_Entry, RcptResult]]:
        """The outcome of each entry; an unexpected error defers them all (logged)."""
        try:
            return await self._send_domain(job, domain, entries)
        except Exception as e:  # CancelledError (a shutdown) is no Exception: it goes on up
            self._job_error("deliver", job.message_id, e)
            text = f"internal error in the relay: {type(e).__name__}: {e}"
            return [(en, RcptResult(0, "4.3.0", text, "none")) for en in entries]

    async def _send_domain(self, job: _Job, domain: str, entries: list[_Entry]
                           ) -> list[tuple[_Entry, RcptResult]]:
        if domain in self.config.atrn_domains:  # no MX: it waits for its client's ATRN
            return [(e, RcptResult(0, "4.4.0", ATRN_WAIT, "none")) for e in entries]
        if self.probing is not None and self.probing(domain):  # the probe, not every entry
            return [(e, RcptResult(0, "4.4.1", PROBE_WAIT, "none")) for e in entries]
        route = await self.router.route(domain)
        if route.failed:
            code = 550 if route.dsn.startswith("5") else 0
            return [(e, RcptResult(code, route.dsn, route.reason, "none")) for e in entries]
        sem = self._destinations.get(route.destination)
        if sem is None:
            sem = asyncio.Semaphore(self.destination_limit)
            self._destinations[route.destination] = sem
        waits = sem.locked() or self._global.locked()
        if waits:
            self._lagging(route.destination, 1)
            job.waiting += 1
            job.let_go()
        try:
            # the destination's slot first: a job waiting for it holds none of the
            # others' (it held one of max_deliveries while it waited)
            async with sem, self._global:
                if waits:
                    waits = False
                    self._lagging(route.destination, -1)
                    job.waiting -= 1
                job.sending += 1
                try:
                    if job.streamed and not job.found_damaged():
                        results = await self._stream(job, entries, lambda stream:
                                                     self.deliverer.deliver(
                            route.hosts, job.mail_from, [e.rcpt for e in entries], stream,
                            job.params, wire_ready=job.wire_ready))
                    else:
                        body = await self._body(job, entries)
                        if body is None:  # quarantined, or back in the queue
                            return []
                        results = await self.deliverer.deliver(
                            route.hosts, job.mail_from, [e.rcpt for e in entries], body,
                            job.params, wire_ready=job.wire_ready)
                    if results is None:  # quarantined, or back in the queue
                        return []
                finally:
                    job.sending -= 1
                    job.let_go()  # another domain of the job waits still
        finally:
            if waits:  # cancelled while it waited
                self._lagging(route.destination, -1)
                job.waiting -= 1
        return list(zip(entries, results, strict=True))

    async def _stream(self, job: _Job, entries: list[_Entry],
                      send: Callable[[BodyStream], Awaitable[list[RcptResult]]]
                      ) -> list[RcptResult] | None:
        """``send`` ``entries``' body read as it goes out (through the first of them); None
        when the queue could not give all of it (nothing was delivered; ``_read_failed``)."""
        stream = QueuedBody(self.store, self.executor, entries[0].mail, job.size)
        job.streams.append(stream)
        try:
            return await send(stream)
        except BodyUnreadable as e:
            cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
            await storage_call(self.executor, self._read_failed, job, entries, cause)
            return None
        finally:
            job.streams.remove(stream)
            job.verified = job.verified or stream.complete

    async def _body(self, job: _Job, entries: list[_Entry]) -> bytes | None:
        """The body to send to ``entries``, read again in a storage thread if the job let
        go of it; None when it cannot be: the message was found damaged (quarantined,
        logged: ``job.damaged``), or the read failed (the entries are back in the queue,
        ``_unreadable``).  A read in progress when the job is cancelled is waited for,
        as a claim is: no storage call of a job outlives it."""
        if job.body is not None or job.damaged:
            return job.body
        return await storage_call(self.executor, self._read_again, job, entries)

    def _read_again(self, job: _Job, entries: list[_Entry]) -> bytes | None:
        """``_body`` in a storage thread."""
        if job.body is not None or job.damaged:  # another domain's read came first
            return job.body
        try:
            with self.store.read_inflight(entries[0].mail) as reader:
                job.body = reader.read_all()
            return job.body
        except Exception as e:
            self._read_failed(job, entries, e)
        return None

    def _read_failed(self, job: _Job, entries: list[_Entry], e: Exception) -> None:
        """The body could not be read for ``entries`` (a storage thread): found damaged,
        the message is quarantined (``job.damaged``, logged once); otherwise the entries go
        back to the queue (``_unreadable``)."""
        if job.found_damaged():  # another domain's read quarantined it meanwhile
            return
        if isinstance(e, CorruptionError):  # the backend quarantined every entry
            job.damaged = True
            self.log.emit("error", job.message_id, what="read",
                          entry_id=entries[0].mail.entry_id, reason=f"quarantined: {e}")
            return
        job.settled.update(x.mail.entry_id for x in entries)
        job.back += self._unreadable(job.message_id, [x.mail for x in entries], e, "read")

    def _unreadable(self, message_id: str, mails: list[InflightMail], e: Exception,
                    step: str) -> list[QueuedMail]:
        """A body or metadata that could not be read (not found damaged): the entries go
        back to the queue, logged.  After a queue error (an I/O error, the queue closed)
        due again in a minute, no attempt counted; after an error no backend should raise,
        as after a failed attempt (``job_errors``).  The handles of the entries put back."""
        if isinstance(e, QueueError):
            self.log.emit("error", message_id, what="read", entry_id=mails[0].entry_id,
                          reason=f"{type(e).__name__}: {e}")
            self._queue_error(e)
        else:
            self._job_error(step, message_id, e, mails[0].entry_id)
        back = []
        for mail in mails:
            schedule = Schedule(int(self.clock()) + 60, mail.schedule.attempts) \
                if isinstance(e, QueueError) else self._retry_schedule(mail.schedule, self.clock())
            queued = self._retrying("send_cancel", self.store.send_cancel, mail, schedule)
            if isinstance(queued, QueuedMail):
                back.append(queued)
        return back

    # ---- outcomes (a storage thread) ----

    def _put_back(self, job: _Job) -> list[QueuedMail]:
        """Shutdown: every entry back in the queue with the schedule it had."""
        out = []
        for e in job.entries:
            if e.mail.entry_id in job.settled:  # put back already (``_unreadable``)
                continue
            queued = self._retrying("send_cancel", self.store.send_cancel, e.mail, e.schedule)
            if isinstance(queued, QueuedMail):
                out.append(queued)
        return out

    def _finish(self, job: _Job, outcomes: list[tuple[_Entry, RcptResult]]) -> list[QueuedMail]:
        """Hand every outcome to the queue; the handles of entries queued again.  Whatever
        raises on the way, the entries not yet handed over go back to the queue."""
        requeued: list[QueuedMail] = []
        try:
            self._settle(job, outcomes, requeued)
        except Exception as e:
            self._job_error("finish", job.message_id, e)
            requeued.extend(self._return_unsettled(job, e))
        return requeued

    def _settle(self, job: _Job, outcomes: list[tuple[_Entry, RcptResult]],
                requeued: list[QueuedMail]) -> None:
        now = self.clock()
        arrival = job.arrival or self._started
        null_sender = not job.mail_from
        done: list[tuple[_Entry, RcptResult, str]] = []
        deferred: list[tuple[_Entry, RcptResult]] = []
        failed: list[tuple[_Entry, RcptResult, str]] = []
        for e, r in outcomes:
            if r.outcome == "sent":
                done.append((e, r, "sent"))
            elif r.outcome == "bounced":
                failed.append((e, r, "bounced"))
            elif self.retry.expired(now, arrival, null_sender):
                failed.append((e, r, "expired"))
            else:
                deferred.append((e, r))
        if failed:
            bounce = self._bounce(job, failed, now)
            if bounce is None:  # not committed: keep the entries, try them again later
                for e, r, _ in failed:
                    deferred.append((e, r))
                failed = []
            else:
                requeued.extend(bounce)
        schedules = {e.mail.entry_id: self._deferral(e, r, now, arrival, null_sender)
                     for e, r in deferred}
        warn = self._delay_warning(job, deferred, schedules, now, arrival)
        if warn:
            requeued.extend(warn)
        try:  # the log first (one write), as before each single call; whatever raises
            # there, the outcomes still reach the queue (a sent entry must not go back as
            # unsettled)
            with self.log.batch():
                for e, r, status in done + failed:
                    self._record(job, e, r, status, now, arrival)
                for e, r in deferred:
                    domain = _domain(e.rcpt)
                    if self.on_parked is not None and domain in self.config.ondemand_domains \
                            and domain not in self.config.atrn_domains:
                        self.on_parked(domain)
                    self._record(job, e, r, "deferred", now, arrival)
        finally:
            self._hand_over(job, [e for e, _, _ in done + failed],
                            [(e, schedules[e.mail.entry_id]) for e, _ in deferred], requeued)

    def _hand_over(self, job: _Job, done: list[_Entry], cancel: list[tuple[_Entry, Schedule]],
                   requeued: list[QueuedMail]) -> None:
        """Every outcome to the queue in one ``send_finish`` (C15: one durable step where
        the backend can), then the cleanups.  If the batch fails, each entry goes on its
        own (``_retrying``, with the handles the error gave back), as before batches."""
        ids = [e.mail.entry_id for e in done] + [e.mail.entry_id for e, _ in cancel]
        try:
            got = self.store.send_finish([e.mail for e in done],
                                         [(e.mail, s) for e, s in cancel])
        except StorageIOError as err:
            job.settled.update(ids)
            self.log.emit("error", job.message_id, what="send_finish",
                          reason=f"{type(err).__name__}: {err}")
            self._queue_error(err)
            if isinstance(err, ReopenRequiredError):
                self._take_finished(err.finished, requeued)
                return  # the reopened queue's recovery puts every other entry back
            self._one_by_one(done, cancel, requeued, err.finished)
            return
        except Exception as err:  # what no backend should raise: each entry alone
            job.settled.update(ids)
            self._job_error("send_finish", job.message_id, err)
            self._one_by_one(done, cancel, requeued)
            return
        job.settled.update(ids)
        self._take_finished(got, requeued)

    def _take_finished(self, got: Finished | None, requeued: list[QueuedMail]) -> None:
        """The entries a batch moved: the done ones cleaned up, the cancelled ones back in
        the schedule."""
        if got is None:
            return
        self._release([pending for pending in got.done if pending is not None])
        requeued.extend(q for q in got.cancelled if q is not None)

    def _release(self, pending: list[PendingCleanupMail]) -> None:
        """A message's delivered entries released in one ``cleanup_all`` (C16: the
        filesystem queue looks at the message file for its last entry alone, not twice
        for each entry).  After a
        failure each entry it may not have released goes on its own, with retries: on
        ``StorageIOError`` the handles it gave back; on an error no backend should raise,
        every handle (one the failed call spent answers ``MisuseError``, logged, and its
        entry waits in PENDING_CLEANUP for the next recovery, as a single call's would)."""
        if len(pending) > 1:
            try:
                self.store.cleanup_all(pending)
                return
            except StorageIOError as err:
                self.log.emit("error", pending[0].message_id, what="cleanup_all",
                              reason=f"{type(err).__name__}: {err}")
                self._queue_error(err)
                if isinstance(err, ReopenRequiredError):
                    return  # the reopened queue's recovery finishes every cleanup
                pending = [h for h in err.handles if isinstance(h, PendingCleanupMail)]
            except Exception as err:  # what no backend should raise: each entry alone
                self._job_error("cleanup_all", pending[0].message_id, err)
        for h in pending:
            self._retrying("cleanup", self.store.cleanup, h)

    def _one_by_one(self, done: list[_Entry], cancel: list[tuple[_Entry, Schedule]],
                    requeued: list[QueuedMail], finished: Finished | None = None) -> None:
        """After a failed batch: each entry the batch did not finish (``finished``: what it
        made durable before failing) on its own, with retries."""
        got = finished or Finished([None] * len(done), [None] * len(cancel))
        self._take_finished(finished, requeued)
        for e, moved in zip(done, got.done, strict=True):
            if moved is not None:
                continue
            pending = self._retrying("send_done", self.store.send_done, e.mail)
            if isinstance(pending, PendingCleanupMail):
                self._retrying("cleanup", self.store.cleanup, pending)
        for (e, schedule), back in zip(cancel, got.cancelled, strict=True):
            if back is not None:
                continue
            queued = self._retrying("send_cancel", self.store.send_cancel, e.mail, schedule)
            if isinstance(queued, QueuedMail):
                requeued.append(queued)

    def _deferral(self, e: _Entry, r: RcptResult, now: float, arrival: float,
                  null_sender: bool) -> Schedule:
        """The schedule a deferred entry is queued again with, the attempt's reason in it."""
        retry = self._retry_schedule(e.schedule, now)
        domain = _domain(e.rcpt)
        if domain in self.config.atrn_domains or domain in self.config.ondemand_domains:
            # not retried: due again only when its lifetime is over (to bounce), the
            # domain's ATRN (odmr_server) takes it whenever it is queued, a successful
            # probe of an on-demand domain (ondemand_probe) makes it due
            end = int(arrival + self.retry.lifetime(null_sender)) + 1
            retry = Schedule(max(end, retry.at), retry.attempts)
        return Schedule(retry.at, retry.attempts, r.text)  # the reason goes with it

    def _retry_schedule(self, schedule: Schedule, now: float) -> Schedule:
        """The schedule after one more failed attempt."""
        attempts = schedule.attempts + 1
        return Schedule(self.retry.next_try(now, attempts), attempts)

    def _return_unsettled(self, job: _Job, error: BaseException) -> list[QueuedMail]:
        """Every entry of ``job`` not yet handed to the queue, deferred as after a failed
        attempt (logged as such, with the error for its reason)."""
        out = []
        now = self.clock()
        text = f"internal error in the relay: {type(error).__name__}: {error}"
        for e in job.entries:
            if e.mail.entry_id in job.settled:
                continue
            job.settled.add(e.mail.entry_id)
            schedule = self._retry_schedule(e.schedule, now)
            with contextlib.suppress(Exception):  # the log and metrics must not stop this
                self._record(job, e, RcptResult(0, "4.3.0", text, "none"), "deferred", now,
                             job.arrival or self._started)
            queued = self._retrying("send_cancel", self.store.send_cancel, e.mail, schedule)
            if isinstance(queued, QueuedMail):
                out.append(queued)
        return out

    def _job_error(self, step: str, message_id: str, e: BaseException,
                   entry_id: str | None = None) -> None:
        """Log and count an unexpected error of a delivery job."""
        self.job_errors += 1
        if self.metrics is not None:
            self.metrics.job_errors.labels(step=step).inc()
        self.log.emit("error", message_id, what=f"delivery job: {step}", entry_id=entry_id,
                      reason=f"{type(e).__name__}: {e}")

    def _record(self, job: _Job, e: _Entry, r: RcptResult, status: str, now: float,
                arrival: float) -> None:
        self.counts[status] += 1
        if self.metrics is not None:
            self.metrics.deliveries.labels(outcome=status).inc()
            if status == "sent":
                self.metrics.delivery_seconds.observe(max(0.0, now - arrival))
        reason = r.text if status != "expired" else f"message expired: {r.text}"
        self.log.emit("delivery", job.message_id, to=e.rcpt, relay=r.relay,
                      delay=round(now - arrival, 2), attempts=e.schedule.attempts + 1, dsn=r.dsn,
                      status="bounced" if status == "expired" else status, reason=reason,
                      tls=r.tls, entry_id=e.mail.entry_id)

    def _bounce(self, job: _Job, failed: list[tuple[_Entry, RcptResult, str]], now: float
                ) -> list[QueuedMail] | None:
        """Commit the DSN for ``failed`` (the handles to deliver it), [] when none is due
        (a bounce of a bounce is dropped), None when it could not be committed."""
        if job.damaged:
            return self._no_dsn_of_damaged(job, len(failed))
        to = job.mail_from
        if not to or job.params.get("dsn"):
            if job.params.get("dsn") != "double" and self.config.double_bounce_recipient:
                to = self.config.double_bounce_recipient
            else:
                self.log.emit("bounce", job.message_id, status="dropped",
                              reason="undeliverable mail with the null sender is not bounced",
                              nrcpt=len(failed))
                return []
        recipients = [FailedRecipient(e.rcpt, r.dsn if r.dsn[0] in "45" else "5.0.0", r.text,
                                      r.relay.split("[", 1)[0] if r.relay != "none" else "", now)
                      for e, r, _ in failed]
        try:
            original = self._original(job)
            if original is None:  # found damaged now
                return self._no_dsn_of_damaged(job, len(failed))
            message = build_dsn(reporting_mta=self.config.myhostname, queue_id=job.message_id,
                                sender=job.mail_from or "MAILER-DAEMON",
                                arrival=job.arrival or now, recipients=recipients,
                                original=original, now=now,
                                size_limit=self.config.bounce_size_limit,
                                smtputf8=self._smtputf8(job, to))
        except Exception as e:  # not built: the failed entries are tried again later
            self._job_error("bounce", job.message_id, e)
            return None
        kind = "double" if not job.mail_from or job.params.get("dsn") else "bounce"
        handles = self._enqueue_dsn(job, to, message, kind, now, recipients)
        if handles is not None:
            self.log.emit("bounce", job.message_id, bounce_id=handles[0].message_id, to=to,
                          nrcpt=len(failed))
        return handles

    def _no_dsn_of_damaged(self, job: _Job, nrcpt: int) -> list[QueuedMail]:
        self.log.emit("bounce", job.message_id, status="dropped", nrcpt=nrcpt,
                      reason="the message is quarantined (its body was found damaged): "
                             "no DSN is built from it")
        return []

    def _original(self, job: _Job) -> bytes | None:
        """The body a DSN of ``job`` returns (a storage thread), read again if the job let
        go of it or never held it (a streamed body), and then kept only as far as a DSN
        looks (``original_looked_at``: a big body's headers).  Unless a stream of the job
        read it to its end, it is read to its end, so that its digest is checked: a DSN
        is never built from a body nobody found damaged.  None when it is found damaged
        now (quarantined, logged: ``job.damaged``).  Another error goes up: the DSN is not
        built, and its entries are tried again later."""
        if job.body is not None:
            return job.body
        # through an entry still the job's (not put back: spent)
        live = next(e for e in job.entries if e.mail.entry_id not in job.settled)
        try:
            with self.store.read_inflight(live.mail) as reader:
                original = read_piece(reader, original_looked_at(self.config.bounce_size_limit))
                if not job.verified:
                    collections.deque(reader, maxlen=0)  # to the end: the digest checked
        except CorruptionError as e:
            self._read_failed(job, [live], e)
            return None
        return original

    def _smtputf8(self, job: _Job, to: str) -> bool:
        """Whether a DSN of ``job`` sent to ``to`` is internationalized mail."""
        return job.params.get("smtputf8") == "yes" or not to.isascii()

    def _enqueue_dsn(self, job: _Job, to: str, message: bytes, kind: str, now: float,
                     recipients: list[FailedRecipient]) -> list[QueuedMail] | None:
        utf8 = needs_smtputf8(job.mail_from, recipients, self._smtputf8(job, to))
        params = {"arrival": f"{now:.3f}", "dsn": kind, "client": "localhost",
                  "helo": self.config.myhostname, **dsn_params(message, utf8)}
        try:
            with self.store.enqueue("", params) as enq:
                enq.write(message)
                return enq.commit([Recipient(to, Schedule(int(now)))])
        except QueueError as e:
            self.log.emit("error", job.message_id, what=f"enqueue {kind}",
                          reason=f"{type(e).__name__}: {e}")
            self._queue_error(e)
            return None
        except Exception as e:  # not committed (the Enqueuer aborted): tried again later
            self._job_error("bounce", job.message_id, e)
            return None

    def _delay_warning(self, job: _Job, deferred: list[tuple[_Entry, RcptResult]],
                       schedules: dict[str, Schedule], now: float, arrival: float
                       ) -> list[QueuedMail]:
        """A "delayed" DSN once per message: on the deferral whose retry interval, from the
        time the attempt was due to the time it is queued again for (``schedules``), spans
        ``arrival + delay_warning_time`` (the intervals of one entry never overlap)."""
        warn_at = arrival + self.config.delay_warning_time
        if self.config.delay_warning_time <= 0 or not job.mail_from or not deferred \
                or job.damaged:
            return []
        late = []
        for e, r in deferred:
            if e.schedule.at < warn_at <= schedules[e.mail.entry_id].at:
                late.append(FailedRecipient(e.rcpt, r.dsn, r.text,
                                            r.relay.split("[", 1)[0] if r.relay != "none" else "",
                                            now))
        if not late:
            return []
        until = arrival + self.retry.lifetime(False)
        try:
            original = self._original(job)
            if original is None:  # found damaged now: no warning built from it
                return []
            message = build_dsn(reporting_mta=self.config.myhostname, queue_id=job.message_id,
                                sender=job.mail_from, arrival=arrival, recipients=late,
                                original=original, now=now, action="delayed",
                                retry_until=until, size_limit=self.config.bounce_size_limit,
                                smtputf8=self._smtputf8(job, job.mail_from))
        except Exception as e:  # a warning only: the entries go on being retried
            self._job_error("bounce", job.message_id, e)
            return []
        handles = self._enqueue_dsn(job, job.mail_from, message, "delay", now, late)
        if handles:
            self.log.emit("delayed", job.message_id, bounce_id=handles[0].message_id,
                          to=job.mail_from, nrcpt=len(late))
        return handles or []

    def _queue_error(self, e: BaseException) -> None:
        """Tell ``on_queue_failed`` (from any thread) that the queue must be reopened."""
        if isinstance(e, ReopenRequiredError) and self.on_queue_failed is not None:
            self.on_queue_failed(e)

    def _retrying(self, what: str, call: Callable[..., object], *args: object) -> object:
        """Run a transition, trying again after an I/O error (StorageIOError leaves the
        entry in its old state).  When it cannot be made (the error persists, or the call
        raises what no backend should), it is remembered and made at the next scan of the
        queue: the entry is not left inflight until a restart.  After ReopenRequiredError
        the relay reopens the queue, whose recovery puts the entry back."""
        mail = args[0]
        message_id = getattr(mail, "message_id", "")
        entry_id = getattr(mail, "entry_id", None)
        for wait in (*FINISH_RETRIES, None):
            try:
                return call(*args)
            except StorageIOError as e:
                if isinstance(e, ReopenRequiredError):  # no retry can succeed on this queue
                    self.log.emit("error", message_id, what=what, entry_id=entry_id,
                                  reason=f"{type(e).__name__}: {e}")
                    self._queue_error(e)
                    return e
                if wait is None:
                    self.log.emit("error", message_id, what=what, entry_id=entry_id,
                                  reason=f"gave up until the next queue scan: {e}")
                    self._remember(what, call, args)
                    return e
                time.sleep(wait)
            except QueueError as e:  # the entry changed under us: nothing left to do
                self.log.emit("error", message_id, what=what, entry_id=entry_id,
                              reason=f"{type(e).__name__}: {e}")
                return e
            except Exception as e:
                self._job_error(what, message_id, e, entry_id)
                self._remember(what, call, args)
                return e
        return None

    def _remember(self, what: str, call: Callable[..., object], args: tuple[object, ...]
                  ) -> None:
        with self._unfinished_lock:
            self._unfinished.append((what, call, args))

    def _retry_unfinished(self) -> list[QueuedMail]:
        """Make the transitions that could not be made before (a storage thread, at each
        scan); the handles of the entries they queued again."""
        with self._unfinished_lock:
            pending, self._unfinished = self._unfinished, []
        found: list[QueuedMail] = []
        for what, call, args in pending:
            result = self._retrying(what, call, *args)
            if isinstance(result, QueuedMail):
                found.append(result)
            elif isinstance(result, PendingCleanupMail):
                self._retrying("cleanup", self.store.cleanup, result)
        return found

    def unfinished(self) -> int:
        """Transitions waiting for the next scan (entries held inflight meanwhile)."""
        with self._unfinished_lock:
            return len(self._unfinished)
