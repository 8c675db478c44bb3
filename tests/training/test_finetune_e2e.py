"""finetune_qwen.py end to end on the shipped MetaMathQA sample and tokenizer (packed sequences, fp32, CPU ranks).

The same five SFT steps must give the same per-step losses on one rank, DP2, TP2 x PP2 (with full activation
recompute) and DP2 x TP2 + SP (with selective recompute): the initialisation is mesh-independent and recompute
changes no math. A run saved at step 3 and stopped by --exit-interval must resume to the same steps 4-5, on its own
mesh and under another one; --finetune takes only the weights. bf16 stays close to fp32; fp16 skips the steps its
dynamic loss scale overflows and then trains. Context parallelism (CP2) trains. An MoE run under DP2 x EP2 with the
distributed optimizer resumes exactly, and a dense one saved under DP2 resumes on one rank, both with their gradients
in dozens of buckets (megatron-core 0.16.1 saved the optimizer state of every parameter past the first bucket from a
shifted offset; both fail without engines/distopt_fixes.py). DP2 and TP2 x PP2 record steps 2-3 with --profile (same losses: the profiler
changes no math) and write one trace per rank, every labelled region inside the window; a run without it, none.
"""

import json

import pytest
import torch

from support.ranks import run_ranks
from support.step_checks import assert_close, assert_skips_then_trains, assert_trains, by_step

TOL = 1e-5
STEPS = range(1, 6)
COMMON = ["finetune_qwen.py", "--model", "tiny", "--pack-sequences", "--seq-length", "128", "--micro-batch-size",
          "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "2e-3", "--lr-warmup-iters", "1",
          "--clip-grad", "0.5"]
MESHES = {
    "1rank": (1, []),
    "dp2": (2, []),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--recompute-granularity", "full"]),
    "dp2_tp2_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
                       "selective"]),
}
PROFILED = {"dp2", "tp2_pp2"}  # --profile-step-start 2 --profile-step-end 4: steps 2 and 3
PRECISIONS = {"bf16": (1, ["--bf16"]), "fp16": (1, ["--fp16", "--initial-loss-scale", "4096"])}


def records(log_dir):
    return list(map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()))


def losses(log_dir):
    return {r["step"]: r["loss"] for r in records(log_dir)}


def assert_same(actual, expected):
    for step, loss in actual.items():
        assert abs(loss - expected[step]) <= TOL * abs(expected[step]), (step, actual, expected)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    # Data cache shared by all runs: the first builds it, the rest reuse it.
    cache = ["--data-cache-dir", str(root / "cache")]
    out = {}
    for name, (world, flags) in {**MESHES, **PRECISIONS}.items():
        profile = ["--profile", "--profile-step-end", "4"] if name in PROFILED else []
        run_ranks(world, COMMON + flags + cache + profile + ["--log-dir", str(root / name)])
        out[name] = losses(root / name)
    out["logs"] = root
    out["fp16_records"] = records(root / "fp16")
    # Context parallelism (packed documents padded to 2 x CP, so other samples than the meshes above): it trains.
    run_ranks(2, COMMON + ["--context-parallel-size", "2", "--recompute-granularity", "full"] + cache +
              ["--log-dir", str(root / "cp2")])
    out["cp2_records"] = records(root / "cp2")
    ckpt = root / "ckpt"
    tp2 = ["--tensor-model-parallel-size", "2"]
    run_ranks(2, COMMON + tp2 + cache + ["--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3",
                                         "--log-dir", str(root / "first3")])
    out["first3"] = losses(root / "first3")
    run_ranks(2, COMMON + tp2 + cache + ["--load", str(ckpt), "--log-dir", str(root / "resume_tp2")])
    out["resume_tp2"] = losses(root / "resume_tp2")
    run_ranks(2, COMMON + ["--pipeline-model-parallel-size", "2"] + cache +
              ["--load", str(ckpt), "--log-dir", str(root / "resume_pp2")])
    out["resume_pp2"] = losses(root / "resume_pp2")
    run_ranks(1, COMMON + ["--train-iters", "2"] + cache +
              ["--load", str(ckpt), "--finetune", "--log-dir", str(root / "finetune")])
    out["finetune"] = losses(root / "finetune")
    out["ckpt"] = ckpt
    # The distributed optimizer with gradients in 4,096-element buckets (dozens here; a real model's 40M-element
    # ones too: megatron-core 0.16.1 saved every parameter past the first bucket from a shifted offset), saved at 3
    # under DP2 and resumed on one rank with a single bucket.
    distopt, distopt_ckpt = ["--use-distributed-optimizer"], root / "distopt_ckpt"
    run_ranks(2, COMMON + distopt + ["--ddp-bucket-size", "4096"] + cache +
              ["--save", str(distopt_ckpt), "--save-interval", "3", "--exit-interval", "3",
               "--log-dir", str(root / "distopt_first3")])
    # ... and the same three steps exported, with no save before the export
    run_ranks(2, COMMON + distopt + ["--ddp-bucket-size", "4096"] + cache +
              ["--exit-interval", "3", "--save-hf", str(root / "distopt_hf"), "--log-dir", str(root / "distopt_hf_run")])
    out["distopt_ckpt"], out["distopt_hf"] = distopt_ckpt, root / "distopt_hf"
    run_ranks(1, COMMON + distopt + cache + ["--load", str(distopt_ckpt), "--log-dir", str(root / "resume_distopt")])
    out["resume_distopt"] = losses(root / "resume_distopt")
    # MoE under DP2 x EP2 with the distributed optimizer (dense and expert optimizers chained): five steps with
    # SequentialMLP saving at 3 (and 5); resumed from step 3 with grouped experts, saving at 4; resumed from that
    # with SequentialMLP again. One checkpoint format, optimizer state included. megatron-core 0.16.1 without
    # apex/TE needed three fixes for this (engines/distopt_fixes.py).
    moe = ["--model", "tiny-moe", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
           "--ddp-bucket-size", "4096", "--moe-aux-loss-coeff", "1e-2"] + cache
    out["moe_ckpt"], grouped_ckpt = root / "moe_ckpt", root / "moe_grouped_ckpt"
    for name, extra in (("moe", ["--no-moe-grouped-gemm", "--save", str(out["moe_ckpt"]), "--save-interval", "3"]),
                        ("moe_resumed", ["--load", str(out["moe_ckpt"] / "iter_0000003"), "--save",
                                         str(grouped_ckpt), "--save-interval", "4"]),
                        ("moe_resumed_sequential", ["--no-moe-grouped-gemm", "--load",
                                                    str(grouped_ckpt / "iter_0000004")])):
        run_ranks(2, COMMON + moe + extra + ["--log-dir", str(root / name)])
        out[name] = losses(root / name)
        out[f"{name}_experts"] = json.loads((root / name / "summary.json").read_text())["run"]["experts"]
    out["moe_records"] = records(root / "moe")
    return out


def test_distributed_optimizer_saves_and_exports_the_weights_of_its_last_step(runs, tmp_path):
    """Each rank's step updates its shard of the weights and the all-gather of the rest waits for the next forward
    (overlap_param_gather): the checkpoint's weights (read without the optimizer, as --finetune and the converter
    read them) and the --save-hf export of the same three steps (another run, not saving) are step 3's, tensor for
    tensor."""
    from support.hf_fixtures import tensors
    from support.ranks import run_tool

    run_tool("convert_mcore_to_hf", "--load", runs["distopt_ckpt"], "--save", tmp_path)
    exported, converted = (tensors(d) for d in (runs["distopt_hf"], tmp_path))
    assert sorted(exported) == sorted(converted)
    assert all(torch.equal(exported[k], converted[k]) for k in exported), \
        [k for k in exported if not torch.equal(exported[k], converted[k])]


def test_moe_with_the_distributed_optimizer_resumes_exactly_across_expert_implementations(runs):
    """SequentialMLP -> grouped experts -> SequentialMLP through checkpoints (weights and Adam state): the same
    losses as the uninterrupted run."""
    assert [runs[f"{n}_experts"].split()[0] for n in ("moe", "moe_resumed", "moe_resumed_sequential")] == \
        ["sequential", "grouped", "sequential"]
    assert sorted(runs["moe"]) == [1, 2, 3, 4, 5] and sorted(runs["moe_resumed"]) == [4, 5]
    assert sorted(runs["moe_resumed_sequential"]) == [5]
    assert_same(runs["moe_resumed"], runs["moe"])
    assert_same(runs["moe_resumed_sequential"], runs["moe"])
    assert runs["moe"][5] < runs["moe"][1] and all("moe_load_cv" in r for r in runs["moe_records"])


def test_moe_optimizer_state_does_not_cross_expert_parallel_layouts(runs):
    """megatron-core chains a separate expert optimizer only under EP > 1: resuming under EP1 is refused in one
    line before anything is loaded (--finetune takes the weights)."""
    from megatron.core import dist_checkpointing

    from megatron_ext.errors import ConfigError
    from megatron_ext import checkpoint

    common = dist_checkpointing.load_common_state_dict(checkpoint.find(str(runs["moe_ckpt"])))
    with pytest.raises(ConfigError, match="was saved with --expert-model-parallel-size 2"):
        checkpoint.load(str(runs["moe_ckpt"]), None, mesh=dict(common["mesh"], ep=1),
                        model_shape=common["model_shape"])


@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "1rank"])
def test_same_losses_on_every_mesh(runs, mesh):
    assert sorted(runs[mesh]) == [1, 2, 3, 4, 5]
    assert_same(runs[mesh], runs["1rank"])


def test_training_makes_progress(runs):
    assert runs["1rank"][5] < runs["1rank"][1]


def test_context_parallel_run_trains(runs):
    """CP2 with full recompute: one rank logs (the first CP rank), every step is finite and the loss falls like the
    single rank's. (Exact equality with one process: tests/training/test_parity_megatron.py.)"""
    loss = by_step(runs["cp2_records"])
    assert_trains(loss, STEPS, by=0.1)
    assert abs(loss[1] - runs["1rank"][1]) < 0.05 * runs["1rank"][1]  # same initial weights, similar data


def test_exit_interval_saves_and_stops(runs):
    assert sorted(runs["first3"]) == [1, 2, 3]
    assert (runs["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.parametrize("resumed", ["resume_tp2", "resume_pp2", "resume_distopt"])
def test_resume_continues_exactly(runs, resumed):
    assert sorted(runs[resumed]) == [4, 5], "a resumed run continues from the saved step"
    assert_same(runs[resumed], runs["1rank"])


def test_finetune_loads_weights_only(runs):
    """Fresh optimizer, schedule and data position (steps restart at 1), but the trained weights (a lower loss on
    the very first batch than the untrained model had)."""
    assert sorted(runs["finetune"]) == [1, 2]
    assert runs["finetune"][1] < runs["1rank"][1] - 0.1


def test_bf16_tracks_fp32(runs):
    """Measured: 2.0e-4 relative at most (step 4); the band leaves 10x."""
    assert_close(runs["bf16"], runs["1rank"], 2e-3, STEPS)
    assert_trains(runs["bf16"], STEPS)


def test_fp16_loss_scaling_skips_overflow_then_trains(runs):
    """Measured: steps 1-2 overflow the 4096 scale and are skipped, steps 3-5 train (6.94 -> 6.62)."""
    assert_skips_then_trains(runs["fp16_records"], max(STEPS), most_skipped=3, least_trained=3)


@pytest.mark.parametrize("mesh", sorted(PROFILED))
def test_profile_writes_one_trace_per_rank_with_every_region_inside_the_window(runs, mesh):
    from megatron_ext.observability.regions import LABELS
    from analysis.traces import load_traces

    world, _ = MESHES[mesh]
    traces = {t.rank: t.data for t in load_traces(str(runs["logs"] / mesh / "traces"))}
    assert sorted(traces) == list(range(world))
    for rank, trace in traces.items():
        meta = trace["megatron_ext"]
        assert meta["rank"] == rank and meta["steps"] == [2, 3] and meta["world_size"] == world
        names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
        assert sorted(n for n in names if n.startswith("## Training Step")) == [
            "## Training Step 2 ##", "## Training Step 3 ##"]
        # (garbage collection: only at --manual-gc-interval steps)
        expected = set(LABELS.values()) - {LABELS["gc"]} - ({LABELS["pipeline_comm"]} if meta["mesh"]["pp"] == 1
                                                            else set())
        assert expected <= set(names), (rank, expected - set(names))
        assert names.count(LABELS["data"]) == 2 and names.count(LABELS["optimizer"]) == 2  # once per recorded step
    # The profiled steps are marked, and the summary's speeds leave them out (they run slower)
    run = records(runs["logs"] / mesh)
    assert [r["step"] for r in run if r.get("profiled")] == [2, 3]
    summary = json.loads((runs["logs"] / mesh / "summary.json").read_text())
    steady = [r["tokens_per_sec"] for r in run if r["step"] not in (1, 2, 3)]
    assert summary["profiled_steps"] == "2-3" and summary["tokens_per_sec"] == pytest.approx(sum(steady) / len(steady))
    step = run[-1]
    parts = [step[f"{name}_time"] for name in LABELS]
    assert all(value >= 0 for value in parts) and step["forward_time"] > 0 and step["backward_time"] > 0
    assert sum(parts) <= step["step_time"] * 1.01  # exclusive parts of the step: they cannot add up to more


def test_no_trace_without_profile(runs):
    assert not (runs["logs"] / "1rank" / "traces").exists()
    assert "forward_time" in records(runs["logs"] / "1rank")[-1]  # the time split is always there


def test_report_and_merged_trace_of_the_tp2_pp2_run(runs, tmp_path):
    """The trace tools on a real TP2 x PP2 run: the CPU path's report has every rank's regions, the collectives,
    and a pipeline bubble; the merged trace names one row per rank by its mesh coordinates."""
    from support.ranks import run_tool
    from analysis.traces import read_trace

    traces = str(runs["logs"] / "tp2_pp2" / "traces")
    run_tool("analyze_traces", traces, "-o", str(tmp_path / "report"))
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["path"] == "cpu" and report["mesh"]["pp"] == 2
    assert (tmp_path / "report" / "index.html").stat().st_size and (tmp_path / "report" / "regions.png").stat().st_size
    for rank in range(4):
        regions = {row["region"] for row in report["regions"] if row["rank"] == rank}
        assert {"Forward", "Backward", "Pipeline Communication", "Gradient Reduction"} <= regions
    assert {row["rank"] for row in report["comm"]} == {0, 1, 2, 3}
    assert sorted(row["rank"] for row in report["bubble"]) == [0, 1, 2, 3]
    assert all(0 < row["bubble_share"] < 1 for row in report["bubble"])
    run_tool("merge_traces", traces, "-o", str(tmp_path / "merged.json.gz"))
    names = {e["args"]["name"] for e in read_trace(str(tmp_path / "merged.json.gz"))["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert {f"rank {r} (tp{r % 2} pp{r // 2} dp0) CPU" for r in range(4)} <= names, names
