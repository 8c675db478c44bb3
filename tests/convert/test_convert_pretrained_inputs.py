"""--pretrained's inputs: bad sources are one line naming the source and the fix, exit 2, before any step; the
source and the model must match one to one; a hub id fetches only the files a run reads.

Each class of bad source runs the entry script as a user does (its own process, exit status, stderr); all but the
wrong shape are found while the flags are parsed (no process group, no torch import: about 0.3 s each).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from support import REPO, hf_fixtures
from support.ranks import run_script


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from test_convert_gpt2 import make_hf_gpt2

    root = tmp_path_factory.mktemp("sources")
    out = {"root": root, "qwen": hf_fixtures.make_qwen(root / "qwen"), "vit": hf_fixtures.make_vit(root / "vit", 5),
           "vit_backbone": hf_fixtures.make_vit(root / "vit_backbone", None)}
    make_hf_gpt2(root / "gpt2")
    out["gpt2"] = root / "gpt2"
    return out


def _copy(sources, tmp_path, name="qwen"):
    target = tmp_path / f"{name}_copy"
    shutil.copytree(sources[name], target)
    return target


def _shard_of(directory, tensor):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][tensor]


def _rewrite(directory, tensor, change):
    """``change(tensors of tensor's shard)`` saved back into that shard."""
    shard = _shard_of(directory, tensor)
    tensors = hf_fixtures.tensors(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _nowhere(sources, tmp_path):
    return [tmp_path / "nowhere"], f"--pretrained {tmp_path / 'nowhere'}: no such directory, and not a hub id"


def _other_family(sources, tmp_path):
    return [sources["vit"]], (f"--pretrained {sources['vit']} is a 'vit' model; finetune_qwen.py takes qwen2, "
                              "qwen2_moe, qwen3 or qwen3_moe")


def _missing_shard(sources, tmp_path):
    source = _copy(sources, tmp_path)
    os.remove(source / "model-00002-of-00008.safetensors")
    return [source], f"--pretrained {source}: the index names shards that are missing: model-00002-of-00008.safetensors"


def _truncated(sources, tmp_path):
    source = _copy(sources, tmp_path)
    shard = source / "model-00008-of-00008.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return [source], (f"--pretrained {source}: {shard.name} cannot be read (", "bytes of data where the header places",
                      "); the file is truncated or damaged, download it again")


def _wrong_shape(sources, tmp_path):
    source = _copy(sources, tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(source, name, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    return [source], (f"--pretrained {source}: {name} give decoder.layers.0.mlp.linear_fc2.weight the shape (64, 127), "
                      "but the model's is (64, 128); the config.json does not match the weights")


def _conflicting_model(sources, tmp_path):
    return ([sources["qwen"], "--model", "qwen2.5-0.5b"],
            f"--model qwen2.5-0.5b is not the model of --pretrained {sources['qwen']}; drop --model (the shape comes "
            "from the source's config.json)")


def _offline_uncached(sources, tmp_path):
    return (["tiny-org/absent"], "--pretrained tiny-org/absent: not in the Hugging Face cache and the hub cannot be "
            "reached (offline?); download it where there is a network (huggingface-cli download tiny-org/absent) or "
            "pass a local directory")


BAD = {"no_such_directory": _nowhere, "other_family": _other_family, "missing_shard": _missing_shard,
       "truncated_safetensors": _truncated, "wrong_shape": _wrong_shape, "conflicting_model": _conflicting_model,
       "offline_without_a_cached_copy": _offline_uncached,
       # no HF_HUB_OFFLINE, but no network either (the hub's port closed): the same line at once, not after
       # huggingface_hub's ~25 s of retries, a log line each
       "no_network_without_a_cached_copy": _offline_uncached}


@pytest.mark.parametrize("case", BAD)
def test_bad_source_exits_2_with_one_line_before_any_step(sources, tmp_path, case):
    """``python finetune_qwen.py --pretrained SOURCE ...``: exit 2, stderr one line naming the source and the fix, no
    step logged."""
    source, expected = BAD[case](sources, tmp_path)
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty_cache"))
    argv = ["finetune_qwen.py", "--pretrained", *map(str, source), "--mock-data", "--seq-length", "32",
            "--train-iters", "1", "--log-dir", str(tmp_path / "logs")]
    if case == "no_network_without_a_cached_copy":
        del env["HF_HUB_OFFLINE"]
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # (discard: nothing listens)
    if "cached_copy" in case:  # huggingface_hub reads HF_HUB_CACHE (and HF_ENDPOINT) as it is imported
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    else:  # the preloaded server's fork: the same process without paying torch's imports
        proc = run_script(argv, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    pieces = expected if isinstance(expected, tuple) else (expected,)
    assert lines[0].startswith(f"error: {pieces[0]}") and all(p in lines[0] for p in pieces), lines[0]
    assert not (tmp_path / "logs" / "metrics.jsonl").exists() or not (tmp_path / "logs" / "metrics.jsonl").read_text()


def test_a_reachable_hub_stays_online(monkeypatch):
    """The reachability probe behind the line above does not turn offline mode on where the hub answers."""
    import socket

    from megatron_ext.convert import source

    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    source.offline_unless_reachable.cache_clear()
    try:
        assert source.offline_unless_reachable() is False and "HF_HUB_OFFLINE" not in os.environ
    finally:
        server.close()
        source.offline_unless_reachable.cache_clear()


def parse_error(*argv, family="qwen"):
    from megatron_ext import arguments
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        arguments.parse([str(a) for a in argv], world_size=1, family=family)
    return str(error.value)


def test_other_conflicts_are_refused_while_parsing(sources, tmp_path):
    assert parse_error("--pretrained", sources["qwen"], "--hf-config", sources["qwen"]).startswith(
        f"--pretrained {sources['qwen']} gives the model's config; drop --hf-config")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert parse_error("--pretrained", sources["qwen"], "--save-hf", tmp_path / "full").startswith(
        f"--save-hf {tmp_path / 'full'} is not empty")
    assert parse_error("--pretrained", sources["qwen"], "--load", tmp_path, "--finetune").endswith(
        "both choose the first weights; keep one (--pretrained also takes one of our checkpoints)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither a Hugging Face model directory" in parse_error("--pretrained", empty)


def _load_error(directory, shape=None, model_shape=None):
    """The one-line error of --pretrained's loader reading ``directory`` (as a source of ``shape``, default its own)
    into a model of ``model_shape`` (default ``shape``; ViT: a 5-class classifier)."""
    from megatron_ext.convert import pretrained
    from megatron_ext.models import families
    from megatron_ext.errors import ConfigError

    family = families.from_hf_config(str(directory), "test")[1]
    shape = shape or family.shape_from_hf(str(directory), "test")
    with pytest.raises(ConfigError) as e:
        weights = pretrained.HFWeights(str(directory), shape, 0)
        pretrained.load(weights, [family.build(model_shape or shape, torch.float32, {"num_classes": 5})])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_source_and_model_must_match_one_to_one(sources, tmp_path, single_rank):
    """A source tensor with no place in the model (an extra tensor; a layer the model does not have), a tensor the
    source lacks, a model parameter no source tensor fills (a backbone under a classifier, when no new head is
    allowed), and a shape the config does not give (GPT-2's transposed Conv1D): each one line naming it."""
    import dataclasses

    extra = _copy(sources, tmp_path)
    _rewrite(extra, "model.norm.weight", lambda t: t.update({"model.extra.weight": torch.ones(3)}))
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = index["weight_map"]["model.norm.weight"]
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _load_error(extra) == (f"--pretrained {extra}: tensor model.extra.weight (1 such) has no place in the "
                                  "model; the config.json does not describe these weights")
    from megatron_ext.models.qwen.shape import shape_from_hf_config

    shape = shape_from_hf_config(str(sources["qwen"]))
    assert _load_error(sources["qwen"], model_shape=dataclasses.replace(shape, num_layers=3)).startswith(
        f"--pretrained {sources['qwen']}: tensor model.layers.3.input_layernorm.weight (7 such) has no parameter "
        "in the model (--num-layers or another shape flag changed the model?)")
    absent = _copy(sources, tmp_path, "vit")
    _rewrite(absent, "vit.layernorm.bias", lambda t: t.pop("vit.layernorm.bias"))
    index = json.loads((absent / "model.safetensors.index.json").read_text())
    del index["weight_map"]["vit.layernorm.bias"]
    (absent / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _load_error(absent).startswith(f"--pretrained {absent}: tensor vit.layernorm.bias is missing (1 missing); "
                                          "the source is not a complete ViT checkpoint of this config")
    assert _load_error(sources["vit_backbone"]) == (
        f"--pretrained {sources['vit_backbone']}: the model's head.bias has no tensor in the source; the config.json "
        "does not describe these weights")
    wrong = _copy(sources, tmp_path, "gpt2")
    tensors = hf_fixtures.tensors(wrong / "model.safetensors")
    tensors["transformer.h.0.mlp.c_fc.weight"] = tensors["transformer.h.0.mlp.c_fc.weight"][:, :-1].contiguous()
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    message = _load_error(wrong)
    assert "the config.json does not match the weights" in message and "c_fc" in message, message


def test_hub_id_fetches_only_the_indexed_shards_and_the_run_files(sources, tmp_path, monkeypatch):
    """A hub repository that also ships .bin weights, a consolidated checkpoint, ONNX and a README: the download
    asks for config, generation config, the index, the shards it names and the tokenizer files, nothing else
    (huggingface_hub's listing and per-file download stand in for the network)."""
    import huggingface_hub
    from huggingface_hub import _snapshot_download, constants
    from huggingface_hub.hf_api import RepoFile

    from megatron_ext.convert import source as pretrained_source

    repo = sources["qwen"]
    extras = ["pytorch_model.bin", "consolidated.safetensors", "onnx/model.onnx", "README.md", ".gitattributes",
              "original/params.json"]
    listing = sorted(os.listdir(repo)) + extras
    requested = []

    def download(repo_id, filename, revision, cache_dir, **_):
        requested.append(filename)
        path = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"), "snapshots", revision, filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(repo / filename, path)
        return path

    info = type("Info", (), {"sha": hf_fixtures.COMMIT})
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", lambda self, **_: info)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", lambda self, **_: [
        RepoFile(path=name, size=1, oid=str(i)) for i, name in enumerate(listing)])
    monkeypatch.setattr(_snapshot_download, "hf_hub_download", download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(pretrained_source, "offline_unless_reachable", lambda: False)  # (the hub stands in)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    source = pretrained_source.Source("tiny-org/remote", "hub")
    pretrained_source.fetch(source)
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    run_files = [n for n in os.listdir(repo) if n.startswith(("tokenizer", "vocab", "merges", "chat_template"))]
    expected = {"config.json", "generation_config.json", "model.safetensors.index.json",
                *index["weight_map"].values(), *run_files}
    assert set(requested) == expected and not set(requested) & set(extras), sorted(requested)
    assert sorted(os.listdir(source.directory)) == sorted(expected)
