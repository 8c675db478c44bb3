"""Pretraining data as one token stream (GPT-2 family): documents -> ids with an EOS after each, cut into windows.

Text is tokenized once per (data, tokenizer) into a cached flat uint16 (uint32 for vocabularies over 65536) file
that every rank memory-maps; nanoGPT's pre-tokenized ``.bin`` files are mapped as they are. Train and validation
are contiguous token ranges (train first), so no window ever straddles them.

Windows follow Megatron's GPTDataset: window i is tokens [i*S, i*S + S + 1) for sequence length S, so inputs never
overlap and each token is a label exactly once per epoch. Each global batch takes ``global_batch_size`` windows
from a seeded per-epoch permutation (``GlobalBatchSampler``) rather than nanoGPT's random offsets: an epoch then
covers the data exactly once, and the whole position (the next batches on any mesh) is one number,
``consumed_samples``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.data.sampler import GlobalBatchSampler, rank_microbatches
from megatron_ext.data.sft import _first_line, _sha256_file, _split_weights, _tokenizer_fingerprint, on_rank0
from megatron_ext.errors import ConfigError

SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".bin")
CACHE_FORMAT = 1  # part of the cache key: bump when the cached stream changes meaning
TOKENIZE_CHUNK = 1024  # documents per tokenizer call (the fast tokenizer encodes a batch in parallel)
TEXT_PIECE_CHARS = 1 << 18  # a .txt is encoded in pieces of about this size (same ids, bounded memory)
HUB_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext", "tokens")
# A safe place to cut text: after a lone newline between non-spaces. No match of GPT-2's pre-tokenizer regex
# crosses it, and the newline pre-tokenizes alone on either side, so the pieces encode to the same ids as the whole.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")

Batch = Dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------- documents


class _Source:
    """A text --data-path opened for reading: a content fingerprint for the cache key, and its documents."""

    def __init__(self, data_path: str):
        self.path = data_path
        if _is_file(data_path):
            _check_file(data_path)
            self.kind = os.path.splitext(data_path)[1][1:]
            self.fingerprint = "sha256:" + _sha256_file(data_path)
        else:
            self.kind = "hub"
            self._dataset = _load_hub_dataset(data_path)
            self.fingerprint = "datasets:" + self._dataset._fingerprint

    def segments(self) -> Iterator[Tuple[List[str], List[bool]]]:
        """(texts, ends) a batch at a time, in order: ``ends[i]`` says a document ends with ``texts[i]`` (an EOS
        follows it). A .txt is one document, handed over in pieces cut where tokenizing is unaffected."""
        if self.kind == "txt":
            pieces = self._txt_pieces()
            for begin in range(0, len(pieces), 16):
                batch = pieces[begin:begin + 16]
                yield batch, [begin + i == len(pieces) - 1 for i in range(len(batch))]
            return
        rows = {"parquet": self._parquet_rows, "hub": self._hub_rows}.get(self.kind, self._json_rows)()
        for texts in _batched((_text(row, where, self.path) for where, row in rows), TOKENIZE_CHUNK):
            yield texts, [True] * len(texts)

    def _txt_pieces(self) -> List[str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ConfigError(f"--data-path {self.path}: not UTF-8 text ({_first_line(e)}); convert it") from None
        pieces, start = [], 0
        while len(text) - start > TEXT_PIECE_CHARS:
            cut = _SAFE_CUT.search(text, start + TEXT_PIECE_CHARS)
            if cut is None:
                break
            pieces.append(text[start:cut.start()])
            start = cut.start()
        return pieces + [text[start:]]

    def _json_rows(self) -> Iterator[Tuple[str, object]]:
        with open(self.path, encoding="utf-8") as f:
            is_list = f.read(4096).lstrip().startswith("[")  # one JSON list, otherwise JSON lines
            f.seek(0)
            if is_list:
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"--data-path {self.path}: invalid JSON list ({e}); fix the file or write "
                                      f"one JSON object per line") from None
                yield from ((f"row index {i}", row) for i, row in enumerate(rows))
                return
            for number, line in enumerate(f, start=1):
                try:
                    yield from [(f"line {number}", json.loads(line))] if line.strip() else []
                except json.JSONDecodeError:
                    raise ConfigError(f"--data-path {self.path}: line {number} is not valid JSON; fix or remove "
                                      f"it") from None

    def _parquet_rows(self) -> Iterator[Tuple[str, object]]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except Exception as e:
            raise ConfigError(f"--data-path {self.path}: not a readable parquet file ({_first_line(e)})") from None
        if "text" not in table.schema_arrow.names:
            raise ConfigError(f"--data-path {self.path}: no 'text' column (columns: "
                              f"{', '.join(table.schema_arrow.names)}); rename the text column to 'text'")
        batches = table.iter_batches(TOKENIZE_CHUNK, columns=["text"])
        texts = (t for batch in batches for t in batch.column(0).to_pylist())
        return ((f"row index {i}", {"text": t}) for i, t in enumerate(texts))

    def _hub_rows(self) -> Iterator[Tuple[str, object]]:
        texts = (t for batch in self._dataset.iter(batch_size=TOKENIZE_CHUNK) for t in batch["text"])
        return ((f"row index {i}", {"text": t}) for i, t in enumerate(texts))


def _is_file(data_path: str) -> bool:
    """A local path rather than a datasets hub id: an existing file, a known suffix, or an explicit path."""
    return not os.path.isdir(data_path) and (os.path.isfile(data_path) or data_path.endswith(SUFFIXES)
                                             or data_path.startswith(("/", ".")))


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"--data-path {path}: no such file; pass an existing .txt/.json/.jsonl/.parquet/.bin file "
                          f"or a datasets hub id such as karpathy/tiny_shakespeare")
    if not path.endswith(SUFFIXES):
        raise ConfigError(f"--data-path {path}: unsupported file type '{os.path.splitext(path)[1]}'; use .txt, "
                          f".json, .jsonl, .parquet (a 'text' field per row) or a pre-tokenized uint16 .bin")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"--data-path {path}: file is not readable; fix its permissions")


def _load_hub_dataset(data_path: str):
    import datasets

    try:
        dataset = datasets.load_dataset(data_path, split="train")
    except Exception as e:
        raise ConfigError(f"--data-path {data_path}: cannot load it as a datasets hub id ({_first_line(e)}); check the "
                          f"id and the network (offline, it must already be in the HF cache) or pass a local "
                          f".txt/.jsonl/.parquet/.bin file") from None
    if "text" not in dataset.column_names:
        raise ConfigError(f"--data-path {data_path}: no 'text' column (columns: {', '.join(dataset.column_names)})")
    return dataset


def _text(row: object, where: str, path: str) -> str:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise ConfigError(f"--data-path {path}: {where} has no string 'text' field; fix or remove it")
    return row["text"]


def _batched(items, size: int) -> Iterator[list]:
    items = iter(items)
    while batch := list(itertools.islice(items, size)):
        yield batch


# ----------------------------------------------------------------------------------------------- tokenizing


def load_tokenizer(path: str):
    """A Hugging Face tokenizer with an EOS token (the document separator) whose ids fit uint32."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer ({_first_line(e)}); pass a local tokenizer "
                          f"directory such as examples/tokenizers/tiny-gpt2 or a hub id already in the HF cache"
                          ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer {path} has no eos token to end documents with; use a GPT-2 style tokenizer "
                          f"(gpt2 or examples/tokenizers/tiny-gpt2)")
    token_dtype(len(tokenizer), f"--tokenizer {path}")
    return tokenizer


def token_dtype(vocab_size: int, what: str = "the vocabulary") -> np.dtype:
    """The narrowest unsigned type holding every id below ``vocab_size``."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ConfigError(f"{what}: {vocab_size} tokens do not fit uint32 token ids; use a tokenizer with at most 2**32")


def encode(tokenizer, texts: List[str]) -> List[List[int]]:
    """Ids of each text as plain text: a literal "<|endoftext|>" inside a document is not the EOS token (as
    nanoGPT's ``encode_ordinary``), so only the EOS appended after a document separates documents."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]


def _write_stream(source: _Source, tokenizer, path: str) -> dict:
    """Tokenize every document, EOS after each, into ``path`` (atomically); returns the stream's metadata."""
    dtype, eos = token_dtype(len(tokenizer)), tokenizer.eos_token_id
    counts = dict(documents=0, empty_documents=0, tokens=0)

    def write(f) -> None:
        for texts, ends in source.segments():
            keep = [i for i, text in enumerate(texts) if text]
            counts["empty_documents"] += sum(end and not text for text, end in zip(texts, ends))
            encoded = encode(tokenizer, [texts[i] for i in keep])
            for i, ids in zip(keep, encoded):
                if ends[i]:
                    ids.append(eos)
                    counts["documents"] += 1
            array = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype)
            f.write(array.tobytes())
            counts["tokens"] += len(array)
        if not counts["tokens"]:
            raise ConfigError(f"--data-path {source.path}: no text to train on (every document is empty)")

    _atomic_write(path, write)
    return dict(counts, dtype=dtype.name, vocab_size=len(tokenizer), eos_id=eos)


# ----------------------------------------------------------------------------------------------- cache


def _atomic_write(path: str, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, then rename: readers see the whole file or none."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(os.path.join(directory, ".gitignore")):  # a cache in a checkout stays untracked
        with open(os.path.join(directory, ".gitignore"), "w") as f:
            f.write("*\n")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _cached_meta(stem: str) -> Optional[dict]:
    """The metadata of a complete cache entry (written last, so its presence marks completeness), else None."""
    try:
        with open(stem + ".json") as f:
            meta = json.load(f)
        complete = os.path.getsize(stem + ".bin") == meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError):
        return None
    return meta if complete else None


def _tokenize_cached(data_path: str, tokenizer_path: str, cache_dir: Optional[str]) -> dict:
    """Rank 0's part for text: locate or build the cached stream; returns its metadata and path."""
    tokenizer = load_tokenizer(tokenizer_path)
    source = _Source(data_path)
    parts = dict(format=CACHE_FORMAT, data=source.fingerprint, tokenizer=_tokenizer_fingerprint(tokenizer))
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    default_dir = (os.path.join(os.path.dirname(os.path.abspath(data_path)), ".cache", "megatron_ext")
                   if source.kind != "hub" else HUB_CACHE_DIR)
    stem = os.path.join(cache_dir or default_dir, f"tokens-{key[:24]}")
    meta, cache = _cached_meta(stem), "hit"
    if meta is None:
        meta, cache = _write_stream(source, tokenizer, stem + ".bin"), "build"
        meta["source"] = source.kind
        _atomic_write(stem + ".json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return dict(meta, cache=cache, cache_path=stem + ".bin")


def _open_bin(path: str) -> np.ndarray:
    """nanoGPT's pre-tokenized format: raw uint16 token ids."""
    _check_file(path)
    size = os.path.getsize(path)
    if size % 2:
        raise ConfigError(f"--data-path {path}: {size} bytes is odd, so not uint16 token ids (nanoGPT's .bin); "
                          f"regenerate it or pass the text")
    if not size:
        raise ConfigError(f"--data-path {path}: empty; no tokens to train on")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _sibling_val(path: str) -> Optional[str]:
    val = os.path.join(os.path.dirname(path), "val.bin")
    return val if os.path.basename(path) == "train.bin" and os.path.isfile(val) else None


def _bin_meta(data_path: str) -> dict:
    """Rank 0's part for a .bin: check the files and read the vocabulary size off the largest id."""
    val = _sibling_val(data_path)
    max_id = max(int(_open_bin(p).max()) for p in filter(None, (data_path, val)))
    return dict(source="bin", documents=None, empty_documents=None, tokens=len(_open_bin(data_path)),
                dtype="uint16", vocab_size=max_id + 1, eos_id=None, cache="none", cache_path=data_path)


# ----------------------------------------------------------------------------------------------- arrays


def load_token_arrays(data_path: str, tokenizer_path: Optional[str] = None, data_split: str = "99,1",
                      cache_dir: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, validation tokens, info), both memory-mapped. ``info``: source, documents, tokens,
    train_tokens, valid_tokens, valid_from (the split or a sibling val.bin), vocab_size, eos_id, dtype, cache
    ("hit", "build" or "none" for a .bin), cache_path, seconds.

    Under torch.distributed only rank 0 reads the data and builds a missing cache; the others wait, then all map
    the same file. A .bin needs no tokenizer; ``.../train.bin`` with a ``val.bin`` beside it ignores the split.
    """
    start = time.perf_counter()
    data_path = os.path.expanduser(data_path)
    train_weight, valid_weight = _split_weights(data_split)
    is_bin = _is_file(data_path) and data_path.endswith(".bin")
    if not is_bin and not tokenizer_path:
        raise ConfigError(f"--data-path {data_path} is text: pass --tokenizer (e.g. gpt2 or "
                          f"examples/tokenizers/tiny-gpt2)")
    info = on_rank0(lambda: _bin_meta(data_path) if is_bin else _tokenize_cached(data_path, tokenizer_path,
                                                                                  cache_dir))
    path = info["cache_path"]
    if not os.path.exists(path):
        raise ConfigError(f"--data-cache-dir: rank 0 wrote {path} but this rank cannot see it; put the cache on a "
                          f"filesystem every node shares")
    stream = np.memmap(path, dtype=info["dtype"], mode="r", shape=(info["tokens"],))
    val = _sibling_val(data_path) if is_bin else None
    if val:
        train, valid, info["valid_from"] = stream, _open_bin(val), val
    else:
        cut = len(stream) - round(len(stream) * valid_weight / (train_weight + valid_weight))
        train, valid, info["valid_from"] = stream[:cut], stream[cut:], f"--data-split {data_split}"
    info.update(data_path=data_path, train_tokens=len(train), valid_tokens=len(valid),
                seconds=time.perf_counter() - start)
    return train, valid, info


def num_windows(num_tokens: int, seq_length: int) -> int:
    """Windows of ``seq_length + 1`` tokens starting every ``seq_length`` tokens (neighbours share one token)."""
    return max(num_tokens - 1, 0) // seq_length


class TokenStreamData:
    """Windows of a token stream for the loop (the ``SFTData`` protocol); see the module docstring."""

    def __init__(self, train: np.ndarray, valid: np.ndarray, *, seq_length: int, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.train, self.valid, self.seq_length = train, valid, seq_length
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.train_size, self.valid_size = num_windows(len(train), seq_length), num_windows(len(valid), seq_length)
        self.sampler = GlobalBatchSampler(self.train_size, global_batch_size, seed)

    def _batch(self, stream: np.ndarray, windows: List[int]) -> Batch:
        s = self.seq_length
        rows = torch.from_numpy(np.stack([stream[i * s:i * s + s + 1] for i in windows]).astype(np.int64))
        return dict(tokens=rows[:, :-1].contiguous(), labels=rows[:, 1:].contiguous(),
                    loss_mask=torch.ones(len(windows), s), position_ids=torch.arange(s).repeat(len(windows), 1))

    def _microbatches(self, stream: np.ndarray, windows: List[int]) -> List[Batch]:
        return [self._batch(stream, micro)
                for micro in rank_microbatches(windows, self.dp_rank, self.dp_size, self.micro_batch_size)]

    def train_microbatches(self) -> List[Batch]:
        return self._microbatches(self.train, self.sampler.next_global_batch())

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        """The same first ``iters`` global batches of validation windows, in order, every time (wrapping)."""
        for k in range(iters if self.valid_size else 0):
            windows = [(k * self.global_batch_size + j) % self.valid_size for j in range(self.global_batch_size)]
            yield self._microbatches(self.valid, windows)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def _check_lengths(info: dict, seq_length: int, global_batch_size: int) -> None:
    window, path = seq_length + 1, info["data_path"]
    if info["train_tokens"] < window:
        raise ConfigError(f"--data-path {path}: {info['train_tokens']} training tokens, fewer than one window of "
                          f"--seq-length {seq_length} + 1 = {window}; use more data or a smaller --seq-length")
    if num_windows(info["train_tokens"], seq_length) < global_batch_size:
        raise ConfigError(f"--data-path {path}: {info['train_tokens']} training tokens make "
                          f"{num_windows(info['train_tokens'], seq_length)} windows of --seq-length {seq_length}, "
                          f"fewer than --global-batch-size {global_batch_size}; use more data or smaller settings")
    if 0 < info["valid_tokens"] < window:
        raise ConfigError(f"{info['valid_from']}: {info['valid_tokens']} validation tokens, fewer than one window of "
                          f"--seq-length {seq_length} + 1 = {window}; give validation more data (or 100,0 for none)")


def build_token_data(data_path: str, tokenizer_path: Optional[str], *, seq_length: int, global_batch_size: int,
                     micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, data_split: str = "99,1",
                     cache_dir: Optional[str] = None) -> Tuple[TokenStreamData, dict]:
    """The loop's data source for --data-path, plus ``info`` (``load_token_arrays``'s, and train/valid windows)."""
    if seq_length < 1:
        raise ConfigError(f"--seq-length {seq_length}: must be at least 1")
    train, valid, info = load_token_arrays(data_path, tokenizer_path, data_split, cache_dir)
    _check_lengths(info, seq_length, global_batch_size)
    data = TokenStreamData(train, valid, seq_length=seq_length, global_batch_size=global_batch_size,
                           micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    info.update(train_windows=data.train_size, valid_windows=data.valid_size)
    return data, info


def summary(info: dict) -> str:
    """One line for the entry script to print."""
    return (f"{info['tokens']} tokens of {info['source']} data ({info['documents'] or 'n/a'} documents, "
            f"{info['dtype']}, vocab {info['vocab_size']}): {info['train_tokens']} train / {info['valid_tokens']} "
            f"validation ({info['valid_from']}); cache {info['cache']} {info['cache_path']} in {info['seconds']:.1f}s")


def main() -> None:
    """Tokenize ahead of a run (one process, no collective timeout): ``python -m megatron_ext.data.tokens``."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--data-split", default="99,1")
    parser.add_argument("--data-cache-dir", default=None)
    args = parser.parse_args()
    print(summary(load_token_arrays(args.data_path, args.tokenizer, args.data_split, args.data_cache_dir)[2]))


if __name__ == "__main__":
    from megatron_ext.cli import run_main

    run_main(main)
