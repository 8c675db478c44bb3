"""pretrain_vit.py end to end (fp32, CPU ranks).

Synthetic images, five steps, clipping at 0.5 (it bites): one rank, TP2 x PP2 (megatron engine), DP2 ZeRO-2 and
ZeRO-3 give the same losses and grad norms (1e-5); a checkpoint saved under TP2 x PP2 resumes on one rank to the
same steps. LoRA (frozen base, adapters + head): one rank = DeepSpeed ZeRO-3 DP2 = a TP2 run saved at step 3 and
resumed on one rank; the merged export, loaded by transformers, gives the run's own validation loss; the adapters
export holds only adapters and head. The shipped image sample through DataLoader workers: one rank = DP2 = TP2
(one reader per TP group) = PP4 (middle stages read nothing), and the model learns (training loss and top-1 improve,
validation loss below chance), which the same model never updated does not. Bad ViT/LoRA flags are one line before
any process group.
"""

import json
import math
import re

import pytest

from support import hf_fixtures
from support.ranks import run_ranks, run_tool
from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError

TOL = 1e-5
COMMON = ["pretrain_vit.py", "--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", "5", "--lr", "2e-3", "--clip-grad", "0.5"]
DS = ["--engine", "deepspeed", "--zero-stage"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "qkv,proj,fc1,fc2", "--lr", "1e-2"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
EVAL = ["--eval-interval", "5", "--eval-iters", "1"]
RUNS = {"1rank": (1, []), "tp2_pp2": (4, TP2_PP2), "dp2_zero2": (2, DS + ["2"]), "dp2_zero3": (2, DS + ["3"]),
        "lora_1rank": (1, LORA + EVAL), "lora_dp2_zero3": (2, LORA + DS + ["3"])}
SAMPLE = ["pretrain_vit.py", "--model", "tiny", "--micro-batch-size", "8", "--global-batch-size", "32",
          "--train-iters", "120", "--lr", "3e-3", "--lr-warmup-iters", "10", "--weight-decay", "0.05",
          "--eval-interval", "60", "--eval-iters", "1", "--num-workers", "2"]


def records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    out = {}
    for name, (world, flags) in RUNS.items():
        save = ["--save", str(root / "lora_ckpt")] if name == "lora_1rank" else []
        profile = ["--profile", "--profile-step-end", "4"] if name == "tp2_pp2" else []  # the family changes nothing
        run_ranks(world, COMMON + flags + save + profile + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    # Saved at step 3 under one mesh, resumed on one rank: (world, flags of the first run, of the resumed run).
    for prefix, (world, first, resumed) in {"": (4, TP2_PP2, []),
                                            "lora_": (2, LORA + ["--tensor-model-parallel-size", "2"], LORA)}.items():
        ckpt = ["--save", str(root / f"{prefix}ckpt3"), "--save-interval", "3", "--exit-interval", "3"]
        run_ranks(world, COMMON + first + ckpt + ["--log-dir", str(root / f"{prefix}first3")])
        run_ranks(1, COMMON + resumed + ["--load", str(root / f"{prefix}ckpt3"),
                                         "--log-dir", str(root / f"{prefix}resumed")])
        out[f"{prefix}resumed"] = records(root / f"{prefix}resumed")
    # TP2: one rank decodes, the other receives; PP4: two stages decode nothing. Six steps, all inside the 10 warm-up
    # steps: the same lr as on one rank.
    short = ["--train-iters", "6", "--eval-interval", "3"]
    # One rank only for the steps compared (the first 10, inside the warm-up: the lr does not depend on the length).
    # The negative control of the learning check: the same model and data, never updated (lr 0).
    for name, world, flags in (("sample_1rank", 1, ["--train-iters", "10"]), ("sample_dp2", 2, []),
                               ("sample_untrained", 1, ["--lr", "0", "--train-iters", "40", "--eval-interval", "40"]),
                               ("sample_tp2", 2, short + ["--tensor-model-parallel-size", "2"]),
                               ("sample_pp4", 4, short + ["--pipeline-model-parallel-size", "4"])):
        run_ranks(world, SAMPLE + flags + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    out["root"] = root
    return out


def assert_same(ours, ref, keys=("loss", "grad_norm")):
    ref = {r["step"]: r for r in ref}
    assert ours and all(r["step"] in ref for r in ours)
    for r in ours:
        for key in keys:
            if key in r or key in ref[r["step"]]:  # validation keys: on evaluation steps only, in both
                assert abs(r[key] - ref[r["step"]][key]) <= TOL * abs(ref[r["step"]][key]), (key, r, ref[r["step"]])


@pytest.mark.parametrize("name, reference", [("tp2_pp2", "1rank"), ("dp2_zero2", "1rank"), ("dp2_zero3", "1rank"),
                                             ("resumed", "1rank"), ("lora_dp2_zero3", "lora_1rank"),
                                             ("lora_resumed", "lora_1rank")])
def test_same_steps_on_every_layout_engine_and_resume(runs, name, reference):
    ref = runs[reference]
    assert len(ref) == 5 and ref[-1]["loss"] < ref[0]["loss"]
    assert all(r["grad_norm"] > 0.5 for r in ref), "clipping must be active for this test to mean much"
    assert [r["step"] for r in runs[name]] == ([4, 5] if "resumed" in name else [1, 2, 3, 4, 5])
    assert_same(runs[name], ref)


def test_vit_runs_are_profiled_like_every_family(runs):
    from megatron_ext.observability.regions import LABELS
    from analysis.traces import load_traces

    traces = load_traces(str(runs["root"] / "tp2_pp2" / "traces"))
    assert [t.rank for t in traces] == [0, 1, 2, 3]
    for trace in traces:
        names = {e["name"] for e in trace.events if e.get("cat") == "user_annotation"}
        everywhere = set(LABELS.values()) - {LABELS["gc"]}  # (garbage collection: at --manual-gc-interval steps)
        assert everywhere | {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names


def test_lora_exports_merged_and_adapters(runs, tmp_path):
    """The merged export is a plain transformers ViT that computes the run's validation loss; adapters alone hold
    only what LoRA trained."""
    import torch
    from transformers import ViTForImageClassification

    from megatron_ext.data.sources import MockImages
    from megatron_ext.models.vit.model import HF_MEAN_STD, VIT_PRESETS, device_pixels

    ckpt = runs["root"] / "lora_ckpt"
    run_tool("convert_mcore_to_hf", "--load", ckpt, "--save", tmp_path / "merged")
    run_tool("convert_mcore_to_hf", "--load", ckpt, "--save", tmp_path / "adapters", "--lora", "adapters")

    model = ViTForImageClassification.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    data = MockImages(image_size=VIT_PRESETS["tiny"].image_size, num_classes=10, global_batch_size=8,
                      micro_batch_size=2, dp_rank=0, dp_size=1, seed=1234)
    batch = next(data.valid_microbatches(1))
    with torch.no_grad():
        size = VIT_PRESETS["tiny"].image_size  # uint8 images, normalised as the training step does
        logits = torch.cat([model(pixel_values=device_pixels(b["pixels"], size, *HF_MEAN_STD)).logits for b in batch])
    loss = torch.nn.functional.cross_entropy(logits, torch.cat([b["labels"] for b in batch])).item()
    val_loss = runs["lora_1rank"][-1]["val_loss"]
    assert abs(loss - val_loss) <= TOL * val_loss, (loss, val_loss)

    names = sorted(hf_fixtures.tensors(tmp_path / "adapters" / "adapters.safetensors"))
    assert names and all(".lora_" in n or n.startswith("head.") for n in names)
    assert len(names) == 2 * 4 * VIT_PRESETS["tiny"].num_layers + 2


def test_image_sample_one_rank_equals_two_and_learns(runs):
    one, two = runs["sample_1rank"], runs["sample_dp2"]
    assert_same(two[:10], one, keys=("loss",))  # same images, crops and flips however the batch is split
    assert_same(runs["sample_tp2"], one, keys=("loss",))  # TP ranks share one reader's batches
    assert_same(runs["sample_pp4"], one, keys=("loss",))  # middle stages read nothing
    assert_same(runs["sample_pp4"], runs["sample_tp2"], keys=("loss", "val_loss", "val_top1"))
    assert all(learning(two).values()), learning(two)


def learning(steps) -> dict:
    """5 classes, 270 images seen through random-resized crops: a tiny ViT from scratch learns them slowly and
    generalises slower still. Training loss and top-1 must improve from the first 20 steps to the last 20, and the
    final validation loss must be below ln 5, what a model that knows nothing of the classes scores at best (its
    expected cross entropy is at least that, whatever its logits)."""
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 40
    assert all(math.isfinite(r["loss"]) for r in steps) and math.isfinite(steps[-1]["val_loss"])
    first, last = ({key: sum(r[key] for r in part) / len(part) for key in ("loss", "top1")}
                   for part in (steps[:20], steps[-20:]))
    return dict(loss_falls=last["loss"] < first["loss"] - 0.2, top1_rises=last["top1"] > first["top1"] + 0.15,
                val_loss_below_chance=steps[-1]["val_loss"] < math.log(5))


def test_an_untrained_vit_fails_every_learning_check(runs):
    assert not any(learning(runs["sample_untrained"]).values()), learning(runs["sample_untrained"])


@pytest.mark.parametrize("flags, world, expected", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", 2, "--sequence-parallel is not supported for ViT: its 17"),
    ("--image-size 30", 1, "--image-size 30 is not a multiple of the patch size 8"),
    ("--engine deepspeed --zero-stage 1 --pipeline-model-parallel-size 2", 2, "pipeline engine runs language"),
    ("--num-classes 1", 1, "--num-classes must be >= 2, got 1"),
    ("--label-smoothing 1.5", 1, "--label-smoothing must be in [0, 1), got 1.5"),
    ("--lora-rank 4 --lora-targets qkv,mlp", 1, "--lora-targets qkv,mlp: choose from qkv,proj,fc1,fc2"),
    ("--lora-rank 3 --tensor-model-parallel-size 2", 2, "--lora-rank 3 must be positive and divisible by"),
    ("--lora-rank 4 --lora-dropout 1", 1, "--lora-dropout must be in [0, 1), got 1.0"),
])
def test_bad_vit_flags(flags, world, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse(["--mock-data", *flags.split()], world_size=world, family="vit")
