"""The ``queue-ref`` command.

Each command group lives in its own module that provides ``register(subparsers)``;
this module only puts them together.  Every command that reports results takes
``--json`` and then prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Modules that add commands, in the order their commands are listed in --help.
COMMAND_MODULES = (
    "queue_ref.demo",
    "conformance.certify.certify_command",
    "conformance.crashexplore.crash_command",
    "queue_ref.repair_cli",
    "queue_ref.relay.relay_command",
    "queue_ref.operate.operate_commands",
    "conformance.campaign.campaign_command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="queue-ref",
        description="A crash-safe mail queue, its contract, fault injection and conformance suite.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
