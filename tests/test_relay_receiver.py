"""The relay's SMTP receiver against real clients: durable 250, policy, limits, codes."""

from __future__ import annotations

import email
import email.policy
import smtplib

import pytest
from aiosmtpd.smtp import SMTP
from hypothesis import given
from hypothesis import strategies as st

from queue_ref.opener import open_queue
from queue_ref.relay.relay_config import ConfigError, load_config
from queue_ref.relay.smtp_address import fast_path_address
from queue_ref.relay.smtp_receiver import RelaySMTP
from tests.relay_support import RelayThread, Sink, plain_addresses, relay_config

BODY = b"From: alice@example.org\r\nTo: bob@example.net\r\nSubject: hi\r\n\r\nHello.\r\n"


def test_mail_reaches_the_sink_through_the_relayhost_with_a_received_header(tmp_path):
    with Sink() as sink, RelayThread(relay_config(
            str(tmp_path / "q"), relayhost=f"[127.0.0.1]:{sink.port}", log_json=True)) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
            code, _msg = c.ehlo("client.test")
            assert code == 250
            for ext in ("size", "8bitmime", "smtputf8", "pipelining", "enhancedstatuscodes"):
                assert c.has_extn(ext), ext
            c.mail("alice@example.org")
            c.rcpt("bob@example.net")
            c.rcpt("carol@example.net")
            code, reply = c.data(BODY)
        assert code == 250
        text = reply.decode()
        assert text.startswith("2.0.0 Ok: queued as ")
        queue_id = text.rsplit(" ", 1)[1]
        (got,) = sink.wait_for(2)
        assert sorted(got.rcpts) == ["bob@example.net", "carol@example.net"]
        assert got.mail_from == "alice@example.org"
        first, _, _rest = got.data.partition(b"\r\n\t")
        assert first.startswith(b"Received: from client.test ([127.0.0.1])")
        assert got.data.endswith(BODY)
        parsed = email.message_from_bytes(got.data, policy=email.policy.default)
        assert "by relay.test (queue-ref) with ESMTP" in parsed["Received"]
        assert parsed["Subject"] == "hi"
        events = r.wait_events(2, status="sent")
        assert {e["to"] for e in events} == {"bob@example.net", "carol@example.net"}
        assert all(e["queue_id"] == queue_id and e["dsn"] == "2.0.0" for e in events)
        assert all(e["relay"] == f"127.0.0.1[127.0.0.1]:{sink.port}" for e in events)
        r.wait_events(1, "received")
    # The drained queue holds nothing.
    with open_queue(str(tmp_path / "q")) as q:
        assert list(q.list_queue()) == []
        assert q.footprint().objects == 0


def test_the_relay_is_not_an_open_relay(tmp_path):
    cfg = relay_config(str(tmp_path / "q"), mynetworks=["192.0.2.0/24"],
                       relay_domains=["allowed.test", ".sub.test"], relayhost="[127.0.0.1]:9")
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("outsider.test")
        c.mail("spammer@example.org")
        code, msg = c.rcpt("victim@elsewhere.test")
        assert (code, msg) == (554, b"5.7.1 <victim@elsewhere.test>: Relay access denied")
        assert c.rcpt("x@a.sub.test")[0] == 250
        assert c.rcpt("y@allowed.test")[0] == 250
        assert c.rcpt("y@notallowed.test")[0] == 554
        assert c.rcpt("z@sub.test")[0] == 554  # ".sub.test" names subdomains only
        assert c.rset()[0] == 250
        c.mail("spammer@example.org")
        assert c.rcpt("victim@elsewhere.test")[0] == 554
        code, _ = c.docmd("DATA")
        assert code == 503  # no recipient was accepted: nothing can be queued


def test_limits_and_codes(tmp_path):
    cfg = relay_config(str(tmp_path / "q"), message_size_limit=2000, smtpd_recipient_limit=3,
                       relayhost="[127.0.0.1]:9")
    with RelayThread(cfg) as r, smtplib.SMTP("127.0.0.1", r.port, timeout=10) as c:
        c.ehlo("client.test")
        assert c.esmtp_features["size"] == "2000"
        code, msg = c.mail("a@example.org", ["SIZE=5000"])
        assert code == 552 and msg.startswith(b"5.3.4")
        assert c.mail("not an address")[0] == 501
        code, msg = c.mail("bad@@example.org")
        assert code == 501, msg
        assert c.mail("a@example.org")[0] == 250
        code, msg = c.rcpt("no-domain")
        assert code == 501 and msg.startswith(b"5.1.3"), msg
        for i in range(3):
            assert c.rcpt(f"r{i}@example.net")[0] == 250
        code, msg = c.rcpt("r4@example.net")
        assert (code, msg[:5]) == (452, b"4.5.3")
        code, msg = c.data(b"Subject: big\r\n\r\n" + b"x" * 900 + b"\r\n" + b"y" * 900 + b"\r\n"
                           + b"z" * 900 + b"\r\n")
        assert (code, msg[:5]) == (552, b"5.3.4")
        code, msg = c.docmd("VRFY", "a")
        assert code == 252 or code >= 500
        code, msg = c.docmd("BOGUS")
        assert code == 500 and msg.startswith(b"5.5.2"), msg
    with open_queue(str(tmp_path / "q")) as q:
        assert list(q.list_queue()) == []  # nothing was half accepted


def test_config_file_flags_and_errors(tmp_path):
    f = tmp_path / "relay.toml"
    f.write_text('queue = "/tmp/x"\n[relay]\nminimal_backoff_time = "15m"\n'
                 'retry_delays = ["15m", "30m", "2h", "4h"]\nmaximal_queue_lifetime = "72h"\n'
                 '[relay.transport_maps]\n"Example.COM" = "[127.0.0.1]:2526"\n')
    cfg = load_config(str(f), {"listen": "127.0.0.1:2600", "relayhost": None})
    assert cfg.minimal_backoff_time == 900 and cfg.retry_delays == [900, 1800, 7200, 14400]
    assert cfg.maximal_queue_lifetime == 72 * 3600 and cfg.listen == "127.0.0.1:2600"
    assert cfg.transport_maps == {"example.com": "[127.0.0.1]:2526"}
    f.write_text('queue = "/tmp/x"\nminimal_backof_time = 5\n')
    with pytest.raises(ConfigError, match="unknown key 'minimal_backof_time'"):
        load_config(str(f))
    for bad, match in [('mynetworks = ["nonsense"]', "mynetworks"),
                       ('listen = "127.0.0.1:99999"', "bad port"),
                       ('minimal_backoff_time = "soon"', "duration"),
                       ('metrics_listen = "0.0.0.0:9100"', "loopback"),
                       ("queue = [", "relay.toml: ")]:
        f.write_text('queue = "/tmp/x"\n' + bad + "\n" if not bad.startswith("queue") else bad)
        with pytest.raises(ConfigError, match=match):
            load_config(str(f))
    with pytest.raises(ConfigError, match="no queue directory"):
        load_config(None)


def test_a_session_finds_every_verb_hook_and_mechanism_aiosmtpd_would(tmp_path):
    """Sessions name their verbs through a cached ``__dir__`` (aiosmtpd's own lookup
    walks every attribute for each connection): the tables it builds are the same."""
    import asyncio
    import inspect

    from aiosmtpd.smtp import SMTP

    from queue_ref.relay.smtp_receiver import RelaySMTP

    with RelayThread(relay_config(str(tmp_path / "q"))) as relay:
        receiver = relay.relay.receiver
        assert receiver is not None
        loop = asyncio.new_event_loop()
        try:
            ours = RelaySMTP(receiver, loop=loop, hostname="h")
            full = set(object.__dir__(ours))
            assert {n for n in full if n.startswith("smtp_")} == {
                f"smtp_{v}" for v in ours._smtp_methods}
            assert set(ours._handle_hooks) == {
                n[len("handle_"):] for n in object.__dir__(receiver) if n.startswith("handle_")}
            plain = SMTP(receiver, loop=loop, hostname="h")
            assert set(plain._auth_methods) == set(ours._auth_methods)
            assert set(plain._smtp_methods) == set(ours._smtp_methods) - {"ETRN"}
            assert set(plain._handle_hooks) == set(ours._handle_hooks) != set()
            assert inspect.getmembers(ours)  # still answers, from the names that matter
        finally:
            loop.close()


_path = plain_addresses().map("<{}>".format)
_tail = st.sampled_from(["", " SIZE=100", "  SIZE=1", " ", "\tX", " (c) X", "X", "\u00a0X",
                         " BODY=8BITMIME SMTPUTF8", ">", "@x", " <y@z>"])


def _outcome(getaddr, arg):
    """What a ``_getaddr`` returns, or the type of what it raises (the email package's
    parser raises IndexError and AttributeError on some broken paths)."""
    try:
        return getaddr(arg)
    except Exception as e:
        return type(e)


@given(st.one_of(st.builds(str.__add__, _path, _tail),
                 st.text("<>@.aZ0 -(\t\u00e9\"[]", max_size=20),
                 st.builds(lambda p, i, c: p[:i] + c + p[i:], _path,
                           st.integers(0, 20), st.sampled_from(list(".@<> (\"\\\u00e9[")))))
def test_the_fast_path_reads_an_address_as_aiosmtpd_does(arg):
    """Every path the receiver's fast parser takes, aiosmtpd's own parser reads the same
    way; and the receiver's answer equals aiosmtpd's on every input."""
    session = RelaySMTP.__new__(RelaySMTP)
    session.local_part_limit = 0
    fast = fast_path_address(arg)
    slow = _outcome(lambda a: SMTP._getaddr(session, a), arg)
    if fast is not None:
        assert fast == slow
    assert _outcome(session._getaddr, arg) == slow


def test_the_fast_path_takes_the_common_forms_and_keeps_the_local_part_limit():
    assert fast_path_address("<alice.b+tag@mail.example.org> SIZE=4096") == (
        "alice.b+tag@mail.example.org", "SIZE=4096")
    assert fast_path_address("<bob@example.net>") == ("bob@example.net", "")
    for other in ("<>", "<a..b@c>", "<a@b.c.>", "<a@[127.0.0.1]>", "bob@example.net",
                  "<=?utf-8?q?bob?=@example.net>",
                  " <a@b>", "<\u00e9@b>", '<"a b"@c>', "<a@b> ", "<a@b>  SIZE=1"):
        assert fast_path_address(other) is None, other
    session = RelaySMTP.__new__(RelaySMTP)
    session.local_part_limit = 5
    assert session._getaddr("<abcdef@b.c>") == (None, None)
    assert session._getaddr("<abcde@b.c> X=1") == ("abcde@b.c", "X=1")


def test_an_event_loop_that_is_not_installed_is_refused(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        load_config(None, {"queue": str(tmp_path), "event_loop": "uvloop"})
    assert load_config(None, {"queue": str(tmp_path), "event_loop": "asyncio"}).event_loop == (
        "asyncio")
    assert load_config(None, {"queue": str(tmp_path)}).event_loop == "auto"
