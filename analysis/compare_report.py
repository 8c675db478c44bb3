"""The run comparison as files: ``comparison.json``, one PNG per plot and a self-contained ``index.html`` (the same
PNGs as base64 data URIs), so the report opens from a copied directory without a server. Matplotlib's Agg canvas
draws without a display and leaves pyplot's global backend alone."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from typing import Callable, Dict, List, Optional

from analysis.compare import MARKDOWN_COLUMNS, Run, table_cells
from megatron_ext.observability.loggers import SPLIT

PLOTS = (("throughput", "Throughput vs devices"), ("scaling", "Speedup and scaling efficiency vs devices"),
         ("time_split", "Time per step, split"), ("memory", "Peak memory per rank"), ("mfu", "MFU"),
         ("loss", "Loss curves"))


def _figure(width: float, height: float, columns: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, columns)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _colour(rows: List[dict], row: dict) -> str:
    """One colour per run in every plot."""
    return f"C{rows.index(row) % 10}"


def _devices_axis(ax, worlds: List[int]) -> None:
    """Device counts on a log2 axis (1, 2, 4, 8 evenly spaced), ticks at the counts there are."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(worlds)), [str(w) for w in sorted(set(worlds))])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("devices")


def _points(ax, rows: List[dict], all_rows: List[dict], key: str) -> None:
    """A marker per run, labelled; the comparable ones joined in device order."""
    comparable = sorted((r for r in rows if r["not_comparable"] is None), key=lambda r: r["world_size"])
    if len(comparable) > 1:
        ax.plot([r["world_size"] for r in comparable], [r[key] for r in comparable], "-", color="0.6", zorder=1)
    for r in rows:
        hollow = r["not_comparable"] is not None
        ax.scatter([r["world_size"]], [r[key]], s=45, zorder=2, color=_colour(all_rows, r),
                   facecolors="none" if hollow else None, label=r["label"] + (" (not comparable)" if hollow else ""))


def plot_throughput(result: dict) -> Optional[bytes]:
    """Throughput of every run with a known device count; ideal scaling is the baseline's times the device ratio."""
    metric = result["speedup_metric"]
    rows = [r for r in result["runs"] if r["world_size"] and r[metric] is not None]
    if not rows:
        return None
    fig, ax = _figure(6.5, 4.2)
    base = next(r for r in result["runs"] if r["baseline"])
    worlds = [r["world_size"] for r in rows]
    if base in rows:
        xs = sorted(set(worlds + [base["world_size"]]))
        ax.plot(xs, [base[metric] * w / base["world_size"] for w in xs], "--", color="0.4", label="ideal scaling")
    _points(ax, rows, result["runs"], metric)
    _devices_axis(ax, worlds)
    ax.set(ylabel=metric.replace("_per_sec", "/s"), title="throughput vs devices")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _png(fig)


def plot_scaling(result: dict) -> Optional[bytes]:
    """Speedup (ideal: the device ratio) and efficiency (ideal: 1) of the runs comparable with the baseline."""
    rows = [r for r in result["runs"] if r["efficiency"] is not None]
    if not rows:
        return None
    base = next(r for r in result["runs"] if r["baseline"])
    fig, (speed_ax, eff_ax) = _figure(11, 4.2, 2)
    worlds = [r["world_size"] for r in rows]
    xs = sorted(set(worlds))
    speed_ax.plot(xs, [w / base["world_size"] for w in xs], "--", color="0.4", label="ideal")
    eff_ax.axhline(1.0, linestyle="--", color="0.4", label="ideal")
    _points(speed_ax, rows, result["runs"], "speedup")
    _points(eff_ax, rows, result["runs"], "efficiency")
    for ax, name in ((speed_ax, "speedup"), (eff_ax, "scaling efficiency")):
        _devices_axis(ax, worlds)
        ax.set(ylabel=name, title=f"{name} vs {base['label']}")
        ax.legend(fontsize=8)
    speed_ax.set_ylim(bottom=0)
    eff_ax.set_ylim(0, max(1.1, *(r["efficiency"] * 1.05 for r in rows)))
    return _png(fig)


def _bars(rows: List[dict], values: List[Optional[float]], ylabel: str, title: str, fmt: str) -> bytes:
    """One bar per run, its value written above it ('n/a' where unknown)."""
    fig, ax = _figure(max(5.0, 0.9 * len(rows) + 2.5), 4.0)
    x = list(range(len(rows)))
    ax.bar(x, [v or 0.0 for v in values], color=[_colour(rows, r) for r in rows])
    for i, value in enumerate(values):
        ax.annotate("n/a" if value is None else fmt.format(value), (i, value or 0.0), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20 if len(rows) > 4 else 0, ha="right" if len(rows) > 4
                  else "center")
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.12)
    return _png(fig)


def plot_time_split(result: dict) -> Optional[bytes]:
    """Mean step time per run, stacked by the step's parts (the whole step where a run has no split)."""
    rows = [r for r in result["runs"] if r["mean_step_time"] is not None]
    if not rows:
        return None
    fig, ax = _figure(max(6.0, 0.9 * len(rows) + 4.0), 4.2)
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for i, (name, label) in enumerate(SPLIT.items()):
        heights = [(r["time_split_s"] or {}).get(name) or 0.0 for r in rows]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, label=label, color=f"C{i}")
            bottom = [b + h for b, h in zip(bottom, heights)]
    unsplit = [0.0 if r["time_split_s"] else r["mean_step_time"] for r in rows]
    if any(unsplit):
        ax.bar(x, unsplit, bottom=bottom, label="step (no split recorded)", color="0.7")
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20 if len(rows) > 4 else 0)
    ax.set(ylabel="seconds per step (mean after step 1)", title="time per step")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _png(fig)


def plot_memory(result: dict) -> Optional[bytes]:
    rows = result["runs"]
    if all(r["mem_peak_gib"] is None for r in rows):
        return None
    return _bars(rows, [r["mem_peak_gib"] for r in rows], "GiB", "peak memory (logging rank)", "{:.2f}")


def plot_mfu(result: dict) -> Optional[bytes]:
    rows = result["runs"]
    if all(r["mfu"] is None for r in rows):
        return None
    return _bars(rows, [None if r["mfu"] is None else 100 * r["mfu"] for r in rows], "% of peak FLOP/s", "MFU",
                 "{:.1f}%")


def plot_loss(result: dict, runs: List[Run]) -> Optional[bytes]:
    """Train loss against step, overlaid; validation loss as points in the run's colour."""
    fig, ax = _figure(8, 4.5)
    drawn = validated = False
    for run in runs:
        colour = _colour(result["runs"], run.row)
        train = [(r["step"], r["loss"]) for r in run.records if r.get("loss") is not None and math.isfinite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in run.records if r.get("val_loss") is not None]
        if train:
            ax.plot(*zip(*train), color=colour, label=run.row["label"])
        if val:
            ax.plot(*zip(*val), "o", color=colour)
        drawn = drawn or bool(train or val)
        validated = validated or bool(val)
    if not drawn:
        return None
    if validated:
        ax.plot([], [], "o", color="0.4", label="validation (points)")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend(fontsize=8)
    return _png(fig)


def _sizes(result: dict) -> set:
    """The runs' known device counts: with one (or none), a scaling chart would be a dot per run."""
    return {r["world_size"] for r in result["runs"] if r["world_size"]}


def _one_size(result: dict) -> bool:
    return len(_sizes(result)) <= 1


def render_plots(result: dict, runs: List[Run]) -> Dict[str, Optional[bytes]]:
    makers: Dict[str, Callable[[], Optional[bytes]]] = dict(
        throughput=lambda: None if _one_size(result) else plot_throughput(result),
        scaling=lambda: None if _one_size(result) else plot_scaling(result),
        time_split=lambda: plot_time_split(result), memory=lambda: plot_memory(result),
        mfu=lambda: plot_mfu(result), loss=lambda: plot_loss(result, runs))
    return {name: makers[name]() for name, _ in PLOTS}


SKIPPED = dict(throughput="no run has a known device count (summary.json's run.world_size, --gpus, or _<N>gpu in "
                          "the directory name) and a throughput",
               scaling="no run with a known device count is comparable with the baseline",
               time_split="no step times", memory="no run recorded mem_peak",
               mfu="no run recorded MFU (it needs a known device peak: --peak-tflops or a known GPU)",
               loss="no finite loss")


def why_not(name: str, result: dict) -> str:
    sizes = _sizes(result)
    if name in ("throughput", "scaling") and len(sizes) == 1:
        return f"every run is on {sizes.pop()} device(s): nothing to scale (give runs on other device counts)"
    return SKIPPED[name]


def render_html(result: dict, plots: Dict[str, Optional[bytes]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in (*MARKDOWN_COLUMNS, "tokens/step", "model", "device",
                                                              "step split"))
    body = []
    for row in result["runs"]:
        split = ", ".join(f"{SPLIT[k]} {v:.0%}" for k, v in (row["time_split"] or {}).items() if v >= 0.005)
        extra = [f"{row['tokens_per_step']:,}" if row["tokens_per_step"] is not None else "-",
                 "/".join(x for x in (row["family"], row["model"]) if x) or "?", row["device"] or "?", split or "-"]
        style = " class='base'" if row["baseline"] else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in table_cells(row) + extra)
                    + "</tr>")
    base = next(r for r in result["runs"] if r["baseline"])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>run comparison</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1300px} table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right} th{background:#eee}"
        "td:first-child{text-align:left} tr.base{background:#eef6ee} .note{color:#555;font-size:13px}"
        "</style></head><body>",
        "<h1>Run comparison</h1>",
        f"<p class='note'>Baseline: <b>{html.escape(base['label'])}</b> "
        f"(on {html.escape(str(base['world_size'] or '?'))} device(s)). Speedup = "
        f"{html.escape(result['speedup_metric'].replace('_per_sec', '/s'))} over the baseline's; efficiency = "
        f"speedup / device ratio. Comparable: {html.escape(result['comparable_when'])}. Speeds and step times are "
        "means over steps after the first (warm-up); peak memory is the logging rank's (last pipeline stage, "
        "first TP/CP/DP rank).</p>",
        f"<table><tr>{head}</tr>{''.join(body)}</table>",
    ]
    for name, title in PLOTS:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if plots.get(name):
            uri = "data:image/png;base64," + base64.b64encode(plots[name]).decode("ascii")
            parts.append(f"<img alt='{name}' src='{uri}'>")
        else:
            parts.append(f"<p class='note'>not drawn: {html.escape(why_not(name, result))}</p>")
    sources = "".join(f"<li>{html.escape(r['label'])}: {html.escape(os.path.abspath(r['dir']))}</li>"
                      for r in result["runs"])
    parts.append(f"<h2>Runs</h2><ul class='note'>{sources}</ul></body></html>")
    return "\n".join(parts)


def _finite(obj):
    """Strict JSON: NaN and infinities (json.loads reads them from a metrics file) become null."""
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite(value) for value in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def write_report(result: dict, runs: List[Run], out_dir: str) -> str:
    """``out_dir/comparison.json``, ``index.html`` and ``<plot>.png`` for each plot drawn (``result["plots"]`` says
    which, and why the others were not); other files in ``out_dir`` are left alone. Returns index.html's path."""
    plots = render_plots(result, runs)
    result["plots"] = {name: f"{name}.png" if png else None for name, png in plots.items()}
    result["not_drawn"] = {name: why_not(name, result) for name, png in plots.items() if not png}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "comparison.json"), "w") as f:
        json.dump(_finite(result), f, indent=1)
        f.write("\n")
    for name, png in plots.items():
        if png:
            with open(os.path.join(out_dir, f"{name}.png"), "wb") as f:
                f.write(png)
    html_path = os.path.join(out_dir, "index.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(result, plots))
    return html_path
