"""Where fine-tuning rows come from: a local .json/.jsonl/.parquet file, a ``save_to_disk`` directory or a datasets
hub id, read row by row with where each row is (for error messages), and fingerprinted for the cache key."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator, Tuple

from megatron_ext.errors import ConfigError

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
SAVED_MARKS = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes: a Dataset, a DatasetDict


def first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]


def _is_file(path: str) -> bool:
    """A local file rather than a datasets hub id or a saved data set's directory."""
    return not os.path.isdir(path) and (os.path.isfile(path) or path.endswith(LOCAL_SUFFIXES)
                                        or path.startswith(("/", ".")))


def check_path(data_path: str) -> None:
    """A --data-path that names a local file must be a readable .json/.jsonl/.parquet one: checked with the flags
    (arguments.parse), before any rank reads it. Hub ids and directories are checked as they load."""
    path = os.path.expanduser(data_path)
    if not _is_file(path):
        return
    if not os.path.isfile(path):
        raise ConfigError(f"--data-path {path}: no such file; pass an existing .json/.jsonl/.parquet file "
                          f"or a datasets hub id such as meta-math/MetaMathQA")
    if not path.endswith(LOCAL_SUFFIXES):
        raise ConfigError(f"--data-path {path}: unsupported file type; use .json, .jsonl or .parquet")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"--data-path {path}: file is not readable; fix its permissions")


class Source:
    """A --data-path opened for reading: a content fingerprint for the cache key, and its rows on demand."""

    def __init__(self, data_path: str):
        self.path = os.path.expanduser(data_path)
        self.is_file = _is_file(self.path)
        self.is_local = self.is_file or is_saved_dataset(self.path)
        if self.is_file:
            check_path(self.path)
            self.fingerprint = "sha256:" + sha256_file(self.path)
        else:
            self._dataset = (load_saved_dataset(self.path, "train", "--data-path") if self.is_local
                             else _load_hub_dataset(self.path))
            self.fingerprint = "datasets:" + self._dataset._fingerprint

    def rows(self) -> Iterator[Tuple[str, Any]]:
        """(where, row) pairs; ``where`` is what an error message should point at (1-based line or row index)."""
        if not self.is_file:
            return ((f"row index {i}", row) for i, row in enumerate(self._dataset))
        if self.path.endswith(".parquet"):
            return self._parquet_rows()
        return self._json_rows()

    def _parquet_rows(self) -> Iterator[Tuple[str, Any]]:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(self.path).to_pylist()
        except Exception as e:
            raise ConfigError(f"--data-path {self.path}: not a readable parquet file ({first_line(e)})") from None
        return ((f"row index {i}", row) for i, row in enumerate(rows))

    def _json_rows(self) -> Iterator[Tuple[str, Any]]:
        with open(self.path, "rb") as f:
            data = f.read()
        if data.lstrip().startswith(b"["):  # one JSON list, otherwise JSON lines
            try:
                rows = json.loads(data.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"--data-path {self.path}: invalid JSON list ({first_line(e)}); fix the file or "
                                  f"write one JSON object per line") from None
            yield from ((f"row index {i}", row) for i, row in enumerate(rows))
            return
        for number, line in enumerate(data.splitlines(), start=1):
            if line.strip():
                try:  # an undecodable line is a bad row like any other
                    yield f"line {number}", json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    yield f"line {number}", NotUtf8()
                except json.JSONDecodeError:
                    yield f"line {number}", None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_saved_dataset(path: str) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, mark)) for mark in SAVED_MARKS)


def load_saved_dataset(path: str, split: str, flag: str):
    """A save_to_disk directory as one ``datasets.Dataset`` (``split`` of a DatasetDict, or its only split):
    ``load_dataset`` refuses these directories ("use load_from_disk")."""
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise ConfigError(f"{flag} {path}: cannot load this save_to_disk directory ({first_line(e)}); save it again "
                          f"with Dataset.save_to_disk or pass a .json/.jsonl/.parquet file") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded and len(loaded) != 1:
            raise ConfigError(f"{flag} {path}: the saved DatasetDict has no '{split}' split (it has "
                              f"{', '.join(loaded)}); save the split to use as a Dataset of its own")
        loaded = loaded[split] if split in loaded else next(iter(loaded.values()))
    return loaded


def _load_hub_dataset(data_path: str):
    import datasets

    try:
        return datasets.load_dataset(data_path, split="train")
    except Exception as e:
        raise ConfigError(f"--data-path {data_path}: cannot load it as a datasets hub id ({first_line(e)}); check the "
                          f"id and the network (offline, it must already be in the HF cache) or pass a local "
                          f".json/.jsonl/.parquet file") from None


class NotUtf8:
    """A JSON line whose bytes are not UTF-8."""
