"""Trace merging and analysis (tools/merge_traces.py, tools/analyze_traces.py) on real torch.profiler traces of two
gloo ranks, made once per module: the CPU path must find our labelled regions, the collectives and the idle gaps,
and bad input must be one line naming the file, exit status 2."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from support import REPO
from support.ranks import free_port, run_tool
from megatron_ext.errors import ConfigError
from analysis import trace_analysis, traces

STEPS = 5  # profiler schedule: 1 wait, 1 warm-up, 3 active (steps 2, 3, 4)


def _worker(rank: int, world: int, out: str, port: int) -> None:
    """One rank of a tiny two-stage 'pipeline': the same labels, collectives and metadata our profiler writes."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    meta = {"rank": rank, "world_size": world, "device": "cpu", "engine": "megatron",
            "mesh": {"tp": 1, "pp": 2, "dp": 1, "cp": 1, "ep": 1, "vpp": 1},
            "coords": {"tp": 0, "pp": rank, "dp": 0, "cp": 0}, "steps": [2, 4]}
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for step in range(STEPS):
            if step == 2:  # the first active step: metadata only sticks while the profiler records
                prof.add_metadata_json("megatron_ext", json.dumps(meta))
            with record_function(f"## Training Step {step} ##"):
                with record_function("## Data ##"):
                    x = torch.randn(16, 32)
                with record_function("## Forward ##"):
                    loss = model(x).pow(2).mean()
                with record_function("## Pipeline Communication ##"):
                    buf = torch.zeros(16, 32)
                    dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
                with record_function("## Backward ##"):
                    loss.backward()
                if rank == 1:
                    with record_function("only_on_rank_1"):
                        torch.mm(torch.randn(32, 32), torch.randn(32, 32))
                with record_function("## Gradient Reduction ##"):
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                with record_function("## Optimizer Step ##"):
                    opt.step()
                    opt.zero_grad()
            prof.step()
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json.gz"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("run") / "traces"
    out.mkdir()
    mp.spawn(_worker, args=(2, str(out), free_port()), nprocs=2)
    (out / "metrics.json").write_text("{}")  # a stray file the loader must ignore
    return out


def _events(path):
    return [e for e in traces.read_trace(str(path))["traceEvents"] if e.get("ph") != "M"]


def _row_names(merged: dict) -> dict:
    return {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "process_name"}


def test_merge_gives_one_row_per_rank_and_keeps_every_event(trace_dir, tmp_path):
    out = tmp_path / "merged.json.gz"
    run_tool("merge_traces", trace_dir, "-o", out)
    text = gzip.decompress(out.read_bytes()).decode()
    merged = json.loads(text)
    assert "rank" not in merged and not re.search(r'"rank":\s+\d', text)  # HTA would take it for a rank file
    rows = _row_names(merged)
    assert sorted(rows.values()) == ["rank 0 (tp0 pp0 dp0) CPU", "rank 1 (tp0 pp1 dp0) CPU"]
    sort = {e["pid"]: e["args"]["sort_index"] for e in merged["traceEvents"] if e.get("name") == "process_sort_index"}
    assert sorted(rows, key=sort.get) == sorted(rows, key=rows.get)
    originals = [_events(trace_dir / f"rank{r}_trace.json.gz") for r in (0, 1)]
    kept = [e for e in merged["traceEvents"] if e.get("ph") != "M"]
    assert len(kept) == sum(map(len, originals))
    # flows (fwdbwd here, ac2g on GPU) stay within their rank: no id shared by two rows, every pair intact
    flows = {}
    for e in kept:
        if e.get("ph") in ("s", "f"):
            flows.setdefault(e["id"], set()).add(e["pid"])
    assert flows and all(len(pids) == 1 for pids in flows.values())
    assert len(flows) == sum(len({e["id"] for e in ev if e.get("ph") == "s"}) for ev in originals)
    assert merged["distributedInfo"] == {"world_size": 2}


def test_ranks_stay_apart_even_when_file_names_lie(trace_dir, tmp_path):
    """The rank comes from the trace itself: rank 1's own label lands in rank 1's row and rank 1's pipeline stage
    stays rank 1's, although the (plain JSON) files are swapped."""
    swapped = tmp_path / "traces"
    swapped.mkdir()
    for r in (0, 1):
        (swapped / f"rank{1 - r}_trace.json").write_bytes(gzip.decompress((trace_dir / f"rank{r}_trace.json.gz")
                                                                           .read_bytes()))
    loaded = traces.load_traces(str(swapped))
    assert [(t.rank, os.path.basename(t.path)) for t in loaded] == [(0, "rank1_trace.json"), (1, "rank0_trace.json")]
    merged = traces.merge(loaded)
    rows = _row_names(merged)
    marks = {rows[e["pid"]] for e in merged["traceEvents"] if e.get("name") == "only_on_rank_1"}
    assert marks == {"rank 1 (tp0 pp1 dp0) CPU"}
    result = trace_analysis.analyze(str(swapped))
    assert [(b["rank"], b["pp_rank"]) for b in result["bubble"]] == [(0, 0), (1, 1)]
    sends = {(c["rank"], c["op"]) for c in result["comm"] if c["op"] in ("gloo:send", "gloo:recv")}
    assert sends == {(0, "gloo:send"), (1, "gloo:recv")}


def test_analyze_cpu_path_writes_the_report(trace_dir, tmp_path, capsys):
    out = tmp_path / "report"
    run_tool("analyze_traces", trace_dir, "-o", out)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("Where the time goes (mean of 2 rank(s)): compute ") and \
        printed[1].startswith("Top operations: ") and printed[2].startswith("Try first: --"), printed
    result = json.loads((out / "report.json").read_text())
    assert result["path"] == "cpu" and "no GPU kernels" in result["reason"] and result["ranks"] == [0, 1]
    assert all(v == "ok" for k, v in result["analyses"].items() if k != "kernels")
    assert [(w["first_step"], w["last_step"]) for w in result["window"]] == [(2, 4), (2, 4)]
    for rank in (0, 1):
        regions = {r["region"]: r for r in result["regions"] if r["rank"] == rank}
        assert {"Training Step", "Data", "Forward", "Backward", "Pipeline Communication", "Gradient Reduction",
                "Optimizer Step"} <= set(regions)
        assert regions["Training Step"]["count"] == 3 and 0.9 < regions["Training Step"]["share"] <= 1.0
        comm = {(c["op"], c["region"]) for c in result["comm"] if c["rank"] == rank}
        assert {("gloo:all_reduce", "Gradient Reduction"), ("c10d::allreduce_", "Gradient Reduction")} <= comm
        (b,) = [b for b in result["breakdown"] if b["rank"] == rank]
        assert b["compute_ms"] > 0 and b["comm_ms"] > 0 and b["idle_ms"] > 0
        assert b["compute_ms"] + b["comm_exposed_ms"] + b["idle_ms"] == pytest.approx(b["window_ms"], rel=1e-3)
        assert sum(i["idle_ms"] for i in result["idle"] if i["rank"] == rank) == pytest.approx(b["idle_ms"], 1e-3)
        ops = [o for o in result["top_ops"] if o["rank"] == rank]
        assert 0 < len(ops) <= 15 and ops == sorted(ops, key=lambda o: -o["self_ms"])
        assert any(o["op"] == "aten::addmm" for o in ops)
    assert all(0 < b["bubble_share"] < 1 for b in result["bubble"])  # mesh pp=2
    page = (out / "index.html").read_text()
    assert "Analysis path: cpu" in page and page.count("data:image/png;base64,") == 3
    assert page.index("<h2>Verdict</h2>") < page.index("Analysis path") < page.index("<table>")
    assert trace_analysis.analyze(str(trace_dir)).keys() == result.keys()


def _synthetic(tmp_path):
    """One rank, hand-made (ms): step [0,100]; Forward [0,40] with mm [5,25] > add [10,15]; Gradient Reduction
    [50,90] with c10d::allreduce_ [50,55] on the main thread, gloo:all_reduce [55,85] on gloo's thread and an op
    [60,70] on a third thread."""
    def x(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts * 1000.0, "dur": dur * 1000.0}
    ua = "user_annotation"
    events = [x("ProfilerStep#1", 0, 100, ua), x("## Training Step 1 ##", 0, 100, ua), x("## Forward ##", 0, 40, ua),
              x("aten::mm", 5, 20), x("aten::add", 10, 5), x("## Gradient Reduction ##", 50, 40, ua),
              x("c10d::allreduce_", 50, 5), x("gloo:all_reduce", 55, 30, ua, tid=2), x("aten::copy_", 60, 10, tid=3)]
    d = tmp_path / "synthetic"
    d.mkdir()
    (d / "rank0_trace.json").write_text(json.dumps({"traceEvents": events}))
    return d


def test_cpu_path_numbers_on_a_hand_made_trace(tmp_path):
    result = trace_analysis.analyze(str(_synthetic(tmp_path)))
    (b,) = result["breakdown"]
    assert (b["window_ms"], b["compute_ms"], b["comm_ms"], b["comm_exposed_ms"], b["idle_ms"], b["overlap_ms"]) == \
        (100, 30, 35, 25, 45, 10)
    assert {i["region"]: i["idle_ms"] for i in result["idle"]} == {"Forward": 20, "Training Step": 20,
                                                                    "Gradient Reduction": 5}
    assert {o["op"]: o["self_ms"] for o in result["top_ops"]} == {"gloo:all_reduce": 30, "aten::mm": 15,
                                                                  "aten::copy_": 10, "aten::add": 5,
                                                                  "c10d::allreduce_": 5}
    regions = {r["region"]: (r["total_ms"], r["exclusive_ms"]) for r in result["regions"]}
    assert regions == {"Training Step": (100, 20), "Gradient Reduction": (40, 40), "Forward": (40, 40)}
    assert result["bubble"] == []  # no mesh: not a pipeline run
    v = result["verdict"]  # idle 45% of the window: the first lever
    assert v["shares"] == dict(compute=0.3, communication=0.25, idle=0.45, data=0.0) and v["ranks"] == 1
    assert [(t["name"], t["share"]) for t in v["top"]] == [("gloo:all_reduce", 0.4615), ("aten::mm", 0.2308),
                                                           ("aten::copy_", 0.1538)]
    assert v["flag"] == "--micro-batch-size (larger)" and v["why"].startswith("the host idles 45% of the window")


def _result(compute=0.8, comm=0.05, idle=0.1, data=0.0, top="sm90_xmma_gemm_bf16", path="hta", **meta):
    window = 100.0
    return dict(path=path, mesh=meta.get("mesh", {}), engine=meta.get("engine", "megatron"),
                breakdown=[dict(rank=0, window_ms=window, compute_share=compute, idle_share=idle,
                                non_compute_ms=comm * window)],
                regions=[dict(rank=0, region="Data", total_ms=data * window)],
                top_ops=[dict(rank=0, op=top, total_ms=60.0), dict(rank=0, op="other", total_ms=40.0)])


@pytest.mark.parametrize("case, flag", [
    (dict(data=0.2, idle=0.5), "--num-workers (images) or a local --data-cache-dir (text)"),
    (dict(idle=0.3, comm=0.3), "--micro-batch-size (larger)"),
    (dict(comm=0.2, mesh={"tp": 2}), "--tensor-model-parallel-size (smaller)"),
    (dict(comm=0.2, engine="deepspeed"), "--zero-stage 2 (or 1)"),
    (dict(comm=0.2), "--global-batch-size (larger)"),
    (dict(top="at::native::cross_entropy_loss_kernel"), "--cross-entropy-loss-fusion"),
    (dict(top="aten::add_", path="cpu"), "gradient-accumulation fusion (on by default: drop "
                                         "--no-gradient-accumulation-fusion)"),
    (dict(), "--micro-batch-size (larger, as memory allows)"),
])
def test_the_verdict_names_one_lever_in_order(case, flag):
    """Data before idle before communication before what the top kernel says; HTA's non-compute time stands for
    communication on a GPU trace."""
    from analysis.trace_verdict import lines, verdict

    v = verdict(_result(**case))
    assert v["flag"] == flag, v
    assert lines(v, gpu=True)[2] == f"Try first: {flag} ({v['why']})"


def _bad_dir(tmp_path, name, payload: bytes):
    d = tmp_path / "bad"
    d.mkdir()
    (d / name).write_bytes(payload)
    return d


def test_bad_input_is_one_line_and_exit_2(trace_dir, tmp_path):
    good = (trace_dir / "rank0_trace.json.gz").read_bytes()
    d = _bad_dir(tmp_path, "rank0_trace.json.gz", good[: len(good) // 2])
    proc = subprocess.run([sys.executable, "tools/merge_traces.py", str(d), "-o", str(tmp_path / "m.json.gz")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "rank0_trace.json.gz" in proc.stderr and "gzip" in proc.stderr


@pytest.mark.parametrize("case", ["missing", "empty", "corrupt_gz", "truncated_json", "no_events", "duplicate",
                                  "output_inside"])
def test_bad_input_messages(case, trace_dir, tmp_path):
    raw = gzip.decompress((trace_dir / "rank0_trace.json.gz").read_bytes())
    tool, flag = "analyze_traces", []
    if case == "missing":
        d, expect = tmp_path / "nowhere", "does not exist"
    elif case == "empty":
        d, expect = tmp_path / "empty", "holds no trace files"
        d.mkdir()
        (d / "notes.json").write_text("{}")
    elif case == "corrupt_gz":
        d, expect = _bad_dir(tmp_path, "rank3_trace.json.gz", b"\x1f\x8b" + os.urandom(200)), "rank3_trace.json.gz"
    elif case == "truncated_json":
        d, expect = _bad_dir(tmp_path, "rank0_trace.json", raw[: len(raw) // 3]), "rank0_trace.json: not valid JSON"
    elif case == "no_events":
        d, expect = _bad_dir(tmp_path, "rank0_trace.json", b'{"schemaVersion": 1}'), "no 'traceEvents'"
    elif case == "duplicate":
        d = _bad_dir(tmp_path, "rank0_trace.json", raw)
        shutil.copy(d / "rank0_trace.json", d / "rank5_trace.json")
        expect = "both hold rank 0"
    else:
        d, expect, tool, flag = trace_dir, "inside the trace directory", "merge_traces", ["-o", trace_dir / "m.json"]
    with pytest.raises(ConfigError, match=re.escape(expect)) as err:
        run_tool(tool, d, *flag)
    assert "\n" not in str(err.value)
