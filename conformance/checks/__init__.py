"""The checks of the suite, one module each (their ids are those of
``conformance.harness.check_catalog.CHECKS``):

=========================  ==============================================================
module                     check ids
=========================  ==============================================================
bad_input_check            bad-input
scale_checks               many-recipients, threads
limits_check               limits
process_kill_check         process-kill, recovery-rerun
crash_exploration_check    crash-exploration (hands the backend to ``crashexplore``)
io_errors_check            io-errors
multi_process_check        multi-process
streaming_check            streaming
damage_at_rest_check       damage-at-rest (the ways a file is damaged: ``file_damage``)
disk_growth_check          bounded-disk
group_commit_check         group-commit
sync_rounds_check          sync-rounds (the rule it judges by: ``harness.sync_cover``)
sync_rounds_crash_check    sync-rounds-crash (sync-rounds' runs, power cut at their calls)
linearizability_check      linearizable (the search: ``concurrency.linearizability``)
lifecycle_edges_check      lifecycle-edges (the children: ``lifecycle_edges_actors``;
                           the judge: ``lifecycle_edges_judge``)
blackbox_power_loss_check  blackbox-power-loss (strace; backends without the I/O seam)
=========================  ==============================================================

The lockstep checks (lockstep, restart, listing) are ``conformance.lockstep``.  Each
module has ``run...(backend, ...) -> CheckResult`` and, where its scenarios are its own,
``replay(backend, scenario)``.  ``conformance.certify.suite_runner`` runs them.
"""
