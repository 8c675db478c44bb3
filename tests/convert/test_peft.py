"""LoRA adapters in and out in PEFT's format (megatron_ext/convert/adapters.py), checked with peft itself.

Out: a LoRA run from --pretrained under TP2 x PP2 writes --save-peft and --save-hf; peft.PeftModel on the base in
transformers gives the merged export's logits (fp32, 1e-4). Its step-2 checkpoint resumed under PP2 (TP1) gives step 3
exactly; it holds the adapters and their optimizer state, not the frozen base, which it names (resuming from another
base, or none, is one line), and tools/convert_mcore_to_hf.py rebuilds the merged model from it. In: an adapter peft made (its own A for q and v, gate
and down only, B random) continues under TP2: at lr 0 the merged export equals PeftModel's logits, and --save-peft
gives the same tensors back (the parts it did not adapt as zeros); ours comes back at its rank and bit for bit.
Under FSDP2: our adapter in and out at lr 0 with the merged export's logits; from a random init the megatron engine's
losses, adapter-only checkpoints, exact resume on half the ranks.
A wrong base, a rank mismatch, DoRA, a non-LoRA tensor: one line, exit 2, before any process group.
"""

import json
import os

import pytest
import torch

from support import hf_fixtures
from support.ranks import run_ranks, run_script, run_tool

TARGETS = "qkv,proj,fc1,fc2"
COMMON = ["finetune_qwen.py", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-dir"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_fixtures.make_qwen(tmp_path_factory.mktemp("peft") / "base")


def logits(model_dir, adapter=None, vocab: int = 1000):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens).logits


def adapter_tensors(directory):
    return hf_fixtures.tensors(directory / "adapter_model.safetensors")


def train(base, tmp_path, world, *flags):
    run_ranks(world, COMMON + [str(tmp_path / "log"), "--pretrained", str(base), *map(str, flags)])


def test_trained_adapter_loads_in_peft_with_the_merged_logits(base, tmp_path):
    lora = ["--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", TARGETS, "--lr", "5e-2", "--train-iters", 3]
    train(base, tmp_path, 4, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, *lora,
          "--save-peft", tmp_path / "adapter", "--save-hf", tmp_path / "merged", "--save", tmp_path / "ckpt",
          "--save-interval", 2)
    # saved at step 2, resumed under PP2 alone (TP1: fc1's B resharded as gate and up): step 3 as the uninterrupted
    # run's (the base from --pretrained, the adapters and their AdamW state from the checkpoint)
    resumed = tmp_path / "resumed"
    train(base, resumed, 2, "--pipeline-model-parallel-size", 2, *lora, "--load", tmp_path / "ckpt" / "iter_0000002")
    losses = [[json.loads(line)["loss"] for line in (d / "log" / "metrics.jsonl").read_text().splitlines()]
              for d in (tmp_path, resumed)]
    assert len(losses[0]) == 3 and len(losses[1]) == 1 and abs(losses[1][0] - losses[0][2]) <= 1e-5 * losses[0][2]
    # The checkpoint holds the adapters and their AdamW state, not the frozen base, which it names
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt" / "iter_0000002"))
    assert saved and all(".lora_" in key for key in saved), sorted(saved)[:5]
    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "ckpt" / "iter_0000002"))
    assert common["lora_base"] == dict(pretrained=str(base), seed=1234, directory=str(base), revision=None)
    # the converter rebuilds the model from it: the base read where the run read it, the adapters merged
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "converted")
    torch.testing.assert_close(logits(tmp_path / "converted"), logits(tmp_path / "merged"), rtol=0, atol=1e-5)
    other = hf_fixtures.make_qwen(tmp_path / "other", seed=2)
    for flags, expected in (([], f"holds the LoRA adapters of a run from --pretrained {base}; resume with"),
                            (["--pretrained", str(other)], f"holds LoRA adapters for --pretrained {base}, not")):
        proc = run_script(COMMON[:-1] + [*flags, *map(str, lora), "--load", str(tmp_path / "ckpt")])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    assert config["base_model_name_or_path"] == str(base)
    tensors = adapter_tensors(tmp_path / "adapter")
    assert len(tensors) == 2 * 7 * 4 and all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "every B trained"
    merged, adapted = logits(tmp_path / "merged"), logits(base, tmp_path / "adapter")
    assert (adapted - logits(base)).abs().max() > 1e-2, "the adapter changes the model"
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-4)
    # under DP2 with the distributed optimizer, exported with nothing saved first: each rank's last step updated its
    # half of the adapters, the other half arrives by an all-gather the export (merging them) must wait for
    dp2 = tmp_path / "dp2_distopt"
    train(base, dp2, 2, *lora, "--use-distributed-optimizer", "--save-hf", dp2 / "merged")
    torch.testing.assert_close(logits(dp2 / "merged"), merged, rtol=0, atol=1e-4)

    # ours back in (its parts share A: rank 4 again), at lr 0 under FSDP2 over DP2 (drawn into each rank's shards):
    # the same tensors out, and the merged export gives the first run's logits
    again = tmp_path / "again"
    train(base, again, 2, "--engine", "fsdp", "--pretrained-adapter", tmp_path / "adapter", "--lr", 0,
          "--train-iters", 1, "--save-peft", again / "adapter", "--save-hf", again / "merged")
    back = adapter_tensors(again / "adapter")
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    torch.testing.assert_close(logits(again / "merged"), merged, rtol=0, atol=1e-5)


def test_fsdp_lora_from_a_random_init_checkpoints_the_adapters_and_resumes_exactly(tmp_path):
    """LoRA under FSDP2 x TP2 from a random init (built on the meta device, each rank drawing its shards, adapters
    included) gives the megatron engine's losses; its step-2 checkpoint holds the adapters and their AdamW state, not
    the frozen base, and resumed on half the ranks (TP2, DP1) gives step 3 as the uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    lora = ["--model", "tiny", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", TARGETS, "--lr", "5e-2",
            "--train-iters", "3", "--tensor-model-parallel-size", "2"]
    runs = {"megatron": (2, []), "fsdp": (4, ["--engine", "fsdp", "--save", str(tmp_path / "ckpt"),
                                             "--save-interval", "2"]),
            "resumed": (2, ["--engine", "fsdp", "--load", str(tmp_path / "ckpt" / "iter_0000002")])}
    losses = {}
    for name, (world, flags) in runs.items():
        run_ranks(world, COMMON + [str(tmp_path / name), *lora, *flags])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert [len(losses[k]) for k in ("megatron", "fsdp", "resumed")] == [3, 3, 1], losses
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses["fsdp"] + losses["resumed"],
                                                        losses["megatron"] + losses["megatron"][2:])), losses
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000002")).read_metadata().state_dict_metadata
    models = [k for k in keys if ".model." in k and not k.endswith("._extra_state")]  # (megatron-core's, empty)
    assert models and all(".lora_" in k for k in models), sorted(models)[:5]


def test_an_adapter_peft_trained_continues_with_its_logits(base, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                                      init_lora_weights=False))  # B random too: every part of the adapter counts
    model.save_pretrained(tmp_path / "theirs")
    theirs = adapter_tensors(tmp_path / "theirs")
    train(base, tmp_path, 2, "--tensor-model-parallel-size", 2, "--pretrained-adapter", tmp_path / "theirs",
          "--lr", 0, "--train-iters", 1, "--save-hf", tmp_path / "merged", "--save-peft", tmp_path / "out")
    torch.testing.assert_close(logits(tmp_path / "merged"), logits(base, tmp_path / "theirs"), rtol=0, atol=1e-4)
    out = adapter_tensors(tmp_path / "out")
    assert all(torch.equal(out[k], v) for k, v in theirs.items())
    assert all(not t.any() for k, t in out.items() if k not in theirs), "k_proj and up_proj: not adapted, zero"


@pytest.mark.parametrize("change, flags, expected", [
    ({}, ["--lora-rank", "8"], "--lora-rank 8 but --pretrained-adapter"),
    ({"base_model_name_or_path": "Qwen/Qwen2.5-7B"}, [], "was trained on Qwen/Qwen2.5-7B, not on --pretrained"),
    ({"use_dora": True}, [], "uses DoRA"),
    ({"peft_type": "IA3"}, [], "a IA3 adapter; only LoRA adapters load"),
    (None, [], "is not a LoRA A or B weight"),
])
def test_bad_adapters_are_one_line(base, tmp_path, change, flags, expected):
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
              "base_model_name_or_path": str(base), **(change or {})}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{name}.lora_A.weight": torch.zeros(4, 64), f"{name}.lora_B.weight": torch.zeros(256, 4)}
    if change is None:
        tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    proc = run_script(COMMON + [str(tmp_path / "log"), "--pretrained", str(base), "--pretrained-adapter",
                                str(adapter), "--train-iters", "1", *flags])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "log")


def test_moe_adapters_on_every_linear_round_trip_through_peft_and_resume_on_another_mesh(tmp_path):
    """LoRA on a Qwen2-MoE's attention, dense MLP, shared expert and routed experts (grouped adapters) under EP2:
    PeftModel on the base (experts through PEFT's target_parameters) gives the merged export's logits; the step-2
    checkpoint (adapters only) resumed under TP2+SP x EP2 gives step 3 exactly; the adapter read back with
    --pretrained-adapter and written again at lr 0 is bit for bit the same."""
    from test_convert_qwen_moe import make_hf_moe_model

    make_hf_moe_model(tmp_path / "base", mlp_only_layers=(1,))
    moe = tmp_path / "base"
    lora = ["--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", TARGETS, "--lr", "5e-2", "--train-iters", 3]
    train(moe, tmp_path, 2, "--expert-model-parallel-size", 2, *lora, "--save-peft", tmp_path / "adapter",
          "--save-hf", tmp_path / "merged", "--save", tmp_path / "ckpt", "--save-interval", 2)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]  # (the shared expert's and the dense layer's MLP)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    merged, adapted = logits(tmp_path / "merged", vocab=256), logits(moe, tmp_path / "adapter", vocab=256)
    assert (adapted - logits(moe, vocab=256)).abs().max() > 1e-2, "the adapter changes the model"
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-4)

    resumed = tmp_path / "resumed"
    train(moe, resumed, 2, "--tensor-model-parallel-size", 2, "--expert-model-parallel-size", 2,
          "--expert-tensor-parallel-size", 1, "--sequence-parallel", *lora, "--load", tmp_path / "ckpt" / "iter_0000002")
    losses = [[json.loads(line)["loss"] for line in (d / "log" / "metrics.jsonl").read_text().splitlines()]
              for d in (tmp_path, resumed)]
    assert len(losses[1]) == 1 and abs(losses[1][0] - losses[0][2]) <= 1e-5 * losses[0][2], losses
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt" / "iter_0000002"))
    assert any("experts.linear_fc1.lora_a" in key for key in saved), sorted(saved)
    assert all(".lora_" in key for key in saved), sorted(saved)

    again = tmp_path / "again"
    train(moe, again, 1, "--pretrained-adapter", tmp_path / "adapter", "--lr", 0, "--train-iters", 1,
          "--save-peft", again / "adapter")
    first, second = adapter_tensors(tmp_path / "adapter"), adapter_tensors(again / "adapter")
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_qwen3_moe_adapters_load_in_peft_with_the_merged_logits(tmp_path):
    """The same on a Qwen3-MoE (query/key norms, no shared expert, every layer MoE as in the published ones), on
    one rank. With a dense layer, fc1/fc2 adapters cannot be written for peft (it reads gate_proj as the experts'
    transformers-4 name): one line at start-up."""
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    mixed = hf_fixtures.make_qwen3(tmp_path / "mixed", moe=True)
    with pytest.raises(ConfigError, match="^--save-peft: peft reads a Qwen3-MoE adapter's gate_proj"):
        parse(["--pretrained", str(mixed), "--mock-data", "--lora-rank", "4", "--lora-targets", "qkv,fc1",
               "--save-peft", str(tmp_path / "x")])
    moe = hf_fixtures.make_qwen3(tmp_path / "base", moe=True, mlp_only_layers=())
    train(moe, tmp_path, 1, "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", TARGETS, "--lr", "5e-2",
          "--train-iters", 2, "--save-peft", tmp_path / "adapter", "--save-hf", tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    merged, adapted = logits(tmp_path / "merged"), logits(moe, tmp_path / "adapter")
    assert (adapted - logits(moe)).abs().max() > 1e-2, "the adapter changes the model"
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-4)


def test_expert_adapters_need_grouped_experts_under_expert_parallelism():
    """SequentialMLP's linears do their own expert communication, which LoRALinear's would not: refused at parse
    time (its dropout refusal: tests/models/test_moe.py); attention adapters keep their dropout."""
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    moe = ["--model", "tiny-moe", "--mock-data", "--lora-rank", "4"]
    assert parse([*moe, "--lora-targets", "qkv,proj", "--lora-dropout", "0.1"]).lora.dropout == 0.1
    with pytest.raises(ConfigError, match="^--no-moe-grouped-gemm: LoRA on the experts under expert"):
        parse([*moe, "--lora-targets", "fc1", "--no-moe-grouped-gemm", "--expert-model-parallel-size", "2"],
              world_size=2)


def test_save_peft_needs_a_lora_run_and_keeps_other_files(base, tmp_path):
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    proc = run_script(COMMON + [str(tmp_path / "log"), "--pretrained", str(base), "--save-peft", str(tmp_path / "a"),
                                "--train-iters", "1"])
    assert proc.returncode == 2 and "--save-peft" in proc.stderr and "--lora-rank" in proc.stderr
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds files that are not a PEFT adapter"):
        parse(["--pretrained", str(base), "--mock-data", "--lora-rank", "4", "--save-peft", str(tmp_path / "notes")])
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
