"""Another process of a shared queue claims an entry and is killed holding it: the running
relay's next listing finds the dead owner's entry (``find_inflight``), puts it back and
delivers it at once, in that same scan (not a scan later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayThread, Sink, relay_config

CLAIMER = """
import sys, time
from queue_ref.opener import open_queue
q = open_queue(sys.argv[1], "fs")
h = next(h for h in q.list_queue() if h.entry_id == sys.argv[2])
assert q.send_start(h) is not None
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_dead_owners_entry_is_delivered_in_the_scan_that_finds_it(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    with Sink() as sink, RelayThread(relay_config(
            queue, relayhost=f"[127.0.0.1]:{sink.port}", log_json=True,
            queue_scan_interval=3600.0)) as r:
        assert r.wait_events(1, "relay", what="queue listed")
        with open_queue(queue, "fs") as q, q.enqueue("a@example.org") as enq:
            enq.write(b"Subject: orphan\r\n\r\nbody\r\n")
            # due now, but the relay lists the queue only when woken: the child claims it
            h = enq.commit([Recipient("orphan@example.net", Schedule(0))])[0]
        child = subprocess.Popen([sys.executable, "-c", CLAIMER, queue, h.entry_id],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "claimed"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            assert child.stdout is not None
            child.stdout.close()
        r.wake()  # one scan: the scan interval is an hour
        got = sink.wait_for(1, timeout=20)
    assert [m.rcpts for m in got] == [["orphan@example.net"]]
