"""The relay on each backend, and its Prometheus metrics on a loopback port."""

from __future__ import annotations

import smtplib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.relay_support import RelayThread, Sink, relay_config


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize("backend", ["fs", "fs-fsync", "kv-log", "kv-leveldb"])
def test_relay_on_each_backend_with_metrics(tmp_path, backend):
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), backend=backend, relayhost=f"[127.0.0.1]:{sink.port}",
            metrics_listen="127.0.0.1:0", log_json=True)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            for i in range(3):
                c.sendmail("a@example.org", [f"b{i}@example.net", "reject-x@example.net"],
                           b"Subject: m\r\n\r\nhi\r\n")
        sink.wait_for(6)  # three messages, three bounces
        r.wait_events(3, status="bounced")
        r.wait_events(6, status="sent")
        assert r.relay.metrics_port is not None
        m = scrape(r.relay.metrics_port)
    assert m[("queue_ref_relay_deliveries_total", (("outcome", "sent"),))] == 6
    assert m[("queue_ref_relay_deliveries_total", (("outcome", "bounced"),))] == 3
    assert m[("queue_ref_relay_received_messages_total", ())] == 3
    assert m[("queue_ref_relay_commit_seconds_count", ())] == 3
    assert m[("queue_ref_relay_delivery_seconds_count", ())] == 6
    assert m[("queue_ref_relay_queue_entries", (("state", "queued"),))] == 0
    assert ("queue_ref_relay_queue_entries", (("state", "inflight"),)) in m
    if backend.startswith("fs"):
        rounds = m[("queue_ref_group_commit_rounds_total", ())]
        served = m[("queue_ref_group_commit_requests_total", ())]
        # a commit with a step after its first round (the link, in syncfs mode) is one
        # request served by two rounds, so rounds may exceed requests, never twice them
        assert 0 < rounds <= 2 * served


def test_concurrent_sessions_share_group_commit_rounds(tmp_path):
    import threading

    from queue_ref.relay.relay_metrics import group_commit_counts

    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}",
            metrics_listen="127.0.0.1:0", log_json=True)) as r:
        before = group_commit_counts(r.relay.store)
        assert before is not None

        def client() -> None:
            with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as c:
                for _ in range(5):
                    c.sendmail("a@example.org", ["b@example.net"], b"Subject: m\r\n\r\nhi\r\n")

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        sink.wait_for(40)
        r.wait_events(40, status="sent")
        assert r.relay.metrics_port is not None
        for _ in range(50):  # the metrics, read while no sync round runs: the store's counts
            after = group_commit_counts(r.relay.store)
            m = scrape(r.relay.metrics_port)
            if group_commit_counts(r.relay.store) == after:
                break
    assert after is not None
    assert m[("queue_ref_group_commit_rounds_total", ())] == after[0]
    assert m[("queue_ref_group_commit_requests_total", ())] == after[1]
    rounds, served, sizes = after[0] - before[0], after[1] - before[1], after[2]
    # a commit alone takes two rounds (its data, then its link), so rounds are fewer
    # than twice the requests only because rounds were shared: some served several
    assert served >= 40 and rounds < 2 * served, (rounds, served)
    assert max(sizes) >= 2, sizes



def test_mail_delivered_while_a_listing_ran_is_not_claimed_again(tmp_path):
    """A message that arrives and is delivered while a scan lists the queue (the listing
    is stopped until then) is not taken back into the window when the scan ends: the scan
    adds back what was pushed meanwhile, less what was claimed since.  Taken back, the
    ``queued`` gauge counted it and a job claimed the consumed entry again."""
    import threading
    import time

    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}",
            metrics_listen="127.0.0.1:0", log_json=True, queue_scan_interval=0.2)) as r:
        sched = r.relay.scheduler
        assert sched is not None
        listing, go_on = threading.Event(), threading.Event()
        real_list, real_claim = sched._list_window, sched._claim
        claimed: list[str] = []

        def paused_listing():  # a storage thread: stopped until the mail was delivered
            listing.set()
            assert go_on.wait(30)
            return real_list()

        def counted_claim(handles):
            claimed.extend(h.entry_id for h in handles)
            return real_claim(handles)

        sched._claim = counted_claim
        sched._list_window = paused_listing
        assert listing.wait(10), "no scan started"
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            c.sendmail("a@example.org", ["b@example.net"], b"Subject: m\r\n\r\nhi\r\n")
        sink.wait_for(1)
        r.wait_events(1, status="sent")
        assert sched._scanning and len(claimed) == 1
        sched._list_window = real_list
        go_on.set()
        deadline = time.monotonic() + 1.0  # a stale handle is due now: claimed at once
        while time.monotonic() < deadline and len(claimed) == 1:
            time.sleep(0.01)
        assert claimed == claimed[:1], "the delivered entry was claimed again"
        assert sched.sizes()["queued"] == 0
        assert r.relay.metrics_port is not None
        m = scrape(r.relay.metrics_port)
    assert m[("queue_ref_relay_queue_entries", (("state", "queued"),))] == 0
