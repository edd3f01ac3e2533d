"""Crash exploration of the relay: its receiver's commits and its scheduler's finishing
steps, crashed at every storage call under every persistence model, then run again.

A *relay scenario* is a few messages with a script of what the next hop answers each
recipient (by local part: ``ok`` 250, ``rej`` 550 5.1.1, ``soft`` 451 at the first
attempt and 250 after).  Its run goes through the fault-injecting seam:

1. the receiver's commit of every message (``smtp_receiver._store_message``, the call that
   precedes ``250``): a message whose commit returned is *acknowledged*;
2. one delivery round of the real ``DeliveryScheduler``: listing, claims (``send_start``,
   ``read_inflight``), its delivery step (``_deliver``: the transport map, the ATRN
   domains it never sends by MX) with a scripted next hop in place of the SMTP client (a
   recipient answered 250 counts as delivered from that moment: the next hop has it),
   and the finishing step (``_finish``: the bounce enqueued and committed, ``send_done``,
   ``cleanup``, ``send_cancel`` with the next retry, or parked until the lifetime for an
   ATRN domain).

The run is crashed before and after each of its mutating calls; for each crash point and
model every disk the crash may leave (``faultinject.models.crash_states``) is opened
(recovery runs) and the relay runs again on it: the same scheduler with the same script
and a clock that jumps past every retry time, until the queue is empty.  The judge then
holds the whole history (before and after the crash) against the relay contract
(``spec/RELAY_CONTRACT.md``):

* ``lost``: an acknowledged recipient answered 250 by the script was never delivered;
* ``bounce-lost``: an acknowledged recipient refused with 5xx, of a message with a
  sender, is named by no delivered bounce;
* ``bounce-of-bounce``: a failure of a message with the null sender was bounced;
* ``duplicate``: a recipient (or a bounce naming it) delivered again after its
  ``send_done`` had returned, or more than twice (at least once allows one repeat, of an
  entry that was inflight at the crash);
* ``partial``: of a message whose commit had not returned, some recipients arrived and
  others not (atomic enqueue);
* ``spurious``: a bounce names a recipient the script did not refuse;
* ``sent-by-mx``: mail for an ATRN domain was handed to the next hop (it waits for its
  client's ATRN, and bounces when its lifetime is over);
* ``stranded``: the queue did not drain (an entry left queued, inflight or held).

Scenario ids (``relay:BACKEND:SCENARIO:MODEL:c<index><b|a>:<state key>``; a broken
scheduler of ``VARIANTS`` as ``relay-VARIANT:...``) replay one crash state: ``queue-ref
crash reproduce ID``.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.explored_backends import BackendSpec
from conformance.crashexplore.traced_runs import ScratchIO, scratch_dir
from faultinject.disk import DiskImage, materialize
from faultinject.fault_errors import Crash
from faultinject.models import MODELS, crash_state, crash_states
from faultinject.seam import FaultPlan, FaultyIO
from faultinject.trace import TraceEvent
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.delivery_scheduler import DeliveryScheduler
from queue_ref.relay.mx_routing import Router
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.smtp_delivery import RcptResult, SmtpDeliverer
from queue_ref.relay.smtp_receiver import _store_message
from queue_ref.storage import Capability, QueuedMail, Storage

__all__ = ["SCENARIOS", "RelayExploration", "explore_relay", "reproduce_relay"]

T0 = 1_800_000_000.0  # the scheduler's clock at the start of every run
MAX_ROUNDS = 12  # delivery rounds after a crash before the queue counts as stranded

#: what each violation breaks (spec/RELAY_CONTRACT.md)
KINDS = {
    "lost": "R1, R7: an acknowledged recipient was neither delivered nor bounced",
    "bounce-lost": "R8: a refused recipient of an acknowledged message got no bounce",
    "bounce-of-bounce": "R9: a failure of a null-sender message was bounced",
    "duplicate": "R14: delivered again after its send_done returned, or more than twice",
    "partial": "R2: part of an unacknowledged message was delivered",
    "spurious": "R8: a bounce names a recipient the next hop did not refuse",
    "stranded": "R6: the queue did not drain",
    "sent-by-mx": "R16: mail for an ATRN domain went to the next hop",
}


@dataclass(frozen=True)
class Mail:
    sender: str
    rcpts: tuple[str, ...]
    subject: str = "crash"

    def body(self) -> bytes:
        return (f"Subject: {self.subject}\r\nFrom: <{self.sender}>\r\n\r\n"
                "one line\r\n.dot line\r\n").encode()


#: The scenarios: a message with a delivered, a refused and a deferred recipient and a
#: failing bounce from elsewhere (null sender); internationalized mail (RFC 6533 bounce).
SCENARIOS: dict[str, tuple[Mail, ...]] = {
    "mixed": (Mail("alice@src.test", ("ok1@dst.test", "rej1@dst.test", "soft1@dst.test")),
              Mail("", ("rej2@dst.test",), "a bounce from elsewhere")),
    "utf8": (Mail("jösé@src.test", ("rej3@dst.test", "ok3@dst.test"), "café"),),
    "atrn": (Mail("carol@src.test", ("ok4@dst.test", "user@atrn.test")),),
}
ATRN_DOMAIN = "atrn.test"
LIFETIME = 900.0  # the queue lifetime of the explored relay: parked mail expires in the drain


def fails(rcpt: str) -> bool:
    """Whether ``rcpt`` ends bounced: refused by the next hop, or of an ATRN domain whose
    client never came (its lifetime ran out)."""
    return rcpt.startswith("rej") or rcpt.endswith("@" + ATRN_DOMAIN)


def answer(rcpt: str, attempts: int) -> RcptResult:
    """What the scripted next hop answers ``rcpt`` at its attempt ``attempts + 1``."""
    local = rcpt.partition("@")[0]
    if local.startswith("rej"):
        return RcptResult(550, "5.1.1", "550 5.1.1 No such user here", "mx.dst.test[192.0.2.1]")
    if local.startswith("soft") and attempts == 0:
        return RcptResult(451, "4.3.0", "451 4.3.0 Try again later", "mx.dst.test[192.0.2.1]")
    return RcptResult(250, "2.0.0", "250 2.0.0 Ok", "mx.dst.test[192.0.2.1]")


@dataclass
class Delivery:
    rcpt: str
    bounce_for: tuple[str, ...] = ()  # a bounce: the recipients it names
    utf8: bool = False  # sent with SMTPUTF8


@dataclass
class History:
    """What a run did: messages acknowledged, deliveries, send_done that returned."""

    acked: set[int] = field(default_factory=set)
    deliveries: list[Delivery] = field(default_factory=list)
    done: set[str] = field(default_factory=set)  # recipients whose send_done returned
    bounces_done: set[str] = field(default_factory=set)  # failed rcpts of a finished bounce
    drained: bool = True
    left: list[str] = field(default_factory=list)
    handed: list[str] = field(default_factory=list)  # recipients given to the next hop


class _Watch:
    """The store as the scheduler sees it, noting each ``send_done`` that returned."""

    def __init__(self, store: Storage, on_done: Callable[[str], None]) -> None:
        self._store = store
        self._on_done = on_done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def send_done(self, mail: Any) -> Any:
        out = self._store.send_done(mail)
        self._on_done(mail.entry_id)
        return out

    def send_finish(self, done: Any = (), cancel: Any = ()) -> Any:
        out = self._store.send_finish(done, cancel)
        for mail, got in zip(done, out.done, strict=True):
            if got is not None:
                self._on_done(mail.entry_id)
        return out


class _NullStream:
    def write(self, text: str, /) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class DoneBeforeBounce(DeliveryScheduler):
    """BROKEN: finishes refused entries (``send_done``) before committing their bounce,
    so a crash in between loses the bounce (what the order of ``_finish`` prevents)."""

    def _bounce(self, job: Any, failed: list[Any], now: float) -> list[QueuedMail] | None:
        for e, _, _ in failed:
            self.store.send_done(e.mail)
        return super()._bounce(job, failed, now)


class CancelAsDone(DeliveryScheduler):
    """BROKEN: a deferred entry is finished instead of put back (a lost retry)."""

    def _retrying(self, what: str, call: Callable[..., object], *args: object) -> object:
        if what == "send_cancel":
            return super()._retrying("send_done", self.store.send_done, args[0])
        return super()._retrying(what, call, *args)

    def _hand_over(self, job: Any, done: list[Any], cancel: list[Any],
                   requeued: list[QueuedMail]) -> None:
        super()._hand_over(job, [*done, *(e for e, _ in cancel)], [], requeued)


class AtrnByMx(DeliveryScheduler):
    """BROKEN: routes mail for ATRN domains by MX like any other (it must wait)."""

    async def _send_domain(self, job: Any, domain: str, entries: list[Any]) -> Any:
        saved, self.config.atrn_domains = self.config.atrn_domains, {}
        try:
            return await super()._send_domain(job, domain, entries)
        finally:
            self.config.atrn_domains = saved


#: broken schedulers the exploration must catch (``relay-NAME:...`` scenario ids)
VARIANTS: dict[str, type[DeliveryScheduler]] = {
    "done-before-bounce": DoneBeforeBounce,
    "cancel-as-done": CancelAsDone,
    "atrn-by-mx": AtrnByMx,
}

class _ScriptedHop:
    """The next hop in place of the SMTP client: ``answer`` for each recipient, at the
    attempt its entry is at; every recipient handed over is noted."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.handed: list[str] = []

    async def deliver(self, hosts: object, mail_from: str, rcpts: list[str], body: bytes,
                      params: dict[str, str], *, wire_ready: bool = False) -> list[RcptResult]:
        self.handed += rcpts
        return [answer(r, self.attempts.get(r, 0)) for r in rcpts]


_EXECUTOR = ThreadPoolExecutor(max_workers=1)  # never used: the steps run in this thread
_FINAL = re.compile(rb"^Final-Recipient: [^;]+; (.+?)\r?$", re.M)


class _Relay:
    """The scheduler's storage-thread steps, driven in this thread with a scripted next
    hop and a clock the driver moves."""

    def __init__(self, store: Storage, history: History, variant: str = "") -> None:
        config = RelayConfig(queue="(crash exploration)", myhostname="relay.test",
                             backoff_jitter=0.0, minimal_backoff_time=60.0,
                             maximal_backoff_time=120.0, dns_nameservers=["127.0.0.1"],
                             transport_maps={"dst.test": "[192.0.2.1]:25",
                                             "src.test": "[192.0.2.2]:25",
                                             ATRN_DOMAIN: "[192.0.2.3]:25"},  # no DNS
                             atrn_domains={ATRN_DOMAIN: "user"},
                             maximal_queue_lifetime=LIFETIME, bounce_queue_lifetime=LIFETIME)
        self.now = T0
        self.history = history
        self._rcpt_of: dict[str, tuple[str, tuple[str, ...]]] = {}
        watched = cast(Storage, _Watch(store, self._done))
        self.store = store
        cls = VARIANTS[variant] if variant else DeliveryScheduler
        self.hop = _ScriptedHop()
        self.sched = cls(watched, config, Router(config), cast(SmtpDeliverer, self.hop),
                         DeliveryLog(stream=_NullStream()), _EXECUTOR, clock=lambda: self.now)
        self.loop = asyncio.new_event_loop()  # the scheduler's semaphores live on one loop

    def close(self) -> None:
        self.loop.close()

    def _done(self, entry_id: str) -> None:
        rcpt, bounce_for = self._rcpt_of.get(entry_id, ("", ()))
        if bounce_for:
            self.history.bounces_done.update(bounce_for)
        elif rcpt:
            self.history.done.add(rcpt)

    def receive(self, index: int, mail: Mail) -> None:
        params = {"arrival": f"{self.now:.3f}", "client": "192.0.2.9", "helo": "client.test"}
        if not mail.sender.isascii():
            params["smtputf8"] = "yes"
        received = (b"Received: from client.test ([192.0.2.9])\r\n\tby relay.test (queue-ref) "
                    b"with ESMTP", b"; Fri, 27 Nov 2026 12:00:00 +0000\r\n")
        _store_message(self.store, mail.sender, params, received, mail.body(), mail.rcpts)
        self.history.acked.add(index)

    def round(self) -> None:
        """Deliver every due entry once (one claim per message, as the scheduler does)."""
        due: dict[str, list[QueuedMail]] = {}
        for h in self.sched._list():  # the steps a job runs
            if h.schedule.at <= self.now:
                due.setdefault(h.message_id, []).append(h)
        for handles in due.values():
            job = self.sched._claim(handles)
            if job is None:
                continue
            bounce_for = tuple(m.decode("utf-8", "replace")
                               for m in _FINAL.findall(job.body)) if job.params.get("dsn") else ()
            for e in job.entries:
                self._rcpt_of[e.mail.entry_id] = (e.rcpt, bounce_for)
                self.hop.attempts[e.rcpt] = e.schedule.attempts
            handed = len(self.hop.handed)
            outcomes = self.loop.run_until_complete(self.sched._deliver(job))
            self.history.handed += self.hop.handed[handed:]
            for e, r in outcomes:
                if r.outcome == "sent":
                    self.history.deliveries.append(Delivery(
                        e.rcpt, bounce_for, job.params.get("smtputf8") == "yes"))
            self.sched._finish(job, outcomes)

    def drain(self) -> None:
        for _ in range(MAX_ROUNDS):
            self.round()
            self.now += 121.0
            if self._empty():
                return
        self.history.drained = False
        self.history.left = self._left()

    def _empty(self) -> bool:
        return not self._left()

    def _left(self) -> list[str]:
        left = [f"queued {h.entry_id}" for h in self.store.list_queue()]
        left += [f"inflight {m.entry_id}" for m in self.store.find_inflight()]
        if Capability.HOLD in self.store.capabilities:
            left += [f"held {m.entry_id}" for m in self.store.list_held()]
        return left


# ---- the crashed run and the run after it ----------------------------------------------

@dataclass
class CrashedRun:
    initial: DiskImage
    events: list[TraceEvent]
    history: History
    crashed: bool
    mutating: int  # mutating calls made


def crashed_run(backend: BackendSpec, mails: tuple[Mail, ...], plan: FaultPlan | None,
                variant: str = "") -> CrashedRun:
    """The scenario's receipts and first delivery round through ``FaultyIO``, stopped by
    ``plan``'s crash; the store is never closed (the process died)."""
    history = History()
    with scratch_dir() as d:
        io = FaultyIO(d, plan, inner=ScratchIO())
        crashed = False
        try:
            store = backend.open(d, io)
            relay = _Relay(store, history, variant)
            try:
                for i, mail in enumerate(mails):
                    relay.receive(i, mail)
                relay.round()
            finally:
                relay.close()
        except Crash:
            crashed = True
        return CrashedRun(io.initial, list(io.events), history, crashed, io.mutating_count)


def run_after(backend: BackendSpec, image: DiskImage, variant: str = "") -> History:
    """Open the backend on a crash state (recovery runs) and let the relay drain it."""
    history = History()
    with scratch_dir() as d:
        materialize(image, d)
        store = backend.open(d, ScratchIO())
        try:
            relay = _Relay(store, history, variant)
            relay.now = T0 + 300.0  # the restart comes later, before the lifetime is over
            try:
                relay.drain()
            finally:
                relay.close()
        finally:
            store.close()
    return history


def judge(mails: tuple[Mail, ...], before: History, after: History) -> list[tuple[str, str]]:
    """The violations of the whole history (see the module's docstring)."""
    out: list[tuple[str, str]] = []
    plain = Counter(d.rcpt for d in before.deliveries + after.deliveries if not d.bounce_for)
    named: Counter[str] = Counter()
    for d in before.deliveries + after.deliveries:
        named.update(d.bounce_for)
    refused = {r for m in mails for r in m.rcpts if fails(r)}
    null_refused = {r for m in mails if not m.sender for r in m.rcpts if r in refused}
    for i, mail in enumerate(mails):
        wanted = [r for r in mail.rcpts if r not in refused]
        bounced = [r for r in mail.rcpts if r in refused and mail.sender]
        if i not in before.acked:
            got = [r for r in wanted if plain[r]] + [r for r in bounced if named[r]]
            if got and len(got) != len(wanted) + len(bounced):
                out.append(("partial", f"message {i} (commit had not returned): only {got} "
                                       "arrived"))
            continue
        for r in wanted:
            if not plain[r]:
                out.append(("lost", f"{r} of acknowledged message {i} was never delivered"))
        for r in bounced:
            if not named[r]:
                out.append(("bounce-lost", f"{r} was refused but no bounce names it"))
    for r in null_refused & set(named):
        out.append(("bounce-of-bounce", f"the failure of {r} (null sender) was bounced"))
    for r in set(named) - refused:
        out.append(("spurious", f"a bounce names {r}, which the next hop accepted"))
    for r, n in plain.items():
        again = sum(1 for d in after.deliveries if d.rcpt == r and not d.bounce_for)
        if n > 2 or (r in before.done and again):
            out.append(("duplicate", f"{r} delivered {n} times ({again} after the crash; its "
                                     f"send_done {'had' if r in before.done else 'had not'} "
                                     "returned)"))
    for r, n in named.items():
        again = sum(1 for d in after.deliveries if r in d.bounce_for)
        if n > 2 or (r in before.bounces_done and again) or (r in before.done and n > 1):
            out.append(("duplicate", f"{n} bounces name {r} ({again} after the crash)"))
    utf8_senders = {m.sender for m in mails if not m.sender.isascii()}
    for d in before.deliveries + after.deliveries:
        if d.bounce_for and d.rcpt in utf8_senders and not d.utf8:
            out.append(("lost", f"the bounce to {d.rcpt} went without SMTPUTF8"))
    for r in before.handed + after.handed:
        if r.endswith("@" + ATRN_DOMAIN):
            out.append(("sent-by-mx", f"{r} was handed to the next hop"))
    if not after.drained:
        out.append(("stranded", f"after {MAX_ROUNDS} rounds: {', '.join(after.left[:5])}"))
    return out


# ---- the exploration --------------------------------------------------------------------

@dataclass
class Finding:
    scenario: str  # the id that replays it
    violations: list[tuple[str, str]]


@dataclass
class RelayExploration:
    backend: str
    scenarios: tuple[str, ...]
    models: tuple[str, ...]
    variant: str = ""
    points: int = 0
    states: int = 0
    per_model: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "variant": self.variant,
                "scenarios": list(self.scenarios),
                "models": list(self.models), "crash_points": self.points,
                "states": self.states, "states_per_model": self.per_model,
                "violations": dict(Counter(k for f in self.findings for k, _ in f.violations)),
                "findings": [{"scenario": f.scenario, "violations": f.violations}
                             for f in self.findings[:50]]}


def _scenario_id(variant: str, backend: str, scenario: str, model: str, index: int,
                 when: str, key: str) -> str:
    head = f"relay-{variant}" if variant else "relay"
    return f"{head}:{backend}:{scenario}:{model}:c{index}{when[0]}:{key}"


def points(backend: BackendSpec, scenario: str, variant: str = ""
           ) -> Iterator[tuple[int, str]]:
    """Every crash point of a scenario's run: (mutating call, before|after), opening the
    queue excluded (the queue's own exploration covers it)."""
    mails = SCENARIOS[scenario]
    whole = crashed_run(backend, mails, None, variant)
    opened = _opening_calls(backend)
    for index in range(opened, whole.mutating):
        yield index, "before"
        yield index, "after"


def _opening_calls(backend: BackendSpec) -> int:
    with scratch_dir() as d:
        io = FaultyIO(d, None, inner=ScratchIO())
        store = backend.open(d, io)
        n = io.mutating_count
        store.close()
        return n


def explore_relay(backend_name: str = "fs", scenarios: tuple[str, ...] = tuple(SCENARIOS),
                  models: tuple[str, ...] = tuple(MODELS), *, exhaustive_limit: int = 6,
                  random_states: int = 4, every: int = 1, variant: str = "",
                  progress: Callable[[int, int], None] | None = None) -> RelayExploration:
    """Crash every ``every``-th point of each scenario under each model; judge each state.
    ``variant``: a broken scheduler of ``VARIANTS`` instead of the relay's own."""
    import time

    started = time.monotonic()
    backend = resolve(backend_name)
    unknown = [m for m in models if m not in MODELS] + [s for s in scenarios
                                                       if s not in SCENARIOS]
    if variant and variant not in VARIANTS:
        unknown.append(variant)
    if unknown:
        raise ValueError(f"unknown model or scenario {unknown}; models: {sorted(MODELS)}, "
                         f"scenarios: {sorted(SCENARIOS)}")
    result = RelayExploration(backend_name, scenarios, models, variant)
    plan = [(s, i, w) for s in scenarios
            for n, (i, w) in enumerate(points(backend, s, variant)) if n % every == 0]
    for done, (scenario, index, when) in enumerate(plan):
        mails = SCENARIOS[scenario]
        run = crashed_run(backend, mails, FaultPlan(crash_at=index, crash_when=when), variant)
        result.points += 1
        for model in models:
            for state in crash_states(run.initial, run.events, model,
                                      exhaustive_limit=exhaustive_limit,
                                      random_states=random_states):
                after = run_after(backend, state.image, variant)
                bad = judge(mails, run.history, after)
                result.states += 1
                result.per_model[model] = result.per_model.get(model, 0) + 1
                if bad:
                    result.findings.append(Finding(_scenario_id(
                        variant, backend_name, scenario, model, index, when, state.key), bad))
        if progress is not None:
            progress(done + 1, len(plan))
    result.seconds = time.monotonic() - started
    return result


_ID = re.compile(r"relay(?:-(?P<variant>[a-z-]+))?:(?P<backend>[^:]+(?::[^:]+)?):(?P<scenario>[a-z0-9]+):"
                 r"(?P<model>[a-z0-9-]+):c(?P<index>\d+)(?P<when>[ba]):(?P<key>.*)")


@dataclass
class RelayReproduction:
    scenario: str
    description: str
    violations: list[tuple[str, str]]
    before: History
    after: History

    def lines(self) -> list[str]:
        out = [f"relay scenario {self.scenario}",
               f"  crash state: {self.description}",
               f"  before the crash: acknowledged messages {sorted(self.before.acked)}, "
               f"delivered {[d.rcpt for d in self.before.deliveries]}, send_done returned "
               f"for {sorted(self.before.done)}",
               f"  after recovery: delivered {[d.rcpt for d in self.after.deliveries]}, "
               f"bounces naming {[list(d.bounce_for) for d in self.after.deliveries if d.bounce_for]}"]
        if self.violations:
            out += [f"  VIOLATION {k} ({KINDS[k]}): {text}" for k, text in self.violations]
        else:
            out.append("  no violation: every clause of the relay contract holds")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "state": self.description,
                "violations": self.violations, "ok": not self.violations}


def is_relay_scenario(text: str) -> bool:
    return text.startswith("relay:") or text.startswith("relay-")


def reproduce_relay(text: str) -> RelayReproduction:
    """Rebuild the crash state a relay scenario id names, run the relay on it, judge."""
    m = _ID.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a relay scenario id "
                         "(relay:BACKEND:SCENARIO:MODEL:c<index><b|a>:<state key>)")
    variant = m["variant"] or ""
    if m["scenario"] not in SCENARIOS or m["model"] not in MODELS or (
            variant and variant not in VARIANTS):
        raise ValueError(f"unknown scenario, model or variant in {text!r}")
    backend = resolve(m["backend"])
    mails = SCENARIOS[m["scenario"]]
    when = "before" if m["when"] == "b" else "after"
    run = crashed_run(backend, mails, FaultPlan(crash_at=int(m["index"]), crash_when=when),
                      variant)
    if not run.crashed:
        raise ValueError(f"the run makes fewer than {int(m['index']) + 1} mutating calls")
    state = crash_state(run.initial, run.events, m["model"], m["key"])
    after = run_after(backend, state.image, variant)
    return RelayReproduction(text.strip(), state.description,
                             judge(mails, run.history, after), run.history, after)
