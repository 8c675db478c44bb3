"""Unpaired preference examples for KTO (``--objective kto``), prepared as TRL 1.16's ``KTOTrainer`` prepares them.

Formats, detected per file from its first row:
- TRL's unpaired rows: ``prompt``, ``completion`` (text, or lists of messages) and a boolean ``label`` (``kto_tag``,
  LLaMA-Factory's name, is read too);
- any paired format ``data/preference.py`` reads, unpaired as TRL's ``unpair_preference_dataset`` does: per block
  of 1,000 rows (its ``map`` batch), the block's chosen completions (desirable) then its rejected ones.
Each example is tokenized by ``preference.tokenize``'s rules (TRL's), on its own. Its KL row is its prompt with
another example's completion, as TRL pairs them: within each chunk of ``--micro-batch-size`` consecutive examples
(TRL's ``per_device_train_batch_size``), example k takes the completion of example k - 1 and the chunk's first the
chunk's last. KTO reads its examples in order (TRL's sequential sampling), so each micro-batch is one such chunk:
its KL rows come from its own examples.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.data import chat, preference

UNPAIR_BLOCK = 1000  # the rows TRL's unpair_preference_dataset unpairs together (datasets' map batch)


def is_unpaired(row: Any) -> bool:
    return isinstance(row, dict) and "completion" in row and ("label" in row or "kto_tag" in row)


def detect(row: Any, path: str) -> str:
    if is_unpaired(row):
        return f"unpaired {'messages' if preference.is_messages(row['completion']) else 'text'}"
    return preference.detect(row, path)


def examples(row: Any, fmt: str) -> List[preference.Record]:
    """The row's examples (``value``: desirable): one for an unpaired row, two for a pair."""
    if not fmt.startswith("unpaired"):
        made = preference.pair(row, fmt)
        return [preference.Record(made.prompt, (completion,), made.conversational, made.tools, made.template_kwargs,
                                  label) for completion, label in zip(made.completions, (True, False))]
    row = preference.as_object(row)
    label = row.get("label", row.get("kto_tag"))
    if not isinstance(label, bool) and label not in (0, 1):
        raise chat.BadRow(f"'label' is {label!r}, not true or false")
    conversational = fmt.endswith("messages")
    prompt = preference.value(row, "prompt", conversational)
    completion = preference.value(row, "completion", conversational)
    if not prompt:
        raise chat.BadRow("no prompt before the completion")
    if preference.empty(completion):
        raise chat.BadRow("empty completion")
    return [preference.Record(prompt, (completion,), conversational, *preference.template_args(row), bool(label))]


def split_examples(records: Sequence[Tuple[str, list]]) -> List[Tuple[str, preference.Record]]:
    """One split's records (each row's examples) as examples in TRL's unpairing order: per block of 1,000 rows, every
    chosen then every rejected completion (unpaired rows keep their order)."""
    out = []
    for begin in range(0, len(records), UNPAIR_BLOCK):
        block = records[begin:begin + UNPAIR_BLOCK]
        out += [(where, made[0]) for where, made in block] + [(where, made[1]) for where, made in block
                                                              if len(made) > 1]
    return out


def tokenized(tokenizer, records, seq_length: int, system_prompt, bad_rows: str, source) -> Tuple[dict, dict]:
    """A split's usable examples: each one's ids (through ``seq_length`` tokens of completion, enough for any KL row
    it lends its completion to), completion start and ``desirable``; and the counts."""
    counts, rows, labels = preference.Counts(), [], []
    for record, start, (whole,) in preference.usable(tokenizer, split_examples(records), seq_length, system_prompt,
                                                     bad_rows, source, counts):
        rows.append((whole[:start + seq_length], start))
        labels.append(record.value)
    return preference.flat(rows, desirable=torch.tensor(labels, dtype=torch.bool)), counts


class UnpairedDataset(preference.PreferenceDataset):
    """Example ``i``: rows [2, S] (the example, its KL row) and ``desirable``; ``reference`` ([N, 2]: the starting
    model's log-probabilities of both rows' completions) once it is known. ``kl_batch``: the chunk of consecutive
    examples whose completions the KL rows rotate (TRL's ``per_device_train_batch_size``: ``--micro-batch-size``)."""

    kl_batch: Optional[int] = None

    def __init__(self, arrays: Dict[str, torch.Tensor], seq_length: int, pad_id: int):
        super().__init__(arrays, seq_length, pad_id)
        self.desirable = arrays["desirable"]

    @staticmethod
    def samples(arrays: Dict[str, torch.Tensor]) -> int:
        return len(arrays["offsets"]) - 1

    def kl_partner(self, index: int) -> int:
        """Whose completion example ``index``'s KL row takes: the previous one in its chunk, cyclically (TRL's)."""
        if not self.kl_batch:
            raise RuntimeError("UnpairedDataset.kl_batch is not set (the micro-batch size)")
        first = index - index % self.kl_batch
        size = min(self.kl_batch, len(self) - first)
        return first + (index - first - 1) % size

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        ids, start = self.row(index)
        other, other_start = self.row(self.kl_partner(index))
        kl = torch.cat([ids[:start], other[other_start:]])[:self.seq_length]
        return dict(self.rows([(ids[:self.seq_length], start), (kl, start)], index), margin=torch.tensor(0.0),
                    desirable=self.desirable[index])


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


def build_datasets(data_path: str, tokenizer_path: str, seq_length: int, kl_batch: int, **kw):
    """``preference.build_datasets`` for KTO's examples, whose KL rows rotate within chunks of ``kl_batch``."""
    train, valid, info = preference.build_datasets(data_path, tokenizer_path, seq_length, layout=EXAMPLES, **kw)
    train.kl_batch = valid.kl_batch = kl_batch
    return train, valid, info
