"""HF <-> megatron-core conversion of ViT through the family-generic tools (tools/convert_*.py), offline.

A tiny random ViTForImageClassification (4 heads, distinct q/k/v, 5 classes; test_vit.hf_vit) is converted once;
the checkpoint must give transformers' logits under TP1, TP2 and PP2 (one torchrun launch), export back bit for
bit in fp32 and bf16, and fine-tune under PP2 with 7 classes from a new zero head. A headless in21k-style ViTModel
converts without a head and exports; an unknown recorded model_type is one line. The tools run in this process
(the CLI's exit codes are test_convert_qwen's): the imports are paid once. A naive [Q; K; V] fusion is caught by
test_vit's logits check, which the TP/PP logits here repeat through the checkpoint.
"""

import dataclasses
import json
import shutil

import pytest
import torch

from support.hf_fixtures import tensors
from support.ranks import run_ranks, run_tool
from test_vit import SHAPE, hf_vit

TOL = 1e-4
PROCESSOR = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
             "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def pixels(n, seed):
    return torch.randn(n, 3, SHAPE.image_size, SHAPE.image_size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted(single_rank, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_vit")
    hf, _ = hf_vit(root / "hf", num_labels=5)
    (root / "hf" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    run_tool("convert_hf_to_mcore", "--hf-path", root / "hf", "--save", root / "mcore")
    return root, hf


def test_checkpoint_gives_transformers_logits_under_tp1_tp2_pp2(converted):
    root, hf = converted
    torch.save(pixels(2, 2), root / "pixels.pt")
    run_ranks(2, ["tests/support/vit_worker.py", str(root / "hf"), str(root / "pixels.pt"), str(root / "out.pt"),
                  str(root / "mcore")])
    with torch.no_grad():
        expected = hf(pixel_values=pixels(2, 2)).logits
    results = torch.load(root / "out.pt")
    assert sorted(results) == ["pp2", "tp1", "tp2"]
    for layout, logits in results.items():
        assert logits.shape == (2, 5) and (logits - expected).abs().max().item() < TOL, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, dtype, tmp_path):
    from transformers import AutoImageProcessor, ViTForImageClassification

    root, _ = converted
    source, mcore = root / "hf", root / "mcore"
    if dtype == torch.bfloat16:  # a bf16 source stays bf16 through both tools
        source, mcore = tmp_path / "hf", tmp_path / "mcore"
        ViTForImageClassification.from_pretrained(root / "hf", dtype=dtype).save_pretrained(source)
        run_tool("convert_hf_to_mcore", "--hf-path", source, "--save", mcore)
    run_tool("convert_mcore_to_hf", "--load", mcore, "--save", tmp_path / "back")
    original, exported = tensors(source), tensors(tmp_path / "back")
    assert sorted(exported) == sorted(original) and "classifier.weight" in exported
    assert all(t.dtype == dtype and torch.equal(t, original[name]) for name, t in exported.items())
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(open(source / "config.json"))
    model = ViTForImageClassification.from_pretrained(tmp_path / "back", dtype="auto")
    reference = ViTForImageClassification.from_pretrained(source, dtype="auto")
    assert model.dtype == dtype and model.config.num_labels == 5
    assert all(torch.equal(t, reference.state_dict()[name]) for name, t in model.state_dict().items())
    if dtype == torch.float32:  # the source's preprocessor_config.json travels through the checkpoint
        assert json.load(open(tmp_path / "back" / "preprocessor_config.json")) == PROCESSOR
        assert list(AutoImageProcessor.from_pretrained(tmp_path / "back").image_std) == PROCESSOR["image_std"]


def test_headless_backbone_converts_exports_and_finetunes_with_a_new_head(single_rank, tmp_path):
    """An in21k-style ViTModel (no 'vit.' prefix, no classifier, a pooler) gives a checkpoint without a head; the
    export is the same backbone for transformers, and --finetune's loader starts a zero head on it."""
    from megatron.core import dist_checkpointing
    from transformers import ViTConfig, ViTModel

    from megatron_ext.mesh import Mesh
    from megatron_ext.models import hf_rules
    from megatron_ext.models.vit import hf as convert
    from megatron_ext.models.vit import model as vit
    from megatron_ext import checkpoint

    config = ViTConfig(hidden_size=SHAPE.hidden_size, num_hidden_layers=SHAPE.num_layers,
                       num_attention_heads=SHAPE.num_attention_heads, intermediate_size=SHAPE.ffn_hidden_size,
                       image_size=SHAPE.image_size, patch_size=SHAPE.patch_size)
    torch.manual_seed(3)
    backbone = ViTModel(config).eval()
    with torch.no_grad():
        for param in backbone.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    backbone.save_pretrained(tmp_path / "in21k")
    original = tensors(tmp_path / "in21k")
    assert "pooler.dense.weight" in original and not any(n.startswith("vit.") for n in original)
    run_tool("convert_hf_to_mcore", "--hf-path", tmp_path / "in21k", "--save", tmp_path / "mcore")
    record = dist_checkpointing.load_common_state_dict(str(tmp_path / "mcore"))
    assert record["model_type"] == "vit" and record["num_classes"] is None
    assert not any(k.startswith("head.") for k in dist_checkpointing.load_tensors_metadata(str(tmp_path / "mcore")))

    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    exported = tensors(tmp_path / "back")
    assert sorted(exported) == sorted(f"vit.{n}" for n in original if not n.startswith("pooler."))
    assert all(torch.equal(t, original[name[len("vit."):]]) for name, t in exported.items())
    assert json.load(open(tmp_path / "back" / "config.json")) == json.load(open(tmp_path / "in21k" / "config.json"))
    with torch.no_grad():
        ours = ViTModel.from_pretrained(tmp_path / "back", add_pooling_layer=False).eval()(pixels(2, 4))
        assert torch.equal(ours.last_hidden_state, backbone(pixels(2, 4)).last_hidden_state)

    model = vit.ViTClassifier(vit.transformer_config(SHAPE, Mesh(world=1)), SHAPE, 7)
    fresh = checkpoint.load_weights(str(tmp_path / "mcore"), [model], dataclasses.asdict(SHAPE),
                                    replaceable={"head.weight", "head.bias"})
    assert sorted(fresh) == ["head.bias [7] (--load has none)", "head.weight [7, 64] (--load has none)"]
    assert not model.head.weight.any() and not model.head.bias.any()
    body = hf_rules.hf_to_mcore(convert, original, SHAPE)
    assert all(torch.equal(p, body[n]) for n, p in model.named_parameters() if not n.startswith("head."))


def test_finetune_with_another_class_count_starts_from_a_zero_head(converted, tmp_path):
    """pretrain_vit.py --finetune --num-classes 7 from the 5-class checkpoint under PP2 (the head on the last stage,
    rank 0 reports it); --lr 0 keeps every weight, so the export is the source's body and a 7-row zero head."""
    from transformers import ViTForImageClassification

    root, _ = converted
    proc = run_ranks(2, ["pretrain_vit.py", "--model", "tiny", "--mock-data", "--load", str(root / "mcore"),
                         "--finetune", "--num-classes", "7", "--pipeline-model-parallel-size", "2",
                         "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "0",
                         "--save", str(tmp_path / "ft")])
    assert ("new, zero-initialised: head.bias [7] (--load has [5]), head.weight [7, 64] (--load has [5, 64])"
            in proc.stdout), proc.stdout
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ft", "--save", tmp_path / "hf")
    original, exported = tensors(root / "hf"), tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], original[n]) for n in original if not n.startswith("classifier."))
    assert exported["classifier.weight"].shape == (7, SHAPE.hidden_size) and exported["classifier.bias"].shape == (7,)
    assert not exported["classifier.weight"].any() and not exported["classifier.bias"].any()
    assert ViTForImageClassification.from_pretrained(tmp_path / "hf").config.num_labels == 7
    processor = json.load(open(tmp_path / "hf" / "preprocessor_config.json"))  # none recorded: 0.5, the image size
    assert processor["image_mean"] == [0.5] * 3 and processor["size"] == {"height": 32, "width": 32}


def test_recorded_family_unknown_is_one_line_and_old_checkpoints_are_recognised(converted, tmp_path):
    from megatron_ext.errors import ConfigError

    root, _ = converted
    shutil.copytree(root / "mcore", tmp_path / "ckpt")
    common_path = tmp_path / "ckpt" / "common.pt"
    common = torch.load(common_path, weights_only=False)
    torch.save(dict(common, model_type="llama"), common_path)
    with pytest.raises(ConfigError) as error:
        run_tool("convert_mcore_to_hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "out")
    assert str(error.value) == (f"--load {tmp_path / 'ckpt'} (recorded in the checkpoint): model_type 'llama' is not "
                                "supported; supported: qwen2, qwen2_moe, qwen3, qwen3_moe, vit, gpt2")
    # Written before checkpoints recorded their family or HF config: ViT by its shape's fields, labels by its head.
    old = {k: v for k, v in common.items() if k not in ("model_type", "hf_config", "hf_files")}
    torch.save(old, common_path)
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "out")
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["model_type"] == "vit" and len(config["id2label"]) == 5 and config["dtype"] == "float32"
    assert sorted(tensors(tmp_path / "out")) == sorted(tensors(root / "hf"))
