"""The human reports of a certificate: Markdown and one self-contained HTML page.

Both come from Jinja2 templates in ``conformance/certify/templates/`` and show the status, the
clause x crash-model matrix, every check with its timing, and every finding with the
steps that lead to it and the command that replays it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jinja2

from conformance.certify.certificate import CERTIFIED, KNOWN_FAILURES, Certificate
from conformance.harness.check_catalog import BY_ID, ROWS
from conformance.harness.check_results import Status

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("conformance.certify", "templates"),
    autoescape=jinja2.select_autoescape(["html", "html.j2"]),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)

SYMBOL = {
    Status.PASS: "pass", Status.FAIL: "FAIL", Status.UNSUPPORTED: "unsupported",
    Status.ERROR: "ERROR", Status.KNOWN_FAILURE: "known failure", Status.NOT_RUN: "-",
}


def anchor(scenario: str) -> str:
    return "s-" + re.sub(r"[^A-Za-z0-9]+", "-", scenario).strip("-")


def reproduce_command(backend: str, scenario: str) -> str:
    """The command that runs the scenario again (any check's scenario ids)."""
    return f"queue-ref certify {backend} --scenario {scenario}"


def context(cert: Certificate) -> dict[str, Any]:
    matrix = cert.matrix()
    status = cert.status()
    rows = []
    for clause, row in matrix.items():
        cells = []
        for col, cell in row.items():
            cells.append({
                "column": col, "status": cell.status.value, "label": SYMBOL[cell.status],
                "scenarios": [{"id": s, "anchor": anchor(s)} for s in cell.scenarios[:4]],
                "more": max(0, len(cell.scenarios) - 4), "checks": cell.checks,
                "unsupported": cell.unsupported,
            })
        rows.append({"clause": clause, "name": ROWS[clause],
                     "status": cert.clause_status(row).value, "cells": cells})
    checks = []
    findings = []
    seen: set[str] = set()
    anchors: set[str] = set()
    for r in cert.results:
        spec = BY_ID.get(r.check)
        checks.append({
            "id": r.check, "model": r.model, "status": r.status.value,
            "label": SYMBOL[r.status], "seconds": f"{r.seconds:.2f}",
            "title": spec.title if spec else "", "kind": spec.kind.value if spec else "",
            "level": spec.level.value if spec else "",
            "note": r.note.splitlines()[0] if r.note else "",
            "stats": ", ".join(f"{k}={v}" for k, v in r.stats.items()
                               if not isinstance(v, (dict, list)) and k not in ("in", "out")),
            "seed": r.seed, "findings": len(r.findings),
        })
        for f in r.findings:
            key = f"{f.scenario}|{f.clause}|{f.detail}"
            if key in seen:
                continue
            seen.add(key)
            first = anchor(f.scenario) not in anchors
            anchors.add(anchor(f.scenario))
            findings.append({
                "anchor": anchor(f.scenario) if first else "", "clause": f.clause,
                "clause_name": ROWS.get(f.clause, ""), "model": f.model, "check": r.check,
                "scenario": f.scenario, "detail": f.detail, "steps": list(f.steps),
                "reproduce": reproduce_command(cert.backend, f.scenario),
                "expected": cert.expected(f),
            })
    findings.sort(key=lambda f: (list(ROWS).index(f["clause"]) if f["clause"] in ROWS else 99,
                                 f["model"], f["scenario"]))
    return {
        "coverage": coverage(cert),
        "cert": cert, "status": status,
        "status_class": {CERTIFIED: "pass", KNOWN_FAILURES: "known-failure"}.get(status,
                                                                                  "fail"),
        "columns": cert.columns, "rows": rows, "checks": checks, "findings": findings,
        "reasons": cert.reasons(), "certified_models": cert.certified_models(),
        "unsupported_models": cert.unsupported_models(),
        "stale": cert.stale_expectations(),
    }


def coverage(cert: Certificate) -> dict[str, Any]:
    """Operation x crash model: how many crash points inside the operation crash
    exploration crashed and judged, of how many, and whether some instance of it was
    crashed at every one of its mutating calls."""
    models = [r.model for r in cert.results if r.check == "crash-exploration"
              and isinstance(r.stats.get("coverage"), dict)]
    ops: list[str] = []
    for r in cert.results:
        if r.check == "crash-exploration":
            ops += [op for op in r.stats.get("coverage", {}) if op not in ops]
    rows = []
    for op in ops:
        cells = []
        for r in cert.results:
            if r.check != "crash-exploration" or r.model not in models:
                continue
            c = r.stats["coverage"].get(op, {"points": 0, "crashed": 0, "complete": 0})
            cells.append({"text": f"{c['crashed']}/{c['points']}" if c["points"] else
                          ("no mutating call" if c["complete"] else "never run"),
                          "complete": bool(c["complete"])})
        rows.append({"op": op, "cells": cells})
    return {"models": models, "rows": rows}


def markdown(cert: Certificate) -> str:
    return _ENV.get_template("report.md.j2").render(context(cert))


def html(cert: Certificate) -> str:
    return _ENV.get_template("report.html.j2").render(context(cert))


def write(cert: Certificate, out_dir: str) -> dict[str, str]:
    """Write certificate.json, report.md and report.html into ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("certificate.json", "report.md", "report.html")}
    with open(paths["certificate.json"], "w", encoding="utf-8") as fh:
        json.dump(cert.to_json(), fh, indent=2)
        fh.write("\n")
    with open(paths["report.md"], "w", encoding="utf-8") as fh:
        fh.write(markdown(cert))
    with open(paths["report.html"], "w", encoding="utf-8") as fh:
        fh.write(html(cert))
    return paths
