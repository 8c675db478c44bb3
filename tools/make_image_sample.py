"""Write a small, deterministic labelled-image set, so ViT runs and tests need no download.

300 RGB 32x32 PNGs in 5 learnable classes (circle, square, triangle, cross, stripes): each a shape of random colour,
position and size on a random background, plus pixel noise. Written as parquet with the datasets features metadata,
so ``datasets`` reads an ``Image`` column ``image`` and a ``ClassLabel`` column ``label`` with the class names.

    python tools/make_image_sample.py            # -> examples/data/shapes_sample.parquet
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Dict, List

import numpy as np
from PIL import Image, ImageDraw

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "examples", "data", "shapes_sample.parquet")
CLASSES = ["circle", "square", "triangle", "cross", "stripes"]
SIZE = 32
PER_CLASS = 60
NOISE = 6.0  # std of the Gaussian pixel noise, in 0..255 units


def _colours(rng: np.random.Generator):
    """A background and a shape colour at least 120 apart (sum over channels), so every shape is visible."""
    while True:
        background, colour = rng.integers(0, 256, (2, 3))
        if np.abs(background - colour).sum() >= 120:
            return tuple(int(c) for c in background), tuple(int(c) for c in colour)


def draw(label: int, rng: np.random.Generator) -> np.ndarray:
    """One HWC uint8 image of class ``label``."""
    background, colour = _colours(rng)
    im = Image.new("RGB", (SIZE, SIZE), background)
    pen = ImageDraw.Draw(im)
    r = int(rng.integers(6, 13))  # half extent
    cx, cy = (int(v) for v in rng.integers(r, SIZE - r, 2))
    name = CLASSES[label]
    if name == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif name == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif name == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif name == "cross":
        w = max(2, r // 3)
        pen.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        pen.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    else:  # stripes over the whole image, random period and direction
        period, vertical = int(rng.integers(4, 9)), bool(rng.integers(0, 2))
        for start in range(int(rng.integers(0, period)) - period, SIZE, period):
            box = (start, 0, start + period // 2 - 1, SIZE) if vertical else (0, start, SIZE, start + period // 2 - 1)
            pen.rectangle(box, fill=colour)
    pixels = np.asarray(im, dtype=np.float32) + rng.normal(0, NOISE, (SIZE, SIZE, 3))
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def make(seed: int = 0) -> Dict[str, List]:
    """Rows in a fixed shuffled order: ``image`` (HWC uint8 arrays) and ``label`` (class ids)."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(len(CLASSES)), PER_CLASS)).tolist()
    return {"image": [draw(label, rng) for label in labels], "label": labels}


def write(path: str, seed: int = 0) -> None:
    import datasets

    rows = make(seed)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": _png(p), "path": None} for p in rows["image"]],
                                     "label": rows["label"]}, features=features)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ds.to_parquet(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.seed)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB, {len(CLASSES) * PER_CLASS} images)")


if __name__ == "__main__":
    main()
