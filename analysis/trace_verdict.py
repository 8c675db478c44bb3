"""The first thing a trace report says: where the profiled steps' time goes, the top kernels (host operations on a
CPU trace), and the one lever to try first with the flag that pulls it. Rules, in order: a data pipeline that
holds the step, a device that idles waiting for the host (launch-bound: the first H100 runs at micro-batch 1,
``../shared/notes/gpu-facts.md``), communication on the critical path, then what the top kernel says."""

from __future__ import annotations

import re
from collections import defaultdict

DATA, IDLE, COMM = 0.10, 0.25, 0.15  # shares of the profiled window above which that part is the first lever
MATMUL_RE = re.compile(r"gemm|matmul|\bmm\b|aten::(add)?mm|aten::bmm|cutlass|xmma|nvjet|flash|attention|sdpa", re.I)
CROSS_ENTROPY_RE = re.compile(r"cross_entropy|log_softmax|nll_loss|logsumexp", re.I)
WGRAD_ADD_RE = re.compile(r"aten::add_\b|elementwise.*add", re.I)


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def shares(result: dict) -> dict:
    """Mean share of the profiled window over ranks: compute, communication (exposed on the CPU path; HTA's
    non-compute: communication and memory kernels), idle, and the ``## Data ##`` region."""
    rows = result.get("breakdown") or []
    comm = [r.get("comm_exposed_ms", r.get("non_compute_ms")) for r in rows]
    window = {r["rank"]: r.get("window_ms") for r in rows}
    data = [r["total_ms"] / window[r["rank"]] for r in result.get("regions") or []
            if r["region"] == "Data" and window.get(r["rank"])]
    return dict(compute=_mean(r.get("compute_share") for r in rows),
                communication=_mean(c / r["window_ms"] if c is not None and r.get("window_ms") else None
                                    for c, r in zip(comm, rows)),
                idle=_mean(r.get("idle_share") for r in rows), data=_mean(data))


def top_kernels(result: dict, most: int = 3) -> list:
    """The ``most`` kernels (CPU: operations by self time) with the largest time summed over ranks, with their share
    of all kernel (operation) time."""
    totals: dict = defaultdict(float)
    for row in result.get("top_ops") or []:
        totals[row["op"]] += row.get("self_ms", row.get("total_ms")) or 0.0
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:most]
    return [dict(name=name, ms=round(ms, 3), share=round(ms / whole, 4)) for name, ms in ranked]


def lever(result: dict, part: dict, top: list) -> tuple[str, str]:
    """(flag, why) of the first rule that applies."""
    mesh, engine = result.get("mesh") or {}, result.get("engine")
    if part["data"] >= DATA:
        return ("--num-workers (images) or a local --data-cache-dir (text)",
                f"building batches takes {part['data']:.0%} of the window: the step waits for data")
    if part["idle"] >= IDLE:
        return ("--micro-batch-size (larger)", f"the {'GPU' if result.get('path') == 'hta' else 'host'} idles "
                f"{part['idle']:.0%} of the window: launch-bound, fewer and larger kernels fill it")
    if part["communication"] >= COMM:
        why = f"communication on the critical path takes {part['communication']:.0%} of the window"
        if (mesh.get("tp") or 1) > 1:
            return "--tensor-model-parallel-size (smaller)", why + ": TP's collectives sit inside every layer"
        if engine == "deepspeed":
            return "--zero-stage 2 (or 1)", why + ": ZeRO-3 gathers every weight twice a step"
        return "--global-batch-size (larger)", why + ": the gradient reduction is paid once per step"
    name = top[0]["name"] if top else ""
    if CROSS_ENTROPY_RE.search(name):
        return "--cross-entropy-loss-fusion", f"the top kernel is the cross entropy ({top[0]['share']:.0%})"
    if name and not MATMUL_RE.search(name) and WGRAD_ADD_RE.search(name):
        return ("gradient-accumulation fusion (on by default: drop --no-gradient-accumulation-fusion)",
                f"the top kernel adds weight gradients into main_grad ({top[0]['share']:.0%})")
    return ("--micro-batch-size (larger, as memory allows)",
            f"compute-bound ({part['compute']:.0%} of the window), matmuls on top: larger GEMMs run closer to peak")


def verdict(result: dict) -> dict:
    part, top = shares(result), top_kernels(result)
    flag, why = lever(result, part, top)
    return dict(shares={k: round(v, 4) for k, v in part.items()}, top=top, flag=flag, why=why,
                ranks=len(result.get("breakdown") or []))


def lines(v: dict, gpu: bool) -> list:
    """The verdict as three lines of text (terminal, gpu_check.md, the top of index.html)."""
    s = v["shares"]
    what = "kernels" if gpu else "operations"
    return [f"Where the time goes (mean of {v['ranks']} rank(s)): compute {s['compute']:.0%}, communication "
            f"{s['communication']:.0%}, idle {s['idle']:.0%}; data {s['data']:.0%}",
            f"Top {what}: " + ", ".join(f"{t['name'][:60]} {t['share']:.0%}" for t in v["top"]),
            f"Try first: {v['flag']} ({v['why']})"]
