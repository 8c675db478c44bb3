"""The one reader of data rows: a local .json/.jsonl/.parquet file, a ``save_to_disk`` directory or a datasets hub
id, read row by row with where each row is (for error messages), and fingerprinted for the cache key. SFT, preference
pairs, KTO's examples, pretraining text (whose .txt and .bin it opens for data/tokens.py) and eval_math read here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator, Optional, Sequence, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import HUB_ID

SAVED_MARKS = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes: a Dataset, a DatasetDict
BATCH_ROWS = 1024  # rows read at a time from a parquet file or a data set


@dataclasses.dataclass(frozen=True)
class Accepts:
    """What a flag's files may be: their suffixes, what the error for another suffix says to use, a hub id to cite."""
    suffixes: Tuple[str, ...]
    use: str
    example: str


CHATS = Accepts((".json", ".jsonl", ".parquet"), ".json, .jsonl or .parquet", "meta-math/MetaMathQA")


def first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]


def looks_like_path(path: str) -> bool:
    """A local path rather than a datasets hub id: explicit (``/``, ``.``, ``~``), not of a hub id's form, named as
    Megatron-LM names corpora (``..._document``), or in a directory that exists (``data/owt_text_documnet``)."""
    parent = os.path.dirname(path)
    return (path.startswith(("/", ".", "~")) or not HUB_ID.match(path) or path.endswith(("_document", "_sentence"))
            or (bool(parent) and os.path.isdir(parent)))


def is_file(path: str, accepts: Accepts = CHATS) -> bool:
    """A local file rather than a datasets hub id or a directory: an existing file, a known suffix, or a string that
    looks like a path (a typo is then "no such file", not a hub look-up)."""
    return not os.path.isdir(path) and (os.path.isfile(path) or path.endswith(accepts.suffixes)
                                        or looks_like_path(path))


def check_path(data_path: str, flag: str = "--data-path", accepts: Accepts = CHATS) -> None:
    """A path that names a local file must be a readable one of ``accepts``: checked with the flags
    (arguments.parse), before any rank reads it. Hub ids and directories are checked as they load."""
    path = os.path.expanduser(data_path)
    if not is_file(path, accepts):
        return
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file; pass an existing {'/'.join(accepts.suffixes)} file "
                          f"or a datasets hub id such as {accepts.example}")
    if not path.endswith(accepts.suffixes):
        raise ConfigError(f"{flag} {path}: unsupported file type '{os.path.splitext(path)[1]}'; use {accepts.use}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: file is not readable; fix its permissions")


class Source:
    """A data path opened for reading: a content fingerprint for the cache key, and its rows on demand. ``kind``:
    the file's suffix (``jsonl``, ``txt``, ...) or ``hub`` (a hub id or a directory: its ``split``, ``config``)."""

    def __init__(self, data_path: str, flag: str = "--data-path", accepts: Accepts = CHATS, split: str = "train",
                 config: Optional[str] = None):
        self.path, self.flag, self.accepts = os.path.expanduser(data_path), flag, accepts
        self.is_file = is_file(self.path, accepts)
        self.is_local = self.is_file or is_saved_dataset(self.path)
        if self.is_file:
            check_path(self.path, flag, accepts)
            self.kind = os.path.splitext(self.path)[1][1:]
            self.fingerprint = "sha256:" + sha256_file(self.path)
        else:
            self.kind = "hub"
            self.dataset = (load_saved_dataset(self.path, split, flag) if self.is_local
                            else self._load_hub_dataset(config, split))
            self.fingerprint = "datasets:" + self.dataset._fingerprint

    def rows(self, columns: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, Any]]:
        """(where, row) pairs; ``where`` is what an error message should point at (1-based line or row index). A
        JSON line that does not decode is a ``NotUtf8`` or None row. With ``columns``, a parquet file or data set
        reads only those (each must be there)."""
        if self.kind == "hub":
            return self._table_rows(self.dataset.column_names, columns, lambda: (
                self.dataset.select_columns(list(columns)) if columns else self.dataset).iter(BATCH_ROWS))
        if self.kind == "parquet":
            return self._parquet_rows(columns)
        return self._json_rows()

    def _parquet_rows(self, columns) -> Iterator[Tuple[str, Any]]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except Exception as e:
            raise ConfigError(f"{self.flag} {self.path}: not a readable parquet file ({first_line(e)}); "
                              "regenerate it") from None
        return self._table_rows(table.schema_arrow.names, columns, lambda: (
            batch.to_pydict() for batch in table.iter_batches(BATCH_ROWS, columns=columns)))

    def _table_rows(self, names, columns, batches) -> Iterator[Tuple[str, Any]]:
        for column in columns or ():
            if column not in names:
                raise ConfigError(f"{self.flag} {self.path}: no '{column}' column (columns: {', '.join(names)})")
        rows = (dict(zip(batch, values)) for batch in batches() for values in zip(*batch.values()))
        return ((f"row index {i}", row) for i, row in enumerate(rows))

    def _json_rows(self) -> Iterator[Tuple[str, Any]]:
        with open(self.path, "rb") as f:
            if f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):  # one JSON list, else JSON lines
                f.seek(0)
                data = f.read()
                try:
                    rows = json.loads(data.decode("utf-8-sig"))
                except UnicodeDecodeError as e:
                    line = data[:e.start].count(b"\n") + 1
                    raise ConfigError(f"{self.flag} {self.path}: line {line} is not valid UTF-8; re-save the file as "
                                      "UTF-8") from None
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{self.flag} {self.path}: invalid JSON list ({first_line(e)}); fix the file "
                                      f"or write one JSON object per line") from None
                yield from ((f"row index {i}", row) for i, row in enumerate(rows))
                return
            f.seek(0)
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:  # an undecodable line is a bad row like any other
                        yield f"line {number}", json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))
                    except UnicodeDecodeError:
                        yield f"line {number}", NotUtf8()
                    except json.JSONDecodeError:
                        yield f"line {number}", None

    def _load_hub_dataset(self, config: Optional[str], split: str):
        import datasets

        try:
            return datasets.load_dataset(self.path, config, split=split)
        except Exception as e:
            raise ConfigError(f"{self.flag} {self.path}: cannot load it as a datasets hub id ({first_line(e)}); check "
                              f"the id and the network (offline, it must already be in the HF cache) or pass a local "
                              f"{'/'.join(self.accepts.suffixes)} file or save_to_disk directory") from None


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


class NotUtf8:
    """A JSON line whose bytes are not UTF-8."""
