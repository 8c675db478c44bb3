"""Supervised fine-tuning data: rows (MetaMathQA, alpaca, ShareGPT, messages, prompt/completion: ``data/chat.py``)
-> chat-formatted, loss-masked, optionally packed samples.

The loss covers only what the model must learn to say (``--loss-on``): the assistant's turns and the special token
that closes each (``<|im_end|>`` for Qwen2.5), read off the tokenizer's own chat template. Tokenizing is done once
per (data, tokenizer, template, settings) and cached on disk; every rank then memory-maps the same file.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_ext.data import cache, chat, packing
from megatron_ext.data.rows import NotUtf8, Source
from megatron_ext.data.tokenizer import load_tokenizer, pad_token_id
from megatron_ext.errors import ConfigError

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")
CACHE_FORMAT = 3  # part of the cache key: bump when the cached arrays change meaning (2: tool calls, tools
# columns and the end of turn of {% generation %} templates read as chat.py now reads them; 3: best-fit packing)
TOKENIZE_CHUNK = 4096


def _bad_row_reason(row: Any, how: chat.RowFormat) -> Optional[str]:
    if isinstance(row, NotUtf8):
        return "not valid UTF-8"
    try:
        chat.conversation(row, how)
    except chat.BadRow as e:
        return str(e)
    return None


def _read_records(source: Source, bad_rows: str, how: chat.RowFormat = chat.RowFormat()) -> Tuple[List[dict], int]:
    records, num_bad = [], 0
    for where, row in source.rows():
        reason = _bad_row_reason(row, how)
        if reason is None:
            records.append(row)
        elif bad_rows == "error":
            raise ConfigError(f"--data-path {source.path}: bad row at {where} ({reason}); fix or remove it, "
                              f"or pass --bad-rows skip")
        else:
            num_bad += 1
    return records, num_bad


def load_records(data_path: str, bad_rows: str = "skip",
                 how: chat.RowFormat = chat.RowFormat()) -> Tuple[List[dict], int]:
    """The rows that are conversations in one of the formats (``how``) from a local file or a datasets hub id,
    and how many were not (``bad_rows="skip"``; ``"error"`` raises at the first one, naming its line or row)."""
    return _read_records(Source(data_path), bad_rows, how)


def split_weights(data_split: str) -> Tuple[float, float]:
    try:
        weights = [float(w) for w in data_split.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 2 or min(weights) < 0 or weights[0] <= 0:
        raise ConfigError(f"--data-split {data_split!r}: expected two non-negative train,validation weights with a "
                          f"positive train weight, e.g. 98,2")
    return weights[0], weights[1]


def split_records(records: Sequence[dict], data_split: str = "98,2", seed: int = 1234) -> Tuple[list, list]:
    """Shuffle deterministically (by seed), then cut by the train,validation weights. A non-zero validation weight
    keeps at least one record on each side, so evaluation never sees an empty set."""
    train_weight, valid_weight = split_weights(data_split)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    num_valid = round(len(records) * valid_weight / (train_weight + valid_weight))
    if valid_weight > 0 and len(records) > 1:
        num_valid = min(max(num_valid, 1), len(records) - 1)
    cut = len(records) - num_valid
    return [records[i] for i in order[:cut]], [records[i] for i in order[cut:]]


# ----------------------------------------------------------------------------------------------- tokenizing


def tokenize_examples(tokenizer, pairs: Sequence[Tuple[str, str]],
                      system_prompt: Optional[str] = None) -> List[Tuple[List[int], List[int]]]:
    """``(input_ids, assistant_mask)`` per (query, response): a one-turn conversation (``chat.tokenize_conversations``:
    the completion up to and including the special token closing the turn)."""
    chats = [([{"role": "user", "content": q}, {"role": "assistant", "content": r}], None) for q, r in pairs]
    return chat.tokenize_conversations(tokenizer, chats, "assistant", system_prompt)


def tokenize_example(tokenizer, query: str, response: str,
                     system_prompt: Optional[str] = None) -> Tuple[List[int], List[int]]:
    """One chat [system?, user, assistant] as ``(input_ids, assistant_mask)``; see ``tokenize_examples``."""
    return tokenize_examples(tokenizer, [(query, response)], system_prompt)[0]


# ----------------------------------------------------------------------------------------------- samples


class SFTDataset(torch.utils.data.Dataset):
    """Fixed-length samples cut from tokenized examples stored as flat arrays (compact, cacheable, mmap-able).

    ``sample_offsets`` says which consecutive examples form sample i: one each unpacked, several when packed.
    Packed examples are padded to a multiple of ``pad_multiple`` (2 x CP under context parallelism, which cuts
    every document into 2 x CP equal chunks); the padding is part of its document, outside the loss.
    """

    def __init__(self, arrays: Dict[str, torch.Tensor], seq_length: int, pad_id: int, pack: bool,
                 pad_multiple: int = 1):
        self.ids, self.mask = arrays["ids"], arrays["mask"]
        self.example_offsets, self.sample_offsets = arrays["example_offsets"], arrays["sample_offsets"]
        self.seq_length, self.pad_id, self.pack = seq_length, pad_id, pack
        self.pad_multiple = pad_multiple if pack else 1

    def __len__(self) -> int:
        return len(self.sample_offsets) - 1

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = self.seq_length
        tokens = torch.full((s,), self.pad_id, dtype=torch.int64)
        labels = torch.full((s,), self.pad_id, dtype=torch.int64)
        loss_mask = torch.zeros(s, dtype=torch.float32)
        position_ids = torch.arange(s, dtype=torch.int64)
        padding = torch.ones(s, dtype=torch.bool)  # True where no example's token is: never routed to experts
        seqlens, used = [], 0
        for example in range(int(self.sample_offsets[index]), int(self.sample_offsets[index + 1])):
            start, end = int(self.example_offsets[example]), int(self.example_offsets[example + 1])
            n = end - start - 1  # next-token pairs in this example
            tokens[used:used + n] = self.ids[start:end - 1]
            labels[used:used + n] = self.ids[start + 1:end]
            loss_mask[used:used + n] = self.mask[start + 1:end]
            padding[used:used + n] = False
            n = -(-n // self.pad_multiple) * self.pad_multiple  # padding: pad ids, loss mask 0
            position_ids[used:used + n] = torch.arange(n)
            seqlens.append(n)
            used += n
        sample = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                      padding_mask=padding)
        if self.pack:
            if used < s:  # the padding tail is a segment of its own: nothing attends across into it
                position_ids[used:] = torch.arange(s - used)
                seqlens.append(s - used)
            sample["seqlens"] = torch.tensor(seqlens, dtype=torch.int32)
        return sample


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples into the batch the engine consumes: tokens/labels/position_ids int64 [b, S], loss_mask
    float32 [b, S], padding_mask bool [b, S], and for packed samples cu_seqlens int32 [segments + 1] over the
    flattened b*S tokens."""
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in SAMPLE_KEYS}
    if "seqlens" in samples[0]:
        seqlens = torch.cat([sample["seqlens"] for sample in samples])  # each row sums to S: offsets come free
        batch["cu_seqlens"] = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return batch


def _tokenize_chunk(tokenizer, how: chat.RowFormat, loss_on: str, system_prompt: Optional[str],
                    records: Sequence[dict]) -> List[Tuple[np.ndarray, np.ndarray]]:
    chats = [chat.conversation(r, how) for r in records]
    return [(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8))
            for ids, mask in chat.tokenize_conversations(tokenizer, chats, loss_on, system_prompt)]


_worker_job = None  # a tokenizing process's _tokenize_chunk, bound to its own tokenizer


def _start_worker(tokenizer_path: str, how: chat.RowFormat, loss_on: str, system_prompt: Optional[str]) -> None:
    global _worker_job
    _worker_job = functools.partial(_tokenize_chunk, load_tokenizer(tokenizer_path), how, loss_on, system_prompt)


def _worker_chunk(records: Sequence[dict]) -> List[Tuple[np.ndarray, np.ndarray]]:
    return _worker_job(records)


def tokenizing_processes(records: int) -> int:
    """How many processes tokenize ``records``: ``cache.preparing_processes``, or one for fewer than 4 chunks, where
    starting them costs more than it saves."""
    return 1 if records < 4 * TOKENIZE_CHUNK else cache.preparing_processes()


def _tokenized(tokenizer, records: Sequence[dict], how: chat.RowFormat, loss_on: str, system_prompt: Optional[str],
               tokenizer_path: Optional[str], workers: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """Each record's (ids, loss mask), in order: here, or in ``workers`` forked processes that each load the
    tokenizer from ``tokenizer_path`` (Megatron-LM's ``Pool.imap``, as tools/preprocess_data.py)."""
    chunks = (records[begin:begin + TOKENIZE_CHUNK] for begin in range(0, len(records), TOKENIZE_CHUNK))
    if workers <= 1 or tokenizer_path is None:
        for part in chunks:
            yield from _tokenize_chunk(tokenizer, how, loss_on, system_prompt, part)
        return
    import multiprocessing

    print(f"megatron_ext: tokenizing {len(records):,} conversations in {workers} processes", flush=True)
    with multiprocessing.get_context("fork").Pool(workers, _start_worker,
                                                  (tokenizer_path, how, loss_on, system_prompt)) as pool:
        for part in pool.imap(_worker_chunk, chunks):
            yield from part


def _sample_arrays(tokenizer, records: Sequence[dict], system_prompt: Optional[str], seq_length: int,
                   pack: bool, pad_multiple: int = 1, how: chat.RowFormat = chat.RowFormat(),
                   loss_on: str = "assistant", tokenizer_path: Optional[str] = None,
                   workers: Optional[int] = None) -> Tuple[dict, dict]:
    """Tokenize (in chunks, so peak memory is the arrays, not Python lists; in ``workers`` processes, by default
    ``tokenizing_processes``), truncate to seq_length+1 ids (seq_length token/label pairs), drop examples left
    without any target, and assign examples to samples: one each, or packed (each padded to a multiple of
    ``pad_multiple``) by best-fit decreasing."""
    counts = dict(truncated=0, dropped=0)
    ids_parts, mask_parts = [], []
    workers = tokenizing_processes(len(records)) if workers is None else workers
    for ids, mask in _tokenized(tokenizer, records, how, loss_on, system_prompt, tokenizer_path, workers):
        if len(ids) > seq_length + 1:
            counts["truncated"] += 1
            ids, mask = ids[:seq_length + 1], mask[:seq_length + 1]
        if mask[1:].any():
            ids_parts.append(ids)
            mask_parts.append(mask)
        else:
            counts["dropped"] += 1
    lengths = np.array([len(ids) for ids in ids_parts], dtype=np.int64)
    if pack:  # rows by best-fit decreasing (data/packing.py), each row's examples stored together, in data order
        rows = sorted(sorted(row) for row in packing.best_fit_decreasing(
            -(-(lengths - 1) // pad_multiple) * pad_multiple, seq_length))
        order = [example for row in rows for example in row]
        ids_parts, mask_parts, lengths = [ids_parts[i] for i in order], [mask_parts[i] for i in order], lengths[order]
        sample_offsets = np.cumsum([0] + [len(row) for row in rows])
    else:
        sample_offsets = range(len(lengths) + 1)
    arrays = dict(ids=torch.from_numpy(np.concatenate([np.zeros(0, np.int32)] + ids_parts)),
                  mask=torch.from_numpy(np.concatenate([np.zeros(0, np.uint8)] + mask_parts)),
                  example_offsets=torch.from_numpy(np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])),
                  sample_offsets=torch.tensor(list(sample_offsets), dtype=torch.int64))
    return arrays, counts


# ----------------------------------------------------------------------------------------------- cache


def _build_cache(path: str, source: Source, tokenizer, seq_length: int, pack: bool, data_split: str,
                 system_prompt: Optional[str], bad_rows: str, seed: int, pad_multiple: int = 1,
                 row_format: Optional[dict] = None, loss_on: str = "assistant",
                 tokenizer_path: Optional[str] = None) -> None:
    how = chat.RowFormat(**{k: tuple(map(tuple, v)) if k != "format" else v for k, v in (row_format or {}).items()})
    records, num_bad = _read_records(source, bad_rows, how)
    if not records:
        raise ConfigError(f"--data-path {source.path}: no usable rows (each must be a conversation: query/response, "
                          f"alpaca, ShareGPT, messages or prompt/completion, see --data-format); {num_bad} bad rows "
                          "skipped")
    splits = split_records(records, data_split, seed)
    payload = dict(info=dict(records=len(records), bad_rows=num_bad, truncated=0, dropped=0))
    for name, part in zip(("train", "valid"), splits):
        payload[name], counts = _sample_arrays(tokenizer, part, system_prompt, seq_length, pack, pad_multiple, how,
                                               loss_on, tokenizer_path)
        for counter, value in counts.items():
            payload["info"][counter] += value
        payload["info"][f"{name}_samples"] = len(payload[name]["sample_offsets"]) - 1
    cache.atomic_save(payload, path)


def build_datasets(data_path: str, tokenizer_path: str, seq_length: int, pack: bool = False,
                   data_split: str = "98,2", system_prompt: Optional[str] = None, bad_rows: str = "skip",
                   seed: int = 1234, cache_dir: Optional[str] = None, pad_multiple: int = 1,
                   how: chat.RowFormat = chat.RowFormat(),
                   loss_on: str = "assistant") -> Tuple[SFTDataset, SFTDataset, dict]:
    """Train and validation datasets of ``seq_length`` samples, plus ``info``: records, bad_rows, truncated,
    dropped (prompt filled the whole sequence), train_samples, valid_samples, cache ("hit" or "build"),
    cache_path, seconds (to build or load), pad_id, vocab_size (len(tokenizer), which the model must cover). Rank 0
    builds a missing cache while the others wait (``cache.locate_or_build``)."""
    if seq_length < 2:
        raise ConfigError(f"--seq-length {seq_length} is too short for SFT samples; use at least 2")
    pad_multiple = pad_multiple if pack else 1
    if seq_length % pad_multiple:
        raise ConfigError(f"--seq-length {seq_length} must be a multiple of {pad_multiple}, the length every packed "
                          f"document is padded to a multiple of (2 x --context-parallel-size)")
    start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_path)
    settings = dict(seq_length=seq_length, pack=pack, data_split=data_split, system_prompt=system_prompt,
                    bad_rows=bad_rows, seed=seed)
    if pad_multiple > 1:  # part of the cache key only then: caches built before it stay valid
        settings["pad_multiple"] = pad_multiple
    if how != chat.RowFormat() or loss_on != "assistant":  # likewise
        settings.update(row_format=dataclasses.asdict(how), loss_on=loss_on)
    payload, path, built = cache.locate_or_build(
        "sft", data_path, tokenizer, cache_dir,
        lambda path, source: _build_cache(path, source, tokenizer, tokenizer_path=tokenizer_path, **settings),
        format=CACHE_FORMAT, **settings)
    pad_id = pad_token_id(tokenizer)
    info = dict(payload["info"], cache="build" if built else "hit", cache_path=path,
                seconds=time.perf_counter() - start, pad_id=pad_id, vocab_size=len(tokenizer))
    train, valid = (SFTDataset(payload[name], seq_length, pad_id, pack, pad_multiple) for name in ("train", "valid"))
    return train, valid, info
