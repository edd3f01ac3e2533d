"""``queue-ref relay --processes N`` over a backend processes cannot share (the KV queue):
one root of the queue per process, each served by one worker alone.

Real processes, a real SMTP sink, real signals: mail lands in both roots and all of it is
delivered once, under ids ``mailq`` over both roots shows; a killed worker is started
again on its root and loses nothing acknowledged; an ETRN taken by one worker flushes the
domain in the other's root too; a root count that does not match, or ODMR, is refused.
"""

from __future__ import annotations

import os
import re
import signal
import smtplib
import socket
import time
from pathlib import Path

from queue_ref.opener import open_queues
from queue_ref.storage import Recipient, Schedule
from tests.relay_support import Sink, relay_process
from tests.test_relay_processes import _cli, _wait, _workers, kill_a_worker_while_mail_flows

_RECEIVED_ID = re.compile(r"queue-ref/relay\[\d+\]: (r[01]-[0-9a-f.]+): received")


def _roots(tmp_path: Path) -> list[str]:
    return [str(tmp_path / "q0"), str(tmp_path / "q1")]


def _args(roots: list[str], relayhost: str, *more: str) -> list[str]:
    queues = [a for root in roots for a in ("--queue", root)]
    return [*queues, "--backend", "kv-log", "--listen", "127.0.0.1:0", "--processes", "2",
            "--relayhost", relayhost, *more]


def test_each_worker_serves_its_root_and_a_killed_one_loses_nothing(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    tokens = [f"k{i:03d}" for i in range(150)]
    with Sink() as sink, relay_process(_args(roots, f"[127.0.0.1]:{sink.port}")) as (rp, port):
        got = kill_a_worker_while_mail_flows(rp, port, sink, tokens, 1, after=40)
        err = rp.stderr()
    # a delivery the victim made and had not recorded when killed goes again (at least
    # once); nothing else is delivered twice
    assert len(got) - len(set(got)) <= 10, len(got) - len(set(got))
    ids = _RECEIVED_ID.findall(err)
    assert {i[:3] for i in ids} == {"r0-", "r1-"}, "mail went to one root only"
    store = open_queues(roots, "kv-log")  # both roots, as the operator commands open them
    try:
        assert list(store.list_queue()) == []
    finally:
        store.close()


def test_an_etrn_flushes_the_domain_in_every_root(tmp_path: Path) -> None:
    """Mail for example.net deferred in both roots (the next hop down, a retry an hour
    away); the next hop comes up and one session says ETRN: both workers deliver at
    once, the one that took the ETRN and the one the master passed it to."""
    roots = _roots(tmp_path)
    store = open_queues(roots, "kv-log")
    try:
        for i in range(6):  # round robin: three messages in each root, due in an hour
            with store.enqueue("a@example.org") as enq:
                enq.write(b"Subject: e%d\r\n\r\nbody\r\n" % i)
                enq.commit([Recipient(f"u{i}@example.net", Schedule(int(time.time()) + 3600))])
        assert sorted(m.entry_id[:3] for m in store.list_queue()) == ["r0-"] * 3 + ["r1-"] * 3
    finally:
        store.close()
    with socket.socket() as s:  # the next hop's port, nothing listening on it yet
        s.bind(("127.0.0.1", 0))
        hop = s.getsockname()[1]
    with relay_process(_args(roots, f"[127.0.0.1]:{hop}")) as (rp, port):
        assert _wait(lambda: len(_workers(rp)) == 2)
        with Sink(port=hop) as sink:
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
                c.ehlo("client.test")
                code, text = c.docmd("ETRN", "example.net")
            assert code == 250, text
            got = sink.wait_for(6, timeout=30)
            assert sorted(m.data.split(b"Subject: ")[1][:2].decode() for m in got) == [
                f"e{i}" for i in range(6)]
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(60) == 0


def test_a_root_count_that_does_not_match_or_odmr_is_refused(tmp_path: Path) -> None:
    """Refused by the configuration's check (``--check-config`` too, exit 2), before any
    root is opened: nothing is made in the directories."""
    three = [str(tmp_path / f"q{i}") for i in range(3)]
    for check in ([], ["--check-config"]):
        r = _cli(*_args(three, "[127.0.0.1]:9"), *check)
        assert r.returncode == 2, r.stderr
        assert "2 roots for processes = 2; now 3)" in r.stderr
    assert not any(os.path.exists(d) for d in three)
    conf = tmp_path / "relay.toml"
    secrets = tmp_path / "odmr_secrets"
    secrets.write_text("alice:a-secret-of-some-length\n")
    secrets.chmod(0o600)
    conf.write_text(f'odmr_listen = "127.0.0.1:0"\nodmr_cram_md5_file = "{secrets}"\n'
                    "smtpd_tls_auth_only = false\n")
    for check in ([], ["--check-config"]):
        r = _cli("--config", str(conf), *_args(_roots(tmp_path), "[127.0.0.1]:9"), *check)
        assert r.returncode == 2, r.stderr
        assert "odmr_listen: with backend kv-log each process serves one root" in r.stderr
    conf.write_text('ondemand_domains = ["example.net"]\n')
    r = _cli("--config", str(conf), *_args(_roots(tmp_path), "[127.0.0.1]:9"), "--check-config")
    assert r.returncode == 2 and "ondemand_domains: with backend kv-log" in r.stderr, r.stderr
    assert not any(os.path.exists(d) for d in _roots(tmp_path))


def test_a_root_holding_another_backends_queue_is_refused(tmp_path: Path) -> None:
    """A KV queue's roots started without ``--backend kv-log`` (the default is fs), and an
    fs queue's root started as kv-log: each refused, naming the backend to give, and
    nothing is written into the roots (a second, empty queue beside the first would hide
    its mail from the relay and from mailq)."""
    roots = _roots(tmp_path)
    store = open_queues(roots, "kv-log")
    with store.enqueue("a@example.org") as enq:
        enq.write(b"Subject: kept\r\n\r\nbody\r\n")
        enq.commit([Recipient("u@example.net", Schedule(0))])
    store.close()
    before = {d: sorted(os.listdir(d)) for d in roots}
    for procs in ("1", "2"):
        queues = [a for root in roots for a in ("--queue", root)]
        r = _cli(*queues, "--listen", "127.0.0.1:0", "--processes", procs,
                 "--relayhost", "[127.0.0.1]:9")
        assert r.returncode == 1, r.stderr
        assert "holds a kv-log queue, not a fs one: give --backend kv-log" in r.stderr
        assert {d: sorted(os.listdir(d)) for d in roots} == before
    fs_root = str(tmp_path / "fsq")
    open_queues([fs_root], "fs").close()
    r = _cli("--queue", fs_root, "--backend", "kv-log", "--listen", "127.0.0.1:0",
             "--relayhost", "[127.0.0.1]:9")
    assert r.returncode == 1 and "holds a fs queue, not a kv-log one" in r.stderr, r.stderr
    assert "CURRENT" not in os.listdir(fs_root)
