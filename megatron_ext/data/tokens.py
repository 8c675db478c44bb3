"""Text as a Megatron pretraining corpus: the front door that lets ``--data-path`` take a .txt/.json/.jsonl/.parquet
file, a datasets hub id or nanoGPT's pre-tokenized ``.bin`` as well as ``.bin``/``.idx`` prefixes.

Text is tokenized once per (data, tokenizer) into a cached prefix (``data/indexed.py``) with an EOS after each
document, then read like any other (``data/pretrain.py``). A .txt is one text cut into documents of about 1 KiB
at points where tokenizing is unaffected (megatron-core splits train and validation by documents), the EOS after
the last. A nanoGPT ``.bin`` becomes a prefix without a copy: a link to it and an index of 1M-token pieces.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from typing import Iterator, List, Optional, Tuple

import numpy as np

from megatron_ext.data import indexed
from megatron_ext.data.rows import first_line as _first_line, is_saved_dataset, load_saved_dataset
from megatron_ext.data.rows import sha256_file as _sha256_file
from megatron_ext.data.sft import _tokenizer_fingerprint, preparing_processes
from megatron_ext.errors import ConfigError

SUFFIXES = indexed.FRONT_DOOR  # .txt .json .jsonl .parquet and nanoGPT's .bin
CACHE_FORMAT = 2  # part of the cache key: bump when the cached corpus changes meaning
TOKENIZE_CHUNK = 1024  # documents per tokenizer call (the fast tokenizer encodes a batch in parallel)
TEXT_PIECE_CHARS = 1 << 10  # a .txt's documents: about this many characters (same ids as the whole)
BIN_PIECE_TOKENS = 1 << 20  # a nanoGPT .bin's documents, in its index
PARALLEL_BYTES = 64 << 20  # a file corpus this large (or a data set of PARALLEL_ROWS documents) is tokenized in
PARALLEL_ROWS = 100_000    # forked processes when a run preprocesses it (tools/preprocess_data.py: --workers)
HUB_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext", "tokens")
# A safe place to cut text: after a lone newline between non-spaces. No match of GPT-2's pre-tokenizer regex
# crosses it, and the newline pre-tokenizes alone on either side, so the pieces encode to the same ids as the whole.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")

# ----------------------------------------------------------------------------------------------- documents


class _Source:
    """A text --data-path opened for reading: a content fingerprint for the cache key, and its documents."""

    def __init__(self, data_path: str, key: str = "text", flag: str = "--data-path"):
        self.path, self.key, self.flag = data_path, key, flag
        if _is_file(data_path):
            _check_file(data_path, flag)
            self.kind = os.path.splitext(data_path)[1][1:]
            self.fingerprint = "sha256:" + _sha256_file(data_path)
        else:
            self.kind = "hub"
            self._dataset = _load_hub_dataset(data_path, key, flag)
            self.fingerprint = "datasets:" + self._dataset._fingerprint

    def segments(self) -> Iterator[Tuple[List[str], List[bool]]]:
        """(texts, ends) a batch at a time, in order, one document each: ``ends[i]`` says an EOS follows
        ``texts[i]``. A .txt's documents are pieces cut where tokenizing is unaffected, the EOS after the last."""
        if self.kind == "txt":
            pieces = self._txt_pieces()
            for begin in range(0, len(pieces), 16):
                batch = pieces[begin:begin + 16]
                yield batch, [begin + i == len(pieces) - 1 for i in range(len(batch))]
            return
        rows = {"parquet": self._parquet_rows, "hub": self._hub_rows}.get(self.kind, self._json_rows)()
        for texts in _batched((_text(row, where, self.path, self.key, self.flag) for where, row in rows),
                              TOKENIZE_CHUNK):
            yield texts, [True] * len(texts)

    def _txt_pieces(self) -> List[str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.flag} {self.path}: not UTF-8 text ({_first_line(e)}); convert it") from None
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
                    raise ConfigError(f"{self.flag} {self.path}: invalid JSON list ({e}); fix the file or write "
                                      f"one JSON object per line") from None
                yield from ((f"row index {i}", row) for i, row in enumerate(rows))
                return
            for number, line in enumerate(f, start=1):
                try:
                    yield from [(f"line {number}", json.loads(line))] if line.strip() else []
                except json.JSONDecodeError:
                    raise ConfigError(f"{self.flag} {self.path}: line {number} is not valid JSON; fix or remove "
                                      f"it") from None

    def _parquet_rows(self) -> Iterator[Tuple[str, object]]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except Exception as e:
            raise ConfigError(f"{self.flag} {self.path}: not a readable parquet file ({_first_line(e)}); "
                              "regenerate it") from None
        if self.key not in table.schema_arrow.names:
            raise ConfigError(f"{self.flag} {self.path}: no '{self.key}' column (columns: "
                              f"{', '.join(table.schema_arrow.names)}); name the text column")
        batches = table.iter_batches(TOKENIZE_CHUNK, columns=[self.key])
        texts = (t for batch in batches for t in batch.column(0).to_pylist())
        return ((f"row index {i}", {self.key: t}) for i, t in enumerate(texts))

    def _hub_rows(self) -> Iterator[Tuple[str, object]]:
        texts = (t for batch in self._dataset.iter(batch_size=TOKENIZE_CHUNK) for t in batch[self.key])
        return ((f"row index {i}", {self.key: t}) for i, t in enumerate(texts))


def _is_file(data_path: str) -> bool:
    """A local file rather than a datasets hub id (or a directory): an existing file, a known suffix, or a string
    that looks like a path (``indexed.looks_like_path``: a typo is then "no such file", not a hub look-up)."""
    return not os.path.isdir(data_path) and (os.path.isfile(data_path) or data_path.endswith(SUFFIXES)
                                             or indexed.looks_like_path(data_path))


def _check_file(path: str, flag: str = "--data-path") -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file; pass an existing .txt/.json/.jsonl/.parquet/.bin file "
                          f"or a datasets hub id such as karpathy/tiny_shakespeare")
    if not path.endswith(SUFFIXES):
        raise ConfigError(f"{flag} {path}: unsupported file type '{os.path.splitext(path)[1]}'; use .txt, "
                          f".json, .jsonl, .parquet (a 'text' field per row) or a pre-tokenized uint16 .bin")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: file is not readable; fix its permissions")


def _load_hub_dataset(data_path: str, key: str = "text", flag: str = "--data-path"):
    """A datasets hub id's train split (offline: from the HF cache), or a ``save_to_disk`` directory's."""
    import datasets

    try:
        dataset = (load_saved_dataset(data_path, "train", flag) if is_saved_dataset(data_path)
                   else datasets.load_dataset(data_path, split="train"))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{flag} {data_path}: cannot load it as a datasets hub id ({_first_line(e)}); check the "
                          f"id and the network (offline, it must already be in the HF cache) or pass a local "
                          f".txt/.jsonl/.parquet/.bin file or save_to_disk directory") from None
    if key not in dataset.column_names:
        raise ConfigError(f"{flag} {data_path}: no '{key}' column (columns: {', '.join(dataset.column_names)})")
    return dataset


def _text(row: object, where: str, path: str, key: str = "text", flag: str = "--data-path") -> str:
    if not isinstance(row, dict) or not isinstance(row.get(key), str):
        raise ConfigError(f"{flag} {path}: {where} has no string '{key}' field; fix or remove it")
    return row[key]


def _batched(items, size: int) -> Iterator[list]:
    items = iter(items)
    while batch := list(itertools.islice(items, size)):
        yield batch


# ----------------------------------------------------------------------------------------------- tokenizing


def load_tokenizer(path: str):
    """A Hugging Face tokenizer with an EOS token (the document separator)."""
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
    return tokenizer


def write_corpus(source: "_Source", tokenizer, prefix: str, append_eod: bool = True, tokenizer_path=None,
                 workers: int = 1, progress=None) -> dict:
    """Every document of ``source`` into ``prefix.bin/.idx`` (EOS after each with ``append_eod``); empty ones are
    skipped and counted. Nothing is left behind when it fails."""
    counts = dict(documents=0, empty_documents=0, tokens=0)
    eos = tokenizer.eos_token_id
    with indexed.PrefixWriter(prefix, indexed.optimal_dtype(len(tokenizer))) as out:
        texts_ends, ends_only = itertools.tee(source.segments())
        batches = ([t for t in texts if t] for texts, _ in texts_ends)
        for (texts, ends), ids in zip(ends_only, indexed.encoded(batches, tokenizer, tokenizer_path, workers)):
            kept = iter(ids)
            for text, end in zip(texts, ends):
                if not text:
                    counts["empty_documents"] += 1
                    continue
                doc = next(kept) + ([eos] if append_eod and end else [])
                out.add(doc)
                counts["documents"] += 1
                counts["tokens"] += len(doc)
            if progress is not None:
                progress(len(texts), counts["tokens"])
        if not counts["tokens"]:
            raise ConfigError(f"{source.flag} {source.path}: no text to train on (every document is empty); give "
                              "documents with text")
    return dict(counts, vocab_size=len(tokenizer), eos_id=eos)


# ----------------------------------------------------------------------------------------------- cache


def _cache_dir(data_path: str, cache_dir: Optional[str], hub: bool) -> str:
    directory = cache_dir or (HUB_CACHE_DIR if hub else os.path.join(os.path.dirname(os.path.abspath(data_path)),
                                                                     ".cache", "megatron_ext"))
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(os.path.join(directory, ".gitignore")):  # a cache in a checkout stays untracked
        with open(os.path.join(directory, ".gitignore"), "w") as f:
            f.write("*\n")
    return directory


def text_prefix(data_path: str, tokenizer_path: str, cache_dir: Optional[str], flag: str = "--data-path") -> dict:
    """Rank 0's part for text: the cached prefix of (data, tokenizer), built when missing; its metadata."""
    tokenizer = load_tokenizer(tokenizer_path)
    source = _Source(data_path, flag=flag)
    parts = dict(format=CACHE_FORMAT, data=source.fingerprint, tokenizer=_tokenizer_fingerprint(tokenizer))
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    stem = os.path.join(_cache_dir(data_path, cache_dir, source.kind == "hub"), f"tokens-{key[:24]}")
    if os.path.isfile(stem + ".idx") and os.path.isfile(stem + ".json"):
        with open(stem + ".json") as f:
            return dict(json.load(f), prefix=stem, cache="hit")
    workers = corpus_processes(source)
    if workers > 1:
        print(f"megatron_ext: tokenizing {flag} {data_path} in {workers} processes", flush=True)
    meta = dict(write_corpus(source, tokenizer, stem, tokenizer_path=tokenizer_path, workers=workers),
                source=source.kind)
    with open(stem + ".json", "w") as f:
        json.dump(meta, f)
    return dict(meta, prefix=stem, cache="build")


def corpus_processes(source: _Source) -> int:
    """Processes for tokenizing ``source`` on rank 0: ``sft.preparing_processes`` for a large corpus
    (``PARALLEL_BYTES``, ``PARALLEL_ROWS``), one for a small one."""
    large = len(source._dataset) >= PARALLEL_ROWS if source.kind == "hub" else \
        os.path.getsize(source.path) >= PARALLEL_BYTES
    return preparing_processes() if large else 1


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


def bin_prefix(path: str, cache_dir: Optional[str]) -> dict:
    """Rank 0's part for a nanoGPT .bin: a prefix linking to it (no copy) with an index of 1M-token documents."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    path = os.path.abspath(path)
    tokens = _open_bin(path)
    stat = os.stat(path)
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, path, stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()
    stem = os.path.join(_cache_dir(path, cache_dir, False), f"bin-{key[:24]}")
    if os.path.isfile(stem + ".idx") and os.path.isfile(stem + ".json"):
        with open(stem + ".json") as f:
            return dict(json.load(f), prefix=stem, cache="hit")
    n = len(tokens)
    lengths = [BIN_PIECE_TOKENS] * (n // BIN_PIECE_TOKENS) + ([n % BIN_PIECE_TOKENS] if n % BIN_PIECE_TOKENS else [])
    partial = f"{stem}.partial-{os.getpid()}"
    os.symlink(path, partial + ".bin")
    with _IndexWriter(partial + ".idx", np.uint16) as writer:
        writer.write(lengths, None, list(range(len(lengths) + 1)))
    meta = dict(source="bin", documents=len(lengths), empty_documents=0, tokens=n,
                vocab_size=int(tokens.max()) + 1, eos_id=None)
    os.replace(partial + ".bin", stem + ".bin")
    with open(stem + ".json", "w") as f:
        json.dump(meta, f)
    os.replace(partial + ".idx", stem + ".idx")
    return dict(meta, prefix=stem, cache="build")


def sibling_val(path: str) -> Optional[str]:
    """nanoGPT's layout: ``train.bin`` with ``val.bin`` beside it (then no split is needed)."""
    val = os.path.join(os.path.dirname(path), "val.bin")
    return val if os.path.basename(path) == "train.bin" and os.path.isfile(val) else None
