"""Per-rank torch.profiler traces (``rank{r}_trace.json[.gz]``): loading them by rank and merging them into one
Chrome/Perfetto trace with one process row per rank. Pure json/gzip, so it runs anywhere the traces are copied to."""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import json
import os
import re
import zlib
from typing import Any, Callable

from megatron_ext.errors import ConfigError

PATTERNS = ("rank*_trace.json", "rank*_trace.json.gz")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
RANK_STRIDE = 100  # new pid = rank * RANK_STRIDE + row: rows sort by rank, then CPU before GPU 0, 1, ...
# The labels megatron_ext puts on profiled regions (``## Training Step 12 ##``), and what a busy rank is in.
LABEL_RE = re.compile(r"^## (.+?) ##$")
BUSY_REGIONS = ("Forward", "Backward", "Optimizer Step", "Data")  # pipeline bubble = step time outside these


@dataclasses.dataclass
class RankTrace:
    """One rank's trace file, parsed."""

    rank: int
    path: str
    data: dict

    @property
    def events(self) -> list:
        return self.data["traceEvents"]

    @property
    def meta(self) -> dict:
        """Our own metadata (mesh, coords, device, engine, steps); empty for a trace written by someone else."""
        meta = self.data.get("megatron_ext")
        return meta if isinstance(meta, dict) else {}

    @property
    def mesh(self) -> dict:
        return self.meta.get("mesh") or {}

    def label(self) -> str:
        """``rank 3 (tp1 pp0 dp1)``: where the rank sits in the mesh, when the trace says."""
        coords = self.meta.get("coords") or {}
        keys = ["tp", "pp", "dp"] + [k for k in ("cp", "ep") if (self.mesh.get(k) or 1) > 1 or coords.get(k)]
        where = " ".join(f"{k}{coords[k]}" for k in keys if k in coords)
        return f"rank {self.rank} ({where})" if where else f"rank {self.rank}"


def is_trace_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in PATTERNS)


def read_trace(path: str) -> dict:
    """One trace file as a dict; a truncated or corrupt file is a one-line error naming it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"trace file {path}: cannot read it ({e.strerror or e})")
    try:
        if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the name says
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise ConfigError(f"trace file {path}: truncated or corrupt gzip ({e})")
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"trace file {path}: not valid JSON, truncated? ({str(e).splitlines()[0]})")
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"trace file {path}: no 'traceEvents' list; is it a torch.profiler Chrome trace?")
    return data


def rank_of(data: dict, path: str) -> int:
    """distributedInfo (torch writes it when a process group exists), else our metadata, else the file name."""
    for key in ("distributedInfo", "megatron_ext"):
        info = data.get(key)
        if isinstance(info, dict) and isinstance(info.get("rank"), int):
            return info["rank"]
    m = re.search(r"rank(\d+)", os.path.basename(path))
    if not m:
        raise ConfigError(f"trace file {path}: cannot tell its rank (no distributedInfo.rank, no rank<N> in the name)")
    return int(m.group(1))


def load_traces(trace_dir: str) -> list[RankTrace]:
    """Every ``rank*_trace.json[.gz]`` in ``trace_dir``, sorted by rank; other files are ignored."""
    if not os.path.isdir(trace_dir):
        raise ConfigError(f"trace directory {trace_dir} does not exist")
    names = sorted(n for n in os.listdir(trace_dir) if is_trace_file(n))
    if not names:
        raise ConfigError(f"trace directory {trace_dir} holds no trace files (expected rank<N>_trace.json[.gz])")
    by_rank: dict[int, RankTrace] = {}
    for name in names:
        path = os.path.join(trace_dir, name)
        data = read_trace(path)
        rank = rank_of(data, path)
        if rank in by_rank:
            raise ConfigError(f"trace files {by_rank[rank].path} and {path} both hold rank {rank}")
        by_rank[rank] = RankTrace(rank, path, data)
    return [by_rank[r] for r in sorted(by_rank)]


def outside(path: str, trace_dir: str, flag: str) -> str:
    """``path``, refused when it lies in ``trace_dir``: HTA reads every json/gz file there (and so would we)."""
    root, target = os.path.realpath(trace_dir), os.path.realpath(path)
    if os.path.commonpath([root, target]) == root:
        raise ConfigError(f"{flag} {path} is inside the trace directory {trace_dir}; write it elsewhere "
                          f"(HTA reads every json/gz file in that directory)")
    return path


def has_gpu_events(traces: list[RankTrace]) -> bool:
    return any(e.get("cat") == "kernel" for t in traces for e in t.events)


def _rows(trace: RankTrace) -> dict:
    """old pid -> (row index, 'CPU' | 'GPU n'): the CPU process first, then devices; Kineto's 'Spans' pid (the
    profiler's own span markers) joins the CPU row, pids that only carry metadata get no row."""
    labels = {e.get("pid"): str(e.get("args", {}).get("labels", "")) for e in trace.events
              if e.get("ph") == "M" and e.get("name") == "process_labels"}
    used = list(dict.fromkeys(e.get("pid") for e in trace.events if e.get("ph") != "M"))
    gpu = {e.get("pid") for e in trace.events if e.get("cat") in GPU_CATS}
    gpu = [p for p in used if p in gpu or labels.get(p, "").startswith("GPU")]
    cpu = sorted(p for p in used if p not in gpu and isinstance(p, int))
    rows = {pid: (k, "CPU" if len(cpu) == 1 else f"CPU (pid {pid})") for k, pid in enumerate(sorted(cpu))}
    for k, pid in enumerate(sorted(gpu, key=lambda p: (not isinstance(p, int), str(p).zfill(12)))):
        device = labels.get(pid) or (f"GPU {pid}" if isinstance(pid, int) else f"GPU {k}")
        rows[pid] = (len(cpu) + k, device)
    for pid in used:  # string pids other than GPUs ('Spans'): fold into the first CPU row
        if pid not in rows:
            rows[pid] = rows[min(cpu)] if cpu else (len(rows), str(pid))
    return rows


def _shift_us(traces: list[RankTrace]) -> tuple[dict, int | None]:
    """Per-rank µs to add so every rank's ts counts from one reference. Kineto writes ts relative to
    ``baseTimeNanoseconds`` (floored to 3 months, so normally equal); older traces wrote absolute epoch µs."""
    bases = {t.rank: t.data.get("baseTimeNanoseconds") for t in traces}
    known = [b for b in bases.values() if isinstance(b, (int, float))]
    ref = min(known) if known else 0
    return {r: ((b if isinstance(b, (int, float)) else 0) - ref) / 1000.0 for r, b in bases.items()}, \
        (ref if known else None)


def merge(traces: list[RankTrace]) -> dict:
    """One Chrome trace of all ranks: a process row per (rank, CPU|GPU n), thread ids and names kept, flow ids
    made unique across ranks, ts on one clock. No top-level 'rank' key: HTA would take the file for a rank's."""
    shifts, base = _shift_us(traces)
    events: list[dict[str, Any]] = []
    device_props: list = []
    for t in traces:
        rows, shift, label = _rows(t), shifts[t.rank], t.label()
        for row, name in sorted(set(rows.values())):
            new_pid = t.rank * RANK_STRIDE + row
            full = f"{label} {name}" if name.startswith("CPU") else f"rank {t.rank} {name}"
            events.append({"ph": "M", "name": "process_name", "pid": new_pid, "tid": 0, "args": {"name": full}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": new_pid, "tid": 0,
                           "args": {"sort_index": new_pid}})
        for e in t.events:
            if e.get("pid") not in rows or (e.get("ph") == "M" and e.get("name", "").startswith("process_")):
                continue  # metadata-only pids, and process rows we rewrote above
            e = dict(e, pid=t.rank * RANK_STRIDE + rows[e["pid"]][0])
            if isinstance(e.get("ts"), (int, float)) and shift:
                e["ts"] = e["ts"] + shift
            if e.get("ph") in ("s", "t", "f") and "id" in e:  # flows (ac2g, fwdbwd) link events of one rank only
                e["id"] = (t.rank << 32) + e["id"] if isinstance(e["id"], int) else f"r{t.rank}:{e['id']}"
            events.append(e)
        device_props += t.data.get("deviceProperties") or []
    first = traces[0]
    world = (first.data.get("distributedInfo") or {}).get("world_size") or first.meta.get("world_size") or len(traces)
    out = {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": events,
           "distributedInfo": {"world_size": world},
           "megatron_ext": {"merged_ranks": [t.rank for t in traces], "mesh": first.mesh,
                            "device": first.meta.get("device"), "engine": first.meta.get("engine")}}
    if device_props:
        out["deviceProperties"] = device_props
    if base is not None:
        out["baseTimeNanoseconds"] = base
    return out


def write_trace(trace: dict, path: str) -> None:
    """gzip'd when the name ends in .gz; compact separators, so HTA's ``"rank":\\s+N`` scan never matches."""
    tmp = path + ".tmp"
    opener = gzip.open(tmp, "wt", compresslevel=6) if path.endswith(".gz") else open(tmp, "w")
    with opener as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)


def region_name(name: str) -> str | None:
    """``## Training Step 12 ##`` -> ``Training Step``: per-step (or per-micro-batch) numbers merge into one row."""
    m = LABEL_RE.match(name)
    return re.sub(r"\s+\d+$", "", m.group(1)) if m else None


def rounded(rows: list) -> list:
    """Rows with their floats rounded to 4 digits (reports and JSON)."""
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def run_sections(out: dict, names, fn: Callable[[str], list]) -> None:
    """Fill each section from ``fn(name)``; a failure empties that section and is recorded, the others still run."""
    for name in names:
        try:
            out[name] = fn(name)
            out["analyses"][name] = "ok"
        except Exception as e:  # noqa: BLE001 - one broken view must not cost the others
            out[name] = []
            out["analyses"][name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
