"""A campaign's summaries, computed with Spark SQL over its Parquet dataset.

``totals`` gives the numbers ``queue-ref crash explore --json`` gives, under the same keys
(``workloads``, ``crash_points``, ``rest_points``, ``eio_points``, ``states``,
``distinct_states``, ``violations``, ``violating_states``, ``by_model``), for the whole
campaign and per backend; ``summary`` adds the tables of the report (states and
violations per backend x model x clause, time per workload, slowest units, distinct
disks, crash points exhaustive and sampled, every violation with the command that
replays it).  ``diff`` compares two campaigns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.campaign.campaign_plan import DATA_DIR, CampaignError, read_params

VIEW = "points"

_STATES = "states + recovery_states + eio_states"


def load(spark: Any, out: Path, view: str = VIEW) -> Any:
    """Register the campaign's rows as the temporary view ``view``; returns the frame."""
    read_params(out)
    data = out / DATA_DIR
    if not any(data.glob("part-*.parquet")):
        raise CampaignError(f"{out} has no finished partition yet (run the campaign first)")
    # small aggregates: a few shuffle partitions per core, not Spark's default 200
    spark.conf.set("spark.sql.shuffle.partitions",
                   str(max(4, 2 * spark.sparkContext.defaultParallelism)))
    df = spark.read.parquet(str(data)).cache()  # every summary reads it again
    df.createOrReplaceTempView(view)
    return df


def _rows(spark: Any, sql: str) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in spark.sql(sql).collect()]


def _clause_key(c: str) -> tuple[int, str]:
    return (int(c[1:]), c) if c[1:].isdigit() else (99, c)


def _totals(spark: Any, view: str, where: str) -> dict[str, Any]:
    head = _rows(spark, f"""
        SELECT count(DISTINCT backend, workload) AS workloads,
               count(DISTINCT CASE WHEN counted AND kind IN ('crash', 'rest')
                     THEN concat_ws('|', unit, kind, crash_point, `when`) END) AS crash_points,
               count(DISTINCT CASE WHEN counted AND kind = 'rest'
                     THEN concat_ws('|', unit, crash_point) END) AS rest_points,
               count(DISTINCT CASE WHEN counted AND kind = 'eio'
                     THEN concat_ws('|', unit, crash_point) END) AS eio_points,
               coalesce(sum(CASE WHEN model != 'none'
                            THEN {_STATES} + violating_states END), 0) AS states,
               coalesce(sum(violating_states), 0) AS violating_states,
               coalesce(sum(seconds), 0) AS seconds
        FROM {view} WHERE {where}""")[0]
    distinct = _rows(spark, f"""
        SELECT count(DISTINCT backend, model, disk) AS n
        FROM (SELECT backend, model, explode(disks) AS disk FROM {view} WHERE {where})""")[0]["n"]
    clauses = {r["clause"]: r["n"] for r in _rows(spark, f"""
        SELECT v.clause AS clause, count(*) AS n
        FROM (SELECT explode(violations) AS v FROM {view} WHERE {where}) GROUP BY v.clause""")}
    by_model: dict[str, Any] = {}
    for r in _rows(spark, f"""
            SELECT model, sum(CAST(judged AS INT)) AS crash_points, sum(states) AS states,
                   sum(recovery_states) AS recovery_states, sum(eio_states) AS eio_states,
                   sum(CASE WHEN judged AND exhaustive THEN 1 ELSE 0 END) AS exhaustive_points,
                   sum(CASE WHEN judged AND NOT exhaustive THEN 1 ELSE 0 END)
                       AS sampled_points
            FROM {view} WHERE {where} AND model != 'none' GROUP BY model ORDER BY model"""):
        m = r.pop("model")
        by_model[m] = {**r, "distinct_states": 0, "violations": {}}
    for r in _rows(spark, f"""
            SELECT model, count(DISTINCT backend, disk) AS n
            FROM (SELECT backend, model, explode(disks) AS disk FROM {view}
                  WHERE {where} AND model != 'none') GROUP BY model"""):
        by_model[r["model"]]["distinct_states"] = r["n"]
    for r in _rows(spark, f"""
            SELECT model, v.clause AS clause, count(*) AS n
            FROM (SELECT model, explode(violations) AS v FROM {view}
                  WHERE {where} AND model != 'none') GROUP BY model, v.clause"""):
        by_model[r["model"]]["violations"][r["clause"]] = r["n"]
    for st in by_model.values():
        st["violations"] = dict(sorted(st["violations"].items()))
    return {
        "workloads": head["workloads"], "crash_points": head["crash_points"],
        "rest_points": head["rest_points"], "eio_points": head["eio_points"],
        "states": head["states"], "distinct_states": distinct,
        "violations": dict(sorted(clauses.items(), key=lambda kv: _clause_key(kv[0]))),
        "violating_states": head["violating_states"],
        "exhaustive_points": sum(s["exhaustive_points"] for s in by_model.values()),
        "sampled_points": sum(s["sampled_points"] for s in by_model.values()),
        "seconds": round(head["seconds"], 2),
        "by_model": by_model,
    }


def totals(spark: Any, out: Path) -> dict[str, Any]:
    """The crash-explore totals of the campaign in ``out``: all backends together, and
    per backend under ``by_backend``."""
    load(spark, out)
    cfg = read_params(out)
    result = _totals(spark, VIEW, "true")
    backends = [r[0] for r in spark.sql(f"SELECT DISTINCT backend FROM {VIEW} ORDER BY 1")
                .collect()]
    per = {}
    for backend in backends:
        safe = backend.replace("'", "''")
        per[backend] = (dict(result) if len(backends) == 1 else
                        _totals(spark, VIEW, f"backend = '{safe}'"))
    result["by_backend"] = per
    result.update(backends=list(cfg.backends), models=list(cfg.models), bound=cfg.bound,
                  after_life=cfg.after_life, random=cfg.random,
                  random_length=cfg.random_length, seed=cfg.seed,
                  exhaustive_limit=cfg.exhaustive_limit, code_version=cfg.code_version)
    return result


def violations(spark: Any, limit: int = 0) -> list[dict[str, Any]]:
    """Every violating state (after ``load``), shortest workload first, with the command
    that replays it."""
    lim = f"LIMIT {int(limit)}" if limit else ""
    rows = _rows(spark, f"""
        SELECT backend, model, workload, workload_len, kind, crash_point, `when`,
               collect_list(v.clause) AS clauses, v.scenario AS scenario,
               first(v.detail) AS detail
        FROM (SELECT *, explode(violations) AS v FROM {VIEW})
        GROUP BY backend, model, workload, workload_len, kind, crash_point, `when`, v.scenario
        ORDER BY workload_len, CASE kind WHEN 'rest-check' THEN 0 WHEN 'rest' THEN 1
                 WHEN 'crash' THEN 2 WHEN 'eio' THEN 3 ELSE 4 END, length(v.scenario),
                 v.scenario {lim}""")
    for r in rows:
        r["clauses"] = sorted(set(r["clauses"]), key=_clause_key)
        r["reproduce"] = f"queue-ref crash reproduce {r['scenario']}"
    return rows


def summary(spark: Any, out: Path) -> dict[str, Any]:
    """Everything the report shows."""
    result = totals(spark, out)
    result["per_backend_model"] = _rows(spark, f"""
        SELECT backend, model, sum(CAST(judged AS INT)) AS crash_points,
               sum({_STATES}) AS states, sum(violating_states) AS violating_states,
               sum(CASE WHEN judged AND NOT exhaustive THEN 1 ELSE 0 END) AS sampled_points,
               round(sum(seconds), 2) AS seconds
        FROM {VIEW} WHERE model != 'none' GROUP BY backend, model ORDER BY backend, model""")
    result["per_clause"] = _rows(spark, f"""
        SELECT backend, model, v.clause AS clause, count(*) AS states
        FROM (SELECT backend, model, explode(violations) AS v FROM {VIEW})
        GROUP BY backend, model, v.clause ORDER BY backend, model, clause""")
    result["per_workload_length"] = _rows(spark, f"""
        SELECT workload_len, count(DISTINCT backend, workload) AS workloads,
               round(sum(seconds), 2) AS seconds,
               round(sum(seconds) / count(DISTINCT backend, workload), 3) AS seconds_each,
               sum(CASE WHEN model != 'none' THEN {_STATES} ELSE 0 END) AS states
        FROM {VIEW} GROUP BY workload_len ORDER BY workload_len""")
    result["slowest_units"] = _rows(spark, f"""
        SELECT unit, round(sum(seconds), 3) AS seconds, sum({_STATES}) AS states,
               count(DISTINCT kind, crash_point, `when`) AS crash_points
        FROM {VIEW} GROUP BY unit ORDER BY 2 DESC, unit LIMIT 15""")
    result["distinct_disks"] = _rows(spark, f"""
        SELECT backend, model, count(DISTINCT disk) AS disks
        FROM (SELECT backend, model, explode(disks) AS disk FROM {VIEW})
        GROUP BY backend, model ORDER BY backend, model""")
    result["violation_list"] = violations(spark)
    result["errors"] = [r["e"] for r in _rows(spark, f"""
        SELECT e FROM (SELECT explode(errors) AS e FROM {VIEW}) ORDER BY e LIMIT 50""")]
    result["error_count"] = _rows(spark, f"""
        SELECT count(*) AS n FROM (SELECT explode(errors) FROM {VIEW})""")[0]["n"]
    return result


def diff(spark: Any, a: Path, b: Path) -> dict[str, Any]:
    """New and fixed violations of ``b`` against ``a`` (by backend, model, clause and
    scenario id), and the state counts per model of each."""
    ta, tb = totals(spark, a), totals(spark, b)
    found = {}
    for name, path in (("a", a), ("b", b)):
        load(spark, path, f"points_{name}")
        found[name] = {(r["backend"], r["model"], r["clause"], r["scenario"]) for r in _rows(
            spark, f"""SELECT DISTINCT backend, model, v.clause AS clause,
                          v.scenario AS scenario
                       FROM (SELECT backend, model, explode(violations) AS v
                             FROM points_{name})""")}

    def listed(keys: set[tuple[str, str, str, str]]) -> list[dict[str, str]]:
        return [{"backend": k[0], "model": k[1], "clause": k[2], "scenario": k[3],
                 "reproduce": f"queue-ref crash reproduce {k[3]}"} for k in sorted(keys)]

    models = sorted(set(ta["by_model"]) | set(tb["by_model"]))
    per_model = {}
    for m in models:
        sa, sb = ta["by_model"].get(m, {}), tb["by_model"].get(m, {})
        per_model[m] = {
            key: {"a": sa.get(key, 0), "b": sb.get(key, 0),
                  "delta": sb.get(key, 0) - sa.get(key, 0)}
            for key in ("crash_points", "states", "recovery_states", "eio_states",
                        "distinct_states")}
        per_model[m]["violating_states"] = {
            "a": sum(sa.get("violations", {}).values()),
            "b": sum(sb.get("violations", {}).values())}
    return {
        "a": str(a), "b": str(b),
        "code_version": {"a": ta["code_version"], "b": tb["code_version"]},
        "backends": {"a": ta["backends"], "b": tb["backends"]},
        "new": listed(found["b"] - found["a"]),
        "fixed": listed(found["a"] - found["b"]),
        "by_model": per_model,
        "totals": {k: {"a": ta[k], "b": tb[k]} for k in (
            "workloads", "crash_points", "states", "violating_states")},
    }
