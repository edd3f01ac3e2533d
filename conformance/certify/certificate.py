"""The certificate: what was checked, under which crash models, and what held.

The matrix has one row per clause (C1..C10, and API for answers that break the
interface itself) and one column per crash model checked, plus ``no-crash``.  A cell is

* ``fail``: a finding of that clause under that model (with its scenario ids);
* ``known-failure``: every such finding is listed in the expected-failures file;
* ``error``: a check of that cell could not run;
* ``pass``: the checks of that cell ran and found nothing;
* ``unsupported``: every check of the cell needs a capability the backend does not
  declare (power-loss models need the I/O seam), never counted as a pass;
* ``not-run``: no check tests that clause under that model.

Status: **certified** when no cell fails or errs and at least one crash model was
checked (its column has passes, and no failure); **not certified, known failures** when
every failure is an expected one; **not certified** otherwise.  A backend is certified
*under* the models listed in ``certified_models`` only; a model whose every cell is
unsupported (a power-loss model for a backend without the I/O seam) is not among them.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from conformance.harness.check_catalog import BY_ID, CHECKS, INCLUDES, NO_CRASH, ROWS
from conformance.harness.check_results import CheckResult, Finding, Status

SUITE = "queue-ref conformance suite"
SUITE_VERSION = "1.0"

CERTIFIED = "certified"
NOT_CERTIFIED = "not certified"
KNOWN_FAILURES = "not certified, known failures"


@dataclass(frozen=True)
class Expectation:
    clause: str
    model: str  # a model name, or "*" for any
    reason: str

    def matches(self, f: Finding) -> bool:
        return f.clause == self.clause and self.model in ("*", f.model)

    def to_json(self) -> dict[str, str]:
        return {"clause": self.clause, "model": self.model, "reason": self.reason}


def load_expectations(path: str) -> list[Expectation]:
    """Read an expected-failures file: one ``CLAUSE [MODEL|*] [# reason]`` per line.

    A JSON list of ``{"clause", "model", "reason"}`` objects is accepted too.
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("["):
        return [Expectation(d["clause"], d.get("model", "*"), d.get("reason", ""))
                for d in json.loads(text)]
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line, _, reason = raw.partition("#")
        parts = line.split()
        if not parts:
            continue
        if parts[0] not in ROWS or len(parts) > 2:
            raise ValueError(f"{path}:{n}: expected 'CLAUSE [MODEL] [# reason]' with CLAUSE "
                             f"one of {', '.join(ROWS)}; got {raw.strip()!r}")
        out.append(Expectation(parts[0], parts[1] if len(parts) > 1 else "*", reason.strip()))
    return out


@dataclass
class Cell:
    status: Status
    scenarios: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "scenarios": self.scenarios,
                "checks": self.checks, "unsupported": self.unsupported}


@dataclass
class Certificate:
    backend: str
    storage_class: str
    capabilities: list[str]
    profile: str
    models: list[str]
    seed: int
    results: list[CheckResult]
    expectations: list[Expectation] = field(default_factory=list)
    seconds: float = 0.0
    started: str = ""
    environment: dict[str, str] = field(default_factory=dict)

    # ---- derived ---------------------------------------------------------------------

    @property
    def columns(self) -> list[str]:
        return [NO_CRASH, *self.models]

    def expected(self, f: Finding) -> bool:
        return any(e.matches(f) for e in self.expectations)

    def cell(self, clause: str, column: str) -> Cell:
        findings = [(r.check, f) for r in self.results for f in r.findings
                    if f.clause == clause and f.model == column]
        relevant = [r for r in self.results if r.model == column
                    and r.check in BY_ID and clause in BY_ID[r.check].clauses]
        checks = sorted({r.check for r in relevant} | {c for c, _ in findings})
        unsupported = sorted(r.check for r in relevant if r.status is Status.UNSUPPORTED)
        if findings:
            scen = list(dict.fromkeys(f.scenario for _, f in findings))
            known = all(self.expected(f) for _, f in findings)
            return Cell(Status.KNOWN_FAILURE if known else Status.FAIL, scen, checks,
                        unsupported)
        if any(r.status is Status.ERROR for r in relevant):
            return Cell(Status.ERROR, [], checks, unsupported)
        # A check that ran (even one that failed on another clause) and found nothing of
        # this clause passes it.
        ran = [r for r in relevant
               if r.status in (Status.PASS, Status.FAIL, Status.KNOWN_FAILURE)]
        if ran:
            return Cell(Status.PASS, [], checks, unsupported)
        if relevant:
            return Cell(Status.UNSUPPORTED, [], checks, unsupported)
        return Cell(Status.NOT_RUN, [], checks, unsupported)

    def matrix(self) -> dict[str, dict[str, Cell]]:
        return {clause: {col: self.cell(clause, col) for col in self.columns}
                for clause in ROWS}

    def clause_status(self, row: dict[str, Cell]) -> Status:
        statuses = [c.status for c in row.values()]
        for s in (Status.FAIL, Status.ERROR, Status.KNOWN_FAILURE, Status.PASS):
            if s in statuses:
                return s
        return Status.UNSUPPORTED if Status.UNSUPPORTED in statuses else Status.NOT_RUN

    def certified_models(self) -> list[str]:
        """Crash models whose column has no failure, no error, and at least one pass.

        Cells whose checks all need an undeclared capability stay "unsupported" in the
        matrix (they are not passes); they do not by themselves withhold the model.
        """
        m = self.matrix()
        out = []
        ok = (Status.PASS, Status.NOT_RUN, Status.UNSUPPORTED)
        for col in self.models:
            cells = [m[c][col].status for c in m]
            if Status.PASS in cells and all(s in ok for s in cells) \
                    and not self.broken_inclusions(col, m):
                out.append(col)
        return out

    def broken_inclusions(self, col: str, m: dict[str, dict[str, Cell]] | None = None
                          ) -> list[str]:
        """Checked models that ``col`` includes (``INCLUDES``) and that do not hold: every
        state they can leave is one ``col`` allows too, so ``col`` cannot hold either."""
        m = m if m is not None else self.matrix()
        bad = (Status.FAIL, Status.ERROR, Status.KNOWN_FAILURE)
        return [inc for inc in INCLUDES.get(col, ()) if inc in self.models
                and any(m[c][inc].status in bad for c in m)]

    def unsupported_models(self) -> list[str]:
        m = self.matrix()
        return [col for col in self.models
                if all(m[c][col].status in (Status.UNSUPPORTED, Status.NOT_RUN) for c in m)]

    def status(self) -> str:
        cells = [c.status for row in self.matrix().values() for c in row.values()]
        if Status.FAIL in cells or Status.ERROR in cells:
            return NOT_CERTIFIED
        if Status.KNOWN_FAILURE in cells:
            return KNOWN_FAILURES
        if not self.certified_models():
            return NOT_CERTIFIED
        return CERTIFIED

    def reasons(self) -> list[str]:
        """Why the status is what it is, in a sentence each."""
        m = self.matrix()
        out = []
        for clause, row in m.items():
            for col, cell in row.items():
                if cell.status in (Status.FAIL, Status.ERROR, Status.KNOWN_FAILURE):
                    what = {Status.FAIL: "fails", Status.ERROR: "could not be checked",
                            Status.KNOWN_FAILURE: "fails (expected)"}[cell.status]
                    out.append(f"{clause} ({ROWS[clause]}) {what} under {col}"
                               + (f": {', '.join(cell.scenarios[:3])}" if cell.scenarios
                                  else ""))
        for col in self.models:
            for inc in self.broken_inclusions(col, m):
                out.append(f"not certified under {col}: it includes every state {inc} can "
                           f"leave, and {inc} does not hold")
        if not self.certified_models() and not out:
            if any(r.model in self.models for r in self.results):
                out.append("no crash model could be checked: the checks of "
                           f"{', '.join(self.models)} are unsupported (power-loss models "
                           "need the I/O seam; add process-kill to the models)")
            else:
                out.append("no crash model was checked: no crash check ran")
        return out

    def stale_expectations(self) -> list[Expectation]:
        found = [f for r in self.results for f in r.findings]
        return [e for e in self.expectations if not any(e.matches(f) for f in found)]

    def exit_code(self) -> int:
        """0 when certified, 3 when only known failures remain, 1 otherwise."""
        return {CERTIFIED: 0, KNOWN_FAILURES: 3}.get(self.status(), 1)

    # ---- serialisation ---------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        m = self.matrix()
        return {
            "suite": SUITE,
            "suite_version": SUITE_VERSION,
            "backend": {"factory": self.backend, "storage_class": self.storage_class,
                        "capabilities": self.capabilities},
            "profile": self.profile,
            "models": self.models,
            "seed": self.seed,
            "started": self.started,
            "seconds": round(self.seconds, 2),
            "environment": self.environment,
            "status": self.status(),
            "certified_models": self.certified_models(),
            "unsupported_models": self.unsupported_models(),
            "reasons": self.reasons(),
            "clauses": {
                clause: {"name": ROWS[clause], "status": self.clause_status(row).value,
                         "cells": {col: cell.to_json() for col, cell in row.items()}}
                for clause, row in m.items()
            },
            "checks": [r.to_json() for r in self.results],
            "check_specs": [
                {"id": c.id, "title": c.title, "kind": c.kind.value, "level": c.level.value,
                 "requires": [r.value for r in c.requires],
                 "excludes": [r.value for r in c.excludes], "clauses": list(c.clauses)}
                for c in CHECKS],
            "expected_failures": [e.to_json() for e in self.expectations],
            "stale_expectations": [e.to_json() for e in self.stale_expectations()],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Certificate:
        return cls(
            d["backend"]["factory"], d["backend"]["storage_class"],
            list(d["backend"]["capabilities"]), d["profile"], list(d["models"]), d["seed"],
            [CheckResult.from_json(r) for r in d["checks"]],
            [Expectation(e["clause"], e["model"], e["reason"])
             for e in d.get("expected_failures", ())],
            float(d.get("seconds", 0.0)), d.get("started", ""), dict(d.get("environment", {})),
        )


def environment() -> dict[str, str]:
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": str(os.cpu_count() or 0)}
