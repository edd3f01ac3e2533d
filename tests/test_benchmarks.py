"""The benchmarks run end to end and print their figures as one JSON object, last.

These check what the benchmarks report and that the queues they drive end empty, not how
fast anything is: speed is measured by running the benchmarks themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(*args: str, cwd: Path) -> tuple[dict[str, object], str]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lifecycle.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), proc.stderr


def test_lifecycle_benchmark_reports_interleaved_ratios(tmp_path: Path) -> None:
    out, log = run_benchmark("--backend", "fs", "--rounds", "2", "--messages", "32",
                             "--rcpts", "20", "--big-mb", "2", "--dir", str(tmp_path),
                             cwd=tmp_path)
    assert out["rounds"] == 2 and out["procs"] == 2 and log.count("round ") == 2
    assert "fs-syncfs/2proc" in log
    floor = out["raw_floor_per_s"]
    assert isinstance(floor, dict) and 0 < floor["min"] <= floor["median"] <= floor["max"]
    for mode in ("fs-syncfs", "fs-fsync"):
        fig = out[mode]
        assert isinstance(fig, dict)
        ratio = fig["ratio_16p_to_raw_floor"]
        rate = fig["lifecycle_16p_per_s"]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
        assert 0 < rate["min"] <= rate["median"] <= rate["max"]
        assert 0 <= ratio["rounds_at_or_above_1"] <= 2
        assert fig["lifecycle_1p_per_s"] > 0
        assert fig["disk_after_16p_bytes"] == 0 and fig["disk_after_1p_bytes"] == 0
        procs = fig["ratio_16p_2proc_to_raw_floor"]  # the same 16 producers in 2 processes
        assert 0 < procs["min"] <= procs["median"] <= procs["max"]
        assert fig["lifecycle_16p_2proc_per_s"]["median"] > 0
        assert fig["disk_after_16p_2proc_bytes"] == 0
        assert fig["one_message_20_rcpts"]["recipients"] == 20
        assert 0 < fig["peak_memory_2MB_body_bytes"] < 1 << 20  # streamed: far below 2 MB
    assert os.listdir(tmp_path) == []  # the benchmark removed its directories


def test_lifecycle_benchmark_sets_the_kv_queue_against_the_raw_log_ceiling(
        tmp_path: Path) -> None:
    out, _ = run_benchmark("--backend", "kv-log", "--rounds", "1", "--messages", "32",
                           "--rcpts", "5", "--big-mb", "1", "--dir", str(tmp_path),
                           cwd=tmp_path)
    kv = out["kv-log"]
    assert isinstance(kv, dict) and "fs-syncfs" in out
    share = out["ratio_kv-log_16p_to_raw_log_ceiling"]
    assert isinstance(share, dict)
    rate, ceiling = kv["lifecycle_16p_per_s"]["median"], out["raw_log_ceiling_per_s"]
    assert share["lifecycles"] == pytest.approx(rate / ceiling)
    assert share["write_batches"] == pytest.approx(4 * rate / ceiling)
    assert "ratio_fs-syncfs_16p_to_raw_log_ceiling" not in out  # a KV queue's figure


@pytest.mark.parametrize("args", [("--rounds", "0"), ("--procs", "3")])
def test_lifecycle_benchmark_refuses_bad_sizes(tmp_path: Path, args: tuple[str, str]) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lifecycle.py"), *args],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 2 and args[0] in proc.stderr


def test_domain_listing_benchmark_prints_both_ratios(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "domain_listing.py"),
                           "--entries", "2000", "--target", "10", "--rcpts", "50",
                           "--repeat", "1", "--dir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for backend in ("fs", "kv-log"):
        fig = out[backend]
        assert fig["entries"] == 2000 and fig["target"] == 10
        assert fig["index_s"] > 0 and fig["ratio"] == fig["scan_s"] / fig["index_s"]
        assert f"{backend}" in proc.stderr and "ratio" in proc.stderr
    assert os.listdir(tmp_path) == []  # the queues were removed
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "domain_listing.py"),
                          "--target", "0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "--target" in bad.stderr


def test_scale_benchmark_measures_the_relay_and_the_commands(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"),
                           "--sizes", "200", "--threads", "4", "--timeout", "120",
                           "--dir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fig = out["sizes"]["200"]
    assert fig["queued"] == 200 and out["targets"]["ready_s"] == 2.0
    for key in ("ready_s", "accept_s", "deliver_s", "listed_s", "rss_mb", "mailq_first_s",
                "mailq_s", "qshape_s"):
        assert fig[key] > 0, key
    assert fig["accept_s"] < fig["deliver_s"] and fig["mailq_first_s"] <= fig["mailq_s"]
    assert fig["ratios"]["rss_mb"] == round(fig["rss_mb"] / 200.0, 3)
    assert "200 queued" in proc.stderr and "mailq first line" in proc.stderr
    assert os.listdir(tmp_path) == []  # the queue was removed
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"),
                          "--sizes", "0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "--sizes" in bad.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/sbin/mkfs.ext4").exists(),
                    reason="loop-mounting file systems needs root and mkfs.ext4")
def test_multi_root_benchmark_compares_two_file_systems_with_one(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_root.py"),
                           "--rounds", "2", "--messages", "64", "--threads", "4",
                           "--size-mb", "32", "--dir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = out["one_root"], out["two_roots"]
    assert len(one["rates"]) == len(two["rates"]) == 2 and out["same_disk"] is True
    assert out["body_bytes"] == 4096 and len(one["sync"]) == 1 and len(two["sync"]) == 2
    assert two["sync"][0] == two["sync"][1] == one["sync"][0]  # each on its own file system
    assert out["ratio"] == two["median"] / one["median"] > 0
    assert "round 2: one" in proc.stdout and "round 2: two" in proc.stdout
    assert os.listdir(tmp_path) == []  # unmounted and removed
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_root.py"),
                          "--size-mb", "8"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "--size-mb" in bad.stderr
