"""The campaign report: one self-contained HTML page, its plots inline SVG (matplotlib).

``render(summary)`` takes ``campaign_sql.summary``'s dict and returns the page: the totals
(under the keys of ``crash explore --json``), states per backend x model (plot and
table), violations per clause, time per workload length (plot), the slowest units,
distinct disks, crash points sampled rather than exhaustive, and every violation with
the command that replays it on one machine.
"""

from __future__ import annotations

import html
import io
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

#: Violations listed in full on the page (all of them are in the JSON summary).
LISTED = 300


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def states_plot(rows: list[dict[str, Any]]) -> str:
    labels = [f"{r['backend']}\n{r['model']}" for r in rows]
    fig = Figure(figsize=(max(5.0, 1.1 * len(rows) + 2), 3.6))
    ax = fig.subplots()
    xs = range(len(rows))
    ax.bar(xs, [r["states"] for r in rows], color="#4878a8", label="states judged")
    ax.bar(xs, [r["violating_states"] for r in rows], color="#c0392b", label="violating")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("states")
    # whole numbers with separators: matplotlib's "1e7" offset label sits under the title
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.set_title("States per backend and persistence model")
    ax.legend(fontsize=8)
    return _svg(fig)


def time_plot(rows: list[dict[str, Any]]) -> str:
    fig = Figure(figsize=(5.5, 3.4))
    ax = fig.subplots()
    xs = [r["workload_len"] for r in rows]
    ax.bar(xs, [r["seconds_each"] for r in rows], color="#5b9a68")
    ax.set_xlabel("workload length (operations)")
    ax.set_ylabel("seconds per workload (executor time)")
    ax.set_title("Time per workload")
    ax.set_xticks(xs)
    return _svg(fig)


def clause_plot(rows: list[dict[str, Any]]) -> str:
    per: dict[str, int] = {}
    for r in rows:
        per[r["clause"]] = per.get(r["clause"], 0) + r["states"]
    fig = Figure(figsize=(5.5, 3.4))
    ax = fig.subplots()
    names = sorted(per, key=lambda c: (int(c[1:]) if c[1:].isdigit() else 99, c))
    ax.bar(names, [per[c] for c in names], color="#c0392b")
    ax.set_ylabel("violating states")
    ax.set_title("Violations per clause")
    return _svg(fig)


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>"
                                    for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 1150px; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #eee; }
.bad { color: #c0392b; font-weight: bold; } .ok { color: #2e7d32; font-weight: bold; }
code { background: #f4f4f4; padding: 1px 4px; font-size: 12px; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; } .plots svg { max-width: 100%; height: auto; }
"""


def render(s: dict[str, Any]) -> str:
    e = html.escape
    verdict = (f'<span class="bad">{s["violating_states"]} violating states</span>'
               if s["violating_states"] else '<span class="ok">no violations</span>')
    totals = [{"key": k, "value": s[k]} for k in (
        "workloads", "crash_points", "rest_points", "eio_points", "states",
        "distinct_states", "violating_states", "exhaustive_points", "sampled_points",
        "seconds")]
    model_rows = [{"model": m, **{k: v for k, v in st.items() if k != "violations"},
                   "violations": ", ".join(f"{c}: {n}" for c, n in st["violations"].items())
                   or "none"} for m, st in s["by_model"].items()]
    plots = [states_plot(s["per_backend_model"]) if s["per_backend_model"] else "",
             time_plot(s["per_workload_length"]) if s["per_workload_length"] else ""]
    if s["per_clause"]:
        plots.append(clause_plot(s["per_clause"]))
    first: dict[str, dict[str, Any]] = {}
    for v in s["violation_list"]:
        for c in v["clauses"]:
            first.setdefault(c, v)
    shortest = "".join(
        f"<li><b>{e(c)}</b> ({e(v['backend'])}, {e(v['model'])}): "
        f"<code>{e(v['reproduce'])}</code><br>{e(v['detail'])}</li>"
        for c, v in sorted(first.items()))
    listed = "".join(
        f"<tr><td>{e(', '.join(v['clauses']))}</td><td>{e(v['backend'])}</td>"
        f"<td>{e(v['model'])}</td><td>{e(v['kind'])} {e(v['when'])} #{v['crash_point']}</td>"
        f"<td><code>{e(v['reproduce'])}</code></td></tr>"
        for v in s["violation_list"][:LISTED])
    more = (f"<p>{len(s['violation_list']) - LISTED} more in the JSON summary.</p>"
            if len(s["violation_list"]) > LISTED else "")
    errors = ("".join(f"<li>{e(x)}</li>" for x in s["errors"]) or "<li>none</li>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>queue-ref crash campaign</title>
<style>{CSS}</style></head><body>
<h1>Crash campaign: {e(', '.join(s['backends']))}</h1>
<p>Models {e(', '.join(s['models']))}; bound {s['bound']}{
f", bound {s['after_life']} after a whole life" if s['after_life'] >= 0 else ""}{
f", {s['random']} random workload{'s' if s['random'] != 1 else ''} of "
f"{s['random_length']} calls from seed {s['seed']}"
 if s['random'] else ""}; exhaustive limit {s['exhaustive_limit']} pending operations;
code {e(s['code_version'])}. Verdict: {verdict}.</p>
<h2>Totals</h2>{_table(totals, ["key", "value"])}
<h2>Per model</h2>{_table(model_rows, ["model", "crash_points", "states", "recovery_states",
                                       "eio_states", "distinct_states", "exhaustive_points",
                                       "sampled_points", "violations"])}
<div class="plots">{''.join(plots)}</div>
<h2>Per backend and model</h2>{_table(s["per_backend_model"], [
    "backend", "model", "crash_points", "states", "violating_states", "sampled_points",
    "seconds"])}
<h2>Violations per clause</h2>{_table(s["per_clause"], ["backend", "model", "clause",
                                                         "states"])}
<h2>Violations: the shortest of each clause</h2><ul>{shortest or "<li>none</li>"}</ul>
<h2>Every violating state</h2>
<table><tr><th>clauses</th><th>backend</th><th>model</th><th>crash point</th>
<th>replay on one machine</th></tr>{listed}</table>{more}
<h2>Time per workload length</h2>{_table(s["per_workload_length"], [
    "workload_len", "workloads", "seconds", "seconds_each", "states"])}
<h2>Slowest units</h2>{_table(s["slowest_units"], ["unit", "seconds", "states",
                                                  "crash_points"])}
<h2>Distinct disk images</h2>{_table(s["distinct_disks"], ["backend", "model", "disks"])}
<h2>Cases that could not be built ({s['error_count']})</h2><ul>{errors}</ul>
</body></html>
"""
