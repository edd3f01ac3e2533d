"""The operator commands (mailq, qshape, hold, release, delete, requeue, flush, show)
against real queues the tests fill, in text and JSON, and their answers to bad input."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conformance.cli import main
from queue_ref.fsqueue import FsQueue
from queue_ref.io import OsIO
from queue_ref.opener import (
    PID_FILE,
    open_queue,
    read_relay_pid,
    remove_relay_pid,
    write_relay_pid,
)
from queue_ref.operate import queue_actions as qa
from queue_ref.storage import Recipient, Schedule

BACKENDS = ("fs", "kv-log")
LATER = 10**10  # a schedule far in the future: deferred mail


def fill(path: Path, backend: str) -> list[str]:
    """Five messages of two recipients each (domains d0, d1, d2), deferred; their ids."""
    ids = []
    with open_queue(str(path), backend) as q:
        for i in range(5):
            with q.enqueue(f"s{i}@sender{i % 2}.example", {"ENVID": f"env{i}"}) as enq:
                enq.write(b"From: s%d@sender.example\r\nSubject: message %d\r\n\r\nbody %d\r\n"
                          % (i, i, i))
                hs = enq.commit([Recipient(f"u{j}@d{(i + j) % 3}.example", Schedule(LATER, 2))
                                 for j in range(2)])
            ids.append(hs[0].message_id)
    return ids


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return code, json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def standing_for_the_relay(q: Path) -> Iterator[None]:
    """This process writes and holds the queue's ``relay.pid``, as a running relay does."""
    write_relay_pid(str(q))
    try:
        yield
    finally:
        remove_relay_pid(str(q))


def state(path: Path, backend: str) -> dict[str, tuple[str, Schedule]]:
    with open_queue(str(path), backend) as q:
        return {i.entry_id: (i.state, i.schedule) for _, i in qa.listing(q)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mailq_lists_every_message_in_text_and_json(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    ids = fill(q, backend)
    code, out, _ = run(capsys, "mailq", "--queue", str(q))
    assert code == 0
    assert out.startswith("-Queue ID-")
    for mid in ids:
        assert mid in out
    assert "u0@d0.example" in out and "s0@sender0.example" in out and "attempts 2" in out
    assert out.rstrip().endswith("in 5 Requests, 10 recipients.")
    text_summary = out.rstrip().splitlines()[-1]
    code, out, _ = run(capsys, "mailq", "--queue", str(q), "--json")
    lines = [json.loads(x) for x in out.strip().splitlines()]
    msgs = lines[:-1]
    total = sum(m["message_size"] for m in msgs)
    assert lines[-1] == {"messages": 5, "recipients": 10, "bytes": total}
    assert text_summary.startswith(f"-- {(total + 1023) // 1024} Kbytes in 5 Requests")
    # as the backend finds them (the fs queue: directory order), each message once with
    # both its recipients
    assert sorted(m["queue_id"] for m in msgs) == sorted(ids)
    assert all(len(m["recipients"]) == 2 for m in msgs)
    first = next(m for m in msgs if m["queue_id"] == ids[0])
    assert first["sender"] == "s0@sender0.example" and first["params"] == {"ENVID": "env0"}
    assert first["message_size"] == len(b"From: s0@sender.example\r\nSubject: message 0\r\n"
                                        b"\r\nbody 0\r\n")
    assert abs(first["arrival_time"] - time.time()) < 600
    assert [r["recipient"] for r in first["recipients"]] == ["u0@d0.example", "u1@d1.example"]
    assert {r["state"] for m in msgs for r in m["recipients"]} == {"queued"}
    assert first["recipients"][0]["next_attempt"] == LATER


@pytest.mark.parametrize("backend", BACKENDS)
def test_mailq_shows_a_message_once_whatever_the_states_and_zones_of_its_entries(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A message partly held, partly queued in two delivery zones and (fs) partly in
    another process's delivery is one request in mailq, with all its recipients, and
    the totals count it once; a message wholly held is one request too."""
    q = tmp_path / "q"
    ids = fill(q, backend)
    with open_queue(str(q), backend) as store:
        with store.enqueue("list@example.org") as enq:
            enq.write(b"Subject: list\r\n\r\nbody\r\n")
            mixed = enq.commit([Recipient(f"m{j}@d{j % 3}.example", Schedule(LATER, 1),
                                          zone="slow" if j % 2 else "default")
                                for j in range(6)])[0].message_id
        for h in list(store.list_queue()):
            if h.entry_id in (f"{mixed}.1", f"{mixed}.4") or h.message_id == ids[4]:
                assert store.hold(h) is not None
    states = {f"{mixed}.{j}": "queued" for j in range(6)}
    states[f"{mixed}.1"] = states[f"{mixed}.4"] = "held"
    with contextlib.ExitStack() as stack:
        if backend == "fs":  # another owner's claim, as a relay's (one KV process at once)
            sender = stack.enter_context(FsQueue(str(q)))
            (h,) = [h for h in sender.list_queue() if h.entry_id == f"{mixed}.2"]
            assert sender.send_start(h) is not None
            states[f"{mixed}.2"] = "inflight"
        _, out, _ = run(capsys, "mailq", "--queue", str(q), "--json")
        *msgs, total = [json.loads(x) for x in out.strip().splitlines()]
        _, text, _ = run(capsys, "mailq", "--queue", str(q))
    assert sorted(m["queue_id"] for m in msgs) == sorted([*ids, mixed])
    assert total["messages"] == 6 and total["recipients"] == 16
    (m,) = [m for m in msgs if m["queue_id"] == mixed]
    assert {r["entry_id"]: r["state"] for r in m["recipients"]} == states
    assert [r["recipient"] for r in m["recipients"]] == [f"m{j}@d{j % 3}.example"
                                                         for j in range(6)]
    (h4,) = [m for m in msgs if m["queue_id"] == ids[4]]
    assert {r["state"] for r in h4["recipients"]} == {"held"}
    assert text.rstrip().endswith("in 6 Requests, 16 recipients."), text
    assert sum(line.startswith(mixed) for line in text.splitlines()) == 1, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_hold_release_delete_requeue_by_id_domain_and_all(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    ids = fill(q, backend)
    entry = f"{ids[1]}.0"  # u0@d1.example
    _, res = run_json(capsys, "hold", "--queue", str(q), entry)
    assert res["changed"] == 1 and res["entries"] == [entry]
    _, res = run_json(capsys, "hold", "--queue", str(q), "--domain", "D2.example")
    assert res["changed"] == 3  # the entries of d2 (d0: 3, d1: 4, d2: 3)
    st = state(q, backend)
    held = sorted(k for k, (s, _) in st.items() if s == "held")
    assert entry in held and len(held) == 4
    assert all(sched == Schedule(LATER, 2) for _, sched in st.values())  # schedules kept
    _, out, _ = run(capsys, "mailq", "--queue", str(q))
    assert "held)" in out
    # qshape of held entries only: d2 and the one d1 entry
    _, shape = run_json(capsys, "qshape", "--queue", str(q), "--held")
    rows = {r["domain"]: r["counts"] for r in shape["rows"]}
    assert rows["TOTAL"][0] == 4 and rows["d2.example"][0] == 3 and rows["d1.example"][0] == 1
    assert rows["TOTAL"][1] == 4  # all younger than 5 minutes
    # by default the other six, as Postfix's qshape counts all but its hold queue
    _, shape = run_json(capsys, "qshape", "--queue", str(q))
    rows = {r["domain"]: r["counts"] for r in shape["rows"]}
    assert rows["TOTAL"][0] == 6 and rows["d0.example"][0] == 3 and rows["d1.example"][0] == 3
    assert "d2.example" not in rows
    _, res = run_json(capsys, "release", "--queue", str(q), ids[1])  # a message id
    assert res["changed"] == 2  # u0@d1 held by id, u1@d2 by domain
    _, res = run_json(capsys, "requeue", "--queue", str(q), ids[0])
    assert res["changed"] == 2
    st = state(q, backend)
    assert st[f"{ids[0]}.0"][1].at <= time.time() + 5 and st[f"{ids[0]}.0"][1].attempts == 2
    _, res = run_json(capsys, "delete", "--queue", str(q), "--domain", "d2.example")
    assert res["changed"] == 3  # queued and held entries alike
    st = state(q, backend)
    assert len(st) == 10 - 3
    assert not any(e.endswith("d2.example") for e in st)
    _, res = run_json(capsys, "delete", "--queue", str(q), "--all")
    assert res["changed"] == 7
    _code, out, _ = run(capsys, "mailq", "--queue", str(q))
    assert out.strip() == "Mail queue is empty"
    with open_queue(str(q), backend) as store:
        assert store.footprint().objects == 0


def test_flush_makes_one_domain_due(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    fill(q, "fs")
    _, res = run_json(capsys, "flush", "--queue", str(q), "--domain", "d0.example")
    assert res["changed"] == 3 and res["relay_woken"] is False  # no relay runs
    st = state(q, "fs")
    due = {k for k, (_, s) in st.items() if s.at < LATER}
    assert len(due) == 3 and all(st[k][1].attempts == 2 for k in due)
    _, res = run_json(capsys, "flush", "--queue", str(q))
    assert res["changed"] == 7 and res["skipped"] == 3  # the first three are due already


def test_show_prints_envelope_recipients_and_headers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    ids = fill(q, "fs")
    code, out, _ = run(capsys, "show", "--queue", str(q), ids[2])
    assert code == 0
    assert "sender: s2@sender0.example" in out and "named_attribute: ENVID=env2" in out
    assert "recipient: u0@d2.example" in out and "recipient: u1@d0.example" in out
    assert "Subject: message 2" in out and "body 2" not in out
    _, shown = run_json(capsys, "show", "--queue", str(q), f"{ids[2]}.1", "--body")
    assert shown["queue_id"] == ids[2] and shown["body"] == "body 2\r\n"
    assert shown["headers"].startswith("From: s2@")


def test_bad_input_one_line_exit_2_nothing_changed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    ids = fill(q, "fs")
    other = tmp_path / "other"
    other_ids = fill(other, "fs")
    before = state(q, "fs")
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("queue = [\n")
    cases = [
        (["hold", "--queue", str(q), ids[0], "nope"], "unknown queue id 'nope'"),
        (["delete", "--queue", str(q), other_ids[0]], "unknown queue id"),  # another queue's
        (["release", "--queue", str(q), "--domain", "bad domain"], "malformed domain"),
        (["flush", "--queue", str(q), "--domain", "a@b.example"], "malformed domain"),
        (["requeue", "--queue", str(q)], "name the entries"),
        (["hold", "--queue", str(q), ids[0], "--all"], "name the entries"),
        (["mailq", "--queue", str(empty)], "is not a queue"),
        (["mailq", "--queue", str(tmp_path / "missing")], "is not a directory"),
        (["mailq", "--queue", str(q), "--backend", "kv-log"], "is not a kv-log queue"),
        (["show", "--queue", str(q), "zzz"], "unknown queue id"),
        (["show", "--queue", str(q), "ALL"], "show takes one queue id"),
        (["mailq", "--config", str(bad_toml)], f"{bad_toml}: "),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (argv, err)
        assert err.count(str(bad_toml)) <= 1, err  # the file named once
        assert out == ""
    assert state(q, "fs") == before
    assert sorted(os.listdir(empty)) == []  # never made a queue there
    assert not (tmp_path / "missing").exists()


def test_a_kv_queue_with_a_running_relay_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    fill(q, "kv-log")
    with standing_for_the_relay(q):
        code, _out, err = run(capsys, "hold", "--queue", str(q), "--all")
    assert code == 1 and f"the relay (pid {os.getpid()}) works on this KV queue" in err
    assert all(s == "queued" for s, _ in state(q, "kv-log").values())


def test_qshape_buckets_by_age_and_sender() -> None:
    now = 10**12 * 60  # ns
    mk = lambda eid, mid, rcpt, sender, minutes: qa.EntryInfo(  # noqa: E731
        eid, mid, "queued", rcpt, 0, "default", sender, {}, Schedule(0), 1,
        now - int(minutes * 60e9))
    infos = [mk("a.0", "a", "x@one.example", "s@s1.example", 1),
             mk("a.1", "a", "y@two.example", "s@s1.example", 1),
             mk("b.0", "b", "x@one.example", "", 7),
             mk("c.0", "c", "x@one.example", "t@s2.example", 5000)]
    rows = dict(qa.qshape(infos, now))
    assert rows["TOTAL"] == [4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert rows["one.example"] == [3, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    by_sender = dict(qa.qshape(infos, now, by="sender"))
    assert by_sender["TOTAL"][0] == 3 and by_sender["MAILER-DAEMON"][2] == 1
    assert list(qa.qshape(infos, now, top=1))[1][0] == "one.example"


def test_the_relay_configuration_names_the_queue(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q"
    ids = fill(q, "kv-log")
    conf = tmp_path / "relay.toml"
    conf.write_text(f'queue = "{q}"\nbackend = "kv-log"\n')
    _, summary = run_json(capsys, "mailq", "--config", str(conf))
    assert summary["messages"] == len(ids)
    _, res = run_json(capsys, "hold", "--config", str(conf), ids[0])
    assert res["changed"] == 2
    code, out, err = run(capsys, "mailq", "--config", str(conf), "--backend", "fs")
    assert code == 2 and out == "" and "is not a fs queue" in err  # --backend wins
    conf.write_text("queue = 3\n")
    for argv in (["mailq", "--config", str(conf)], ["mailq"],
                 ["mailq", "--queue", str(q), "--config", str(conf)]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.parametrize("log_json", [False, True])
def test_actions_given_the_relays_config_are_in_its_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], log_json: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As postsuper's "ID: removed" lands in the mail log beside the deliveries: each
    entry an action changed is an ``operator`` record in the relay's ``log_file``, with
    the program, action and user; what changed nothing writes nothing."""
    q = tmp_path / "q"
    ids = fill(q, "fs")
    mail_log = tmp_path / "mail.log"
    mail_log.write_text("a line the relay wrote\n")
    conf = tmp_path / "relay.toml"
    conf.write_text(f'queue = "{q}"\nlog_file = "{mail_log}"\nlog_json = {str(log_json).lower()}\n')
    assert run(capsys, "hold", "--config", str(conf), ids[0])[0] == 0
    assert run(capsys, "delete", "--config", str(conf), f"{ids[1]}.1")[0] == 0
    assert run(capsys, "release", "--config", str(conf), f"{ids[1]}.0")[0] == 0  # not held
    assert run(capsys, "hold", "--queue", str(q), f"{ids[1]}.0")[0] == 0  # no config: no log
    lines = mail_log.read_text().splitlines()
    assert lines[0] == "a line the relay wrote" and len(lines) == 4, lines
    user = pwd.getpwuid(os.geteuid()).pw_name  # the uid's, whatever USER says
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setenv("LOGNAME", "someone-else")
    monkeypatch.delenv("SUDO_USER", raising=False)
    if log_json:
        records = [json.loads(x) for x in lines[1:]]
        assert [(r["program"], r["queue_id"], r["entry_id"], r["result"], r["user"])
                for r in records] == [
            ("queue-ref/hold", ids[0], f"{ids[0]}.0", "placed on hold", user),
            ("queue-ref/hold", ids[0], f"{ids[0]}.1", "placed on hold", user),
            ("queue-ref/delete", ids[1], f"{ids[1]}.1", "removed", user)]
        assert all(r["event"] == "operator" and r["pid"] for r in records)
    else:
        assert " queue-ref/hold[" in lines[1] and f"]: {ids[0]}: operator, action=hold, " \
            f"entry_id={ids[0]}.0, result=placed on hold, user={user}" in lines[1], lines[1]
        assert " queue-ref/delete[" in lines[3] and "result=removed" in lines[3]
    # a log that cannot be written to: the action stands, and the command says so; a
    # log the relay has not made is not made by an operator command
    for log_file, why in ((tmp_path, "Is a directory"), ("/dev/full", "No space left"),
                          (tmp_path / "none.log", "No such file")):
        conf.write_text(f'queue = "{q}"\nlog_file = "{log_file}"\n')
        code, out, err = run(capsys, "requeue", "--config", str(conf), ids[2])
        assert code == 0 and "requeue: 2 entries" in out, out
        assert "not written to the relay's log" in err and why in err, err
    assert not (tmp_path / "none.log").exists()


@pytest.mark.parametrize("command", [["mailq", "--json"], ["mailq"]])
def test_mailq_prints_each_message_as_it_is_found(tmp_path: Path, command: list[str]) -> None:
    """The first message is printed before the rest of the queue is read: a message
    deleted after mailq printed its first line (mailq then blocked on a full pipe, far
    before the end) is not shown, and the totals count what was shown."""
    q = tmp_path / "q"
    # 1 KB of output per message or more, in text and JSON alike (the recipient, 900
    # octets of it padding, is printed by both; the parameter by JSON): 200 of them outgrow
    # the 64 KiB pipe
    pad = "x" * 2000
    with open_queue(str(q), "fs") as store:
        ids = []
        for i in range(200):
            with store.enqueue(f"s{i}@sender.example", {"pad": pad}) as enq:
                enq.write(b"Subject: streamed\r\n\r\nbody\r\n")
                ids.append(enq.commit([Recipient(f"u{i}.{pad[:900]}@d.example", Schedule(LATER))])[0])
    proc = subprocess.Popen([sys.executable, "-m", "conformance.cli", *command, "--queue",
                             str(q)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        # listed in the directory's own order (os.scandir's, which os.listdir shares)
        order = [name.rpartition(".")[0] for name in os.listdir(q / "queue")]
        assert sorted(order) == sorted(h.message_id for h in ids)
        assert order[0] in first or first.startswith("-Queue ID-")
        last = order[-1]
        with open_queue(str(q), "fs") as store:  # the last one found, gone meanwhile
            pending = store.drop(next(h for h in store.list_queue() if h.message_id == last))
            assert pending is not None and store.cleanup(pending)
        rest = proc.stdout.read()
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    out = first + rest
    assert all(mid in out for mid in order[:-1])
    assert last not in out
    if "--json" in command:
        shown = [json.loads(x)["queue_id"] for x in out.splitlines()[:-1]]
        assert shown == order[:-1]
    if "--json" in command:
        assert json.loads(out.splitlines()[-1])["messages"] == 199
    else:
        assert out.rstrip().endswith("in 199 Requests, 199 recipients.")


@pytest.mark.parametrize("backend", BACKENDS)
def test_qshape_text_is_an_aligned_table_of_the_json_counts(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Postfix's qshape layout: a header of age columns, then one right-aligned row per
    domain (TOTAL first), every line as long as the header, the numbers as in --json."""
    q = tmp_path / "q"
    fill(q, backend)
    code, out, _ = run(capsys, "qshape", "--queue", str(q))
    assert code == 0
    _, shape = run_json(capsys, "qshape", "--queue", str(q))
    lines = out.rstrip("\n").split("\n")
    assert lines[0].split() == shape["columns"] == list(qa.AGE_COLUMNS)
    assert lines[0].startswith(" " * (len("d0.example") + 1))  # the domain column is blank
    assert len({len(line) for line in lines}) == 1, lines  # one width: columns aligned
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == [r["domain"] for r in shape["rows"]]
    assert rows[0][0] == "TOTAL" and lines[1].startswith("     TOTAL ")
    assert [[int(n) for n in r[1:]] for r in rows] == [r["counts"] for r in shape["rows"]]


def test_show_lists_a_messages_entries_in_delivery_and_no_other_messages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sender holds one entry of the first message in delivery: ``show`` of that message
    lists it "in delivery" beside its queued entry; ``show`` of a later message lists only
    its own two entries (not another message's entry in delivery)."""
    q = tmp_path / "q"
    ids = fill(q, "fs")
    assert ids == sorted(ids)  # ids grow with time: an earlier message's id sorts first
    with open_queue(str(q), "fs") as sender:
        first = next(h for h in sender.list_queue() if h.entry_id == f"{ids[0]}.0")
        assert sender.send_start(first) is not None
        _, own = run_json(capsys, "show", "--queue", str(q), ids[0])
        assert [(r["entry_id"], r["state"]) for r in own["recipients"]] == [
            (f"{ids[0]}.0", "inflight"), (f"{ids[0]}.1", "queued")]
        _, later = run_json(capsys, "show", "--queue", str(q), ids[2])
        assert [r["entry_id"] for r in later["recipients"]] == [f"{ids[2]}.0", f"{ids[2]}.1"]
        code, out, _ = run(capsys, "show", "--queue", str(q), ids[2])
        assert code == 0 and "in delivery" not in out and ids[0] not in out


def test_show_of_a_damaged_message_exits_1_and_says_it_was_set_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A body damaged on disk: ``show`` prints nothing of it, exits 1 with one line that
    says what is wrong and that the message was quarantined, and the damaged bytes are
    kept; the other messages are shown as before."""
    q = tmp_path / "q"
    ids = fill(q, "fs")
    data = q / "data" / ids[1]
    damaged = bytearray(data.read_bytes())
    damaged[damaged.index(b"body 1")] ^= 1
    data.write_bytes(bytes(damaged))
    code, out, err = run(capsys, "show", "--queue", str(q), ids[1], "--body")
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.strip().endswith("(quarantined)"), err
    assert ids[1] in err
    kept = list((q / "quarantine").iterdir())
    assert any(not p.is_symlink() and p.read_bytes() == bytes(damaged) for p in kept), kept
    code, out, _ = run(capsys, "show", "--queue", str(q), ids[2])
    assert code == 0 and "Subject: message 2" in out


class ClaimMidListing(OsIO):
    """The real disk; while queue/ is listed, after the names of the message's entries
    .1 and .2 are read and before .0 is, ``claim`` runs (a relay taking .0): for a
    listing read name by name (``iter_names``) as for one read whole (``listdir``)."""

    def __init__(self, mid: str, claim: Any) -> None:
        super().__init__()
        self.mid, self.claim, self.armed = mid, claim, False  # armed once opened

    def _fire(self) -> None:
        if self.armed:
            self.armed = False
            self.claim()

    def iter_names(self, path: str) -> Any:
        names = list(super().iter_names(path))
        if not path.endswith("/queue"):
            yield from names
            return
        mine = [f"{self.mid}.1", f"{self.mid}.2"]
        yield from mine
        self._fire()
        yield from (n for n in names if n not in mine and os.path.lexists(os.path.join(path, n)))

    def listdir(self, path: str, *, ordered: bool = True) -> list[str]:
        names = super().listdir(path, ordered=ordered)
        if path.endswith("/queue"):
            self._fire()
        return names


def test_an_action_beside_a_relay_takes_every_entry_that_stayed_queued(tmp_path: Path) -> None:
    """``hold --all`` while a relay claims entry .0 of a three-recipient message: .1 and
    .2 stayed queued throughout and are held.  Actions select from the ordered listings;
    through ``scan_queue`` (mailq's) .1 and .2 were passed over for .0, never met, and
    left to the relay (found by a cold review)."""
    root = str(tmp_path / "q")
    relay = FsQueue(root)
    with relay.enqueue("a@example.org") as e:
        e.write(b"Subject: x\r\n\r\nbody\r\n")
        hs = e.commit([Recipient(f"r{k}@example.net", Schedule(0)) for k in range(3)])
    mid = hs[0].message_id
    io = ClaimMidListing(mid, lambda: relay.send_start(hs[0]))
    operator = FsQueue(root, io=io)
    io.armed = True
    try:
        res = qa.hold(operator, qa.select(qa.listing(operator), every=True))
        assert sorted(res.changed) == [f"{mid}.1", f"{mid}.2"]
        assert sorted(h.entry_id for h in operator.list_held()) == [f"{mid}.1", f"{mid}.2"]
        assert list(operator.list_queue()) == [] and not io.armed  # the claim was made
    finally:
        operator.close()
        relay.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_postsuper_ways_of_naming_entries_all_and_ids_on_standard_input(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ALL`` alone names every entry and ``-`` reads ids from standard input, as
    postsuper takes them: ids as mailq prints them (a ``*`` or ``!`` after the id) or
    one per line."""
    import io

    q = tmp_path / "q"
    ids = fill(q, backend)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{ids[0]}!\n  {ids[1]}.1*\n\n"))
    _, res = run_json(capsys, "hold", "--queue", str(q), "-")
    assert sorted(res["entries"]) == sorted([f"{ids[0]}.0", f"{ids[0]}.1", f"{ids[1]}.1"])
    _, res = run_json(capsys, "release", "--queue", str(q), "ALL")
    assert res["changed"] == 3 and res["skipped"] == 7  # release applies to held ones
    _, res = run_json(capsys, "requeue", "--queue", str(q), "ALL")
    assert res["changed"] == 10
    assert all(s == "queued" and sched.at <= time.time() + 5
               for s, sched in state(q, backend).values())
    before = state(q, backend)
    for argv, given, message in (
            (["delete", "--queue", str(q), "ALL", ids[0]], "", "give it alone"),
            (["delete", "--queue", str(q), "ALL", "--all"], "", "give it alone"),
            (["delete", "--queue", str(q), "ALL", "-"], "", "give it alone"),  # stdin empty
            (["delete", "--queue", str(q), "-"], " \n", "no queue id on standard input"),
            (["delete", "--queue", str(q), "-"], "ALL\n", "unknown queue id 'ALL'"),  # literal
            (["delete", "--queue", str(q), "-", "--all"], None, "name the entries"),
            (["delete", "--queue", str(q), "-", "--domain", "d0.example"], None,
             "name the entries")):
        # None: standard input must not be read at all
        monkeypatch.setattr(sys, "stdin", io.StringIO(given) if given is not None else None)
        code, out, err = run(capsys, *argv)
        assert code == 2 and message in err and out == "", (argv, err)
    assert state(q, backend) == before
    _, res = run_json(capsys, "delete", "--queue", str(q), "ALL")
    assert res["changed"] == 10 and state(q, backend) == {}


def test_with_json_a_refusal_is_also_a_json_object_on_standard_output(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A script reading the last line of ``--json`` output reads why it failed and the
    exit status, besides the one line on standard error."""
    q = tmp_path / "q"
    fill(q, "kv-log")
    code, out, err = run(capsys, "hold", "--queue", str(q), "nope", "--json")
    assert code == 2 and "unknown queue id 'nope'" in err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["status"] == 2 and "unknown queue id 'nope'" in got["error"]
    with standing_for_the_relay(q):
        code, out, err = run(capsys, "mailq", "--queue", str(q), "--json")
    assert code == 1 and f"the relay (pid {os.getpid()})" in err
    assert out.count("\n") == 1
    got = json.loads(out)
    assert got == {"error": got["error"], "status": 1}
    assert f"the relay (pid {os.getpid()})" in got["error"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_id_of_a_split_queue_given_for_one_root_alone_is_refused_with_the_way_out(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A relay on split roots logs ids as the whole queue gives them (``r1-<id>``).  An
    operator who opens one root alone with ``--queue`` and gives such an id is told
    what to give instead; nothing is guessed (KV ids repeat from root to root: root 0
    holds an entry of the same own id, which must not be taken for it)."""
    from queue_ref.opener import open_queues

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    handles = {}
    for part in (0, 1):
        with open_queues(roots, backend, part=part) as q, \
                q.enqueue("s@example.org", {}) as enq:
            enq.write(b"Subject: split %d\r\n\r\nbody\r\n" % part)
            (handles[part],) = enq.commit([Recipient("u@d.example", Schedule(LATER, 0))])
    h = handles[1]
    assert h.entry_id.startswith("r1-")
    own = h.entry_id[len("r1-"):]
    before = state(tmp_path / "a", backend), state(tmp_path / "b", backend)
    for root in roots:
        code, out, err = run(capsys, "hold", "--queue", root, h.entry_id)
        assert code == 2 and out == "", err
        assert f"unknown queue id {h.entry_id!r}: an id of root 1" in err
        assert f"give every root (--queue once per root, or --config), or {own!r}" in err
    assert (state(tmp_path / "a", backend), state(tmp_path / "b", backend)) == before
    _, res = run_json(capsys, "hold", "--queue", roots[1], own)  # the way out, alone
    assert res["entries"] == [own]
    _, res = run_json(capsys, "release", "--queue", roots[0], "--queue", roots[1],
                      h.entry_id)  # the whole queue: its own ids
    assert res["entries"] == [h.entry_id]
    code, _, err = run(capsys, "release", "--queue", roots[0], "--queue", roots[1],
                       "r1-999.0")  # every root given: no hint to give them
    assert code == 2 and "unknown queue id 'r1-999.0': no queued or held entry" in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pid_file_a_dead_relay_left_names_no_relay_and_its_pid_is_not_signalled(
        tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A relay killed by SIGKILL leaves ``relay.pid``; its pid may be another process's
    by then.  That process must not get the relay's SIGUSR1 (``release``, ``flush``,
    which would kill it), and a KV queue must not be refused for it: only a pid file
    whose lock is held names a live relay."""
    q = tmp_path / "q"
    ids = fill(q, backend)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (q / PID_FILE).write_text(f"{stranger.pid}\n")  # left behind, the pid reused
        _, res = run_json(capsys, "hold", "--queue", str(q), ids[0])
        assert res["changed"] == 2
        _, res = run_json(capsys, "release", "--queue", str(q), ids[0])
        assert res["changed"] == 2
        _, res = run_json(capsys, "flush", "--queue", str(q))
        assert res["changed"] == 10 and res["relay_woken"] is False
        time.sleep(0.2)
        assert stranger.poll() is None, "the stranger got the relay's signal"
    finally:
        stranger.kill()
        stranger.wait()
    with standing_for_the_relay(q):  # a live relay (holding the lock) is still found
        assert read_relay_pid(str(q)) == os.getpid()
    assert not (q / PID_FILE).exists()


def test_ids_on_standard_input_are_read_before_the_queue_is_opened(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mailq | ... | delete -`` on a KV queue (one process at a time): the action reads
    its ids before it opens the queue, so mailq, still listing, is not shut out."""
    q = tmp_path / "q"
    ids = fill(q, "kv-log")

    class Stdin:
        def read(self) -> str:
            open_queue(str(q), "kv-log").close()  # raises if the action holds the queue
            return f"{ids[2]}\n"

    monkeypatch.setattr(sys, "stdin", Stdin())
    _, res = run_json(capsys, "delete", "--queue", str(q), "-")
    assert res["changed"] == 2


def test_an_id_in_delivery_is_refused_as_such_and_qshape_top_must_not_be_negative(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """mailq marks a message in delivery with ``*``; an action on it is refused saying
    so (not "unknown queue id"), and nothing changes."""
    q = tmp_path / "q"
    ids = fill(q, "fs")
    with FsQueue(str(q)) as sender:  # another owner's claim, as a relay's
        (h,) = [h for h in sender.list_queue() if h.entry_id == f"{ids[3]}.0"]
        assert sender.send_start(h) is not None
        before = state(q, "fs")
        code, out, err = run(capsys, "hold", "--queue", str(q), f"{ids[3]}.0")
        assert code == 2 and out == ""
        assert f"queue id '{ids[3]}.0' is in delivery now (mailq's *)" in err, err
        assert state(q, "fs") == before
        code, out, err = run(capsys, "show", "--queue", str(q), f"{ids[3]}.0")  # show too
        assert code == 2 and f"queue id '{ids[3]}.0' is in delivery now" in err, err
        _, res = run_json(capsys, "hold", "--queue", str(q), ids[3])  # the message: the
        assert res["entries"] == [f"{ids[3]}.1"]  # entry not in delivery
        # qshape counts the entry in delivery (Postfix's active queue), not the held one
        _, shape = run_json(capsys, "qshape", "--queue", str(q))
        want = collections.Counter(f"d{(i + j) % 3}.example" for i in range(5)
                                   for j in range(2) if (i, j) != (3, 1))
        assert {r["domain"]: r["counts"][0] for r in shape["rows"][1:]} == want, shape
        assert shape["rows"][0]["counts"][0] == 9
    code, _, err = run(capsys, "qshape", "--queue", str(q), "--top", "-1")
    assert code == 2 and "--top: at least 0" in err


def test_with_json_a_usage_error_is_also_a_json_object(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own refusals (a missing id, an unknown option, a bad number) exit 2
    and, with ``--json``, print ``{"error", "status"}`` as the commands' refusals do."""
    q = tmp_path / "q"
    fill(q, "fs")
    for argv, message in ((["show", "--queue", str(q)], "the following arguments are required"),
                          (["mailq", "--queue", str(q), "--bogus"], "unrecognized arguments"),
                          (["qshape", "--queue", str(q), "--top", "x"], "invalid int value")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--json"])
        out = capsys.readouterr()
        assert stop.value.code == 2
        got = json.loads(out.out.strip().splitlines()[-1])
        assert got["status"] == 2 and message in got["error"], got
        # the command's own usage and name, not the top-level one's
        assert got["error"].startswith(f"queue-ref {argv[0]}: "), got
        assert message in out.err and f"usage: queue-ref {argv[0]} " in out.err, out.err
        with pytest.raises(SystemExit):
            main(argv)  # without --json: standard error only
        assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit):  # a subcommand's subcommand: its usage
        main(["crash", "explore", "--bogus"])
    assert "usage: queue-ref crash explore " in capsys.readouterr().err
    for argv in (["--bogus", "mailq"], ["crash", "--bogus", "explore"]):
        with pytest.raises(SystemExit):  # given before the command: not the command's
            main(argv)
        err = capsys.readouterr().err
        assert "unrecognized arguments: --bogus" in err and "mailq [" not in err, err
        assert "usage: queue-ref crash explore" not in err, err


def test_an_action_names_each_entry_it_changed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As ``postsuper`` names each message it removed or held: one line per entry, then
    the count, so the operator's terminal keeps a record of what changed."""
    q = tmp_path / "q"
    ids = fill(q, "fs")
    code, out, _ = run(capsys, "hold", "--queue", str(q), ids[0])
    assert code == 0
    assert out.splitlines() == [f"{ids[0]}.0: placed on hold", f"{ids[0]}.1: placed on hold",
                                "hold: 2 entries"]
    code, out, _ = run(capsys, "delete", "--queue", str(q), f"{ids[1]}.1")
    assert out.splitlines() == [f"{ids[1]}.1: removed", "delete: 1 entry"]
    # what was left alone says why, once per reason
    code, out, _ = run(capsys, "requeue", "--queue", str(q), ids[0])
    assert code == 0 and out.splitlines() == [
        "requeue: 0 entries, 2 not applicable (on hold: release it first)"]
    code, out, _ = run(capsys, "hold", "--queue", str(q), ids[0], f"{ids[1]}.0")
    assert out.splitlines() == [f"{ids[1]}.0: placed on hold",
                                "hold: 1 entry, 2 not applicable (on hold already)"]
    code, out, _ = run(capsys, "release", "--queue", str(q), "ALL")
    assert out.splitlines()[-1] == "release: 3 entries, 6 not applicable (not on hold)"
    _, res = run_json(capsys, "flush", "--queue", str(q))
    assert res["skipped_why"] == {} and res["changed"] == 9
    _, res = run_json(capsys, "flush", "--queue", str(q))
    assert res["skipped_why"] == {"due already": 9} and res["skipped"] == 9


def test_params_are_listed_in_one_order_whatever_the_backend_kept() -> None:
    """``mailq --json`` and ``show --json`` give a message's parameters sorted by name:
    the same through a running relay (arrival order) and on a stopped queue."""
    info = qa.MessageInfo("m", "s@example.org", 10, 0, {"helo": "h", "body": "8BITMIME",
                                                        "client": "c"})
    assert list(info.to_json()["params"]) == ["body", "client", "helo"]


# CI runs as root, where it runs (QUEUE_REF_NO_SKIPS=1 fails a run that skips it)
@pytest.mark.skipif(os.geteuid() != 0, reason="setpriv runs a command as another user "
                                              "(nobody) only for root")
@pytest.mark.parametrize("backend", ["fs", "kv-log"])
def test_another_user_is_told_permission_denied_and_who_may(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A user who cannot read the queue directory (mode 0750, another group) is told
    "permission denied" and who may run the command, exit 1, not "not a queue" (exit 2,
    a usage error); one of its group, who can read but not write, likewise."""
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                 sys.executable, "-m", "conformance.cli"]
    hidden = subprocess.run([*as_nobody, "mailq", "--queue", str(tmp_path / "q")],
                            capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).parent.parent)  # pytest's tmp is 0700
    assert hidden.returncode == 1 and "a directory above it, or above the directory it " \
        "links to, cannot be searched" in hidden.stderr, hidden
    base = Path(tempfile.mkdtemp())  # a directory every user may search
    request.addfinalizer(lambda: shutil.rmtree(base))
    os.chmod(base, 0o755)
    q = base / "q"
    fill(q, backend)
    for path in [q, *q.rglob("*")]:
        os.chmod(path, 0o750 if path.is_dir() else 0o640)
    for group in ("root", "nogroup"):
        shutil.chown(q, group=group)
        for path in q.rglob("*"):
            shutil.chown(path, group=group)
        for command in ("mailq", "qshape", "hold"):
            args = [command, "--queue", str(q)] + (["--all"] if command == "hold" else [])
            got = subprocess.run([*as_nobody, *args], capture_output=True, text=True,
                                 timeout=60, cwd=Path(__file__).parent.parent)
            assert got.returncode == 1 and got.stdout == "", (group, command, got)
            assert "permission denied" in got.stderr and "run the command as root" in \
                got.stderr, (group, command, got.stderr)
            assert "not a queue" not in got.stderr
    # the queue is nobody's, but a file in it is root's: nobody is told so (not to run
    # as the queue's owner, which it is), by an action and by a listing alike
    for path in [q, *q.rglob("*")]:
        shutil.chown(path, user="nobody", group="nogroup")
    inside = next(p for p in sorted(q.rglob("*")) if p.is_file() and p.name != "relay.pid")
    shutil.chown(inside, user="root", group="root")
    os.chmod(inside, 0o600)
    inside.parent.chmod(0o555)
    for command in (["hold", "--all"], ["mailq"]):
        got = subprocess.run([*as_nobody, command[0], "--queue", str(q), *command[1:]],
                             capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).parent.parent)
        assert got.returncode == 1 and f"{inside} belongs to root: give it back to the " \
            "queue's owner, or run the command as root" in got.stderr, (command, got)
    if backend.startswith("kv"):  # an unreadable relay.pid: said, not a traceback
        inside.parent.chmod(0o755)
        pid = q / "relay.pid"
        pid.write_text("1\n")
        os.chmod(pid, 0o600)  # root's
        got = subprocess.run([*as_nobody, "mailq", "--queue", str(q)], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).parent.parent)
        assert got.returncode == 1 and "permission denied" in got.stderr, got
        assert "Traceback" not in got.stderr
