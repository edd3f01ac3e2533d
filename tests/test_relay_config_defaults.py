"""docs/relay.md's table of settings against ``RelayConfig``: every setting is in the
table, and every default the table gives as a value (a number, a duration, a boolean, a
word, none) is the dataclass's default.  An operator reads the table, not the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from queue_ref.relay.relay_config import RelayConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "relay.md"
UNITS = {"s": 1.0, "d": 86400.0}


def table() -> dict[str, str]:
    """key -> its default as the table writes it (keys sharing a row split their values)."""
    text = DOC.read_text()
    start = text.index("| key | default |")
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        names = re.findall(r"`([a-z_A-Z0-9]+)`", cells[0])
        values = cells[1].split(", ") if len(names) > 1 else [cells[1]]
        if len(values) == 1:  # one value for every key of the row ("none")
            values *= len(names)
        assert len(values) == len(names), line
        rows.update(zip(names, values, strict=True))
    return rows


def parse(value: str) -> tuple[bool, Any]:
    """(whether the table gives a value, the value)."""
    v = re.sub(r"\s*\(.*\)$", "", value)  # "true (Postfix: no)", "0 (off)"
    if v in ("none", "`[]`"):
        return True, None
    if v in ("true", "false"):
        return True, v == "true"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?: ([sd]))?", v)
    if m:
        return True, float(m.group(1)) * UNITS.get(m.group(2) or "", 1.0)
    m = re.fullmatch(r"`([^`]+)`", v)
    if m:
        return True, m.group(1)
    return False, None


def test_every_setting_is_documented_with_its_default() -> None:
    rows = table()
    fields = {f.name: f for f in dataclasses.fields(RelayConfig)}
    assert sorted(set(fields) - set(rows)) == []  # a setting missing from the table
    assert sorted(set(rows) - set(fields)) == []  # a row for no setting
    defaults = RelayConfig(queue="/q", myhostname="mx.example.org")
    checked = []
    for name, written in rows.items():
        given, want = parse(written)
        if not given:
            continue  # described in words (loopback, resolv.conf, gethostname() ...)
        got = getattr(defaults, name)
        if want is None:
            assert got in ("", [], {}), (name, got)
        elif isinstance(want, float):
            assert not isinstance(got, bool) and got == want, (name, got, written)
        else:
            assert got == want, (name, got, written)
        checked.append(name)
    assert len(checked) >= 40 and "smtp_mx_address_limit" in checked, checked


AT_LEAST_1 = ("message_size_limit", "smtpd_recipient_limit", "hopcount_limit",
              "default_destination_concurrency_limit", "max_deliveries",
              "smtp_mx_address_limit", "processes", "qmgr_message_active_limit",
              "smtpd_auth_failure_limit")
#: (setting, values accepted, values refused): each bound exactly where docs/relay.md puts it
BOUNDS: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = [
    *((name, (1,), (0,)) for name in AT_LEAST_1),
    ("processes", (256,), (257,)),
    ("bounce_size_limit", (0,), (-1,)),
    ("smtp_line_length_limit", (0, 80), (1, 79)),
    ("dns_port", (1, 65535), (0, 65536)),
    ("smtp_port", (1, 65535), (0, 65536)),
    ("backoff_jitter", (0.0, 0.999), (1.0, -0.01)),
    ("anvil_rate_time_unit", (0.001,), (0.0,)),
    ("maximal_backoff_time", (300.0,), (299.0,)),  # not below minimal_backoff_time (300)
]


def test_every_bound_of_a_setting_is_exact() -> None:
    """The least (and most) value of each numeric setting is taken, the next refused with
    a message naming the setting: a limit of 1 failed AUTH, a line limit of 80 or a jitter
    just below 1 are settings an operator may want."""
    from queue_ref.relay.config_values import ConfigError

    for name, good, bad in BOUNDS:
        for value in good:
            RelayConfig(queue="/q", myhostname="mx.example.org", **{name: value}).validate()
        for value in bad:
            try:
                RelayConfig(queue="/q", myhostname="mx.example.org", **{name: value}).validate()
            except ConfigError as e:
                assert name.split("_time")[0] in str(e), (name, value, e)
            else:
                raise AssertionError(f"{name} = {value!r} was taken")
