"""Collect bench_qwen.py JSON results into one Markdown table (the one bench/README.md shows).

    python bench/table.py bench/results/h100_*.json            # or a directory
    python bench/table.py bench/results --out bench/results/h100_table.md

One row per run, in the order given (a directory: by file name): device, model, engine, fusions, micro/global
batch, recompute, tokens/s, MFU, peak memory, and, where the run had ``--baseline hf``, transformers' row and the
ratio. Runs of one sweep share device, sequence length and global batch, so rows compare directly.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import List

COLUMNS = ["device", "model", "engine", "fusions", "seq", "micro / global", "recompute", "tokens/s", "MFU",
           "peak mem", "transformers tokens/s", "MFU", "peak mem", "ratio"]


def _fmt(value, kind: str) -> str:
    if value is None:
        return "—"
    return {"int": f"{value:,.0f}", "pct": f"{value:.1%}", "gib": f"{value:.1f} GiB", "x": f"{value:.2f}x"}[kind]


def row(report: dict) -> List[str]:
    ours = report["results"]["megatron_ext"]
    hf = report["results"].get("transformers", {})
    fusions = [name for key, name in (("gradient_accumulation_fusion", "wgrad"),
                                      ("cross_entropy_loss_fusion", "CE")) if report.get(key)]
    return [report["device"], str(report["model"]), report.get("engine", "megatron"), "+".join(fusions) or "none",
            str(report["seq_length"]), f"{report['micro_batch_size']} / {report['global_batch_size']}",
            report["recompute_granularity"] or "none", _fmt(ours["tokens_per_sec"], "int"), _fmt(ours["mfu"], "pct"),
            _fmt(ours["mem_peak_gib"], "gib"), _fmt(hf.get("tokens_per_sec"), "int"), _fmt(hf.get("mfu"), "pct"),
            _fmt(hf.get("mem_peak_gib"), "gib"), _fmt(report.get("ratio_tokens_per_sec"), "x")]


def grid(columns: List[str], rows: List[List[str]]) -> List[str]:
    """A Markdown table's lines (bench/gpu_check.py's tables too)."""
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(cell, columns)) + " |", "|" + " --- |" * len(columns)] + [
        "| " + " | ".join(map(cell, r)) + " |" for r in rows]


def markdown(reports: List[dict]) -> str:
    return "\n".join(grid(COLUMNS, [row(r) for r in reports]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="result JSON files or directories holding them")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    files = []
    for path in args.paths:
        files += sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    reports = []
    for path in files:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"error: {path}: not a readable JSON file ({e})")
        if "megatron_ext" in report.get("results", {}):  # skip other benchmarks' JSON in the same directory
            reports.append(report)
    if not reports:
        sys.exit(f"error: no bench_qwen.py results in {' '.join(args.paths)}; run bench/bench_qwen.py --bench-out")
    table = markdown(reports)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
