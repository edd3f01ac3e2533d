"""The operator commands on a KV queue a running relay holds: a KV store is opened by one
process only, so ``mailq``, ``qshape``, ``show``, ``hold``, ``release``, ``delete`` and
``flush`` make their Storage calls in the relay, through ``<root>/relay.ctl``
(``relay_control``).  A real ``queue-ref relay`` process, the commands run here: what
they print and change is what they would on a stopped queue, held mail waits, deleted
mail is gone, flushed mail is delivered at once, and the socket answers bad requests
with errors, not by dying."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conformance.cli import main
from queue_ref.opener import open_queue
from queue_ref.operate.relay_control_wire import socket_path
from queue_ref.storage import Recipient, Schedule
from tests.relay_failing_disk import trigger_of as failing_disk_trigger
from tests.relay_support import Sink, relay_process

LATER = int(time.time()) + 3600


def enqueue(queue: str, names: list[str]) -> None:
    """Deferred mail (tried once, due in an hour) to ``NAME@example.net``."""
    with open_queue(queue, "kv-log") as q:
        for n in names:
            with q.enqueue("ops@example.org", {"arrival": f"{time.time():.3f}"}) as enq:
                enq.write(b"Subject: %s\r\n\r\nbody of %s\r\n" % (n.encode(), n.encode()))
                enq.commit([Recipient(f"{n}@example.net", Schedule(LATER, 1, "450 busy"))])


def cmd(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    """A command's JSON lines (it must succeed)."""
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def ids_by_name(capsys: pytest.CaptureFixture[str], *queue: str) -> dict[str, str]:
    """``mailq``: recipient local part -> message id."""
    return {str(m["recipients"][0]["recipient"]).split("@")[0]: str(m["queue_id"])  # type: ignore[index]
            for m in cmd(capsys, "mailq", *queue) if "queue_id" in m}


def relay_args(sink: Sink, *roots: str) -> list[str]:
    return [*(x for r in roots for x in ("--queue", r)), "--backend", "kv-log",
            "--listen", "127.0.0.1:0", "--relayhost", f"[127.0.0.1]:{sink.port}"]


def test_operator_commands_reach_a_running_relays_kv_queue(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = str(tmp_path / "q")
    names = ["keep", "look", "gone", "rest"]
    enqueue(queue, names)
    with Sink() as sink, relay_process(relay_args(sink, queue)) as (rp, _):
        q = ("--queue", queue)
        ids = ids_by_name(capsys, *q)
        assert sorted(ids) == sorted(names)
        listed = [m for m in cmd(capsys, "mailq", *q) if "queue_id" in m]
        assert all(m["recipients"][0]["delay_reason"] == "450 busy" for m in listed)  # type: ignore[index]
        shape = cmd(capsys, "qshape", *q)[-1]
        assert shape["rows"][0] == {"domain": "TOTAL", "counts": [4, 4] + [0] * 9}
        assert cmd(capsys, "hold", *q, ids["keep"])[-1]["changed"] == 1
        [shown] = cmd(capsys, "show", *q, ids["look"], "--body")
        assert shown["body"] == "body of look\r\n" and shown["sender"] == "ops@example.org"
        assert cmd(capsys, "delete", *q, ids["gone"])[-1]["changed"] == 1
        states = {str(m["queue_id"]): m["queue_name"] for m in cmd(capsys, "mailq", *q)
                  if "queue_id" in m}
        assert states == {ids["keep"]: "hold", ids["look"]: "deferred", ids["rest"]: "deferred"}
        flushed = cmd(capsys, "flush", *q)[-1]
        assert flushed["changed"] == 2 and flushed["relay_woken"]
        got = sink.wait_for(2, timeout=20)  # at once, not at the next scan of the queue
        assert sorted(r for m in got for r in m.rcpts) == ["look@example.net", "rest@example.net"]
        assert cmd(capsys, "release", *q, ids["keep"])[-1]["changed"] == 1
        assert cmd(capsys, "flush", *q)[-1]["changed"] == 1
        sink.wait_for(3, timeout=20)
        time.sleep(0.5)
        assert sorted(sink.state.rcpts()) == ["keep@example.net", "look@example.net",
                                              "rest@example.net"]
        rp.terminate()
        assert rp.wait(30) == 0
    assert not os.path.exists(socket_path(queue))  # gone with the relay
    with open_queue(queue, "kv-log") as store:
        assert list(store.list_queue()) == [] and list(store.list_held()) == []
    assert cmd(capsys, "mailq", "--queue", queue)[-1]["messages"] == 0  # opened directly now


def test_a_queue_over_two_roots_served_by_two_workers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--processes 2``: each worker holds one root and serves its socket; a command
    given both roots sees one queue (ids naming their root) and changes either."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    enqueue(roots[0], ["a0", "a1"])
    enqueue(roots[1], ["b0", "b1"])
    with Sink() as sink, relay_process([*relay_args(sink, *roots), "--processes", "2"]) \
            as (rp, _):
        q = ("--queue", roots[0], "--queue", roots[1])
        deadline = time.monotonic() + 20
        while not all(os.path.exists(socket_path(r)) for r in roots):
            assert time.monotonic() < deadline, "the workers serve no control socket"
            time.sleep(0.05)
        # ps names each worker with the one root it serves
        with open(f"/proc/{rp.pid}/task/{rp.pid}/children") as f:
            workers = [int(p) for p in f.read().split()]
        titles = []
        for pid in workers:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                titles.append(f.read().replace(b"\0", b" ").decode().strip())
        assert sorted(t for t in titles if "worker" in t) == [
            f"queue-ref relay: worker {k} of 2 --queue {roots[k]}" for k in (0, 1)]
        ids = ids_by_name(capsys, *q)
        assert sorted(ids) == ["a0", "a1", "b0", "b1"]
        assert {i.split("-")[0] for i in ids.values()} == {"r0", "r1"}
        assert cmd(capsys, "hold", *q, ids["b1"])[-1]["changed"] == 1
        assert cmd(capsys, "flush", *q)[-1]["changed"] == 3
        got = sink.wait_for(3, timeout=20)
        assert sorted(r for m in got for r in m.rcpts) == [
            "a0@example.net", "a1@example.net", "b0@example.net"]
        held = [m for m in cmd(capsys, "mailq", *q) if m.get("queue_name") == "hold"]
        assert [m["queue_id"] for m in held] == [ids["b1"]]


def _ask(s: socket.socket, f: object, request: bytes) -> dict[str, object]:
    s.sendall(request + b"\n")
    reply: dict[str, object] = json.loads(f.readline())  # type: ignore[attr-defined]
    return reply


def test_the_control_socket_refuses_bad_requests_and_is_the_owners_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = str(tmp_path / "q")
    enqueue(queue, ["one"])
    with Sink() as sink, relay_process(relay_args(sink, queue)) as (rp, _):
        path = socket_path(queue)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            f = s.makefile("rb")
            assert _ask(s, f, b"not json")["error"] == "InvalidInputError"
            assert _ask(s, f, b"[1, 2]")["error"] == "InvalidInputError"
            assert _ask(s, f, b'{"op": "send_start"}')["error"] == "InvalidInputError"
            made_up = b'{"op": "drop", "h": {"kind": "queued", "entry_id": "0.0"}}'
            assert _ask(s, f, made_up)["error"] == "MisuseError"  # never given here
            assert _ask(s, f, b'{"op": "more", "cursor": 99}')["error"] == "MisuseError"
            listed = _ask(s, f, b'{"op": "list_queue"}')
            assert listed["end"] and len(listed["items"]) == 1  # type: ignore[arg-type]
            entry = listed["items"][0]["entry_id"]  # type: ignore[index]
            ref = json.dumps({"kind": "queued", "entry_id": entry}).encode()
            held = _ask(s, f, b'{"op": "hold", "h": %s}' % ref)["r"]
            assert held["kind"] == "held"  # type: ignore[index]
            assert _ask(s, f, b'{"op": "hold", "h": %s}' % ref)["error"] == "MisuseError"  # spent
        # the relay took no harm: the commands still work, and see the hold
        [m] = [m for m in cmd(capsys, "mailq", "--queue", queue) if "queue_id" in m]
        assert m["queue_name"] == "hold"
        os.unlink(path)  # a socket that does not answer: refused, naming it
        assert main(["mailq", "--queue", queue]) == 1
        err = capsys.readouterr().err
        assert f"the relay (pid {rp.pid}) works on this KV queue" in err and path in err
        assert "the relay is starting or stopping: try again" in err


def test_a_command_that_does_not_read_its_replies_cannot_hold_the_relays_stop(
        tmp_path: Path) -> None:
    queue = str(tmp_path / "q")
    enqueue(queue, ["one"])
    with Sink() as sink, relay_process(relay_args(sink, queue)) as (rp, _), \
            socket.socket(socket.AF_UNIX) as s:
        s.connect(socket_path(queue))
        s.sendall(b'{"op": "list_queue"}\n' * 5000)  # megabytes of replies, never read
        time.sleep(1)
        started = time.monotonic()
        rp.terminate()
        assert rp.wait(30) == 0
        assert time.monotonic() - started < 15
    assert not os.path.exists(socket_path(queue))


def test_a_failed_request_leaves_the_handle_and_a_scan_keeps_one_batch(
        tmp_path: Path) -> None:
    """A move that fails (a schedule no backend can store) leaves the handle it named
    for the request that follows; a ``scan_queue`` listing (``mailq``) lets go of each
    batch's handles when it reads the next, so the relay holds one batch, not the queue."""
    queue = str(tmp_path / "q")
    enqueue(queue, [f"m{i:04d}" for i in range(1200)])
    with Sink() as sink, relay_process(relay_args(sink, queue)) as _, \
            socket.socket(socket.AF_UNIX) as s:
        s.connect(socket_path(queue))
        f = s.makefile("rb")
        first = _ask(s, f, b'{"op": "scan_queue"}')
        assert len(first["items"]) == 500 and not first["end"]  # type: ignore[arg-type]
        early = json.dumps({"kind": "queued", "entry_id": first["items"][0]["entry_id"]})  # type: ignore[index]
        assert "r" in _ask(s, f, b'{"op": "inspect_entry", "h": %s}' % early.encode())
        cursor = first["cursor"]
        batches = 1
        while not _ask(s, f, b'{"op": "more", "cursor": %d}' % cursor)["end"]:  # type: ignore[str-format]
            batches += 1
        assert batches == 2  # 500, then 500, then the last 200 with its end
        assert _ask(s, f, b'{"op": "inspect_entry", "h": %s}' % early.encode())["error"] == \
            "MisuseError"  # let go with its batch
        listed = _ask(s, f, b'{"op": "list_queue"}')
        ref = json.dumps({"kind": "queued", "entry_id": listed["items"][0]["entry_id"]})  # type: ignore[index]
        bad = b'{"op": "reschedule", "h": %s, "schedule": [1e400, 0, ""]}' % ref.encode()
        assert "error" in _ask(s, f, bad)
        good = b'{"op": "reschedule", "h": %s, "schedule": [%d, 0, ""]}' % (ref.encode(), LATER)
        assert _ask(s, f, good)["r"]["kind"] == "queued"  # type: ignore[index]


def test_a_queue_deeper_than_a_socket_path_is_still_reached(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    queue = str(deep / "q")
    assert len(socket_path(queue)) > 108
    enqueue(queue, ["far"])
    with Sink() as sink, relay_process(relay_args(sink, queue)) as _:
        assert ids_by_name(capsys, "--queue", queue).keys() == {"far"}


def test_a_failed_sync_in_an_operator_call_makes_the_relay_reopen_its_queue(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sync of a ``hold`` made through the socket fails: the relay reopens its queue
    at once, as after a failed sync of its own, and the next command works."""
    queue = str(tmp_path / "q")
    enqueue(queue, ["a", "b"])
    with Sink() as sink, relay_process(
            ["--queue", queue, "--backend", "tests.relay_failing_disk:kv_log", "--listen",
             "127.0.0.1:0", "--relayhost", f"[127.0.0.1]:{sink.port}"]) as (rp, _):
        Path(failing_disk_trigger(queue)).touch()  # the next sync fails (EIO), once
        assert main(["hold", "--queue", queue, "ALL"]) == 1
        capsys.readouterr()
        assert rp.wait_log("reopened the queue")
        # the failed hold left each entry held or queued (C10); the next one holds the rest
        assert cmd(capsys, "hold", "--queue", queue, "ALL")[-1]["changed"] in (1, 2)
        states = [m["queue_name"] for m in cmd(capsys, "mailq", "--queue", queue)
                  if "queue_id" in m]
        assert states == ["hold", "hold"]


def test_mail_in_delivery_is_shown_and_refused_as_such(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A KV store cannot list its inflight entries; the relay's jobs know them: ``mailq``
    through the socket marks the message ``*`` (in delivery), ``qshape`` counts it, and
    ``hold`` refuses it as in delivery, not as an unknown id, as on a filesystem queue."""
    queue = str(tmp_path / "q")
    enqueue(queue, ["busy"])
    with Sink() as sink:
        sink.state.hold = gate = threading.Event()  # the delivery stays in progress
        with relay_process(relay_args(sink, queue)) as _:
            try:
                [mid] = ids_by_name(capsys, "--queue", queue).values()
                assert cmd(capsys, "flush", "--queue", queue)[-1]["changed"] == 1
                deadline = time.monotonic() + 20
                while not sink.state.seen:
                    assert time.monotonic() < deadline, "never delivered"
                    time.sleep(0.05)
                [m] = [m for m in cmd(capsys, "mailq", "--queue", queue) if "queue_id" in m]
                assert m["queue_id"] == mid and m["queue_name"] == "active"
                assert m["recipients"][0]["state"] == "inflight"  # type: ignore[index]
                shape = cmd(capsys, "qshape", "--queue", queue)[-1]
                assert shape["rows"][0]["counts"][0] == 1  # type: ignore[index]
                assert main(["hold", "--queue", queue, mid]) == 2
                assert "in delivery" in capsys.readouterr().err
            finally:
                gate.set()
            sink.wait_for(1)


def test_a_command_on_a_stopped_kv_queue_does_not_keep_a_relay_from_starting(
        tmp_path: Path) -> None:
    """A command opened the stopped store a moment before the relay starts: the relay
    waits for the store's lock (``LOCK_WAIT``) instead of failing to start; a command
    that meets the relay's lock before its socket serves is told to try again."""
    queue = str(tmp_path / "q")
    enqueue(queue, ["one"])
    holder = open_queue(queue, "kv-log")  # as `show --body | slow pager` holds it
    try:
        proc = subprocess.Popen([sys.executable, "-m", "conformance.cli", "relay", "--queue",
                                 queue, "--backend", "kv-log", "--listen", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert proc.poll() is None, proc.communicate()  # still waiting, not failed
    finally:
        holder.close()
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    with open_queue(queue, "kv-log"):  # held by this process: a command is refused
        r = subprocess.run([sys.executable, "-m", "conformance.cli", "mailq", "--queue", queue],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "held by another process" in r.stderr and "try again" in r.stderr


def test_mail_in_delivery_on_a_queue_over_two_roots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--processes 2``: each worker lists its own root's deliveries under that root's
    own ids, so a command given both roots names the message once, with its ``r<k>-``."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    enqueue(roots[0], ["a0"])
    enqueue(roots[1], ["b0"])
    with Sink() as sink:
        sink.state.hold = gate = threading.Event()
        with relay_process([*relay_args(sink, *roots), "--processes", "2"]) as _:
            try:
                q = ("--queue", roots[0], "--queue", roots[1])
                deadline = time.monotonic() + 20
                while not all(os.path.exists(socket_path(r)) for r in roots):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                ids = ids_by_name(capsys, *q)
                assert cmd(capsys, "flush", *q, "--domain", "example.net")[-1]["changed"] == 2
                while len(sink.state.seen) < 2:
                    assert time.monotonic() < deadline + 20, "never delivered"
                    time.sleep(0.05)
                listed = {str(m["queue_id"]): m["queue_name"] for m in cmd(capsys, "mailq", *q)
                          if "queue_id" in m}
                assert listed == {ids["a0"]: "active", ids["b0"]: "active"}
            finally:
                gate.set()
            sink.wait_for(2)


def test_a_big_body_is_read_through_the_socket_a_piece_at_a_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``show --body`` of a 5 MB message on a running relay's KV queue prints it whole,
    fetched a piece (``BODY_PIECE``) a request: no reply line holds the body; a second
    reader of the same entry starts at its beginning, whatever the first left."""
    from queue_ref.operate.relay_control_client import RelayControlStorage
    from queue_ref.operate.relay_control_wire import BODY_PIECE

    queue = str(tmp_path / "q")
    body = b"Subject: big\r\n\r\n" + b"".join(b"%07d %s\r\n" % (i, b"y" * 60)
                                               for i in range(75_000))
    with open_queue(queue, "kv-log") as q, q.enqueue("ops@example.org") as enq:
        enq.write(body)
        mid = enq.commit([Recipient("big@example.net", Schedule(LATER, 1, "450 busy"))])[0] \
            .message_id
    with Sink() as sink, relay_process(relay_args(sink, queue)):
        [shown] = cmd(capsys, "show", "--queue", queue, mid, "--body")
        assert shown["body"].encode() == body.split(b"\r\n\r\n", 1)[1]  # after the headers
        store = RelayControlStorage(queue)
        try:
            lines: list[int] = []
            call = store._reply_to

            def counted(op: str, **args: object) -> dict[str, object]:
                reply = call(op, **args)
                lines.append(len(json.dumps(reply)))
                return reply

            store._reply_to = counted  # type: ignore[method-assign]
            [h] = list(store.list_queue())
            first = store.inspect_entry(h)
            assert first is not None and first.read(100) == body[:100]
            again = store.inspect_entry(h)
            assert again is not None and again.read_all() == body
            assert max(lines) < BODY_PIECE * 4 // 3 + 1000, max(lines)
            assert len(lines) >= len(body) // BODY_PIECE
        finally:
            store.close()
