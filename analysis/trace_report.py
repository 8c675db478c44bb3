"""The trace analysis as files: ``report.json`` (the sections as computed) and a self-contained ``index.html``
(plots as base64 PNG data URIs, plain tables), so the report opens from a copied directory without a server."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections import defaultdict

STACKS = {"compute_ms": "compute", "comm_exposed_ms": "communication (not overlapped)",
          "non_compute_ms": "non-compute (comm + memory kernels)", "idle_ms": "idle"}
SECTION_TITLES = [
    ("breakdown", "Compute, communication and idle time per rank"),
    ("regions", "Labelled regions"),
    ("idle", "Idle time"),
    ("comm", "Communication"),
    ("top_ops", "Top operations"),
    ("bubble", "Pipeline bubble"),
    ("kernels", "GPU kernel types"),
    ("window", "Profiled window"),
]
NOTES = {
    "cpu": {
        "breakdown": "Host timeline of each rank over the profiled window (the ProfilerStep# span): compute = CPU ops "
                     "other than collectives, communication = collectives/p2p (gloo runs them on its own threads), "
                     "idle = no op on any thread. overlap = communication while another thread computes.",
        "regions": "total = inclusive time of each ## label ##; exclusive = time when it is the innermost label "
                   "(the bars). share = total / window.",
        "idle": "Idle gaps, attributed to the innermost labelled region around them.",
        "top_ops": "Self time: time an op is the innermost op on its thread.",
        "bubble": "Step time outside Forward, Backward, Optimizer Step and Data (pipeline-parallel runs).",
    },
    "hta": {
        "breakdown": "HTA temporal breakdown of the GPU timeline; overlap = HTA's compute/communication overlap.",
        "regions": "HTA user-annotation breakdown of the ## label ## regions (inclusive; nested labels overlap).",
        "idle": "HTA idle time per stream: host_wait (CPU not feeding), kernel_wait (launch gaps), other.",
        "top_ops": "Top GPU kernels per rank by total time ('others' = the rest of that type).",
        "comm": "Communication (NCCL) kernels.",
        "bubble": "Training Step time outside Forward, Backward, Optimizer Step and Data annotations.",
    },
}


def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _stacked(series: dict, ranks: list, title: str) -> str:
    """One bar per rank, one stacked colour per series (ms)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 0.6 * len(ranks) + 3.5), 3.6))
    ax = fig.add_subplot(111)
    bottom = [0.0] * len(ranks)
    x = list(range(len(ranks)))
    for label, values in series.items():
        ax.bar(x, values, bottom=bottom, label=_short(label, 40), width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, [str(r) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _png(fig)


def plot_breakdown(result: dict) -> str | None:
    rows = sorted(result.get("breakdown") or [], key=lambda r: r["rank"])
    keys = [k for k in STACKS if rows and any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    return _stacked({STACKS[k]: [r.get(k) or 0.0 for r in rows] for k in keys}, [r["rank"] for r in rows],
                    "time per rank")


def plot_regions(result: dict, most: int = 9) -> str | None:
    rows = result.get("regions") or []
    key = "exclusive_ms" if rows and all("exclusive_ms" in r for r in rows) else "total_ms"
    if key == "total_ms":  # inclusive times: the step would count everything twice
        rows = [r for r in rows if r["region"] != "Training Step"]
    if not rows:
        return None
    ranks = sorted({r["rank"] for r in rows})
    by_region: dict = defaultdict(lambda: [0.0] * len(ranks))
    for r in rows:
        name = "Training Step (in no sub-region)" if r["region"] == "Training Step" else r["region"]
        by_region[name][ranks.index(r["rank"])] += r.get(key) or 0.0
    order = sorted(by_region, key=lambda n: -sum(by_region[n]))
    series = {n: by_region[n] for n in order[:most]}
    if len(order) > most:
        series["other regions"] = [sum(by_region[n][i] for n in order[most:]) for i in range(len(ranks))]
    return _stacked(series, ranks, "regions per rank (" + key.replace("_ms", "") + " ms)")


def plot_top_ops(result: dict, most: int = 15) -> str | None:
    rows = result.get("top_ops") or []
    if not rows:
        return None
    from matplotlib.figure import Figure

    key = "self_ms" if all("self_ms" in r for r in rows) else "total_ms"
    ranks = {r["rank"] for r in rows}
    per_op: dict = defaultdict(float)
    for r in rows:
        per_op[r["op"]] += (r.get(key) or 0.0) / len(ranks)
    top = sorted(per_op, key=lambda n: -per_op[n])[:most][::-1]
    fig = Figure(figsize=(8, 0.3 * len(top) + 1.2))
    ax = fig.add_subplot(111)
    ax.barh(range(len(top)), [per_op[n] for n in top])
    ax.set_yticks(range(len(top)), [_short(n) for n in top], fontsize=7)
    ax.set_xlabel(f"{key.replace('_ms', '')} ms, mean over ranks")
    ax.set_title("top operations")
    return _png(fig)


def _cell(key: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{100 * value:.1f} %" if key.endswith("share") else f"{value:,.3f}"
    return html.escape(_short(str(value), 120))


def table(rows: list) -> str:
    if not rows:
        return "<p><i>empty</i></p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c, r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def plots_of(result: dict) -> dict:
    return {"breakdown": plot_breakdown(result), "regions": plot_regions(result), "top_ops": plot_top_ops(result)}


def render_html(result: dict, plots: dict | None = None) -> str:
    plots = plots_of(result) if plots is None else plots
    notes = NOTES.get(result.get("path"), {})
    status = "".join(f"<li>{html.escape(k)}: {html.escape(str(v))}</li>" for k, v in result["analyses"].items())
    mesh = ", ".join(f"{k}={v}" for k, v in (result.get("mesh") or {}).items()) or "unknown"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>trace report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1200px} table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right} th{background:#eee}"
        "td:nth-child(2){text-align:left} .note{color:#555;font-size:13px}</style></head><body>",
        "<h1>Trace report</h1>",
        f"<p><b>Analysis path: {html.escape(result['path'])}</b> — {html.escape(result['reason'])}</p>",
        f"<p>traces: {html.escape(str(result.get('trace_dir')))}; ranks {html.escape(str(result['ranks']))}; "
        f"device {html.escape(str(result.get('device')))}; engine {html.escape(str(result.get('engine')))}; "
        f"mesh {html.escape(mesh)}</p>",
        f"<details><summary>analyses run</summary><ul>{status}</ul></details>",
    ]
    if result.get("verdict"):
        from analysis.trace_verdict import lines

        parts.insert(2, "<div class='verdict'><h2>Verdict</h2>" + "".join(
            f"<p>{html.escape(line)}</p>" for line in lines(result["verdict"], result["path"] == "hta")) + "</div>")
    for key, title in SECTION_TITLES:
        rows = result.get(key) or []
        if not rows and key in ("bubble", "kernels"):
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if key in notes:
            parts.append(f"<p class='note'>{html.escape(notes[key])}</p>")
        if plots.get(key):
            parts.append(f"<img alt='{key}' src='{plots[key]}'>")
        parts.append(table(rows))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(result: dict, out_dir: str) -> tuple[str, str]:
    """``out_dir/report.json``, ``out_dir/index.html`` and each plot as ``<section>.png`` (for slides and docs);
    other files in ``out_dir`` are left alone."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, html_path = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "index.html")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    plots = plots_of(result)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(result, plots))
    for key, uri in plots.items():
        if uri:
            with open(os.path.join(out_dir, f"{key}.png"), "wb") as f:
                f.write(base64.b64decode(uri.split(",", 1)[1]))
    return json_path, html_path
