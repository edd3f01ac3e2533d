"""``reproduce``: rebuild one scenario from its id and say what happened, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.crashexplore.crash_scenario import AT_REST, CaseInput, CaseOutcome, parse
from conformance.crashexplore.recovered_queue import to_views
from conformance.crashexplore.scenario_rebuild import Built, build_case
from conformance.crashexplore.traced_runs import OPEN, Run
from faultinject.models import MODELS, CrashState
from faultinject.trace import TraceEvent
from spec.crash import CLAUSES, allowed_views
from spec.model import Call, EntryView
from spec.states import EntryState


@dataclass
class Reproduction:
    outcome: CaseOutcome
    operations: list[str] = field(default_factory=list)
    crash: str = ""  # the call where the process died (or failed), with its source line
    recovery_crash: str = ""
    state: str = ""
    dropped: list[str] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    allowed: list[list[str]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome.ok

    def to_json(self) -> dict[str, Any]:
        o = self.outcome
        return {
            "scenario": o.scenario, "backend": o.case.backend, "model": o.case.model,
            "kind": o.case.kind, "operations": self.operations, "crash": self.crash,
            "recovery_crash": self.recovery_crash, "state": self.state,
            "dropped": self.dropped, "torn": self.torn, "recovered": self.recovered,
            "allowed": self.allowed, "clauses": list(o.clauses),
            "violations": [{"clause": c, "name": CLAUSES.get(c, ""), "detail": d}
                           for c, d in o.violations],
            "trace_hash": o.trace_hash, "error": o.error, "ok": o.ok,
        }

    def lines(self) -> list[str]:
        o = self.outcome
        out = [f"scenario {o.scenario}",
               f"backend {o.case.backend}, persistence model {o.case.model}, trace hash "
               f"{o.trace_hash[:16]}", "operations:"]
        out += [f"  {line}" for line in self.operations]
        if self.crash:
            out.append(f"crash: {self.crash}")
        if self.recovery_crash:
            out.append(f"crash inside recovery: {self.recovery_crash}")
        if self.state:
            out.append(f"disk: {self.state.split('; dropped: ')[0].split('; torn: ')[0]}")
        out += [f"  dropped: {d}" for d in self.dropped]
        out += [f"  torn:    {t}" for t in self.torn]
        out.append("recovered:")
        out += [f"  {r}" for r in self.recovered or ["(nothing listed)"]]
        if o.violations and o.case.when == AT_REST and o.case.kind in ("crash", "recovery"):
            out.append("allowed after recovery (the state the returned calls left):")
            for view in self.allowed:
                out.append(f"  at rest: {'; '.join(view) or '(empty)'}")
        elif o.violations:
            out.append("allowed after recovery (the state before or after the call):")
            for i, view in enumerate(self.allowed):
                out.append(f"  {'before' if i == 0 else 'after'}: {'; '.join(view) or '(empty)'}")
        out += [f"VIOLATION {c} ({CLAUSES.get(c, '?')}): {d}" for c, d in o.violations]
        if o.error:
            out.append(f"ERROR: {o.error}")
        if o.ok:
            out.append("OK: the recovered state is one the contract allows")
        return out


def _event_line(run: Run | None, ev: TraceEvent, events_of_run: bool = True) -> str:
    where = ""
    if run is not None and events_of_run:
        call = run.call_of_event(ev.index)
        where = ("opening the queue" if call == OPEN else
                 f"call {call}" if call < len(run.workload) else "closing")
        where = f" [{where}]"
    return f"{ev.short()}{where} at {ev.site}"


def _view_lines(views: frozenset[EntryView]) -> list[str]:
    """Entries in the model's numbering: message ``m<n>``, recipient ``[i]``."""
    out = []
    for v in sorted(views, key=lambda v: (v.msg, v.index)):
        state = "" if v.state is EntryState.QUEUED else f" ({v.state.value})"
        out.append(f"m{v.msg}[{v.index}] {v.rcpt} at={v.schedule.at} "
                   f"attempts={v.schedule.attempts} "
                   + (f"reason={v.schedule.reason!r} " if v.schedule.reason else "")
                   + f"body {v.body_digest[:8]}{state}")
    return out


def _state_parts(run: Run | None, events: list[TraceEvent], st: CrashState,
                 of_run: bool) -> tuple[list[str], list[str]]:
    by_index = {e.index: e for e in events}
    dropped = [_event_line(run, by_index[i], of_run) for i in st.dropped if i in by_index]
    torn = [_event_line(run, by_index[i], of_run) for i in st.torn if i in by_index]
    return dropped, torn


def explain(built: Built) -> Reproduction:
    o = built.outcome
    rep = Reproduction(o, violations=[f"{c}: {d}" for c, d in o.violations])
    run = built.run
    case = o.case
    for i, op in enumerate(case.workload):
        mark = ""
        if built.at_rest is not None:
            if i == built.at_rest - 1:
                mark = "   <-- returned; then the process died (at rest)"
            elif i >= built.at_rest:
                mark = "   (not reached)"
        elif built.call is not None and i == built.call:
            mark = "   <-- failed here" if case.kind == "eio" else "   <-- crashed inside"
        elif built.call is not None and i > built.call:
            mark = "   (not reached)"
        rep.operations.append(f"{i}: {op.describe()}{mark}")
    if built.call == OPEN:
        rep.operations.insert(0, "(crashed while opening the queue)")
    if built.at_rest is not None:
        if built.at_rest == 0:
            rep.operations.insert(0, "(the process died right after opening the queue)")
        rep.crash = (f"at rest: the process died after {built.at_rest} call(s) returned, "
                     "with no call in flight and without closing the queue (what the "
                     "backend kept in memory is lost)")
    elif run is not None:
        hit = next((e for e in run.events if e.crash is not None or e.injected), None)
        if hit is not None:
            rep.crash = _event_line(run, hit)
    if built.second is not None:
        hit = next((e for e in built.recovery_events if e.crash is not None), None)
        if hit is not None:
            rep.recovery_crash = _event_line(None, hit, False)
    st = built.second or built.state
    if st is not None:
        rep.state = st.description
        if built.second is not None:
            rep.dropped, rep.torn = _state_parts(None, built.recovery_events, st, False)
        elif run is not None:
            rep.dropped, rep.torn = _state_parts(run, run.events, st, True)
    if run is None:
        return rep
    call: Call | None
    if built.at_rest is not None:
        before, call = run.models[built.at_rest], None
    elif built.call is not None and built.call != OPEN:
        before, call = run.models[built.call], case.workload[built.call]
    elif built.call == OPEN:
        before, call = run.models[0], None
    else:
        before, call = run.models[-1], None
    rep.allowed = [_view_lines(v) for v in allowed_views(before, call)]
    rec = built.recovered
    if rec is not None:
        rep.recovered = _view_lines(to_views(rec, run.message_ids, run.entry_keys, before,
                                             call))
        rep.recovered += [f"quarantined: entry {q}" for q in rec.quarantined]
        if rec.leftover_objects or rec.leftover_bytes:
            rep.recovered.append(f"after draining everything: {rec.leftover_objects} "
                                 f"objects, {rec.leftover_bytes} bytes left")
    return rep


def reproduce(scenario: str) -> Reproduction:
    """Rebuild the scenario ``scenario`` (an id) and explain it."""
    sid = parse(scenario, tuple(MODELS))
    return explain(build_case(CaseInput.from_scenario(sid)))
