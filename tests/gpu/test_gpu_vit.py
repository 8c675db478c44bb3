"""GPU tier for pretrain_vit.py (marked ``gpu``; skipped without CUDA), each a plain ``python`` process on one GPU.

- ViT-B/16 (2 layers) in bf16 on the shipped image sample through DataLoader workers: uint8 batches pinned, moved,
  upsampled 32 -> 224 and normalised on the GPU; loss finite and falling, images/s, MFU and memory reported.
- The same with LoRA and full recompute: only adapters and head train, every step finite.
- fp32 tiny ViT: DeepSpeed ZeRO-2 and ZeRO-3 equal the megatron engine (1e-4) on synthetic images.
CPU proves the layouts with gloo (tests/training/test_parity_megatron.py, test_pretrain_vit.py); here the tensors are CUDA.
"""

import functools

import pytest

from support.ranks import run_concurrently, run_ranks
from support.step_checks import assert_close, assert_steps, by_step, records

pytestmark = pytest.mark.gpu
TOL = 1e-4
STEPS = range(1, 7)
COMMON = ["pretrain_vit.py", "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "6",
          "--lr", "1e-3", "--clip-grad", "1.0"]
BASE = ["--model", "vit-base-16", "--num-layers", "2", "--bf16", "--num-workers", "2"]
TINY = ["--model", "tiny", "--mock-data"]
RUNS = {
    "base_bf16": BASE,
    "base_bf16_lora_recompute": BASE + ["--lora-rank", "16", "--recompute-granularity", "full"],
    "tiny_fp32": TINY,
    "tiny_zero2": TINY + ["--engine", "deepspeed", "--zero-stage", "2"],
    "tiny_zero3": TINY + ["--engine", "deepspeed", "--zero-stage", "3"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    root = tmp_path_factory.mktemp("gpu_vit")
    run_concurrently({name: functools.partial(run_ranks, 1, COMMON + flags + ["--log-dir", str(root / name)])
                      for name, flags in RUNS.items()})
    return {name: records(root / name) for name in RUNS}


@pytest.mark.parametrize("name", ["base_bf16", "base_bf16_lora_recompute"])
def test_vit_base_trains_in_bf16_on_decoded_images(runs, name):
    steps = runs[name]
    loss = by_step(steps)
    assert_steps(loss, STEPS)
    assert all(r["mfu"] is not None and r["mfu"] > 0 and r["mem_peak"] > 0 for r in steps)
    assert min(loss[s] for s in (4, 5, 6)) < loss[1], loss  # real image batches are noisy: the best of the last 3


@pytest.mark.parametrize("name", ["tiny_zero2", "tiny_zero3"])
def test_zero_equals_megatron_engine_on_gpu(runs, name):
    for key in ("loss", "grad_norm"):
        assert_close(by_step(runs[name], key), by_step(runs["tiny_fp32"], key), TOL, STEPS)
