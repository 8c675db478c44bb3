"""Several training runs side by side: throughput, MFU, memory, step split and loss of each run's --log-dir, and
speedup and scaling efficiency against the run on the fewest devices, among runs that did the same work per step.

A run is its ``metrics.jsonl`` (the numbers, recomputed here with ``loggers.summarize`` so old runs compare too) and,
when there, ``summary.json``'s ``"run"`` (world size, mesh, engine, model: what the numbers alone cannot tell).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from typing import List, Optional

from megatron_ext.errors import ConfigError
from megatron_ext.observability.loggers import SPLIT, summarize

GIB = 2 ** 30
NUMERIC = ("step", "loss", "val_loss", "tokens_per_sec", "samples_per_sec", "mfu", "step_time", "mem_peak",
           *(f"{name}_time" for name in SPLIT))
GPUS_IN_NAME = re.compile(r"_(\d+)gpus?(?![a-z])", re.IGNORECASE)
MESH_ORDER = ("dp", "tp", "pp", "vpp", "cp", "ep", "etp")
RUN_INFO_KEYS = ("world_size", "mesh", "engine", "zero_stage", "zeropp", "model", "family", "device")
# Two runs did the same work per step when their tokens per step agree this closely (the product
# tokens_per_sec * step_time gives it back up to float rounding).
SAME_WORK = 1e-3


@dataclasses.dataclass
class Run:
    row: dict  # what comparison.json holds for the run
    records: List[dict]  # metrics.jsonl, for the loss curves


def split_label(arg: str) -> tuple[str, Optional[str]]:
    """``DIR`` or ``DIR:LABEL``; an existing directory whose name holds a colon stays whole."""
    if os.path.isdir(arg) or ":" not in arg:
        return arg, None
    directory, label = arg.rsplit(":", 1)
    if not directory or not label.strip():
        raise ConfigError(f"{arg!r}: expected DIR or DIR:LABEL")
    return directory, label.strip()


def read_records(directory: str) -> List[dict]:
    """metrics.jsonl's records, each checked: a bad line names its file and line number."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: no such directory (give a training run's --log-dir)")
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{directory} has no metrics.jsonl: give a training run's --log-dir, where training "
                          "writes metrics.jsonl and summary.json")
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ConfigError(f"{path} line {n}: not valid JSON ({getattr(e, 'msg', 'not UTF-8')})") from None
            if not isinstance(record, dict) or not _number(record.get("step")):
                raise ConfigError(f"{path} line {n}: expected a step's record, a JSON object with a numeric 'step'")
            bad = next((key for key in NUMERIC if record.get(key) is not None and not _number(record[key])), None)
            if bad:
                raise ConfigError(f"{path} line {n}: {bad!r} is {record[bad]!r}, not a number")
            records.append(record)
    if not records:
        raise ConfigError(f"{path} line 1: the file is empty (the run logged no step)")
    if not any("loss" in r for r in records):
        raise ConfigError(f"{path} line 1 to {n}: no training step (a record with 'loss'), only evaluations")
    return records


def read_run_info(directory: str) -> Optional[dict]:
    """summary.json's ``"run"``, or None for runs that predate it (or have no summary: a crashed run)."""
    path = os.path.join(directory, "summary.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            summary = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({getattr(e, 'msg', 'not UTF-8')}); remove it to compare "
                          "from metrics.jsonl alone") from None
    run = summary.get("run") if isinstance(summary, dict) else None
    if run is not None and not isinstance(run, dict):
        raise ConfigError(f"{path}: 'run' is {type(run).__name__}, expected an object (world_size, mesh, engine...)")
    return run


def load_run(directory: str, label: Optional[str] = None, gpus: Optional[int] = None) -> Run:
    """One run's row. World size: ``gpus`` (the --gpus flag), else summary.json's run.world_size (or mesh.world),
    else ``_<N>gpu`` in the directory's name, else unknown."""
    records = read_records(directory)
    info = read_run_info(directory) or {}
    mesh = info.get("mesh") if isinstance(info.get("mesh"), dict) else None
    world, source = gpus, "--gpus"
    if world is None:
        world, source = _int(info.get("world_size")) or _int((mesh or {}).get("world")), "run_info"
    if world is None:
        found = GPUS_IN_NAME.findall(os.path.basename(os.path.abspath(directory)))
        world, source = (int(found[-1]), "directory name") if found else (None, None)
    summary = summarize(records)
    step_time = summary["mean_step_time"]
    train = [r for r in records if "loss" in r]
    row = dict(label=label or os.path.basename(os.path.abspath(directory)), dir=directory, world_size=world,
               world_size_from=source, engine=_engine(info), mesh=_mesh(mesh, world), model=_text(info.get("model")),
               family=_text(info.get("family")), device=_text(info.get("device")), run_info=info or None,
               steps=summary["steps"], tokens_per_step=_per_step(train, "tokens_per_sec"),
               samples_per_step=_per_step(train, "samples_per_sec"), mean_step_time=step_time,
               tokens_per_sec=summary["tokens_per_sec"], samples_per_sec=summary["samples_per_sec"],
               mfu=summary["mfu"], mem_peak_gib=None if summary["mem_peak"] is None else summary["mem_peak"] / GIB,
               time_split=summary["time_split"],
               time_split_s={name: share * step_time for name, share in summary["time_split"].items()}
               if summary["time_split"] else None,
               final_loss=summary["final_loss"], min_loss=summary["min_loss"],
               final_val_loss=summary["final_val_loss"], final_val_top1=summary["final_val_top1"])
    return Run(row, records)


def load_runs(specs: List[str], gpus: Optional[List[Optional[int]]] = None) -> List[Run]:
    """Every ``DIR[:LABEL]``; labels must be unique (a clash of default names falls back to the paths given)."""
    if not specs:
        raise ConfigError("no run directories given: pass one or more training runs' --log-dir")
    if gpus is not None and len(gpus) != len(specs):
        raise ConfigError(f"--gpus gives {len(gpus)} device counts for {len(specs)} run(s): give one per run, in order")
    pairs = [split_label(spec) for spec in specs]
    seen = {}
    for directory, _ in pairs:
        real = os.path.realpath(directory)
        if real in seen:
            raise ConfigError(f"{directory}: the same run as {seen[real]}, given twice")
        seen[real] = directory
    runs = [load_run(d, label, gpus[i] if gpus else None) for i, (d, label) in enumerate(pairs)]
    names = [r.row["label"] for r in runs]
    for run, (directory, label) in zip(runs, pairs):
        if label is None and names.count(run.row["label"]) > 1:
            run.row["label"] = directory.rstrip("/") or directory
    names = [r.row["label"] for r in runs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice:
        raise ConfigError(f"label {twice!r} names two runs; give each a label of its own (DIR:LABEL)")
    return runs


def compare(runs: List[Run], baseline: Optional[str] = None) -> dict:
    """Speedup (throughput over the baseline's) and efficiency (speedup over the device ratio) for every run that
    did the baseline's work per step on the same model; the others say why not. The baseline is ``baseline`` (a
    label) or the run on the fewest devices, the first given among equals."""
    rows = [r.row for r in runs]
    if baseline is not None:
        base = next((row for row in rows if row["label"] == baseline), None)
        if base is None:
            labels = ", ".join(row["label"] for row in rows)
            raise ConfigError(f"--baseline {baseline!r} is none of the runs' labels: {labels}")
    else:
        known = [row for row in rows if row["world_size"] is not None]
        base = min(known, key=lambda row: row["world_size"]) if known else rows[0]
    metric = "tokens_per_sec" if base["tokens_per_sec"] is not None else "samples_per_sec"
    for row in rows:
        row.update(baseline=row is base, speedup=None, efficiency=None)
        row["not_comparable"] = None if row is base else _why_not(row, base, metric)
        if row["not_comparable"] is None:
            row["speedup"] = row[metric] / base[metric]
            if row["world_size"] and base["world_size"]:
                row["efficiency"] = row["speedup"] * base["world_size"] / row["world_size"]
    return dict(baseline=base["label"], speedup_metric=metric,
                comparable_when="same tokens per step (tokens_per_sec x step_time; samples when there are no tokens) "
                                "and same model and family where summary.json's run names them",
                runs=rows)


MARKDOWN_COLUMNS = ("run", "devices", "engine", "mesh", "step time (s)", "tokens/s", "samples/s", "MFU",
                    "peak mem/rank (GiB)", "final loss", "val loss", "speedup", "efficiency")


def table_cells(row: dict) -> List[str]:
    """The row as the markdown and HTML tables show it; unknown values are '?' or '-'."""
    speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
    if row["baseline"]:
        speedup += " (baseline)"
    elif row["not_comparable"]:
        speedup = f"not comparable: {row['not_comparable']}"
    return [row["label"], _fmt(row["world_size"], "{:d}", "?"), row["engine"] or "?", row["mesh"] or "?",
            _fmt(row["mean_step_time"], "{:.3f}"), _fmt(row["tokens_per_sec"], "{:,.0f}"),
            _fmt(row["samples_per_sec"], "{:,.2f}"), _fmt(row["mfu"], "{:.1%}"), _fmt(row["mem_peak_gib"], "{:.2f}"),
            _fmt(row["final_loss"], "{:.4f}"), _fmt(row["final_val_loss"], "{:.4f}"), speedup,
            _fmt(row["efficiency"], "{:.1%}")]


def markdown(result: dict) -> str:
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in table_cells(row)) + " |" for row in result["runs"]]
    base = next(row for row in result["runs"] if row["baseline"])
    lines.append(f"\nspeedup: {result['speedup_metric'].replace('_per_sec', '/s')} over {base['label']}'s "
                 f"(on {_fmt(base['world_size'], '{:d}', '?')} device(s)); efficiency: speedup / device ratio; "
                 f"comparable: {result['comparable_when']}")
    return "\n".join(lines)


def _why_not(row: dict, base: dict, metric: str) -> Optional[str]:
    """None when ``row`` did ``base``'s work per step on the same model, else the difference in a few words."""
    for key, unit in (("tokens_per_step", "tokens/step"), ("samples_per_step", "samples/step")):
        if row[key] is not None and base[key] is not None:
            if abs(row[key] - base[key]) > SAME_WORK * max(row[key], base[key]):
                return f"{row[key]:,} vs {base[key]:,} {unit}"
            break
    else:
        return "no tokens/s or samples/s to tell its work per step"
    for key in ("family", "model"):
        if row[key] and base[key] and row[key] != base[key]:
            return f"{key} {row[key]} vs {base[key]}"
    if row[metric] is None:
        return f"no {metric.replace('_per_sec', '/s')}"
    return None


def _per_step(train: List[dict], key: str) -> Optional[int]:
    """Work per step (tokens or samples) from ``key``/s x step time, the median over steps after the first."""
    steady = train[1:] or train
    values = [r[key] * r["step_time"] for r in steady if r.get(key) is not None and r.get("step_time") is not None]
    return round(statistics.median(values)) if values else None


def _mesh(mesh: Optional[dict], world: Optional[int]) -> Optional[str]:
    """``DP2 TP2+SP PP1`` and the other dimensions where they are not 1; DP from the world size when not given."""
    if not mesh:
        return None
    sizes = {key: _int(value) for key, value in mesh.items() if key not in ("world", "world_size")}
    if sizes.get("dp") is None and (_int(mesh.get("world")) or world):
        sizes["dp"] = (_int(mesh.get("world")) or world) // ((sizes.get("tp") or 1) * (sizes.get("pp") or 1)
                                                            * (sizes.get("cp") or 1))
    parts = []
    for key in (*MESH_ORDER, *sorted(set(sizes) - set(MESH_ORDER))):
        size = sizes.get(key)
        if key in ("dp", "tp", "pp") or (size is not None and size > 1):
            sp = "+SP" if key == "tp" and (mesh.get("sequence_parallel") or mesh.get("sp")) else ""
            parts.append(f"{key.upper()}{'?' if size is None else size}{sp}")
    return " ".join(parts)


def _engine(info: dict) -> Optional[str]:
    """``megatron``, ``deepspeed ZeRO-2``, ``deepspeed ZeRO-3++``: the ZeRO stage only where DeepSpeed runs it."""
    engine = _text(info.get("engine"))
    if engine and "deepspeed" in engine.lower() and info.get("zero_stage") is not None:
        engine += f" ZeRO-{info['zero_stage']}" + ("++" if info.get("zeropp") else "")
    return engine


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value) -> Optional[int]:
    return int(value) if _number(value) and math.isfinite(value) and value == int(value) else None


def _text(value) -> Optional[str]:
    return None if value is None else str(value)


def _fmt(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)
