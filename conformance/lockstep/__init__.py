"""A hypothesis state machine that drives a backend and the spec model in lockstep.

``lockstep_machine(factory)`` returns a ``RuleBasedStateMachine`` subclass; every rule
performs one operation on the backend and on ``spec.model.Model`` and compares the
answers, and after every step the whole listing must equal the model.  Handles are kept
in a pool, several per entry (each listing adds one), so rules also play the second
worker that holds a stale handle; consumed, wrong-type and foreign handles must raise
``MisuseError``.  Switches:

* ``restarts``: a rule closes the queue and opens it again (an orderly restart): every
  acknowledged entry must come back (INFLIGHT ones as QUEUED, PENDING_CLEANUP ones gone)
  and a second recovery must find nothing to do;
* ``listing``: zone and domain listings, for backends that declare them;
* ``crashes``: for a backend that declares the I/O seam, a rule crashes inside the next
  operation under a persistence model, recovers, judges the result by the crash
  condition and goes on (``conformance.lockstep.crash_rules``).  Other backends skip only
  that rule; the machine's docstring says so;
* ``traced`` (by default on without ``restarts``, always with the crash rule): a backend
  that declares the I/O seam runs through a recording one, and after every step the
  operations it acknowledged are judged by the sync-cover rule
  (``conformance.harness.sync_cover``; ``MachineBase.check_sync_cover``).

A difference raises ``ClauseViolation`` (an AssertionError) naming the clause.  Under
pytest::

    TestLockstep = lockstep_machine(my_factory, restarts=True).TestCase

Without pytest, ``run_lockstep`` returns findings instead of raising (``queue-ref
certify``), or ``hypothesis.stateful.run_state_machine_as_test(lockstep_machine(f))``.

Modules: ``machine_state`` (state, helpers, the listing invariant), ``operation_rules``
(enqueue, transitions, reads, drain), ``handle_rules`` (listings, misuse),
``restart_rules`` (with the edge sequence of a live recovery under held claims), ``crash_rules``.
"""

from __future__ import annotations

from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis.stateful import get_state_machine_test

from conformance.harness.backend_factory import Backend, Factory
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import Finding
from conformance.harness.suite_profiles import Profile
from conformance.lockstep.crash_rules import CrashRules
from conformance.lockstep.handle_rules import HandleRules
from conformance.lockstep.machine_state import ClauseViolation
from queue_ref.storage import Capability

__all__ = ["ClauseViolation", "LockstepMachine", "lockstep_machine", "run_lockstep"]


class LockstepMachine(CrashRules, HandleRules):
    """Every rule of the lockstep machine; ``lockstep_machine`` binds it to a backend."""


def lockstep_machine(factory: Factory | Backend | str, *, restarts: bool = False,
                     listing: bool = False, crashes: bool = False,
                     traced: bool | None = None,
                     name: str | None = None) -> type[LockstepMachine]:
    """A LockstepMachine subclass bound to ``factory`` (named ``name`` in reports).

    The backend is opened once here to read its capabilities: the crash rule (with
    ``crashes``) is on only if it declares the I/O seam; so is ``traced``: the backend run
    through a recording seam, every step judged by the sync-cover rule (always with the
    crash rule).  ``traced`` None: on unless ``restarts`` is (the restart rule reopens
    the queue in the same directory, and a backend opened through the seam may take its
    names from what is on disk, as the project's example factories do for crash
    exploration's reruns: an emptied queue reopened would hand out its message ids again,
    which the machine refuses).
    """
    backend = factory if isinstance(factory, Backend) else Backend.from_factory(factory, name)
    if traced is None:
        traced = not restarts
    has_seam = (crashes or traced) and backend.probe().has(Capability.IO_SEAM)
    seam = crashes and has_seam
    traced = has_seam
    doc = [f"{backend.name} and the model in lockstep.",
           "Restart rule: " + ("on." if restarts else "off."),
           "Listing rules: " + ("on, for the listings the backend declares." if listing
                                else "off.")]
    if crashes:
        doc.append("Crash rule: " + ("on (the backend declares the I/O seam)." if seam else
                                     "SKIPPED: the backend declares no I/O seam "
                                     "(Capability.IO_SEAM), so no crash can be placed inside "
                                     "its calls; every other rule runs."))
    doc.append("Sync-cover rule: " + ("on (the backend runs through the I/O seam)." if traced
                                      else "off."))
    attrs = {"backend": backend, "restarts": restarts, "listing": listing, "crashes": seam,
             "traced": traced, "last_log": [], "__doc__": "\n".join(doc)}
    cls_name = ("LockstepCrashes" if seam else "LockstepRestarts" if restarts
                else "LockstepListing" if listing else "Lockstep")
    return type(cls_name, (LockstepMachine,), attrs)


def run_lockstep(backend: Backend, profile: Profile, seed: int, *, check: str = "lockstep",
                 restarts: bool = False, listing: bool = False) -> list[Finding]:
    """Run the machine with the profile's settings from ``seed``; the findings of the
    failure found (shrunk to a minimal one when the profile says so).

    The scenario id is ``<check>:<profile>:seed=<seed>``; the same id runs the same
    examples again.
    """
    machine = lockstep_machine(backend, restarts=restarts, listing=listing)
    settings = Settings(profile.hypothesis_settings(), report_multiple_bugs=False)
    test = hypothesis_seed(seed)(get_state_machine_test(machine, settings=settings))
    scenario = f"{check}:{profile.name}:seed={seed}"
    try:
        test()
    except ClauseViolation as e:
        return [Finding(e.clause, e.detail, scenario, NO_CRASH, tuple(machine.last_log))]
    except Exception as e:  # the machine itself failed (setup, teardown)
        return [Finding("C9", f"{type(e).__name__}: {e}", scenario, NO_CRASH,
                        tuple(machine.last_log))]
    return []
