"""The one data cache: what is prepared once per (data, tokenizer, settings) on rank 0 while the other ranks wait,
then read by every rank. SFT samples, preference pairs and KTO's examples (``NAME-KEY.pt``), pretraining corpora
(``tokens-KEY``, ``bin-KEY``: data/tokens.py) and the DPO/KTO reference tables all live here.

A cache goes beside local data (``.cache/megatron_ext`` next to the file or save_to_disk directory), or for a hub id
in ``~/.cache/megatron_ext/<what>``, unless --data-cache-dir names a directory; it carries a ``.gitignore``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Callable, Optional, Tuple

import torch

from megatron_ext.data.rows import Source
from megatron_ext.data.tokenizer import pad_token_id
from megatron_ext.errors import ConfigError
from megatron_ext.parallel import on_rank0

HUB_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext")


def key(parts: Any) -> str:
    """The cache key: sha256 of ``parts`` as sorted JSON (bump a ``format`` in them when a cache changes meaning)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's part of a key: its vocabulary and merges, special tokens and pad id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps([tokenizer.all_special_tokens, pad_token_id(tokenizer)])
    return hashlib.sha256((vocab + specials).encode()).hexdigest()


def default_dir(data_path: str, local: bool, what: str) -> str:
    """Beside ``data_path`` when it is ``local``, else ``~/.cache/megatron_ext/WHAT``."""
    if local:
        return os.path.join(os.path.dirname(os.path.abspath(data_path)), ".cache", "megatron_ext")
    return os.path.join(HUB_DIR, what)


def prepare(directory: str) -> str:
    """``directory``, made, with a ``.gitignore``: a cache inside a checkout must not show up as untracked files."""
    os.makedirs(directory, exist_ok=True)
    ignore = os.path.join(directory, ".gitignore")
    if not os.path.exists(ignore):
        with open(ignore, "w") as f:
            f.write("*\n")
    return directory


def atomic_save(payload: dict, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: readers see the whole file or none."""
    fd, tmp = tempfile.mkstemp(dir=prepare(os.path.dirname(path)), prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def preparing_processes() -> int:
    """Processes rank 0 may use for its one-off preparation while the other ranks wait idle: every CPU it may run
    on, at most 32."""
    return max(1, min(32, len(os.sched_getaffinity(0))))


def locate_or_build(name: str, data_path: str, tokenizer, cache_dir: Optional[str],
                    build: Callable[[str, Source], None], **settings) -> Tuple[dict, str, bool]:
    """The cache ``NAME-KEY.pt`` of (``data_path``'s content, the tokenizer and its chat template, ``settings``):
    under torch.distributed only rank 0 opens the data (hashes the file or loads the hub data set) and, when the file
    is missing, ``build(path, source)``s it; the others wait. Then every rank memory-maps it: (payload, path, built)."""
    def locate() -> Tuple[str, bool]:
        source = Source(data_path)
        parts = dict(data=source.fingerprint, tokenizer=tokenizer_fingerprint(tokenizer),
                     chat_template=tokenizer.chat_template, **settings)
        path = os.path.join(cache_dir or default_dir(source.path, source.is_local, "sft"),
                            f"{name}-{key(parts)[:24]}.pt")
        if os.path.exists(path):
            return path, False
        build(path, source)
        return path, True

    path, built = on_rank0(locate)
    if not os.path.exists(path):
        raise ConfigError(f"--data-cache-dir: rank 0 wrote {path} but this rank cannot see it; put the cache on a "
                          f"filesystem every node shares")
    return torch.load(path, mmap=True, weights_only=True), path, built
