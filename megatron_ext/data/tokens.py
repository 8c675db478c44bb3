"""Text as a Megatron pretraining corpus: the front door that lets ``--data-path`` take a .txt/.json/.jsonl/.parquet
file, a datasets hub id or nanoGPT's pre-tokenized ``.bin`` as well as ``.bin``/``.idx`` prefixes.

Text is tokenized once per (data, tokenizer) into a cached prefix (``data/indexed.py``) with an EOS after each
document, then read like any other (``data/pretrain.py``). A .txt is one text cut into documents of about 1 KiB
at points where tokenizing is unaffected (megatron-core splits train and validation by documents), the EOS after
the last. A nanoGPT ``.bin`` becomes a prefix without a copy: a link to it and an index of 1M-token pieces.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Iterator, List, Optional, Tuple

import numpy as np

from megatron_ext.data import cache, indexed
from megatron_ext.data.rows import Accepts, NotUtf8, Source, check_path, first_line
from megatron_ext.data.tokenizer import load_tokenizer
from megatron_ext.errors import ConfigError

TEXT = Accepts(indexed.FRONT_DOOR, ".txt, .json, .jsonl, .parquet (a 'text' field per row) or a pre-tokenized "
               "uint16 .bin", "karpathy/tiny_shakespeare")  # .txt .json .jsonl .parquet and nanoGPT's .bin
CACHE_FORMAT = 2  # part of the cache key: bump when the cached corpus changes meaning
TOKENIZE_CHUNK = 1024  # documents per tokenizer call (the fast tokenizer encodes a batch in parallel)
TEXT_PIECE_CHARS = 1 << 10  # a .txt's documents: about this many characters (same ids as the whole)
BIN_PIECE_TOKENS = 1 << 20  # a nanoGPT .bin's documents, in its index
PARALLEL_BYTES = 64 << 20  # a file corpus this large (or a data set of PARALLEL_ROWS documents) is tokenized in
PARALLEL_ROWS = 100_000    # forked processes when a run preprocesses it (tools/preprocess_data.py: --workers)
# A safe place to cut text: after a lone newline between non-spaces. No match of GPT-2's pre-tokenizer regex
# crosses it, and the newline pre-tokenizes alone on either side, so the pieces encode to the same ids as the whole.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")

# ----------------------------------------------------------------------------------------------- documents


def open_text(data_path: str, flag: str = "--data-path") -> Source:
    """A text corpus opened for reading (``rows.Source``): a .txt/.json/.jsonl/.parquet file or a data set."""
    return Source(data_path, flag, TEXT)


def segments(source: Source, key: str = "text") -> Iterator[Tuple[List[str], List[bool]]]:
    """(texts, ends) a batch at a time, in order, one document each: ``ends[i]`` says an EOS follows ``texts[i]``.
    A row's document is its ``key`` field; a .txt's documents are pieces cut where tokenizing is unaffected, the
    EOS after the last."""
    if source.kind == "txt":
        pieces = _txt_pieces(source)
        for begin in range(0, len(pieces), 16):
            batch = pieces[begin:begin + 16]
            yield batch, [begin + i == len(pieces) - 1 for i in range(len(batch))]
        return
    texts = (_text(row, where, source, key) for where, row in source.rows([key]))
    for batch in _batched(texts, TOKENIZE_CHUNK):
        yield batch, [True] * len(batch)


def _txt_pieces(source: Source) -> List[str]:
    try:
        with open(source.path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source.flag} {source.path}: not UTF-8 text ({first_line(e)}); convert it") from None
    pieces, start = [], 0
    while len(text) - start > TEXT_PIECE_CHARS:
        cut = _SAFE_CUT.search(text, start + TEXT_PIECE_CHARS)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    return pieces + [text[start:]]


def _text(row: object, where: str, source: Source, key: str) -> str:
    if (row is None and where.startswith("line")) or isinstance(row, NotUtf8):  # (rows.Source's undecodable lines)
        raise ConfigError(f"{source.flag} {source.path}: {where} is not valid {'JSON' if row is None else 'UTF-8'}; "
                          "fix or remove it")
    if not isinstance(row, dict) or not isinstance(row.get(key), str):
        raise ConfigError(f"{source.flag} {source.path}: {where} has no string '{key}' field; fix or remove it")
    return row[key]


def _batched(items, size: int) -> Iterator[list]:
    items = iter(items)
    while batch := list(itertools.islice(items, size)):
        yield batch


# ----------------------------------------------------------------------------------------------- tokenizing


def write_corpus(source: Source, tokenizer, prefix: str, append_eod: bool = True, tokenizer_path=None,
                 workers: int = 1, progress=None, key: str = "text") -> dict:
    """Every document of ``source`` (its ``key`` field) into ``prefix.bin/.idx`` (EOS after each with
    ``append_eod``); empty ones are skipped and counted. Nothing is left behind when it fails."""
    counts = dict(documents=0, empty_documents=0, tokens=0)
    eos = tokenizer.eos_token_id
    with indexed.PrefixWriter(prefix, indexed.optimal_dtype(len(tokenizer))) as out:
        texts_ends, ends_only = itertools.tee(segments(source, key))
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


def _cached(directory: str, name: str, parts) -> Tuple[str, Optional[dict]]:
    """The prefix ``NAME-KEY`` in ``directory`` (made), and its metadata when it is there (an .idx comes last)."""
    stem = os.path.join(cache.prepare(directory), f"{name}-{cache.key(parts)[:24]}")
    if os.path.isfile(stem + ".idx") and os.path.isfile(stem + ".json"):
        with open(stem + ".json") as f:
            return stem, dict(json.load(f), prefix=stem, cache="hit")
    return stem, None


def text_prefix(data_path: str, tokenizer_path: str, cache_dir: Optional[str], flag: str = "--data-path") -> dict:
    """Rank 0's part for text: the cached prefix of (data, tokenizer), built when missing; its metadata."""
    tokenizer = load_tokenizer(tokenizer_path, chat=False)
    source = open_text(data_path, flag)
    parts = dict(format=CACHE_FORMAT, data=source.fingerprint, tokenizer=cache.tokenizer_fingerprint(tokenizer))
    stem, hit = _cached(cache_dir or cache.default_dir(source.path, source.is_file, "tokens"), "tokens", parts)
    if hit:
        return hit
    workers = corpus_processes(source)
    if workers > 1:
        print(f"megatron_ext: tokenizing {flag} {data_path} in {workers} processes", flush=True)
    meta = dict(write_corpus(source, tokenizer, stem, tokenizer_path=tokenizer_path, workers=workers),
                source=source.kind)
    with open(stem + ".json", "w") as f:
        json.dump(meta, f)
    return dict(meta, prefix=stem, cache="build")


def corpus_processes(source: Source) -> int:
    """Processes for tokenizing ``source`` on rank 0: ``cache.preparing_processes`` for a large corpus
    (``PARALLEL_BYTES``, ``PARALLEL_ROWS``), one for a small one."""
    large = len(source.dataset) >= PARALLEL_ROWS if source.kind == "hub" else \
        os.path.getsize(source.path) >= PARALLEL_BYTES
    return cache.preparing_processes() if large else 1


def _open_bin(path: str) -> np.ndarray:
    """nanoGPT's pre-tokenized format: raw uint16 token ids."""
    check_path(path, "--data-path", TEXT)
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
    stem, hit = _cached(cache_dir or cache.default_dir(path, True, "tokens"), "bin",
                        [CACHE_FORMAT, path, stat.st_size, stat.st_mtime_ns])
    if hit:
        return hit
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
