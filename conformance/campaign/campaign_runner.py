"""Running a campaign's partitions on Spark, one job each, and writing their Parquet files.

Each partition that has no file yet is one Spark job of one task (as many driver threads
as executor cores keep every core busy); its rows come back to the driver, which writes
them to ``data/part-NNNNN.parquet`` under a dot name and renames the file when it is
complete.  A campaign interrupted at any moment therefore resumes with exactly the
partitions that have no file.  On a terminal a rich progress bar shows the partitions
done, the states judged and the tasks Spark's status tracker reports running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conformance.campaign.campaign_plan import (
    CampaignConfig,
    Unit,
    finished,
    part_path,
    partitions,
)
from conformance.campaign.campaign_rows import run_partition, to_table

JOB_GROUP = "queue-ref-campaign"


@dataclass
class RunStats:
    partitions: int = 0  # in the campaign
    skipped: int = 0  # finished before this run (resumed)
    ran: int = 0  # run now
    states: int = 0  # states judged by the partitions run now
    violating: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    failed: list[str] = field(default_factory=list)


def write_part(out: Path, index: int, rows: list[dict[str, Any]]) -> None:
    final = part_path(out, index)
    tmp = final.with_name(f".{final.name}.tmp")
    pq.write_table(to_table(rows), tmp)
    tmp.replace(final)


def _states(rows: list[dict[str, Any]]) -> tuple[int, int]:
    states = sum(r["states"] + r["recovery_states"] + r["eio_states"] + r["violating_states"]
                 for r in rows if r["model"] != "none")
    return states, sum(r["violating_states"] for r in rows)


class _Tracker:
    """Running tasks and their stages as Spark's status tracker reports them."""

    def __init__(self, sc: Any) -> None:
        self.tracker = sc.statusTracker()

    def running(self) -> tuple[int, int]:
        """(tasks running on executors, tasks completed in the active stages)."""
        active = done = 0
        for sid in self.tracker.getActiveStageIds():
            info = self.tracker.getStageInfo(sid)
            if info is not None:
                active += info.numActiveTasks
                done += info.numCompletedTasks
        return active, done


def run_campaign(spark: Any, cfg: CampaignConfig, out: Path, *,
                 console: Console | None = None, jobs: int = 0,
                 on_partition: Callable[[int], None] | None = None) -> RunStats:
    """Run every partition of ``cfg`` that ``out`` has no file for.  ``jobs``: Spark jobs
    at once (default: Spark's default parallelism, the executors' cores)."""
    sc = spark.sparkContext
    parts = partitions(cfg)
    done = finished(out)
    stats = RunStats(partitions=len(parts), skipped=len(done & set(range(len(parts)))))
    todo = [i for i in range(len(parts)) if i not in done]
    width = jobs or sc.defaultParallelism
    t0 = time.perf_counter()
    lock = threading.Lock()
    code = cfg.code_version

    def one(index: int, part: list[Unit]) -> int:
        sc.setJobGroup(JOB_GROUP, f"campaign partition {index} ({len(part)} units)",
                       interruptOnCancel=True)
        rows: list[dict[str, Any]] = sc.parallelize([(index, part)], 1).flatMap(
            lambda p: run_partition(p[0], p[1], code)).collect()
        write_part(out, index, rows)
        s, v = _states(rows)
        with lock:
            stats.ran += 1
            stats.states += s
            stats.violating += v
        if on_partition is not None:
            on_partition(index)
        return index

    console = console or Console(stderr=True)
    tracker = _Tracker(sc)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[states]} states"),
                        TextColumn("{task.fields[running]} running"),
                        TextColumn("[red]{task.fields[bad]}"), TimeElapsedColumn(),
                        console=console, transient=False)
    pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="campaign-job")
    pending: set[Future[int]] = set()
    try:
        with progress:
            bar = progress.add_task(f"campaign {'+'.join(cfg.backends)}", total=len(parts),
                                    completed=stats.skipped, states=0, running=0, bad="")
            pending = {pool.submit(one, i, parts[i]) for i in todo}
            while pending:
                finished_now, pending = wait(pending, timeout=0.5,
                                             return_when=FIRST_COMPLETED)
                for f in finished_now:
                    exc = f.exception()
                    if exc is not None:
                        stats.failed.append(f"{type(exc).__name__}: "
                                            f"{str(exc).strip().splitlines()[-1][:300]}")
                running, _ = tracker.running()
                progress.update(bar, completed=stats.skipped + stats.ran,
                                states=stats.states, running=running,
                                bad=f"{stats.violating} violating" if stats.violating else "")
    except KeyboardInterrupt:
        stats.interrupted = True
        sc.cancelJobGroup(JOB_GROUP)
        for f in pending:
            f.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        stats.seconds = time.perf_counter() - t0
    return stats
