"""Queue failures seen from SMTP: a full disk answers 452 4.3.1, any other queue error
451 4.3.0, and nothing is half accepted."""

from __future__ import annotations

import os
import shutil
import smtplib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_ref.opener import open_queue
from tests.relay_support import RelayThread, relay_config


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="relay-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    try:
        yield Path(mnt)
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)
        os.rmdir(mnt)


@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_a_full_disk_answers_452_and_keeps_what_got_250(small_disk, backend):
    queue = str(small_disk / "q")
    cfg = relay_config(queue, backend=backend, relayhost="[127.0.0.1]:9",
                       message_size_limit=50_000_000, minimal_backoff_time=3600,
                       maximal_backoff_time=3600, log_json=True)
    body = b"Subject: big\r\n\r\n" + (b"x" * 998 + b"\r\n") * 500  # 500 KB
    accepted, refused = 0, []
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=30) as c:
        for _ in range(20):
            try:
                c.sendmail("a@example.org", ["b@example.net"], body)
                accepted += 1
            except smtplib.SMTPDataError as e:
                refused.append((e.smtp_code, e.smtp_error))
                break
    assert refused and refused[0] == (452, b"4.3.1 Insufficient system storage"), refused
    assert accepted >= 1
    with open_queue(queue, backend) as q:
        assert len(list(q.list_queue())) == accepted  # no half-accepted message


def test_a_queue_error_answers_451_and_the_relay_goes_on(tmp_path):
    queue = tmp_path / "q"
    cfg = relay_config(str(queue), relayhost="[127.0.0.1]:9", log_json=True)
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=30) as c:
        assert r.wait_events(1, "relay", what="queue listed")  # recovered and listed
        shutil.rmtree(queue / "data")  # the queue's files vanish under it
        with pytest.raises(smtplib.SMTPDataError) as e:
            c.sendmail("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nx\r\n")
        assert (e.value.smtp_code, e.value.smtp_error) == (451, b"4.3.0 Error: queue file write error")
        assert r.events("error")[0]["what"] == "commit"
        assert c.noop()[0] == 250  # the session goes on
