"""RFC 5321 conformance of the relay's delivery client, table-driven: each row scripts an
aiosmtpd next hop (``SinkState.at``: a reply or a dropped connection at one stage of
every session, from the greeting to the final dot; ``SinkState.without``: EHLO keywords
not offered; the recipient scripts of ``tests/relay_support.py``), sends one message
through a relay, and expects per recipient the outcome the relay logs (``delivery``:
sent, deferred or bounced, with its enhanced status code), then the queue after the
relay stopped: a deferred recipient is still queued with the reason it logged, a sent
or bounced one is gone, and a bounce (RFC 3464, from ``<>``) reached the sender's own
next hop naming the status.  The sender's domain goes to a second sink that accepts
everything, so bounces arrive whatever the first one does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from tests.relay_support import RelayThread, Sink, codes, queued_entries, raw_dialogue, relay_config

SENDER = "alice@src.test"


@dataclass(frozen=True)
class Row:
    name: str
    outcomes: dict[str, tuple[str, str]]  # recipient -> (status, dsn) of its first attempt
    at: dict[str, str] = field(default_factory=dict)  # the next hop's scripted replies
    without: frozenset[str] = frozenset()
    mail: bytes = b""  # MAIL parameters the message is received with
    body: bytes = b"Subject: rfc 5321 client\r\n\r\nhello\r\n"
    reason_has: str = ""  # in the reason of every recipient not sent
    options: tuple[str, ...] = ()  # MAIL parameters the next hop got (sent rows)
    not_options: tuple[str, ...] = ()  # MAIL parameter names it did not get


OK = ("sent", "2.0.0")
BOTH = ("ann@dst.test", "bob@dst.test")

ROWS = [
    Row("greeting 421", {r: ("deferred", "4.4.1") for r in BOTH},
        at={"connect": "421 4.3.2 Service not available"},
        reason_has="refused to talk to me: 421 4.3.2 Service not available"),
    Row("greeting 554", {r: ("deferred", "4.4.1") for r in BOTH},
        at={"connect": "554 5.3.2 No SMTP service here"},
        reason_has="refused to talk to me: 554 5.3.2 No SMTP service here"),
    Row("EHLO 502: HELO instead", {r: OK for r in BOTH},
        at={"EHLO": "502 5.5.1 Error: command not implemented"}, mail=b" BODY=8BITMIME",
        not_options=("BODY", "SIZE")),
    Row("EHLO and HELO 5xx", {r: ("deferred", "4.4.1") for r in BOTH},
        at={"EHLO": "502 5.5.1 no EHLO", "HELO": "550 5.7.1 go away"}, reason_has="550"),
    Row("MAIL 451", {r: ("deferred", "4.3.0") for r in BOTH},
        at={"MAIL": "451 4.3.0 Temporary sender trouble"}, reason_has="451 4.3.0 Temporary"),
    Row("MAIL 553", {r: ("bounced", "5.1.8") for r in BOTH},
        at={"MAIL": "553 5.1.8 Sender address rejected"}, reason_has="553 5.1.8 Sender"),
    Row("RCPT 4xx and 5xx per recipient",
        {"defer1@dst.test": ("deferred", "4.2.0"), "reject1@dst.test": ("bounced", "5.1.1"),
         "carl@dst.test": OK}),
    Row("RCPT 500 without an enhanced code: every 5xx is permanent",
        {r: ("bounced", "5.0.0") for r in BOTH}, at={"RCPT": "500 Syntax error"},
        reason_has="500 Syntax error"),
    Row("RCPT 450 without an enhanced code", {r: ("deferred", "4.0.0") for r in BOTH},
        at={"RCPT": "450 Mailbox busy"}, reason_has="450 Mailbox busy"),
    Row("RCPT multiline 550", {r: ("bounced", "5.1.1") for r in BOTH},
        at={"RCPT": "550-5.1.1 The mailbox you named\r\n550 5.1.1 does not exist here"},
        reason_has="550 5.1.1 The mailbox you named 5.1.1 does not exist here"),
    Row("DATA command 451", {r: ("deferred", "4.3.1") for r in BOTH},
        at={"DATA": "451 4.3.1 Try again later"}, reason_has="451 4.3.1 Try again"),
    Row("DATA command 554", {r: ("bounced", "5.7.1") for r in BOTH},
        at={"DATA": "554 5.7.1 No data accepted from you"}, reason_has="554 5.7.1 No data"),
    Row("after the final dot 452", {r: ("deferred", "4.3.1") for r in BOTH},
        at={"DOT": "452 4.3.1 Insufficient system storage"}, reason_has="452 4.3.1"),
    Row("after the final dot 554 multiline", {r: ("bounced", "5.6.0") for r in BOTH},
        at={"DOT": "554-5.6.0 Content rejected\r\n554 5.6.0 see the policy"},
        reason_has="554 5.6.0 Content rejected 5.6.0 see the policy"),
    Row("dropped after the greeting", {r: ("deferred", "4.4.2") for r in BOTH},
        at={"EHLO": "drop"}, reason_has="while performing the EHLO handshake"),
    Row("dropped after EHLO", {r: ("deferred", "4.4.1") for r in BOTH}, at={"MAIL": "drop"},
        reason_has="lost connection"),
    Row("dropped after MAIL", {r: ("deferred", "4.4.2") for r in BOTH}, at={"RCPT": "drop"},
        reason_has="lost connection"),
    Row("dropped after RCPT", {r: ("deferred", "4.4.2") for r in BOTH}, at={"DATA": "drop"},
        reason_has="lost connection"),
    Row("dropped in DATA", {r: ("deferred", "4.4.2") for r in BOTH},
        at={"DATA": "354 End data with <CR><LF>.<CR><LF>"}, reason_has="lost connection"),
    Row("dropped after the final dot", {r: ("deferred", "4.4.2") for r in BOTH},
        at={"DOT": "drop"}, reason_has="lost connection"),
    Row("a server without PIPELINING", {r: OK for r in BOTH}, without=frozenset({"PIPELINING"})),
    Row("8BITMIME to a server without it: sent as it is, without BODY=",
        {r: OK for r in BOTH}, without=frozenset({"8BITMIME"}), mail=b" BODY=8BITMIME",
        body=b"Subject: 8 bit\r\n\r\ncaf\xe9\r\n", not_options=("BODY",)),
    Row("8BITMIME to a server with it", {r: OK for r in BOTH}, mail=b" BODY=8BITMIME",
        body=b"Subject: 8 bit\r\n\r\ncaf\xe9\r\n", options=("BODY=8BITMIME",)),
    # Postfix's rule: SMTPUTF8 mail with UTF-8 in the envelope or headers is not downgraded
    Row("a UTF-8 address to a server without SMTPUTF8: every recipient bounces",
        {"ann@dst.test": ("bounced", "5.6.7"), "jöhn@dst.test": ("bounced", "5.6.7")},
        without=frozenset({"SMTPUTF8"}), mail=b" SMTPUTF8",
        reason_has="SMTPUTF8 is required, but was not offered by host 127.0.0.1[127.0.0.1]"),
    Row("UTF-8 headers to a server without SMTPUTF8", {r: ("bounced", "5.6.7") for r in BOTH},
        without=frozenset({"SMTPUTF8"}), mail=b" SMTPUTF8",
        body="Subject: grüße\r\n\r\nhello\r\n".encode(), reason_has="SMTPUTF8 is required"),
    Row("ASCII mail received with SMTPUTF8 to a server without it",
        {r: OK for r in BOTH}, without=frozenset({"SMTPUTF8"}), mail=b" SMTPUTF8",
        body="Subject: ascii\r\n\r\ngrüße in the body\r\n".encode(), not_options=("SMTPUTF8",)),
    Row("a UTF-8 address to a server with SMTPUTF8", {"jöhn@dst.test": OK}, mail=b" SMTPUTF8",
        options=("SMTPUTF8",)),
]


@pytest.fixture(scope="module")
def sinks():
    with Sink() as next_hop, Sink() as senders:
        yield next_hop, senders


def _submit(port: int, row: Row) -> None:
    steps: list[bytes | tuple[bytes, int]] = [b"EHLO client.test",
                                              f"MAIL FROM:<{SENDER}>".encode() + row.mail]
    steps += [f"RCPT TO:<{r}>".encode() for r in row.outcomes]
    steps += [b"DATA", (row.body + b".\r\n", 1), b"QUIT"]
    replies = raw_dialogue(port, steps)
    assert codes(replies) == "220 250 250 " + "250 " * len(row.outcomes) + "354 250 221", replies


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_rfc5321_client_table(sinks, tmp_path, row):
    next_hop, senders = sinks
    next_hop.state.at, next_hop.state.without = dict(row.at), set(row.without)
    bounces_before = len(senders.state.messages)
    queue = str(tmp_path / "q")
    cfg = relay_config(queue, log_json=True, minimal_backoff_time=300.0,
                       maximal_backoff_time=600.0,
                       transport_maps={"dst.test": f"[127.0.0.1]:{next_hop.port}",
                                       "src.test": f"[127.0.0.1]:{senders.port}"})
    bounced = {r for r, (status, _) in row.outcomes.items() if status == "bounced"}
    with RelayThread(cfg) as rt:
        _submit(rt.port, row)
        deadline = time.monotonic() + 20
        while len(got := [e for e in rt.events() if e["to"] in row.outcomes]) < len(
                row.outcomes) and time.monotonic() < deadline:
            time.sleep(0.02)
        if bounced:
            assert rt.wait_events(1, "bounce"), rt.log_lines
            senders.wait_for(bounces_before + 1)
    by_rcpt = {e["to"]: e for e in got}
    assert {r: (e["status"], e["dsn"]) for r, e in by_rcpt.items()} == row.outcomes, got
    for e in by_rcpt.values():
        assert e["relay"].startswith("127.0.0.1["), e  # reached: the host is the relay
        if e["status"] != "sent":
            assert row.reason_has in e["reason"], e
    sent = [m for m in next_hop.state.messages if m.mail_from == SENDER
            and set(m.rcpts) & {r for r, o in row.outcomes.items() if o == OK}]
    for m in sent[-1:]:
        assert set(row.options) <= set(m.mail_options), m.mail_options
        assert not set(row.not_options) & {o.split("=")[0] for o in m.mail_options}, m.mail_options
        assert m.data.endswith(row.body)
    left = queued_entries(queue)
    deferred = {r: e for r, e in by_rcpt.items() if e["status"] == "deferred"}
    assert {e.rcpt: (e.schedule.attempts, e.schedule.reason) for e in left} == {
        r: (1, e["reason"]) for r, e in deferred.items()}
    if bounced:
        dsn = senders.state.messages[bounces_before]
        assert dsn.mail_from == "" and dsn.rcpts == [SENDER]
        for r in bounced:
            status = row.outcomes[r][1].encode()
            assert b"Status: " + status in dsn.data, dsn.data[:2000]
