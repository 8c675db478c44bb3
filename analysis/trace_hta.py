"""The HTA path of ``trace_analysis``: Holistic Trace Analysis views of the GPU streams, turned into the same
sections (plain dict rows) as the CPU path. Each view runs on its own, so one HTA failure costs only its section."""

from __future__ import annotations

import logging
import os
from collections import defaultdict

from analysis.traces import BUSY_REGIONS, RankTrace, region_name, rounded, run_sections


def _records(df) -> list:
    """A DataFrame as JSON-able rows (numpy scalars to Python, NaN to None)."""
    import math

    rows = []
    for rec in df.to_dict(orient="records"):
        row = {}
        for k, v in rec.items():
            v = v.item() if hasattr(v, "item") else v
            row[str(k)] = None if isinstance(v, float) and math.isnan(v) else v
        rows.append(row)
    return rows


def _ms(us) -> float | None:
    return None if us is None else float(us) / 1000.0


def analyze_hta(traces: list[RankTrace], trace_dir: str, top_n: int = 15) -> dict:
    """All HTA views on the rank files only (``trace_files``: HTA would otherwise read every json/gz in the
    directory), with ``include_last_profiler_step=True`` (its default drops the last profiled step)."""
    logging.getLogger("hta").setLevel(logging.ERROR)  # it logs every parse step as a warning
    from hta.trace_analysis import TraceAnalysis

    files = {t.rank: os.path.abspath(t.path) for t in traces}
    ta = TraceAnalysis(trace_files=files, trace_dir=os.path.abspath(trace_dir), include_last_profiler_step=True)
    ranks = sorted(files)
    cache: dict = {}

    def kernel_breakdown():
        if "kernels" not in cache:
            cache["kernels"] = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=top_n)
        return cache["kernels"]

    def annotations():
        if "annotations" not in cache:
            gpu = any(e.get("cat") == "gpu_user_annotation" for t in traces for e in t.events)
            df = ta.get_gpu_user_annotation_breakdown(use_gpu_annotation=gpu, visualize=False)
            cache["annotations"] = (gpu, [] if df is None else _records(df))
        return cache["annotations"]

    def breakdown():
        temporal = {r["rank"]: r for r in _records(ta.get_temporal_breakdown(visualize=False))}
        try:
            overlap = {r["rank"]: r.get("comp_comm_overlap_pctg")
                       for r in _records(ta.get_comm_comp_overlap(visualize=False))}
        except Exception:  # noqa: BLE001 - the temporal view is still worth having
            overlap = {}
        rows = []
        for rank, t in sorted(temporal.items()):
            pct = overlap.get(rank)
            rows.append({"rank": rank, "window_ms": _ms(t.get("kernel_time(us)")),
                         "compute_ms": _ms(t.get("compute_time(us)")),
                         "non_compute_ms": _ms(t.get("non_compute_time(us)")), "idle_ms": _ms(t.get("idle_time(us)")),
                         "compute_share": (t.get("compute_time_pctg") or 0) / 100.0,
                         "non_compute_share": (t.get("non_compute_time_pctg") or 0) / 100.0,
                         "idle_share": (t.get("idle_time_pctg") or 0) / 100.0,
                         "overlap_share": None if pct is None else pct / 100.0})
        return rows

    def kernels():
        types, _ = kernel_breakdown()
        return [{"kernel_type": r["kernel_type"], "total_ms": _ms(r["sum"]), "share": r["percentage"] / 100.0}
                for r in _records(types)]

    def kernel_rows(kind=None):
        _, metrics = kernel_breakdown()
        rows = [{"rank": r["rank"], "op": r["name"], "kernel_type": r["kernel_type"], "total_ms": _ms(r["sum (us)"]),
                 "mean_ms": _ms(r["mean (us)"]), "max_ms": _ms(r["max (us)"])} for r in _records(metrics)
                if kind is None or r["kernel_type"] == kind]
        rows.sort(key=lambda r: (r["rank"], -(r["total_ms"] or 0)))
        per_rank: dict = defaultdict(list)
        for r in rows:
            if len(per_rank[r["rank"]]) < top_n:
                per_rank[r["rank"]].append(r)
        return [r for rank in sorted(per_rank) for r in per_rank[rank]]

    def idle():
        df, _ = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
        return [{"rank": r["rank"], "stream": r["stream"], "category": r["idle_category"],
                 "idle_ms": _ms(r["idle_time"]), "share_of_idle": r["idle_time_ratio"]} for r in _records(df)]

    def regions():
        gpu, rows = annotations()
        totals: dict = defaultdict(lambda: [0, 0.0])
        for r in rows:
            name = region_name(str(r["name"]))
            if name and r.get("mean (us)"):
                totals[(r["rank"], name)][0] += round(r["sum (us)"] / r["mean (us)"])
                totals[(r["rank"], name)][1] += r["sum (us)"]
        where = "GPU" if gpu else "CPU"
        return [{"rank": rank, "region": name, "annotation": where, "count": c, "total_ms": _ms(tot),
                 "mean_ms": _ms(tot / c) if c else None} for (rank, name), (c, tot) in sorted(
                     totals.items(), key=lambda kv: (kv[0][0], -kv[1][1]))]

    def bubble():
        if not any((t.mesh.get("pp") or 1) > 1 for t in traces):
            return []
        by_rank: dict = defaultdict(dict)
        for r in regions():
            by_rank[r["rank"]][r["region"]] = r["total_ms"]
        rows = []
        for t in traces:
            got = by_rank.get(t.rank, {})
            step = got.get("Training Step")
            if not step:
                continue
            busy = sum(got.get(n, 0.0) for n in BUSY_REGIONS)
            rows.append({"rank": t.rank, "pp_rank": (t.meta.get("coords") or {}).get("pp"), "step_ms": step,
                         "busy_ms": busy, "bubble_ms": step - busy, "bubble_share": (step - busy) / step})
        return rows

    views = {"breakdown": breakdown, "kernels": kernels, "top_ops": kernel_rows,
             "comm": lambda: kernel_rows("COMMUNICATION"), "idle": idle, "regions": regions, "bubble": bubble}
    out: dict = {"analyses": {}}
    run_sections(out, views, lambda name: rounded(views[name]()))
    return out
