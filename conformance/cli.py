"""The ``queue-ref`` command.

Each command group lives in its own module that provides ``register(subparsers)``;
this module only puts them together.  Every command that reports results takes
``--json`` and then prints one JSON object as its last line.

Only the module of the command named on the command line is imported (``COMMANDS``
says which module adds which command, and its one-line help for ``queue-ref --help``):
the certifier and the campaign import hypothesis, pytest's pieces and pyspark, which an
operator's ``mailq`` or ``relay --help`` must not wait for.  ``tests/test_cli_lazy.py``
checks that the table names each module's commands with their help.

Standard output closed early (``queue-ref mailq | head -1``) ends the command quietly
with exit status 141, as a Unix tool killed by SIGPIPE: no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import sys
from collections.abc import Sequence
from typing import NoReturn

#: command -> (module that adds it, its help), in the order --help lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("queue_ref.demo", "show a real queue directory at work, step by step"),
    "certify": ("conformance.certify.certify_command",
                "run the conformance suite on a Storage backend"),
    "crash": ("conformance.crashexplore.crash_command", "crash exploration of a backend"),
    "repair": ("queue_ref.repair_cli",
               "salvage every intact message of a damaged queue (queue stopped)"),
    "relay": ("queue_ref.relay.relay_command",
              "run the SMTP relay (receive, queue, deliver, bounce) on a queue"),
    "mailq": ("queue_ref.operate.operate_commands",
              "list queued, held and in-delivery mail with envelopes and the reason of each "
              "deferred recipient's last attempt (postqueue -p / -j)"),
    "qshape": ("queue_ref.operate.operate_commands",
               "domains x age buckets of the queue (Postfix qshape): queued and "
               "in-delivery entries"),
    "hold": ("queue_ref.operate.operate_commands",
             "set entries aside: never delivered until released (postsuper -h)"),
    "release": ("queue_ref.operate.operate_commands",
                "put held entries back in the queue with their schedule (postsuper -H)"),
    "delete": ("queue_ref.operate.operate_commands",
               "remove queued or held entries without delivering them (postsuper -d)"),
    "requeue": ("queue_ref.operate.operate_commands", "make queued entries due now (postsuper -r)"),
    "flush": ("queue_ref.operate.operate_commands",
              "make deferred mail due now and wake the relay (postqueue -f / -s)"),
    "show": ("queue_ref.operate.operate_commands",
             "envelope, recipients and headers of one message (postcat -q)"),
    "campaign": ("conformance.campaign.campaign_command",
                 "crash exploration on Spark, results as Parquet (run, report, diff)"),
}

#: Modules that add commands, in the order their commands are listed in --help.
COMMAND_MODULES = tuple(dict.fromkeys(module for module, _ in COMMANDS.values()))

#: the exit status of a command whose standard output was closed (128 + SIGPIPE)
BROKEN_PIPE_STATUS = 141


def _named_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (exit 2) are also one JSON object on
    standard output, ``{"error": ..., "status": 2}``, when ``--json`` was asked for: a
    script reading the last line reads why (the commands' own refusals do the same).
    Subparsers are made of this class too (argparse makes them of the parser's type)."""

    json_errors = False  # set by ``main`` for each call

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            print(json.dumps({"error": f"{self.prog}: {message}", "status": 2}), flush=True)
        super().error(message)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv`` (None: every command's module is imported): the named
    command's module adds its commands; the others are listed with their help only."""
    parser = _Parser(
        prog="queue-ref",
        description="A crash-safe mail queue, its contract, fault injection and conformance suite.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if argv is None:
        wanted = set(COMMAND_MODULES)
    else:
        named = _named_command(argv)
        wanted = {COMMANDS[named][0]} if named is not None else set()
    for module in COMMAND_MODULES:
        if module in wanted:
            importlib.import_module(module).register(sub)
        else:  # listed in --help; never chosen, as argv does not name it
            for name, (owner, help_text) in COMMANDS.items():
                if owner == module:
                    sub.add_parser(name, help=help_text)
    # argparse lists subcommands in the order they were added
    sub._choices_actions.sort(key=lambda a: list(COMMANDS).index(a.dest))
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace,
            argv: Sequence[str], extra: str) -> argparse.ArgumentParser:
    """The deepest (sub)command parser chosen in ``argv`` before the unknown ``extra``
    (``queue-ref --bogus mailq`` is the top level's error, ``mailq --bogus`` mailq's)."""
    at = argv.index(extra) if extra in argv else len(argv)
    rest = list(argv[:at])
    while parser._subparsers is not None:
        (action,) = [a for a in parser._subparsers._group_actions
                     if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, action.dest, None)
        if name not in action.choices or name not in rest:
            break
        rest = rest[rest.index(name) + 1:]
        parser = action.choices[name]
    return parser


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll says POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_errors = "--json" in args_list
    try:
        parser = build_parser(args_list)
        args, extras = parser.parse_known_args(args_list)
        if extras:  # refused by the parser of the command they follow: its usage
            _chosen(parser, args, args_list, extras[0]).error(
                f"unrecognized arguments: {' '.join(extras)}")
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket: an error to show, not a reader gone
        # The reader went away (``| head -1``): what is left unwritten goes nowhere, so
        # that the interpreter's last flush does not fail again on the way out.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    return code


if __name__ == "__main__":
    sys.exit(main())
