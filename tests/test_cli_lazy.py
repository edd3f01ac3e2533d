"""The ``queue-ref`` entry point: only the named command's module is imported, and a
reader that closes the pipe early (``| head -1``) ends a command quietly."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import BROKEN_PIPE_STATUS, COMMAND_MODULES, COMMANDS
from queue_ref.opener import open_queue
from queue_ref.storage import Recipient, Schedule

CLI = [sys.executable, "-m", "conformance.cli"]
#: what an operator's command must not wait for
HEAVY = ("conformance.certify", "conformance.campaign", "conformance.crashexplore",
         "conformance.lockstep", "pyspark", "hypothesis", "pytest")


def test_the_table_names_each_module_s_commands_with_their_help() -> None:
    for module in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        added = {a.dest: a.help for a in sub._choices_actions}
        assert added == {n: h for n, (m, h) in COMMANDS.items() if m == module}, module


PROBE = """
import json, sys
from conformance.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("argv", [["mailq", "--help"], ["qshape", "--help"], ["relay", "--help"],
                                  ["show", "--help"], ["--help"]])
def test_an_operator_command_imports_neither_the_certifier_nor_spark(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "usage: queue-ref" in out.stdout
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.startswith(HEAVY)] == []


def test_every_command_is_listed_and_each_help_works() -> None:
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60, check=True)
    for name in COMMANDS:
        assert f"    {name} " in out.stdout
    out = subprocess.run([*CLI, "certify", "--help"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "usage: queue-ref certify" in out.stdout
    bad = subprocess.run([*CLI, "nosuch"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'nosuch'" in bad.stderr


@pytest.fixture(scope="module")
def big_queue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three messages of 900 recipients each, every recipient in a domain of its own:
    mailq and qshape print far more than a pipe holds (64 KiB)."""
    path = tmp_path_factory.mktemp("big") / "q"
    with open_queue(str(path), "fs") as q:
        for m in range(3):
            with q.enqueue(f"sender{m}@example.org") as enq:
                enq.write(b"Subject: many\r\n\r\nbody\r\n")
                enq.commit([Recipient(f"user{i}@domain-{m}-{i}.example", Schedule(10**10))
                            for i in range(900)])
    return path


@pytest.mark.parametrize("command", ["mailq", "qshape"])
def test_a_pipe_closed_early_ends_the_command_quietly(big_queue: Path, command: str) -> None:
    cmd = " ".join([*CLI, command, "--queue", str(big_queue)])
    out = subprocess.run(["bash", "-o", "pipefail", "-c", f"{cmd} | head -1"],
                         capture_output=True, text=True, timeout=120)
    assert out.stderr == ""
    assert len(out.stdout.splitlines()) == 1
    # the pipe did break (the command's output outgrew it): 128 + SIGPIPE, as `yes | head -1`
    assert out.returncode == BROKEN_PIPE_STATUS
    whole = subprocess.run([*CLI, command, "--queue", str(big_queue)], capture_output=True,
                           text=True, timeout=120, check=True)
    assert len(whole.stdout) > 1 << 16


BROKEN_SOCKET = """
import sys
from conformance.cli import main
from queue_ref.operate import operate_commands

def run(name, fn, args):
    raise BrokenPipeError(32, "Broken pipe (a socket)")

operate_commands._run = run
sys.exit(main(["mailq", "--queue", "/nonexistent"]))
"""


def test_a_broken_pipe_that_is_not_standard_output_still_shows() -> None:
    out = subprocess.run([sys.executable, "-c", BROKEN_SOCKET], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "BrokenPipeError: [Errno 32] Broken pipe (a socket)"
