"""Where a profiled step's time goes, per rank. HTA (``pip install megatron_ext[traces]``) analyses GPU streams;
CPU runs (and machines without HTA) get the same sections computed here from the host events, because HTA's
temporal/idle views fail on traces without kernels. Every section is a list of plain dict rows (JSON-able)."""

from __future__ import annotations

import bisect
import heapq
import re
from collections import defaultdict

from analysis.trace_hta import analyze_hta
from analysis.traces import (BUSY_REGIONS, RankTrace, has_gpu_events, load_traces, region_name,
                                         rounded, run_sections)

SECTIONS = ("window", "regions", "breakdown", "comm", "idle", "top_ops", "bubble", "kernels")
# Collectives and p2p as torch records them: dispatcher ops (c10d::allreduce_, c10d::send, c10d::recv_,
# _c10d_functional::all_reduce/wait_tensor), NCCL's record_param_comms, and the backends' own spans, which are
# user_annotations (gloo:all_reduce on gloo's runloop thread, gloo:send/recv on the caller; nccl:all_reduce).
COMM_RE = re.compile(r"^(c10d::|_?c10d_functional::|record_param_comms$|(gloo|nccl|mpi|ucc|xccl|hccl):)")
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver"}
OUTSIDE = "(outside labelled regions)"


# --- interval arithmetic on sorted, disjoint [start, end) lists (µs) -------------------------------------------

def union(intervals) -> list:
    out: list = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(u) -> float:
    return sum(e - s for s, e in u)


def intersect(a, b) -> list:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list:
    return intersect(a, complement(b, a[0][0], a[-1][1])) if a else []


def complement(u, lo, hi) -> list:
    out, t = [], lo
    for s, e in u:
        if s > t:
            out.append([t, min(s, hi)])
        t = max(t, e)
    if t < hi:
        out.append([t, hi])
    return [x for x in out if x[0] < x[1]]


def innermost(items) -> list:
    """``(start, end, key)`` items that nest (mostly: Kineto's backend spans may cross an op's end) -> disjoint
    ``(start, end, key)`` segments, each owned by the innermost item covering it (the latest started)."""
    items = sorted((s, e, k) for s, e, k in items if e > s)
    points = sorted({p for s, e, _ in items for p in (s, e)})
    heap: list = []
    out, i = [], 0
    for a, b in zip(points, points[1:]):
        while i < len(items) and items[i][0] <= a:
            heapq.heappush(heap, (-items[i][0], items[i][1], i))
            i += 1
        while heap and heap[0][1] <= a:
            heapq.heappop(heap)
        if heap:
            key = items[heap[0][2]][2]
            if out and out[-1][2] == key and out[-1][1] == a:
                out[-1] = (out[-1][0], b, key)
            else:
                out.append((a, b, key))
    return out


def attribute(gaps, segments, default: str) -> dict:
    """ms of each gap that falls in each labelled segment (the rest under ``default``)."""
    starts = [s for s, _, _ in segments]
    out: dict = defaultdict(float)
    for gs, ge in gaps:
        t = gs
        j = max(bisect.bisect_right(starts, gs) - 1, 0)
        while t < ge:
            if j < len(segments) and segments[j][1] <= t:
                j += 1
                continue
            if j < len(segments) and segments[j][0] <= t:
                end = min(ge, segments[j][1])
                out[segments[j][2]] += end - t
            else:
                end = min(ge, segments[j][0]) if j < len(segments) else ge
                out[default] += end - t
            t = end
    return {k: v / 1000.0 for k, v in out.items()}


# --- per-rank views --------------------------------------------------------------------------------------------

def _spans(trace: RankTrace) -> list:
    """Complete ('X') events with a numeric time and duration, the profiler's own span markers left out."""
    return [e for e in trace.events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float)) and e.get("cat") != "Trace"]


def window_of(spans: list) -> tuple[float, float, list]:
    """The profiled window: the span of ``ProfilerStep#N`` events (the whole trace if there are none)."""
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    chosen = steps or spans
    lo = min((e["ts"] for e in chosen), default=0.0)
    hi = max((e["ts"] + e["dur"] for e in chosen), default=0.0)
    numbers = sorted(int(e["name"].split("#", 1)[1]) for e in steps if e["name"].split("#", 1)[1].isdigit())
    return lo, hi, numbers


def _clip(e, lo, hi):
    return max(e["ts"], lo), min(e["ts"] + e["dur"], hi)


def cpu_rank(trace: RankTrace, top_n: int = 15) -> dict:
    """Every CPU-path section for one rank; times in ms, shares of the profiled window."""
    r, spans = trace.rank, _spans(trace)
    lo, hi, steps = window_of(spans)
    win = max(hi - lo, 1e-9)
    inside = [e for e in spans if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    labelled = [(e, region_name(e["name"])) for e in inside if e.get("cat") in ("user_annotation", None)]
    labelled = [(e, n) for e, n in labelled if n]
    comm = [e for e in inside if COMM_RE.match(e["name"])]
    ops = [e for e in inside if e.get("cat") in HOST_CATS and not COMM_RE.match(e["name"])]
    segments = innermost([(*_clip(e, lo, hi), n) for e, n in labelled])
    seg_starts = [s for s, _, _ in segments]

    def region_at(t):
        j = bisect.bisect_right(seg_starts, t) - 1
        return segments[j][2] if j >= 0 and segments[j][1] > t else OUTSIDE

    out: dict = {"window": cpu_window(trace)}
    # regions: inclusive time per label (clipped to the window) and exclusive (innermost) time
    totals: dict = defaultdict(lambda: [0, 0.0])
    for e, n in labelled:
        s, t = _clip(e, lo, hi)
        totals[n][0] += 1
        totals[n][1] += t - s
    exclusive: dict = defaultdict(float)
    for s, t, n in segments:
        exclusive[n] += t - s
    exclusive[OUTSIDE] = win - sum(exclusive.values())
    out["regions"] = [{"rank": r, "region": n, "count": c, "total_ms": tot / 1000.0, "mean_ms": tot / c / 1000.0,
                       "exclusive_ms": exclusive[n] / 1000.0, "share": tot / win}
                      for n, (c, tot) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    if exclusive[OUTSIDE] > 0:
        out["regions"].append({"rank": r, "region": OUTSIDE, "count": 0, "total_ms": exclusive[OUTSIDE] / 1000.0,
                               "mean_ms": None, "exclusive_ms": exclusive[OUTSIDE] / 1000.0,
                               "share": exclusive[OUTSIDE] / win})
    # comm vs compute vs idle: compute = host ops minus any collective running on the same thread
    by_tid_comm, by_tid_ops = defaultdict(list), defaultdict(list)
    for e in comm:
        by_tid_comm[e.get("tid")].append(_clip(e, lo, hi))
    for e in ops:
        by_tid_ops[e.get("tid")].append(_clip(e, lo, hi))
    comm_t = {t: union(v) for t, v in by_tid_comm.items()}
    comp_t = {t: subtract(union(v), comm_t.get(t, [])) for t, v in by_tid_ops.items()}
    u_comm = union([x for v in comm_t.values() for x in v])
    u_comp = union([x for v in comp_t.values() for x in v])
    busy = union(u_comm + u_comp)
    overlap = union([x for t, c in comm_t.items()
                     for x in intersect(c, union([y for t2, v in comp_t.items() if t2 != t for y in v]))])
    comm_ms, idle_gaps = length(u_comm) / 1000.0, complement(busy, lo, hi)
    out["breakdown"] = [{"rank": r, "window_ms": win / 1000.0, "compute_ms": length(u_comp) / 1000.0,
                         "comm_ms": comm_ms, "comm_exposed_ms": length(subtract(u_comm, u_comp)) / 1000.0,
                         "idle_ms": length(idle_gaps) / 1000.0, "overlap_ms": length(overlap) / 1000.0,
                         "overlap_share": length(overlap) / 1000.0 / comm_ms if comm_ms else None,
                         "compute_share": length(u_comp) / win, "comm_share": length(u_comm) / win,
                         "idle_share": length(idle_gaps) / win}]
    per_op: dict = defaultdict(lambda: [0, 0.0])
    for e in comm:
        s, t = _clip(e, lo, hi)
        key = (e["name"], region_at(s))
        per_op[key][0] += 1
        per_op[key][1] += t - s
    out["comm"] = [{"rank": r, "op": op, "region": reg, "count": c, "total_ms": tot / 1000.0,
                    "mean_ms": tot / c / 1000.0} for (op, reg), (c, tot) in sorted(per_op.items(),
                                                                                   key=lambda kv: -kv[1][1])]
    idle = attribute(idle_gaps, segments, OUTSIDE)
    total_idle = sum(idle.values()) or 1e-9
    out["idle"] = [{"rank": r, "region": n, "idle_ms": ms, "share_of_idle": ms / total_idle,
                    "share_of_window": ms * 1000.0 / win} for n, ms in sorted(idle.items(), key=lambda kv: -kv[1])]
    out["top_ops"] = _top_ops(r, ops + comm, lo, hi, top_n)
    out["bubble"] = _bubble(trace, labelled, lo, hi)
    out["kernels"] = []
    return out


def _top_ops(rank: int, ops: list, lo: float, hi: float, top_n: int) -> list:
    """Self time = time an op is the innermost op on its thread."""
    by_tid = defaultdict(list)
    for i, e in enumerate(ops):
        by_tid[e.get("tid")].append((*_clip(e, lo, hi), i))
    self_us: dict = defaultdict(float)
    for items in by_tid.values():
        for s, t, i in innermost(items):
            self_us[ops[i]["name"]] += t - s
    stats: dict = defaultdict(lambda: [0, 0.0])
    for e in ops:
        s, t = _clip(e, lo, hi)
        stats[e["name"]][0] += 1
        stats[e["name"]][1] += t - s
    total_self = sum(self_us.values()) or 1e-9
    ranked = sorted(stats, key=lambda n: -self_us[n])[:top_n]
    return [{"rank": rank, "op": n, "count": stats[n][0], "self_ms": self_us[n] / 1000.0,
             "total_ms": stats[n][1] / 1000.0, "self_share": self_us[n] / total_self} for n in ranked]


def _bubble(trace: RankTrace, labelled: list, lo: float, hi: float) -> list:
    """Pipeline runs only: the share of step time in none of Forward/Backward/Optimizer Step/Data."""
    if (trace.mesh.get("pp") or 1) <= 1:
        return []
    steps = union([_clip(e, lo, hi) for e, n in labelled if n == "Training Step"])
    if not steps:
        steps = [[lo, hi]]
    busy = intersect(union([_clip(e, lo, hi) for e, n in labelled if n in BUSY_REGIONS]), steps)
    step_ms, busy_ms = length(steps) / 1000.0, length(busy) / 1000.0
    return [{"rank": trace.rank, "pp_rank": (trace.meta.get("coords") or {}).get("pp"), "step_ms": step_ms,
             "busy_ms": busy_ms, "bubble_ms": step_ms - busy_ms,
             "bubble_share": (step_ms - busy_ms) / step_ms if step_ms else None}]


def analyze_cpu(traces: list[RankTrace], top_n: int = 15) -> dict:
    """The CPU path: every section computed from the host events of every rank."""
    out: dict = {"analyses": {}}
    per_rank: dict = {}
    for t in traces:
        try:
            per_rank[t.rank] = cpu_rank(t, top_n)
        except Exception as e:  # noqa: BLE001 - record and keep the other ranks
            out["analyses"][f"rank {t.rank}"] = f"failed: {type(e).__name__}: {e}"
    run_sections(out, SECTIONS, lambda name: rounded([row for v in per_rank.values() for row in v[name]]))
    if not out["kernels"]:
        out["analyses"]["kernels"] = "n/a (no GPU kernels, or HTA not used)"
    return out


def hta_available() -> str | None:
    """The HTA version when ``import hta`` works, else None."""
    try:
        import hta  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is the same as none
        return None
    from importlib import metadata
    for dist in ("traceinsight", "holistictraceanalysis"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "hta (version unknown)"


def analyze(trace_dir: str, use_hta: bool = True, top_n: int = 15) -> dict:
    """Analyse a directory of per-rank traces: the HTA path when ``hta`` imports and the traces hold GPU kernels
    (unless ``use_hta=False``), else the CPU path; ``path`` and ``reason`` in the result say which ran and why."""
    traces = load_traces(trace_dir)
    gpu, version = has_gpu_events(traces), hta_available()
    result: dict = {"trace_dir": trace_dir, "ranks": [t.rank for t in traces], "mesh": traces[0].mesh,
                    "device": traces[0].meta.get("device") or ("cuda" if gpu else "cpu"),
                    "engine": traces[0].meta.get("engine")}
    if not use_hta:
        reason = "CPU path requested"
    elif not gpu:
        reason = "the traces hold no GPU kernels (HTA analyses GPU streams)"
    elif version is None:
        reason = "HTA is not installed (pip install 'megatron_ext[traces]')"
    else:
        try:
            sections = analyze_hta(traces, trace_dir, top_n)
        except Exception as e:  # noqa: BLE001 - HTA could not even load them: fall back, saying why
            reason = f"HTA ({version}) failed to load the traces: {type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            windows = rounded([row for t in traces for row in cpu_window(t)])
            span = {w["rank"]: w["window_ms"] for w in windows}
            for row in sections["regions"]:
                row["share"] = round(row["total_ms"] / span[row["rank"]], 4) if span.get(row["rank"]) else None
            return _with_verdict({"path": "hta", "reason": f"{version}, GPU kernels in the traces", **result,
                                  **sections, "window": windows})
    return _with_verdict({"path": "cpu", "reason": reason, **result, **analyze_cpu(traces, top_n)})


def _with_verdict(result: dict) -> dict:
    from analysis.trace_verdict import verdict

    return {**result, "verdict": verdict(result)}


def cpu_window(trace: RankTrace) -> list:
    lo, hi, steps = window_of(_spans(trace))
    return [{"rank": trace.rank, "first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None,
             "steps": len(steps), "window_ms": (hi - lo) / 1000.0}]
