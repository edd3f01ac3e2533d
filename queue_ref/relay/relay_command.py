"""``queue-ref relay``: run the SMTP relay, or check its configuration."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from queue_ref.opener import check_backend
from queue_ref.relay.relay_config import (
    EVENT_LOOPS,
    ConfigError,
    RelayConfig,
    load_config,
    run_relay,
)
from queue_ref.storage import InvalidInputError

__all__ = ["register"]


def _config(args: argparse.Namespace) -> RelayConfig:
    queues = args.queue or []  # --queue given again: every root of one queue
    overrides: dict[str, Any] = {
        "queue": None if not queues else queues[0] if len(queues) == 1 else "",
        "queue_directories": None if not queues else [] if len(queues) == 1 else queues,
        "backend": args.backend, "listen": args.listen,
        "relayhost": args.relayhost, "log_json": True if args.log_json else None,
        "processes": args.processes, "event_loop": args.event_loop,
    }
    return load_config(args.config, overrides)


def _toml(value: Any) -> str:
    """``value`` as a TOML value: tables inline (the TLS policy table nests one)."""
    if isinstance(value, dict):
        inner = ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items())
        return f"{{ {inner} }}"
    return json.dumps(value)


def _show(config: RelayConfig) -> str:
    return "\n".join(f"{key} = {_toml(value)}" for key, value in config.as_dict().items())


def _cmd(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
    except ConfigError as e:
        print(f"queue-ref relay: {e}", file=sys.stderr)
        return 2
    problem = _log_file_problem(config.log_file)
    if problem is not None:
        print(f"queue-ref relay: log_file {config.log_file}: {problem}", file=sys.stderr)
        return 2
    if args.check_config:
        for root in config.queue_roots():  # a queue of another backend there, as at start
            try:
                check_backend(root, config.backend)
            except InvalidInputError as e:
                print(f"queue-ref relay: {e}", file=sys.stderr)
                return 2
        warnings = config.warnings()
        for line in warnings:  # valid, but likely wrong (a running relay logs them)
            print(f"queue-ref relay: warning: {line}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": True, "config": config.as_dict(), "warnings": warnings}))
        else:
            print(_show(config))
        return 0
    from queue_ref.relay.relay_server import Relay, RelayStartError

    if config.processes > 1:
        from queue_ref.relay.relay_master import RelayMaster

        try:
            return RelayMaster(config).run()
        except RelayStartError as e:
            return _start_failed(config, e)
    import setproctitle

    from queue_ref.relay.relay_master import process_title

    setproctitle.setproctitle(process_title(config, "one process"))
    relay = Relay(config)
    try:
        run_relay(config, relay.run())
    except RelayStartError as e:
        return _start_failed(config, e)
    except ConfigError as e:  # the event loop named cannot be had
        print(f"queue-ref relay: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def _log_file_problem(path: str) -> str | None:
    """Why the relay could not append to ``log_file``, or None (checked before it starts,
    and by ``--check-config``: a log the relay cannot write to is found now, not by a
    traceback, or never)."""
    if not path:
        return None
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "cannot be written to by this user"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made in {parent} by this user"
    return None


def _start_failed(config: RelayConfig, e: Exception) -> int:
    """Say why the relay could not start: on standard error, and as an ``error`` record
    of its log (with ``--log-json`` and no ``log_file``, the record alone: standard error
    then holds JSON records only).  Exit status 1."""
    from queue_ref.relay.delivery_log import DeliveryLog

    if not (config.log_json and not config.log_file):
        print(f"queue-ref relay: {e}", file=sys.stderr)
    if config.log_json or config.log_file:
        log = DeliveryLog(config.log_json, config.log_file)
        log.emit("error", what="start", reason=str(e))
        log.close()
    return 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "relay", help="run the SMTP relay (receive, queue, deliver, bounce) on a queue",
        description="An SMTP relay on any Storage backend: mail is answered 250 only once "
                    "committed, delivered to its MX (or a relayhost) with retries, bounced "
                    "with an RFC 3464 DSN when it cannot be.  See docs/relay.md.")
    p.add_argument("--config", metavar="FILE", help="TOML configuration (default: built-in)")
    p.add_argument("--queue", metavar="DIR", action="append",
                   help="queue directory (overrides the file); given again, every root of "
                        "one queue over several disks (docs/multi-root.md)")
    p.add_argument("--backend", help="fs (default), fs-fsync, kv-log, kv-leveldb or "
                                     "pkg.module:factory")
    p.add_argument("--listen", metavar="HOST:PORT", help="SMTP address (default 127.0.0.1:2525)")
    p.add_argument("--relayhost", metavar="HOST:PORT",
                   help="send all mail to this smarthost ([host]:port skips the MX lookup)")
    p.add_argument("--log-json", action="store_true", help="log JSON lines instead of text")
    p.add_argument("--processes", type=int, metavar="N",
                   help="relay processes sharing the queue and the port (a master accepts and hands "
                        "each connection to the worker with the fewest sessions); "
                        "a KV queue (kv-log, kv-leveldb) needs one --queue root per "
                        "process, each served by one of them")
    p.add_argument("--event-loop", choices=EVENT_LOOPS,
                   help="the event loop of each relay process: uvloop, asyncio, or auto "
                        "(uvloop where it is installed; the default)")
    p.add_argument("--check-config", action="store_true",
                   help="validate and print the effective configuration, then exit")
    p.add_argument("--json", action="store_true", help="with --check-config: one JSON object")
    p.set_defaults(func=_cmd)
