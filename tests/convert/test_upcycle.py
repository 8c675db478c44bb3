"""tools/upcycle_moe.py: a dense Qwen2 becomes a Qwen2-MoE computing the same function at step 0, and trains.

The claim is exact function preservation (renormalised top-k, copies or G slices of the dense MLP with down_proj
scaled by G, router rows shared within each group of G, a shared expert whose output starts at 0): the upcycled
model's fp32 logits equal the dense model's, in transformers and in our megatron-core model after conversion, for
G=1 and G=2. Each ingredient left out (no renormalisation, no scaling, no grouped router rows) breaks it, so the
tests have teeth. Then a few SFT steps from the converted checkpoint must lower the loss.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from support import REPO, hf_fixtures
from support.ranks import run_tool
from support.hf_fixtures import tensors as hf_tensors

TOL, WRONG = 1e-5, 1e-3
TOKENIZER = os.path.join(REPO, "examples/tokenizers/tiny-qwen")
UPCYCLES = {"g1": ["--num-experts", "4", "--moe-router-topk", "2"],
            "g2": ["--num-experts", "8", "--moe-router-topk", "4", "--granularity", "2"]}


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory):
    root = tmp_path_factory.mktemp("upcycle")
    # a random tiny Qwen2 with the shipped tokenizer's vocabulary (1024), its tokenizer files beside it
    hf_fixtures.make_qwen(root / "dense", vocab=1024, seed=5, shard=None, bos_token_id=None, eos_token_id=None)
    for kind, flags in UPCYCLES.items():
        run_tool("upcycle_moe", "--load", root / "dense", "--save", root / kind, *flags)
        run_tool("convert_hf_to_mcore", "--hf-path", root / kind, "--save", root / f"mcore_{kind}")
    return root


def tokens():
    from support.convert_worker import BATCH, SEQ

    return torch.randint(0, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def logits(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(tokens()).logits


@pytest.mark.parametrize("kind", UPCYCLES)
def test_step0_logits_equal_the_dense_model_in_transformers(upcycled, kind):
    dense_class, dense = logits(upcycled / "dense")
    moe_class, moe = logits(upcycled / kind)
    assert (dense_class, moe_class) == ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    diff = (moe - dense).abs().max().item()
    print(f"{kind}: transformers max |MoE - dense| = {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("kind", UPCYCLES)
def test_step0_logits_equal_the_dense_model_in_megatron_after_conversion(single_rank, upcycled, kind):
    from support.convert_worker import megatron_logits

    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    shape = shape_from_hf_config(str(upcycled / kind))
    assert shape.moe.norm_topk_prob and shape.moe.num_experts == int(UPCYCLES[kind][1])
    ours = megatron_logits(str(upcycled / f"mcore_{kind}"), Mesh(world=1), shape, tokens())
    diff = (ours - logits(upcycled / "dense")[1]).abs().max().item()
    print(f"{kind}: megatron-core max |MoE - dense| = {diff:.2e}")
    assert diff < TOL


def _unscaled(tensors, config):
    for name in tensors:
        if ".experts." in name and name.endswith("down_proj.weight"):
            tensors[name] = tensors[name] / 2


def _ungrouped_router(tensors, config):
    for name in tensors:
        if name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0)) * 0.02


def _no_renormalisation(tensors, config):
    config["norm_topk_prob"] = False


@pytest.mark.parametrize("kind,wrong", [("g2", _unscaled), ("g2", _ungrouped_router), ("g1", _no_renormalisation)],
                         ids=["down_proj_not_scaled", "router_rows_not_grouped", "norm_topk_prob_false"])
def test_each_ingredient_left_out_breaks_the_function(upcycled, kind, wrong, tmp_path):
    shutil.copytree(upcycled / kind, tmp_path, dirs_exist_ok=True)
    tensors, config = hf_tensors(tmp_path), json.load(open(tmp_path / "config.json"))
    wrong(tensors, config)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    diff = (logits(tmp_path)[1] - logits(upcycled / "dense")[1]).abs().max().item()
    print(f"{wrong.__name__}: max |MoE - dense| = {diff:.2e}")
    assert diff > WRONG


def test_output_layout_and_carried_files(upcycled):
    from transformers import AutoTokenizer

    tensors, dense = hf_tensors(upcycled / "g2"), hf_tensors(upcycled / "dense")
    layer = "model.layers.3.mlp"
    assert {f"{layer}.experts.7.down_proj.weight", f"{layer}.shared_expert_gate.weight", f"{layer}.gate.weight"} \
        <= set(tensors)
    assert not any(name.startswith(f"{layer}.gate_proj") for name in tensors)
    assert torch.equal(tensors[f"{layer}.experts.5.up_proj.weight"], dense[f"{layer}.up_proj.weight"][64:])
    assert torch.equal(tensors[f"{layer}.experts.4.down_proj.weight"], dense[f"{layer}.down_proj.weight"][:, :64] * 2)
    router = tensors[f"{layer}.gate.weight"]
    assert torch.equal(router[0::2], router[1::2]) and not torch.equal(router[0], router[2])
    assert not tensors[f"{layer}.shared_expert.down_proj.weight"].any()
    assert not tensors[f"{layer}.shared_expert_gate.weight"].any()
    assert all(torch.equal(tensors[n], t) for n, t in dense.items() if ".mlp." not in n)
    assert len(AutoTokenizer.from_pretrained(upcycled / "g2")) == 1024
    assert os.path.exists(upcycled / "g2" / "generation_config.json")


def test_our_checkpoint_upcycles_to_the_same_model(upcycled, tmp_path):
    """A megatron-core checkpoint is exported in-process first: the result is the HF source's, bit for bit."""
    run_tool("convert_hf_to_mcore", "--hf-path", upcycled / "dense", "--save", tmp_path / "mcore")
    run_tool("upcycle_moe", "--load", tmp_path / "mcore", "--save", tmp_path / "moe", "--tokenizer", TOKENIZER,
             *UPCYCLES["g2"])
    ours, reference = hf_tensors(tmp_path / "moe"), hf_tensors(upcycled / "g2")
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[n], reference[n]) for n in reference)
    assert os.path.exists(tmp_path / "moe" / "tokenizer.json")
    assert sorted(os.listdir(tmp_path)) == ["mcore", "moe"]  # the temporary export is gone


@pytest.mark.parametrize("flags,message", [
    (["--num-experts", "6", "--granularity", "4"], "--num-experts 6 must be a multiple of --granularity 4"),
    (["--num-experts", "8", "--moe-router-topk", "3", "--granularity", "2"], "--moe-router-topk 3 must be a "
                                                                               "multiple of --granularity 2"),
    (["--num-experts", "6", "--moe-router-topk", "3", "--granularity", "3"], "--granularity 3 does not divide the "
                                                                              "dense FFN size 128"),
    (["--num-experts", "4", "--shared-expert-size", "0"], "--shared-expert-size must be >= 1"),
    (["--num-experts", "4", "--save-here"], "is not empty; choose an empty directory or pass --overwrite"),
])
def test_bad_flags_are_one_line_errors(upcycled, tmp_path, flags, message):
    from megatron_ext.errors import ConfigError

    save = upcycled / "g1" if "--save-here" in flags else tmp_path / "out"
    flags = [f for f in flags if f != "--save-here"]
    with pytest.raises(ConfigError) as error:
        run_tool("upcycle_moe", "--load", upcycled / "dense", "--save", save, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_moe_source_is_refused(upcycled, tmp_path):
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="is already an MoE model; upcycling takes a dense Qwen2 or Qwen3 model"):
        run_tool("upcycle_moe", "--load", upcycled / "g1", "--save", tmp_path / "again", "--num-experts", "4")
    with pytest.raises(ConfigError, match="holds a qwen2_moe model"):
        run_tool("upcycle_moe", "--load", upcycled / "mcore_g1", "--save", tmp_path / "again", "--num-experts", "4")
    assert not os.listdir(tmp_path / "again")


def test_upcycled_model_trains(upcycled, tmp_path):
    """A few SFT steps from the converted checkpoint (single rank, in this process) on the shipped sample: the first
    step's loss is the dense model's (the training path preserves the function too), then it falls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_qwen", os.path.join(REPO, "finetune_qwen.py"))
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    run_tool("convert_hf_to_mcore", "--hf-path", upcycled / "dense", "--save", tmp_path / "mcore_dense")
    common = ["--finetune", "--tokenizer", TOKENIZER, "--data-path",
              os.path.join(REPO, "examples/data/metamathqa_sample.jsonl"), "--pack-sequences", "--seq-length", "128",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1",
              "--data-cache-dir", str(tmp_path / "cache")]
    dense = finetune.main(["--hf-config", str(upcycled / "dense"), "--load", str(tmp_path / "mcore_dense"),
                           "--train-iters", "1", "--log-dir", str(tmp_path / "dense"), *common])
    records = finetune.main(["--hf-config", str(upcycled / "g2"), "--load", str(upcycled / "mcore_g2"),
                             "--train-iters", "5", "--moe-aux-loss-coeff", "1e-2", "--log-dir", str(tmp_path / "moe"),
                             *common])
    losses = [r["loss"] for r in records]
    print(f"dense step 1: {dense[0]['loss']:.6f}; upcycled SFT losses: {', '.join(f'{x:.6f}' for x in losses)}")
    assert abs(losses[0] - dense[0]["loss"]) < TOL * abs(dense[0]["loss"])
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3
