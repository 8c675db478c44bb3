"""Observability: the FLOPs formula by hand and against Qwen2.5-0.5B's published size, peaks and MFU, memory, and
every sink of MetricsLogger (JSONL, TensorBoard, wandb offline or missing, summary, plot)."""

import builtins
import json
import sys
import time

import pytest
import torch

from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.observability.flops import mfu, peak_flops, training_flops_per_token
from megatron_ext.observability.loggers import MetricsLogger
from megatron_ext.observability.metrics import StepTimer, memory_stats

CUDA = torch.device("cuda", 0)


def test_flops_tiny_shape_by_hand():
    # tiny: h=64, ffn=128, 4 layers, 4 heads x 16 channels, 2 KV groups (k width 32), vocab 256; s=32.
    # MACs per layer and token: Q 64*64 + K,V 2*64*32 + O 64*64 + MLP 3*64*128 = 36864;
    # attention (scores + values) 2 * 32 * 64 = 4096 over the full square, half of it causal.
    tiny = PRESETS["tiny"]
    layers_causal, layers_full, head = 4 * (36864 + 2048), 4 * (36864 + 4096), 64 * 256
    assert training_flops_per_token(tiny, 32) == 6 * (layers_causal + head) == 1_032_192
    assert training_flops_per_token(tiny, 32, causal=False) == 6 * (layers_full + head)
    assert training_flops_per_token(tiny, 32, recompute_full=True) == 8 * layers_causal + 6 * head


def test_flops_match_qwen2_5_0_5b_published_parameters():
    """Dense part = 6 x matmul parameters (all non-embedding weights plus the tied LM head), exactly."""
    shape = PRESETS["qwen2.5-0.5b"]
    h, L, V = shape.hidden_size, shape.num_layers, shape.vocab_size
    kv_width = shape.num_query_groups * shape.kv_channels
    matmul_per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * shape.ffn_hidden_size
    biases_and_norms = L * (h + 2 * kv_width + 2 * h) + h  # QKV biases, two RMSNorms per layer, final norm
    # Hugging Face's Qwen/Qwen2.5-0.5B: 494,032,768 parameters, 0.36B of them non-embedding.
    assert L * matmul_per_layer + biases_and_norms + V * h == 494_032_768
    assert round(L * matmul_per_layer / 1e9, 2) == 0.36
    s = 4096
    attention = 6 * L * s * h  # 2 matmuls x s/2 keys (causal) x h x 2 FLOPs x 3 passes
    assert training_flops_per_token(shape, s) == 6 * (L * matmul_per_layer + h * V) + attention
    assert training_flops_per_token(shape, s, causal=False) == 6 * (L * matmul_per_layer + h * V) + 2 * attention


def test_vit_flops_count_what_the_model_computes(single_rank):
    """The ViT formula's forward third equals torch's own FLOP count of our model's forward (patch embedding,
    every matmul, attention and head); ViT-H/14 gives the published 1,003.8 GFLOP per image; a frozen base costs
    less (no weight gradients)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_ext.mesh import Mesh
    from megatron_ext.models.vit import model as vit
    from megatron_ext.observability.flops import vit_training_flops_per_image

    shape = vit.VIT_PRESETS["tiny"]
    model = vit.ViTClassifier(vit.transformer_config(shape, Mesh(world=1)), shape, 10)
    # The math backend runs attention as matmuls torch can count (its CPU flash kernel has no FLOP formula).
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randn(2, 3, shape.image_size, shape.image_size))
    assert counter.get_total_flops() / 2 == vit_training_flops_per_image(shape, 10) / 3
    huge = vit.VIT_PRESETS["vit-huge-14"]
    assert round(vit_training_flops_per_image(huge, 0) / 1e9, 1) == 1003.8
    assert 0.6 < vit_training_flops_per_image(huge, 0, frozen_base=True) / vit_training_flops_per_image(huge, 0) < 0.7


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.float16, 756.0),
    ("NVIDIA H200", torch.bfloat16, 989.4), ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100 80GB PCIe", torch.bfloat16, 312.0), ("NVIDIA L40S", torch.bfloat16, 362.05),
    ("Tesla T4", torch.bfloat16, None), ("NVIDIA H100 80GB HBM3", torch.int8, None)])
def test_peak_by_device_name(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(CUDA, dtype) == (None if tflops is None else tflops * 1e12)
    assert peak_flops(CUDA, dtype, override_tflops=100.0) == 100e12


@pytest.mark.parametrize("precision, h100, a100", [("high", 494.7, 156.0), ("highest", 66.9, 19.5)])
def test_fp32_peak_follows_tf32_setting(monkeypatch, precision, h100, a100):
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
    for name, tflops in (("NVIDIA H100 80GB HBM3", h100), ("NVIDIA A100-SXM4-40GB", a100)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert peak_flops(CUDA, torch.float32) == tflops * 1e12


def test_mfu_needs_a_peak_on_cpu():
    cpu = torch.device("cpu")
    flops_per_token = training_flops_per_token(PRESETS["tiny"], 64)
    assert peak_flops(cpu, torch.float32) is None
    assert mfu(5000.0, flops_per_token, peak_flops(cpu, torch.float32)) is None
    peak = peak_flops(cpu, torch.float32, override_tflops=0.5)  # --peak-tflops 0.5
    assert peak == 0.5e12
    assert mfu(5000.0, flops_per_token, peak) == pytest.approx(5000.0 * flops_per_token / 0.5e12)


def test_cpu_memory_and_timer():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"mem_allocated", "mem_reserved", "mem_peak"}
    assert all(isinstance(v, int) and v > 0 for v in stats.values())
    assert stats["mem_peak"] >= stats["mem_allocated"]
    timer = StepTimer(torch.device("cpu"))
    time.sleep(0.02)
    first = timer.lap()
    assert 0.02 <= first < 1.0 and timer.lap() < first


def make_records(n=4):
    return [dict(step=step, loss=3.0 - 0.5 * step, lr=1e-3, grad_norm=1.0, tokens_per_sec=1000.0 * step,
                 samples_per_sec=2.0 * step, mfu=None, step_time=1.0 if step == 1 else 0.25, data_time=0.0,
                 forward_time=0.1, backward_time=0.1, pipeline_comm_time=0.0, grad_reduce_time=0.0, optimizer_time=0.05,
                 other_time=0.0, mem_allocated=100, mem_reserved=200, mem_peak=300 + step)
            for step in range(1, n + 1)]


def test_logger_writes_every_sink(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = make_records()
    log_dir, tb_dir = tmp_path / "logs", tmp_path / "tb"
    logger = MetricsLogger(log_dir=str(log_dir), tensorboard_dir=str(tb_dir), wandb_project="test",
                           wandb_exp_name="run", config={"lr": 1e-3}, total_steps=4)
    for record in records:
        logger.log(record)
    logger.log(dict(step=4, val_loss=1.5))
    assert len((log_dir / "metrics.jsonl").read_text().splitlines()) == 5  # flushed before close
    plot = logger.close()

    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records + [dict(step=4, val_loss=1.5)]
    assert '"mfu": null' in lines[0]
    assert list(tb_dir.glob("events.out.tfevents.*"))
    assert list((log_dir / "wandb").glob("offline-run-*"))
    printed = capsys.readouterr()
    assert "warning" not in printed.err
    assert "training summary" in printed.out and f"plot: {log_dir / 'training.png'}" in printed.out

    assert plot == str(log_dir / "training.png")
    assert (log_dir / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == 1.0 and summary["min_loss"] == 1.0
    assert summary["final_val_loss"] == 1.5
    assert summary["mean_step_time"] == 0.25  # the 1.0 s warm-up step is left out
    assert summary["time_split"] == pytest.approx(dict(data=0.0, forward=0.4, backward=0.4, pipeline_comm=0.0,
                                                       grad_reduce=0.0, optimizer=0.2, other=0.0))
    assert "of which                     forward 40% backward 40% optimizer 20%" in printed.out
    assert summary["tokens_per_sec"] == 3000.0 and summary["mfu"] is None and summary["mem_peak"] == 304


def test_math_accuracy_reaches_tensorboard_wandb_and_the_plot(tmp_path, monkeypatch):
    """--eval-generate-samples' metrics, as the loop adds them to an evaluation step's record: TensorBoard scalars,
    wandb's log (a stub run), the summary and the accuracy panel of training.png."""
    from matplotlib.figure import Figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = []

    class StubRun:
        summary = {}

        def log(self, scalars, step):
            logged.append((step, scalars))

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", type("StubWandb", (), {"init": staticmethod(lambda **kw: StubRun())}))
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (figures.append(fig), save(fig, *a, **kw)))
    records = make_records(4)
    records[1].update(val_loss=2.0, val_math_accuracy=0.25, val_math_no_answer=0.5, val_math_tokens_per_sec=80.0)
    records[3].update(val_loss=1.5, val_math_accuracy=0.75, val_math_no_answer=0.0, val_math_tokens_per_sec=90.0)
    logger = MetricsLogger(log_dir=str(tmp_path / "logs"), tensorboard_dir=str(tmp_path / "tb"), wandb_project="t")
    for record in records:
        logger.log(record)
    logger.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val_math_accuracy")] == [(2, 0.25), (4, 0.75)]
    assert [e.value for e in events.Scalars("val_math_no_answer")] == [0.5, 0.0]
    assert [(step, s["val_math_accuracy"]) for step, s in logged if "val_math_accuracy" in s] == [(2, 0.25), (4, 0.75)]
    assert StubRun.summary["final_val_math_accuracy"] == 0.75
    (fig,) = figures
    accuracy = {line.get_label(): line.get_xydata().tolist() for line in fig.axes[2].get_lines()}
    assert accuracy == {"val math": [[2.0, 0.25], [4.0, 0.75]]} and fig.axes[2].get_title() == "accuracy"
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["final_val_math_accuracy"] == 0.75


def test_logger_survives_missing_or_failing_wandb(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def import_without_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_wandb)
    logger = MetricsLogger(log_dir=str(tmp_path / "no_wandb"), wandb_project="test")
    logger.log(make_records(1)[0])
    logger.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: wandb logging disabled (ImportError: No module named 'wandb')"]
    monkeypatch.undo()

    class FailingWandb:
        @staticmethod
        def init(**kwargs):
            raise RuntimeError("init failed")

    monkeypatch.setitem(sys.modules, "wandb", FailingWandb)
    logger = MetricsLogger(log_dir=str(tmp_path / "failing_wandb"), wandb_project="test")
    logger.log(make_records(1)[0])
    assert logger.close() == str(tmp_path / "failing_wandb" / "training.png")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: wandb logging disabled (RuntimeError: init failed)"]


def test_plot_skipped_when_asked(tmp_path, monkeypatch, capsys):
    """MEGATRON_EXT_PLOT=0 (sweeps, the test launches): summary.json still, no training.png."""
    monkeypatch.setenv("MEGATRON_EXT_PLOT", "0")
    logger = MetricsLogger(log_dir=str(tmp_path), total_steps=4)
    for record in make_records():
        logger.log(record)
    assert logger.close() is None and (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "training.png").exists() and "plot:" not in capsys.readouterr().out


def test_disabled_logger_is_a_no_op(tmp_path):
    logger = MetricsLogger(log_dir=str(tmp_path / "off"), tensorboard_dir=str(tmp_path / "tb"), enabled=False)
    logger.log(make_records(1)[0])
    assert logger.close() is None
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("peak_gib, micro, num_micro, expected", [
    (10, 1, 16, 4),     # 4 x 10 GiB <= 0.9 x 80 < 8 x 10
    (10, 2, 2, 4),      # only one doubling keeps the global batch whole
    (50, 1, 16, None),  # 2 x 50 GiB does not fit
    (10, 1, 1, None),   # a single micro-batch per step: nothing to merge
])
def test_micro_batch_suggestion_keeps_global_batch_and_fits(peak_gib, micro, num_micro, expected):
    from megatron_ext.observability.loggers import format_summary, summarize
    from megatron_ext.observability.metrics import suggest_micro_batch_size

    gib = 2 ** 30
    assert suggest_micro_batch_size(peak_gib * gib, 80 * gib, micro, num_micro) == expected
    assert suggest_micro_batch_size(peak_gib * gib, None, micro, num_micro) is None  # CPU: capacity unknown
    records = [dict(step=1, loss=2.0, mem_peak=peak_gib * gib)]
    summary = summarize(records, dict(micro_batch_size=micro, num_microbatches=num_micro, memory_capacity=80 * gib))
    assert summary["suggested_micro_batch_size"] == expected
    assert ("fits --micro-batch-size" in format_summary(summary)) == (expected is not None)


def test_a_resumed_run_continues_its_metrics_and_plots_the_whole_run(tmp_path, monkeypatch):
    """Resumed at step 3 after a run that logged 1-5 and was killed mid-line: metrics.jsonl keeps 1-3 (4 and 5 are
    taken again), drops the torn line, and goes on; the plot covers steps 1-6, the summary this run's 4-6."""
    from megatron_ext.observability import loggers

    records = make_records(6)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:5]) + '{"step": 6, "lo')
    plotted = []
    monkeypatch.setattr(loggers, "plot_training", lambda history, *args: plotted.append(history))
    logger = MetricsLogger(log_dir=str(tmp_path), total_steps=6, resumed_at=3)
    for record in records[3:]:
        logger.log(record)
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in plotted[0]] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
