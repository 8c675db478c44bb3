"""bench/bench_qwen.py, bench_vit.py and bench_gpt.py on one CPU rank: both rows measured, the ratio is their
quotient, MFU only with a known peak, and flags that would make the comparison meaningless are refused in one line
before any process group."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from support import REPO
from support.ranks import run_ranks, run_script

TINY = ["bench/bench_qwen.py", "--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--bench-steps", "4", "--warmup-steps", "1"]
QUIET = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # as a launched rank runs


def bench(args, **env):
    return run_script([*TINY, *args], env=dict(QUIET, **env))


@pytest.mark.parametrize("peak", [[], ["--peak-tflops", "1"]], ids=["no_peak", "peak_1tflops"])
def test_megatron_ext_beside_transformers(tmp_path, peak):
    out = tmp_path / "bench.json"
    proc = bench(["--baseline", "hf", "--bench-out", str(out), *peak])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"megatron_ext", "transformers"}
    for row in rows.values():
        assert row["tokens_per_sec"] > 0 and row["step_time"] > 0 and row["mem_peak_gib"] > 0
        assert row["measured_steps"] == 3
        assert row["tokens_per_sec"] == pytest.approx(report["tokens_per_step"] / row["step_time"])
        if peak:
            assert row["mfu"] == pytest.approx(row["tokens_per_sec"] * report["flops_per_token"] / 1e12)
        else:
            assert row["mfu"] is None
    ratio = rows["megatron_ext"]["tokens_per_sec"] / rows["transformers"]["tokens_per_sec"]
    assert report["ratio_tokens_per_sec"] == pytest.approx(ratio, rel=1e-12)
    split = rows["megatron_ext"]["split_ms"]  # where ours spends its measured steps (the speed stage's column)
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0, split
    assert sum(split.values()) <= 1e3 * rows["megatron_ext"]["step_time"] * 1.01
    assert "split_ms" not in rows["transformers"]
    assert report["tokens_per_step"] == 4 * 64 and report["num_microbatches"] == 2 and report["data"] == "mock"
    assert report["device"].startswith("cpu") and report["dtype"] == "float32"
    assert f"megatron_ext / transformers tokens/s: {ratio:.2f}x" in proc.stdout


@pytest.mark.parametrize("args, env, message", [
    (["--baseline", "hf"], {"WORLD_SIZE": "2"},
     "error: --baseline hf runs transformers on one device, but WORLD_SIZE is 2; launch one process or use "
     "--baseline none"),
    (["--warmup-steps", "4"], {}, "error: --bench-steps 4 must exceed --warmup-steps 4"),
    (["--train-iters", "7"], {}, "error: --train-iters would change the number of steps the benchmark runs"),
], ids=["baseline_needs_one_process", "nothing_measured", "train_iters"])
def test_refusals_are_one_line(args, env, message):
    proc = bench(args, **env)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr


def peers_report(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = bench(["--bench-steps", "2", "--warmup-steps", "1", "--bench-out", str(out), *args])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc, json.loads(out.read_text())


def test_a_peer_that_cannot_run_here_is_a_row_saying_why(tmp_path):
    """--baseline hf liger on CPU: plain transformers measured, transformers + Liger (Triton, CUDA only) a row with
    the reason and no numbers, the JSON still written; each measured side states its numerics, from the run's dtype."""
    proc, report = peers_report(tmp_path, "--baseline", "hf", "liger")
    rows = report["results"]
    assert list(rows) == ["megatron_ext", "transformers", "transformers+liger"]
    assert report["baseline"] == ["hf", "liger"]
    assert rows["transformers+liger"] == {"skipped": "liger-kernel's Triton kernels need a CUDA device; this run is "
                                                     "on cpu"}
    assert rows["transformers"]["model_class"] == "Qwen2ForCausalLM" and rows["transformers"]["tokens_per_sec"] > 0
    assert set(report["ratios"]) == {"transformers"}
    assert report["ratio_tokens_per_sec"] == report["ratios"]["transformers"]
    assert rows["megatron_ext"]["numerics"] == "fp32 weights and Adam states (megatron-core)"
    assert rows["transformers"]["numerics"] == "fp32 weights and AdamW states"
    assert "transformers+liger  skipped: liger-kernel's Triton kernels need a CUDA device" in proc.stdout


def test_lora_beside_peft(tmp_path):
    """Our LoRA (r 4, every linear) beside PEFT LoRA on transformers with the same rank, alpha and the equivalent
    targets: the "peft" row trains exactly what PEFT trains for that config, far fewer than the model's parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_ext.models.qwen.hf import config_fields
    from megatron_ext.models.qwen.shape import PRESETS

    _, report = peers_report(tmp_path, "--baseline", "hf", "--lora-rank", "4", "--lora-alpha", "8",
                             "--lora-targets", "qkv,proj,fc1,fc2")
    rows = report["results"]
    assert list(rows) == ["megatron_ext", "peft"] and report["ratio_tokens_per_sec"] == report["ratios"]["peft"]
    peft = get_peft_model(Qwen2ForCausalLM(Qwen2Config(**config_fields(PRESETS["tiny"]))), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"]))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert rows["peft"]["trainable"] == trainable < rows["peft"]["parameters"] // 5, rows["peft"]
    assert rows["peft"]["numerics"] == "fp32 frozen weights, fp32 adapters and AdamW states"
    assert "adapters" in rows["megatron_ext"]["numerics"] and rows["peft"]["mem_peak_gib"] > 0


def test_qwen3_moe_beside_its_transformers_class(tmp_path):
    """A Qwen3-MoE slice (tiny-qwen3-moe, 2 layers) beside transformers' Qwen3MoeForCausalLM of the same shape."""
    _, report = peers_report(tmp_path, "--model", "tiny-qwen3-moe", "--num-layers", "2", "--baseline", "hf")
    rows = report["results"]
    assert rows["transformers"]["model_class"] == "Qwen3MoeForCausalLM" and report["shape"]["num_layers"] == 2
    for row in rows.values():
        assert math.isfinite(row["first_loss"]) and math.isfinite(row["final_loss"]) and row["tokens_per_sec"] > 0


def test_the_qwen3_moe_gpu_row_is_a_valid_command():
    """The GPU row's command (two layers of Qwen3-30B-A3B's dimensions, both peers) parses, and its peer is
    transformers' Qwen3-MoE with grouped_mm experts on CUDA; none beside a peer is refused."""
    import torch

    from bench import bench_qwen, peers
    from megatron_ext import arguments
    from megatron_ext.errors import ConfigError

    bench_args, forward = bench_qwen.split_argv(["--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16",
                                                 "--seq-length", "4096", "--micro-batch-size", "1",
                                                 "--global-batch-size", "8", "--baseline", "liger", "hf"])
    run = arguments.parse(forward, world_size=1, family="qwen")
    model_class, config = peers.qwen_model(run, torch.device("cuda"))
    assert bench_args.baseline == ["hf", "liger"] and model_class.__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_hidden_layers, config.num_experts, config.head_dim) == (2, 128, 128)
    assert config._experts_implementation == "grouped_mm"
    with pytest.raises(ConfigError, match="--baseline none hf: none or peers, not both"):
        bench_qwen.split_argv(["--model", "tiny", "--baseline", "none", "hf"])


def test_zero3_partitions_weights_and_optimizer_states(tmp_path):
    """bench/zero_memory.py's workers, ZeRO-3 on 2 ranks: this rank's 16-bit weights are 2Ψ/N bytes and its fp32
    master weights + Adam moments 12Ψ/N (the formula's terms DeepSpeed partitions without extra buffers), within 1%.
    (The ranks are forked, as every launch of the suite; the script itself starts them with torchrun.)"""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import zero_memory

    run_ranks(2, ["bench/zero_memory.py", "--worker-stage", "3", "--worker-dir", str(tmp_path)])
    row = zero_memory.measured_row(3, 2, str(tmp_path))
    for term in ("weights", "optimizer"):
        assert row["measured"][term] == pytest.approx(row["predicted"][term], rel=0.01), term
    lines = zero_memory.table([row])
    assert lines[0].startswith("Ψ = 26,7") and lines[1].split()[-1] == "ratio" and len(lines) == 3


def test_table_collects_results_and_refuses_an_empty_directory(tmp_path):
    """bench/table.py reads a directory of mixed benchmark JSON (bench_qwen.py's and bench_gpt.py's, which share the
    layout, become rows; bench_vit.py's and the others' do not)."""
    proc = subprocess.run([sys.executable, "bench/table.py", "bench/results", "--out", str(tmp_path / "t.md")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| cpu")]
    assert len(rows) == 2 and "| gpt2-tiny | megatron |" in rows[0] and "1.09x" in rows[0]
    assert "| tiny | megatron |" in rows[1] and "0.82x" in rows[1]
    assert (tmp_path / "t.md").read_text().strip() == proc.stdout.strip()
    empty = subprocess.run([sys.executable, "bench/table.py", str(tmp_path)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert empty.returncode == 1 and empty.stderr.startswith("error: no bench_qwen.py results")


def test_vit_beside_transformers(tmp_path):
    """bench/bench_vit.py, tiny on one CPU rank: both rows measured, the same number of parameters on both sides,
    images/s from the mean step time, MFU from the ViT FLOPs and --peak-tflops, the shapes recorded; --profile-ops:
    each side's top operators in one profiled step (its second, the first measured), matrix products among them."""
    from megatron_ext.models.vit.shape import VIT_PRESETS
    from megatron_ext.observability.flops import vit_training_flops_per_image

    out = tmp_path / "vit.json"
    proc = run_script(["bench/bench_vit.py", "--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--num-classes", "5", "--bench-steps", "3", "--warmup-steps", "1", "--peak-tflops", "1",
                       "--profile-ops", "8", "--bench-out", out], env=QUIET)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert set(rows) == {"megatron_ext", "transformers"} and "results" not in report  # not bench/table.py's
    assert rows["megatron_ext"]["parameters"] == rows["transformers"]["parameters"] > 0
    flops_per_image = vit_training_flops_per_image(VIT_PRESETS["tiny"], 5)
    assert report["flops_per_image"] == flops_per_image and report["images_per_step"] == 4
    for row in rows.values():
        assert row["measured_steps"] == 2 and row["step_time"] > 0 and row["mem_peak_gib"] > 0
        assert row["images_per_sec"] == pytest.approx(4 / row["step_time"])
        assert row["mfu"] == pytest.approx(row["images_per_sec"] * flops_per_image / 1e12)
    ratio = rows["megatron_ext"]["images_per_sec"] / rows["transformers"]["images_per_sec"]
    assert report["ratio_images_per_sec"] == pytest.approx(ratio, rel=1e-12)
    assert report["shape"]["seq_length"] == 17 and report["shape"]["hidden_size"] == 64
    assert (report["num_microbatches"], report["attention"], report["data"]) == (2, "sdpa", "mock")
    assert report["device"].startswith("cpu") and report["dtype"] == "float32"
    assert f"megatron_ext / transformers images/s: {ratio:.2f}x" in proc.stdout
    for row in rows.values():
        table = row["profile_ops"]
        assert (table["step"], table["time"], len(table["ops"])) == (2, "cpu", 8), table
        assert all(op["self_ms"] >= 0 and op["count"] > 0 for op in table["ops"])
        assert {"aten::mm", "aten::addmm", "aten::bmm"} & {op["op"] for op in table["ops"]}, table


@pytest.mark.parametrize("args, message", [
    (["--data-path", "ethz/food101"], "--data-path: bench_vit.py times the model on synthetic images"),
    (["--train-iters", "3"], "--train-iters would change the number of steps"),
    (["--bench-steps", "2", "--warmup-steps", "2"], "--bench-steps 2 must exceed --warmup-steps 2"),
    (["--lora-rank", "4"], "--baseline hf trains every weight, unlike --lora-rank"),
], ids=["data_path", "train_iters", "nothing_measured", "lora_vs_full"])
def test_vit_refusals(args, message):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_vit

    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        bench_vit.main(["--model", "tiny", *args])


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_host_ops_counts_every_variant(tmp_path, model):
    """bench/host_ops.py: operator and host-sync counts per step are deterministic, so the stand-ins' effect is a
    count, not a timing: fewer operators per layer and no sync per layer or micro-batch; transformers' model of the
    same shape (Qwen2's, Qwen3's with its query/key norms) counted beside them; the optimizer step apart."""
    out = tmp_path / "ops.json"
    host_layers = "1" if model == "tiny" else "0"  # (the optimizer step's host time: its plumbing, once)
    proc = run_script(["bench/host_ops.py", "--model", model, "--num-layers", "1", "2", "--optimizer-host-layers",
                       host_layers, "--out", out], env=QUIET)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    rows, host = result["rows"], result["optimizer_host_ms"]
    assert host is None if model != "tiny" else (host["tensors"] > 12 and host["megatron_ext"] > 0 and
                                                 host["megatron-core fallbacks"] > 0)
    ours, theirs, peer = rows["megatron_ext"], rows["megatron-core fallbacks"], rows["transformers"]
    assert ours["per_layer"] < theirs["per_layer"] and ours["ops_full_depth"] < theirs["ops_full_depth"]
    assert ours["syncs_per_layer"] == 0 < theirs["syncs_per_layer"]
    assert peer["per_layer"] > 0 and peer["ops_full_depth"] > 0
    # the optimizer step: a fixed handful of launches, against one copy per weight tensor
    assert ours["by_depth"]["1"]["optimizer_ops"] == ours["by_depth"]["2"]["optimizer_ops"] < \
        theirs["by_depth"]["1"]["optimizer_ops"] < theirs["by_depth"]["2"]["optimizer_ops"]


@pytest.mark.parametrize("model, experts", [("qwen1.5-moe-a2.7b", ("4", "8")), ("qwen3-30b-a3b", ("8", "16"))])
def test_moe_layer_bench_counts_grouped_against_sequential(tmp_path, model, experts):
    """bench/moe_experts.py, Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's layers (top-8, no shared expert, against
    transformers' Qwen3MoeSparseMoeBlock): the grouped layer dispatches as many operators at either expert count,
    the loop more with every expert; all implementations compute the same output."""
    out = tmp_path / "moe.json"
    proc = run_script(["bench/moe_experts.py", "--model", model, "--experts", *experts, "--tokens", "64", "--reps",
                       "1", "--cpu-width-divisor", "16", "--out", out], env=QUIET)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [r["results"] for r in json.loads(out.read_text())["rows"]]
    grouped, sequential = "grouped (torch._grouped_mm)", "SequentialMLP (megatron-core)"
    assert rows[0][grouped]["ops"] == rows[1][grouped]["ops"] < rows[0][sequential]["ops"] < rows[1][sequential]["ops"]
    assert all(r["max_abs_diff_vs_sequential"] < 1e-5 for row in rows for r in row.values())


def test_gpt_beside_transformers(tmp_path):
    """bench/bench_gpt.py, tiny on one CPU rank: both rows measured with the same parameter count (tiny's vocabulary
    needs no padding), tokens/s from the mean step time, MFU from the GPT-2 FLOPs and --peak-tflops, and the JSON in
    bench_qwen.py's layout, so bench/table.py makes it a row."""
    from megatron_ext.models.gpt2.shape import GPT2_PRESETS
    from megatron_ext.observability.flops import training_flops_per_token

    out = tmp_path / "gpt.json"
    proc = run_script(["bench/bench_gpt.py", "--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--bench-steps", "3", "--warmup-steps", "1", "--peak-tflops", "1",
                       "--bench-out", out], env=QUIET)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"megatron_ext", "transformers"}
    assert rows["megatron_ext"]["parameters"] == rows["transformers"]["parameters"] > 0
    flops_per_token = training_flops_per_token(GPT2_PRESETS["tiny"], 64)
    assert report["flops_per_token"] == flops_per_token and report["tokens_per_step"] == 4 * 64
    for row in rows.values():
        assert row["measured_steps"] == 2 and row["step_time"] > 0 and row["mem_peak_gib"] > 0
        assert row["tokens_per_sec"] == pytest.approx(4 * 64 / row["step_time"])
        assert row["mfu"] == pytest.approx(row["tokens_per_sec"] * flops_per_token / 1e12)
    ratio = rows["megatron_ext"]["tokens_per_sec"] / rows["transformers"]["tokens_per_sec"]
    assert report["ratio_tokens_per_sec"] == pytest.approx(ratio, rel=1e-12)
    assert (report["benchmark"], report["model"], report["shape"]["hidden_size"]) == ("bench_gpt", "gpt2-tiny", 64)
    assert (report["num_microbatches"], report["attention"], report["data"]) == (2, "sdpa", "mock")
    assert report["device"].startswith("cpu") and report["dtype"] == "float32"
    assert f"megatron_ext / transformers tokens/s: {ratio:.2f}x" in proc.stdout
    table = subprocess.run([sys.executable, "bench/table.py", str(out)], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 0 and "| gpt2-tiny | megatron |" in table.stdout and f"{ratio:.2f}x" in table.stdout


@pytest.mark.parametrize("args, message", [
    (["--data-path", "examples/data/tiny_shakespeare_sample.txt"], "--data-path: bench_gpt.py times the model on "
     "synthetic tokens"),
    (["--exit-interval", "3"], "--exit-interval would change the number of steps"),
    (["--bench-steps", "2", "--warmup-steps", "2"], "--bench-steps 2 must exceed --warmup-steps 2"),
], ids=["data_path", "exit_interval", "nothing_measured"])
def test_gpt_refusals(args, message):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_gpt

    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        bench_gpt.main(["--model", "tiny", *args])


def test_gpu_tier_report_says_what_did_not_run(tmp_path):
    """bench/gpu_tier.py on JUnit XML: passed, failed and not run (with pytest's reason) listed and counted, JSON
    written, exit 1 on a failure. (Its input from pytest's own JUnit, GPU tests skipped with their reasons:
    tests/gpu/test_gpu_check.py's rehearsal.)"""
    mixed = tmp_path / "mixed.xml"
    mixed.write_text('<testsuites><testsuite><testcase classname="t" name="a" time="1"/>'
                     '<testcase classname="t" name="b" time="2"><failure message="boom">x</failure></testcase>'
                     '<testcase classname="t" name="c" time="0"><skipped message="not run: needs 2 GPUs, this '
                     'machine has 1"/></testcase></testsuite></testsuites>')
    out = tmp_path / "tier.json"
    proc = subprocess.run([sys.executable, "bench/gpu_tier.py", str(mixed), "--device", "test", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "test: 1 passed, 1 failed, 0 error, 1 not run" in proc.stdout, proc.stdout
    assert "not run: needs 2 GPUs, this machine has 1" in proc.stdout
    report = json.loads(out.read_text())
    assert report["counts"] == {"passed": 1, "failed": 1, "not run": 1} and report["device"] == "test"
    assert not report["ok"] and report["tests"]["t::b"]["reason"] == "boom"


def test_gpu_tier_keeps_the_worst_outcome_and_refuses_an_empty_file(tmp_path, capsys):
    """Several calls' JUnit files: a failure in an earlier file stays a failure whatever a later file says, a test
    not run in one and passed in another reads as passed; a file without test cases is an error (exit 2)."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import gpu_tier

    def junit(name, *cases):
        path = tmp_path / name
        path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
        return str(path)

    first = junit("first.xml", '<testcase classname="t" name="a"><failure message="boom"/></testcase>',
                  '<testcase classname="t" name="b"><skipped message="needs a CUDA GPU"/></testcase>')
    second = junit("second.xml", '<testcase classname="t" name="a"><skipped message="needs a CUDA GPU"/></testcase>',
                   '<testcase classname="t" name="b" time="3"/>')
    third = junit("third.xml", '<testcase classname="t" name="a" time="2"/>')
    tests = gpu_tier.outcomes([first, second, third])
    assert tests["t::a"]["outcome"] == "failed" and tests["t::a"]["reason"] == "boom"
    assert tests["t::b"] == dict(outcome="passed", seconds=3.0, reason=None)
    assert gpu_tier.main([first, second, "--device", "x"]) == 1
    empty = junit("empty.xml")
    capsys.readouterr()
    assert gpu_tier.main([second, empty, "--device", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {empty} holds no test case: pytest collected nothing " \
                                               "(a wrong test id or marker?)"


def test_gpu_tier_reads_a_stopped_run_as_what_it_finished(tmp_path):
    """A pytest run stopped at a stage's cap (SIGINT) writes only its finished tests, and a nameless ``<testcase/>``
    when none finished (the second H200 window's "::None passed"): the placeholder is no test, a file of only it is
    an error, and the tests the stage meant to run but no file reports read "not run" with the reason given."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import gpu_tier

    stopped = tmp_path / "stopped.xml"
    stopped.write_text('<testsuites><testsuite><testcase time="0.000" /></testsuite></testsuites>')
    with pytest.raises(gpu_tier.EmptyReport, match="stopped before its first test finished"):
        gpu_tier.outcomes([str(stopped)])
    part = tmp_path / "part.xml"
    part.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="one[bf16]" time="3"/>'
                    '<testcase time="0.000" /></testsuite></testsuites>')
    want = ["tests/test_a.py::one", "tests/test_a.py::two", "tests/test_b.py::three[fp32]"]
    tier = gpu_tier.summary(gpu_tier.expected(gpu_tier.outcomes([str(part)]), want, "stopped at the stage's cap"), "x")
    assert tier["counts"] == {"passed": 1, "not run": 2} and tier["ok"], tier
    assert tier["tests"]["tests.test_b::three[fp32]"]["reason"] == "stopped at the stage's cap"
    assert set(tier["tests"]) == {"tests.test_a::one[bf16]", "tests.test_a::two", "tests.test_b::three[fp32]"}


def test_lora_memory_counts_what_each_variant_trains(tmp_path):
    """bench/lora_memory.py on the tiny Qwen: full fine-tuning holds fp32 gradients (4 B) and master weights plus
    AdamW's moments (12 B) for every parameter, LoRA for its adapters only (rank 4 of hidden 64, all linears), and
    its checkpoint is the smaller one."""
    out = tmp_path / "lora.json"
    proc = run_script(["bench/lora_memory.py", "--model", "tiny", "--layers", "2", "--workdir", tmp_path,
                       "--out", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, lora = json.loads(out.read_text())["rows"]
    assert not full["lora"] and lora["lora"] and full["parameters"] == lora["parameters"] - lora["trainable"]
    assert full["trainable"] == full["parameters"] and full["weights"] == 2 * full["parameters"]  # bf16
    for row in (full, lora):
        assert row["grads"] == 4 * row["trainable"] and row["optimizer"] == 12 * row["trainable"], row
    assert lora["checkpoint"] < full["checkpoint"] and "LoRA r=16, all linears" in proc.stdout


def test_loss_memory_holds_one_chunk_of_logits(tmp_path):
    """bench/loss_memory.py: both variants compute the same loss; 3,000 tokens of a 150,000-token vocabulary are
    1.7 GiB of fp32 logits, which the unfused path holds (and more), the fused one a 1 GiB chunk of at most."""
    out = tmp_path / "loss.json"
    proc = run_script(["bench/loss_memory.py", "--tokens", "3000", "--vocab", "150000", "--hidden", "64",
                       "--out", out], env=QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    unfused, fused = json.loads(out.read_text())["rows"]
    assert (unfused["variant"], fused["variant"]) == ("unfused", "fused")
    assert abs(unfused["loss_mean"] - fused["loss_mean"]) <= 1e-5 * unfused["loss_mean"]
    assert unfused["peak_gib"] > 1.5 and fused["peak_gib"] < 0.7 * unfused["peak_gib"], (unfused, fused)


def test_packed_attention_bench_times_the_mask_and_says_where_varlen_runs(tmp_path):
    """bench/packed_attention.py on CPU: the document-mask path timed over real packed rows (documents cut at the
    row's end), the flash varlen row marked unavailable (CUDA, half precision)."""
    out = tmp_path / "packed.json"
    proc = run_script(["bench/packed_attention.py", "--rows", "2", "--seq-length", "256", "--longest", "100",
                       "--reps", "1", "--out", out], env=QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    mask, varlen = result["results"]
    assert mask["path"] == "SDPA + document mask" and mask["ms"] > 0 and mask["vs_mask"] == "1.00x"
    assert varlen["ms"] is None and "CUDA" in varlen["note"] and result["documents"] >= 2 * 256 // 100


def test_packing_bench_counts_rows_and_padding_of_each_method():
    """bench/packing.py's row on a small set: best-fit and TRL's rows hold every token in fewer rows than data
    order here, and the padding is what the rows leave over the tokens."""
    import numpy as np

    from bench import packing

    lengths = np.random.default_rng(1).integers(1, 65, 300)
    row = packing.measure("random", lengths, 64)
    order, ours, trl = (row[m] for m in ("data order", "best-fit decreasing", "TRL pack_dataset"))
    assert ours["rows"] <= trl["rows"] < order["rows"] and ours["rows"] >= -(-int(lengths.sum()) // 64)
    assert ours["padding"] == pytest.approx(1 - lengths.sum() / (ours["rows"] * 64))
