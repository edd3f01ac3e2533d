"""What a check found: findings (one per broken clause and scenario) and a check's result.

A *finding* names the clause it breaks, the crash model (or ``no-crash``), a scenario id
that replays it, and what was seen.  A check *result* holds its findings and its status:

* ``pass``: the check ran and found nothing;
* ``fail``: at least one finding;
* ``unsupported``: the backend does not declare what the check needs (never a pass);
* ``error``: the check could not run (the factory failed, a child process vanished...);
  reported with the reason, and counted as a failure of the check's clauses.
"""

from __future__ import annotations

import enum
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conformance.harness.check_catalog import NO_CRASH


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    UNSUPPORTED = "unsupported"
    ERROR = "error"
    KNOWN_FAILURE = "known-failure"  # failed, and listed in the expected-failures file
    NOT_RUN = "not-run"  # no check covers this cell


@dataclass(frozen=True)
class Finding:
    clause: str
    detail: str
    scenario: str
    model: str
    steps: tuple[str, ...] = ()  # how to get there, one line per step

    def to_json(self) -> dict[str, Any]:
        return {"clause": self.clause, "model": self.model, "scenario": self.scenario,
                "detail": self.detail, "steps": list(self.steps)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finding:
        return cls(d["clause"], d["detail"], d["scenario"], d["model"],
                   tuple(d.get("steps", ())))


@dataclass
class CheckResult:
    check: str
    model: str
    status: Status
    findings: list[Finding] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    seed: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    scenarios: list[str] = field(default_factory=list)  # ids of what was run, when few

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check, "model": self.model, "status": self.status.value,
            "note": self.note, "seconds": round(self.seconds, 3), "seed": self.seed,
            "stats": self.stats, "findings": [f.to_json() for f in self.findings],
            "scenarios": self.scenarios,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckResult:
        return cls(d["check"], d["model"], Status(d["status"]),
                   [Finding.from_json(f) for f in d.get("findings", ())], d.get("note", ""),
                   float(d.get("seconds", 0.0)), d.get("seed"), dict(d.get("stats", {})),
                   list(d.get("scenarios", ())))


def finished(check: str, model: str, findings: list[Finding], **kw: Any) -> CheckResult:
    """A result that passes when ``findings`` is empty, fails otherwise."""
    status = Status.FAIL if findings else Status.PASS
    return CheckResult(check, model, status, _dedupe(findings), **kw)


def findings_in_scratch(prefix: str, steps: Callable[[str], list[tuple[str, str]]],
                        scenario: str, step_texts: tuple[str, ...]) -> list[Finding]:
    """Run ``steps`` (root -> [(clause, detail)]) on a fresh directory, removed after, and
    make its answers findings of ``scenario`` (no crash; for checks of fixed steps)."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        found = steps(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [Finding(c, d, scenario, NO_CRASH, step_texts) for c, d in found]


def _dedupe(findings: list[Finding], per_clause: int = 5) -> list[Finding]:
    """At most ``per_clause`` findings per clause (the first, which are the shortest)."""
    seen: dict[str, int] = {}
    out = []
    for f in findings:
        n = seen.get(f.clause, 0)
        if n < per_clause:
            out.append(f)
        seen[f.clause] = n + 1
    return out
