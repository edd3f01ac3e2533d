"""The reason of an entry's last attempt (``Schedule.reason``): stored with the schedule on
every backend, cut to MAX_REASON octets, read back by every listing and after reopening;
queues written before reasons existed open and list with reason "".  The relay records
the remote reply when it defers, and ``queue-ref mailq`` shows it (Postfix's
``postqueue -p`` / ``-j``), with entries in delivery marked ``*`` and held ones ``!``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.examples import backends, sqlite_backend
from queue_ref.memory import MemoryStorage
from queue_ref.storage import (
    MAX_REASON,
    Capability,
    InflightMail,
    InvalidInputError,
    QueuedMail,
    Recipient,
    Schedule,
    ScheduleError,
    Storage,
)
from tests.relay_support import Sink, relay_process
from tests.test_operate_relay import cmd, enqueue

ROOT = Path(__file__).resolve().parent.parent
#: The last commit whose queues know no reasons (their formats are the old ones).
BEFORE_REASONS = "d9774c21d7c42cb6ee1a07ad5c4cfd0556568e08"

OPENERS: dict[str, Callable[[str], Storage]] = {
    "memory": lambda _: MemoryStorage(),
    "fs": backends.fs,
    "fs-fsync": backends.fs_fsync,
    "kv-log": backends.kv_log,
    "kv-leveldb": backends.kv_leveldb,
    "sqlite": sqlite_backend.factory,
}
DEFER = "450 4.2.0 Mailbox busy, try later"


def test_a_reason_is_cut_to_max_reason_octets_on_a_character_boundary() -> None:
    long = "\u00e9" * MAX_REASON  # two octets each
    s = Schedule(1, 1, long)
    assert len(s.reason.encode()) == MAX_REASON and s.reason == "\u00e9" * (MAX_REASON // 2)
    odd = Schedule(1, 1, "x" + "\u20ac" * MAX_REASON).reason  # 1 + 3k octets
    assert len(odd.encode()) <= MAX_REASON and odd.endswith("\u20ac")
    with pytest.raises(ScheduleError, match="reason must be a str"):
        Schedule(1, 1, b"450")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="UTF-8"):
        Schedule(1, 1, "\udc80")


@pytest.mark.parametrize("name", sorted(OPENERS))
def test_every_listing_returns_the_reason_stored_with_the_schedule(tmp_path: Path,
                                                                   name: str) -> None:
    root = str(tmp_path / "q")
    q = OPENERS[name](root)
    with q.enqueue("a@example.org") as enq:
        enq.write(b"Subject: r\r\n\r\nbody\r\n")
        a, b = enq.commit([Recipient("a@x.example", Schedule(5)),
                           Recipient("b@x.example", Schedule(6))])
    inflight = q.send_start(a)
    assert isinstance(inflight, InflightMail)
    reason = "451 4.7.1 \u00e9 greylisted\r\n451 try again \"later\" ' ;" + "y" * 2000
    back = q.send_cancel(inflight, Schedule(10, 1, reason))
    assert isinstance(back, QueuedMail)
    want = Schedule(10, 1, reason)  # cut to MAX_REASON when made
    assert back.schedule == want and len(want.reason.encode()) == MAX_REASON
    moved = q.reschedule(b, Schedule(20, 0, "flushed by an operator"))
    assert moved is not None

    def seen(q: Storage) -> dict[str, Schedule]:
        got = {h.entry_id: h.schedule for h in q.list_queue()}
        if Capability.DOMAIN_INDEX in q.capabilities:
            assert {h.entry_id: h.schedule for h in q.list_domain("x.example")} == got
        if Capability.HOLD in q.capabilities:
            got.update({h.entry_id: h.schedule for h in q.list_held()})
        return got

    assert seen(q) == {a.entry_id: want, b.entry_id: Schedule(20, 0, "flushed by an operator")}
    if Capability.HOLD in q.capabilities:  # held and released, the reason is kept
        (h,) = [h for h in q.list_queue() if h.entry_id == a.entry_id]
        held = q.hold(h)
        assert held is not None and held.schedule == want
        assert [x.schedule for x in q.list_held()] == [want]
        released = q.release(held)
        assert released is not None and released.schedule == want
    (h,) = [h for h in q.list_queue() if h.entry_id == a.entry_id]
    again = q.send_start(h)
    assert again is not None and again.schedule == want
    with q.read_inflight(again) as r:
        assert r.meta.schedule == want
    if name == "memory":
        return
    q.close()  # killed in delivery: recovery requeues it with the reason it had
    q = OPENERS[name](root)
    assert seen(q) == {a.entry_id: want, b.entry_id: Schedule(20, 0, "flushed by an operator")}
    (h,) = [h for h in q.list_queue() if h.entry_id == a.entry_id]
    forged = Schedule(30, 2)  # past Schedule's own cut: the backend refuses it
    object.__setattr__(forged, "reason", "x" * (MAX_REASON + 1))
    with pytest.raises(InvalidInputError, match="reason is 1001 octets"):
        q.send_cancel(q.send_start(h), forged)  # type: ignore[arg-type]
    q.close()


_OLD_WRITER = """
    import sys
    from conformance.examples import backends, sqlite_backend
    from queue_ref.storage import Recipient, Schedule
    opener = {"fs": backends.fs, "kv-log": backends.kv_log,
              "sqlite": sqlite_backend.factory}[sys.argv[1]]
    q = opener(sys.argv[2])
    with q.enqueue("old@example.org") as enq:
        enq.write(b"Subject: old\\r\\n\\r\\nbody\\r\\n")
        a, b, c = enq.commit([Recipient(f"{n}@x.example", Schedule(7)) for n in "abc"])
    q.send_cancel(q.send_start(a), Schedule(100, 1))
    q.reschedule(b, Schedule(200, 0))
    if hasattr(q, "hold") and "hold" in {c.value for c in q.capabilities}:
        q.hold(c)
    q.close()
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project as it was before reasons, unpacked from git."""
    out = tmp_path_factory.mktemp("before-reasons")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE_REASONS, "spec",
                              "queue_ref", "conformance", "faultinject"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


@pytest.mark.parametrize("name", ["fs", "kv-log", "sqlite"])
def test_a_queue_written_before_reasons_opens_and_lists_with_no_reason(
        tmp_path: Path, old_tree: Path, name: str) -> None:
    root = str(tmp_path / "q")
    subprocess.run([sys.executable, "-c", textwrap.dedent(_OLD_WRITER), name, root],
                   cwd=old_tree, check=True, env={"PYTHONPATH": str(old_tree), "PATH": ""})
    q = OPENERS[name](root)
    listed = sorted((h.schedule for h in q.list_queue()), key=lambda s: s.at)
    if Capability.HOLD in q.capabilities:
        assert [h.schedule for h in q.list_held()] == [Schedule(7)]
        assert listed == [Schedule(100, 1), Schedule(200, 0)]
    else:
        assert listed == [Schedule(7), Schedule(100, 1), Schedule(200, 0)]
    h = next(h for h in q.list_queue() if h.schedule.at == 100)
    back = q.send_cancel(q.send_start(h), Schedule(300, 2, DEFER))  # type: ignore[arg-type]
    assert back is not None
    q.close()
    q = OPENERS[name](root)
    assert Schedule(300, 2, DEFER) in [h.schedule for h in q.list_queue()]
    q.close()


# ---- the relay records it, mailq shows it ----


def _mailq_json(queue: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["mailq", "--queue", queue, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()[:-1]]


def _by_rcpt(msgs: list[dict[str, object]]) -> dict[str, tuple[dict[str, object], dict[str, object]]]:
    """Each recipient's local part -> (its message's object, its own)."""
    out = {}
    for m in msgs:
        for r in m["recipients"]:  # type: ignore[attr-defined]
            out[r["recipient"].split("@")[0]] = (m, r)
    return out


def test_mailq_shows_the_relays_reason_mail_in_delivery_and_held_mail(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = str(tmp_path / "q")
    enqueue(queue, ["defer1", "slow1", "keep1"])
    keep = _by_rcpt(_mailq_json(queue, capsys))["keep1"][0]["queue_id"]
    assert cmd(capsys, "hold", "--queue", queue, str(keep))["changed"] == 1
    with Sink() as sink, relay_process(["--queue", queue, "--listen", "127.0.0.1:0",
                                        "--relayhost", f"[127.0.0.1]:{sink.port}"]):
        deadline = time.monotonic() + 30
        while True:
            seen = _by_rcpt(_mailq_json(queue, capsys))
            defer, slow = (seen.get(n, ({}, {}))[1] for n in ("defer1", "slow1"))
            if (defer.get("state") == "queued" and defer.get("delay_reason")
                    and slow.get("state") == "inflight"):
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
        assert seen["defer1"][0]["queue_name"] == "deferred"
        assert seen["defer1"][1]["delay_reason"] == DEFER
        assert seen["defer1"][1]["attempts"] == 1
        assert seen["slow1"][0]["queue_name"] == "active"
        assert "delay_reason" not in seen["slow1"][1]
        assert seen["keep1"][0]["queue_name"] == "hold"
        capsys.readouterr()
        assert main(["mailq", "--queue", queue]) == 0
        text = capsys.readouterr().out.splitlines()
        reason_at = text.index(f"({DEFER})")
        assert "defer1@example.net" in text[reason_at + 1]
        assert text[reason_at - 1].split()[0] == seen["defer1"][0]["queue_id"]
        for name, mark, how in (("slow1", "*", "in delivery"), ("keep1", "!", "held")):
            at = next(i for i, line in enumerate(text) if f"{name}@example.net" in line)
            assert text[at - 1].split()[0] == f"{seen[name][0]['queue_id']}{mark}"
            assert f": {how})" in text[at]
        capsys.readouterr()
        assert main(["show", "--queue", queue, str(seen["defer1"][0]["queue_id"])]) == 0
        assert f"delay_reason: {DEFER}" in capsys.readouterr().out
        assert sink.state.rcpts() == []  # nothing delivered: slow1 is still being answered
