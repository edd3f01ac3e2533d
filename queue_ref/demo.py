"""``queue-ref demo``: a real filesystem queue at work, shown on disk at each step.

Mail is enqueued, claimed, delivered over SMTP to a receiver on the loopback address,
deferred with a new schedule, cleaned up, and recovered after a simulated crash; then a
one-recipient message's file is kept as a spare and rewritten for the next message.
After each step the queue directory is printed as it is on disk (links with their
targets).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import smtplib
import socket
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.tree import Tree

from queue_ref.fsqueue import FsQueue
from queue_ref.storage import InflightMail, QueuedMail, Recipient, Schedule, Storage

RETRY_DELAY = 15 * 60  # first retry after 15 minutes, as Mailismus does


def disk_tree(root: str) -> list[str]:
    """Every path under ``root`` (relative), sorted: symlinks with their targets, files
    with their size and, for a file of several names (a message file and its entries'
    hard links), how many it has."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(
                os.path.join(dirpath, d))]):
            p = os.path.join(dirpath, name)
            shown = name if rel == "." else os.path.join(rel, name)
            if os.path.islink(p):
                out.append(f"{shown} -> {os.readlink(p)}")
            else:
                st = os.lstat(p)
                names = f", {st.st_nlink} names" if st.st_nlink > 1 else ""
                out.append(f"{shown} ({st.st_size} B{names})")
        for d in dirnames:
            if not os.listdir(os.path.join(dirpath, d)):
                out.append((d if rel == "." else os.path.join(rel, d)) + "/")
    return sorted(out)


def _render(console: Console, title: str, lines: list[str]) -> None:
    tree = Tree(f"[bold]{title}[/bold]")
    for line in lines or ["(empty)"]:
        tree.add(line)
    console.print(tree)


def _deliver(storage: Storage, mail: InflightMail, port: int) -> None:
    """Send one inflight entry over SMTP to the loopback receiver."""
    with storage.read_inflight(mail) as reader:
        body = reader.read_all()
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as smtp:
            smtp.sendmail(reader.meta.mail_from, [reader.meta.rcpt], body)


def _send_and_clean_up(storage: Storage, mail: QueuedMail, port: int) -> None:
    """The rest of a queued entry's life: claim, deliver over SMTP, done, cleanup."""
    taken = storage.send_start(mail)
    assert taken is not None
    _deliver(storage, taken, port)
    finished = storage.send_done(taken)
    assert finished is not None
    storage.cleanup(finished)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_demo(root: str, console: Console, quiet: bool = False) -> dict[str, Any]:
    from aiosmtpd.controller import Controller
    from aiosmtpd.handlers import Sink

    received: list[str] = []

    class Receiver(Sink):
        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
            received.extend(envelope.rcpt_tos)
            return "250 OK"

    steps: list[dict[str, Any]] = []

    def show(title: str) -> None:
        lines = disk_tree(root)
        steps.append({"step": title, "disk": lines})
        if not quiet:
            _render(console, title, lines)

    now = int(time.time())
    port = _free_port()
    controller = Controller(Receiver(), hostname="127.0.0.1", port=port)
    controller.start()
    try:
        q = FsQueue(root)
        show("1. an empty queue")
        body = b"From: alice@example.org\r\nSubject: hello\r\n\r\nHello from queue-ref.\r\n"
        with q.enqueue("alice@example.org") as enq:
            enq.write(body)
            first = enq.commit([Recipient("bob@example.net", Schedule(now)),
                                Recipient("carol@example.com", Schedule(now))])
        show(f"2. one message, two recipients, committed ({q.sync_mode} group commit): "
             "one file in data/ (body, envelope) and four more names of it: a "
             "reference per recipient in data/, a link per recipient in queue/ (hard "
             "links: no inode of their own)")
        inflight = q.send_start(first[0])
        assert inflight is not None
        show("3. send_start: bob's link moved to inflight/, named with this process's owner token")
        _deliver(q, inflight, port)
        done = q.send_done(inflight)
        assert done is not None
        show("4. delivered over SMTP, send_done: the link is in cleanup/; it is never sent again")
        q.cleanup(done)
        show("5. cleanup: bob's hard link and link are gone; the message stays for carol")
        carol = q.send_start(first[1])
        assert carol is not None
        later = q.send_cancel(carol, Schedule(now + RETRY_DELAY, attempts=1))
        assert later is not None
        show("6. carol's server said 4xx: send_cancel put her back with a new schedule, atomically")
        claimed = q.send_start(later)
        assert claimed is not None
        q.close()  # the process "dies" with carol's entry inflight
        show("7. a sender dies holding carol's entry inflight")
        q = FsQueue(root, recover=False)
        report = q.recover()
        show("8. a new FsQueue recovers: the dead owner's entry is queued again (at-least-once)")
        for mail in list(q.list_queue()):
            _send_and_clean_up(q, mail, port)
        show("9. carol delivered and cleaned up: the last recipient takes the message with it")
        footprint = q.footprint()

        def one(rcpt: str, text: bytes) -> int:
            """Enqueue a one-recipient message, deliver it, clean it up; its file's inode."""
            with q.enqueue("alice@example.org") as enq:
                enq.write(text)
                (mail,) = enq.commit([Recipient(rcpt, Schedule(now))])
            inode = os.stat(os.path.join(root, "data", mail.message_id)).st_ino
            _send_and_clean_up(q, mail, port)
            return inode

        first_inode = one("dave@example.net", body + b"A longer first message.\r\n" * 4)
        show("10. a one-recipient message delivered and cleaned up: its file is kept as a "
             "spare in this owner's tmp/ (no entry can reach it)")
        second_inode = one("erin@example.net", body)
        reused = first_inode == second_inode
        show(f"11. the next message was written into the spare (same inode: {reused}), cut "
             "to its length and synced before its link was made; its cleanup keeps it again")
        q.close()
        show("12. close: the queue's spares are removed, nothing is left")
    finally:
        controller.stop()
    return {
        "queue": root,
        "sync_mode": q.sync_mode,
        "delivered_to": received,
        "recovery": {"requeued": report.requeued, "cleaned": report.cleaned},
        "footprint_after_drain": {"objects": footprint.objects, "bytes": footprint.bytes},
        "spare_file_reused": reused,
        "steps": steps,
    }


def _cmd(args: argparse.Namespace) -> int:
    console = Console()
    root = args.dir or tempfile.mkdtemp(prefix="queue-ref-demo-")
    if args.dir and os.path.exists(root):
        if os.listdir(root) and not args.force:
            console.print(f"[red]{root} is not empty; pass --force to replace it[/red]")
            return 2
        shutil.rmtree(root)
    if args.relay:
        from queue_ref.relay.relay_demo import run_relay_demo

        result = run_relay_demo(root, console, quiet=args.json)
        if args.json:
            print(json.dumps(result))
        return 0
    result = run_demo(root, console, quiet=args.json)
    if args.json:
        print(json.dumps(result))
    else:
        console.print(f"delivered to {result['delivered_to']}; "
                      f"footprint after drain: {result['footprint_after_drain']}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="show a real queue directory at work, step by step")
    p.add_argument("--dir", help="queue directory (default: a new temporary one)")
    p.add_argument("--force", action="store_true", help="replace --dir if it exists")
    p.add_argument("--json", action="store_true", help="print the steps as one JSON object")
    p.add_argument("--relay", action="store_true",
                   help="show queue-ref relay instead: accept, defer, retry, deliver, bounce")
    p.set_defaults(func=_cmd)

