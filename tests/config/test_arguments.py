"""Mesh and shape validation: every bad combination is one clear line before any process group exists."""

import json
import os
import subprocess
import sys

import pytest

from support import flag_values
from megatron_ext.arguments import ConfigError, parse
from megatron_ext.models.qwen.shape import PRESETS, shape_from_hf_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("flags, world, expected", [
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 6, "not divisible by TP x PP x CP"),
    ("--tensor-model-parallel-size 3", 3, "4 attention heads do not divide over --tensor-model-parallel-size 3"),
    ("--tensor-model-parallel-size 4", 4, "2 key/value groups (GQA) do not divide"),
    ("--pipeline-model-parallel-size 3", 3, "4 layers do not divide over --pipeline-model-parallel-size 3"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2, "do not split into"),
    ("--num-layers-per-virtual-pipeline-stage 1", 2, "needs --pipeline-model-parallel-size > 1"),
    ("--sequence-parallel", 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 33", 2, "--seq-length 33 must be divisible"),
    ("--expert-model-parallel-size 2", 2, "needs an MoE model (--num-experts)"),
    ("--num-experts 3 --expert-model-parallel-size 2", 2, "--num-experts 3 is not divisible"),
    ("--num-experts 4 --tensor-model-parallel-size 2", 2, "MoE with --tensor-model-parallel-size > 1 needs"),
    ("--context-parallel-size 2 --seq-length 30", 2,
     "--seq-length 30 must be divisible by 2 x --context-parallel-size 2 = 4"),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --seq-length 36", 4,
     "--seq-length 36 must be divisible by 2 x --context-parallel-size 2 x --tensor-model-parallel-size 2"),
    ("--context-parallel-size 2 --engine deepspeed", 2, "--context-parallel-size > 1 runs on --engine megatron only"),
    ("--micro-batch-size 2 --global-batch-size 6", 2, "--global-batch-size 6 is not a multiple"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 2,
     "the interleaved schedule needs at least --pipeline-model-parallel-size 2 micro-batches"),
    ("--tensor-model-parallel-size 0", 1, "--tensor-model-parallel-size must be >= 1"),
    ("--model qwen2.5-0.5b --tensor-model-parallel-size 4", 4, "14 attention heads"),
    ("--transformer-impl transformer_engine", 1, "needs TransformerEngine installed"),
    ("--zero-stage 3 --zeropp", 2, "--zeropp needs --engine deepspeed"),
    ("--engine deepspeed --pipeline-model-parallel-size 2 --zero-stage 2", 2, "runs --zero-stage 0 or 1, not 2"),
    ("--engine deepspeed --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 4", 2, "no interleaved (virtual) pipeline"),
    ("--recompute-granularity full --recompute-num-layers 3", 1, "--recompute-num-layers 3 must divide the 4"),
    ("--engine deepspeed --use-distributed-optimizer", 2, "ZeRO shards the optimizer"),
    ("--engine fsdp --ddp-bucket-size 1000", 2, "--ddp-bucket-size is the megatron engine's"),
    ("--model tiny-qwen3-moe --moe-aux-loss-scope model --pipeline-model-parallel-size 2", 2,
     "--moe-aux-loss-scope model does not take --pipeline-model-parallel-size > 1"),
    ("--model tiny-qwen3-moe --moe-aux-loss-scope model --moe-expert-capacity-factor 1.5", 1,
     "--moe-aux-loss-scope model does not take --moe-expert-capacity-factor"),
    ("--engine deepspeed --zero-stage 3 --zero-hpz-partition-size 3", 4, "must divide the data-parallel size 4"),
    ("--engine deepspeed --zero-stage 3 --offload-param nvme", 2, "nvme offload needs --offload-path"),
    ("--lr-warmup-iters 5 --lr-decay-iters 5", 1, "--lr-decay-iters 5 ends the decay before --lr-warmup-iters 5"),
    ("--adam-beta2 1", 1, "--adam-beta2 must be in [0, 1), got 1.0"),
    ("--adam-eps 0", 1, "--adam-eps must be > 0, got 0.0"),
])
def test_bad_mesh_is_one_clear_line(flags, world, expected):
    with pytest.raises(ConfigError) as info:
        parse(flags.split(), world_size=world)
    message = str(info.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("flags, world, dp, vpp, microbatches", [
    ("", 4, 4, None, 1),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8", 8, 2, None, 4),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4", 2, 1, 2, 4),
    ("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --global-batch-size 8", 4, 2, None, 2),
    ("--num-experts 4 --expert-model-parallel-size 2", 2, 2, None, 1),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 4", 8, 2, None,
     2),
])
def test_good_mesh(flags, world, dp, vpp, microbatches):
    run = parse(flags.split(), world_size=world)
    assert (run.mesh.dp, run.mesh.vpp, run.num_microbatches) == (dp, vpp, microbatches)
    assert run.mesh.dp * run.mesh.tp * run.mesh.pp * run.mesh.cp == world


@pytest.mark.parametrize("flags, world, message", [
    (["--context-parallel-size", "2"], 2, "--context-parallel-size > 1 is not supported for ViT"),
    (["--cross-entropy-loss-fusion"], 1, "a ViT's classifier head is small: drop the flag"),
])
def test_language_model_flags_are_refused_for_vit(flags, world, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse(flags, world_size=world, family="vit")
    assert "\n" not in str(info.value)


def test_presets_have_published_qwen25_shapes():
    """config.json of Qwen/Qwen2.5-{0.5,1.5,3,7}B: hidden, layers, heads, KV heads, FFN, vocab, tied."""
    published = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
                 "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
                 "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936, True),
                 "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False)}
    for name, values in published.items():
        s = PRESETS[name]
        assert (s.hidden_size, s.num_layers, s.num_attention_heads, s.num_query_groups, s.ffn_hidden_size,
                s.vocab_size, s.tie_word_embeddings) == values
        assert s.rope_theta == 1e6 and s.rms_norm_eps == 1e-6


def test_hf_config_from_transformers(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1000, rope_theta=5e5, rms_norm_eps=1e-5,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    shape = shape_from_hf_config(str(tmp_path))
    assert (shape.hidden_size, shape.ffn_hidden_size, shape.num_layers, shape.num_attention_heads,
            shape.num_query_groups, shape.vocab_size, shape.rope_theta, shape.rms_norm_eps,
            shape.tie_word_embeddings) == (128, 256, 6, 8, 2, 1000, 5e5, 1e-5, False)


def test_hf_config_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="expected 'qwen2'"):
        shape_from_hf_config(str(tmp_path))
    with pytest.raises(ConfigError, match="cannot read"):
        shape_from_hf_config(str(tmp_path / "missing.json"))


def test_entry_point_rejects_bad_mesh_with_exit_2():
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    proc = subprocess.run([sys.executable, "finetune_qwen.py", "--tensor-model-parallel-size", "3"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: world size 4 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3 (--tensor-model-parallel-size, "
        "--pipeline-model-parallel-size, --context-parallel-size); launch a multiple of 3 processes or shrink the mesh"]


def test_backend_choice(monkeypatch):
    import torch

    from megatron_ext.parallel import choose_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend() == "nccl" and choose_backend("gloo") == "gloo"


def test_gpu_tier_command_lines_are_valid(monkeypatch):
    """GPU time is scarce: every run of the GPU tier must at least pass validation here, on CPU."""
    import test_gpu_deepspeed
    import test_gpu_megatron as gpu

    monkeypatch.setattr(test_gpu_deepspeed, "gpus", lambda: 2)
    runs = [(world, gpu.SFT + flags) for world, flags in [*gpu.RUNS.values(), *gpu.MULTI_GPU.values()]]
    runs += [(1, gpu.SFT + flags) for flags in gpu.RESUMED.values()]
    runs += [(2, test_gpu_deepspeed.common() + flags) for flags in test_gpu_deepspeed.RUNS.values()]
    assert len(runs) == len(gpu.RUNS) + len(gpu.MULTI_GPU) + len(gpu.RESUMED) + len(test_gpu_deepspeed.RUNS)
    for world, argv in runs:
        assert argv[0] == "finetune_qwen.py"
        parse(argv[1:], world_size=world)
    for world, argv in gpu.CP_RUNS.values():
        parse(argv, world_size=world)
    import test_gpu_vit

    for flags in test_gpu_vit.RUNS.values():
        assert test_gpu_vit.COMMON[0] == "pretrain_vit.py"
        parse(test_gpu_vit.COMMON[1:] + flags, world_size=1, family="vit")


@pytest.mark.parametrize("family", ["qwen", "gpt", "vit"])
def test_shipped_defaults_run_from_any_directory(family, tmp_path, monkeypatch):
    """``python ~/megatron_ext/finetune_qwen.py`` from elsewhere: the sample data and tiny tokenizer the defaults
    name are found in the repository (from inside it they stay as written)."""
    inside = flag_values(parse([], world_size=1, family=family))
    monkeypatch.chdir(tmp_path)
    outside = flag_values(parse([], world_size=1, family=family))
    for name in ("data_path", "tokenizer"):
        here, there = getattr(inside, name, None), getattr(outside, name, None)
        for a, b in zip(*(v if isinstance(v, list) else [v] for v in (here, there))):
            if a is not None:
                assert not os.path.isabs(a) and os.path.isabs(b) and os.path.exists(b) and b.endswith(a), (a, b)


@pytest.mark.parametrize("family", ["qwen", "vit", "gpt"])
def test_megatron_lm_flags_we_do_not_take_say_what_to_do(family):
    """A script ported from Megatron-LM: each of its flags that we do not take gets its reason and fix in one line
    (none of them is one of ours, but --rampup-batch-size for pretrain_gpt.py); a typo of ours gets the nearest
    flag."""
    from megatron_ext.arguments import build_parser
    from megatron_ext.megatron_lm_flags import INSTEAD

    ours = build_parser(family=family)._option_string_actions
    owned = set(INSTEAD) & set(ours)  # pretrain_gpt.py's batch-size ramp-up; the others say so
    assert owned == ({"--rampup-batch-size"} if family == "gpt" else set())
    for flag, why in INSTEAD.items():
        if flag in owned:
            continue
        with pytest.raises(ConfigError) as info:
            parse([flag, "1", "--seed", "3"], world_size=1, family=family)
        assert str(info.value) == f"{flag} is a Megatron-LM flag megatron_ext does not take: {why}", flag
    with pytest.raises(ConfigError, match=r"^unrecognized flag --micro-batch; did you mean --micro-batch-size\?$"):
        parse(["--micro-batch", "2"], world_size=1, family=family)
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --no-such-thing$"):
        parse(["--no-such-thing"], world_size=1, family=family)
