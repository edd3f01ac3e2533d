"""Scenario ids: one short string that names a crash state and rebuilds it.

Grammar (``-`` separates parts; a state key's own ``-`` is written ``_``)::

    <backend>-<model>-<workload>-c<N><b|a>-s<key>                 crash before/after call N
    <backend>-<model>-<workload>-c<N><b|a>-s<key>-r<M>-s<key2>    ... then recovery crashed
                                                                  after its call M
    <backend>-<model>-<workload>-rest<K>-s<key>                   crash at rest, after K
                                                                  workload calls returned
    <backend>-<model>-<workload>-rest<K>-s<key>-r<M>-s<key2>      ... then recovery crashed
                                                                  after its call M
    <backend>-<model>-<workload>-e<N>-s<key>                      call N failed (EIO), then
                                                                  power was lost
    <backend>-none-<workload>-rest                                no crash: the run and an
                                                                  orderly restart

``N`` and ``M`` count mutating calls from 0 (``FaultPlan``); ``key`` is the crash state's key
(``faultinject.models``: ``all``, ``d3.5~9``, ``t7:512``...).  A crash *at rest* comes
between two calls of the workload, with no operation in flight: ``K`` counts the calls that
had returned (0: right after opening the queue); the process dies without closing the
queue, so the disk is what reached the I/O seam by then, as the persistence model keeps
it, and recovery must show exactly the restart view of the model after those ``K`` calls.
In ``ScenarioId`` it is kind ``crash`` (or ``recovery``) with ``when == "rest"`` and
``index == K``.  Workloads are named by how they were made: ``b3w17`` (number 17 of the
exhaustive enumeration of bound 3), ``a2w9`` (number 9 of the enumeration of bound 2 after
one message's whole life, ``workloads.LIFE``), ``r5n20`` (``random_workload(5, 20)``) or
``x<base32>`` (the calls themselves, compressed).  Examples: ``fs-weak-b3w17-c9b-sd12``,
``fs-weak-b3w17-rest3-sall``.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from conformance.crashexplore.workloads import (
    LIFE,
    Workload,
    enumerate_steps,
    random_workload,
    workload_at,
)
from spec.model import Call, Schedule
from spec.states import Op

NO_CRASH = "none"
KINDS = ("crash", "recovery", "eio", "rest")
#: ``ScenarioId.when`` of a crash at rest (between calls; ``index`` counts returned calls).
AT_REST = "rest"
WHENS = ("before", "after", AT_REST)

_WL = r"[ab]\d+w\d+|r\d+n\d+|x[a-z2-7]+"
_ID = re.compile(rf"^(?P<head>.+?)-(?P<wl>{_WL})-(?P<tail>.+)$")
_TAIL = re.compile(
    r"^(?:c(?P<c>\d+)(?P<w>[ba])|rest(?P<q>\d+)|e(?P<e>\d+))-s(?P<key>[^-]+)"
    r"(?:-r(?P<r>\d+)-s(?P<key2>[^-]+))?$")


class ScenarioError(ValueError):
    """A scenario id that cannot be read."""


# ---- workload ids ----------------------------------------------------------------------

def _sched(s: Schedule | None) -> list[int | str] | None:
    if s is None:
        return None
    return [s.at, s.attempts, s.reason] if s.reason else [s.at, s.attempts]


def _row(c: Call) -> list[object]:
    row: list[object] = [c.op.value, list(c.key) if c.key else None, _sched(c.schedule),
                         c.mail_from, c.body.decode("latin-1"),
                         [[r, s.at, s.attempts] for r, s in c.rcpts]]
    if c.parts:
        row.append([_row(p) for p in c.parts])
    return row


def _call(row: list[Any]) -> Call:
    op, key, sched, mail_from, body, rcpts, *parts = row
    return Call(Op(op), (key[0], key[1]) if key else None,
                Schedule(*sched) if sched else None, mail_from, body.encode("latin-1"),
                tuple((r, Schedule(at, att)) for r, at, att in rcpts),
                tuple(_call(p) for p in parts[0]) if parts else ())


def encode_workload(workload: Workload) -> str:
    """``x<base32>``: the calls themselves, for workloads made neither way."""
    rows = [_row(c) for c in workload]
    raw = zlib.compress(json.dumps(rows, separators=(",", ":")).encode(), 9)
    return "x" + base64.b32encode(raw).decode().rstrip("=").lower()


def workload_id(workload: Workload) -> str:
    """The shortest id of ``workload``: its number in the enumeration of its own length
    (up to 4 calls), else the calls themselves."""
    n = len(workload)
    if n <= 4:
        for step in enumerate_steps(n):
            if step.workload == workload:
                return f"b{n}w{step.index}"
    return encode_workload(workload)


def decode_workload(wid: str) -> Workload:
    """The workload a workload id names."""
    m = re.fullmatch(r"([ab])(\d+)w(\d+)", wid)
    if m:
        return workload_at(int(m[2]), int(m[3]), after=LIFE if m[1] == "a" else ())
    m = re.fullmatch(r"r(\d+)n(\d+)", wid)
    if m:
        return random_workload(int(m[1]), int(m[2]))
    if not re.fullmatch(r"x[a-z2-7]+", wid):
        raise ScenarioError(f"{wid!r} is not a workload id (b<bound>w<n>, a<bound>w<n>, "
                            "r<seed>n<len>, x...)")
    text = wid[1:].upper()
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
        rows = json.loads(zlib.decompress(raw))
        return tuple(_call(row) for row in rows)
    except (ValueError, TypeError, zlib.error) as e:
        raise ScenarioError(f"workload id {wid[:20]}... does not decode: {e}") from e


# ---- scenario ids ----------------------------------------------------------------------

@dataclass(frozen=True)
class ScenarioId:
    backend: str
    model: str  # a persistence model, or NO_CRASH
    workload_id: str
    kind: str  # "crash", "recovery", "eio" or "rest"
    index: int = -1  # the crashing (or failing) mutating call; at rest: calls returned
    when: str = "after"  # "before", "after" or AT_REST
    key: str = ""
    recovery_index: int = -1
    recovery_key: str = ""

    def __str__(self) -> str:
        head = f"{self.backend}-{self.model}-{self.workload_id}"
        if self.kind == "rest":
            return f"{head}-rest"
        key = "s" + self.key.replace("-", "_")
        if self.kind == "eio":
            return f"{head}-e{self.index}-{key}"
        if self.when == AT_REST:
            out = f"{head}-rest{self.index}-{key}"
        else:
            out = f"{head}-c{self.index}{self.when[0]}-{key}"
        if self.kind == "recovery":
            out += f"-r{self.recovery_index}-s{self.recovery_key.replace('-', '_')}"
        return out


def parse(text: str, models: tuple[str, ...]) -> ScenarioId:
    """Read a scenario id; ``models`` are the persistence model names it may name."""
    m = _ID.match(text.strip())
    if m is None:
        raise ScenarioError(f"{text!r} is not a scenario id (see conformance/crashexplore/crash_scenario.py)")
    head, wid, tail = m["head"], m["wl"], m["tail"]
    model = next((x for x in (*models, NO_CRASH) if head.endswith("-" + x)), None)
    if model is None:
        raise ScenarioError(f"{text!r}: no known model ({', '.join(models)}) before the "
                            "workload id")
    backend = head[:-len(model) - 1]
    if tail == "rest":
        return ScenarioId(backend, model, wid, "rest")
    t = _TAIL.match(tail)
    if t is None or model == NO_CRASH:
        raise ScenarioError(f"{text!r}: cannot read {tail!r}")
    key = t["key"].replace("_", "-")
    if t["e"] is not None:
        return ScenarioId(backend, model, wid, "eio", int(t["e"]), "after", key)
    if t["q"] is not None:
        when, index = AT_REST, int(t["q"])
    else:
        when, index = ("before" if t["w"] == "b" else "after"), int(t["c"])
    if t["r"] is not None:
        return ScenarioId(backend, model, wid, "recovery", index, when, key,
                          int(t["r"]), t["key2"].replace("_", "-"))
    return ScenarioId(backend, model, wid, "crash", index, when, key)


# ---- one crash state as plain data, and what judging it gave -------------------------

Violations = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CaseInput:
    """One crash state, as plain data (see the module docstring for the fields)."""

    backend: str
    workload_id: str
    workload: Workload
    kind: str = "crash"  # "crash", "recovery", "eio" or "rest"
    model: str = NO_CRASH
    index: int = -1  # mutating call that crashed (or failed, for "eio"); at rest: calls
    when: str = "after"  # "before", "after", or AT_REST: between calls, ``index`` returned
    state_key: str = ""
    recovery_index: int = -1
    recovery_key: str = ""
    seed: int = 0  # of the state sampler that chose the state (the key alone rebuilds it)

    @property
    def scenario(self) -> ScenarioId:
        return ScenarioId(self.backend, self.model, self.workload_id, self.kind, self.index,
                          self.when, self.state_key, self.recovery_index, self.recovery_key)

    @classmethod
    def from_scenario(cls, sid: ScenarioId) -> CaseInput:
        return cls(sid.backend, sid.workload_id, decode_workload(sid.workload_id), sid.kind,
                   sid.model, sid.index, sid.when, sid.key, sid.recovery_index,
                   sid.recovery_key)


@dataclass(frozen=True)
class CaseOutcome:
    case: CaseInput
    scenario: str
    violations: Violations
    trace_hash: str = ""  # of the workload's run (FaultyIO.trace_hash)
    image: str = ""  # digest of the judged disk
    description: str = ""  # what the crash kept, dropped and tore
    error: str = ""  # the case could not be built (not a violation of the backend)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.error

    @property
    def clauses(self) -> tuple[str, ...]:
        return tuple(sorted({c for c, _ in self.violations}, key=_clause_order))


def _clause_order(c: str) -> tuple[int, str]:
    return (int(c[1:]), c) if c[1:].isdigit() else (99, c)
