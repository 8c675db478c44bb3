"""--pretrained and --save-hf, offline: tiny Hugging Face models of every family (sharded, with an index; as a hub
cache too, used by hub id under HF_HUB_OFFLINE=1) loaded straight into each rank's shards.

- logits equal transformers' under every mesh the converters are proven on (one 4-rank launch for the language
  families, ViT classifier and backbone under TP1/TP2/PP2);
- with lr 0, every step's loss equals transformers' loss on that step's batch (a padded vocabulary under TP2
  included), on each engine, and --save-hf gives back every tensor bit for bit in its dtype (so optimizers that keep
  fp32 master copies started from the loaded values);
- a dense source upcycles into an MoE model with the dense model's loss; the export is a Qwen2-MoE transformers
  runs with the same logits;
- after real training, transformers' loss on the export equals the run's own evaluation; a resumed run ignores
  --pretrained;
- bad sources: tests/convert/test_convert_pretrained_inputs.py.
"""

import json

import pytest
import torch

from support import faults, hf_fixtures
from support.ranks import run_ranks
from support.pretrained_runs import (DOCUMENTS, SEQ, assert_same_tensors, hf_losses, offline, per_document_losses,
                             short_documents, train)
from support.step_checks import assert_close, by_step, records, worst

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_convert_gpt2 import make_hf_gpt2
    from test_convert_qwen_moe import CONFIGS, make_hf_moe_model

    root = tmp_path_factory.mktemp("pretrained")
    out = {"root": root, "cache": root / "hub"}
    out["qwen"] = hf_fixtures.make_qwen(root / "qwen")
    out["qwen_bf16"] = hf_fixtures.make_qwen(root / "qwen_bf16", dtype=torch.bfloat16, seed=3)
    out["qwen_untied"] = hf_fixtures.make_qwen(root / "qwen_untied", tied=False, vocab=200, seed=2)
    make_hf_moe_model(root / "moe", **CONFIGS["renorm_mixed"])
    out["moe"] = root / "moe"
    make_hf_gpt2(root / "gpt2")
    out["gpt2"] = root / "gpt2"
    out["qwen3"] = hf_fixtures.make_qwen3(root / "qwen3")
    out["qwen3_moe"] = hf_fixtures.make_qwen3(root / "qwen3_moe", moe=True, tied=True)
    out["vit"] = hf_fixtures.make_vit(root / "vit", classes=5)
    out["vit_backbone"] = hf_fixtures.make_vit(root / "vit_backbone", classes=None)
    hf_fixtures.as_hub_cache(out["qwen"], out["cache"], "tiny-org/qwen")
    return out


def test_logits_match_transformers_under_every_mesh(models):
    """Qwen2 (tied with a padded vocabulary, untied) and GPT-2 under TP1, TP2, PP2, TP2 x PP2, PP2 x VPP2 and CP2,
    Qwen2-MoE under TP1, TP2, EP2, EP4, TP2+SP x EP2, PP2 x EP2, PP2, PP2 x VPP2 and CP2, Qwen3 (untied, a head
    dimension twice hidden / heads) under TP1, TP2, PP2 and CP2, Qwen3-MoE (tied, no shared expert, one dense layer)
    under TP1, TP2, EP2, TP2+SP x EP2, PP2 and CP2, a ViT classifier and
    backbone under TP2 x PP2, read by the --pretrained loader (tests/support/convert_worker.py); each language layout exported
    again bit for bit. GPT-2 on the engines that shard what was loaded, TP2 x DP2 with the distributed optimizer and
    under ZeRO-3: two lr-0 steps' losses equal transformers' (1e-5), and the export after them is bit-exact. A wide
    vocabulary's export under TP2 and ZeRO-3 TP2 x DP2 holds at most a quarter of the embedding above the model
    (streamed in blocks; gathering it whole costs at least twice it). Converted checkpoints (tools/convert_hf_to_mcore)
    loaded resharded by megatron-core's dist-checkpoint: Qwen2 under TP2 x PP2, PP2 x VPP2 and CP2, the MoE models
    under TP2+SP x EP2 and PP2 x VPP2, GPT-2 under TP2 x PP2."""
    from support.ranks import run_tool

    out = models["root"] / "logits.json"
    models["wide"] = hf_fixtures.make_qwen(models["root"] / "wide", vocab=2**17, seed=5)
    ckpt = {"qwen": "tp2_pp2,pp2_vpp2,cp2", "qwen_untied": "tp2_pp2,pp2_vpp2,cp2", "moe": "tp2_sp_ep2,pp2_vpp2",
            "qwen3_moe": "tp2_sp_ep2,pp2_vpp2", "gpt2": "tp2_pp2"}
    for name in ckpt:
        if not (models["root"] / f"{name}_mcore").exists():
            run_tool("convert_hf_to_mcore", "--hf-path", models[name], "--save", models["root"] / f"{name}_mcore")
    run_ranks(4, ["tests/support/convert_worker.py", str(out)] +
              [f"{models[k]}:hf={models[k]}" for k in ("qwen", "moe", "gpt2")] +
              [f"{models['qwen_untied']}:hf={models['qwen_untied']}@tp2_pp2,pp2_vpp2,cp2"] +  # its own output layer
              [f"{models['qwen3']}:hf={models['qwen3']}@tp2,pp2,cp2",  # (one rank: tests/models/test_qwen3.py)
               f"{models['qwen3_moe']}:hf={models['qwen3_moe']}@tp2,ep2,tp2_sp_ep2,pp2,cp2"] +
              [f"{models[name]}:{models['root'] / f'{name}_mcore'}@{layouts}" for name, layouts in ckpt.items()] +
              [f"vit:{models['vit']}", f"vit:{models['vit_backbone']}", f"memory:{models['wide']}",
               f"engines:{models['gpt2']}"])
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))
    engines = {k: v for k, v in results.items() if k.startswith("engine/")}
    assert sorted(engines) == [f"engine/gpt2/{name}{end}" for name in ("distopt_tp2_dp2", "zero3_tp2_dp2")
                               for end in ("", "/export")], engines
    assert all(0 <= v < TOL if not k.endswith("/export") else v == 0 for k, v in engines.items()), engines
    results = {k: v for k, v in results.items() if k not in engines}
    resharded = {k: v for k, v in results.items() if "@ckpt/" in k}
    assert len(resharded) == 3 + 3 + 2 + 2 + 1 and all(0 <= d < 1e-4 for d in resharded.values()), resharded
    results = {k: v for k, v in results.items() if k not in resharded}
    logits = {k: v for k, v in results.items() if not k.startswith("wide/") and not k.endswith("/export")}
    assert len(logits) == 2 * 6 + 3 + 9 + 3 + 5 + 2 and all(0 <= d < 1e-4 for d in logits.values()), logits
    assert sum(k.startswith("qwen3") for k in logits) == 3 + 5, logits
    exports = {k: v for k, v in results.items() if k.endswith("/export")}
    assert len(exports) == 2 * 6 + 3 + 9 + 3 + 5 + 2 and not any(exports.values()), exports
    peaks = {k: v for k, v in results.items() if k.endswith("/export_peak")}
    assert sorted(peaks) == ["wide/tp2/export_peak", "wide/zero3_tp2/export_peak"], results
    assert all(0 <= v < 0.25 for v in peaks.values()), peaks


def test_naive_tensor_parallel_slicing_is_caught(models):
    """Negative control: TP ranks taking plain 1/TP row slices of the sources (no per-group QKV, no [gate_r; up_r])
    match under TP1 and PP2 but not under TP2."""
    out = models["root"] / "logits_wrong.json"
    run_ranks(4, ["tests/support/patched.py", "pretrained_plain_rows", "tests/support/convert_worker.py", str(out),
                  f"{models['qwen']}:hf={models['qwen']}"])
    diffs = json.loads(out.read_text())
    assert worst([diffs["qwen/tp1"], diffs["qwen/pp2"]]) < 1e-4 and min(diffs["qwen/tp2"], diffs["qwen/tp2_pp2"]) > 0.1


@pytest.mark.parametrize("kind", ["vit", "vit_backbone"])
def test_vit_logits_match_transformers(models, kind):
    """ViTForImageClassification, and an in21k-style ViTModel backbone (its class-token features, through an
    identity head on the fresh one), under TP1, TP2 and PP2 (tests/support/vit_worker.py)."""
    from transformers import ViTForImageClassification, ViTModel

    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    torch.save(pixels, models["root"] / "pixels.pt")
    out = models["root"] / f"{kind}.pt"
    run_ranks(2, ["tests/support/vit_worker.py", str(models[kind]), str(models["root"] / "pixels.pt"), str(out), "hf"])
    with torch.no_grad():
        if kind == "vit":
            expected = ViTForImageClassification.from_pretrained(models[kind]).eval()(pixel_values=pixels).logits
        else:
            model = ViTModel.from_pretrained(models[kind], add_pooling_layer=False).eval()
            expected = model(pixel_values=pixels).last_hidden_state[:, 0]
    results = torch.load(out)
    assert sorted(results) == ["pp2", "tp1", "tp2"]
    assert all((logits - expected).abs().max().item() < 1e-4 for logits in results.values()), results


ENGINES = {  # name: (source, flags); fp32, losses to 1e-5
    "megatron_tp2_hub": ("tiny-org/qwen", ["--tensor-model-parallel-size", "2"]),
    "megatron_cp2": ("qwen", ["--context-parallel-size", "2"]),
    "megatron_dp2_distopt": ("qwen", ["--use-distributed-optimizer"]),
    "zero3_dp2": ("qwen", ["--engine", "deepspeed", "--zero-stage", "3"]),
    "deepspeed_pp2": ("qwen", ["--engine", "deepspeed", "--pipeline-model-parallel-size", "2"]),
    "fsdp_dp2_save_hf_bf16": ("qwen", ["--engine", "fsdp", "--save-hf-dtype", "bf16"]),
    "qwen3_megatron_tp2_sp_save_hf_bf16": ("qwen3", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                     "--save-hf-dtype", "bf16"]),
    "qwen3_moe_ep2_grouped_distopt": ("qwen3_moe", ["--expert-model-parallel-size", "2", "--moe-aux-loss-scope",
                                                    "model", "--moe-aux-loss-coeff", "1e-3",
                                                    "--use-distributed-optimizer"]),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_losses_equal_transformers_and_export_is_bit_exact(models, engine, tmp_path):
    """Every tensor back bit for bit in the run's dtype, or (--save-hf-dtype bf16) each the source's cast to it."""
    source, flags = ENGINES[engine]
    hub = source.startswith("tiny-org/")
    proc = train(2, "finetune_qwen.py", source if hub else models[source], tmp_path, *flags,
                 env=offline(models["cache"]) if hub else None)
    assert f"weights from --pretrained {source if hub else models[source]}" in proc.stdout
    local = models["qwen"] if hub else models[source]
    assert_close(by_step(records(tmp_path / "logs")), hf_losses(local, [1, 2], hf_fixtures.QWEN_VOCAB), TOL,
                 steps=[1, 2])
    if "--save-hf-dtype" in flags:
        exported, expected = hf_fixtures.tensors(tmp_path / "hf"), hf_fixtures.tensors(local)
        assert sorted(exported) == sorted(expected)
        assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t.to(torch.bfloat16))
                   for n, t in expected.items())
        assert "bfloat16" in (tmp_path / "hf" / "config.json").read_text()
        return
    assert_same_tensors(tmp_path / "hf", local)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == {**json.loads((local / "config.json").read_text()), **{k: config[k] for k in ("dtype",)
                                                                              if k in config}}
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == 1024
    assert (tmp_path / "hf" / "generation_config.json").exists()


@pytest.mark.parametrize("flags", [["--use-distributed-optimizer"],
                                   ["--expert-model-parallel-size", "2", "--no-moe-grouped-gemm"]],
                         ids=["grouped_dp2_distopt", "sequential_ep2"])
def test_moe_source_exports_bit_exact(models, tmp_path, flags):
    """Grouped experts under DP2 with the distributed optimizer (experts and dense parameters sharded over DP2),
    SequentialMLP under EP2 (grouped EP2: the upcycling test below and tests/support/convert_worker.py)."""
    train(2, "finetune_qwen.py", models["moe"], tmp_path, *flags)
    assert_close(by_step(records(tmp_path / "logs")), hf_losses(models["moe"], [1, 2], 256), TOL, steps=[1, 2])
    assert_same_tensors(tmp_path / "hf", models["moe"])


@pytest.mark.parametrize("source, flags, model_type", [
    ("qwen", ["--moe-shared-expert-intermediate-size", "128"], "qwen2_moe"),
    ("qwen3", [], "qwen3_moe")])
def test_dense_source_upcycles_into_moe_with_the_dense_loss(models, tmp_path, source, flags, model_type):
    """--num-experts 4 over a dense Qwen2 (Qwen3) source: experts are the dense MLP, the router small and random, so
    the loss is the dense model's; the export is a Qwen2-MoE (a Qwen3-MoE, without shared expert) that transformers
    runs with the dense logits."""
    from transformers import AutoModelForCausalLM

    proc = train(2, "finetune_qwen.py", models[source], tmp_path, "--num-experts", "4", *flags,
                 "--expert-model-parallel-size", "2")
    assert "upcycled to MoE while loading" in proc.stdout
    assert_close(by_step(records(tmp_path / "logs")), hf_losses(models[source], [1, 2], hf_fixtures.QWEN_VOCAB),
                 TOL, steps=[1, 2])
    tokens = torch.randint(0, 1024, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        dense = AutoModelForCausalLM.from_pretrained(models[source]).eval()
        assert moe.config.model_type == model_type and moe.config.num_experts == 4
        assert (moe(tokens).logits - dense(tokens).logits).abs().max().item() < 1e-4


def test_gpt2_under_pp2(models, tmp_path):
    train(2, "pretrain_gpt.py", models["gpt2"], tmp_path, "--pipeline-model-parallel-size", "2")
    from test_convert_gpt2 import SHAPE

    assert_close(by_step(records(tmp_path / "logs")), hf_losses(models["gpt2"], [1, 2], SHAPE.vocab_size,
                                                                  family="gpt"), TOL,
                 steps=[1, 2])
    assert_same_tensors(tmp_path / "hf", models["gpt2"])


@pytest.mark.parametrize("source, flags, vocab", [
    ("qwen", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], hf_fixtures.QWEN_VOCAB),
    ("qwen3", ["--pipeline-model-parallel-size", "2"], hf_fixtures.QWEN_VOCAB),
    ("moe", ["--expert-model-parallel-size", "2"], 256)], ids=["qwen2_tp2_sp", "qwen3_pp2", "qwen2_moe_ep2"])
def test_qwen_continued_pretraining_under_pretrain_gpt(models, tmp_path, source, flags, vocab):
    """pretrain_gpt.py --pretrained a Qwen (a Qwen2-MoE under EP2 too): megatron-core's pretraining samples through
    finetune_qwen.py's model; with lr 0 each step's loss is transformers' on that step's batch, and the export is the
    source bit for bit."""
    proc = train(2, "pretrain_gpt.py", models[source], tmp_path, *flags)
    assert f"weights from --pretrained {models[source]}" in proc.stdout
    assert_close(by_step(records(tmp_path / "logs")), hf_losses(models[source], [1, 2], vocab, family="gpt"), TOL,
                 steps=[1, 2])
    assert_same_tensors(tmp_path / "hf", models[source])


@pytest.mark.parametrize("flags", [[], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
                         ids=["dp2", "tp2_sp"])
def test_documents_attend_only_within_themselves(models, tmp_path, flags):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss (Megatron-LM's) continuing a Qwen's pretraining:
    with lr 0 each step's loss is transformers' over the samples' documents run one by one; attending across them
    (without the flags) is not."""
    data = short_documents(tmp_path)
    common = ["pretrain_gpt.py", "--pretrained", str(models["qwen"]), *data, "--seq-length", str(SEQ),
              "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "0"]
    run_ranks(2, common + DOCUMENTS + flags + ["--log-dir", str(tmp_path / "docs")])
    expected = per_document_losses(models["qwen"], data, [1, 2])
    assert_close(by_step(records(tmp_path / "docs")), expected, TOL, steps=[1, 2])
    if not flags:
        run_ranks(2, common + ["--eod-mask-loss", "--log-dir", str(tmp_path / "across")])
        across = by_step(records(tmp_path / "across"))
        assert worst(abs(across[s] - expected[s]) for s in (1, 2)) > 1e-3, (across, expected)


def test_vit_backbone_gets_a_new_head_and_exports_a_classifier(models, tmp_path):
    """Under DP2 with the distributed optimizer: after an lr-0 step (each rank updating its shard of the fp32
    parameters, then gathering them) every backbone tensor comes back bit for bit."""
    from transformers import ViTForImageClassification

    proc = train(2, "pretrain_vit.py", models["vit_backbone"], tmp_path, "--use-distributed-optimizer",
                 "--num-classes", "3")
    assert "new, zero-initialised: head.bias [3], head.weight [3, 64]" in proc.stdout
    model = ViTForImageClassification.from_pretrained(tmp_path / "hf")
    assert model.config.num_labels == 3
    exported = hf_fixtures.tensors(tmp_path / "hf")
    backbone = hf_fixtures.tensors(models["vit_backbone"])
    for name, tensor in backbone.items():
        if not name.startswith("pooler."):
            assert torch.equal(exported[f"vit.{name}"], tensor), name
    assert not exported["classifier.weight"].any()  # lr 0: the new head stays at zero


def test_trained_export_matches_the_runs_evaluation_and_resume_ignores_pretrained(models, tmp_path):
    """Two steps of a 3-step schedule with --pretrained and --save, then the same command resumed to step 3 with an
    evaluation: the resumed run says it does not read --pretrained, and transformers' loss on the export's
    validation batch equals the run's own val_loss."""
    common = ["--tensor-model-parallel-size", "2", "--lr", "1e-3", "--lr-decay-iters", "3", "--save", tmp_path / "ckpt",
              "--load", tmp_path / "ckpt", "--eval-interval", "3", "--eval-iters", "1"]
    train(2, "finetune_qwen.py", models["qwen"], tmp_path, *common, steps=2)
    proc = train(2, "finetune_qwen.py", models["qwen"], tmp_path, *common, steps=3)
    assert f"holds a checkpoint of this run: resuming it, --pretrained {models['qwen']} is not read" in proc.stdout
    val = [r for r in records(tmp_path / "logs") if r.get("val_loss") is not None][-1]
    assert val["step"] == 3
    expected = hf_losses(tmp_path / "hf", [-1], hf_fixtures.QWEN_VOCAB)[-1]
    assert abs(val["val_loss"] - expected) < 1e-4, (val["val_loss"], expected)
    trained, source = hf_fixtures.tensors(tmp_path / "hf"), hf_fixtures.tensors(models["qwen"])
    assert not torch.equal(trained["model.norm.weight"], source["model.norm.weight"])


def test_vit_lora_export_is_merged(models, tmp_path):
    """LoRA over a --pretrained 5-class classifier fine-tuned for 3 classes: the head starts afresh (one line); the
    export is a plain 3-class ViTForImageClassification with the adapters folded into the fused QKV they wrap;
    every other backbone tensor is the source's, bit for bit (frozen)."""
    from transformers import ViTForImageClassification

    proc = train(2, "pretrain_vit.py", models["vit"], tmp_path, "--tensor-model-parallel-size", "2",
                 "--num-classes", "3", "--lora-rank", "4", "--lr", "1e-2", steps=3)
    assert proc.stdout.count("new, zero-initialised: head.bias [3], head.weight [3, 64]") == 1, proc.stdout
    assert ViTForImageClassification.from_pretrained(tmp_path / "hf").config.num_labels == 3
    exported, source = hf_fixtures.tensors(tmp_path / "hf"), hf_fixtures.tensors(models["vit"])
    assert exported["classifier.weight"].shape == (3, 64) and exported["classifier.weight"].any()
    assert sorted(exported) == sorted(name for name in source if not name.startswith("vit.pooler"))
    for name in exported:
        changed = not torch.equal(exported[name], source[name])
        assert changed == (".attention.attention." in name and name.endswith("weight") or
                           name.startswith("classifier.")), name


def test_our_checkpoint_as_pretrained_and_export_on_a_signal(models, tmp_path):
    """--pretrained one of our checkpoints (tools/convert_hf_to_mcore.py's, of a Qwen3) is --load --finetune: under
    TP2 with lr 0 the losses are transformers'; a SIGTERM at step 2 of 5 exits gracefully, and the export is still
    written."""
    from support.ranks import run_tool

    run_tool("convert_hf_to_mcore", "--hf-path", models["qwen3"], "--save", tmp_path / "mcore")
    proc = train(2, "finetune_qwen.py", tmp_path / "mcore", tmp_path, "--hf-config", models["qwen3"],
                 "--tokenizer", models["qwen3"], "--tensor-model-parallel-size", "2", "--save", tmp_path / "ckpt",
                 env=faults.env("sigterm@2"), steps=5)
    assert f"weights from --pretrained {tmp_path / 'mcore'}" in proc.stdout
    assert "exiting (the same command with --load resumes)" in proc.stdout
    assert_close(by_step(records(tmp_path / "logs")), hf_losses(models["qwen3"], [1, 2], hf_fixtures.QWEN_VOCAB),
                 TOL, steps=[1, 2])
    assert f"Hugging Face model written to --save-hf {tmp_path / 'hf'}" in proc.stdout
    # its size in a unit that shows it (a tiny model's MiB, not "0.00 GiB"): the bytes of its tensors
    from megatron_ext.convert.export import size

    total = sum(t.numel() * t.element_size() for t in hf_fixtures.tensors(tmp_path / "hf").values())

    assert f"(float32, {size(total)})" in proc.stdout and total < 2**30 and not size(total).startswith("0"), \
        proc.stdout[-2000:]
    assert [size(n) for n in (17, 290_000, 5_000_000, 3_100_000_000)] == ["17 bytes", "283 KiB", "4.77 MiB", "2.89 GiB"]
    assert_same_tensors(tmp_path / "hf", models["qwen3"])


def test_gpt2_under_fsdp_and_vit_under_zero3(models, tmp_path):
    """The other families on the engines that shard the model itself: GPT-2 under FSDP DP2 (losses are
    transformers'), a ViT classifier under ZeRO-3 DP2 (built partitioned); both give every tensor back bit for bit."""
    from test_convert_gpt2 import SHAPE

    train(2, "pretrain_gpt.py", models["gpt2"], tmp_path / "gpt2", "--engine", "fsdp")
    assert_close(by_step(records(tmp_path / "gpt2" / "logs")), hf_losses(models["gpt2"], [1, 2], SHAPE.vocab_size,
                                                                  family="gpt"),
                 TOL, steps=[1, 2])
    assert_same_tensors(tmp_path / "gpt2" / "hf", models["gpt2"])
    proc = train(2, "pretrain_vit.py", models["vit"], tmp_path / "vit", "--engine", "deepspeed", "--zero-stage", "3",
                 "--num-classes", "5")
    assert "new, zero-initialised" not in proc.stdout  # the source's classifier has the 5 classes
    assert_same_tensors(tmp_path / "vit" / "hf", models["vit"])


def test_export_on_a_time_limit_keeps_bf16_and_stops_generation_at_the_end_of_a_turn(models, tmp_path):
    """A bf16 run stopped by --exit-duration-in-mins after its first step still exports, bf16 kept bit for bit. A
    chat fine-tune of a base model ends its turns with <|im_end|>: the export's generation config stops there as
    well as at the base model's EOS (else transformers and vLLM generate past the answer)."""
    proc = train(1, "finetune_qwen.py", models["qwen_bf16"], tmp_path, "--bf16", "--exit-duration-in-mins", "1e-6",
                 steps=3)
    assert "--exit-duration-in-mins 1e-06 reached: nothing saved (no --save); exiting" in proc.stdout
    assert [r["step"] for r in records(tmp_path / "logs")] == [1]
    assert f"Hugging Face model written to --save-hf {tmp_path / 'hf'} (bfloat16" in proc.stdout
    assert_same_tensors(tmp_path / "hf", models["qwen_bf16"])
    from transformers import AutoTokenizer, GenerationConfig

    im_end = AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == [2, im_end]  # the source's eos is 2
    from support.ranks import run_tool  # the offline converter does the same with the files it copies

    run_tool("convert_hf_to_mcore", "--hf-path", models["qwen"], "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back", "--tokenizer",
             models["qwen"])
    assert GenerationConfig.from_pretrained(tmp_path / "back").eos_token_id == [2, im_end]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pretrained_load_and_save_hf_on_the_gpu(models, tmp_path, dtype):
    """On one GPU as a plain process: --pretrained puts the weights on the device, two lr-0 steps give
    transformers' losses (fp32: 1e-4 with the GPU's kernels; bf16: 2e-2 of bf16 rounding), and --save-hf brings every
    tensor back from the GPU bit for bit in its dtype."""
    source = models["qwen" if dtype == "fp32" else "qwen_bf16"]
    proc = train(1, "finetune_qwen.py", source, tmp_path, *(["--bf16"] if dtype == "bf16" else []))
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["run"]["device"] == "cuda", proc.stdout
    expected = hf_losses(source, [1, 2], hf_fixtures.QWEN_VOCAB, dtype=torch.float32)
    assert_close(by_step(records(tmp_path / "logs")), expected, 1e-4 if dtype == "fp32" else 2e-2, steps=[1, 2])
    assert_same_tensors(tmp_path / "hf", source)
