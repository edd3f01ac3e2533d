"""``queue-ref demo --relay``: the relay accepting, deferring, retrying, delivering and
bouncing, against a loopback SMTP server, its log shown as it is written.

The loopback server (aiosmtpd) stands for the next hop: it accepts ``bob``, says 451 the
first time it sees ``busy`` and 250 afterwards, and refuses ``nobody`` with 550.  The relay
runs on a fresh filesystem queue with a fast retry schedule (2 s instead of 300 s).
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import io
import json
import smtplib
import threading
import time
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session
from rich.console import Console
from rich.markup import escape

from queue_ref.opener import open_queue
from queue_ref.relay.delivery_log import DeliveryLog
from queue_ref.relay.relay_config import RelayConfig
from queue_ref.relay.relay_server import Relay

__all__ = ["run_relay_demo"]


class _NextHop:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.received: list[tuple[str, list[str], bytes]] = []

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          options: list[str]) -> str:
        n = self.seen.get(address, 0)
        self.seen[address] = n + 1
        if address.startswith("nobody@"):
            return "550 5.1.1 <nobody@example.net>: Recipient address rejected"
        if address.startswith("busy@") and n == 0:
            return "451 4.2.0 Mailbox busy, try again later"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        sender = "" if envelope.mail_from in (None, "<>") else str(envelope.mail_from)
        self.received.append((sender, list(envelope.rcpt_tos), envelope.original_content or b""))
        return "250 2.0.0 Ok: delivered"


class _Lines:
    """The relay's log stream: JSON records kept, shown as Postfix-style lines."""

    def __init__(self, show: Any) -> None:
        self.records: list[dict[str, Any]] = []
        self._show = show
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                rec = json.loads(line)
                with self._lock:
                    self.records.append(rec)
                self._show(rec)
        return len(text)

    def flush(self) -> None:
        pass

    def wait(self, pred: Any, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if pred(self.records):
                    return True
            time.sleep(0.05)
        return False


def _deliveries(records: list[dict[str, Any]], status: str) -> list[str]:
    return [r["to"] for r in records if r["event"] == "delivery" and r["status"] == status]


def run_relay_demo(root: str, console: Console, quiet: bool = False) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    hop = _NextHop()

    async def start_hop() -> asyncio.Server:
        lp = asyncio.get_running_loop()
        return await lp.create_server(lambda: SMTP(hop, loop=lp), "127.0.0.1", 0)

    def say(text: str) -> None:
        if not quiet:
            console.print(text)

    server = asyncio.run_coroutine_threadsafe(start_hop(), loop).result(10)
    hop_port = server.sockets[0].getsockname()[1]
    config = RelayConfig(queue=root, listen="127.0.0.1:0", relayhost=f"[127.0.0.1]:{hop_port}",
                         myhostname="relay.demo", minimal_backoff_time=2, maximal_backoff_time=4,
                         backoff_jitter=0.0, log_json=True).validate()
    fmt = DeliveryLog(stream=io.StringIO())  # renders records as Postfix-style lines
    lines = _Lines(lambda rec: say(f"  [dim]log[/dim] {escape(fmt.text(rec))}"))
    relay = Relay(config, log_stream=lines)
    result: dict[str, Any] = {"queue": root}
    try:
        asyncio.run_coroutine_threadsafe(relay.start(), loop).result(30)
        assert relay.smtp_address is not None
        port = relay.smtp_address[1]
        say(f"[bold]1. the relay listens on 127.0.0.1:{port}[/bold] (queue {root}, backend fs); "
            f"its next hop is a loopback SMTP server on port {hop_port}")
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
            client.ehlo("client.demo")
            say(f"[bold]2. a client says EHLO[/bold]: {', '.join(sorted(client.esmtp_features))}")
            client.mail("alice@example.org")
            rcpts = ["bob@example.net", "busy@example.net", "nobody@example.net"]
            for r in rcpts:
                client.rcpt(r)
            code, reply = client.data(b"From: alice@example.org\r\nTo: bob@example.net\r\n"
                                      b"Subject: relay demo\r\n\r\nHello through queue-ref.\r\n")
            say(f"[bold]3. one message to {len(rcpts)} recipients[/bold]: {code} "
                f"{reply.decode()} (only once the queue's commit returned: durable)")
            result["accepted"] = f"{code} {reply.decode()}"
        say("[bold]4. delivery: bob is sent, busy deferred (451), nobody bounced (550); "
            "the bounce is committed before nobody's entry is finished[/bold]")
        lines.wait(lambda rs: "busy@example.net" in _deliveries(rs, "deferred")
                   and "nobody@example.net" in _deliveries(rs, "bounced"))
        say("[bold]5. the bounce (null sender) goes back to alice; busy waits for its retry "
            "(2 s here, 300 s by default)[/bold]")
        lines.wait(lambda rs: "busy@example.net" in _deliveries(rs, "sent")
                   and "alice@example.org" in _deliveries(rs, "sent"))
        say("[bold]6. busy delivered on the retry; the queue is empty[/bold]")
    finally:
        asyncio.run_coroutine_threadsafe(relay.stop(), loop).result(60)

        async def stop_hop() -> None:
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop_hop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    bounce = next((data for sender, to, data in hop.received if sender == ""), b"")
    report = email.message_from_bytes(bounce, policy=email.policy.default)
    statuses = []
    if report.is_multipart():
        parts = list(report.iter_parts())
        if len(parts) > 1:
            blocks: Any = parts[1].get_payload()
            statuses = [dict(b.items()) for b in blocks[1:]]
    with open_queue(root) as q:
        left = len(list(q.list_queue()))
        footprint = q.footprint()
    result.update({
        "sent": _deliveries(lines.records, "sent"),
        "deferred": _deliveries(lines.records, "deferred"),
        "bounced": _deliveries(lines.records, "bounced"),
        "bounce": {"subject": str(report["Subject"] or ""),
                   "recipients": [s.get("Final-Recipient", "") for s in statuses],
                   "status": [s.get("Status", "") for s in statuses]},
        "next_hop_received": [{"from": s, "to": t} for s, t, _ in hop.received],
        "queue_left": left, "footprint": {"objects": footprint.objects, "bytes": footprint.bytes},
    })
    say(f"sent {result['sent']}, deferred then sent {result['deferred']}, bounced "
        f"{result['bounced']}; the bounce says {result['bounce']['status']}; "
        f"entries left in the queue: {left}")
    return result
