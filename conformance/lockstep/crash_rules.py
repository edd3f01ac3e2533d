"""The crash rule: crash inside the next operation, recover, compare with the model, go on.

On for backends that declare the I/O seam (``Capability.IO_SEAM``); the machine then runs
the backend over a recording ``FaultyIO`` from the moment it opens it.  The rule:

1. picks the next operation (any operation rule's, with its arguments) and runs it
   through the machine's own code, answers checked as usual;
2. picks a crash point inside it: one of the mutating calls it made, before or after
   that call.  The disk a crash there leaves is built from the trace up to that point,
   which is what ``FaultyIO`` records when ``FaultPlan(crash_at=..., crash_when=...)``
   makes it raise ``Crash`` there: calls after a crash never happen, so none of them is
   in it.  (Running the operation to its end first is what lets the point be drawn among
   the calls it really makes.)  An operation that made no mutating call is crashed at
   its end;
3. picks a persistence model of ``faultinject.MODELS`` and one of the states
   ``crash_states`` builds for it (its sampling seed and the state's index drawn too);
4. materializes the state in a scratch directory, opens the backend there (recovery
   runs), reads the recovered view back and judges it exactly as crash exploration does
   (``conformance.crashexplore``: ``inspect``, ``judge_recovered``): the restart view of the
   model before the operation, or after it, nothing else (``spec.crash.judge``), and a
   recovered queue that drains to zero objects;
5. goes on: the model becomes the allowed view that matched (the operation's effect
   survived or not), the state is materialized in a fresh directory, recovered and read
   back there through a new ``FaultyIO`` (it must give the same entries), and the
   backend is opened there once more; ``after_reopen`` checks it.

A violation names the clause and prints the model before the operation, the call, the
crash point (the call's source line), the persistence model and the crash state's key;
hypothesis prints the steps that led there and its seed.
"""

from __future__ import annotations

import shutil

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from conformance.crashexplore.crash_judge import judge_recovered
from conformance.crashexplore.recovered_queue import Recovered, inspect, to_views
from conformance.crashexplore.traced_runs import Run, ScratchIO, scratch_dir
from conformance.lockstep.machine_state import ClauseViolation, describe_model
from conformance.lockstep.operation_rules import CRASHABLE
from conformance.lockstep.restart_rules import RestartRules
from faultinject import MODELS, CrashState, crash_states, materialize
from faultinject.seam import FaultyIO
from spec.crash import CLAUSES, allowed_views
from spec.model import Call, Model, run
from spec.states import BATCHES, Op

#: How many crash states ``crash_states`` builds to choose from (see faultinject.models).
EXHAUSTIVE_LIMIT = 6
RANDOM_STATES = 4


class CrashRules(RestartRules):
    @precondition(lambda self: self.crashes and self.io is not None)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """Crash at a random point of the next operation under a random persistence
        model, recover, compare with the model, go on (see the module docstring)."""
        io = self.io
        assert io is not None
        name = data.draw(st.sampled_from([n for n in CRASHABLE if self.can_perform(n)]))
        self.log.append(f"crash inside the next operation, {name}:")
        before = self.model
        first_event, first_call = len(io.events), io.mutating_count
        call = self.perform(name, data)
        self.check_sync_cover()  # it ran to its end on this seam, which the crash leaves
        cut, site = self._crash_point(data, io, first_event, first_call)
        model = data.draw(st.sampled_from(sorted(MODELS)))
        states = crash_states(io.initial, io.events[:cut], model,
                              exhaustive_limit=EXHAUSTIVE_LIMIT, random_states=RANDOM_STATES,
                              seed=data.draw(st.integers(0, 2**16)))
        state = states[data.draw(st.integers(0, len(states) - 1))]
        self.log.append(f"  crash {site}; {model}, crash state {state.key!r}: "
                        f"{state.description}")
        self._call("close", self.store.close)  # the dead process's files (after the cut)
        with scratch_dir() as d:  # not recover_image: its cache would keep every disk
            materialize(state.image, d)
            rec = inspect(lambda: self.backend.open(d, ScratchIO()))
        traced = Run((call,) if call is not None else (), io.initial, io.events[:cut], "",
                     [before], [first_call], [io.mutating_count], dict(self.mids),
                     dict(self.keys), stopped_in=0, crashed=True)
        found = judge_recovered(rec, traced, before, call)
        if found:
            raise ClauseViolation(found[0][0], self._report(found, before, call, site, model,
                                                            state, rec))
        self._go_on(state, before, call, rec)

    def _crash_point(self, data: st.DataObject, io: FaultyIO, first: int,
                     first_call: int) -> tuple[int, str]:
        """How many trace events the crash keeps, and where it is."""
        calls = [e for e in io.events[first:] if e.mutating]
        if not calls:
            return len(io.events), "at the end of the operation (it made no mutating call)"
        k = data.draw(st.integers(0, len(calls) - 1))
        when = data.draw(st.sampled_from(("before", "after")))
        e = calls[k]
        return (e.index + (when == "after"),
                f"{when} mutating call {k + 1} of {len(calls)} of the operation "
                f"(FaultPlan(crash_at={first_call + k}, crash_when={when!r}) since the queue "
                f"was opened here), {e.short()} at {e.site}")

    def _go_on(self, state: CrashState, before: Model, call: Call | None,
               rec: Recovered) -> None:
        """Continue from the crash state with the model whose view was recovered.

        The state is materialized in a fresh directory and read back there as it was for
        judging, through the new ``FaultyIO`` (recovery, then every entry claimed and
        read, so that an entry whose body did not survive is quarantined here too); the
        queue is then opened once more (recovery requeues what the reading claimed)."""
        after = before
        if call is not None:
            views = to_views(rec, self.mids, self.keys, before, call)
            allowed = allowed_views(before, call)
            if call.op in BATCHES:  # each step old or new on its own (rules 7, 8)
                got = {(v.msg, v.index): v for v in views}
                for part in call.parts:
                    one = run(after, part)[0]
                    new = {(v.msg, v.index): v for v in one.restart().view()}
                    if got.get(part.key) == new.get(part.key):  # type: ignore[arg-type]
                        after = one
            elif len(allowed) > 1 and views == allowed[1]:
                after = run(before, call)[0]
            elif call.op is Op.ENQUEUE:
                self._forget_message(before.next_id)
        old_root = self.root
        self.root = self._new_root()
        shutil.rmtree(old_root, ignore_errors=True)
        materialize(state.image, self.root)
        io = self.io = self._new_io(self.root)
        again = inspect(lambda: self.backend.open(self.root, io), drain=False)
        if again.entries != rec.entries or again.problems:
            raise ClauseViolation("C10", "two copies of one crash state recovered "
                                         f"differently: {rec.describe()} and then "
                                         f"{again.describe()} {list(again.problems)}")
        self.forget_handles()
        self.store = self._call("open after the crash", self._open)
        self.model = after.restart()
        self.log.append(f"  recovered the state {'after' if after is not before else 'before'}"
                        " the operation")
        self.after_reopen(before, "the crash")

    def _forget_message(self, mid: int) -> None:
        """The interrupted enqueue did not survive: its ids name nothing any more."""
        for msg_id in [m for m, n in self.mids.items() if n == mid]:
            del self.mids[msg_id]
        for entry_id in [e for e, k in self.keys.items() if k[0] == mid]:
            del self.keys[entry_id]

    def _report(self, found: tuple[tuple[str, str], ...], before: Model, call: Call | None,
                site: str, model: str, state: CrashState, rec: Recovered) -> str:
        what = call.describe() if call is not None else "an aborted enqueue"
        lines = [f"after a crash inside {what}:"]
        lines += [f"  {c} ({CLAUSES.get(c, c)}): {d}" for c, d in found]
        lines += [f"  crash point: {site}",
                  f"  persistence model: {model}; crash state key: {state.key!r}",
                  f"  the crash kept: {state.description}",
                  "  model before the operation:"]
        lines += [f"    {s}" for s in describe_model(before)]
        lines.append("  recovered:")
        lines += [f"    {s}" for s in rec.describe()] or ["    (nothing)"]
        return "\n".join(lines)
