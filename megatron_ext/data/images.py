"""Labelled images for ``pretrain_vit.py``: a datasets hub id, a ``save_to_disk`` or class-per-folder directory, or
.parquet/.arrow files, served as uint8 micro-batches decoded in DataLoader worker processes.

Same protocol as ``SFTData`` (``sources.py``). Which samples a step uses comes from ``GlobalBatchSampler``, and each
sample's augmentation from (seed, epoch, sample index), so batches are identical on any mesh and a checkpoint needs
only ``consumed_samples``. Images are checked cheaply at build time (labels, and headers without decoding, so a
Food-101-sized set takes seconds); an image that still fails to decode in a worker is replaced by a fixed other
sample and counted. Batches stay uint8 ``[b, 3, H, W]``: the device converts, resizes and normalises.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.data import image_transforms as tf
from megatron_ext.data.image_sources import detect_columns, open_splits, pick_splits, read_labels, value_where
from megatron_ext.data.sampler import GlobalBatchSampler, rank_microbatches
from megatron_ext.data.rows import first_line
from megatron_ext.data.sft import split_weights
from megatron_ext.parallel import on_rank0
from megatron_ext.errors import ConfigError

Batch = Dict[str, torch.Tensor]
PROBE_CHUNK = 1024
SUBSTITUTE_STRIDE = 7919  # a decode failure at sample i is replaced by i + k * stride (mod n), first that decodes


def _is_main_rank() -> bool:
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


# ----------------------------------------------------------------------------------------------- samples


class ImageSamples(torch.utils.data.Dataset):
    """One split's usable rows; fetched in workers with ``__getitems__`` keyed by (sample index, epoch), epoch -1
    meaning the eval transform. Returns (HWC uint8 array, label, failure description or None)."""

    def __init__(self, table, column: str, split: str, rows: np.ndarray, labels: np.ndarray, *, size: int,
                 seed: int, draft: bool, crop_fraction: float):
        self.table, self.column, self.split = table, column, split
        self.rows, self.labels = rows, labels
        self.size, self.seed, self.draft, self.crop_fraction = size, seed, draft, crop_fraction

    def __len__(self) -> int:
        return len(self.rows)

    def values(self, indices: Sequence[int]) -> List[Any]:
        return self.table[[int(self.rows[i]) for i in indices]][self.column]

    def image(self, value: Any, index: int, epoch: int) -> np.ndarray:
        if epoch < 0:
            return tf.eval_image(value, self.size, self.crop_fraction)
        return tf.train_image(value, self.size, np.random.default_rng([self.seed, epoch, index]), self.draft)

    def __getitems__(self, keys: Sequence[Tuple[int, int]]) -> List[tuple]:
        return [self._sample(index, epoch, value)
                for (index, epoch), value in zip(keys, self.values([index for index, _ in keys]))]

    def __getitem__(self, key: Tuple[int, int]) -> tuple:
        return self.__getitems__([key])[0]

    def _sample(self, index: int, epoch: int, value: Any) -> tuple:
        try:
            return self.image(value, index, epoch), int(self.labels[index]), None
        except Exception as e:
            failure = f"{value_where(value, self.split, int(self.rows[index]))}: {first_line(e, 120)}"
        for k in range(1, 17):
            other = (index + k * SUBSTITUTE_STRIDE) % len(self)
            try:
                return self.image(self.values([other])[0], index, epoch), int(self.labels[other]), failure
            except Exception:
                continue
        raise RuntimeError(f"image data: {failure}, and 16 substitutes failed to decode too")


def collate(samples: List[tuple]) -> dict:
    pixels = torch.from_numpy(np.stack([s[0] for s in samples])).permute(0, 3, 1, 2).contiguous()
    return dict(pixels=pixels, labels=torch.tensor([s[1] for s in samples], dtype=torch.int64),
                loss_mask=torch.ones(len(samples), dtype=torch.float32),
                failures=[s[2] for s in samples if s[2] is not None])


class _TrainSteps:
    """DataLoader batch sampler: this rank's micro-batches, step after step from ``start`` consumed samples."""

    def __init__(self, size: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        self.args = (size, global_batch_size, seed)
        self.split = (dp_rank, dp_size, micro_batch_size)
        self.start = 0

    def __iter__(self) -> Iterator[List[Tuple[int, int]]]:
        sampler = GlobalBatchSampler(*self.args)
        sampler.consumed_samples = self.start
        while True:
            epoch = sampler.epoch
            for micro in rank_microbatches(sampler.next_global_batch(), *self.split):
                yield [(i, epoch) for i in micro]


class ImageData:
    """Train and validation images for one data-parallel rank (the ``SFTData`` protocol).

    Attributes: ``load_size`` (side of the uint8 images batches carry), ``image_size`` (the model's),
    ``num_classes`` and ``class_names`` (detected from the data; names None when unknown), ``train_size``,
    ``valid_size``, ``skipped`` / ``num_skipped`` (bad images dropped at build time, as "where: reason"),
    ``decode_failures`` (images replaced after failing to decode in a worker)."""

    def __init__(self, train: ImageSamples, valid: ImageSamples, *, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, num_workers: int = 2, prefetch_factor: int = 4,
                 image_size: Optional[int] = None, num_classes: Optional[int] = None,
                 class_names: Optional[List[str]] = None, skipped: Sequence[str] = ()):
        self.train, self.valid = train, valid
        self.load_size, self.image_size = train.size, image_size or train.size
        self.num_classes, self.class_names = num_classes, class_names
        self.skipped, self.num_skipped, self.decode_failures = list(skipped), len(skipped), 0
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.sampler = GlobalBatchSampler(len(train), global_batch_size, seed)  # only its consumed_samples
        try:
            self.micro_per_step = len(rank_microbatches(range(global_batch_size), dp_rank, dp_size,
                                                        micro_batch_size))
        except ValueError as e:
            raise ConfigError(f"--global-batch-size {global_batch_size}: {e}") from None
        self.loader_kwargs = dict(collate_fn=collate, num_workers=num_workers,
                                  pin_memory=torch.cuda.is_available(),
                                  prefetch_factor=prefetch_factor if num_workers > 0 else None)
        self._steps = _TrainSteps(len(train), global_batch_size, micro_batch_size, dp_rank, dp_size, seed)
        self._loader = torch.utils.data.DataLoader(train, batch_sampler=self._steps,
                                                   persistent_workers=num_workers > 0, **self.loader_kwargs)
        self._iter = None

    @property
    def train_size(self) -> int:
        return len(self.train)

    @property
    def valid_size(self) -> int:
        return len(self.valid)

    def _take(self, batch: dict) -> Batch:
        failures = batch.pop("failures")
        if failures:
            if not self.decode_failures and _is_main_rank():
                print(f"replacing images that fail to decode by other samples (first: {failures[0]})", flush=True)
            self.decode_failures += len(failures)
        return batch

    @property
    def batch_spec(self) -> Dict[str, Tuple[tuple, torch.dtype]]:
        """Every micro-batch's tensors (``collate``'s): shapes and dtypes, for ``sources.TensorParallelBroadcast``."""
        b, side = self.micro_batch_size, self.load_size
        return dict(pixels=((b, 3, side, side), torch.uint8), labels=((b,), torch.int64),
                    loss_mask=((b,), torch.float32))

    def train_microbatches(self) -> List[Batch]:
        if self._iter is None:
            self._steps.start = self.sampler.consumed_samples
            self._iter = iter(self._loader)
        batches = [self._take(next(self._iter)) for _ in range(self.micro_per_step)]
        self.sampler.consumed_samples += self.global_batch_size
        return batches

    def valid_microbatches(self, iters: int) -> Iterator[List[Batch]]:
        """The same first ``iters`` global batches of the validation split every time (wrapping if it is small)."""
        n = len(self.valid)
        if not n or iters <= 0:
            return
        micro = [[(i, -1) for i in m]
                 for k in range(iters)
                 for m in rank_microbatches([(k * self.global_batch_size + j) % n
                                             for j in range(self.global_batch_size)],
                                            self.dp_rank, self.dp_size, self.micro_batch_size)]
        batches = iter(torch.utils.data.DataLoader(self.valid, batch_sampler=micro, **self.loader_kwargs))
        for _ in range(iters):
            yield [self._take(next(batches)) for _ in range(self.micro_per_step)]

    def state_dict(self) -> dict:
        """Steps the caller has taken, not what workers have prefetched."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._iter = None  # the next step restarts the stream here (persistent workers are reset, not re-forked)

    def close(self) -> None:
        """Stop the worker processes now rather than at garbage collection."""
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._loader._iterator, self._iter = None, None


# ----------------------------------------------------------------------------------------------- building


def _check_split(ds, column: str, split: str, labels: np.ndarray, rows: np.ndarray, num_names: Optional[int],
                 bad: List[str], bad_images: str, data_path: str) -> Tuple[np.ndarray, np.ndarray]:
    """Rows of ``rows`` with a label in range and an image header that parses; (good rows, their shorter sides).
    Bad ones are appended to ``bad`` as "where: reason", or raise at the first with ``bad_images="error"``."""
    good, sides = [], []
    for start in range(0, len(rows), PROBE_CHUNK):
        chunk = rows[start:start + PROBE_CHUNK]
        for row, value in zip(chunk, ds[[int(r) for r in chunk]][column]):
            label, reason = labels[row], None
            if label < 0:
                reason = "missing label" if label == -1 else f"negative label {label}"
            elif num_names is not None and label >= num_names:
                reason = f"label {label} out of range for {num_names} classes"
            else:
                try:
                    sides.append(min(tf.probe(value)))
                except Exception as e:
                    reason = f"unreadable image ({first_line(e, 120)})"
            if reason is None:
                good.append(row)
                continue
            where = value_where(value, split, int(row))
            if bad_images == "error":
                raise ConfigError(f"--data-path {data_path}: bad image at {where}: {reason}; fix or remove it, or "
                                  f"pass --bad-images skip")
            bad.append(f"{where}: {reason}")
    return np.array(good, np.int64), np.array(sides, np.int64)


def build_image_data(data_path: str, *, image_size: int, global_batch_size: int, micro_batch_size: int,
                     dp_rank: int, dp_size: int, seed: int, image_column: Optional[str] = None,
                     label_column: Optional[str] = None, data_split: str = "90,10", num_workers: int = 2,
                     bad_images: str = "skip", num_classes: Optional[int] = None, prefetch_factor: int = 4,
                     jpeg_draft: bool = True, eval_crop_fraction: float = tf.EVAL_CROP_FRACTION) -> ImageData:
    """Open ``data_path``, pick columns and splits, drop (``bad_images="skip"``) or reject (``"error"``) bad rows,
    choose the load size, and return the rank's ``ImageData``.

    Validation is the source's validation/test split, else a seeded ``data_split`` share of train. ``load_size`` is
    ``image_size``, or the median shorter side of the training images when that is smaller (CIFAR's 32 px with a
    224 model): the device upsamples, the loader ships 49x fewer bytes. ``num_classes``, when given, must cover
    every label. ``jpeg_draft`` lets libjpeg decode training JPEGs at reduced scale (about 2x faster on 512-px
    images); evaluation never uses it."""
    import datasets

    if bad_images not in ("skip", "error"):
        raise ConfigError(f"--bad-images {bad_images}: expected skip or error")
    on_rank0(lambda: open_splits(data_path) and None)  # one download / arrow conversion while the others wait
    splits = open_splits(data_path)  # now from the cache on every rank
    train_name, valid_name = pick_splits(splits, data_path)
    image_column, label_column = detect_columns(splits[train_name].features, image_column, label_column, data_path)
    for name in (train_name, valid_name):
        if name is not None:
            missing = {image_column, label_column} - set(splits[name].features)
            if missing:
                raise ConfigError(f"--data-path {data_path}: split {name} has no column {', '.join(sorted(missing))}")
    feature = splits[train_name].features[label_column]
    class_names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    num_names = len(class_names) if class_names else None

    parts, bad = {}, []
    train_rows = np.arange(len(splits[train_name]))
    if valid_name is None:
        train_weight, valid_weight = split_weights(data_split)
        order = np.random.default_rng([seed, 0x5EED]).permutation(len(train_rows))
        n_valid = int(round(len(order) * valid_weight / (train_weight + valid_weight)))
        parts["validation"] = (train_name, np.sort(order[:n_valid]))
        train_rows = np.sort(order[n_valid:])
    else:
        parts["validation"] = (valid_name, np.arange(len(splits[valid_name])))
    parts["train"] = (train_name, train_rows)

    samples, train_sides = {}, None
    for part in ("train", "validation"):
        split, rows = parts[part]
        ds = splits[split].select_columns([image_column])
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))
        labels, names = read_labels(splits[split].select_columns([label_column]), label_column, class_names,
                                    data_path)
        class_names = class_names or names
        rows, sides = _check_split(ds, image_column, split, labels, rows, len(class_names) if class_names else None,
                                   bad, bad_images, data_path)
        train_sides = sides if part == "train" else train_sides
        samples[part] = (ds, split, rows, labels[rows])
    if bad and _is_main_rank():
        print(f"skipped {len(bad)} bad images (first: {bad[0]})", flush=True)
    if not len(samples["train"][2]):
        raise ConfigError(f"--data-path {data_path}: no usable training images ({len(bad)} bad)")

    present = max(int(s[3].max()) for s in samples.values() if len(s[3])) + 1
    detected = max(present, num_names or 0)
    if num_classes is not None and present > num_classes:
        raise ConfigError(f"--num-classes {num_classes}: the data has labels up to {present - 1} ({detected} "
                          f"classes); pass --num-classes {detected}")
    load_size = int(min(image_size, np.median(train_sides)))
    train, valid = (ImageSamples(ds, image_column, split, rows, labels, size=load_size, seed=seed, draft=jpeg_draft,
                                 crop_fraction=eval_crop_fraction)
                    for ds, split, rows, labels in (samples["train"], samples["validation"]))
    return ImageData(train, valid, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                     dp_rank=dp_rank, dp_size=dp_size, seed=seed, num_workers=num_workers,
                     prefetch_factor=prefetch_factor, image_size=image_size, num_classes=detected,
                     class_names=class_names, skipped=bad)
