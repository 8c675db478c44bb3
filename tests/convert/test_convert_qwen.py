"""HF <-> megatron-core conversion of Qwen2 (tools/convert_*.py), offline, fp32.

A random tiny Qwen2ForCausalLM (GQA 4 heads / 2 KV groups, QKV bias; tied and untied), saved in several shards,
is converted once (its checkpoints loaded resharded under several meshes: tests/convert/test_pretrained.py's launch) and must
export back bit for bit, fine-tune from --finetune, and export after training with exactly the trained tensors
changed.
"""

import json
import os

import pytest
import torch

from support import REPO, hf_fixtures
from support.hf_fixtures import tensors as hf_tensors

from support.ranks import run_ranks, run_script, run_tool

TOL = 1e-4


# transformers' defaults where the tiny shape sets its own: they must come back from a conversion too
DEFAULTS = dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None)


def make_hf_model(path, tied: bool):
    hf_fixtures.make_qwen(path, tied=tied, vocab=200, seed=1 if tied else 2, tokenizer=False, intermediate_size=96,
                          rope_theta=5e5, rms_norm_eps=1e-5, **DEFAULTS)


def cli(name, *args):
    """tools/<name>.py as a user runs it: its own process, exit code and stderr."""
    return run_script([f"tools/{name}.py", *args], env=dict(PYTHONWARNINGS="ignore"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for kind in ("tied", "untied"):
        make_hf_model(root / f"hf_{kind}", tied=kind == "tied")
        dtype = ["--dtype", "fp32"] if kind == "untied" else []  # tied: the source's dtype by default
        run_tool("convert_hf_to_mcore", "--hf-path", root / f"hf_{kind}", "--save", root / f"mcore_{kind}", *dtype)
        out[kind] = (root / f"hf_{kind}", root / f"mcore_{kind}")
    out["root"] = root
    return out


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_round_trip_reproduces_every_tensor_and_the_config(converted, kind, tmp_path):
    hf, mcore = converted[kind]
    run_tool("convert_mcore_to_hf", "--load", mcore, "--save", tmp_path, "--max-shard-size", "100KB")
    original, exported = hf_tensors(hf), hf_tensors(tmp_path)
    assert sorted(exported) == sorted(original)
    assert {t.dtype for t in exported.values()} == {t.dtype for t in original.values()} == {torch.float32}
    assert ("lm_head.weight" in exported) == (kind == "untied")
    assert all(torch.equal(exported[name], original[name]) for name in original)
    assert json.load(open(tmp_path / "config.json")) == json.load(open(hf / "config.json"))
    assert os.path.exists(tmp_path / "model.safetensors.index.json")


def test_round_trip_keeps_a_bf16_source_bf16(tmp_path):
    """Neither tool changes the dtype unless --dtype says so: a bf16 model comes back bf16, bit for bit."""
    from transformers import Qwen2ForCausalLM

    make_hf_model(tmp_path / "fp32", tied=True)
    Qwen2ForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    run_tool("convert_hf_to_mcore", "--hf-path", tmp_path / "bf16", "--save", tmp_path / "mcore")
    from megatron.core import dist_checkpointing

    assert dist_checkpointing.load_common_state_dict(str(tmp_path / "mcore"))["params_dtype"] == "torch.bfloat16"
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "back")
    original, exported = hf_tensors(tmp_path / "bf16"), hf_tensors(tmp_path / "back")
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "back" / "config.json"))["dtype"] == "bfloat16"


def test_exported_model_and_tokenizer_load_in_transformers(converted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_tool("convert_mcore_to_hf", "--load", converted["tied"][1], "--save", tmp_path, "--dtype", "bf16",
         "--tokenizer", os.path.join(REPO, "examples/tokenizers/tiny-qwen"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 1024
    assert os.path.exists(tmp_path / "model.safetensors")  # small enough for one shard


def test_finetune_from_converted_then_export_changes_only_what_trained(converted, tmp_path):
    """One AdamW step under TP2 from the converted (untied) checkpoint, then export: every tensor moves, except the
    embedding rows of tokens the batch never contained (zero gradient, no weight decay: Adam leaves them)."""
    from megatron_ext.data import synthetic

    hf, mcore = converted["untied"]
    batch = dict(seed=1234, global_batch_size=4, micro_batch_size=2, seq_length=32, vocab_size=200)
    run_ranks(2, ["finetune_qwen.py", "--hf-config", str(hf), "--load", str(mcore), "--finetune", "--mock-data",
                  "--tensor-model-parallel-size", "2", "--seq-length", "32", "--micro-batch-size", "2",
                  "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3", "--save", str(tmp_path / "ft")])
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ft", "--save", tmp_path / "hf", "--dtype", "fp32")
    before, after = hf_tensors(hf), hf_tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    seen = torch.unique(torch.cat([mb["tokens"].reshape(-1) for mb in synthetic.global_batch(1, **batch)]))
    unseen = torch.ones(200, dtype=torch.bool)
    unseen[seen] = False
    embed_before, embed_after = before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]
    assert torch.equal(embed_after[unseen], embed_before[unseen])
    assert (embed_after[seen] != embed_before[seen]).any(dim=1).all()
    for name in before:
        if name != "model.embed_tokens.weight":
            assert not torch.equal(after[name], before[name]), f"{name} did not train"
    assert json.load(open(tmp_path / "hf" / "config.json")) == json.load(open(hf / "config.json"))


def test_bad_inputs_are_one_line_errors(converted, tmp_path):
    hf, mcore = converted["tied"]

    def error(*args):
        proc = cli(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert error("convert_hf_to_mcore", "--hf-path", llama, "--save", tmp_path / "a") == (
        f"error: --hf-path {llama / 'config.json'}: model_type 'llama' is not supported; supported: qwen2, "
        "qwen2_moe, qwen3, qwen3_moe, vit, gpt2")

    broken = tmp_path / "missing_shard"
    broken.mkdir()
    lost = sorted(set(json.load(open(hf / "model.safetensors.index.json"))["weight_map"].values()))[1]
    for name in os.listdir(hf):
        if name != lost:
            os.symlink(hf / name, broken / name)
    line = error("convert_hf_to_mcore", "--hf-path", broken, "--save", tmp_path / "b")
    assert "missing" in line and lost in line

    wrong = tmp_path / "wrong_shape"
    wrong.mkdir()
    for name in os.listdir(hf):
        if name != "config.json":
            os.symlink(hf / name, wrong / name)
    config = json.load(open(hf / "config.json"))
    (wrong / "config.json").write_text(json.dumps(dict(config, intermediate_size=80)))
    line = error("convert_hf_to_mcore", "--hf-path", wrong, "--save", tmp_path / "c")
    assert "gate_proj.weight + model.layers.0.mlp.up_proj.weight" in line and "(192, 64)" in line \
        and "(160, 64)" in line

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert "not empty" in error("convert_mcore_to_hf", "--load", mcore, "--save", occupied)
    assert (occupied / "keep.txt").read_text() == "mine"
    run_tool("convert_mcore_to_hf", "--load", mcore, "--save", occupied, "--overwrite")
    assert (occupied / "config.json").exists()
