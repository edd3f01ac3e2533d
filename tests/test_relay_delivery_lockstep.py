"""The real delivery scheduler in lockstep with ``spec/delivery_model.py``.

A Hypothesis state machine enqueues mail into a memory queue, scripts what each address
meets at a real aiosmtpd sink (250, 4xx or 5xx at RCPT, 4xx or 5xx after DATA, the
connection closed at the end of DATA), takes destinations down (their MX host's address
in a real dnslib DNS server then refuses connections), and moves a controlled clock.  The
real DeliveryScheduler (real Router on that DNS server, real SmtpDeliverer) delivers what
is due; a domain that does not exist (NXDOMAIN), one whose DNS fails (SERVFAIL) and one
whose routing raises inside the relay stand for the other outcomes, and the queue itself
finds a message's body damaged (it quarantines the message) or fails to read it for a
while (an I/O error).  After each move of
the clock, once the scheduler is idle, every entry in the queue (due time and attempts),
every report logged (bounce, delay warning, drop: to whom, how many recipients) and
every message the sink received (sender, recipient, and for a DSN its original, Action
and per recipient Status) must be what the model says.

The backoff jitter is 0 (``LockstepDelivery``) or 0.5 (``LockstepDeliveryJitter``); every
draw of the relay's RetryPolicy in one example is one value, Hypothesis's, which the
model's ``decide`` takes as its ``draw``.  Bound: the project's Hypothesis
profile (ci: 40 examples of up to 30 steps; thorough: 1000 of up to 100).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from queue_ref.memory import MemoryStorage
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.delivery_scheduler import DeliveryScheduler
from queue_ref.relay.mx_routing import Route, Router
from queue_ref.relay.retry_backoff import RetryPolicy
from queue_ref.relay.smtp_delivery import SmtpDeliverer
from queue_ref.storage import CorruptionError, InflightMail, MailReader, Recipient, Schedule, StorageIOError
from spec.delivery_model import (
    Attempt,
    DeliveryEntry,
    DeliveryPolicy,
    Dsn,
    Fate,
    Met,
    Origin,
    decide,
    delivery_round,
    dsn_entry,
)
from tests.relay_support import DnsServer, Sink, _ListStream, relay_config

SINK_DOMAINS = ("d0.test", "d1.test", "d2.test")
UP, DOWN = "127.0.0.1", "127.0.0.77"  # nothing listens on DOWN: connections are refused
RCPTS = (*(f"{u}@{d}" for d in SINK_DOMAINS for u in ("a", "b")),
         "x@nx.test", "x@sf.test", "x@err.test")
SENDERS = ("", "s@d0.test", "s@d1.test")
POSTMASTER = "pm@d2.test"
SCRIPTED = (*(a for a in RCPTS if a.split("@")[1] in SINK_DOMAINS), "s@d0.test", "s@d1.test",
            POSTMASTER)
#: what each sink behaviour is to the model
BEHAVIOUR_MET = {
    "accept": Met(Attempt.REPLY_2XX, "2.0.0"),
    "defer": Met(Attempt.REPLY_4XX, "4.2.0"),
    "reject": Met(Attempt.REPLY_5XX, "5.1.1"),
    "datadefer": Met(Attempt.REPLY_4XX, "4.3.1"),
    "datafail": Met(Attempt.REPLY_5XX, "5.6.0"),
    "drop": Met(Attempt.LOST_CONNECTION, "4.4.2"),
}
T0 = 1_000_000
SETTLE_TIMEOUT = 20.0  # seconds for the scheduler to finish what is due


def zone() -> dict[str, list[tuple[str, Any]]]:
    z: dict[str, list[tuple[str, Any]]] = {}
    for d in SINK_DOMAINS:
        z[d] = [("MX", (10, f"mx.{d}"))]
        z[f"mx.{d}"] = [("A", UP)]
    return z


class _SameDraw(random.Random):
    """A random source whose every ``random()`` is one value: the jitter's draw."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


class _RouterRaisingFor(Router):
    """The real Router; routing ``err.test`` raises, as a bug inside the relay would."""

    async def route(self, domain: str) -> Route:
        if domain == "err.test":
            raise RuntimeError("injected: routing err.test failed")
        return await super().route(domain)


class _DamageableMemory(MemoryStorage):
    """A memory queue whose bodies the test damages (a read of one quarantines its
    message, every entry of it, and raises CorruptionError, as the real queues do) or
    makes unreadable for a while (StorageIOError, as a failing disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.damaged: set[str] = set()
        self.unreadable: set[str] = set()

    def read_inflight(self, mail: InflightMail) -> MailReader:
        if mail.message_id in self.unreadable:
            raise StorageIOError("reading the body: injected EIO", mail)
        if mail.message_id in self.damaged:
            with self._lock:
                for eid in [k for k, e in self._entries.items()
                            if e.message_id == mail.message_id]:
                    del self._entries[eid]
            raise CorruptionError(f"message {mail.message_id}: injected damage",
                                  mail.entry_id, None)
        return super().read_inflight(mail)


@pytest.fixture(scope="module")
def network() -> Any:
    """One DNS server and one sink for every example (the sink's script is reset)."""
    with DnsServer(zone(), servfail={"sf.test"}) as dns, Sink() as sink:
        LockstepDelivery.dns = dns
        LockstepDelivery.sink = sink
        yield
        LockstepDelivery.dns = None
        LockstepDelivery.sink = None


@dataclass
class _Msg:
    key: int
    sender: str
    origin: Origin
    arrival: float
    real_id: str = ""  # the queue's message id ("" until the relay logged it)
    report: Dsn | None = None  # what a DSN says
    about: int = -1  # a DSN: the key of the message it reports on
    damaged: bool = False  # its body is damaged in the queue
    unreadable: bool = False  # reading its body fails now


@dataclass
class _Entry:
    msg: _Msg
    rcpt: str
    at: int
    attempts: int = 0
    real_id: str = ""  # the queue's entry id (DSNs: found by their message id)


def _dsn_report(data: bytes) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """(queue id reported on, Action, sorted (recipient, Status)) of a DSN's bytes."""
    text = data.decode("utf-8", "replace").split("\r\nContent-Description: Undelivered")[0]
    qid = re.search(r"^X-Queue-ref-Queue-ID: (\S+)", text, re.M)
    actions = set(re.findall(r"^Action: (\S+)", text, re.M))
    rows = re.findall(r"^Final-Recipient: [\w-]+; (\S+)\r?\nAction: \S+\r?\nStatus: (\S+)",
                      text, re.M)
    assert qid and len(actions) == 1, text[:2000]
    return qid.group(1), actions.pop(), tuple(sorted(rows))


class LockstepDelivery(RuleBasedStateMachine):
    dns: DnsServer | None = None
    sink: Sink | None = None
    JITTER = 0.0  # backoff_jitter

    def __init__(self) -> None:
        super().__init__()
        self.started = False

    # ---- set up and tear down ----

    @initialize(
        backoff=st.sampled_from([(1.0, 1.0), (1.0, 4.0), (2.0, 8.0), (3.0, 5.0)]),
        retry_delays=st.sampled_from([(), (), (2.0, 5.0), (1.0, 3.0, 2.0)]),
        lifetime=st.sampled_from([0.0, 6.0, 15.0, 40.0]),
        bounce_lifetime=st.sampled_from([0.0, 4.0, 12.0, 40.0]),
        warning=st.sampled_from([0.0, 0.0, 3.0, 7.0]),
        postmaster=st.sampled_from(["", POSTMASTER, POSTMASTER]),
        draw=st.floats(0.0, 0.999),
    )
    def start(self, backoff: tuple[float, float], retry_delays: tuple[float, ...],
              lifetime: float, bounce_lifetime: float, warning: float,
              postmaster: str, draw: float) -> None:
        assert self.dns is not None and self.sink is not None, "needs the network fixture"
        self.policy = DeliveryPolicy(
            minimal_backoff_time=backoff[0], maximal_backoff_time=backoff[1],
            backoff_jitter=self.JITTER, retry_delays=retry_delays, maximal_queue_lifetime=lifetime,
            bounce_queue_lifetime=bounce_lifetime, delay_warning_time=warning,
            double_bounce_recipient=postmaster)
        config = relay_config(
            "memory", dns_nameservers=["127.0.0.1"], dns_port=self.dns.port,
            smtp_port=self.sink.port, queue_scan_interval=3600.0, log_json=True,
            minimal_backoff_time=backoff[0], maximal_backoff_time=backoff[1],
            backoff_jitter=self.JITTER, retry_delays=list(retry_delays),
            maximal_queue_lifetime=lifetime, bounce_queue_lifetime=bounce_lifetime,
            delay_warning_time=warning, double_bounce_recipient=postmaster)
        self.dns.resolver.zone.clear()
        self.dns.resolver.zone.update(zone())
        with self.sink.state.lock:
            self.sink.state.script.clear()
            self.seen_at_sink = len(self.sink.state.messages)
        self.down: set[str] = set()
        self.script: dict[str, str] = {}
        self.now = T0
        self.log_lines: list[str] = []
        self.seen_in_log = 0
        self.msgs: list[_Msg] = []
        self.entries: list[_Entry] = []
        self.loop = asyncio.new_event_loop()
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="lockstep-storage")
        self.store = _DamageableMemory()
        self.deliverer = SmtpDeliverer(config)
        self.scheduler = DeliveryScheduler(
            self.store, config, _RouterRaisingFor(config), self.deliverer,
            DeliveryLog(json_lines=True, stream=_ListStream(self.log_lines)), self.executor,
            clock=lambda: float(self.now))
        # every jitter draw of this example is ``draw`` (the model's), whatever the order
        # in which concurrent jobs draw: a failing example replays the same
        self.draw = draw
        self.scheduler.retry = RetryPolicy(config, _SameDraw(draw))
        self.task = self.loop.create_task(self.scheduler.run())
        self.started = True

    def teardown(self) -> None:
        if not self.started:
            return
        try:
            with contextlib.suppress(AssertionError):  # an example that failed may not settle
                self.loop.run_until_complete(self._settle())
            self.loop.run_until_complete(self.scheduler.stop(5.0))
            self.loop.run_until_complete(asyncio.wait_for(self.task, 10))
            self.loop.run_until_complete(self.deliverer.close())
        finally:
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=10))
            self.executor.shutdown(wait=True)
            self.loop.close()
            self.store.close()

    # ---- rules ----

    @rule(sender=st.sampled_from((*SENDERS, "")),
          rcpts=st.lists(st.sampled_from(RCPTS), min_size=1, max_size=3,
                         unique_by=lambda a: a.split("@")[1]))
    def enqueue(self, sender: str, rcpts: list[str]) -> None:
        """Mail as the receiver commits it: due now, its arrival in its parameters."""
        msg = _Msg(len(self.msgs), sender, Origin.MAIL, float(self.now))
        body = f"Subject: m{msg.key}\r\nX-Model: m{msg.key}\r\n\r\nbody\r\n".encode()
        with self.store.enqueue(sender, {"arrival": f"{self.now:.3f}"}) as enq:
            enq.write(body)
            handles = enq.commit([Recipient(r, Schedule(self.now)) for r in rcpts])
        msg.real_id = handles[0].message_id
        self.msgs.append(msg)
        for r, h in zip(rcpts, handles, strict=True):
            self.entries.append(_Entry(msg, r, self.now, 0, h.entry_id))
        self.scheduler.add(handles)

    @rule(address=st.sampled_from(SCRIPTED), behaviour=st.sampled_from(list(BEHAVIOUR_MET)))
    def script_address(self, address: str, behaviour: str) -> None:
        """What ``address`` meets at the sink from now on."""
        assert self.sink is not None
        self.script[address] = behaviour
        with self.sink.state.lock:
            self.sink.state.script[address] = behaviour

    @rule(domain=st.sampled_from(SINK_DOMAINS), down=st.booleans())
    def set_down(self, domain: str, down: bool) -> None:
        """A destination whose MX host refuses connections (its address has no listener)."""
        assert self.dns is not None
        self.dns.resolver.zone[f"mx.{domain}"] = [("A", DOWN if down else UP)]
        (self.down.add if down else self.down.discard)(domain)

    def _queued(self, data: st.DataObject) -> _Msg | None:
        """A message with an entry in the queue, the relay's id known; None if none."""
        live = sorted({e.msg.key for e in self.entries if e.msg.real_id})
        return self.msgs[data.draw(st.sampled_from(live))] if live else None

    @rule(data=st.data())
    def damage_a_body(self, data: st.DataObject) -> None:
        """A bit flips in a queued message's body: its next read finds it (D9)."""
        msg = self._queued(data)
        if msg is not None:
            msg.damaged = True
            self.store.damaged.add(msg.real_id)

    @rule(data=st.data(), failing=st.booleans())
    def disk_fails_reading(self, data: st.DataObject, failing: bool) -> None:
        """Reads of a queued message's body fail (an I/O error) until the disk recovers."""
        msg = self._queued(data)
        if msg is not None:
            msg.unreadable = failing
            (self.store.unreadable.add if failing else self.store.unreadable.discard)(
                msg.real_id)

    @rule(dt=st.sampled_from([0, 1, 1, 2, 3, 5, 8, 13]))
    def advance(self, dt: int) -> None:
        """The clock moves on; the scheduler delivers what is due; then all must agree."""
        self.now += dt
        self.loop.run_until_complete(self._settle())
        lines = self.log_lines[self.seen_in_log:]
        self.seen_in_log += len(lines)
        records = [json.loads(line) for line in lines]
        # (original's queue id, event) -> the queue id of the DSN the relay made
        self.new_ids = {(r["queue_id"], r["event"]): r["bounce_id"] for r in records
                        if r["event"] in ("bounce", "delayed") and "bounce_id" in r}
        expected = self._model_step()
        self._compare(expected, records)

    @rule()
    def advance_to_next_due(self) -> None:
        """The clock moves to the earliest due time the model knows (skipping idle time)."""
        if self.entries:
            self.now = max(self.now, min(e.at for e in self.entries))
        self.advance(0)

    @invariant()
    def scheduler_alive(self) -> None:
        if self.started and self.task.done():
            raise AssertionError(f"the scheduler loop ended: {self.task!r}")

    # ---- the real scheduler ----

    async def _settle(self) -> None:
        """Wake the scheduler and wait until it holds nothing inflight and the queue has
        nothing due (three checks in a row, 5 ms apart)."""
        self.scheduler.wake()
        deadline = time.monotonic() + SETTLE_TIMEOUT
        quiet = 0
        while quiet < 3:
            await asyncio.sleep(0.005)
            inflight = self.scheduler.sizes()["inflight"]
            due = [h for h in self.store.list_queue() if h.schedule.at <= self.now]
            quiet = quiet + 1 if inflight == 0 and not due else 0
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {SETTLE_TIMEOUT} s at t={self.now}: "
                                     f"{inflight} inflight, due: {due}")

    # ---- the model ----

    def _met(self, msg: _Msg, rcpt: str) -> Met:
        if msg.unreadable:  # the body is read before anything else
            return Met(Attempt.BODY_UNREADABLE, "")
        if msg.damaged:
            return Met(Attempt.BODY_DAMAGED, "")
        domain = rcpt.split("@")[1]
        if domain == "nx.test":
            return Met(Attempt.ROUTE_PERMANENT, "5.1.2")
        if domain == "sf.test":
            return Met(Attempt.ROUTE_TEMPORARY, "4.4.3")
        if domain == "err.test":
            return Met(Attempt.RELAY_ERROR, "4.3.0")
        if domain in self.down:
            return Met(Attempt.NO_CONNECTION, "4.4.1")
        return BEHAVIOUR_MET[self.script.get(rcpt, "accept")]

    def _model_step(self) -> dict[str, Counter[Any]]:
        """Deliver what the model has due now (and the reports that makes, due at once)."""
        out: dict[str, Counter[Any]] = {"sink": Counter(), "bounce": Counter(),
                                        "delayed": Counter(), "dropped": Counter()}
        while True:
            due = [e for e in self.entries if e.at <= self.now]
            if not due:
                return out
            by_msg: dict[int, list[_Entry]] = {}
            for e in due:
                by_msg.setdefault(e.msg.key, []).append(e)
            for key, entries in by_msg.items():
                msg = self.msgs[key]
                results = []
                for e in entries:
                    entry = DeliveryEntry(msg.arrival, msg.sender, msg.origin, e.attempts, e.at)
                    met = self._met(msg, e.rcpt)
                    d = decide(self.policy, entry, met, self.now, self.draw)
                    results.append((e.rcpt, entry, met, d))
                    if d.fate is Fate.QUARANTINED:  # every entry of it, due or not
                        self.entries = [x for x in self.entries if x.msg is not msg]
                        break
                    if d.fate in (Fate.TEMPORARY, Fate.RETURNED):
                        e.at, e.attempts = d.at, d.attempts
                    else:
                        self.entries.remove(e)
                    if d.fate is Fate.DELIVERED:
                        out["sink"][(msg.sender, e.rcpt, self._identity(msg))] += 1
                rnd = delivery_round(self.policy, results)
                if rnd.dropped:
                    out["dropped"][(key, rnd.dropped)] += 1
                for dsn, event in ((rnd.bounce, "bounce"), (rnd.warning, "delayed")):
                    if dsn is None:
                        continue
                    out[event][(key, dsn.to, len(dsn.recipients))] += 1
                    new = dsn_entry(dsn, self.now)
                    report = _Msg(len(self.msgs), "", dsn.origin, new.arrival, report=dsn,
                                  about=key)
                    report.real_id = self.new_ids.get((msg.real_id, event), "")
                    self.msgs.append(report)
                    self.entries.append(_Entry(report, dsn.to, new.due))

    def _identity(self, msg: _Msg) -> tuple[Any, ...]:
        if msg.report is None:
            return ("mail", f"m{msg.key}")
        return ("dsn", msg.about, msg.report.action, tuple(sorted(msg.report.recipients)))

    # ---- comparing ----

    def _compare(self, expected: dict[str, Counter[Any]], records: list[dict[str, Any]]
                 ) -> None:
        key_of = {m.real_id: m.key for m in self.msgs if m.real_id}

        def key(queue_id: str) -> int | str:
            return key_of.get(queue_id, f"queue id {queue_id}")

        got: dict[str, Counter[Any]] = {"sink": Counter(), "bounce": Counter(),
                                        "delayed": Counter(), "dropped": Counter()}
        for r in records:
            if r["event"] == "bounce" and r.get("status") == "dropped":
                got["dropped"][(key(r["queue_id"]), r["nrcpt"])] += 1
            elif r["event"] in ("bounce", "delayed"):
                got[r["event"]][(key(r["queue_id"]), r["to"], r["nrcpt"])] += 1
        assert self.sink is not None
        with self.sink.state.lock:
            received = self.sink.state.messages[self.seen_at_sink:]
            self.seen_at_sink += len(received)
        for m in received:
            for rcpt in m.rcpts:
                ident: tuple[Any, ...] = ("mail", _header(m.data, "X-Model"))
                if b"\r\nX-Queue-ref-Queue-ID: " in m.data:
                    about, action, rows = _dsn_report(m.data)
                    ident = ("dsn", key(about), action, rows)
                got["sink"][(m.mail_from, rcpt, ident)] += 1
        where = f"at t={self.now - T0} (policy {self.policy})"
        for what in ("delayed", "bounce", "dropped", "sink"):  # causes before effects
            assert got[what] == expected[what], (
                f"{what} {where}: relay {dict(got[what])} != model {dict(expected[what])}")
        self._compare_queue(where)

    def _compare_queue(self, where: str) -> None:
        real: dict[str, list[tuple[str, int, int]]] = {}
        for h in self.store.list_queue():
            real.setdefault(h.message_id, []).append((h.entry_id, h.schedule.at,
                                                      h.schedule.attempts))
        model: dict[str, list[tuple[str, int, int]]] = {}
        for e in self.entries:
            assert e.msg.real_id, f"{where}: the relay logged no report for {e.msg}"
            if not e.real_id:  # a DSN's one entry
                ids = [eid for eid, _, _ in real.get(e.msg.real_id, [])]
                e.real_id = ids[0] if len(ids) == 1 else f"(one entry of {e.msg.real_id})"
            model.setdefault(e.msg.real_id, []).append((e.real_id, e.at, e.attempts))
        real = {k: sorted(v) for k, v in real.items()}
        model = {k: sorted(v) for k, v in model.items()}
        assert real == model, f"queue {where}: relay {real} != model {model}"


def _header(data: bytes, name: str) -> str:
    m = re.search(rb"^" + name.encode() + rb": (\S+)", data, re.M)
    return m.group(1).decode() if m else ""


TestRelayDeliveryLockstep = pytest.mark.usefixtures("network")(LockstepDelivery.TestCase)


class LockstepDeliveryJitter(LockstepDelivery):
    """The same with ``backoff_jitter = 0.5``: the relay's jitter draws are one value per
    example, which the model takes too."""

    JITTER = 0.5


TestRelayDeliveryLockstepJitter = pytest.mark.usefixtures("network")(
    LockstepDeliveryJitter.TestCase)
