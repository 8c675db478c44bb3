"""Pretraining data the Megatron way: megatron-core's ``GPTDataset`` over ``.bin``/``.idx`` corpora, weighted blends
through ``BlendedMegatronDatasetBuilder``, ``MockGPTDataset`` for --mock-data.

``--data-path`` takes Megatron prefixes with optional weights (``0.3 wiki_text_document 0.7 web_text_document``),
or text (a .txt/.json/.jsonl/.parquet file, a datasets hub id, nanoGPT's .bin), which is preprocessed once into the
cache and then read the same way (``data/tokens.py``). ``--split`` cuts every corpus by documents into train,
validation and test as in Megatron-LM; ``--train-data-path``/``--valid-data-path`` give each its own blend instead.
megatron-core builds (rank 0 first, into ``--data-cache-path``) and caches the shuffled sample index; step k's
global batch is samples [k*B, (k+1)*B) of it, so a mesh never changes the batches and a checkpoint needs one number,
``consumed_samples`` (Megatron-LM's pretraining sampler).
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.data import indexed, mixture, tokens
from megatron_ext.data.sampler import rank_microbatches
from megatron_ext.data.tokenizer import load_tokenizer
from megatron_ext.parallel import on_rank0
from megatron_ext.errors import ConfigError

Batch = Dict[str, torch.Tensor]
KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def document_offsets(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of a micro-batch's [b, S] ``tokens`` as packed documents: each row cut after every
    end-of-text token and at its end (--reset-attention-mask; positions restart there with --reset-position-ids)."""
    ends = tokens == eod
    ends[:, -1] = True
    return torch.nn.functional.pad(torch.nonzero(ends.flatten()).flatten().to(torch.int32) + 1, (1, 0))


class Tokenizer:
    """What ``GPTDatasetConfig`` asks of a tokenizer: the EOD id, the vocabulary size, and identifiers that go
    into the sample-index cache key."""

    def __init__(self, vocab_size: int, eod: int, name: str):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "megatron_ext", "tokenizer": name, "vocab_size": vocab_size, "eod": eod}


def _prefix(path: str, tokenizer_path: str, cache_dir: Optional[str], flag: str) -> Tuple[str, Optional[str]]:
    """A --data-path entry as a corpus prefix (text preprocessed on rank 0 first), and nanoGPT's sibling
    validation corpus when there is one."""
    path = os.path.expanduser(path)
    if indexed.is_prefix(path):  # also a typo'd one: its missing .idx, not a hub look-up
        indexed.check_prefix(path, flag)
        return path, None
    if path.endswith(".bin") and os.path.isfile(path):
        val = tokens.sibling_val(path)
        train = on_rank0(lambda: tokens.bin_prefix(path, cache_dir))["prefix"]
        return train, on_rank0(lambda: tokens.bin_prefix(val, cache_dir))["prefix"] if val else None
    return on_rank0(lambda: tokens.text_prefix(path, tokenizer_path, cache_dir, flag))["prefix"], None


def _blend(values: List[str], tokenizer_path: str, cache_dir: Optional[str], flag: str):
    """``[w1] p1 [w2 p2 ...]`` -> (prefixes, weights or None), checked; nanoGPT sibling validation prefixes."""
    pairs = mixture.parse(values)
    resolved = [(w, *_prefix(p, tokenizer_path, cache_dir, flag)) for w, p in pairs]
    indexed.check_blend([p for _, p, _ in resolved], values, flag)
    prefixes = [p for _, p, _ in resolved]
    weights = [w for w, _, _ in resolved] if len(resolved) > 1 else None
    siblings = [v for _, _, v in resolved if v]
    return (prefixes, weights), (siblings if len(siblings) == len(resolved) else None)


def _check_vocabulary(parts, vocab_size: int, tokenizer_path: str) -> None:
    """A corpus made with another tokenizer would index past the embedding: up to 64 documents spread over each
    corpus (its first, its last and between), up to 16K ids of each, are looked at. ``parts``: (flag, prefixes)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for flag, prefixes in parts:
        for prefix in prefixes:
            data = IndexedDataset(prefix, mmap=True)
            picks = np.unique(np.linspace(0, len(data) - 1, num=min(len(data), 64)).round().astype(np.int64))
            top = max((int(data.get(int(i), 0, min(int(data.sequence_lengths[i]), 1 << 14)).max(initial=0))
                       for i in picks), default=0)
            if top >= vocab_size:
                raise ConfigError(f"{flag} {prefix}: token id {top} is outside --tokenizer {tokenizer_path}'s "
                                  f"vocabulary of {vocab_size}; pass the tokenizer the corpus was made with")


def _check_tokens(parts, seq_length: int, split: Optional[str], sizes: List[int]) -> None:
    """Every (prefix, split) that must give samples holds more than one sequence of tokens: megatron-core would
    otherwise loop forever looking for epochs. ``parts``: (flag, prefixes) for one split each, or all split by
    ``split``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    names = ("training", "validation", "test")
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split)) if split else None
    for index, (flag, prefixes) in enumerate(parts):
        for prefix in prefixes:
            data = IndexedDataset(prefix, mmap=True)
            per_doc = np.add.reduceat(data.sequence_lengths.astype(np.int64), data.document_indices[:-1])
            for k, size in enumerate(sizes):
                if not size or (matrix is None and k != index) or (matrix is not None and matrix[k] is None):
                    continue
                begin, end = ((round(matrix[k][0] * len(per_doc)), round(matrix[k][1] * len(per_doc)))
                              if matrix else (0, len(per_doc)))
                held = int(per_doc[begin:end].sum())
                if held <= seq_length:
                    how = f"--split {split} gives its {names[k]} split {end - begin} of {len(per_doc)} documents, " \
                        if matrix else ""
                    raise ConfigError(f"{flag} {prefix}: {how}{held} tokens, not more than one --seq-length "
                                      f"{seq_length} sequence; use more data, a shorter --seq-length or another "
                                      "--split")


def _split(text: str) -> str:
    weights = [float(w) for w in text.split(",")]
    return ",".join(str(w) for w in (weights + [0.0] * 3)[:3])


def build(run, *, vocab_size: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
          seed: int, rampup=None) -> Tuple["PretrainData", dict]:
    """The loop's data source and what to print about it: megatron-core datasets of exactly the samples the run
    uses (``train_iters`` x global batch; ``eval_iters`` x global batch of validation). ``rampup``: the run's batch
    ramp-up (config/rampup.Rampup), whose steps' batches add up to at most --train-samples."""
    opts, training = run.data, run.training
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    cache_dir = opts.data_cache_dir
    blend = blend_per_split = None
    if opts.mock_data:
        tokenizer, cls, name = Tokenizer(vocab_size, vocab_size - 1, "mock"), MockGPTDataset, "mock data"
        split = _split(opts.data_split)
    else:
        hf = load_tokenizer(opts.tokenizer, chat=False)
        tokenizer, cls = Tokenizer(len(hf), hf.eos_token_id, opts.tokenizer), GPTDataset
        if opts.train_data_path:
            train = _blend(opts.train_data_path, opts.tokenizer, cache_dir, "--train-data-path")[0]
            valid = _blend(opts.valid_data_path, opts.tokenizer, cache_dir, "--valid-data-path")[0] \
                if opts.valid_data_path else None
            blend_per_split, split, name = [train, valid, None], None, " ".join(opts.train_data_path)
            checked = [("--train-data-path", train[0]), ("--valid-data-path", valid[0] if valid else [])]
        else:
            blend, siblings = _blend(opts.data_path, opts.tokenizer, cache_dir, "--data-path")
            split, name, checked = _split(opts.data_split), " ".join(opts.data_path), [
                ("--data-path", blend[0] + (siblings or []))]
            if siblings:  # nanoGPT's train.bin + val.bin: their own validation, no split
                blend_per_split, blend, split = [blend, (siblings, blend[1]), None], None, None
        on_rank0(lambda: _check_vocabulary(checked, tokenizer.vocab_size, opts.tokenizer))
        if cache_dir is None:  # beside the data, or the front door's cache it already sits in
            beside = os.path.dirname(os.path.abspath(checked[0][1][0]))
            cache_dir = beside if beside.endswith(os.path.join(".cache", "megatron_ext")) else \
                os.path.join(beside, ".cache", "megatron_ext")
    validates = bool(training.eval_interval) and (blend_per_split[1] is not None if split is None
                                              else float(split.split(",")[1]) > 0)
    sizes = [training.train_samples if rampup else training.train_iters * global_batch_size,
             training.eval_iters * global_batch_size if validates else 0, 0]
    if not opts.mock_data:
        flags = ("--train-data-path", "--valid-data-path") if opts.train_data_path else ("--data-path",) * 2
        parts = [("--data-path", blend[0])] if blend else [
            (flag, b[0] if b else []) for flag, b in zip(flags, blend_per_split)]
        on_rank0(lambda: _check_tokens(parts, training.seq_length, split, sizes))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=training.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split,
        path_to_cache=os.path.join(cache_dir, "indices") if cache_dir else None, tokenizer=tokenizer,
        reset_position_ids=opts.reset_position_ids, reset_attention_mask=opts.reset_attention_mask,
        eod_mask_loss=opts.eod_mask_loss, create_attention_mask=False,
        mmap_bin_files=True, mid_level_dataset_surplus=0.005)
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    except (AssertionError, IndexError, ValueError) as e:
        flag = "--train-data-path" if opts.train_data_path else "--data-path"
        raise ConfigError(f"{flag} {name}: megatron-core cannot make {sizes[0]} samples of --seq-length "
                          f"{training.seq_length} from it ({' '.join(str(e).split())[:200]}); use more data, a shorter "
                          "--seq-length or another --split") from None
    data = PretrainData(train, valid, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                        dp_rank=dp_rank, dp_size=dp_size, eod=tokenizer.eod if opts.reset_attention_mask else None,
                        rampup=rampup)
    return data, dict(name=name, train_samples=len(train), valid_samples=len(valid) if valid is not None else 0,
                      vocab_size=tokenizer.vocab_size, cache=config.path_to_cache)


class PretrainData:
    """Global batch k is samples [k*B, (k+1)*B) of megatron-core's (already shuffled) dataset, DP ranks taking
    their contiguous shares; validation is its first ``iters`` global batches every time. With a batch-size ramp-up
    (``config/rampup.py``) each step's B comes from the samples consumed before it (``last_global_batch``)."""

    def __init__(self, train, valid, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 eod: Optional[int] = None, rampup=None):
        self.train, self.valid, self.eod = train, valid, eod  # eod: cut samples into documents at it
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.rampup = dp_rank, dp_size, rampup
        self.consumed_samples = 0

    def _microbatches(self, dataset, indices: List[int]) -> List[Batch]:
        out = []
        for micro in rank_microbatches(indices, self.dp_rank, self.dp_size, self.micro_batch_size):
            samples = [dataset[i % len(dataset)] for i in micro]
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in KEYS}
            batch["loss_mask"] = batch["loss_mask"].float()
            if self.eod is not None:
                batch["cu_seqlens"] = document_offsets(batch["tokens"], self.eod)
            out.append(batch)
        return out

    def train_microbatches(self) -> List[Batch]:
        start = self.consumed_samples
        size = self.rampup.batch_at(start) if self.rampup else self.global_batch_size
        if self.rampup:
            self.last_global_batch = size  # (the loop's throughput counts it)
        self.consumed_samples += size
        return self._microbatches(self.train, list(range(start, start + size)))

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        for k in range(iters if self.valid is not None and len(self.valid) else 0):
            yield self._microbatches(self.valid, list(range(k * self.global_batch_size,
                                                            (k + 1) * self.global_batch_size)))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
