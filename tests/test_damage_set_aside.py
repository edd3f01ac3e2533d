"""Damage a listing finds is said, never passed over in silence: the filesystem queue sets
aside (quarantines) a message whose envelope fails its checksum when a listing reads it,
and skips it; ``Storage.set_aside`` names it, ``mailq``, ``flush`` and the other operator
commands print it (or what the recovery that opened the queue set aside), and a running
relay logs it (``error``, ``what=damaged``).  Before, a
byte flipped in a deferred message's envelope made it vanish from ``mailq`` and from the
relay's queue with nothing said (a tester's finding)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from conformance.cli import main
from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import RelayThread, relay_config
from tests.test_relay_waiting_bodies import flip_a_bit

LATER = int(time.time()) + 3600


def deferred_mail(queue: str, n: int) -> list[str]:
    """``n`` messages of two recipients, due in an hour; their ids."""
    ids = []
    with open_queue(queue, "fs") as q:
        for i in range(n):
            with q.enqueue(f"s{i}@example.org") as enq:
                enq.write(b"Subject: m%d\r\n\r\nbody\r\n" % i)
                ids.append(enq.commit([Recipient(f"u{j}@example.net", Schedule(LATER, 1))
                                       for j in range(2)])[0].message_id)
    return ids


def damage_envelope(queue: str, mid: str) -> None:
    """One bit flipped in the envelope kept at the end of the message file."""
    flip_a_bit(os.path.join(queue, "data", mid), from_end=40)


@pytest.mark.parametrize("command", [["mailq"], ["mailq", "--json"], ["qshape"],
                                     ["flush"], ["requeue", "ALL"]])
def test_an_operator_command_says_what_its_listing_set_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    queue = str(tmp_path / "q")
    ids = deferred_mail(queue, 3)
    damage_envelope(queue, ids[1])
    assert main([*command, "--queue", queue]) == 0
    err = capsys.readouterr().err
    # by the listing (mailq, qshape: no recovery) or by the recovery that opened the queue
    said = [line for line in err.splitlines()
            if "damaged, set aside" in line or "set damage aside" in line]
    assert said and all(ids[1] in line for line in said), err
    assert os.path.exists(os.path.join(queue, "quarantine", f"{ids[1]}.msg"))
    # said once: the next command finds nothing more to say
    assert main(["mailq", "--queue", queue]) == 0
    assert "damaged" not in capsys.readouterr().err


def test_a_running_relay_logs_what_its_scan_set_aside(tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    ids = deferred_mail(queue, 3)
    with RelayThread(relay_config(queue, relayhost="[127.0.0.1]:9", log_json=True)) as r:
        deadline = time.monotonic() + 10
        while r.call(lambda: r.relay.scheduler.sizes())["queued"] != 6:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        damage_envelope(queue, ids[2])
        r.wake()  # SIGUSR1: a scan of the queue
        [rec] = r.wait_events(1, event="error", what="damaged", timeout=10)
    assert rec["queue_id"] == ids[2] and rec["entry_id"].startswith(ids[2])
    assert rec["reason"].startswith("set aside: ") and "quarantine" in rec["reason"]
    records = [json.loads(line) for line in r.log_lines]
    assert not any(e["event"] == "delivery" and e["queue_id"] == ids[2] for e in records)
