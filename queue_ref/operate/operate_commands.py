"""The operator commands: ``mailq``, ``qshape``, ``hold``, ``release``, ``delete``,
``requeue``, ``flush`` and ``show``.

    queue-ref mailq   (--queue DIR [--backend B] | --config RELAY.toml) [--json]
    queue-ref qshape  --queue DIR [--by recipient|sender] [--held] [--top N] [--json]
    queue-ref hold    --queue DIR (ID... | ALL | - | --domain D | --all) [--json]
    queue-ref release --queue DIR (ID... | ALL | - | --domain D | --all) [--json]
    queue-ref delete  --queue DIR (ID... | ALL | - | --domain D | --all) [--json]
    queue-ref requeue --queue DIR (ID... | ALL | - | --domain D | --all) [--json]
    queue-ref flush   --queue DIR [--domain D] [--json]
    queue-ref show    --queue DIR ID [--body] [--json]

They open the queue like any other process (a filesystem queue is shared with a running
``queue-ref relay``; every change is one Storage transition, so nothing is claimed twice).
A KV queue belongs to one process: while a relay works on it (``relay.pid``) the
commands make their calls in the relay, through its control socket
(``relay_control_client``), and refuse, naming the relay, if it does not answer.  ``--backend``
defaults to the one whose files are in DIR.  Exit status: 0 done, 1 the queue could not
be opened or failed, 2 bad usage (unknown id, malformed domain, not a queue directory):
one line on standard error (with ``--json`` also ``{"error": ..., "status": N}`` on
standard output), and nothing changed.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import io
import json
import os
import pwd
import sys
import time
from collections.abc import Callable
from typing import Any

from queue_ref.kv.engine_errors import held_by_another
from queue_ref.opener import open_queue, queue_kind, read_relay_pid, wake_relay
from queue_ref.operate import queue_actions as qa
from queue_ref.operate.relay_control_client import RelayControlStorage
from queue_ref.operate.relay_control_wire import socket_path
from queue_ref.storage import (
    CorruptionError,
    InvalidInputError,
    QueueError,
    Storage,
)


class Refused(QueueError):
    """The queue cannot be opened by this process now (exit status 1)."""


def open_for_operator(path: str, backend: str | None, *, recover: bool = True
                      ) -> tuple[Storage, str]:
    """Open an existing queue for an operator command; never creates one.

    ``recover=False`` (the listings, ``mailq`` and ``qshape``, which change no entry): a
    filesystem queue is opened without its recovery, which reads every queued entry, so
    the first entry is listed at once whatever the queue holds; what a crash left is
    skipped by the listings (an uncommitted enqueue's link) or shown as it is (a dead
    process's claim: in delivery) until the next recovery.

    InvalidInputError when ``path`` is not a queue directory (or the backend is unknown);
    A KV queue a relay holds (single-process stores) is reached through the relay's
    control socket; Refused when it does not answer.
    """
    if not os.path.isdir(path):
        if _unsearchable(path):
            raise Refused(f"{path}: permission denied (a directory above it, or above the "
                          "directory it links to, cannot be searched as this user)")
        raise InvalidInputError(f"{path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK, effective_ids=True):
        raise Refused(f"{path}: permission denied (it cannot be read as this user): "
                      f"{_who_may(path, path)}")
    found = queue_kind(path)
    if backend is None:
        if found is None:
            raise InvalidInputError(f"{path} is not a queue (no filesystem queue's data/ and "
                                    "queue/, no KV store's CURRENT and MANIFEST)")
        kind = found
    else:
        kind = backend
        family = "fs" if kind.startswith("fs") else "kv" if kind.startswith("kv") else ""
        if family and (found is None or not found.startswith(family)):
            raise InvalidInputError(f"{path} is not a {kind} queue")
    if kind.startswith("kv"):
        try:
            pid = read_relay_pid(path)
        except PermissionError as e:
            raise Refused(f"{path}: permission denied ({e.filename}): "
                          f"{_who_may(path, e.filename)}") from e
        if pid is not None:  # the store is the relay's: its calls are made there
            try:
                return RelayControlStorage(path), kind
            except OSError as e:
                what = ("run the command as the queue's owner (the relay's user)"
                        if e.errno in (errno.EACCES, errno.EPERM) else
                        "the relay is starting or stopping: try again in a moment, or once "
                        "it has stopped")
                raise Refused(f"the relay (pid {pid}) works on this KV queue, and a KV queue "
                              "is opened by one process only; its control socket "
                              f"{socket_path(path)} does not answer ({e.strerror or e}): "
                              f"{what}") from e
        try:
            return open_queue(path, kind), kind
        except QueueError as e:
            if held_by_another(e):  # a relay starting (its lock taken, no socket yet)
                raise Refused(f"{path} is held by another process (a relay starting, or "
                              "another command): try again in a moment") from e
            if (denied := _denied(path, e)) is not None:
                raise denied from e
            raise
    try:
        if not recover and kind in ("fs", "fs-fsync"):
            from queue_ref.fsqueue import FsQueue

            return FsQueue(path, recover=False,
                           sync="fsync" if kind == "fs-fsync" else None), kind
        return open_queue(path, kind), kind
    except QueueError as e:
        if (denied := _denied(path, e)) is not None:
            raise denied from e
        raise


def _unsearchable(path: str) -> bool:
    """Whether ``path`` cannot even be looked at for want of a permission."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def _denied(path: str, e: QueueError) -> Refused | None:
    """The Refused to raise, saying who may, when ``e`` came of a permission denied in
    the queue at ``path`` (a command opens it as one of its users, reading and writing
    its files); None for any other cause."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, PermissionError):
        cause = cause.__cause__
    if not isinstance(cause, PermissionError):
        return None
    return Refused(f"{path}: permission denied ({cause.filename or cause}): a command "
                   "opens the queue as one of its users, reading and writing its files: "
                   f"{_who_may(path, cause.filename)}")


def _who_may(path: str, denied: object) -> str:
    """What to do about a permission denied on ``denied`` in the queue at ``path``: run
    as its owner; or, for its owner, look at that file's mode; for root, nothing a user
    can change (an immutable file, a read-only mount, a security module)."""
    euid = os.geteuid()
    if euid == 0:
        return "root was refused too (an immutable file, a read-only mount, or a " \
            "security module)"
    st = os.stat(path)
    if st.st_uid == euid:
        try:
            theirs = os.lstat(str(denied)).st_uid
        except (OSError, ValueError):
            theirs = euid
        if theirs != euid:
            return (f"the queue is this user's, but {denied} belongs to {_user(theirs)}: "
                    "give it back to the queue's owner, or run the command as root")
        return f"the queue is this user's: {denied} has a mode that refuses its owner"
    return "run the command as root" if st.st_uid == 0 else \
        f"run the command as the queue's owner ({_user(st.st_uid)}) or root"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _fmt_time(ns: int) -> str:
    if not ns:
        return "-"
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).strftime("%a %b %d %H:%M:%S")


def _fmt_at(at: int) -> str:
    try:
        return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return str(at)


# ---- the commands ---------------------------------------------------------------------


def _mailq(store: Storage, args: argparse.Namespace) -> int:
    """Each message as it is found, in the backend's listing order (Postfix's mailq: queue
    scan order), so the first line comes at once and nothing of the queue is kept; the
    totals follow the last message."""
    n_msgs = nrcpt = size = 0
    for m in qa.stream_messages(qa.stream(store)):
        if not n_msgs and not args.json:
            print(f"{'-Queue ID-':<42} {'--Size--':>8} {'----Arrival Time----':<20} "
                  "-Sender/Recipient-------")
        n_msgs, nrcpt, size = n_msgs + 1, nrcpt + len(m.entries), size + m.size
        if args.json:
            print(json.dumps(m.to_json()), flush=n_msgs == 1)
            continue
        mark = "*" if m.in_delivery else "!" if m.held else " "
        print(f"{m.message_id + mark:<42} {m.size:>8} {_fmt_time(m.arrival_ns):<20} "
              f"{m.mail_from or 'MAILER-DAEMON'}")
        for e in m.entries:
            how = {"held": "held", "inflight": "in delivery"}.get(e.state) or (
                f"attempts {e.schedule.attempts}, next {_fmt_at(e.schedule.at)}")
            if e.schedule.reason:
                print(f"({qa.one_line(e.schedule.reason)})")
            print(f"{'':<72} {e.rcpt}  ({e.entry_id}: {how})")
        print(flush=n_msgs == 1)  # the first at once, the rest as the buffer fills
    if args.json:
        print(json.dumps({"messages": n_msgs, "recipients": nrcpt, "bytes": size}))
    elif not n_msgs:
        print("Mail queue is empty")
    else:
        print(f"-- {(size + 1023) // 1024} Kbytes in {n_msgs} Request"
              f"{'s' if n_msgs != 1 else ''}, {nrcpt} recipient{'s' if nrcpt != 1 else ''}.")
    return 0


def _qshape(store: Storage, args: argparse.Namespace) -> int:
    """Counted while the queue is listed (``qa.stream``): no entry is kept.  As Postfix's
    qshape counts its incoming, active and deferred queues and not hold unless asked:
    the queued entries and those in delivery, or (``--held``) the held ones alone."""
    if args.top < 0:
        raise InvalidInputError(f"--top: at least 0 (0: every domain), got {args.top}")
    infos = (i for i in qa.stream(store) if (i.state == "held") == args.held)
    rows = qa.qshape(infos, time.time_ns(), by=args.by, top=args.top)
    if args.json:
        print(json.dumps({"by": args.by, "held_only": args.held, "columns": list(qa.AGE_COLUMNS),
                          "rows": [{"domain": d, "counts": c} for d, c in rows]}))
        return 0
    width = max([len(d) for d, _ in rows] + [6])
    print(" " * (width + 1) + " ".join(f"{c:>5}" for c in qa.AGE_COLUMNS))
    for d, counts in rows:
        print(f"{d:>{width}} " + " ".join(f"{n:>5}" for n in counts))
    return 0


def _take_ids(args: argparse.Namespace) -> None:
    """postsuper's ways of naming entries, before the queue is opened: ``ALL`` alone
    (every entry, as ``--all``), and ``-``: the ids on standard input (whitespace apart,
    mailq's ``*`` and ``!`` marks after an id dropped, each taken as it is: an ``ALL``
    there is an id like any other).  Standard input is read before the queue is opened,
    so ``mailq | ... | delete -`` on a KV queue opens it once mailq has closed it."""
    given = args.ids
    if "ALL" in given:
        if len(given) > 1 or args.domain is not None or args.all:
            raise InvalidInputError("ALL names every entry: give it alone")
        args.ids, args.all = [], True
    elif "-" in given:
        if args.domain is not None or args.all:
            raise InvalidInputError("name the entries: queue ids (or -), --domain D, or --all")
        read = [t.rstrip("*!") for t in sys.stdin.read().split()]
        args.ids = [i for i in given if i != "-"] + [t for t in read if t]
        if not args.ids:
            raise InvalidInputError("no queue id on standard input")


def _action(fn: Callable[..., qa.ActionResult]) -> Callable[[Storage, argparse.Namespace], int]:
    def run(store: Storage, args: argparse.Namespace) -> int:
        chosen = qa.select(qa.listing(store), ids=args.ids, domain=args.domain, every=args.all,
                           roots=len(args.queue), busy=lambda: qa.in_delivery(store))
        res = fn(store, chosen)
        _log_actions(res, args)
        woke = False
        if res.changed and res.action in ("release", "requeue"):
            # entries became due: a running relay looks at once (no wait for its scan)
            woke = _wake(args.queue[0])
        _report(res, args)
        if woke and not args.json:
            print("relay woken")  # as flush says it
        return 0
    return run


#: What each action did to an entry, said per entry as postsuper says it per message.
_DONE = {"hold": "placed on hold", "release": "released from hold", "delete": "removed",
         "requeue": "requeued", "flush": "due now"}


def _wake(path: str) -> bool:
    """``wake_relay``; a relay this user may not signal (or whose pid file it may not
    read) is said on standard error, and not woken: it finds the change at its next
    scan."""
    try:
        return wake_relay(path)
    except PermissionError as e:
        print(f"queue-ref: the relay was not woken ({e.strerror}): it finds the change at "
              "its next scan of the queue", file=sys.stderr)
        return False


def _log_actions(res: qa.ActionResult, args: argparse.Namespace) -> None:
    """Each entry changed, in the relay's log file when the command was given the relay's
    ``--config`` and it names one (as postsuper's ``ID: removed`` lands in the mail log
    beside the deliveries): ``operator`` records, written by ``queue-ref/ACTION[pid]``,
    appended in one write to the file the relay made (never made here).  A log that
    cannot be written to is said on standard error; what was done stands."""
    if args.relay_log is None or not res.changed:
        return
    from queue_ref.relay.delivery_log import DeliveryLog

    json_lines, path = args.relay_log
    lines = io.StringIO()
    log = DeliveryLog(json_lines, stream=lines, program=f"queue-ref/{res.action}")
    who = _operator()
    for entry in res.changed:
        log.emit("operator", res.message_of.get(entry, ""), action=res.action, entry_id=entry,
                 result=_DONE.get(res.action, res.action), **who)
    data = lines.getvalue().encode("utf-8", "backslashreplace")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except OSError as e:
        print(f"queue-ref {res.action}: not written to the relay's log {path}: "
              f"{e.strerror or e}", file=sys.stderr)


def _operator() -> dict[str, str]:
    """Who ran the command: the user of its effective uid (not the environment's
    ``USER``), and, for a command run as root, the user sudo says it ran it for (the
    environment's word: only root's own sudo sets it for root)."""
    who = {"user": _user(os.geteuid())}
    sudo = os.environ.get("SUDO_USER")
    if sudo and os.geteuid() == 0:
        who["sudo_user"] = qa.one_line(sudo)
    return who


def _report(res: qa.ActionResult, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(res.to_json()))
        return
    for entry in res.changed:  # the ids changed, for the operator's own record
        print(f"{entry}: {_DONE.get(res.action, res.action)}")
    print(f"{res.action}: {len(res.changed)} entr{'y' if len(res.changed) == 1 else 'ies'}"
          + (f", {len(res.vanished)} moved meanwhile" if res.vanished else "")
          + (f", {len(res.skipped)} not applicable ({_why(res.why)})" if res.skipped else ""))


def _why(why: dict[str, int]) -> str:
    """Why entries were skipped: the reason alone, or each with its count."""
    if len(why) == 1:
        return next(iter(why))
    return "; ".join(f"{n} {reason}" for reason, n in sorted(why.items()))


def _flush(store: Storage, args: argparse.Namespace) -> int:
    res = qa.flush(store, args.domain)
    _log_actions(res, args)
    woke = _wake(args.queue[0]) if res.changed else False
    if args.json:
        print(json.dumps({**res.to_json(), "domain": args.domain, "relay_woken": woke}))
        return 0
    _report(res, args)
    if res.changed:
        print("relay woken" if woke else "no relay is running on this queue")
    return 0


def _show(store: Storage, args: argparse.Namespace) -> int:
    if args.id in ("ALL", "-"):
        raise InvalidInputError("show takes one queue id (see mailq)")
    listed = qa.listing(store)
    chosen = qa.select(listed, ids=[args.id], roots=len(args.queue),
                       busy=lambda: qa.in_delivery(store))  # in delivery: said as such
    msg_id = chosen[0][1].message_id
    entries: list[tuple[object, qa.EntryInfo]] = [x for x in listed if x[1].message_id == msg_id]
    entries += [(None, i) for i in qa.in_delivery(store) if i.message_id == msg_id]
    entries.sort(key=lambda x: x[1].rcpt_index)
    h = next(x[0] for x in entries if x[0] is not None)
    reader = store.inspect_entry(h)  # type: ignore[arg-type]
    if reader is None:
        raise InvalidInputError(f"{args.id} moved while it was read; run show again")
    with reader:
        body = reader.read_all()
    head, sep, rest = body.partition(b"\r\n\r\n")
    if not sep:
        head, sep, rest = body.partition(b"\n\n")
    info = entries[0][1]
    if args.json:
        print(json.dumps({
            "queue_id": msg_id, "sender": info.mail_from, "arrival_time":
            info.arrival_ns // 10**9, "message_size": info.size, "params": dict(sorted(info.params.items())),
            "recipients": [e.to_json() for _, e in entries],
            "headers": head.decode("utf-8", "replace"),
            **({"body": rest.decode("utf-8", "replace")} if args.body else {})}))
        return 0
    print("*** ENVELOPE RECORDS ***")
    print(f"message_size: {info.size}")
    print(f"message_arrival_time: {_fmt_time(info.arrival_ns)}")
    print(f"sender: {info.mail_from}")
    for k, v in sorted(info.params.items()):
        print(f"named_attribute: {k}={v}")
    for _, e in entries:
        state = {"held": "held", "inflight": "in delivery"}.get(e.state, "queued")
        print(f"recipient: {e.rcpt} ({e.entry_id}, {state}, attempts {e.schedule.attempts}, "
              f"next attempt {_fmt_at(e.schedule.at)}, zone {e.zone})")
        if e.schedule.reason:
            print(f"delay_reason: {qa.one_line(e.schedule.reason)}")
    print("*** MESSAGE CONTENTS ***")
    sys.stdout.write(head.decode("utf-8", "replace") + "\n")
    if args.body:
        print()
        sys.stdout.write(rest.decode("utf-8", "replace"))
    print("*** END OF MESSAGE ***")
    return 0


# ---- plumbing ---------------------------------------------------------------------------


def _where(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The queue's directories and backend: ``--queue`` (given again: every root of a
    queue over several) and ``--backend``, or the relay's ``--config`` file (its ``queue``
    or ``queue_directories``, and ``backend``; ``--backend`` still wins)."""
    if (args.queue is None) == (args.config is None):
        raise InvalidInputError("name the queue: --queue DIR or --config FILE (the relay's)")
    args.relay_log = None
    if args.config is None:
        return list(args.queue), args.backend
    # the relay's configuration module brings asyncio and dnspython: imported only here,
    # so a listing by --queue does not wait for them before its first line
    from queue_ref.relay.relay_config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as e:
        said = str(e)  # a ConfigError names the file already
        raise InvalidInputError(said if args.config in said else f"{args.config}: {said}") from e
    if cfg.log_file:  # the actions are written to the relay's log too (``_log_actions``)
        args.relay_log = (cfg.log_json, cfg.log_file)
    return cfg.queue_roots(), args.backend if args.backend is not None else cfg.backend


#: The commands that only list (no entry changes): they open a queue without recovery.
_LISTINGS = frozenset({"mailq", "qshape"})


def _run(name: str, fn: Callable[[Storage, argparse.Namespace], int],
         args: argparse.Namespace) -> int:
    try:
        if hasattr(args, "ids"):  # the actions
            _take_ids(args)
        queues, backend = _where(args)
        args.queue = [os.path.abspath(q) for q in queues]
        store = _open_roots(args.queue, backend, recover=name not in _LISTINGS)
    except InvalidInputError as e:
        return _failed(name, str(e), 2, args)
    except QueueError as e:
        return _failed(name, str(e), 1, args)
    _say_recovery_damage(name, store)
    try:
        return fn(store, args)
    except InvalidInputError as e:
        return _failed(name, str(e), 2, args)
    except CorruptionError as e:
        return _failed(name, f"{e} (quarantined)", 1, args)
    except QueueError as e:
        return _failed(name, str(_denied(args.queue[0], e) or e), 1, args)
    finally:
        for x in store.set_aside():  # a listing that found an entry damaged skips it
            print(f"queue-ref {name}: {x.entry_id}: damaged, set aside: {x.reason}",
                  file=sys.stderr)
        store.close()


def _say_recovery_damage(name: str, store: Storage) -> None:
    """What the recovery that opened the queue found damaged, on standard error (a
    relay logs it at its start; a command that recovers the queue says it the same)."""
    report = store.last_recovery
    if report is None or not (report.damage_found or report.quarantined):
        return
    print(f"queue-ref {name}: opening the queue set damage aside: {report.quarantined} "
          f"entries quarantined; messages lost: {', '.join(report.lost) or 'none'}"
          + (f" and {report.lost_unknown} records of unknown messages"
             if report.lost_unknown else ""), file=sys.stderr)
    for problem in report.problems:
        print(f"queue-ref {name}: {problem}", file=sys.stderr)


def _failed(name: str, reason: str, status: int, args: argparse.Namespace) -> int:
    """One line on standard error; with ``--json`` also one object on standard output
    (``error``, ``status``), so a script that reads the last line reads why."""
    print(f"queue-ref {name}: {reason}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": reason, "status": status}))
    return status


def _open_roots(paths: list[str], backend: str | None, *, recover: bool) -> Storage:
    """``open_for_operator`` on one directory, or on each root of a queue over several
    (``queue_ref.multi_root``)."""
    if len(paths) == 1:
        return open_for_operator(paths[0], backend, recover=recover)[0]
    from queue_ref.multi_root import MultiRootQueue

    return MultiRootQueue.over(
        paths, lambda path: open_for_operator(path, backend, recover=recover)[0])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queue", metavar="DIR", action="append",
                   help="the queue's directory; given again, every root of one queue over "
                        "several disks")
    p.add_argument("--config", metavar="FILE",
                   help="the relay's TOML configuration: its queue and backend")
    p.add_argument("--backend", default=None,
                   help="fs, fs-fsync, kv-log, kv-leveldb or package.module:factory "
                        "(default: the one whose files are in DIR)")
    p.add_argument("--json", action="store_true", help="print JSON (last line one object)")


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID",
                   help="entry or message ids (see mailq); ALL: every entry; -: the ids on "
                        "standard input (as postsuper takes them)")
    p.add_argument("--domain", default=None, help="every entry of this recipient domain")
    p.add_argument("--all", action="store_true", help="every entry")


_ACTIONS: dict[str, tuple[str, Callable[..., qa.ActionResult]]] = {
    "hold": ("set entries aside: never delivered until released (postsuper -h)", qa.hold),
    "release": ("put held entries back in the queue with their schedule (postsuper -H)",
                qa.release),
    "delete": ("remove queued or held entries without delivering them (postsuper -d)",
               qa.delete),
    "requeue": ("make queued entries due now (postsuper -r)", qa.requeue),
}


def register(subparsers: Any) -> None:
    def add(name: str, help_text: str, fn: Callable[[Storage, argparse.Namespace], int]
            ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text,
                                                           description=help_text)
        _common(p)
        p.set_defaults(func=lambda a, n=name, f=fn: _run(n, f, a))
        return p

    add("mailq", "list queued, held and in-delivery mail with envelopes and the reason of "
                 "each deferred recipient's last attempt (postqueue -p / -j)", _mailq)
    p = add("qshape", "domains x age buckets of the queue (Postfix qshape): queued and "
                      "in-delivery entries", _qshape)
    p.add_argument("--by", choices=("recipient", "sender"), default="recipient")
    p.add_argument("--held", action="store_true",
                   help="held entries instead (Postfix: qshape hold)")
    p.add_argument("--top", type=int, default=0, help="at most N domains (0: all)")
    for name, (text, fn) in _ACTIONS.items():
        _selection(add(name, text, _action(fn)))
    p = add("flush", "make deferred mail due now and wake the relay (postqueue -f / -s)",
            _flush)
    p.add_argument("--domain", default=None, help="only this recipient domain (ETRN)")
    p = add("show", "envelope, recipients and headers of one message (postcat -q)", _show)
    p.add_argument("id", metavar="ID", help="an entry or message id")
    p.add_argument("--body", action="store_true", help="print the body too")
