"""Where ``pretrain_vit.py``'s images come from, torch-free: which kind of --data-path it is (megatron_ext.launch
checks it in one process before any rank starts; data/images.py opens it by the same rule), its splits, its image
and label columns, and its labels."""

from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from megatron_ext.data.rows import first_line, is_saved_dataset
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import HUB_ID

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "fine_label")
VALID_SPLITS = ("validation", "valid", "val", "test")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
WHAT_TO_PASS = ("pass a datasets hub id (ethz/food101, uoft-cs/cifar100), a save_to_disk or class-per-folder image "
                "directory, or .parquet/.arrow files (a path or glob)")


def kind(data_path: str) -> str:
    """"directory" (save_to_disk or class-per-folder images), "files" (a .parquet/.arrow path or glob), or "hub" (a
    datasets id); anything else is one line."""
    path = os.path.expanduser(data_path)
    if os.path.isdir(path):
        return "directory"
    if path.endswith((".parquet", ".arrow")) or glob.has_magic(path) or os.path.isfile(path):
        return "files"
    if HUB_ID.match(data_path) and not data_path.startswith("."):
        return "hub"
    raise ConfigError(f"--data-path {data_path}: no such file or directory; {WHAT_TO_PASS}")


def named_files(data_path: str) -> list:
    """The files a "files" --data-path names (sorted), or one line when none exists."""
    found = sorted(glob.glob(os.path.expanduser(data_path)))
    if not found:
        raise ConfigError(f"--data-path {data_path}: no such file; {WHAT_TO_PASS}")
    return found


def check(data_path: str) -> None:
    """The checks a local --data-path gets before any rank starts (a hub id is looked up as it loads)."""
    if kind(data_path) == "files":
        named_files(data_path)


def _load(builder: str, **kwargs):
    import datasets

    return datasets.load_dataset(builder, **kwargs)


def open_splits(data_path: str) -> Dict[str, Any]:
    """The --data-path's splits as ``datasets.Dataset`` objects by name, or a one-line ConfigError."""
    import datasets

    path, how = os.path.expanduser(data_path), kind(data_path)
    try:
        if how == "directory":
            if is_saved_dataset(path):
                loaded = datasets.load_from_disk(path)
            elif any(f.lower().endswith(IMAGE_SUFFIXES) for _, _, files in os.walk(path) for f in files):
                loaded = _load("imagefolder", data_dir=path)
            else:
                raise ConfigError(f"--data-path {data_path}: a directory with neither a save_to_disk data set nor "
                                  f"image files; {WHAT_TO_PASS}")
        elif how == "files":
            files = named_files(data_path)
            kinds = {os.path.splitext(f)[1] for f in files}
            if len(kinds) != 1 or kinds - {".parquet", ".arrow"}:
                raise ConfigError(f"--data-path {data_path}: unsupported file type {'/'.join(sorted(kinds))}; "
                                  f"{WHAT_TO_PASS}")
            loaded = _load(kinds.pop()[1:], data_files=files)
        else:
            try:
                loaded = _load(data_path)
            except Exception as e:
                raise ConfigError(f"--data-path {data_path}: cannot load it as a datasets hub id ({first_line(e)});"
                                  f" check the id and the network (offline, it must already be in the HF cache) or "
                                  f"pass a local save_to_disk/image directory or .parquet/.arrow files") from None
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--data-path {data_path}: cannot read it ({first_line(e)}); {WHAT_TO_PASS}") from None
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def pick_splits(splits: Dict[str, Any], data_path: str) -> Tuple[str, Optional[str]]:
    """(train split name, validation split name or None when validation must be carved out of train)."""
    train = "train" if "train" in splits else next(iter(splits)) if len(splits) == 1 else None
    if train is None:
        raise ConfigError(f"--data-path {data_path}: no 'train' split among {', '.join(splits)}; save the training "
                          f"split as 'train'")
    return train, next((s for s in VALID_SPLITS if s in splits and s != train), None)


def detect_columns(features, image_column: Optional[str], label_column: Optional[str],
                   data_path: str) -> Tuple[str, str]:
    """The image column (the only Image feature, else image/img) and the label column (label, fine_label, else the
    only ClassLabel), unless given."""
    import datasets

    columns = ", ".join(features)
    for flag, name in (("--image-column", image_column), ("--label-column", label_column)):
        if name is not None and name not in features:
            raise ConfigError(f"{flag} {name}: no such column in {data_path} (columns: {columns})")
    if image_column is None:
        typed = [c for c, f in features.items() if isinstance(f, datasets.Image)]
        named = [c for c in IMAGE_COLUMNS if c in features]
        image_column = typed[0] if len(typed) == 1 else (named[0] if named else None)
        if image_column is None:
            raise ConfigError(f"--data-path {data_path}: cannot tell which column holds the images (columns: "
                              f"{columns}); pass --image-column")
    if label_column is None:
        named = [c for c in LABEL_COLUMNS if c in features]
        typed = [c for c, f in features.items() if isinstance(f, datasets.ClassLabel)]
        label_column = named[0] if named else (typed[0] if len(typed) == 1 else None)
        if label_column is None:
            raise ConfigError(f"--data-path {data_path}: cannot tell which column holds the labels (columns: "
                              f"{columns}); pass --label-column")
    return image_column, label_column


def read_labels(ds, column: str, class_names: Optional[List[str]],
                data_path: str) -> Tuple[np.ndarray, Optional[List[str]]]:
    """Labels as int64 (-1 where missing) and the class names: a ClassLabel's, or the sorted distinct strings of a
    string column (mapped to their positions)."""
    import pyarrow as pa

    arr = ds.with_format("arrow")[column]
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type) or pa.types.is_null(arr.type):
        values = arr.cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
        return values.astype(np.int64), class_names
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        strings = arr.to_pylist()
        names = class_names or sorted({s for s in strings if s is not None})
        index = {name: i for i, name in enumerate(names)}
        return np.array([index.get(s, -1) if s is not None else -1 for s in strings], np.int64), names
    raise ConfigError(f"--label-column {column}: has type {arr.type} in {data_path}; pass a column of integer class "
                      f"ids or class-name strings")


def value_where(value: Any, split: str, row: int) -> str:
    path = value.get("path") if isinstance(value, dict) else value if isinstance(value, str) else None
    if isinstance(value, dict) and value.get("bytes") is not None:
        return f"{split} row {row}" + (f" ({path})" if path else "")
    return path or f"{split} row {row}"
