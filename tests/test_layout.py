"""The source tree's layout rules: no import circles, conformance modules named uniquely.

Every import counts, those inside functions and under ``TYPE_CHECKING`` included: a
circle that only type checking sees still ties two modules into one.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "queue_ref", "faultinject", "conformance")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            targets: list[str | None] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [known(f"{node.module}.{a.name}") or known(node.module)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            graph[m] |= {t for t in targets if t is not None and t != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_graph(_modules())) == []


def test_conformance_packages_depend_one_way() -> None:
    mods = _modules()
    graph = _graph(mods)

    def package(m: str) -> str:
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]

    pkgs: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if not m.startswith("conformance"):
            continue
        a = package(m)
        pkgs.setdefault(a, set())
        for t in targets:
            b = package(t)
            if b.startswith("conformance") and a != b and not a.startswith(b + "."):
                pkgs[a].add(b)
                pkgs.setdefault(b, set())
    assert _cycles(pkgs) == []


def test_conformance_module_names_are_unique_in_the_tree() -> None:
    names = Counter(p.name for p in _modules().values() if p.name != "__init__.py")
    for p in (ROOT / "conformance").rglob("*.py"):
        if p.name != "__init__.py":
            assert names[p.name] == 1, f"{p.relative_to(ROOT)}: another module is called {p.name}"


def test_the_core_layers_never_import_conformance() -> None:
    graph = _graph(_modules())
    for m, targets in graph.items():
        if m.split(".")[0] in ("spec", "queue_ref", "faultinject"):
            assert not [t for t in targets if t.startswith("conformance")], m
