"""How ``pretrain_vit.py`` reads a --data-path, torch-free: megatron_ext.launch checks it in one process before any
rank starts, and data/images.py opens it by the same rule."""

from __future__ import annotations

import glob
import os

from megatron_ext.data.indexed import HUB_ID
from megatron_ext.errors import ConfigError

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


def files(data_path: str) -> list:
    """The files a "files" --data-path names (sorted), or one line when none exists."""
    found = sorted(glob.glob(os.path.expanduser(data_path)))
    if not found:
        raise ConfigError(f"--data-path {data_path}: no such file; {WHAT_TO_PASS}")
    return found


def check(data_path: str) -> None:
    """The checks a local --data-path gets before any rank starts (a hub id is looked up as it loads)."""
    if kind(data_path) == "files":
        files(data_path)
