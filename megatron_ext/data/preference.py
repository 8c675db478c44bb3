"""Preference pairs for DPO: rows as TRL names them -> chosen/rejected sequences whose loss mask is the completion.

Formats, detected per file from its first row:
- explicit prompt: ``prompt``, ``chosen``, ``rejected``, each a string or a list of messages (TRL's standard and
  conversational explicit-prompt rows);
- implicit prompt: ``chosen`` and ``rejected`` conversations sharing their prefix (TRL's implicit prompt;
  UltraFeedback binarized, whose ``prompt`` column repeats the first user turn);
- HH-RLHF text pairs: ``chosen``/``rejected`` strings of ``\\n\\nHuman: ...\\n\\nAssistant: ...`` turns.
Both completions go through the chat template after the same prompt; the mask covers the final assistant turn
through its end-of-turn token (``loss_on="last-turn"``). A sample is a pair: rows [chosen; rejected], so a pair
always travels in one micro-batch. Rows with identical or empty completions, or whose prompt alone fills the
sequence, are counted and skipped (``--bad-rows error``: one line naming the file and row).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_ext.data import chat, sft
from megatron_ext.data.rows import NotUtf8, Source
from megatron_ext.errors import ConfigError
from megatron_ext.parallel import on_rank0

FORMATS = {"explicit": "prompt/chosen/rejected", "implicit": "chosen/rejected conversations (implicit prompt)",
           "hh-rlhf": "HH-RLHF text pairs"}
CACHE_FORMAT = 2  # 2: each pair's margin
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a preference objective's samples are: its cache's name, the file's format from its first row, a row's
    record, a split's records tokenized (flat arrays of two rows per sample, and counts) and the dataset class."""
    objective: str
    detect: Callable[[Any, str], str]
    read: Callable[[Any, str], Any]
    tokenize: Callable[..., Tuple[dict, dict]]
    dataset: type


def detect(row: Any, path: str) -> str:
    """The file's format, from its first row."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise ConfigError(f"--data-path {path}: not preference data (rows with 'chosen' and 'rejected', and 'prompt' "
                          "unless the two share it; --objective kto also reads 'prompt', 'completion', 'label')")
    chosen = row["chosen"]
    if isinstance(chosen, str):
        if "prompt" in row:
            return "explicit"
        if _HH_TURN.search("\n\n" + chosen.lstrip("\n")):
            return "hh-rlhf"
        raise ConfigError(f"--data-path {path}: 'chosen' is text without a 'prompt' column or HH-RLHF's "
                          "'Human:'/'Assistant:' turns")
    if isinstance(row.get("prompt"), list) or (isinstance(chosen, list) and chosen and isinstance(chosen[0], dict)
                                               and chosen[0].get("role") == "assistant"):
        return "explicit"
    return "implicit"


def _messages(value: Any, role: str, what: str) -> List[Dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                              and m.get("role") for m in value):
        raise chat.BadRow(f"'{what}' is neither text nor a list of messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _hh(text: Any, what: str) -> List[Dict[str, str]]:
    if not isinstance(text, str):
        raise chat.BadRow(f"'{what}' is not text")
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n"))
    return [{"role": "user" if tag == "Human" else "assistant", "content": content.strip()}
            for tag, content in zip(parts[1::2], parts[2::2])]


def margin(row: Any) -> float:
    """A pair's ``margin`` column (TRL's RewardTrainer subtracts it from the reward difference), 0 without one."""
    value = row.get("margin", 0.0) if isinstance(row, dict) else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise chat.BadRow(f"'margin' is {value!r}, not a finite number")
    return float(value)


def pair(row: Any, fmt: str) -> Tuple[list, list, list]:
    """(prompt messages, chosen completion, rejected completion); each completion one assistant turn."""
    if isinstance(row, NotUtf8) or not isinstance(row, dict):
        raise chat.BadRow("not valid UTF-8" if isinstance(row, NotUtf8) else "not a JSON object")
    if fmt == "explicit":
        if "prompt" not in row:
            raise chat.BadRow("missing 'prompt'")
        prompt = _messages(row["prompt"], "user", "prompt")
        chosen, rejected = (_messages(row.get(k), "assistant", k) for k in ("chosen", "rejected"))
    else:
        read = _hh if fmt == "hh-rlhf" else (lambda v, what: _messages(v, "user", what))
        whole_chosen, whole_rejected = read(row.get("chosen"), "chosen"), read(row.get("rejected"), "rejected")
        shared = 0
        while (shared < min(len(whole_chosen), len(whole_rejected)) - 1
               and whole_chosen[shared] == whole_rejected[shared]):
            shared += 1
        prompt, chosen, rejected = whole_chosen[:shared], whole_chosen[shared:], whole_rejected[shared:]
    if not prompt or prompt[-1]["role"] == "assistant":
        raise chat.BadRow("no prompt before the completions")
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if len(completion) != 1 or completion[0]["role"] != "assistant":
            raise chat.BadRow(f"the {name} completion is not one assistant turn")
        if not completion[0]["content"].strip():
            raise chat.BadRow(f"empty {name} completion")
    if chosen == rejected:
        raise chat.BadRow("identical completions")
    return prompt, chosen, rejected


def _bad(source: Source, where: str, reason: str, bad_rows: str) -> None:
    if bad_rows == "error":
        raise ConfigError(f"--data-path {source.path}: bad preference row at {where} ({reason}); fix or remove it, "
                          "or pass --bad-rows skip")


def _tokenized(tokenizer, rows, seq_length: int, system_prompt: Optional[str], bad_rows: str,
               source: Source) -> Tuple[dict, dict]:
    """Flat arrays of both sequences of every usable pair (chosen at 2i, rejected at 2i+1), their margins and the
    counts."""
    counts = dict(bad_rows=0, truncated=0)
    ids_parts, mask_parts, margins = [], [], []
    for begin in range(0, len(rows), sft.TOKENIZE_CHUNK):
        chunk = rows[begin:begin + sft.TOKENIZE_CHUNK]
        chats = [(prompt + completion, None) for _, (prompt, chosen, rejected, _) in chunk
                 for completion in (chosen, rejected)]
        out = chat.tokenize_conversations(tokenizer, chats, "last-turn", system_prompt)
        for k, (where, _) in enumerate(chunk):
            both = [out[2 * k], out[2 * k + 1]]
            if any(len(ids) > seq_length + 1 for ids, _ in both):
                counts["truncated"] += 1
                both = [(ids[:seq_length + 1], mask[:seq_length + 1]) for ids, mask in both]
            if not all(any(mask[1:]) for _, mask in both):
                counts["bad_rows"] += 1
                _bad(source, where, f"the prompt alone fills --seq-length {seq_length}", bad_rows)
                continue
            for ids, mask in both:
                ids_parts.append(np.asarray(ids, dtype=np.int32))
                mask_parts.append(np.asarray(mask, dtype=np.uint8))
            margins.append(chunk[k][1][3])
    lengths = np.array([len(ids) for ids in ids_parts], dtype=np.int64)
    arrays = dict(ids=torch.from_numpy(np.concatenate([np.zeros(0, np.int32)] + ids_parts)),
                  mask=torch.from_numpy(np.concatenate([np.zeros(0, np.uint8)] + mask_parts)),
                  offsets=torch.from_numpy(np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])),
                  margin=torch.tensor(margins, dtype=torch.float32))
    return arrays, counts


def _build_cache(path: str, source: Source, tokenizer, seq_length: int, data_split: str,
                 system_prompt: Optional[str], bad_rows: str, seed: int, layout: Layout) -> None:
    rows, fmt, num_bad = [], None, 0
    for where, row in source.rows():
        fmt = fmt or layout.detect(row, source.path)
        try:
            rows.append((where, layout.read(row, fmt)))
        except chat.BadRow as e:
            num_bad += 1
            _bad(source, where, str(e), bad_rows)
    if not rows:
        raise ConfigError(f"--data-path {source.path}: no usable preference rows ({num_bad} bad rows skipped)")
    payload = dict(info=dict(records=len(rows) + num_bad, bad_rows=num_bad, truncated=0,
                             format=FORMATS.get(fmt, fmt)))
    for name, part in zip(("train", "valid"), sft.split_records(rows, data_split, seed)):
        payload[name], counts = layout.tokenize(tokenizer, part, seq_length, system_prompt, bad_rows, source)
        payload["info"]["bad_rows"] += counts["bad_rows"]
        payload["info"]["truncated"] += counts["truncated"]
        payload["info"][f"{name}_samples"] = (len(payload[name]["offsets"]) - 1) // 2
    sft._atomic_save(payload, path)


class PreferenceDataset(torch.utils.data.Dataset):
    """Pair ``i``: tokens/labels/position_ids/padding_mask/completion_mask [2, S] (chosen, rejected) and its
    ``margin``. ``reference`` ([N, 2] float32: the starting model's log-probabilities of both completions) is set once
    it is known."""

    def __init__(self, arrays: Dict[str, torch.Tensor], seq_length: int, pad_id: int):
        self.ids, self.mask, self.offsets = arrays["ids"], arrays["mask"], arrays["offsets"]
        self.seq_length, self.pad_id = seq_length, pad_id
        self.reference: Optional[torch.Tensor] = None
        trained = torch.cat([torch.zeros(1), self.mask.double().cumsum(0)])  # each pair's chosen completion tokens:
        starts, ends = self.offsets[0:-1:2], self.offsets[1::2]  # the mask of its labels (ids[start + 1:end])
        self.chosen_tokens = (trained[ends] - trained[starts + 1]).long() if len(ends) else torch.zeros(0)
        self.margin = arrays.get("margin", torch.zeros(len(self)))

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 2

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = self.seq_length
        tokens = torch.full((2, s), self.pad_id, dtype=torch.int64)
        labels = torch.full((2, s), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(2, s, dtype=torch.float32)
        padding = torch.ones(2, s, dtype=torch.bool)
        for row in range(2):
            start, end = int(self.offsets[2 * index + row]), int(self.offsets[2 * index + row + 1])
            n = end - start - 1
            tokens[row, :n], labels[row, :n] = self.ids[start:end - 1], self.ids[start + 1:end]
            mask[row, :n], padding[row, :n] = self.mask[start + 1:end], False
        return dict(tokens=tokens, labels=labels, completion_mask=mask, padding_mask=padding,
                    position_ids=torch.arange(s).expand(2, s), index=torch.tensor(index), margin=self.margin[index])


def pair_and_margin(row: Any, fmt: str) -> Tuple[list, list, list, float]:
    return (*pair(row, fmt), margin(row))


PAIRS = Layout("dpo", detect, pair_and_margin, _tokenized, PreferenceDataset)


def collate(samples: Sequence[Dict[str, torch.Tensor]], reference: Optional[torch.Tensor],
            sft_scale: float = 0.0, ld_alpha: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """b pairs -> rows [chosen_1..b; rejected_1..b] ([2b, S]); ``loss_mask`` [b] counts pairs (what the engines
    normalise by), ``reference`` [b, 2], ``index`` [b], ``sft_scale`` [b] (the global batch's pairs per chosen
    completion token: the "sft" loss's normalisation, training/dpo.py), ``margin`` [b]. With ``ld_alpha`` (LD-DPO) also
    ``completion_weight`` [2b, S]: the mask, with ld_alpha on each completion's tokens past the pair's shorter one."""
    batch = {key: torch.cat([torch.stack([s[key][row] for s in samples]) for row in (0, 1)])
             for key in ("tokens", "labels", "completion_mask", "padding_mask", "position_ids")}
    index = torch.stack([s["index"] for s in samples])
    batch.update(index=index, loss_mask=torch.ones(len(samples)), sft_scale=torch.full((len(samples),), sft_scale),
                 reference=reference[index] if reference is not None else torch.zeros(len(samples), 2),
                 margin=torch.stack([s["margin"] for s in samples]))
    if ld_alpha is not None:
        mask = batch["completion_mask"]
        lengths = mask.sum(-1)
        shared = torch.minimum(*lengths.chunk(2)).repeat(2)[:, None]
        batch["completion_weight"] = mask * torch.where(mask.cumsum(-1) <= shared, 1.0, ld_alpha)
    return batch


def build_datasets(data_path: str, tokenizer_path: str, seq_length: int, data_split: str = "98,2",
                   system_prompt: Optional[str] = None, bad_rows: str = "skip", seed: int = 1234,
                   cache_dir: Optional[str] = None, layout: Optional[Layout] = None
                   ) -> Tuple[PreferenceDataset, PreferenceDataset, dict]:
    """Train and validation pairs (or ``layout``'s samples: KTO's, ``data/unpaired.py``), and ``info`` (records,
    bad_rows, truncated, format, train_samples, valid_samples, cache, cache_path, seconds, pad_id, vocab_size),
    cached as ``sft.build_datasets`` caches."""
    layout = layout or PAIRS
    start = time.perf_counter()
    tokenizer = sft.load_tokenizer(tokenizer_path)
    settings = dict(objective=layout.objective, dpo_format=CACHE_FORMAT, seq_length=seq_length, data_split=data_split,
                    system_prompt=system_prompt, bad_rows=bad_rows, seed=seed)

    def locate_or_build() -> Tuple[str, bool]:
        source = Source(data_path)
        key = sft._cache_key(source, tokenizer, **settings)
        path = os.path.join(cache_dir or sft._default_cache_dir(source), f"{settings['objective']}-{key[:24]}.pt")
        if os.path.exists(path):
            return path, False
        _build_cache(path, source, tokenizer, seq_length, data_split, system_prompt, bad_rows, seed, layout)
        return path, True

    path, built = on_rank0(locate_or_build)
    payload = torch.load(path, mmap=True, weights_only=True)
    pad_id = sft._pad_id(tokenizer)
    info = dict(payload["info"], cache="build" if built else "hit", cache_path=path,
                seconds=time.perf_counter() - start, pad_id=pad_id, vocab_size=len(tokenizer))
    train, valid = (layout.dataset(payload[name], seq_length, pad_id) for name in ("train", "valid"))
    return train, valid, info
