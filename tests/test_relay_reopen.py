"""A failed sync under a running relay (C9, fsyncgate): the queue refuses every change
with ReopenRequiredError, so the relay closes it and opens it again by itself, in the
same process and on the same port, instead of answering 451 until someone restarts it.
Nothing acknowledged before the failure is lost; the message whose commit failed got a
451 and arrives once its client sends it again."""

from __future__ import annotations

import re
import smtplib
import time
from pathlib import Path

import pytest

from tests.relay_failing_disk import open_trigger_of, trigger_of
from tests.relay_support import Sink, relay_process


def send(port: int, subject: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as c:
        c.sendmail("a@example.org", ["b@example.net"],
                   f"Subject: {subject}\r\n\r\nbody\r\n".encode())


def wait_log(proc, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in proc.err_lines):
        assert proc.poll() is None, "the relay exited"
        assert time.monotonic() < deadline, f"no {text!r} in the relay's log"
        time.sleep(0.05)


@pytest.mark.parametrize(("backend", "processes"), [("fs", 1), ("kv_log", 1), ("fs", 2)])
def test_a_failed_sync_makes_the_relay_reopen_its_queue_and_go_on(tmp_path: Path,
                                                                  backend: str,
                                                                  processes: int) -> None:
    """With ``--processes 2`` the worker whose commit failed reopens its own queue while
    the other goes on; the next commit may land on either."""
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(
            ["--queue", queue, "--listen", "127.0.0.1:0", "--backend",
             f"tests.relay_failing_disk:{backend}", "--processes", str(processes),
             "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (proc, port):
        send(port, "before")
        sink.wait_for(1)
        wait_log(proc, "status=sent")
        time.sleep(1.0)  # its cleanup synced too: the next sync is the next commit's
        Path(trigger_of(queue)).touch()  # the next sync of the queue fails
        try:
            send(port, "during")
            refused = None
        except smtplib.SMTPDataError as e:
            refused = e.smtp_code
        wait_log(proc, "reopened the queue")
        if refused is not None:
            assert refused == 451  # never a 250 for a commit whose sync failed
            send(port, "during")  # the client tries again, on the same port
        else:  # the sync that failed was another's (a slow cleanup): no commit was hurt
            assert processes > 1 or "what=cleanup" in "".join(proc.err_lines)
        send(port, "after")
        sink.wait_for(3)
        time.sleep(0.5)  # a copy of the failed commit, if recovery kept it, arrives too
        subjects = [re.search(rb"^Subject: (\w+)", m.data, re.M).group(1)  # type: ignore[union-attr]
                    for m in sink.wait_for(3)]
        assert proc.poll() is None
    assert subjects.count(b"before") == 1 and subjects.count(b"after") == 1
    assert subjects.count(b"during") in (1, 2)  # at least once: the failed commit may survive
    assert len(subjects) in (3, 4)
    err = "".join(proc.err_lines)
    assert "ReopenRequiredError" in err and "reopening the queue" in err


def test_a_reopening_that_fails_is_tried_again(tmp_path: Path) -> None:
    """The queue cannot be opened again at the first try (the disk is not back yet): the
    relay logs the failure with the wait before the next try (1 s, then doubling), tries
    again and goes on."""
    queue = str(tmp_path / "q")
    with Sink() as sink, relay_process(
            ["--queue", queue, "--listen", "127.0.0.1:0", "--backend",
             "tests.relay_failing_disk:fs", "--relayhost", f"[127.0.0.1]:{sink.port}"]
            ) as (proc, port):
        send(port, "before")
        sink.wait_for(1)
        wait_log(proc, "status=sent")
        time.sleep(1.0)  # its cleanup synced too: the next sync is the next commit's
        Path(open_trigger_of(queue)).touch()  # the first reopening fails
        Path(trigger_of(queue)).touch()  # the next sync of the queue fails
        with pytest.raises(smtplib.SMTPDataError) as refused:
            send(port, "during")
        assert refused.value.smtp_code == 451
        wait_log(proc, "reopened the queue", timeout=15)
        send(port, "after")
        sink.wait_for(2)
        assert proc.poll() is None
    err = "".join(proc.err_lines)
    assert re.search(r"what=reopening the queue, retry_in=1\.00 \(StorageIOError: .*injected EIO", err), \
        err[-2000:]
    assert not Path(open_trigger_of(queue)).exists()
