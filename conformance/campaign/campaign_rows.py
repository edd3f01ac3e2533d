"""What a Spark executor runs for one partition, and the rows it returns.

``run_partition`` maps the partition's units through ``explore_task`` (the function the
explorer's worker processes run) and turns each crash point's ``PointLog`` into one row
per model: the dataset's schema is ``SCHEMA``.  Rows are plain dicts, so the driver
writes them with pyarrow and Spark SQL reads them back.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from conformance.campaign.campaign_plan import Unit
from conformance.crashexplore.crash_scenario import NO_CRASH
from conformance.crashexplore.crash_task import explore_task

VIOLATION = pa.struct([("clause", pa.string()), ("scenario", pa.string()),
                       ("detail", pa.string())])

SCHEMA = pa.schema([
    ("backend", pa.string()),
    ("model", pa.string()),  # "none": the fault-free run's restart check
    ("workload", pa.string()),  # workload id (``queue-ref crash reproduce`` decodes it)
    ("workload_len", pa.int32()),
    ("unit", pa.string()),  # the task, or shard of it, that explored this point
    ("partition", pa.int32()),
    ("kind", pa.string()),  # rest-check, crash, rest (between calls), eio
    ("crash_point", pa.int32()),  # mutating call; at rest: calls returned
    ("when", pa.string()),  # before, after, rest
    ("counted", pa.bool_()),  # a crash point of the explorer's count
    ("judged", pa.bool_()),  # states were built under this model here
    ("exhaustive", pa.bool_()),  # every state the model allows (else a random sample)
    ("states", pa.int64()),  # first-level states judged (violating ones included)
    ("recovery_states", pa.int64()),  # crashed again inside their recovery
    ("eio_states", pa.int64()),  # power cuts after an fsync failed with EIO
    ("violating_states", pa.int32()),
    ("distinct_disks", pa.int32()),
    ("disks", pa.list_(pa.string())),  # digests of the disk images judged
    ("violations", pa.list_(VIOLATION)),  # one per violating state and clause
    ("errors", pa.list_(pa.string())),  # cases that could not be built
    ("seconds", pa.float64()),
    ("code_version", pa.string()),
])


def unit_rows(unit: Unit, partition: int, code_version: str) -> list[dict[str, Any]]:
    task = unit.task
    result = explore_task(task)
    rows = []
    for point in result.log or []:
        models = point.models or {NO_CRASH: None}
        for model, at in models.items():
            base = {
                "backend": task.backend, "model": model, "workload": task.workload_id,
                "workload_len": len(task.workload), "unit": unit.unit_id,
                "partition": partition, "kind": point.kind, "crash_point": point.index,
                "when": point.when, "counted": point.counted and point.kind != "rest-check",
                "seconds": point.seconds / len(models), "code_version": code_version,
                "errors": point.errors if model == next(iter(models)) else [],
            }
            if at is None:
                rows.append({**base, "judged": False, "exhaustive": True, "states": 0,
                             "recovery_states": 0, "eio_states": 0, "violating_states": 0,
                             "distinct_disks": 0, "disks": [], "violations": []})
                continue
            rows.append({
                **base, "judged": at.judged, "exhaustive": at.exhaustive,
                "states": at.states, "recovery_states": at.recovery_states,
                "eio_states": at.eio_states, "violating_states": len(at.failures),
                "distinct_disks": len(at.images), "disks": sorted(at.images),
                "violations": [{"clause": c, "scenario": sid, "detail": detail}
                               for sid, clauses, detail in at.failures for c in clauses],
            })
    return rows


def run_partition(partition: int, part: list[Unit], code_version: str
                  ) -> list[dict[str, Any]]:
    """The rows of one partition (runs on an executor)."""
    rows: list[dict[str, Any]] = []
    for unit in part:
        rows.extend(unit_rows(unit, partition, code_version))
    return rows


def to_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)
