"""Concurrent callers on one queue: what they did, and whether the model allows it.

* ``history_workers``: callers (threads of one Storage, or child processes with their
  own) doing random operations through the handles they hold, each call recorded with
  its answer and its invocation and return times;
* ``linearizability``: the search that decides whether such a history is linearizable
  against ``spec``'s model (Wing and Gong's algorithm with Lowe's memoization, per entry);
* ``paused_races``: one caller stopped before each mutating call of its transition
  (``FaultyIO.pause_at``) while another runs a competing call on the same entry.

The ``linearizable`` check (``conformance.checks.linearizability_check``) runs them.
"""
