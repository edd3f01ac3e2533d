"""Probes of on-demand domains (``ondemand_domains``; seed 002): domains delivered by MX
but often unreachable, with no ETRN or ATRN of their own.

Mail for such a domain that is deferred leaves the per-entry retry schedule: the
scheduler puts it back due at the end of its queue lifetime (to bounce then) and tells
the prober, which probes the domain instead, once per retry interval (the backoff of
``minimal_backoff_time`` .. ``maximal_backoff_time``, or ``retry_delays``, by failed
probes): the route's addresses in order, a TCP connection, EHLO, QUIT.  A probe reads
and writes nothing in the queue, so an unreachable domain costs one connection attempt
per interval however much mail waits for it, and no disk activity.  While a probe is due
the domain's new mail is deferred without a connection of its own.  When a probe gets a
250 to EHLO, the domain's mail is made due through the domain index
(``queue_actions.flush``, ETRN's path) and the scheduler is woken; an ETRN does the same
at once.  At start every on-demand domain is probed once (mail parked by an earlier run
is found that way).  Each probe is logged (``probe``: domain, status, host or reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiosmtplib

from queue_ref.operate.queue_actions import flush
from queue_ref.relay.mx_routing import Router
from queue_ref.relay.relay_host import RelayHost
from queue_ref.relay.retry_backoff import RetryPolicy

__all__ = ["OndemandProber"]


class OndemandProber:
    """One relay's probes (``Relay.add_service``)."""

    def __init__(self, relay: RelayHost) -> None:
        self.relay = relay
        self.config = relay.config
        self.retry = RetryPolicy(relay.config)
        self.router = Router(relay.config)
        #: domain -> when it is probed next (epoch seconds); absent: sent by MX as usual
        self.due: dict[str, float] = {}
        self.failures: dict[str, int] = {}  # failed probes in a row
        self.probes = 0  # probes made (connection attempts)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        relay.add_service(self.start, self.stop)

    def waiting(self, domain: str) -> bool:
        """Whether ``domain``'s mail waits for a probe (the scheduler's ``probing``)."""
        return domain in self.due

    def reachable(self, domain: str) -> None:
        """``domain`` asked for its mail (ETRN): it is sent by MX again, no probe waits."""
        self.due.pop(domain, None)
        self.failures.pop(domain, None)

    def parked(self, domain: str) -> None:
        """Mail of ``domain`` was deferred (any thread; the scheduler's ``on_parked``)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._park, domain)

    def _park(self, domain: str) -> None:
        if domain not in self.due:
            self.failures[domain] = self.failures.get(domain, 0) + 1
            self.due[domain] = self.retry.next_try(time.time(), self.failures[domain])
            self._event.set()

    async def start(self, relay: RelayHost) -> None:
        self._loop = asyncio.get_running_loop()
        now = time.time()
        for d in self.config.ondemand_domains:
            self.due.setdefault(d, now)
        self._task = self._loop.create_task(self._run())

    async def stop(self, relay: RelayHost) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            self._event.clear()
            now = time.time()
            for domain in [d for d, at in self.due.items() if at <= now]:
                await self._probe_and_flush(domain)
            wait = min(self.due.values(), default=now + 3600) - time.time()
            if wait > 0:
                # not asyncio.wait_for: on Python 3.11 it swallows a cancellation (the
                # relay stopping) that comes in the turn the event is set (mail parked),
                # and this loop would wait on for ever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._event.wait()

    async def _probe_and_flush(self, domain: str) -> None:
        log = self.relay.log
        host, reason = await self.probe(domain)
        if host is None:
            self.failures[domain] = self.failures.get(domain, 0) + 1
            self.due[domain] = self.retry.next_try(time.time(), self.failures[domain])
            log.emit("probe", domain=domain, status="failed", reason=reason,
                     next_probe=int(self.due[domain]))
            return
        loop = asyncio.get_running_loop()
        try:
            res = await loop.run_in_executor(self.relay.executor, flush, self.relay.store,
                                             domain)
        except Exception as e:  # tried again at the next interval
            self.due[domain] = self.retry.next_try(time.time(), self.failures.get(domain, 1))
            log.emit("error", what="probe flush", domain=domain,
                     reason=f"{type(e).__name__}: {e}")
            return
        del self.due[domain]
        self.failures.pop(domain, None)
        log.emit("probe", domain=domain, status="ok", host=host, flushed=len(res.changed))
        if res.changed:
            self.relay.wake()

    async def probe(self, domain: str) -> tuple[str | None, str]:
        """(the host that said 250 to EHLO, "") or (None, why none did)."""
        route = await self.router.route(domain)
        if route.failed:
            return None, route.reason
        why = "no host to probe"
        for hop in route.hosts:
            self.probes += 1
            smtp = aiosmtplib.SMTP(hostname=hop.address, port=hop.port, start_tls=False,
                                   local_hostname=self.config.myhostname,
                                   timeout=self.config.smtp_connect_timeout)
            try:
                await smtp.connect()
                resp = await smtp.ehlo()
                with contextlib.suppress(aiosmtplib.SMTPException, OSError, TimeoutError):
                    await smtp.quit()
                if resp.code == 250:
                    return str(hop), ""
                why = f"{hop}: EHLO answered {resp.code}"
            except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
                why = f"{hop}: {' '.join((str(e) or type(e).__name__).split())}"
            finally:
                smtp.close()
        return None, why
