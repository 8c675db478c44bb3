"""GPU tier (marked ``gpu``): a profiled run on one GPU gives a trace with CUDA kernels, the step's time split from
CUDA events, and a report through HTA (skipped without it: ``EXTRA="traceinsight==0.6.1 plotly narwhals networkx
pyyaml ijson" bash ../shared/gpu/prepare_wheels.sh``) and through the CPU path (always)."""

import json

import pytest

from support.ranks import run_ranks

pytestmark = pytest.mark.gpu
RUN = ["finetune_qwen.py", "--model", "qwen2.5-0.5b", "--num-layers", "2", "--bf16", "--pack-sequences",
       "--seq-length", "512", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
       "--lr", "1e-4", "--profile", "--profile-memory"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gpu_profile")
    run_ranks(1, RUN + ["--log-dir", str(logs)])
    return logs


def test_gpu_trace_split_and_memory_snapshot(profiled):
    from analysis.traces import has_gpu_events, load_traces

    traces = load_traces(str(profiled / "traces"))
    assert [t.rank for t in traces] == [0] and has_gpu_events(traces)
    assert (profiled / "traces" / "rank0_memory_snapshot.pickle").stat().st_size > 0
    record = json.loads((profiled / "metrics.jsonl").read_text().splitlines()[-1])
    parts = ("data", "forward", "backward", "grad_reduce", "optimizer")
    assert record["forward_time"] > 0 and record["backward_time"] > record["forward_time"] * 0.5
    assert sum(record[f"{p}_time"] for p in parts) <= record["step_time"] * 1.01


def test_cpu_path_reads_gpu_traces(profiled):
    from analysis.trace_analysis import analyze

    result = analyze(str(profiled / "traces"), use_hta=False)
    assert result["path"] == "cpu" and result["regions"] and result["breakdown"]


def test_hta_path_on_a_gpu_trace(profiled, tmp_path):
    pytest.importorskip("hta")
    from analysis.trace_analysis import analyze
    from analysis.trace_report import write_report

    result = analyze(str(profiled / "traces"))
    assert result["path"] == "hta", result["reason"]
    ran = [name for name, status in result["analyses"].items() if status == "ok"]
    assert {"breakdown", "kernels", "regions"} <= set(ran), result["analyses"]
    assert result["breakdown"][0]["compute_ms"] > 0 and result["kernels"]
    json_path, html_path = write_report(result, str(tmp_path / "report"))
    assert json.load(open(json_path))["path"] == "hta" and open(html_path).read().count("data:image/png") >= 1
