"""The contract's documents cannot drift from the code.

* ``spec/CONTRACT.md`` has every clause of ``spec.crash.CLAUSES`` (and any further ones,
  numbered on), each with a statement, a rationale, what the seeds and peers do, and a
  "Checked by" list of pytest node ids that all exist.
* ``docs/state-diagram.md`` is exactly what ``python -m spec.diagram`` prints.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from spec import TABLE, Op
from spec.crash import CLAUSES
from spec.diagram import document, mermaid
from spec.states import RESTART

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "spec" / "CONTRACT.md"
DIAGRAM = ROOT / "docs" / "state-diagram.md"
FIELDS = ("Statement.", "Rationale.", "Seeds and peers.", "Checked by:")
HEADING = re.compile(r"^## (C\d+)\. (.+)$", re.M)
NODE_ID = re.compile(r"^- `([^`]+)`$")


@dataclass
class Clause:
    id: str
    name: str
    fields: dict[str, str] = field(default_factory=dict)
    checked_by: list[str] = field(default_factory=list)


def parse(text: str) -> dict[str, Clause]:
    heads = list(HEADING.finditer(text))
    out: dict[str, Clause] = {}
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[h.end():end]
        c = Clause(h.group(1), h.group(2).strip())
        assert c.id not in out, f"CONTRACT.md has clause {c.id} twice"
        marks = [(m.start(), m.end(), m.group(1))
                 for m in re.finditer(r"^\*\*(.+?)\*\*", body, re.M)]
        for j, (_, stop, name) in enumerate(marks):
            nxt = marks[j + 1][0] if j + 1 < len(marks) else len(body)
            c.fields[name] = body[stop:nxt].strip()
        for line in c.fields.get("Checked by:", "").splitlines():
            m = NODE_ID.match(line.strip())
            if m:
                c.checked_by.append(m.group(1))
            elif line.strip():
                raise AssertionError(
                    f"{c.id} 'Checked by' line is not of the form - `node id`: {line!r}")
        out[c.id] = c
    return out


CLAUSE_DOCS = parse(CONTRACT.read_text())
CLAUSE_IDS = sorted(CLAUSE_DOCS, key=lambda cid: int(cid[1:]))


def test_every_clause_of_the_spec_is_documented() -> None:
    for cid, name in CLAUSES.items():
        assert cid in CLAUSE_DOCS, f"spec/CONTRACT.md lacks a section '## {cid}. {name}'"
        assert CLAUSE_DOCS[cid].name == name, (
            f"spec/CONTRACT.md names {cid} {CLAUSE_DOCS[cid].name!r}, spec.crash.CLAUSES "
            f"names it {name!r}")
    numbers = [int(cid[1:]) for cid in CLAUSE_IDS]
    assert numbers == list(range(1, len(numbers) + 1)), f"clauses are not C1..Cn: {numbers}"


@pytest.mark.parametrize("cid", CLAUSE_IDS)
def test_clause_has_every_part(cid: str) -> None:
    c = CLAUSE_DOCS[cid]
    for f in FIELDS:
        assert f in c.fields, f"{cid} ({c.name}) lacks its **{f}** part"
        if f != "Checked by:":
            assert len(c.fields[f].split()) >= 12, f"{cid} **{f}** is too short to say much"
    assert c.checked_by, f"{cid} ({c.name}) lists no test under **Checked by:**"
    assert len(set(c.checked_by)) == len(c.checked_by), f"{cid} lists a test twice"


def _module_names(path: Path) -> dict[str, set[str] | None]:
    """Top-level names of a test file: functions -> None, classes -> their method names."""
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body
                              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = set()
    return out


def missing(node_id: str) -> str | None:
    """Why ``node_id`` names no test (None when it does)."""
    path_part, _, rest = node_id.partition("::")
    path = ROOT / path_part
    if not path_part.startswith("tests/") or path.suffix != ".py":
        return f"{path_part} is not a test file under tests/"
    if not path.is_file():
        return f"{path_part} does not exist"
    if not rest:
        return None
    parts = [re.sub(r"\[.*\]$", "", p) for p in rest.split("::")]
    names = _module_names(path)
    if parts[0] in names:
        members = names[parts[0]]
        if len(parts) == 1 or (members is not None and parts[1] in members):
            return None
    # Classes made at import time (hypothesis state machines): look at the module itself.
    mod = importlib.import_module(".".join(path.with_suffix("").relative_to(ROOT).parts))
    obj: object = mod
    for p in parts:
        if not hasattr(obj, p):
            return f"{path_part} has no {'::'.join(parts)} ({p!r} not found)"
        obj = getattr(obj, p)
    return None


def test_every_listed_test_exists() -> None:
    problems = []
    for c in CLAUSE_DOCS.values():
        for node_id in c.checked_by:
            why = missing(node_id)
            if why is not None:
                problems.append(f"CONTRACT.md {c.id} lists {node_id}, which does not exist: {why}")
    assert not problems, "\n".join(problems)


def test_missing_detects_bad_ids() -> None:
    assert missing("tests/test_contract_doc.py::test_every_listed_test_exists") is None
    assert missing("tests/test_lockstep.py::TestLockstepMemory") is None
    assert missing("tests/test_spec_model.py::test_invariants_hold_in_every_reachable_state"
                   "[2msg-2rcpt-2sched]") is None
    assert missing("tests/test_contract_doc.py::test_nope") is not None
    assert missing("tests/test_nope.py::test_x") is not None
    assert missing("spec/model.py::Model") is not None
    with pytest.raises(AssertionError, match="not of the form"):
        parse("## C1. X\n\n**Checked by:**\n\n- tests/test_x.py::y\n")


# ---- the state diagram -----------------------------------------------------------------


def test_state_diagram_doc_is_generated_output() -> None:
    assert DIAGRAM.read_text() == document(), (
        "docs/state-diagram.md is stale: run python -m spec.diagram > docs/state-diagram.md")


def test_diagram_module_prints_the_document() -> None:
    out = subprocess.run([sys.executable, "-m", "spec.diagram"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout == DIAGRAM.read_text()
    only = subprocess.run([sys.executable, "-m", "spec.diagram", "--mermaid"], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=60)
    assert only.stdout == mermaid()
    bad = subprocess.run([sys.executable, "-m", "spec.diagram", "--nope"], cwd=ROOT,
                         capture_output=True, text=True, check=False, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_diagram_has_every_transition_and_restart_edge() -> None:
    text = mermaid()
    assert text.startswith("stateDiagram-v2\n")
    edges = re.findall(r"^    (\S+) --> (\S+): (.+)$", text, re.M)
    name = {"[*]": "absent"}
    ops = {lbl.split(",")[0].split(" ")[0]: (name.get(a, a.lower()), name.get(b, b.lower()))
           for a, b, lbl in edges if not lbl.startswith("restart")}
    assert ops == {op.value: (t.source.value, t.target.value) for op, t in TABLE.items()}
    restarts = {(a.lower(), b.lower()) for a, b, lbl in edges if lbl.startswith("restart")}
    assert restarts == {(s.value, d.value) for s, d in RESTART.items() if s is not d}
    assert "VANISHED" in text
    assert Op.ENQUEUE.value in text
