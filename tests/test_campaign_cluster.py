"""A campaign on a real Spark standalone cluster on loopback: a master and two workers
from the pyspark installation, on ephemeral ports, the campaign submitted with
spark-submit and the project's packages as a zip (--py-files), all stopped at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.campaign.spark_setup import package_zip
from conformance.crashexplore.exploration import ExploreConfig, explore

pyspark = pytest.importorskip("pyspark")
SPARK_HOME = Path(pyspark.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes],
              timeout: float = 90) -> re.Match[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_WORKER_DIR": str(tmp_path / "work"), "PYSPARK_PYTHON": sys.executable,
           "SPARK_NO_DAEMONIZE": "1"}
    env.pop("SPARK_CONF_DIR", None)  # Spark's default logging: the lines we wait for
    procs = []
    try:
        master = _start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                         "--port", "0", "--webui-port", "0"], tmp_path / "master.log", env)
        procs.append(master)
        url = _wait_for(tmp_path / "master.log", r"spark://127\.0\.0\.1:\d+", master).group(0)
        for i in (1, 2):
            w = _start(["org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                        "--port", "0", "--webui-port", "0", "--cores", "1", "--memory",
                        "1g"], tmp_path / f"worker{i}.log", env)
            procs.append(w)
        for i, w in enumerate(procs[1:], 1):
            _wait_for(tmp_path / f"worker{i}.log", r"Successfully registered with master", w)
        yield url
    finally:
        for p in reversed(procs):
            _stop(p)


@pytest.mark.slow
def test_a_campaign_runs_on_a_standalone_cluster_through_spark_submit(
        cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "c"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_HOME": str(SPARK_HOME)}
    ship = package_zip(tmp_path / "queue_ref.zip")
    done = subprocess.run(
        [str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster,
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         "--conf", "spark.ui.enabled=false", "--py-files", str(ship),
         str(ROOT / "conformance" / "campaign" / "submit_entry.py"),
         "campaign", "run", "--backend", "fs-broken-nofsync", "--model", "weak",
         "--bound", "0", "--no-recovery", "--no-eio", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, env=env, check=False, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = explore(ExploreConfig(backend="fs-broken-nofsync", bound=0, recovery=False,
                                 eio=False))
    for k in ("workloads", "crash_points", "states", "violating_states", "violations"):
        assert got[k] == want.to_json()[k], k
    # both workers ran an executor of this application
    apps = list((tmp_path / "work").glob("app-*/*"))
    assert len({p.parent.parent for p in apps}) == 1 and len(apps) >= 2


@pytest.mark.slow
def test_a_killed_campaign_resumes_where_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "c"
    argv = [str(Path(sys.executable).with_name("queue-ref")), "campaign", "run", "--backend",
            "kv", "--model", "weak", "--bound", "1", "--no-recovery", "--per-partition", "1",
            "--master", "local[2]", "--out", str(out), "--json"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        end = time.monotonic() + 120
        while len(list((out / "data").glob("part-*.parquet"))) < 3:
            assert proc.poll() is None and time.monotonic() < end, "no partition finished"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM and Python workers
        proc.wait(timeout=30)
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("part-*.parquet")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["partitions_resumed"] == len(kept) < got["partitions"]
    assert got["partitions_run"] == got["partitions"] - len(kept)
    for name, stamp in kept.items():  # finished partitions were not run again
        assert (out / "data" / name).stat().st_mtime_ns == stamp
    want = explore(ExploreConfig(backend="kv", bound=1, recovery=False)).to_json()
    for k in ("workloads", "crash_points", "states", "violating_states", "by_model"):
        if k == "by_model":
            for m, st in want[k].items():
                for key in ("crash_points", "states", "eio_states", "violations"):
                    assert got[k][m][key] == st[key], (m, key)
        else:
            assert got[k] == want[k], k
