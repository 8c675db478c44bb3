"""Unpaired preference examples for KTO (``--objective kto``): a prompt, one completion and whether it is desirable.

Formats, detected per file from its first row:
- TRL's unpaired preference rows: ``prompt``, ``completion`` (each text or a list of messages) and a boolean
  ``label`` (``kto_tag``, LLaMA-Factory's name, is read too);
- any paired format ``data/preference.py`` reads, unpaired as TRL's ``unpair_preference_dataset`` does: each split's
  chosen completions (desirable) then its rejected ones, so a pair's halves stay on one side of the split.
A sample is two rows: the example (prompt_i + completion_i, the loss mask on the completion) and its KL row, the
prompt with the previous example's completion (prompt_i + completion_{i-1}, cyclic over the split): TRL's mismatched
pairs for the KL estimate, which it rotates within each ``per_device_train_batch_size`` chunk of the data set.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from megatron_ext.data import chat, preference, sft
from megatron_ext.data.rows import NotUtf8

FORMAT = "prompt/completion/label (unpaired)"


def is_unpaired(row: Any) -> bool:
    return isinstance(row, dict) and "completion" in row and ("label" in row or "kto_tag" in row)


def examples(row: Any, fmt: str) -> List[Tuple[list, list, bool]]:
    """The row's (prompt messages, completion, desirable) examples: one for an unpaired row, two for a pair."""
    if fmt != FORMAT:
        prompt, chosen, rejected = preference.pair(row, fmt)
        return [(prompt, chosen, True), (prompt, rejected, False)]
    if isinstance(row, NotUtf8) or not isinstance(row, dict):
        raise chat.BadRow("not valid UTF-8" if isinstance(row, NotUtf8) else "not a JSON object")
    label = row.get("label", row.get("kto_tag"))
    if not isinstance(label, bool) and label not in (0, 1):
        raise chat.BadRow(f"'label' is {label!r}, not true or false")
    if "prompt" not in row:
        raise chat.BadRow("missing 'prompt'")
    prompt = preference._messages(row["prompt"], "user", "prompt")
    completion = preference._messages(row["completion"], "assistant", "completion")
    if not prompt or prompt[-1]["role"] == "assistant":
        raise chat.BadRow("no prompt before the completion")
    if len(completion) != 1 or completion[0]["role"] != "assistant" or not completion[0]["content"].strip():
        raise chat.BadRow("the completion is not one non-empty assistant turn")
    return [(prompt, completion, bool(label))]


def detect(row: Any, path: str) -> str:
    return FORMAT if is_unpaired(row) else preference.detect(row, path)


def split_examples(records: Sequence[Tuple[str, list]]) -> List[Tuple[str, Tuple[list, list, bool]]]:
    """One split's records (each row's examples) as examples: TRL's unpairing order, every chosen then every
    rejected completion (unpaired rows keep their order)."""
    first = [(where, made[0]) for where, made in records]
    return first + [(where, made[1]) for where, made in records if len(made) > 1]


def tokenized(tokenizer, records, seq_length: int, system_prompt, bad_rows: str, source) -> Tuple[dict, dict]:
    """Flat arrays of a split's usable examples' two rows (the example at 2i, its KL row at 2i+1), ``desirable``
    [N], and the counts."""
    items = split_examples(records)
    counts = dict(bad_rows=0, truncated=0)
    kept, labels = [], []
    for begin in range(0, len(items), sft.TOKENIZE_CHUNK):
        chunk = items[begin:begin + sft.TOKENIZE_CHUNK]
        out = chat.tokenize_conversations(tokenizer, [(prompt + completion, None) for _, (prompt, completion, _)
                                                      in chunk], "last-turn", system_prompt)
        for (where, (_, _, desirable)), (ids, mask) in zip(chunk, out):
            if len(ids) > seq_length + 1:
                counts["truncated"] += 1
                ids, mask = ids[:seq_length + 1], mask[:seq_length + 1]
            if not any(mask[1:]):
                counts["bad_rows"] += 1
                preference._bad(source, where, f"the prompt alone fills --seq-length {seq_length}", bad_rows)
                continue
            kept.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
            labels.append(desirable)
    rows = []
    for i, (ids, mask) in enumerate(kept):
        start = int(np.argmax(mask))  # the completion's first token; the prompt is everything before it
        prev_ids, prev_mask = kept[i - 1]
        prev = int(np.argmax(prev_mask))
        kl_ids = np.concatenate([ids[:start], prev_ids[prev:]])[:seq_length + 1]
        kl_mask = np.concatenate([np.zeros(start, np.uint8), prev_mask[prev:]])[:seq_length + 1]
        rows += [(ids, mask), (kl_ids, kl_mask)]
    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
    arrays = dict(ids=torch.from_numpy(np.concatenate([np.zeros(0, np.int32)] + [ids for ids, _ in rows])),
                  mask=torch.from_numpy(np.concatenate([np.zeros(0, np.uint8)] + [mask for _, mask in rows])),
                  offsets=torch.from_numpy(np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])),
                  desirable=torch.tensor(labels, dtype=torch.bool))
    return arrays, counts


class UnpairedDataset(preference.PreferenceDataset):
    """Example ``i``: rows [2, S] (the example, its KL row) and ``desirable``; ``reference`` ([N, 2]: the starting
    model's log-probabilities of both rows' completions) once it is known."""

    def __init__(self, arrays: Dict[str, torch.Tensor], seq_length: int, pad_id: int):
        super().__init__(arrays, seq_length, pad_id)
        self.desirable = arrays["desirable"]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return dict(super().__getitem__(index), desirable=self.desirable[index])


def collate(samples, reference, chosen_scale: float, rejected_scale: float) -> Dict[str, torch.Tensor]:
    """b examples -> rows [examples; KL rows] ([2b, S]) and per-example ``desirable``, ``kl`` (the step's estimate,
    filled in by the KL pass), ``chosen_scale``/``rejected_scale`` (the global batch's examples per desirable /
    undesirable one: TRL's per-kind means of the metrics)."""
    batch = preference.collate(samples, reference)
    b = len(samples)
    batch.pop("sft_scale")
    batch.update(desirable=torch.stack([s["desirable"] for s in samples]).float(), kl=torch.zeros(b),
                 chosen_scale=torch.full((b,), chosen_scale), rejected_scale=torch.full((b,), rejected_scale))
    return batch


EXAMPLES = preference.Layout("kto", detect, examples, tokenized, UnpairedDataset)


def build_datasets(data_path: str, tokenizer_path: str, seq_length: int, **kw):
    """``preference.build_datasets`` for KTO's examples: train and validation sets and ``info``."""
    return preference.build_datasets(data_path, tokenizer_path, seq_length, layout=EXAMPLES, **kw)
