"""tools/verify_model.py: the parity card of a model built as its entry script builds it, against transformers.

A Qwen3-MoE under EP2 (its TP2+SP x EP2 card: docs/checkpoints.md), a Qwen2 slice (2 of its 4 layers) in bf16 with
LoRA, GPT-2 under FSDP2, Qwen3 under DeepSpeed ZeRO-3, a ViT classifier under PP2 x VPP2 with LoRA and an
in21k-style ViT backbone with a new head under ZeRO-3 pass every row (JSON too); planted mistakes on the real code
path (the loader swapping each KV group's key and value rows, Qwen3's query/key norms never applied, a Qwen3-MoE's
top-k probabilities left unnormalised, a ViT's key and value rows swapped) fail the card on its logit (feature)
rows, exit status 1; what it cannot check is one line, exit status 2. The tests' own logits and export checks
(tests/support/convert_worker.py, tests/support/vit_worker.py) call the same functions (megatron_ext/convert/verify.py).
"""

import json
import os
import subprocess
import sys

import pytest

from support import flag_values
from support import REPO, hf_fixtures
from support.ranks import run_ranks, run_script

LOGIT_ROWS = ("logits: max |ours - transformers|", "logits: mean |ours - transformers|", "top-1 agreement")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # a GPT-2 the shipped tiny GPT-2 tokenizer fits
    GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=128, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(root / "gpt2")
    shutil.copytree(os.path.join(hf_fixtures.REPO, "examples", "tokenizers", "tiny-gpt2"), root / "gpt2",
                    dirs_exist_ok=True)
    return dict(qwen=hf_fixtures.make_qwen(root / "qwen"), qwen3_moe=hf_fixtures.make_qwen3(root / "qwen3_moe", moe=True),
                qwen3=hf_fixtures.make_qwen3(root / "qwen3"), gpt2=root / "gpt2", root=root,
                vit=hf_fixtures.make_vit(root / "vit", classes=5), vit_backbone=hf_fixtures.make_vit(root / "vit_bb"))


def card(path):
    report = json.loads(path.read_text())
    return report, {row["name"]: row for row in report["rows"]}


def test_the_card_passes_under_a_mesh_and_on_a_slice(models, tmp_path):
    proc = run_ranks(2, ["tools/verify_model.py", "--pretrained", str(models["qwen3_moe"]),
                         "--expert-model-parallel-size", "2", "--card-json", str(tmp_path / "moe.json")])
    report, rows = card(tmp_path / "moe.json")
    assert report["passed"] and "=> PASS" in proc.stdout and "EP2" in report["mesh"], proc.stdout[-3000:]
    assert rows["--save-hf round trip"]["value"] == "bit-exact" and rows["top-1 agreement"]["value"] == 1.0
    assert rows["logits: max |ours - transformers|"]["limit"] == "<= 0.0001"
    run_ranks(1, ["tools/verify_model.py", "--pretrained", str(models["qwen"]), "--num-layers", "2", "--bf16",
                  "--lora-rank", "4", "--card-json", str(tmp_path / "slice.json")])
    report, rows = card(tmp_path / "slice.json")
    assert report["passed"] and "2 of 4 layers" in report["title"] and "bfloat16, LoRA" in report["title"], report
    assert rows["logits: max |ours - transformers|"]["limit"] == "<= 0.5"
    run_ranks(2, ["tools/verify_model.py", "--pretrained", str(models["gpt2"]), "--engine", "fsdp",
                  "--card-json", str(tmp_path / "gpt2.json")])  # pretrain_gpt.py's model: GPT-2 under FSDP2 (DP2)
    report, rows = card(tmp_path / "gpt2.json")
    assert report["passed"] and "(gpt2, " in report["title"] and "--engine fsdp" in report["title"], report
    run_ranks(2, ["tools/verify_model.py", "--pretrained", str(models["qwen3"]), "--engine", "deepspeed",
                  "--zero-stage", "3", "--card-json", str(tmp_path / "zero3.json")])  # built partitioned (zero.Init)
    report, rows = card(tmp_path / "zero3.json")
    assert report["passed"] and "--engine deepspeed (ZeRO-3)" in report["title"], report
    assert rows["parameters (ours / transformers)"]["passed"] and rows["--save-hf round trip"]["value"] == "bit-exact"


BF16_BANDS = ("logits: max |ours - transformers|", "logits: mean |ours - transformers|", "top-1 agreement",
              "per-token loss: max |difference|", "loss: ours - transformers")


def test_a_lora_adapter_is_checked_against_peft_and_each_bf16_band_catches_its_control(models, tmp_path):
    """A PEFT adapter with a random B (PEFT's B = 0 would hide a broken adapter forward), in bf16: the card against
    transformers + PEFT passes, the export (adapters folded in) = PEFT's merge_and_unload within one bf16 rounding;
    the planted control, LoRA's forward without alpha / rank, fails every bf16 band row while the export still
    passes (the merge scales)."""
    adapter = hf_fixtures.make_adapter(models["qwen"], models["root"] / "adapter", scale=0.5)  # (bf16 bands measured:
    # passing 0.023, 0.0033, 97%, 0.008, 1.7e-4; planted 1.18, 0.19, 29%, 0.56, 0.058)
    flags = ["tools/verify_model.py", "--pretrained", str(models["qwen"]), "--bf16", "--pretrained-adapter",
             str(adapter)]
    run_ranks(1, [*flags, "--card-json", str(tmp_path / "lora.json")])
    report, rows = card(tmp_path / "lora.json")
    assert report["passed"] and "bfloat16, LoRA" in report["title"], report
    assert rows["--save-hf round trip"]["value"] == "= PEFT's merge", rows
    proc = run_script(["tests/support/patched.py", "lora_unscaled", *flags, "--card-json", tmp_path / "planted.json"])
    assert proc.returncode == 1 and "=> FAIL" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    _, planted = card(tmp_path / "planted.json")
    assert [name for name in BF16_BANDS if planted[name]["passed"]] == [], planted
    assert all(rows[name]["passed"] for name in BF16_BANDS) and planted["--save-hf round trip"]["passed"], planted


def test_vit_cards(models, tmp_path):
    """pretrain_vit.py's model: a classifier under PP2 x VPP2 with LoRA (its logits and per-image loss; the adapters,
    merged on export, left out of the count), and a backbone whose new head only the run has, under ZeRO-3: checked
    on what that head reads, the class token's features."""
    run_ranks(2, ["tools/verify_model.py", "--pretrained", str(models["vit"]), "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1", "--lora-rank", "4",
                  "--card-json", str(tmp_path / "vit.json")])
    report, rows = card(tmp_path / "vit.json")
    assert report["passed"] and "(vit, 4 layers)" in report["title"] and "PP2 VPP2" in report["mesh"], report
    assert rows["top-1 agreement"]["value"] == 1.0 and rows["per-image loss: max |difference|"]["passed"], rows
    assert rows["parameters (ours / transformers)"]["passed"] and "loss: ours - transformers" in rows, rows
    run_ranks(2, ["tools/verify_model.py", "--pretrained", str(models["vit_backbone"]), "--num-classes", "3",
                  "--engine", "deepspeed", "--zero-stage", "3", "--card-json", str(tmp_path / "backbone.json")])
    report, rows = card(tmp_path / "backbone.json")
    assert report["passed"] and "a new 3-class head" in report["title"], report
    assert rows["class-token features: max |ours - transformers|"]["limit"] == "<= 0.0001", rows
    assert not any(name.startswith(("logits", "loss: ")) for name in rows), rows  # nothing to compare a new head with
    assert rows["--save-hf round trip"]["value"] == "bit-exact", rows


def test_a_vit_mistake_fails_its_card_under_the_launcher(models, tmp_path):
    """The loader swapping a ViT backbone's key and value rows, under TP2 through megatron_ext.launch with no port
    given (torchrun's own default: a free local one): the feature rows fail, and the launcher's last line says so,
    exit status 1."""
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.launch", "--nproc-per-node", "2", "tests/support/patched.py",
                           "qkv_transposed", "tools/verify_model.py", "--pretrained", str(models["vit_backbone"]),
                           "--tensor-model-parallel-size", "2", "--card-json", str(tmp_path / "card.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")})
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: patched.py: rank 0: verify_model: the card fails (its rows "
                                                    "above): the model is not the one transformers loads"), proc.stderr
    report, rows = card(tmp_path / "card.json")
    assert not rows["class-token features: max |ours - transformers|"]["passed"], rows
    assert rows["parameters (ours / transformers)"]["passed"] and rows["training path: loss - forward's"]["passed"]


@pytest.mark.parametrize("patch, model", [("qkv_transposed", "qwen"), ("no_qk_norm", "qwen3"),
                                          ("topk_unnormalised", "qwen3_moe")])
def test_a_planted_mistake_fails_the_card(models, tmp_path, patch, model):
    proc = run_script(["tests/support/patched.py", patch, "tools/verify_model.py", "--pretrained", models[model],
                       "--card-json", tmp_path / "card.json"])
    assert proc.returncode == 1 and "=> FAIL" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    report, rows = card(tmp_path / "card.json")
    assert not report["passed"] and not rows["logits: max |ours - transformers|"]["passed"], rows
    assert rows["--save-hf round trip"]["passed"] == (patch != "qkv_transposed")  # (the export splits as it fused)


def load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verify_model", os.path.join(REPO, "tools", "verify_model.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_an_interleaved_mesh_gets_its_micro_batches(models, monkeypatch):
    """TP2 x PP2 x VPP2 on 4 ranks: the mesh is read with enough micro-batches for the interleaved schedule (by
    hand, the card then passes: DP1 TP2 PP2 VPP2), and the batch is a multiple of PP."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    known, run, rows, family = load_tool().parse(["--pretrained", str(models["qwen"]), "--pipeline-model-parallel-size",
                                                  "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                                  "--tensor-model-parallel-size", "2"])
    assert run.mesh.vpp == 2 and rows == 4 and flag_values(run).global_batch_size == 4 and family == "qwen"


@pytest.mark.parametrize("flags, message", [
    ([], "give --pretrained"),
    (["--pretrained", "{qwen}", "--objective", "dpo"], "--objective is not checked here"),
    (["--pretrained", "{vit}", "--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported for ViT"),
])
def test_what_it_cannot_check_is_one_line(models, flags, message, monkeypatch):
    """Refused while parsing, before any process group (cli.run_main prints the line and exits 2)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    from megatron_ext.errors import ConfigError

    tool = load_tool()
    names = {"{qwen}": models["qwen"], "{vit}": models["vit"]}
    with pytest.raises(ConfigError, match=message) as error:
        tool.parse([str(names.get(f, f)) for f in flags])
    assert "\n" not in str(error.value)


def test_the_card_holds_no_optimizer_state(models, tmp_path):
    """A 0.34B-parameter Qwen3 (fp32, the real vocabulary: 1.35 GB) on one rank as a plain process: the card's peak
    RSS stays under 3.5x the model's bytes, 3x beyond a tiny model's card (the model, its gradients, then the
    reference in their place; the export compared a tensor at a time). With an lr-0 optimizer step (Adam's state),
    the engine alive beside the reference and both copies of the weights read whole it was 6.4x (8.6 GB)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    big = Qwen3ForCausalLM(Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                                       num_attention_heads=8, head_dim=128, num_key_value_heads=4, vocab_size=151936,
                                       max_position_embeddings=512, tie_word_embeddings=False))
    model_bytes = sum(p.numel() * 4 for p in big.parameters())
    big.save_pretrained(tmp_path / "big")
    del big
    for name in os.listdir(os.path.join(REPO, "examples", "tokenizers", "tiny-qwen3")):
        (tmp_path / "big" / name).write_bytes(open(os.path.join(REPO, "examples", "tokenizers", "tiny-qwen3", name),
                                                   "rb").read())
    measure = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 if code == 0 else -1)")
    peaks = {}
    for name, source in (("tiny", models["qwen3"]), ("big", tmp_path / "big")):
        proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "tools/verify_model.py", "--pretrained",
                               str(source)], cwd=REPO, capture_output=True, text=True, timeout=300)
        peaks[name] = int(proc.stdout.strip().splitlines()[-1])
        assert peaks[name] > 0 and "=> PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    # measured: 3.9 GB in all, 3.45 GB beyond the tiny card's 0.44 GB (2.9x and 2.6x the model's bytes)
    assert peaks["big"] <= 3.5 * model_bytes and peaks["big"] - peaks["tiny"] <= 3 * model_bytes, (peaks, model_bytes)
