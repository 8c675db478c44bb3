"""Megatron's pretraining corpora: ``PREFIX.bin`` (every document's token ids back to back) and ``PREFIX.idx`` (their
lengths and boundaries), written by megatron-core's ``IndexedDatasetBuilder`` and read by its ``IndexedDataset``,
the format Megatron-LM's ``tools/preprocess_data.py`` writes. Here: checking a prefix before training, writing one
atomically (the ``.idx`` appears last, so a prefix with an ``.idx`` is complete), and tokenizing documents with
worker processes in order.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Iterator, List, Optional, Sequence

import numpy as np

from megatron_ext.data.rows import looks_like_path
from megatron_ext.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
FRONT_DOOR = (".txt", ".json", ".jsonl", ".parquet", ".bin")  # files data/tokens.py reads (nanoGPT's .bin too)


def optimal_dtype(vocab_size: int) -> type:
    """Megatron-LM's choice (``DType.optimal_dtype``): uint16 below 65,500 tokens, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def is_prefix(path: str) -> bool:
    """``path`` names a corpus prefix, maybe a missing one: its .idx or .bin exists, or it is no file or directory
    the front door reads and looks like a path rather than a hub id (a typo is then a missing prefix)."""
    if os.path.isfile(path + ".idx") or (os.path.isfile(path + ".bin") and not path.endswith(".bin")):
        return True
    return not path.endswith(FRONT_DOOR) and not os.path.exists(path) and looks_like_path(path)


def check_blend(prefixes: Sequence[str], values: Sequence[str], flag: str = "--data-path") -> None:
    """Every prefix of one flag's blend (``values``) checked (``check_prefix``), all of one token dtype."""
    dtypes = {check_prefix(p, flag)["dtype"] for p in prefixes}
    if len(dtypes) > 1:
        raise ConfigError(f"{flag} {' '.join(values)}: the corpora hold different token dtypes "
                          f"({', '.join(sorted(dtypes))}); a blend needs one; regenerate them with the same tokenizer")


def check_flags(data) -> None:
    """Before any process group: the corpora that --data-path, --train-data-path and --valid-data-path name by
    prefix, each blend checked (text and hub ids are the front door's, later). One line, nothing written."""
    from megatron_ext.data import mixture

    for flag in ("--data-path", "--train-data-path", "--valid-data-path"):
        values = getattr(data, flag[2:].replace("-", "_"), None)
        if values and not getattr(data, "mock_data", False):
            paths = [os.path.expanduser(p) for _, p in mixture.parse(values)]
            check_blend([p for p in paths if is_prefix(p)], values, flag)


def check_path(path: str, flag: str = "--data-path") -> None:
    """A pretraining --data-path entry, checked with the flags (arguments.parse) before any rank reads it: a prefix
    must have its .bin/.idx, a path to a text file must exist. Hub ids are checked as they load (data/tokens.py)."""
    path = os.path.expanduser(path)
    if is_prefix(path):
        check_prefix(path, flag)
    elif not os.path.isdir(path) and not os.path.isfile(path) and (path.endswith(FRONT_DOOR) or looks_like_path(path)):
        raise ConfigError(f"{flag} {path}: no such file; pass an existing .txt/.json/.jsonl/.parquet/.bin file, "
                          "a .bin/.idx prefix or a datasets hub id such as karpathy/tiny_shakespeare")


def check_prefix(prefix: str, flag: str = "--data-path") -> dict:
    """The header of ``prefix``'s corpus, or one line naming what is missing or unreadable: ``{dtype, sequences,
    documents, tokens}``."""
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            raise ConfigError(f"{flag} {prefix}: {prefix + suffix} is missing; give the prefix of a .bin/.idx pair "
                              "(tools/preprocess_data.py writes them), a text file or a datasets hub id")
    path = prefix + ".idx"
    try:
        with open(path, "rb") as f:
            magic, version, code = f.read(9), f.read(8), f.read(1)
            if magic != MAGIC:
                raise ConfigError(f"{flag} {prefix}: {path} is not a Megatron index (.idx) file; regenerate it with "
                                  "tools/preprocess_data.py")
            version = struct.unpack("<Q", version)[0]
            if version != VERSION:
                raise ConfigError(f"{flag} {prefix}: {path} is index version {version}; this reader takes version "
                                  f"{VERSION} (megatron-core's); regenerate it")
            dtype = DTYPES.get(code[0] if code else -1)
            if dtype is None:
                raise ConfigError(f"{flag} {prefix}: {path} names an unknown token dtype (code "
                                  f"{code[0] if code else 'missing'}; known: 1-8); regenerate it")
            sequences, documents = struct.unpack("<QQ", f.read(16))
    except (OSError, struct.error) as e:
        raise ConfigError(f"{flag} {prefix}: cannot read {path} ({e}); regenerate it") from None
    tokens, size = os.path.getsize(prefix + ".bin") // np.dtype(dtype).itemsize, os.path.getsize(prefix + ".bin")
    if size % np.dtype(dtype).itemsize:
        raise ConfigError(f"{flag} {prefix}: {prefix}.bin is {size} bytes, not a whole number of "
                          f"{np.dtype(dtype).name} tokens as its .idx says; regenerate the pair")
    if not tokens or documents <= 1:
        raise ConfigError(f"{flag} {prefix}: the corpus is empty; give one with documents in it")
    return dict(dtype=np.dtype(dtype).name, sequences=sequences, documents=documents - 1, tokens=tokens)


class PrefixWriter:
    """Documents into ``prefix.bin``/``.idx`` through megatron-core's builder, under temporary names until
    ``close`` renames them, ``.idx`` last. ``add`` takes a document's ids; ``lengths`` cut it into sequences
    (default: one)."""

    def __init__(self, prefix: str, dtype):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self.prefix, self.dtype = prefix, dtype
        self._partial = f"{prefix}.partial-{os.getpid()}"
        self.builder = IndexedDatasetBuilder(self._partial + ".bin", dtype=dtype)
        self.documents = self.tokens = 0

    def add(self, ids, lengths: Optional[List[int]] = None) -> None:
        ids = np.asarray(ids, dtype=self.dtype)
        self.builder.add_document(ids, lengths or [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def close(self) -> None:
        self.builder.finalize(self._partial + ".idx")
        os.replace(self._partial + ".bin", self.prefix + ".bin")
        os.replace(self._partial + ".idx", self.prefix + ".idx")

    def abort(self) -> None:
        self.builder.data_file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self._partial + suffix):
                os.unlink(self._partial + suffix)

    def __enter__(self) -> "PrefixWriter":
        return self

    def __exit__(self, kind, *rest) -> None:
        self.abort() if kind is not None else self.close()


_worker_tokenizer = None


def _start_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from transformers import AutoTokenizer

    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)


def _encode_batch(texts: List[str]) -> List[List[int]]:
    return encode(_worker_tokenizer, texts)


def encode(tokenizer, texts: List[str]) -> List[List[int]]:
    """Ids of each text as plain text: a literal "<|endoftext|>" inside a document is not the EOS token (as
    nanoGPT's ``encode_ordinary``), so only the EOS appended after a document separates documents."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]


def encoded(batches: Iterable[List[str]], tokenizer, tokenizer_path: Optional[str] = None,
            workers: int = 1) -> Iterator[List[List[int]]]:
    """Each batch of texts as ids, in order: here, or in ``workers`` processes each loading the tokenizer from
    ``tokenizer_path`` (Megatron-LM's ``Pool.imap``)."""
    if workers <= 1 or tokenizer_path is None:
        yield from (encode(tokenizer, texts) for texts in batches)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (tokenizer_path,)) as pool:
        yield from pool.imap(_encode_batch, batches, chunksize=2)
