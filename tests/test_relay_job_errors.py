"""Nothing a delivery job claims stays claimed, whatever raises (R: every claimed entry is
finished or returned within bounded time).  An unexpected error is injected once at each
step of a job, in a real relay delivering to a real SMTP sink through a real DNS server;
the relay must log it with the queue id, count it, and still deliver or bounce every
recipient without a restart; afterwards a reopened queue holds nothing."""

from __future__ import annotations

import email
import email.policy
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import queue_ref.relay.delivery_scheduler as delivery_scheduler
from queue_ref.opener import open_queue
from queue_ref.relay.dsn_bounce import FailedRecipient, build_dsn, original_looked_at
from tests.relay_faulty_steps import CALLS, io_trigger_of, trigger_of
from tests.relay_support import DnsServer, RelayThread, Sink, relay_config, smtp_send

ZONE = {
    "ok.test": [("MX", (10, "mx.ok.test"))],
    "sender.test": [("MX", (10, "mx.ok.test"))],
    "mx.ok.test": [("A", "127.0.0.1")],
}
STEPS = (*CALLS, "route", "deliver", "build_dsn")


def _config(tmp_path: Path, dns: DnsServer, sink: Sink, **kw: Any) -> Any:
    return relay_config(str(tmp_path / "q"), backend="tests.relay_faulty_steps:fs",
                        dns_nameservers=["127.0.0.1"], dns_port=dns.port, smtp_port=sink.port,
                        log_json=True, queue_scan_interval=1.0, **kw)




def _failing_once(fn: Any) -> Any:
    state = {"armed": True}

    def call(*args: Any, **kw: Any) -> Any:
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected failure")
        return fn(*args, **kw)

    async def acall(*args: Any, **kw: Any) -> Any:
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected failure")
        return await fn(*args, **kw)

    import inspect
    return acall if inspect.iscoroutinefunction(fn) else call


def _wait_drained(rt: RelayThread, timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        sizes = rt.call(rt.relay.scheduler.sizes)
        if (sizes["queued"] == 0 and sizes["inflight"] == 0) or time.monotonic() > deadline:
            return sizes  # type: ignore[no-any-return]
        time.sleep(0.05)


def _left_in(path: Path) -> list[str]:
    """The entries a reopened queue holds (recovery puts back what was left inflight)."""
    store = open_queue(str(path))
    try:
        return [h.entry_id for h in store.list_queue()]
    finally:
        store.close()


@pytest.mark.parametrize("step", STEPS)
def test_an_error_at_any_step_of_a_job_strands_nothing(tmp_path, monkeypatch, step):
    body = b"Subject: three fates\r\n\r\nhello\r\n"
    with DnsServer(ZONE) as dns, Sink() as sink:
        with RelayThread(_config(tmp_path, dns, sink)) as rt:
            sched = rt.relay.scheduler
            if step in CALLS:
                Path(trigger_of(str(tmp_path / "q"), step)).touch()
            elif step == "route":
                sched.router.route = _failing_once(sched.router.route)
            elif step == "deliver":
                sched.deliverer.deliver = _failing_once(sched.deliverer.deliver)
            else:
                monkeypatch.setattr(delivery_scheduler, "build_dsn",
                                    _failing_once(delivery_scheduler.build_dsn))
            qid = smtp_send(rt.port, "alice@sender.test",
                        ["ok@ok.test", "reject@ok.test", "flaky@ok.test"], body)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                got = sink.state.rcpts()
                if {"ok@ok.test", "flaky@ok.test", "alice@sender.test"} <= set(got):
                    break
                time.sleep(0.05)
            sizes = _wait_drained(rt)
            errors = [e for e in rt.events("error") if "delivery job" in e.get("what", "")]
            job_errors = sched.job_errors
            bounced = rt.events("bounce")
        got = sink.state.rcpts()
        assert {"ok@ok.test", "flaky@ok.test", "alice@sender.test"} <= set(got), (step, got)
        assert sizes["queued"] == 0 and sizes["inflight"] == 0, (step, sizes)
    assert not Path(trigger_of(str(tmp_path / "q"), step)).exists(), "the fault never fired"
    # logged with the queue id of the message it concerns, and counted
    assert errors and all(e["queue_id"] for e in errors), (step, errors)
    assert job_errors >= 1
    assert any(e["queue_id"] == qid for e in errors) or any(
        b.get("bounce_id") == e["queue_id"] for b in bounced for e in errors), errors
    bounce = next(m for m in sink.state.messages if m.rcpts == ["alice@sender.test"])
    assert bounce.mail_from == "" and b"reject@ok.test" in bounce.data
    assert _left_in(tmp_path / "q") == []


def test_a_utf8_sender_whose_recipient_is_refused_gets_an_internationalized_bounce(tmp_path):
    body = "Subject: café\r\nFrom: José <jösé@sender.test>\r\n\r\nolá\r\n".encode()
    with DnsServer(ZONE) as dns, Sink() as sink:
        with RelayThread(_config(tmp_path, dns, sink)) as rt:
            qid = smtp_send(rt.port, "jösé@sender.test", ["reject@ok.test"], body,
                        ("SMTPUTF8", "BODY=8BITMIME"))
            got = sink.wait_for(1)
            sizes = _wait_drained(rt)
            delivery = rt.wait_events(1, status="bounced")
        assert sizes["queued"] == 0 and sizes["inflight"] == 0, sizes
    assert delivery and delivery[0]["queue_id"] == qid
    [bounce] = got
    assert bounce.mail_from == "" and bounce.rcpts == ["jösé@sender.test"]
    assert "SMTPUTF8" in bounce.mail_options and "BODY=8BITMIME" in bounce.mail_options
    # internationalized mail (RFC 6532): the headers are UTF-8 as they are
    msg = email.message_from_string(bounce.data.decode("utf-8"), policy=email.policy.SMTPUTF8)
    assert msg["To"].addresses[0].addr_spec == "jösé@sender.test"
    parts = {p.get_content_type(): p for p in msg.walk()}
    assert "message/global-delivery-status" in parts
    status = parts["message/global-delivery-status"].as_string()
    assert "Final-Recipient: utf-8; reject@ok.test" in status
    assert "Action: failed" in status and "Status: 5.1.1" in status
    returned = parts["message/global"].as_string()
    assert "Subject: café" in returned and "olá" in returned
    assert _left_in(tmp_path / "q") == []


def test_a_bounce_too_large_to_return_whole_carries_the_headers_and_says_so(tmp_path):
    big = b"Subject: big\r\n\r\n" + b"x" * 998 + b"\r\n" + (b"y" * 70 + b"\r\n") * 2000
    with DnsServer(ZONE) as dns, Sink() as sink, RelayThread(
            _config(tmp_path, dns, sink, bounce_size_limit=10_000)) as rt:
        smtp_send(rt.port, "alice@sender.test", ["reject@ok.test"], big)
        [bounce] = sink.wait_for(1)
        _wait_drained(rt)
    assert "SMTPUTF8" not in bounce.mail_options
    msg = email.message_from_bytes(bounce.data, policy=email.policy.default)
    types = [p.get_content_type() for p in msg.walk()]
    assert "message/delivery-status" in types and "text/rfc822-headers" in types
    assert b"larger than 10000 bytes" in bounce.data
    assert b"Subject: big" in bounce.data and b"y" * 70 not in bounce.data


def test_a_bounce_returns_at_most_64_kib_of_headers_cut_at_a_line_end():
    from queue_ref.relay.dsn_bounce import MAX_HEADERS, original_headers

    small = b"Subject: s\r\nX-A: 1\r\n\r\nbody\r\n"
    assert original_headers(small) == b"Subject: s\r\nX-A: 1\r\n"
    huge = b"".join(b"X-Filler-%05d: %s\r\n" % (i, b"y" * 60) for i in range(2000)) + b"\r\nbody"
    head = original_headers(huge)
    assert len(head) <= MAX_HEADERS and head.endswith(b"\r\n") and huge.startswith(head)
    assert head.count(b"\r\n") == head.count(b"X-Filler-")  # whole lines only


#: body lengths at the edges: a size limit and one past it, the header cut and past it
EDGES = [n + d for n in (10_000, 50_000, 65_536, 100_000) for d in (-1, 0, 1, 2, 3, 4, 5)]


@settings(deadline=None)
@given(head_lines=st.integers(0, 1400), separator=st.booleans(),
       length=st.one_of(st.integers(0, 120_000), st.sampled_from(EDGES)),
       size_limit=st.sampled_from([0, 10_000, 50_000, 100_000]))
def test_a_dsn_built_from_the_prefix_it_looks_at_is_the_dsn_of_the_whole(
        head_lines, separator, length, size_limit):
    """``original_looked_at``: a big body is read no further than that for its DSN (a
    streamed body's headers only), and the report is the one the whole body gives."""
    head = b"".join(b"X-H-%05d: %s\r\n" % (i, b"v" * 40) for i in range(head_lines))
    body = head + (b"\r\n" if separator else b"") + (b"b" * 70 + b"\r\n") * (length // 72)
    body = body[:length] + b"p" * (length - len(body))
    failed = [FailedRecipient("r@ok.test", "5.1.1", "550 5.1.1 no", "mx.ok.test", 1.0)]

    def dsn(original: bytes) -> bytes:
        out = build_dsn(reporting_mta="relay.test", queue_id="Q", sender="s@ok.test",
                        arrival=0.0, recipients=failed, original=original, now=1.0,
                        size_limit=size_limit)
        boundary = re.search(rb'boundary="([^"]+)"', out)
        assert boundary is not None
        out = re.sub(rb"Message-ID: <[0-9a-f]+@", b"Message-ID: <M@", out)
        return out.replace(boundary.group(1), b"B")

    assert dsn(body[:original_looked_at(size_limit)]) == dsn(body)


def test_a_batch_the_disk_fails_is_handed_over_entry_by_entry(tmp_path):
    """send_finish fails as a disk does (StorageIOError, every handle given back): the
    relay logs it with the queue id and makes each transition on its own, so the sent
    recipient is not sent again, the deferred one is retried and the bounce goes out."""
    body = b"Subject: batch lost\r\n\r\nhello\r\n"
    with DnsServer(ZONE) as dns, Sink() as sink:
        with RelayThread(_config(tmp_path, dns, sink)) as rt:
            Path(io_trigger_of(str(tmp_path / "q"))).touch()
            qid = smtp_send(rt.port, "alice@sender.test",
                            ["ok@ok.test", "reject@ok.test", "flaky@ok.test"], body)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if {"ok@ok.test", "flaky@ok.test", "alice@sender.test"} <= set(
                        sink.state.rcpts()):
                    break
                time.sleep(0.05)
            sizes = _wait_drained(rt)
            errors = rt.events("error")
            deliveries = rt.events("delivery")
        got = sink.state.rcpts()
    assert not Path(io_trigger_of(str(tmp_path / "q"))).exists(), "the fault never fired"
    assert {"ok@ok.test", "flaky@ok.test", "alice@sender.test"} <= set(got), got
    assert got.count("ok@ok.test") == 1, got  # its send_done was made alone, not repeated
    assert sizes["queued"] == 0 and sizes["inflight"] == 0, sizes
    assert [e for e in errors if e.get("what") == "send_finish" and e["queue_id"] == qid]
    flaky = [d["status"] for d in deliveries if d["to"] == "flaky@ok.test"]
    assert flaky[0] == "deferred" and flaky[-1] == "sent", flaky
    assert _left_in(tmp_path / "q") == []
