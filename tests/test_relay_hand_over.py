"""The scheduler's hand-over of a job's outcomes (``_hand_over``, C15's batch) when
something fails on the way: nothing delivered goes back to the queue, nothing the batch
finished is left behind (a memory queue, a real scheduler, no network)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from queue_ref.memory import MemoryStorage
from queue_ref.relay import delivery_scheduler
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.delivery_scheduler import DeliveryScheduler, _Entry, _Job
from queue_ref.relay.smtp_delivery import RcptResult
from queue_ref.storage import InflightMail, Recipient, Schedule
from tests.relay_support import relay_config
from tests.test_send_finish import SecondDoneFails


def _job(store: MemoryStorage, rcpts: list[str]) -> tuple[_Job, list[InflightMail]]:
    with store.enqueue("s@example.org", {"arrival": "0"}) as enq:
        enq.write(b"Subject: x\r\n\r\nbody\r\n")
        queued = enq.commit([Recipient(r, Schedule(0)) for r in rcpts])
    mails = [store.send_start(q) for q in queued]
    assert all(mails)
    job = _Job(mails[0].message_id, "s@example.org", {"arrival": "0"},  # type: ignore[union-attr]
               b"body")
    job.entries = [_Entry(m, r, m.schedule) for m, r in zip(mails, rcpts, strict=True)]  # type: ignore[arg-type]
    return job, mails  # type: ignore[return-value]


def test_an_error_while_logging_outcomes_still_hands_them_over(tmp_path: Path) -> None:
    """Something raises after the sent recipient was logged (here the on-demand hook of
    the deferred one): the sent entry is finished, not put back as unsettled (it would be
    delivered again), and the deferred one is back in the queue."""
    store = MemoryStorage()
    out = io.StringIO()
    s = DeliveryScheduler(store, relay_config(str(tmp_path / "q"),
                                              ondemand_domains=["parked.test"]),
                          None, None, DeliveryLog(json_lines=True, stream=out),  # type: ignore[arg-type]
                          None, clock=lambda: 1.0)

    def boom(domain: str) -> None:
        raise RuntimeError("Event loop is closed")

    s.on_parked = boom
    job, mails = _job(store, ["ok@ok.test", "p@parked.test"])
    requeued = s._finish(job, [(job.entries[0], RcptResult(250, "2.0.0", "ok", "mx.ok.test")),
                               (job.entries[1], RcptResult(450, "4.0.0", "later", "mx"))])
    assert [h.entry_id for h in requeued] == [mails[1].entry_id]
    assert [q.entry_id for q in store.list_queue()] == [mails[1].entry_id]
    assert list(store.find_pending_cleanup()) == []  # the sent entry cleaned up
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["status"] for e in events if e["event"] == "delivery"
            and e["to"] == "ok@ok.test"] == ["sent"]


def test_what_a_failed_batch_finished_is_cleaned_up_and_the_rest_goes_alone(
        tmp_path: Path) -> None:
    """The batch fails on its second entry after the first moved: the first is cleaned
    up through the handle the error gave back, the others are finished one by one."""
    store = SecondDoneFails()
    out = io.StringIO()
    s = DeliveryScheduler(store, relay_config(str(tmp_path / "q")), None, None,  # type: ignore[arg-type]
                          DeliveryLog(json_lines=True, stream=out), None, clock=lambda: 1.0)
    job, _ = _job(store, ["a@ok.test", "b@ok.test", "c@ok.test"])
    s._hand_over(job, job.entries, [], [])
    assert list(store.find_pending_cleanup()) == []
    assert list(store.list_queue()) == []
    assert store.footprint().objects == 0
    errors = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["what"] for e in errors if e["event"] == "error"] == ["send_finish"]


def test_a_jobs_outcome_lines_go_to_the_log_in_one_write(tmp_path: Path) -> None:
    """A 100-recipient job: its hundred ``delivery`` lines reach the log stream in one
    write, sent and deferred alike, in outcome order."""
    store = MemoryStorage()
    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    s = DeliveryScheduler(store, relay_config(str(tmp_path / "q")), None, None,  # type: ignore[arg-type]
                          DeliveryLog(json_lines=True, stream=Stream()), None, clock=lambda: 1.0)
    rcpts = [f"r{i}@ok.test" for i in range(100)]
    job, _ = _job(store, rcpts)
    results = [RcptResult(250, "2.0.0", "ok", "mx") if i % 3 else
               RcptResult(450, "4.0.0", "later", "mx") for i in range(100)]
    s._finish(job, list(zip(job.entries, results, strict=True)))
    batches = [w for w in writes if '"delivery"' in w]
    assert len(batches) == 1
    lines = [json.loads(x) for x in batches[0].splitlines()]
    assert len(lines) == 100
    assert {x["to"]: x["status"] for x in lines} == {
        r: ("sent" if i % 3 else "deferred") for i, r in enumerate(rcpts)}


def test_the_scheduler_keeps_the_newest_wire_ready_messages_and_gives_each_to_one_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``add(..., wire_ready=True)`` notes the message for the job that claims it (its
    delivery then skips the line checks and the dot-stuffing); at most WIRE_READY_KEPT messages are noted, the
    oldest dropped first (another process of a shared queue may deliver them), and a
    note is taken once: the job of an evicted message, or of one added without it, makes
    the checks."""
    monkeypatch.setattr(delivery_scheduler, "WIRE_READY_KEPT", 3)
    store = MemoryStorage()
    s = DeliveryScheduler(store, relay_config(str(tmp_path / "q")), None, None,  # type: ignore[arg-type]
                          DeliveryLog(json_lines=True, stream=io.StringIO()), None,
                          clock=lambda: 1.0)
    messages = []
    for i in range(5):
        with store.enqueue("s@example.org", {"arrival": "0"}) as enq:
            enq.write(b"Subject: x\r\n\r\nbody\r\n")
            messages.append(enq.commit([Recipient(f"r{i}@ok.test", Schedule(0))]))
    for i, handles in enumerate(messages):
        s.add(handles, wire_ready=i != 3)
    ready = {}
    for i, handles in enumerate(messages):
        job = s._claim(handles)
        assert job is not None
        ready[i] = job.wire_ready
    assert ready == {0: False, 1: True, 2: True, 3: False, 4: True}  # 0 evicted
    assert s._wire_ready == {}
