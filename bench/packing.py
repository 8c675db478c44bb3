"""Padding trained on per step with packed SFT rows: data order (each row closed when the next example does not fit:
megatron_ext before) against best-fit decreasing (``megatron_ext/data/packing.py``, now) and TRL's ``pack_dataset``
as its users run it (best-fit decreasing within each ``datasets.map`` batch of 1,000 examples).

    .venv/bin/python bench/packing.py --out bench/results/packing_cpu.json

Lengths: the shipped MetaMathQA sample through the shipped tokenizer's chat template (what the CPU quickstart
packs), and a long-tailed synthetic mix (lognormal, median 600 tokens, cut at the row length: long chat data).
Every padded token is compute a step spends on nothing, so ``padding`` is the share of a step's tokens lost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def in_data_order(lengths, capacity: int) -> int:
    rows, used = 0, capacity
    for n in lengths:
        rows, used = (rows + 1, n) if used + n > capacity else (rows, used + n)
    return rows


def trl_rows(lengths, capacity: int) -> int:
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    data = Dataset.from_dict({"input_ids": [[0] * int(n) for n in lengths]})
    return len(pack_dataset(data, capacity))  # its default: bfd, map batches of 1,000


def shipped_lengths() -> np.ndarray:
    """Tokens per example (the model sees len(ids) - 1) of the shipped MetaMathQA sample, unpacked."""
    from megatron_ext.data import sft

    with tempfile.TemporaryDirectory() as cache:
        train, _, _ = sft.build_datasets(os.path.join(REPO, "examples/data/metamathqa_sample.jsonl"),
                                         os.path.join(REPO, "examples/tokenizers/tiny-qwen"), 4096, data_split="1,0",
                                         cache_dir=cache)
        return np.diff(train.example_offsets.numpy()) - 1


def measure(name: str, lengths: np.ndarray, capacity: int) -> dict:
    from megatron_ext.data.packing import best_fit_decreasing

    lengths = np.minimum(lengths, capacity)
    real = int(lengths.sum())
    row = dict(data=name, seq_length=capacity, examples=len(lengths), tokens=real)
    for method, count in (("data order", lambda: in_data_order(lengths, capacity)),
                          ("best-fit decreasing", lambda: len(best_fit_decreasing(lengths, capacity))),
                          ("TRL pack_dataset", lambda: trl_rows(lengths, capacity))):
        start = time.perf_counter()
        rows = count()
        row[method] = dict(rows=rows, padding=1 - real / (rows * capacity), seconds=time.perf_counter() - start)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    shipped = shipped_lengths()
    synthetic = np.maximum(np.random.default_rng(0).lognormal(np.log(600), 0.8, 5000).astype(np.int64), 16)
    rows = [measure("MetaMathQA sample (tiny tokenizer)", shipped, s) for s in (512, 2048, 4096)]
    rows += [measure("long-tailed synthetic", synthetic, s) for s in (4096, 8192)]
    methods = ("data order", "best-fit decreasing", "TRL pack_dataset")
    print("| data | seq | examples | " + " | ".join(f"{m}: rows, padding" for m in methods) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in methods) + " |")
    for r in rows:
        cells = [f"{r[m]['rows']:,}, {r[m]['padding']:.1%}" for m in methods]
        print(f"| {r['data']} | {r['seq_length']} | {r['examples']:,} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
