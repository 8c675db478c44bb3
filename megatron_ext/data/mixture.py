"""Several SFT data sets at once: ``--data-path 0.7 a.jsonl 0.3 b.jsonl``. Each is tokenized and cached on its own
(``sft.build_datasets``), then blended by weight into one deterministic sequence of samples, the same on every mesh;
the sampler shuffles it per epoch and its position is what checkpoints carry, so a resume continues exactly.

Sample i comes from the data set furthest below its share of the first i + 1 samples (Megatron-LM's blending
rule: no randomness, every prefix as close to the weights as whole samples allow); a data set drawn more often than
it has samples wraps around.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from megatron_ext.errors import ConfigError  # torch- and numpy-free at import: the flags are parsed with it


def parse(values: Sequence[str]) -> List[Tuple[float, str]]:
    """``PATH`` or ``W1 PATH1 W2 PATH2 ...`` -> [(normalised weight, path)]; one line naming the fix otherwise."""
    values = list(values)
    if len(values) == 1:
        return [(1.0, values[0])]
    usage = "give one path, or weight path pairs such as --data-path 0.7 a.jsonl 0.3 b.jsonl"
    if len(values) % 2:
        raise ConfigError(f"--data-path {' '.join(values)}: an odd number of values; {usage}")
    pairs = []
    for weight, path in zip(values[::2], values[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path {' '.join(values)}: {weight!r} is not a weight; {usage}") from None
        if not w > 0:
            raise ConfigError(f"--data-path: weight {weight} of {path} must be positive")
        pairs.append((w, path))
    total = sum(w for w, _ in pairs)
    return [(w / total, path) for w, path in pairs]


def blend_order(sizes: Sequence[int], weights: Sequence[float], length: int):
    """[length, 2] int64: (data set, sample within it) of each blended sample."""
    import numpy as np

    weights = np.array([w if n else 0.0 for w, n in zip(weights, sizes)], dtype=np.float64)
    weights /= weights.sum()
    counts = np.zeros(len(sizes), dtype=np.int64)
    order = np.zeros((length, 2), dtype=np.int64)
    for i in range(length):
        k = int(np.argmax(weights * (i + 1) - counts))
        order[i] = (k, counts[k] % sizes[k])
        counts[k] += 1
    return order


class BlendedDataset:
    """As many samples as the data sets hold together, drawn from them by weight (``blend_order``)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float]):
        self.datasets = list(datasets)
        sizes = [len(d) for d in self.datasets]
        self.order = blend_order(sizes, weights, sum(sizes)) if sum(sizes) else []

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int):
        k, i = self.order[index]
        return self.datasets[int(k)][int(i)]


def build(pairs: Sequence[Tuple[float, str]], build_one) -> Tuple[object, object, dict]:
    """Train and validation data of the blend; ``build_one(path) -> (train, valid, info)``. The info adds up."""
    if len(pairs) == 1:
        return build_one(pairs[0][1])
    parts = [build_one(path) for _, path in pairs]
    weights = [w for w, _ in pairs]
    info = dict(parts[0][2])
    for key in ("records", "bad_rows", "truncated", "dropped", "seconds"):
        info[key] = sum(p[2][key] for p in parts)
    info["vocab_size"] = max(p[2]["vocab_size"] for p in parts)
    info["cache"] = ",".join(p[2]["cache"] for p in parts)
    train = BlendedDataset([p[0] for p in parts], weights)
    valid = BlendedDataset([p[1] for p in parts], weights)
    import numpy as np

    # how many blended training samples each data set gives: its realised share
    drawn = np.bincount(train.order[:, 0], minlength=len(parts)) if len(train) else [0] * len(parts)
    info.update(train_samples=len(train), valid_samples=len(valid),
                mixture=[dict(path=path, weight=w, records=p[2]["records"], train_samples=len(p[0]),
                              share=int(drawn[i]) / max(1, len(train)))
                         for i, ((w, path), p) in enumerate(zip(pairs, parts))])
    return train, valid, info


def describe(info: dict) -> list:
    """One line per data set of a mixture: its weight, records, samples and realised share of the blend."""
    return [f"{m['weight']:.2f} {m['path']}: {m['records']} records -> {m['train_samples']} train samples, "
            f"{m['share']:.1%} of the blend" for m in info.get("mixture", ())]
