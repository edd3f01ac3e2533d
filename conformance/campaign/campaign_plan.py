"""A campaign's parameters, its units of work and their partitions (no Spark here).

A unit is one explorer ``Task`` (``log_points`` set), or one shard of a task that covers
more than one call (random workloads, ``--whole``): such a task is split by crash point
into up to ``split`` shards so that partitions stay balanced.  Units are grouped into
partitions of ``per_partition`` units, the longest workloads first; the partition
numbers depend only on the parameters, so an interrupted campaign resumes with the same
partitions.  ``campaign.json`` in the campaign directory keeps the parameters.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from conformance.crashexplore.crash_task import Task
from conformance.crashexplore.exploration import ExploreConfig, plan
from conformance.crashexplore.traced_runs import OPEN, Limits

PARAMS_FILE = "campaign.json"
DATA_DIR = "data"


class CampaignError(ValueError):
    """Bad parameters, or a directory that holds another campaign."""


@dataclass(frozen=True)
class CampaignConfig:
    backends: tuple[str, ...] = ("fs",)
    models: tuple[str, ...] = ("weak",)
    bound: int = 3
    after_life: int = -1
    random: int = 0
    random_length: int = 12
    seed: int = 0
    exhaustive_limit: int = 10
    random_states: int = 8
    recovery: bool = True
    recovery_sample: int = 3
    eio: bool = True
    split: int = 4  # shards per task that covers several calls
    per_partition: int = 2  # units per partition (one Spark job each)
    code_version: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.backends:
            raise CampaignError("give at least one backend")
        if self.split < 1 or self.per_partition < 1:
            raise CampaignError("--split and --per-partition must be >= 1")
        if self.exhaustive_limit < 0 or self.random_states < 0:
            raise CampaignError("--exhaustive-limit and --random-states must be >= 0")
        for b in self.backends:
            self.explore_config(b)  # unknown backends and models fail here, in one line

    def explore_config(self, backend: str) -> ExploreConfig:
        try:
            return ExploreConfig(
                backend=backend, models=self.models, bound=self.bound,
                after_life=self.after_life, random=self.random,
                random_length=self.random_length, seed=self.seed,
                limits=Limits(self.exhaustive_limit, self.random_states, 0),
                recovery=self.recovery, recovery_sample=self.recovery_sample, eio=self.eio)
        except ValueError as e:
            raise CampaignError(str(e)) from e

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["backends"] = list(self.backends)
        d["models"] = list(self.models)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CampaignConfig:
        d = dict(d)
        d["backends"] = tuple(d["backends"])
        d["models"] = tuple(d["models"])
        return cls(**d)


@dataclass(frozen=True)
class Unit:
    """One task (or shard of one) of a campaign; ``unit_id`` names it in the dataset."""

    unit_id: str
    task: Task


def covered_calls(task: Task) -> int:
    """How many calls a task crashes inside (opening the queue counts as one)."""
    first = -1 if task.first_call == OPEN else task.first_call
    return max(1, len(task.workload) - first)


def units(cfg: CampaignConfig) -> list[Unit]:
    out = []
    for backend in cfg.backends:
        for task in plan(cfg.explore_config(backend)):
            n = min(cfg.split, covered_calls(task))
            for i in range(n):
                t = replace(task, shard=(i, n), log_points=True)
                uid = f"{backend}/{task.workload_id}" + (f"/{i + 1}of{n}" if n > 1 else "")
                out.append(Unit(uid, t))
    return out


def partitions(cfg: CampaignConfig) -> list[list[Unit]]:
    """The units in partitions, the longest workloads first (so that no executor is left
    with one long partition at the end)."""
    todo = sorted(units(cfg), key=lambda u: -len(u.task.workload))
    return [todo[i:i + cfg.per_partition] for i in range(0, len(todo), cfg.per_partition)]


def code_version() -> str:
    """``git describe`` of the source tree this code runs from, else the package version."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                               "--tags"], capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return f"git:{done.stdout.strip()}"
    try:
        return f"queue-ref {metadata.version('queue-ref')}"
    except metadata.PackageNotFoundError:
        return "unknown"


def open_campaign_dir(out: Path, cfg: CampaignConfig) -> bool:
    """Create the campaign directory for ``cfg``, or check that it holds the same
    campaign (then it is resumed: returns True)."""
    params = out / PARAMS_FILE
    if params.exists():
        try:
            old = CampaignConfig.from_json(json.loads(params.read_text()))
        except (ValueError, TypeError, KeyError) as e:
            raise CampaignError(f"{params} is not a campaign's parameters: {e}") from e
        if old != cfg:
            diff = {k: (v, cfg.to_json()[k]) for k, v in old.to_json().items()
                    if k != "code_version" and cfg.to_json()[k] != v}
            raise CampaignError(f"{out} holds another campaign (differs in "
                                f"{', '.join(f'{k}: {a} vs {b}' for k, (a, b) in diff.items())})"
                                "; give another --out")
        if old.code_version != cfg.code_version:
            raise CampaignError(f"{out} was run by {old.code_version}, this is "
                                f"{cfg.code_version}: verdicts of two versions would mix; "
                                "give another --out")
        return True
    if out.exists() and any(out.iterdir()):
        raise CampaignError(f"{out} exists and is not a campaign directory")
    (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
    tmp = params.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(params)
    return False


def read_params(out: Path) -> CampaignConfig:
    params = out / PARAMS_FILE
    try:
        return CampaignConfig.from_json(json.loads(params.read_text()))
    except FileNotFoundError as e:
        raise CampaignError(f"{out} is not a campaign directory (no {PARAMS_FILE})") from e
    except (ValueError, TypeError, KeyError) as e:
        raise CampaignError(f"{params} is not a campaign's parameters: {e}") from e


def part_path(out: Path, index: int) -> Path:
    return out / DATA_DIR / f"part-{index:05d}.parquet"


def finished(out: Path) -> set[int]:
    """Partitions whose file is complete (files are written under a dot name and renamed)."""
    done = set()
    for p in (out / DATA_DIR).glob("part-*.parquet"):
        try:
            done.add(int(p.stem.split("-")[1]))
        except ValueError:
            continue
    return done
