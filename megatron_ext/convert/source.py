"""``--pretrained SOURCE`` and ``--save-hf DIR``: where a run's first weights come from and where its Hugging Face
model goes, checked while the flags are parsed (torch-free, no process group).

SOURCE is a local Hugging Face directory, a hub id (only config.json is fetched here, by every rank: the model's
shape comes from it; the weights come later, once per node, ``fetch``), or one of our checkpoints (the same as
``--load DIR --finetune``). ``HF_HUB_OFFLINE`` and the cache variables (``HF_HOME``, ``HF_HUB_CACHE``) are
huggingface_hub's own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import struct
import sys
from typing import Dict, Optional

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import HUB_ID, shipped
from megatron_ext.models.families import FAMILIES

# What a run needs from a hub repository besides the weights (the safetensors files the index names: never the
# .bin/.pt or consolidated.safetensors duplicates some repos ship).
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer*", "vocab.json",
             "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*",
             "preprocessor_config.json"]
EXPORT_MARK = "megatron_ext_export.json"  # written into every --save-hf directory: a later export may replace it


@dataclasses.dataclass
class Source:
    name: str                 # as given
    kind: str                 # "hf" (a local directory), "hub" (a hub id), "ours" (one of our checkpoints)
    config_path: Optional[str] = None  # the source's config.json (None for ours)
    model_type: Optional[str] = None
    directory: Optional[str] = None  # the local directory holding the weights (hub: after ``fetch``)


@dataclasses.dataclass
class Pretrained(Section):
    GROUP = "published weights"
    pretrained: Optional[str] = option(
        None, help="start from these weights: a hub id (Qwen/Qwen2.5-3B), a Hugging Face directory, or one of our "
        "checkpoints; the model's shape comes from it. 'none': a random init. Ignored when --load holds a checkpoint "
        "of this run (that resumes)")
    save_hf: Optional[str] = option(None, help="at the end (and on a graceful exit) write a Hugging Face model "
                                               "directory here")
    save_hf_dtype: Optional[str] = option(None, choices=("bf16", "fp16", "fp32"),
                                          help="dtype of the --save-hf tensors (default: the run's)")
    source: Optional[Source] = option(None, cli=False)  # what --pretrained names, resolved
    first_layers: bool = option(False, cli=False)  # the model keeps only --pretrained's first layers (verify_model)


def is_ours(path: str) -> bool:
    """One of our checkpoint directories (a run's --save, or one iter_ directory of it)."""
    return any(os.path.exists(os.path.join(path, name)) for name in
               ("latest_checkpointed_iteration.txt", "metadata.json", "latest", "fsdp_common.pt")) \
        or any(n.startswith("iter_") for n in os.listdir(path))


def offline() -> bool:
    """HF_HUB_OFFLINE as it is now (huggingface_hub reads it once, at import: a process that imported it earlier,
    or forked from one, would otherwise still try the network)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


@functools.lru_cache(maxsize=None)
def offline_unless_reachable() -> bool:
    """HF_HUB_OFFLINE, or turned on now when the hub's host cannot be reached within 3 s (a compute node without a
    network): huggingface_hub would otherwise retry every request for ~25 s, a log line per try, before it reads its
    cache. Turned on in the environment (the ranks a launcher starts inherit it) and where huggingface_hub and
    datasets read it at import. Returns whether this process is offline."""
    if offline():
        return True
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or (80 if endpoint.scheme == "http" else 443)),
                                 timeout=3).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        for module in ("huggingface_hub.constants", "datasets.config"):
            if module in sys.modules:
                sys.modules[module].HF_HUB_OFFLINE = True
        return True


def hub_cache() -> Optional[str]:
    """HF_HUB_CACHE (or HF_HOME/hub) as it is now, for the same reason; None: huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def _hub_config(repo_id: str, flag: str = "--pretrained") -> str:
    """config.json of a hub repository, from the cache or the hub; one line naming ``flag`` and the cause
    otherwise."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # pragma: no cover (a dependency of transformers)
        raise ConfigError(f"{flag} with a hub id needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return hf_hub_download(repo_id, "config.json", cache_dir=hub_cache(),
                               local_files_only=offline_unless_reachable())
    except LocalEntryNotFoundError:
        raise ConfigError(f"{flag} {repo_id}: not in the Hugging Face cache and the hub cannot be reached "
                          "(offline?); download it where there is a network (huggingface-cli download "
                          f"{repo_id}) or pass a local directory") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"{flag} {repo_id}: no such model on the Hugging Face hub (or it is gated: log in "
                          "with huggingface-cli login); check the id") from None
    except EntryNotFoundError:
        raise ConfigError(f"{flag} {repo_id}: the repository has no config.json; is it a model?") from None
    except OSError as e:
        raise ConfigError(f"{flag} {repo_id}: cannot fetch config.json ({e.__class__.__name__}: {e})") from None


def resolve(pretrained: Pretrained, model, checkpoint, family: str) -> Optional[Source]:
    """Check --pretrained (and what it decides: --hf-config, --tokenizer) before anything is built."""
    if pretrained.pretrained in (None, "none"):
        pretrained.pretrained = None
        return None
    name = pretrained.pretrained
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")) and is_ours(name):
        return Source(name, "ours", directory=name)  # the model comes from the flags, as with --load --finetune
    if model.hf_config:
        raise ConfigError(f"--pretrained {name} gives the model's config; drop --hf-config {model.hf_config}")
    if os.path.isdir(name):
        if os.path.isfile(os.path.join(name, "config.json")):
            source = Source(name, "hf", os.path.join(name, "config.json"), directory=name)
        else:
            raise ConfigError(f"--pretrained {name}: neither a Hugging Face model directory (config.json) nor one "
                              "of our checkpoints")
    elif is_hub_id(name):
        source = Source(name, "hub", _hub_config(name))
    else:
        raise ConfigError(f"--pretrained {name}: no such directory, and not a hub id (org/name)")
    try:
        with open(source.config_path) as f:
            source.model_type = json.load(f).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--pretrained {name}: cannot read its config.json ({e.__class__.__name__})") from None
    if source.model_type not in FAMILIES[family].model_types:
        *others, last = FAMILIES[family].model_types
        raise ConfigError(f"--pretrained {name} is a {source.model_type!r} model; {FAMILIES[family].entry} takes "
                          f"{', '.join(others) + ' or ' if others else ''}{last}")
    if source.kind == "hf" and not checkpoint.resumes:  # (a run that may resume reads it later)
        check_weights(name, "--pretrained")
    return source


def apply_pretrained(pretrained: Pretrained, model, data, checkpoint, family: str) -> Optional[Source]:
    """--pretrained (the family's model, data and checkpoint sections beside it): the model's shape from its
    config.json (an explicit --model must agree, or be the MoE model a dense source upcycles into), the language
    families' tokenizer from it too. Returns the source, also kept as ``pretrained.source``."""
    if pretrained.pretrained not in (None, "none") and checkpoint.finetune:
        raise ConfigError(f"--pretrained {pretrained.pretrained} and --load {checkpoint.load} --finetune both choose "
                          "the first weights; keep one (--pretrained also takes one of our checkpoints)")
    paths = getattr(data, "data_path", None)
    named = [pretrained.pretrained, getattr(data, "tokenizer", None), *(paths if isinstance(paths, list) else [paths])]
    if any(isinstance(n, str) and is_hub_id(n) for n in named):
        offline_unless_reachable()  # no network: the cache, at once
    source, fam = resolve(pretrained, model, checkpoint, family), FAMILIES[family]
    upcycle = False
    if source is not None and source.config_path is not None:
        loaded = fam.shape_from_hf(source.config_path, f"--pretrained {source.name}")
        if model.model is not None:
            preset = fam.presets[model.model]
            upcycle = (getattr(preset, "moe", None) is not None and getattr(loaded, "moe", 0) is None
                       and dataclasses.replace(preset, moe=None) == loaded)  # dense source, MoE model: upcycled
            if preset != loaded and not upcycle:
                raise ConfigError(f"--model {model.model} is not the model of --pretrained {source.name}; drop "
                                  "--model (the shape comes from the source's config.json)")
        if model.model is None or not upcycle:
            model.hf_config = source.config_path
        if fam.tokenizer and data.tokenizer is None:
            data.tokenizer = source.directory or source.name  # a hub id: its snapshot once fetched
    if fam.tokenizer and data.tokenizer is None:
        data.tokenizer = shipped(fam.tokenizer)
    pretrained.source = source
    check_export_dir(pretrained.save_hf)
    return source


def check_weights(directory: str, flag: str) -> Optional[Dict[str, str]]:
    """The safetensors files of a Hugging Face directory are all there and whole (each header read, each file as
    long as its header says), torch-free: a damaged download is one line before any process starts. Returns the
    index's weight map (None for a single ``model.safetensors``)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    weight_map = None
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"{flag} {index}: cannot read the index ({e.__class__.__name__}); download it "
                              "again") from None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{flag} {index}: no weight_map; the index is damaged, download it again")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"{flag} {directory}: no model.safetensors or model.safetensors.index.json there")
    missing = [file for file in files if not os.path.isfile(os.path.join(directory, file))]
    if missing:
        raise ConfigError(f"{flag} {directory}: the index names shards that are missing: {', '.join(missing)}")
    for file in files:
        problem = _safetensors_problem(os.path.join(directory, file))
        if problem:
            raise ConfigError(f"{flag} {directory}: {file} cannot be read ({problem}); the file is truncated or "
                              "damaged, download it again")
    return weight_map


def _safetensors_problem(path: str) -> Optional[str]:
    """Why a safetensors file is not whole (its 8-byte header length, JSON header, and data as long as the header's
    offsets say), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            return f"{size} bytes"
        length = struct.unpack("<Q", f.read(8))[0]
        if length > size - 8:
            return f"a header of {length} bytes in a file of {size}"
        try:
            header = json.loads(f.read(length))
            end = max([entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"],
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return "its header is not valid"
    if end != size - 8 - length:
        return f"{size - 8 - length} bytes of data where the header places {end}"
    return None


def check_export_dir(path: Optional[str]) -> None:
    """--save-hf must be empty, absent, or an earlier export (which the new one replaces): nothing else is lost."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--save-hf {path} is a file; give a directory")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, EXPORT_MARK)):
        raise ConfigError(f"--save-hf {path} is not empty and holds no earlier export; choose an empty directory")


def _snapshot(repo_id: str, local_only: bool) -> str:
    """The repository's snapshot with HUB_FILES and the weight files its index names (model.safetensors without
    an index)."""
    from huggingface_hub import snapshot_download

    kwargs = dict(cache_dir=hub_cache(), local_files_only=local_only or offline_unless_reachable())
    path = snapshot_download(repo_id, allow_patterns=HUB_FILES, **kwargs)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weights = sorted(set(json.load(f)["weight_map"].values()))
    else:
        weights = ["model.safetensors"]
    return snapshot_download(repo_id, allow_patterns=HUB_FILES + weights, **kwargs)


def hub_directory(repo_id: str, flag: str) -> str:
    """A hub model's local snapshot (config, tokenizer, weights), downloaded unless offline; one line naming
    ``flag`` otherwise. For a single process (tools); training ranks use ``fetch``."""
    _hub_config(repo_id, flag)  # its errors say what is wrong (offline, no such model, gated)
    try:
        return _snapshot(repo_id, local_only=False)
    except Exception as e:
        raise ConfigError(f"{flag} {repo_id}: download failed ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def is_hub_id(name: str) -> bool:
    return "/" in name and not os.path.exists(name) and bool(HUB_ID.match(name))


def fetch(source: Optional[Source]) -> None:
    """A hub source's files into the local cache: local rank 0 of each node downloads, the other ranks wait, then
    read the same snapshot. Call after the process group exists."""
    if source is None or source.kind != "hub" or source.directory is not None:
        return
    import torch.distributed as dist

    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    path = None
    if first:
        try:
            path = _snapshot(source.name, local_only=False)
        except Exception as e:  # network, disk, gated: one line from this rank, the others stop at the barrier
            raise ConfigError(f"--pretrained {source.name}: download failed ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if dist.is_initialized():
        dist.barrier()
    if not first:
        path = _snapshot(source.name, local_only=True)
    source.directory = path
