"""The files of a checkpoint directory, for every engine: atomic saves (written beside, renamed when complete,
trackers last), the manifest that proves a checkpoint complete, locating what ``--load`` names (an incomplete one is
an error naming the missing file, never a silent restart), ``--save-retain`` and refusing a foreign ``--save``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_ext.errors import ConfigError
from megatron_ext.parallel import on_rank0

TRACKER = "latest_checkpointed_iteration.txt"
DS_LATEST = "latest"  # DeepSpeed's tracker: the tag (directory name) of its newest checkpoint
MANIFEST = "manifest.json"  # every file of a complete checkpoint with its size, written before it is made visible
ITER = re.compile(r"iter_(\d{7,})")
LEFTOVER = re.compile(r"iter_\d{7,}\.(tmp|old|del)")  # a save or deletion that did not finish: never loaded
FIX = f"point {TRACKER} at an older iter_ directory or delete this one"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not text.isdigit():
        raise ConfigError(f"{os.path.join(root, TRACKER)} holds {text[:40]!r}, not an iteration; write the number "
                          "of a complete iter_ directory into it")
    return int(text)


def iterations(root: str) -> List[int]:
    """The complete (published-name) ``iter_`` directories under ``root``, oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in map(ITER.fullmatch, names)
                  if m and os.path.isdir(os.path.join(root, m.group(0))))


def holds_checkpoints(root: str) -> bool:
    return bool(iterations(root)) or any(os.path.isfile(os.path.join(root, t)) for t in (TRACKER, DS_LATEST))


def check_complete(path: str, root: str) -> Optional[str]:
    """The first file the manifest lists that is missing or of another size; checkpoints without a manifest
    (written before it existed, converted ones) pass. ``path`` may be a directory inside the checkpoint
    (DeepSpeed's ``mcore/`` export)."""
    top, prefix = path, ""
    if not os.path.isfile(os.path.join(path, MANIFEST)) and os.path.isfile(os.path.join(path, "..", MANIFEST)):
        top, prefix = os.path.dirname(os.path.normpath(path)), os.path.basename(os.path.normpath(path)) + "/"
    try:
        with open(os.path.join(top, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        return f"--load {root}: {os.path.join(top, MANIFEST)} is unreadable ({e}); {FIX}"
    for name, size in sorted(files.items()):
        if not name.startswith(prefix):
            continue
        full = os.path.join(top, name)
        if not os.path.isfile(full):
            return f"--load {root}: the checkpoint is incomplete, {full} is missing; {FIX}"
        if os.path.getsize(full) != size:
            return (f"--load {root}: the checkpoint is incomplete, {full} is truncated ({os.path.getsize(full)} of "
                    f"{size} bytes); {FIX}")
    return None


def _locate(root: str) -> Optional[str]:
    """The checkpoint directory ``--load root`` names, or None when ``root`` holds none at all (a first run starts
    from scratch). Anything else that is not a complete checkpoint is an error naming what is missing."""
    if os.path.isfile(os.path.join(root, MANIFEST)) or os.path.isfile(os.path.join(root, "metadata.json")) \
            or ITER.fullmatch(os.path.basename(os.path.normpath(root))):
        return root  # an iter_ directory itself, or a converted/exported checkpoint
    iteration = latest_iteration(root)
    if iteration is None:
        held = iterations(root)
        if not held:
            return None
        if os.path.isfile(os.path.join(root, DS_LATEST)):
            return None  # DeepSpeed's: the caller says so
        raise ConfigError(f"--load {root} holds iter_ directories (newest iter_{held[-1]:07d}) but no {TRACKER}; "
                          f"write the iteration to resume into it (echo {held[-1]} > {root}/{TRACKER}) or use a "
                          "new directory")
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        old = f" ({path}.old holds the copy an interrupted re-save replaced: rename it back)" \
            if os.path.isdir(path + ".old") else ""
        raise ConfigError(f"--load {root}: {TRACKER} names {path}, which is missing{old}; {FIX}")
    return path


def locate(root: str) -> Optional[str]:
    """``_locate`` plus the manifest check, decided by rank 0 for every rank."""
    def check() -> Optional[str]:
        path = _locate(root)
        error = check_complete(path, root) if path else None
        if error:
            raise ConfigError(error)
        return path

    return on_rank0(check)


def begin_save(root: str, iteration: int) -> str:
    """The temporary sibling ``iter_XXXXXXX.tmp`` every rank writes into (``find`` and the trackers never name it);
    what a crashed save or deletion left is removed first."""
    staging = iteration_dir(root, iteration) + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in filter(LEFTOVER.fullmatch, os.listdir(root)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    return staging


def _listing(top: str) -> Dict[str, int]:
    files = {}
    for dirpath, _, names in os.walk(top):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, top)] = os.path.getsize(full)
    return files


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_save(root: str, iteration: int, staging: str, trackers: Optional[Dict[str, str]] = None,
                seconds: Optional[float] = None) -> str:
    """Make the staged checkpoint visible once complete: every rank's files closed (barrier), their sizes as each
    rank sees them (on a shared filesystem the writer's own view is the complete one) merged into the manifest,
    the directory renamed to ``iter_XXXXXXX``, then the trackers (default: ours) rewritten atomically. A crash
    before the rename leaves the previous checkpoint named by the trackers. ``seconds``: how long the save took
    (staging to now), kept in the manifest for the next start's preemption-budget check."""
    dist.barrier()
    views = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_listing(staging), views, dst=0)
    final = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        files: Dict[str, int] = {}
        for view in views:
            for name, size in view.items():
                files[name] = max(size, files.get(name, 0))
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump(dict(iteration=iteration, files=files, **({"save_seconds": round(seconds, 3)} if seconds
                                                                  is not None else {})), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(final):  # the same iteration saved again (resumed, then saved at the same step)
            os.rename(final, final + ".old")
        os.rename(staging, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        _fsync_dir(root)
        for name, text in (trackers or {TRACKER: str(iteration)}).items():
            write_atomic(os.path.join(root, name), text)
    dist.barrier()
    return final


def last_save_seconds(root: Optional[str]) -> Optional[float]:
    """How long the save of the newest checkpoint under ``root`` took (its manifest), if it says."""
    try:
        iteration = latest_iteration(root) if root else None
        if iteration is None:
            return None
        with open(os.path.join(iteration_dir(root, iteration), MANIFEST)) as f:
            return json.load(f).get("save_seconds")
    except (OSError, ValueError, ConfigError):
        return None


def retain(root: Optional[str], keep: Optional[int]) -> None:
    """--save-retain N, on every rank after each save: rank 0 deletes the oldest ``iter_`` directories beyond the
    newest N, never one a tracker names (renamed first, so a half-deleted one is never taken for a checkpoint)."""
    if not root or keep is None:
        return
    if dist.get_rank() == 0:
        protected = {latest_iteration(root)}
        with contextlib.suppress(OSError):
            with open(os.path.join(root, DS_LATEST)) as f:
                match = ITER.fullmatch(f.read().strip())
                protected.add(int(match.group(1)) if match else None)
        held = iterations(root)
        for iteration in held[:max(0, len(held) - keep)]:
            if iteration not in protected:
                path = iteration_dir(root, iteration)
                os.rename(path, path + ".del")
                shutil.rmtree(path + ".del", ignore_errors=True)
    dist.barrier()


def saved_model_shape(path: str) -> Optional[dict]:
    """The ``model_shape`` a checkpoint directory records (any engine's), read without running code from it."""
    return _common(path).get("model_shape")


def _common(path: str) -> dict:
    for name in ("common.pt", "fsdp_common.pt", os.path.join("mcore", "common.pt")):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with contextlib.suppress(Exception):
                return torch.load(full, map_location="cpu", weights_only=True)
    return {}


def saved_common(root: str) -> dict:
    """What the newest checkpoint under ``root`` (or ``root``, an iteration directory) records; {} if none."""
    path = locate(root)
    return _common(path) if path is not None else {}


def check_save_dir(save: Optional[str], *, load: Optional[str], finetune: bool, model_shape: Optional[dict]) -> None:
    """Refuse a --save directory that already holds checkpoints this run does not resume: another model's would
    be mixed with ours, and even the same model's two runs' iterations would interleave under one tracker (and
    --save-retain would delete the other run's). Megatron-LM's habit, --save DIR --load DIR, resumes it."""
    if not save or not holds_checkpoints(save):
        return
    if load and not finetune:
        target = os.path.realpath(load)
        if target == os.path.realpath(save) or os.path.dirname(target) == os.path.realpath(save):
            return
    held = iterations(save)
    shape = saved_model_shape(iteration_dir(save, held[-1])) if held else None
    if shape is not None and model_shape is not None and shape != model_shape:
        raise ConfigError(f"--save {save} holds checkpoints of another model (shape {shape}); use a new directory "
                          f"or --load {save} to resume it")
    newest = f" (newest iter_{held[-1]:07d})" if held else ""
    raise ConfigError(f"--save {save} already holds checkpoints{newest} of a run this one does not resume; pass "
                      f"--load {save} to resume it, or use a new directory")




def check_shared(path: Optional[str], flag: str, in_parent: bool = True) -> None:
    """Every rank must see the directory ``path`` is written in as rank 0 does: ranks write their own files there
    (--save's shards, --save-hf's safetensors) and rank 0 renames them into place, so on node-local disks the other
    nodes would fail with a traceback after training while their peers wait. Rank 0 leaves a probe file there
    (``path``'s parent, created if need be; ``path`` itself when it exists and not ``in_parent``), each rank looks
    for it; one line, on every rank, before anything is built."""
    if not path or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    parent = os.path.abspath(path)
    if in_parent or not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    probe, error = os.path.join(parent, f".megatron_ext-probe-{os.getpid()}-{os.urandom(4).hex()}"), None
    if dist.get_rank() == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            open(probe, "w").close()
        except OSError as e:
            error = f"{flag} {path}: cannot write in {parent} ({e.strerror}); give a directory this job can write"
    box = [(probe, error)]
    dist.broadcast_object_list(box, src=0)
    probe, error = box[0]
    if error:
        raise ConfigError(error)
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while not sees(probe) and time.monotonic() < deadline:
        time.sleep(0.5)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (sees(probe), os.uname().nodename))
    if dist.get_rank() == 0:
        os.unlink(probe)
    blind = [(rank, host) for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ConfigError(f"{flag} {path}: {len(blind)} of {len(seen)} ranks (on {', '.join(hosts)}) do not see "
                          f"{parent} as rank 0 does (node-local disk?); give a directory on a filesystem every node "
                          "shares (NFS, Lustre, GPFS)")


VISIBLE_WITHIN_S = 60.0  # NFS may answer from a cached listing for up to acdirmax (60 s by default)


def sees(probe: str) -> bool:
    """Whether ``probe`` is there; listing its directory first makes an NFS client look again."""
    try:
        return os.path.basename(probe) in os.listdir(os.path.dirname(probe))
    except OSError:
        return False
