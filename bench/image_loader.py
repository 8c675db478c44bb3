"""Images/s of the image loader alone (``megatron_ext/data/images.py``, no model): does the host keep up with ViT?

    .venv/bin/python bench/image_loader.py --out bench/results/image_loader_cpu.json

Two data sets: the shipped 32x32 PNG shapes sample (``examples/data/shapes_sample.parquet``; small images load at
their native size, the device upsamples) and a generated Food-101-like set (JPEG q90, longer side 512, smooth
content plus texture, as Food-101's hub parquet stores them) in a temporary directory. Each row builds the loader
(``build s``: opening the data and the header check of every image), takes one warm-up step (workers start, queues
fill), then times ``--repeats`` windows of ``--steps`` global batches of the train transform at 224 (random resized
crop + flip), with and without libjpeg draft decoding, for each ``--workers`` count. images/s = images / wall time
as the training loop would see it (the main process waiting on the DataLoader); the best window is the headline,
since on a shared machine other processes only ever slow a window down (the JSON records the load average around
the run). On 2 cores, workers compete with the main
process and each other, so more than 2 workers cannot help there.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SAMPLE = os.path.join(REPO, "examples", "data", "shapes_sample.parquet")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "image_loader_cpu.json")


def food_like_image(rng: np.random.Generator) -> bytes:
    """A 512 x (384..512) JPEG of about Food-101's size in bytes: low-frequency colour field plus fine texture."""
    from PIL import Image

    width, height = (512, int(rng.integers(384, 513))) if rng.random() < 0.5 else (int(rng.integers(384, 513)), 512)
    field = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = np.asarray(field, dtype=np.float32) + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_food_like(path: str, count: int, classes: int = 8, seed: int = 0) -> float:
    """Write ``count`` images as a parquet with Image + ClassLabel features; returns the mean JPEG size in KiB."""
    import datasets

    rng = np.random.default_rng(seed)
    images = [food_like_image(rng) for _ in range(count)]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[f"dish{k}" for k in range(classes)])})
    datasets.Dataset.from_dict({"image": [{"bytes": b, "path": f"img{i}.jpg"} for i, b in enumerate(images)],
                                "label": [i % classes for i in range(count)]}, features=features).to_parquet(path)
    return float(np.mean([len(b) for b in images]) / 1024)


def measure(path: str, *, workers: int, draft: bool, steps: int, repeats: int, global_batch_size: int,
            micro_batch_size: int, image_size: int) -> dict:
    from megatron_ext.data.images import build_image_data

    start = time.perf_counter()
    data = build_image_data(path, image_size=image_size, global_batch_size=global_batch_size,
                            micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1, seed=0, num_workers=workers,
                            jpeg_draft=draft, data_split="90,10")
    build_s = time.perf_counter() - start
    images = data.train_size + data.valid_size
    data.train_microbatches()  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            data.train_microbatches()
        rates.append(steps * global_batch_size / (time.perf_counter() - start))
    data.close()
    return dict(workers=workers, jpeg_draft=draft, load_size=data.load_size, images=steps * global_batch_size,
                images_per_s=round(max(rates), 1), images_per_s_median=round(float(np.median(rates)), 1),
                build_s=round(build_s, 3), build_images=images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--food-images", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="global batches per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per row: best and median reported")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--out", default=DEFAULT_OUT, help="write the table as JSON")
    args = parser.parse_args()

    import datasets
    import PIL
    import torch

    datasets.disable_progress_bars()
    rows, load_before = [], os.getloadavg()[0]
    kwargs = dict(steps=args.steps, repeats=args.repeats, global_batch_size=args.global_batch_size,
                  micro_batch_size=args.micro_batch_size, image_size=args.image_size)
    with tempfile.TemporaryDirectory() as tmp:
        datasets.config.HF_DATASETS_CACHE = os.path.join(tmp, "hf_cache")
        food = os.path.join(tmp, "food_like.parquet")
        food_kib = write_food_like(food, args.food_images)
        sets = [("shapes_sample (32px PNG)", SAMPLE, [False]),
                (f"food-like ({args.food_images} JPEG q90, 512px, {food_kib:.0f} KiB)", food, [True, False])]
        for name, path, drafts in sets:
            for draft in drafts:
                for workers in args.workers:
                    row = dict(data=name, **measure(path, workers=workers, draft=draft, **kwargs))
                    rows.append(row)
                    print(f"{name:<46} draft={str(draft):<5} workers={workers}  load {row['load_size']:>3}px "
                          f"{row['images_per_s']:>7.1f} images/s best, {row['images_per_s_median']:>7.1f} median  "
                          f"(build {row['build_s']:.2f} s for {row['build_images']} images)", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
                       "transform": f"train: random resized crop to {args.image_size} + flip",
                       "global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                       "versions": {"torch": torch.__version__, "pillow": PIL.__version__,
                                    "datasets": datasets.__version__},
                       "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
