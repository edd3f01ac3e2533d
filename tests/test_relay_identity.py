"""The relay's name (myhostname): Postfix's default, refused when it is no host name,
and a warning (at start and from --check-config) when it is not fully qualified."""

from __future__ import annotations

import json
import smtplib
import socket
import subprocess
import sys
import time
from pathlib import Path

from queue_ref.relay.relay_config import RelayConfig, default_myhostname
from tests.relay_support import relay_process


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance.cli", "relay", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_default_is_the_host_name_made_fully_qualified_as_postfix_does() -> None:
    name = socket.gethostname()
    expected = name if "." in name else f"{name}.localdomain"
    assert default_myhostname() == expected
    c = RelayConfig(queue="/q")
    assert c.myhostname == expected != "localhost"
    assert c.mydomain == expected.partition(".")[2]
    if "." not in name:  # mydomain completes a short host name
        assert RelayConfig(queue="/q", mydomain="example.net").myhostname == f"{name}.example.net"
    c = RelayConfig(queue="/q", myhostname="mx.example.org")
    assert (c.myhostname, c.mydomain, c.warnings()) == ("mx.example.org", "example.org", [])
    assert RelayConfig(queue="/q", myhostname="mailhost").mydomain == "localdomain"


def test_check_config_warns_of_a_name_that_is_not_fully_qualified(tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    for name, why in [("mailhost", "is not a fully qualified domain name"),
                      ("mx.localdomain", "is a local name, not a fully qualified domain name "
                                         "others resolve"),
                      ("localhost", "is not a fully qualified domain name")]:
        f.write_text(f'queue = "/var/spool/x"\nmyhostname = "{name}"\n')
        r = cli("--config", str(f), "--check-config")
        assert r.returncode == 0
        assert r.stderr.splitlines() == [
            f"queue-ref relay: warning: myhostname: '{name}' {why}; next hops see it in EHLO "
            "and Received (set myhostname, or mydomain)"]
        assert f'myhostname = "{name}"' in r.stdout.splitlines()
        out = json.loads(cli("--config", str(f), "--check-config", "--json").stdout)
        assert out["ok"] and len(out["warnings"]) == 1
    f.write_text('queue = "/var/spool/x"\nmyhostname = "mx.example.org"\n')
    r = cli("--config", str(f), "--check-config")
    assert (r.returncode, r.stderr) == (0, "")


def test_a_relay_with_a_short_name_logs_a_warning_and_greets_with_it(tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    f.write_text('myhostname = "mailhost"\n')
    with relay_process(["--config", str(f), "--queue", str(tmp_path / "q"), "--listen",
                        "127.0.0.1:0", "--log-json"]) as (rp, port):
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
            code, text = c.ehlo("client.test")
            assert code == 250 and text.splitlines()[0] == b"mailhost"
        deadline = time.monotonic() + 10
        while not any('"warning"' in line for line in rp.err_lines) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        lines = list(rp.err_lines)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines)  # said once, in the log, not again by the command
    warnings = [r for r in records if r["event"] == "warning"]
    assert [w["what"].split(";")[0] for w in warnings] == [
        "myhostname: 'mailhost' is not a fully qualified domain name"]
    started = next(i for i, r in enumerate(records) if r.get("what") == "started")
    assert records.index(warnings[0]) < started  # said before the relay takes mail
