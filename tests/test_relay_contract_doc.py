"""``spec/RELAY_CONTRACT.md`` cannot drift from the tests: its clauses are numbered R1,
R2, ... in order, each has a statement, what it rests on, what Postfix does and a
"Checked by" list of at least one pytest node id, and pytest collects every id listed
(a parametrized test may be named without its parameters).  docs/relay.md and README.md
link to it."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RELAY_CONTRACT = ROOT / "spec" / "RELAY_CONTRACT.md"
FIELDS = ("Statement.", "Rests on.", "Postfix.", "Checked by:")
CLAUSE = re.compile(r"^## (R\d+)\. (.+)$", re.M)
NODE = re.compile(r"^- `(tests/[\w/]+\.py::\w+(?:\[[^\]]+\])?)`$")


@dataclass
class RelayClause:
    id: str
    name: str
    fields: dict[str, str] = field(default_factory=dict)
    tests: list[str] = field(default_factory=list)


def parse_relay_contract(text: str) -> list[RelayClause]:
    """The clauses of the document, in order; AssertionError for a malformed one."""
    heads = list(CLAUSE.finditer(text))
    out = []
    for i, h in enumerate(heads):
        body = text[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        c = RelayClause(h.group(1), h.group(2).strip())
        marks = list(re.finditer(r"^\*\*(.+?)\*\*", body, re.M))
        for j, m in enumerate(marks):
            end = marks[j + 1].start() if j + 1 < len(marks) else len(body)
            c.fields[m.group(1)] = body[m.end():end].strip()
        for line in c.fields.get("Checked by:", "").splitlines():
            if not line.strip():
                continue
            m = NODE.match(line.strip())
            assert m, f"{c.id}: {line.strip()!r} is not of the form - `tests/test_x.py::test_y`"
            c.tests.append(m.group(1))
        out.append(c)
    return out


def collected(node_ids: list[str]) -> set[str]:
    """The node ids pytest collects from the files ``node_ids`` name."""
    files = sorted({n.split("::", 1)[0] for n in node_ids if (ROOT / n.split("::")[0]).exists()})
    if not files:
        return set()
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    ids = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert ids, f"pytest collected nothing from {files}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return ids


def not_collected(node_ids: list[str]) -> list[str]:
    ids = collected(node_ids)
    return [n for n in node_ids
            if n not in ids and not any(i.startswith(n + "[") for i in ids)]


CLAUSES = parse_relay_contract(RELAY_CONTRACT.read_text())


def test_clauses_are_numbered_in_order_and_complete() -> None:
    assert [c.id for c in CLAUSES] == [f"R{i}" for i in range(1, len(CLAUSES) + 1)]
    assert len(CLAUSES) >= 10
    for c in CLAUSES:
        assert tuple(c.fields) == FIELDS, (c.id, tuple(c.fields))
        assert all(c.fields[f] for f in FIELDS[:3]), f"{c.id} has an empty field"
        assert c.tests, f"{c.id} names no test"


def test_every_named_test_is_collected() -> None:
    named = sorted({t for c in CLAUSES for t in c.tests})
    missing = not_collected(named)
    assert not missing, "RELAY_CONTRACT.md names tests pytest does not collect:\n" + \
        "\n".join(missing)


def test_a_test_that_does_not_exist_is_found() -> None:
    assert not_collected(["tests/test_relay_contract_doc.py::test_every_named_test_is_collected",
                          "tests/test_relay_contract_doc.py::test_nope",
                          "tests/test_relay_nope.py::test_x"]) == [
        "tests/test_relay_contract_doc.py::test_nope", "tests/test_relay_nope.py::test_x"]
    with pytest.raises(AssertionError, match="not of the form"):
        parse_relay_contract("## R1. X\n\n**Checked by:**\n\n- tests/test_x.py::y\n")


def test_the_docs_link_to_it() -> None:
    assert "spec/RELAY_CONTRACT.md" in (ROOT / "README.md").read_text()
    assert "../spec/RELAY_CONTRACT.md" in (ROOT / "docs" / "relay.md").read_text()
