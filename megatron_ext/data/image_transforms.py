"""Host-side image work for ``images.py`` with PIL and numpy only (no torchvision): decode, crop, resize, flip.

Everything here is uint8 in, uint8 out. Float conversion, normalisation and any upsampling to the model's size
happen on the device, so the host only touches each source pixel once and ships small uint8 arrays.
"""

from __future__ import annotations

import io
import math
from typing import Any, Tuple

import numpy as np
from PIL import Image, ImageOps

SCALE = (0.08, 1.0)  # torchvision RandomResizedCrop defaults
RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875  # resize the shorter side to size / 0.875, then crop size (224 from 256)
EXIF_ORIENTATION = 0x0112


def open_image(value: Any) -> Image.Image:
    """A lazily decoded PIL image from what a datasets image column holds: {"bytes", "path"}, bytes or a path."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str):
        return Image.open(value)
    raise ValueError(f"no image data ({type(value).__name__})")


def probe(value: Any) -> Tuple[int, int]:
    """(width, height) from the header, after checking the file's structure (``verify``: PNG chunk CRCs etc.);
    cheap because nothing is decoded, so it can run over every image at build time."""
    with open_image(value) as im:
        size = im.size
        im.verify()
    if size[0] <= 0 or size[1] <= 0:
        raise ValueError(f"empty image {size}")
    return size


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator, scale=SCALE,
                            ratio=RATIO) -> Tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: a box of random area fraction and aspect ratio (ten tries, then a
    central crop of the nearest allowed ratio), as (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _oriented(im: Image.Image) -> Tuple[Image.Image, bool]:
    """Apply an EXIF rotation as ``datasets`` does when it decodes; True when the image had none."""
    if im.getexif().get(EXIF_ORIENTATION, 1) in (0, 1):
        return im, True
    return ImageOps.exif_transpose(im), False


def train_image(value: Any, size: int, rng: np.random.Generator, draft: bool = True) -> np.ndarray:
    """Random resized crop to ``size`` x ``size`` and a random horizontal flip, as HWC uint8 RGB.

    The crop box and flip depend only on the image's size and ``rng``; with ``draft`` a JPEG is decoded at the
    smallest 1/2^k scale that still gives the crop at least ``size`` pixels a side (libjpeg DCT scaling), and the
    box is mapped onto that scale, so draft changes pixel values slightly but never which region is taken. It only
    pays when the crop is at least twice ``size`` a side: rarely for 512-px Food-101 at 224 (bench/image_loader.py
    measures no gain there), often for large photos or small ``size``."""
    im, upright = _oriented(open_image(value))
    width, height = im.size
    box = random_resized_crop_box(width, height, rng)
    flip = rng.random() < 0.5
    if draft and upright and im.format == "JPEG":
        bw, bh = box[2] - box[0], box[3] - box[1]
        wanted = (math.ceil(width * size / bw), math.ceil(height * size / bh))
        if wanted[0] < width and wanted[1] < height:
            im.draft("RGB", wanted)
            sx, sy = im.size[0] / width, im.size[1] / height
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    out = np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR, box=box))
    return out[:, ::-1] if flip else out


def eval_image(value: Any, size: int, crop_fraction: float = EVAL_CROP_FRACTION) -> np.ndarray:
    """Resize the shorter side to ``size / crop_fraction`` and take the central ``size`` x ``size``, as HWC uint8 RGB
    (one resample of the central box of side ``shorter * crop_fraction``: same geometry, no rounding between)."""
    im, _ = _oriented(open_image(value))
    width, height = im.size
    side = min(width, height) * crop_fraction
    left, top = (width - side) / 2, (height - side) / 2
    return np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side)))
