"""Probes of on-demand domains (``ondemand_domains``, seed 002): deferred mail for such
a domain leaves the per-entry retry schedule; one probe per retry interval (TCP, EHLO,
QUIT, no queue I/O) stands for all of it; a probe that succeeds, or an ETRN, makes the
domain's mail due through the domain index and it is delivered.  The MX is a real
aiosmtpd sink on loopback that refuses its greeting (421) while "unreachable"."""

from __future__ import annotations

import asyncio
import smtplib
import time
from pathlib import Path

from queue_ref.opener import open_queue
from queue_ref.operate.queue_actions import EntryInfo, listing
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayThread, Sink, queued_entries, relay_config

DOMAIN = "flaky.example"
DOWN = "421 4.3.2 Service not available"


def fill(queue: str, n: int) -> None:
    """``n`` messages for ``DOMAIN``, due now (queued before the relay starts)."""
    with open_queue(queue) as q:
        for i in range(n):
            with q.enqueue("a@example.org", {"arrival": f"{time.time():.3f}"}) as enq:
                enq.write(b"Subject: waiting\r\n\r\nbody\r\n")
                enq.commit([Recipient(f"r{i}@{DOMAIN}", Schedule(int(time.time())))])


def measure(tmp_path: Path, n: int, ondemand: bool, seconds: float,
            **kw: object) -> tuple[int, int]:
    """Connection attempts the unreachable MX saw and deferrals logged (each one a
    ``send_start`` and a ``send_cancel``: two queue writes) in ``seconds``, for ``n``
    messages queued for it."""
    queue = str(tmp_path / ("on" if ondemand else "off"))
    fill(queue, n)
    with Sink() as mx:
        mx.state.at["connect"] = DOWN
        config = relay_config(queue, transport_maps={DOMAIN: f"[127.0.0.1]:{mx.port}"},
                              ondemand_domains=[DOMAIN] if ondemand else [], log_json=True,
                              **kw)
        with RelayThread(config) as r:
            time.sleep(seconds)
            deferred = len(r.events("delivery"))
            return mx.state.connections, deferred


def test_one_probe_per_interval_stands_for_all_the_mail(tmp_path: Path) -> None:
    n = 100
    probes, deferred = measure(tmp_path, n, True, 5.0)
    attempts, retries = measure(tmp_path, n, False, 5.0)
    # backoff 1 s then 2 s: the probe at start, then about one per 2 s
    assert 1 <= probes <= 5
    assert deferred == n  # each entry deferred once (its first dispatch), never again
    assert attempts >= 2 * n and retries >= 2 * n  # every entry tried again and again


def test_a_probe_that_succeeds_delivers_the_domains_mail(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    fill(queue, 20)
    with Sink() as mx:
        mx.state.at["connect"] = DOWN
        with RelayThread(relay_config(queue, transport_maps={DOMAIN: f"[127.0.0.1]:{mx.port}"},
                                      ondemand_domains=[DOMAIN], log_json=True)) as r:
            assert len(r.wait_events(20, status="deferred", timeout=10)) == 20
            failed = r.wait_events(1, "probe", status="failed")
            assert failed[0]["domain"] == DOMAIN and "421" in failed[0]["reason"]
            assert all(e.schedule.at > time.time() + 86400 for e in queued_entries_live(r))
            del mx.state.at["connect"]  # the domain is back
            got = mx.wait_for(20, timeout=15)
            (ok,) = r.wait_events(1, "probe", status="ok")
    assert sorted(x for m in got for x in m.rcpts) == sorted(f"r{i}@{DOMAIN}" for i in range(20))
    assert ok["flushed"] == 20
    assert queued_entries(queue) == []


def queued_entries_live(r: RelayThread) -> list[EntryInfo]:
    """The QUEUED entries of the running relay's queue (its own store, read only)."""
    return [info for _, info in r.call(lambda: list(listing(r.relay.store)))]


def test_etrn_ends_the_wait_at_once(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    fill(queue, 3)
    with Sink() as mx:
        mx.state.at["connect"] = DOWN
        with RelayThread(relay_config(queue, transport_maps={DOMAIN: f"[127.0.0.1]:{mx.port}"},
                                      ondemand_domains=[DOMAIN], log_json=True,
                                      minimal_backoff_time=600.0, maximal_backoff_time=600.0)
                         ) as r:
            r.wait_events(3, status="deferred", timeout=10)
            # a deferral is logged just before its send_cancel: wait until all three are
            # queued again, else ETRN may find nothing waiting yet (251)
            deadline = time.monotonic() + 10
            while r.call(lambda: r.relay.scheduler.sizes()["inflight"]):
                assert time.monotonic() < deadline, "the deferred entries stayed in flight"
                time.sleep(0.02)
            del mx.state.at["connect"]
            with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
                c.ehlo("flaky.example")
                assert c.docmd("ETRN", DOMAIN)[0] == 250
            got = mx.wait_for(3, timeout=10)
    assert len([x for m in got for x in m.rcpts]) == 3


def test_a_stop_as_mail_is_parked_ends_the_prober(tmp_path: Path) -> None:
    """The prober's wait ends when mail is parked and when the relay stops; both in the
    same turn of the loop (a delivery deferred as the relay stops) once lost the stop:
    ``asyncio.wait_for`` on Python 3.11 returns the event's result and swallows the
    cancellation, and the prober waited for ever (a CI run timed out in ``stop``)."""
    with Sink() as mx:
        mx.state.at["connect"] = DOWN
        config = relay_config(str(tmp_path / "q"), ondemand_domains=[DOMAIN],
                              transport_maps={DOMAIN: f"[127.0.0.1]:{mx.port}"},
                              log_json=True, minimal_backoff_time=600.0,
                              maximal_backoff_time=600.0)
        with RelayThread(config) as r:
            r.wait_events(1, "probe", status="failed")  # the probe at start; next in 600 s
            prober = r.relay.prober

            async def park_and_stop() -> bool:
                prober._event.set()  # what ``parked`` does, in the turn the stop starts
                stop = asyncio.ensure_future(prober.stop(r.relay))
                done, _ = await asyncio.wait({stop}, timeout=5)
                return bool(done)

            stopped = asyncio.run_coroutine_threadsafe(park_and_stop(), r._loop).result(10)
            assert stopped, "the prober went on waiting after its task was cancelled"
            assert prober._task is None
