"""Crash exploration: crash a backend at every mutating call and at rest between calls,
rebuild the disk as each persistence model allows, recover, and judge the result against
``spec.crash``.

The pipeline of one workload reads top to bottom in ``crash_task.explore_task``: run the
workload, crash it at each point, build the crash states, recover, judge, record.  The
leaves it calls:

* ``workloads`` (what to run) and ``workload_driver`` (running it in lockstep with the
  model);
* ``traced_runs`` (a run through ``FaultyIO``, crashed or failed at a mutating call);
* ``disk_recovery`` (recovering a rebuilt disk, cached; crashing inside recovery);
* ``recovered_queue`` (reading a recovered queue back, mapped to the model's entries);
* ``crash_judge`` (the crash condition of ``spec.crash`` on what was read back);
* ``crash_scenario`` (scenario ids, and one crash state as plain data).

Around it: ``exploration`` (every task of a configuration, in worker processes, summed
up), ``scenario_rebuild`` and ``reproduction`` (one scenario id rebuilt and explained),
``explored_backends``, ``broken_fs_variants`` and ``backend_registry`` (what can be
explored, by name), ``crash_command`` (``queue-ref crash``).
"""

from conformance.crashexplore.crash_scenario import CaseInput, CaseOutcome
from conformance.crashexplore.scenario_rebuild import run_case

__all__ = ["CaseInput", "CaseOutcome", "run_case"]
