"""The scheduler's bounded active window (``qmgr_message_active_limit``) and a start that
does not wait for the queue: a real filesystem queue, the relay in a thread, an aiosmtpd
sink as the next hop."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref import opener
from queue_ref.fsqueue import FsQueue
from queue_ref.opener import open_queue
from queue_ref.relay.relay_config import ConfigError, RelayConfig
from queue_ref.storage import QueuedMail, Recipient, Schedule
from tests.relay_support import RelayThread, Sink, relay_config, smtp_send

#: Opened by ``slow_listing_queue``: its listings wait until this is set.
LISTING_GATE = threading.Event()


class _SlowListing(FsQueue):
    def list_queue(self) -> Iterator[QueuedMail]:
        if not LISTING_GATE.wait(60):
            raise AssertionError("the listing was never let go")
        yield from super().list_queue()


def slow_listing_queue(path: str) -> FsQueue:
    """A filesystem queue whose ``list_queue`` waits for ``LISTING_GATE`` (a backend
    factory, ``backend = "tests.test_relay_active_window:slow_listing_queue"``)."""
    return _SlowListing(path)


def fill(queue: str, dues: list[int]) -> list[str]:
    """One message of one recipient per due time (in this order); their recipients."""
    rcpts = []
    with open_queue(queue, "fs") as q:
        for i, at in enumerate(dues):
            with q.enqueue("s@example.org", {"arrival": f"{time.time():.3f}"}) as enq:
                enq.write(b"Subject: window\r\n\r\nbody\r\n")
                enq.commit([Recipient(f"r{i}@example.net", Schedule(at, 1))])
            rcpts.append(f"r{i}@example.net")
    return rcpts


def test_the_window_holds_the_earliest_and_delivers_in_due_order(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    now = int(time.time())
    dues = [now - 1000 + k for k in random.Random(7).sample(range(500), 30)]
    rcpts = fill(queue, dues)
    in_due_order = [r for _, r in sorted(zip(dues, rcpts, strict=True))]
    with Sink() as sink, RelayThread(relay_config(
            queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True, max_deliveries=1,
            qmgr_message_active_limit=4, queue_scan_interval=3600.0)) as r:
        scheduler = r.relay.scheduler
        assert scheduler is not None
        held = []  # the queued entries the scheduler holds, sampled while it delivers
        deadline = time.monotonic() + 60
        while len(sink.state.rcpts()) < 30 and time.monotonic() < deadline:
            held.append(r.call(lambda: len(scheduler._latest)))
            time.sleep(0.01)
        listed = r.wait_events(1, "relay", what="queue listed")
        biggest = max(held)
    assert listed and listed[0]["queued"] == 30 and listed[0]["window"] == 4
    assert biggest <= 4
    assert sink.state.rcpts() == in_due_order  # one at a time, earliest due first


def test_the_relay_is_ready_and_delivers_before_the_first_listing_ends(
        tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    fill(queue, [int(time.time()) + 3600] * 3)  # deferred mail the listing will find
    LISTING_GATE.clear()
    try:
        with Sink() as sink, RelayThread(relay_config(
                queue, backend="tests.test_relay_active_window:slow_listing_queue",
                relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
            assert r.events("relay")[-1]["what"] == "started"  # ready, the listing waits
            smtp_send(r.port, "a@example.org", ["new@example.net"])
            assert [m.rcpts for m in sink.wait_for(1)] == [["new@example.net"]]
            assert not r.events("relay") or all(
                e["what"] != "queue listed" for e in r.events("relay"))
            LISTING_GATE.set()
            listed = r.wait_events(1, "relay", what="queue listed")
            assert listed and listed[0]["queued"] == 3
            assert r.relay.scheduler is not None and r.relay.scheduler.sizes()["queued"] == 3
    finally:
        LISTING_GATE.set()


def test_the_relay_is_ready_before_the_recovery_which_comes_before_the_listing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue every owner closed opens without its recovery: the relay takes and
    delivers mail while the recovery runs beside it, and lists the queue after it (an
    entry a closed owner left inflight is requeued, then delivered)."""
    queue = str(tmp_path / "q")
    with FsQueue(queue) as q:
        with q.enqueue("s@example.org") as enq:
            enq.write(b"Subject: left inflight\r\n\r\nbody\r\n")
            (h,) = enq.commit([Recipient("left@example.net", Schedule(0))])
        assert q.send_start(h) is not None
    gate = tmp_path / "gate"  # the recovery's process waits for this file
    monkeypatch.setattr(opener, "RECOVERY_COMMAND", [
        "sh", "-c", 'while [ ! -e "$0" ]; do sleep 0.02; done; exec "$@"', str(gate),
        *opener.RECOVERY_COMMAND])
    try:
        with Sink() as sink, RelayThread(relay_config(
                queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
            smtp_send(r.port, "a@example.org", ["new@example.net"])
            assert [m.rcpts for m in sink.wait_for(1)] == [["new@example.net"]]
            assert not [e for e in r.events("relay") if e["what"] != "started"]
            gate.touch()
            (recovered,) = r.wait_events(1, "relay", what="queue recovered")
            assert recovered["requeued"] == 1 and recovered["lost"] == 0
            assert r.wait_events(1, "relay", what="queue listed")
            sink.wait_for(2)
            assert sorted(sink.state.rcpts()) == ["left@example.net", "new@example.net"]
            what = [e["what"] for e in r.events("relay")]
            assert what.index("queue recovered") < what.index("queue listed")
    finally:
        gate.touch()


@pytest.mark.parametrize("value", [0, -5])
def test_the_window_must_hold_an_entry(tmp_path: Path, value: int) -> None:
    with pytest.raises(ConfigError, match="qmgr_message_active_limit: must be at least 1"):
        RelayConfig(queue=str(tmp_path / "q"), qmgr_message_active_limit=value).validate()


def test_no_more_entries_are_claimed_than_max_deliveries(tmp_path: Path) -> None:
    """Five due entries, ``max_deliveries = 2`` and a next hop that stalls in DATA: two
    entries are in delivery and three stay queued (claimed, they would wait for a slot
    in delivery while no other process of the queue may take them)."""
    queue = str(tmp_path / "q")
    rcpts = fill(queue, [int(time.time()) - 10] * 5)
    with Sink() as sink:
        for rcpt in rcpts:
            sink.state.script[rcpt] = "slow"  # DATA answered after a minute
        with RelayThread(relay_config(
                queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True, max_deliveries=2,
                shutdown_timeout=1.0)) as r:
            scheduler = r.relay.scheduler
            assert scheduler is not None
            assert r.wait_events(1, "relay", what="queue listed")
            deadline = time.monotonic() + 20
            while sink.state.connections < 2:
                assert time.monotonic() < deadline, "no delivery started"
                time.sleep(0.01)
            for _ in range(20):  # while both deliveries stall
                assert r.call(scheduler.sizes) == {"queued": 3, "inflight": 2, "held": 0}
                time.sleep(0.01)
            assert sink.state.connections == 2


def test_a_message_reaching_the_last_delivery_slot_goes_in_one_transaction(
        tmp_path: Path) -> None:
    """``max_deliveries = 2``, one slot held by a delivery that stalls in DATA: a message
    of five recipients then takes the last slot whole, one job and one transaction (the
    dispatch stopped at the limit after its first entry, and the other four went in a
    second transaction once a slot was free)."""
    queue = str(tmp_path / "q")
    (slow,) = fill(queue, [int(time.time()) - 10])
    wide = [f"w{i}@example.net" for i in range(5)]
    with Sink() as sink:
        sink.state.script[slow] = "slow"  # DATA answered after a minute
        with RelayThread(relay_config(
                queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True, max_deliveries=2,
                shutdown_timeout=1.0)) as r:
            assert r.wait_events(1, "relay", what="queue listed")
            deadline = time.monotonic() + 20
            while sink.state.connections < 1:
                assert time.monotonic() < deadline, "the slow delivery never started"
                time.sleep(0.01)
            smtp_send(r.port, "list@example.org", wide)
            sink.wait_for(1)
            time.sleep(0.3)  # a second transaction of the message would come now
            got = [m for m in sink.state.messages if m.mail_from == "list@example.org"]
            assert [sorted(m.rcpts) for m in got] == [sorted(wide)]


def commit_beside(r: RelayThread, subject: str, rcpts: list[Recipient]) -> list[QueuedMail]:
    """A message committed to the running relay's store, not through SMTP, once its first
    listing is over (so no listing brings the entries): their handles, pushed nowhere."""
    assert r.wait_events(1, "relay", what="queue listed")
    with r.relay.store.enqueue("s@example.org", {"arrival": f"{time.time():.3f}"}) as enq:
        enq.write(b"Subject: %s\r\n\r\nbody\r\n" % subject.encode())
        return enq.commit(rcpts)


def test_a_handle_that_comes_while_a_job_holds_its_entry_is_not_kept(tmp_path: Path) -> None:
    """A listing can find a message before the receiver pushes its handles (the receiver
    commits, the listing sees the entries and a job claims them, then the receiver's
    handles come): those late handles are stale and must not be counted as queued,
    while the handle the job itself queues again (a deferral) is kept.  Forced here on
    the loop: the handles pushed, claimed, and pushed again before the job starts."""
    queue = str(tmp_path / "q")
    with Sink() as sink, RelayThread(relay_config(
            queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
            queue_scan_interval=3600.0,
            # the deferral's retry well after the test: with the tests' 1 s backoff, its
            # whole-second due time could pass (and the retry run) before it was looked at
            minimal_backoff_time=60.0, maximal_backoff_time=120.0)) as r:
        scheduler = r.relay.scheduler
        assert scheduler is not None
        handles = commit_beside(r, "late", [Recipient("ok@example.net", Schedule(0, 0)),
                                            Recipient("defer-x@example.net", Schedule(0, 0))])

        def pushed_twice() -> dict[str, int]:
            scheduler.add(handles)
            scheduler._dispatch()  # the job claims both entries
            scheduler.add(handles)  # the late ones
            return scheduler.sizes()

        assert r.call(pushed_twice) == {"queued": 0, "inflight": 2, "held": 0}
        sink.wait_for(1)
        r.wait_events(1, status="sent")
        r.wait_events(1, status="deferred")
        deadline = time.monotonic() + 10
        while r.call(lambda: scheduler._jobs):
            assert time.monotonic() < deadline, "the job never ended"
            time.sleep(0.01)
        assert r.call(scheduler.sizes) == {"queued": 1, "inflight": 0, "held": 0}
        (kept,) = r.call(lambda: list(scheduler._latest.values()))
    assert kept.entry_id == handles[1].entry_id
    assert kept.schedule.attempts == 1 and kept.schedule.at > time.time()  # the job's own


def test_entries_delivered_over_a_clients_connection_leave_the_window(tmp_path: Path) -> None:
    """ATRN delivers a domain's entries over its client's connection (``run_job``) while
    the window holds them, due later: once delivered they are not counted as queued
    (the window's handles of them were left there, stale, until the next listing)."""
    import asyncio

    from queue_ref.relay.smtp_delivery import RcptResult

    queue = str(tmp_path / "q")
    with RelayThread(relay_config(queue, relayhost="[127.0.0.1]:9", log_json=True,
                                  queue_scan_interval=3600.0)) as r:
        scheduler = r.relay.scheduler
        assert scheduler is not None
        handles = commit_beside(r, "atrn", [Recipient(f"u{i}@odmr.example", Schedule(
            int(time.time()) + 3600, 1)) for i in range(2)])
        r.call(scheduler.add, handles)
        assert r.call(scheduler.sizes)["queued"] == 2

        async def over(mail_from: str, rcpts: list[str], body: bytes,
                       params: dict[str, str]) -> list[RcptResult]:
            return [RcptResult(250, "2.0.0", "250 ok", "client") for _ in rcpts]

        asyncio.run_coroutine_threadsafe(scheduler.run_job(handles, over),
                                         r._loop).result(20)
        assert r.call(scheduler.sizes) == {"queued": 0, "inflight": 0, "held": 0}
        with open_queue(queue, "fs") as q:
            assert list(q.list_queue()) == []
