"""queue-ref campaign on Spark in local mode (one session, local[2], for the module).

The campaign must give the single-process explorer's answers: the same scenario ids with
the same clauses, and the same totals under the keys of ``crash explore --json``; a
broken variant's violation is found, reported with its replay command and replays; a
campaign resumes with only the partitions that have no file; diff tells new from fixed.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.campaign.campaign_plan import CampaignConfig, finished, partitions
from conformance.campaign.spark_setup import spark_session
from conformance.cli import main
from conformance.crashexplore.exploration import ExploreConfig, explore
from conformance.crashexplore.reproduction import reproduce
from conformance.crashexplore.traced_runs import Limits
from tests.browser_support import screenshot

ROOT = Path(__file__).resolve().parents[1]
TOTAL_KEYS = ("workloads", "crash_points", "rest_points", "eio_points", "states",
              "violating_states", "violations")
MODEL_KEYS = ("crash_points", "states", "recovery_states", "eio_states", "violations")


@pytest.fixture(scope="session")
def spark() -> Any:
    session, _ = spark_session("local[2]", app="queue-ref campaign tests")
    yield session
    session.stop()


BROKEN = ["--backend", "fs-broken-nofsync", "--model", "weak", "--bound", "0", "--random", "1",
          "--length", "4", "--no-recovery", "--no-eio"]


@pytest.fixture(scope="module")
def broken(spark: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, int, dict[str, Any]]:
    """A campaign over a broken variant (random workloads split into shards by crash
    point): its directory, exit code and JSON line."""
    out = tmp_path_factory.mktemp("broken") / "c"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["campaign", "run", *BROKEN, "--split", "3", "--out", str(out), "--json"])
    return out, code, json.loads(buf.getvalue().strip().splitlines()[-1])


def _json_last(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out = capsys.readouterr().out.strip().splitlines()
    result: dict[str, Any] = json.loads(out[-1])
    return result


def _explore(backend: str, models: tuple[str, ...], bound: int, **kw: Any) -> Any:
    return explore(ExploreConfig(backend=backend, models=models, bound=bound, **kw))


def _same_totals(campaign: dict[str, Any], explorer: dict[str, Any]) -> None:
    for k in TOTAL_KEYS:
        assert campaign[k] == explorer[k], k
    assert set(campaign["by_model"]) == set(explorer["by_model"])
    for m, st in explorer["by_model"].items():
        for k in MODEL_KEYS:
            assert campaign["by_model"][m][k] == st[k], (m, k)


def _scenarios(rows: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    return {r["scenario"]: tuple(r["clauses"]) for r in rows}


def test_a_clean_backend_gives_the_explorers_totals(spark: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    out = tmp_path / "fs"
    code = main(["campaign", "run", "--backend", "fs", "--model", "all", "--bound", "0",
                 "--out", str(out), "--json"])
    got = _json_last(capsys)
    want = _explore("fs", ("weak", "ext4-ordered", "process-kill"), 0).to_json()
    assert code == 0 and got["violating_states"] == 0
    _same_totals(got, want)
    # distinct_states is left out: traced_runs.image_digest pickles the image, and the
    # same image can pickle differently (the order its containers were filled in)
    assert got["by_backend"]["fs"]["states"] == want["states"]
    assert got["exhaustive_points"] + got["sampled_points"] == sum(
        s["crash_points"] for s in want["by_model"].values())


def test_a_broken_variant_gives_the_explorers_scenarios_and_the_report_shows_them(
        broken: tuple[Path, int, dict[str, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, code, got = broken
    assert code == 1
    want = _explore("fs-broken-nofsync", ("weak",), 0, random=1, random_length=4,
                    recovery=False, eio=False)
    _same_totals(got, want.to_json())
    assert got["violations"]["C1"] > 0
    assert any("/1of3" in u.unit_id for p in partitions(CampaignConfig(
        backends=("fs-broken-nofsync",), bound=0, random=1, random_length=4, split=3))
        for u in p)

    code = main(["campaign", "report", str(out), "--json"])
    rep = _json_last(capsys)
    assert code == 0
    assert len(rep["violation_list"]) == min(1000, rep["violating_states"])
    full = json.loads((out / "summary.json").read_text())  # every violating state
    found = _scenarios(full["violation_list"])
    assert found == {f.scenario: f.clauses for f in want.failures}
    for k in TOTAL_KEYS:
        assert rep[k] == got[k]
    page = (out / "report.html").read_text()
    assert "bound 0, 1 random workload of 4 calls from seed 0;" in page  # one sentence
    shortest = min(want.failures, key=lambda f: (len(f.case.workload), f.scenario))
    assert f"queue-ref crash reproduce {shortest.scenario}" in page
    assert page.count("<svg") >= 3 and "http" not in page.split("<svg", 1)[0].lower()
    # the reproduce command printed for a violation replays it on one machine
    first = rep["violation_list"][0]
    replay = reproduce(first["scenario"])
    assert not replay.ok and set(first["clauses"]) <= {c for c, _ in replay.outcome.violations}

    # diff: the broken campaign against a clean one of the same parameters
    clean = tmp_path / "clean"
    assert main(["campaign", "run", "--backend", "fs", *BROKEN[2:], "--out", str(clean)]) == 0
    capsys.readouterr()
    assert main(["campaign", "diff", str(clean), str(out), "--json"]) == 1
    d = _json_last(capsys)
    assert len(d["new"]) == sum(len(f.clauses) for f in want.failures) and not d["fixed"]
    assert d["by_model"]["weak"]["violating_states"] == {"a": 0, "b": got["by_model"][
        "weak"]["violations"]["C1"] + got["by_model"]["weak"]["violations"].get("C4", 0)}
    assert main(["campaign", "diff", str(out), str(clean), "--json"]) == 0
    d = _json_last(capsys)
    assert not d["new"] and len(d["fixed"]) == sum(len(f.clauses) for f in want.failures)


def test_a_campaign_resumes_with_the_partitions_that_have_no_file(
        spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    args = ["campaign", "run", "--backend", "kv", "--model", "process-kill", "--bound", "0",
            "--no-recovery", "--per-partition", "3", "--out", str(out), "--json"]
    assert main(args) == 0
    first = _json_last(capsys)
    parts = sorted((out / "data").glob("part-*.parquet"))
    assert first["partitions_run"] == len(parts) == first["partitions"] >= 3
    # an interrupted run: two partitions never finished, one left a half-written file
    stamps = {p.name: p.stat().st_mtime_ns for p in parts}
    parts[0].unlink()
    parts[-1].rename(parts[-1].with_name(f".{parts[-1].name}.tmp"))
    assert main(args) == 0
    again = _json_last(capsys)
    assert (again["partitions_resumed"], again["partitions_run"]) == (len(parts) - 2, 2)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("part-*.parquet")}
    assert set(after) == set(stamps)
    assert sorted(n for n in after if after[n] != stamps[n]) == [parts[0].name,
                                                                 parts[-1].name]
    for k in (*TOTAL_KEYS, "by_model", "distinct_states"):
        assert again[k] == first[k], k
    assert finished(out) == set(range(len(parts)))
    # other parameters in the same directory: one clear line, exit 2
    code = main([*args[:-3], "--bound", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "holds another campaign" in err and "bound: 0 vs 1" in err


def test_bad_input_is_one_line_and_exit_2(spark: Any, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in (
            (["run", "--backend", "nosuch", "--out", str(tmp_path / "x")], "unknown backend"),
            (["run", "--model", "fast", "--out", str(tmp_path / "y")], "persistence model"),
            (["report", str(tmp_path)], "not a campaign directory"),
            (["diff", str(tmp_path), str(tmp_path)], "not a campaign directory")):
        assert main(["campaign", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["campaign", "run", "--out", str(tmp_path)]) == 2
    assert "not a campaign directory" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_without_the_extra_the_command_says_how_to_install_it(tmp_path: Path) -> None:
    # pyspark made unimportable: what a plain `pip install .` gives
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "from conformance.cli import main\n"
            f"sys.exit(main(['campaign', 'run', '--out', {str(tmp_path / 'c')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: queue-ref campaign needs Spark: pip install 'queue-ref[campaign]' (pyspark, "
        "pandas, pyarrow, matplotlib) and Java 17 or later"]
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium not installed")
def test_the_report_page_renders_in_a_headless_browser(
        broken: tuple[Path, int, dict[str, Any]], tmp_path: Path) -> None:
    assert main(["campaign", "report", str(broken[0]), "--html",
                 str(tmp_path / "page.html")]) == 0
    # make campaign-screenshot keeps it
    assert len(screenshot(tmp_path / "page.html", tmp_path)) > 50_000


def test_limits_reach_the_rows_of_a_factory_backend(spark: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    # a backend named by package.module:factory; an exhaustive limit of 1 pending
    # operation: the crash points with more are sampled, and each row says so
    out = tmp_path / "s"
    factory = "conformance.examples.backends:kv_log"
    main(["campaign", "run", "--backend", factory, "--model", "weak", "--bound", "0",
          "--no-recovery", "--no-eio", "--exhaustive-limit", "1", "--random-states", "2",
          "--out", str(out), "--json"])
    got = _json_last(capsys)
    want = explore(ExploreConfig(backend=factory, bound=0, recovery=False, eio=False,
                                 limits=Limits(1, 2, 0))).to_json()
    _same_totals(got, want)
    assert list(got["by_backend"]) == [factory]
    assert got["sampled_points"] > 0 and got["exhaustive_points"] > 0
    assert got["sampled_points"] + got["exhaustive_points"] == want["crash_points"]
