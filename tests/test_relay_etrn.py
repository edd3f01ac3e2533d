"""ETRN (RFC 1985) on the relay: a permitted client makes one domain's deferred mail due
now and the relay delivers it at once; others are refused; held mail stays held; the
outcome is counted in the metrics and logged."""

from __future__ import annotations

import smtplib
from pathlib import Path

from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayThread, Sink, relay_config
from tests.test_relay_metrics import scrape

LATER = 10**10  # deferred far beyond the test


def fill(queue: str) -> None:
    with open_queue(queue) as q:
        for dom in ("one.example", "two.example"):
            for i in range(3):
                with q.enqueue("a@example.org", {"arrival": "0"}) as enq:
                    enq.write(b"Subject: deferred\r\n\r\nbody\r\n")
                    enq.commit([Recipient(f"r{i}@{dom}", Schedule(LATER, 3))])
        (h,) = [x for x in q.list_queue() if x.schedule.at == LATER][:1]
        held = q.hold(h)  # r0@one.example: held, ETRN leaves it alone
        assert held is not None


def test_etrn_delivers_one_domain_at_once(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    fill(queue)
    with Sink() as sink, RelayThread(relay_config(
            queue, relayhost=f"[127.0.0.1]:{sink.port}", metrics_listen="127.0.0.1:0",
            log_json=True)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            assert c.docmd("ETRN", "one.example")[0] == 503  # HELO/EHLO first
            code, text = c.ehlo("client.test")
            assert code == 250 and b"ETRN" in text
            assert c.docmd("ETRN", "bad domain!")[0] == 501
            assert c.docmd("ETRN")[0] == 501
            assert c.docmd("ETRN", "#queue")[0] == 458
            code, text = c.docmd("ETRN", "One.Example")
            assert code == 250 and b"one.example" in text
            got = sink.wait_for(2, timeout=10)
            assert sorted(r for m in got for r in m.rcpts) == ["r1@one.example",
                                                               "r2@one.example"]
            assert c.docmd("ETRN", "none.example")[0] == 251
            c.mail("x@example.org")
            assert c.docmd("ETRN", "two.example")[0] == 503  # not inside a transaction
        assert r.relay.metrics_port is not None
        m = scrape(r.relay.metrics_port)
        assert m[("queue_ref_relay_etrn_requests_total", (("outcome", "started"),))] == 1
        assert m[("queue_ref_relay_etrn_requests_total", (("outcome", "empty"),))] == 1
        assert m[("queue_ref_relay_queue_entries", (("state", "held"),))] == 1
        rounds = m[("queue_ref_group_commit_rounds_total", ())]
        assert m[("queue_ref_group_commit_round_size_count", ())] == rounds > 0
        assert m[("queue_ref_group_commit_round_size_sum", ())] == m[
            ("queue_ref_group_commit_requests_total", ())]
    assert len(sink.state.rcpts()) == 2
    # one log record for each ETRN that reached the queue, as operators grep them
    assert [(e["domain"], e["status"], e["entries"], e["client"]) for e in r.events("etrn")] == [
        ("one.example", "started", 2, "127.0.0.1"), ("none.example", "empty", 0, "127.0.0.1")]
    with open_queue(queue) as q:
        left = {(h.schedule.at, h.entry_id) for h in q.list_queue()}
        assert len(left) == 3 and all(at == LATER for at, _ in left)  # two.example untouched
        assert len(list(q.list_held())) == 1


def test_etrn_from_a_client_outside_mynetworks_is_refused(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    fill(queue)
    with Sink() as sink, RelayThread(relay_config(
            queue, relayhost=f"[127.0.0.1]:{sink.port}", mynetworks=["192.0.2.0/24"])) as r, \
            smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("client.test")
        code, text = c.docmd("ETRN", "one.example")
        assert code == 459 and b"not allowed" in text
    assert sink.state.rcpts() == []
    with open_queue(queue) as q:
        assert all(h.schedule.at == LATER for h in q.list_queue())
