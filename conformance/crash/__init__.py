"""Crash exploration: crash a backend at every mutating call and at rest between calls,
rebuild the disk as each persistence model allows, recover, and judge the result against
``spec.crash``.

Modules: ``workloads`` (what to run), ``driver`` (running it in lockstep with the model),
``runner`` (traced runs, rebuilt disks, recovery), ``recovered`` (reading a recovered
queue back), ``cases`` (one crash state as a pure function call), ``tasks`` (every crash
point of one workload), ``explore`` (all of it, summed up), ``scenario`` (ids),
``report`` (reproducing one id), ``backends`` and ``variants`` (what can be explored),
``cli`` (``queue-ref crash``).
"""

from conformance.crash.cases import CaseInput, CaseOutcome, run_case

__all__ = ["CaseInput", "CaseOutcome", "run_case"]
