"""Preference pairs for DPO and reward models, tokenized by TRL 1.16's rules (``DPOTrainer``, ``RewardTrainer``).

Formats, detected per file from its first row (TRL's names):
- explicit prompt: ``prompt``, ``chosen``, ``rejected``, all text or all lists of messages;
- implicit prompt: ``chosen`` and ``rejected`` sharing their start, which is the prompt (TRL's ``extract_prompt``:
  the shared messages, or the shared characters less a trailing space: HH-RLHF's text pairs). A text ``prompt``
  beside conversations (HuggingFaceH4/ultrafeedback_binarized) is ignored, as TRL's ``maybe_extract_prompt`` does.
Conversational rows go through the chat template (with the row's ``tools`` and ``chat_template_kwargs``): the prompt
rendered with the generation prompt, each sequence the whole ``prompt + completion`` rendered, so a completion is
everything the template writes after the prompt (``<|im_end|>\\n`` included). Text rows take no template: the
completion gets the EOS token appended and ``prompt + completion`` is tokenized as one text. The completion starts
where the tokenized prompt and the whole sequence diverge (TRL's common prefix; where that is before the prompt's
end, one warning line says what was cut). A sequence holds at most ``--seq-length`` tokens (TRL's ``max_length``,
``keep_start``); a pair whose prompt alone fills that is a bad row. Reward pairs are the whole sequences; longer ones
are dropped, as TRL's ``RewardTrainer`` filters them. A sample is a pair: rows [chosen; rejected]. Rows with empty
or identical completions are counted and skipped (``--bad-rows error``: one line naming the file and row).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_ext.data import cache, chat, sft
from megatron_ext.data.rows import NotUtf8, Source
from megatron_ext.data.tokenizer import load_tokenizer, pad_token_id
from megatron_ext.errors import ConfigError

FORMATS = {"explicit": "prompt/chosen/rejected", "implicit": "chosen/rejected (implicit prompt)",
           "unpaired": "prompt/completion/label (unpaired)"}
CACHE_FORMAT = 3  # 3: TRL 1.16's tokenization (rows as ids and prompt lengths)


@dataclasses.dataclass(frozen=True)
class Record:
    """One row read: its prompt and completions (text, or lists of messages), what the template needs, and the
    row's ``margin`` (pairs) or ``label`` (KTO's examples) as ``value``."""
    prompt: Any
    completions: tuple
    conversational: bool
    tools: Optional[list] = None
    template_kwargs: Optional[dict] = None
    value: Any = 0.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """What an objective's samples are: its cache's name, the file's format from its first row, a row's record(s),
    a split's records tokenized (flat arrays and counts) and the dataset class."""
    objective: str
    detect: Callable[[Any, str], str]
    read: Callable[[Any, str], Any]
    tokenize: Callable[..., Tuple[dict, dict]]
    dataset: type


def is_messages(value: Any) -> bool:
    """TRL's ``is_conversational`` for one value: a list whose first item is a message."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def detect(row: Any, path: str) -> str:
    """The file's format, from its first row: (explicit or implicit) and whether it is conversational."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise ConfigError(f"--data-path {path}: not preference data (rows with 'chosen' and 'rejected', and 'prompt' "
                          "unless the two share it; --objective kto also reads 'prompt', 'completion', 'label')")
    explicit = "prompt" in row and is_messages(row["prompt"]) == is_messages(row["chosen"])
    return f"{'explicit' if explicit else 'implicit'} {'messages' if is_messages(row['chosen']) else 'text'}"


def value(row: dict, key: str, conversational: bool) -> Any:
    """A prompt or completion as the file's format has it; BadRow otherwise."""
    item = row.get(key)
    if conversational and not (is_messages(item) and all(isinstance(m, dict) and m.get("role") for m in item)):
        raise chat.BadRow(f"'{key}' is not a list of messages")
    if not conversational and not isinstance(item, str):
        raise chat.BadRow(f"'{key}' is not text")
    return item


def empty(completion: Any) -> bool:
    if isinstance(completion, str):
        return not completion.strip()
    return not any((isinstance(m.get("content"), str) and m["content"].strip()) or m.get("tool_calls")
                   for m in completion)


def extract_prompt(chosen: Any, rejected: Any) -> Tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: the longest shared start of the two (messages, or characters less a trailing space),
    and the rests."""
    at = min(len(chosen), len(rejected)) - 1
    for i in range(min(len(chosen), len(rejected))):
        if chosen[i] != rejected[i]:
            at = i - 1 if i and chosen[i - 1] == " " else i
            break
    return chosen[:at], chosen[at:], rejected[at:]


def template_args(row: dict) -> Tuple[Optional[list], Optional[dict]]:
    """The row's ``tools`` (a list, or its JSON text) and ``chat_template_kwargs``, as TRL passes them."""
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise chat.BadRow("'tools' is not JSON") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise chat.BadRow("'chat_template_kwargs' is not a mapping")
    return tools or None, kwargs or None


def margin(row: Any) -> float:
    """A pair's ``margin`` column (TRL's RewardTrainer subtracts it from the reward difference), 0 without one."""
    number = row.get("margin", 0.0) if isinstance(row, dict) else 0.0
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise chat.BadRow(f"'margin' is {number!r}, not a finite number")
    return float(number)


def as_object(row: Any) -> dict:
    if isinstance(row, NotUtf8) or not isinstance(row, dict):
        raise chat.BadRow("not valid UTF-8" if isinstance(row, NotUtf8) else "not a JSON object")
    return row


def pair(row: Any, fmt: str) -> Record:
    """A pair's record: (prompt, (chosen, rejected)), its template arguments and margin."""
    row = as_object(row)
    conversational = fmt.endswith("messages")
    chosen, rejected = value(row, "chosen", conversational), value(row, "rejected", conversational)
    if fmt.startswith("explicit"):
        prompt = value(row, "prompt", conversational)
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if not prompt:
        raise chat.BadRow("no prompt before the completions")
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if empty(completion):
            raise chat.BadRow(f"empty {name} completion")
    if chosen == rejected:
        raise chat.BadRow("identical completions")
    return Record(prompt, (chosen, rejected), conversational, *template_args(row), margin(row))


def common_prefix(ids: Sequence[int], other: Sequence[int]) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokenize(tokenizer, records: Sequence[Record], system_prompt: Optional[str] = None, prompts: bool = True
             ) -> List[Tuple[int, List[List[int]], int]]:
    """Per record (TRL's rules): (the completion's start, each ``prompt + completion``'s ids, how many of the
    tokenized prompt's tokens the whole sequences do not share). Without ``prompts`` (reward pairs, whose prompt
    TRL never tokenizes alone) the start is 0."""
    eos = tokenizer.eos_token
    texts: Dict[bool, List[str]] = {True: [], False: []}
    for record in records:
        out = texts[record.conversational]
        if record.conversational:
            messages = chat.with_system(list(record.prompt), system_prompt)
            kwargs = record.template_kwargs or {}
            if prompts:
                out.append(chat.render(tokenizer, messages, record.tools, add_generation_prompt=True, **kwargs))
            out += [chat.render(tokenizer, messages + list(c), record.tools, **kwargs) for c in record.completions]
        else:
            if prompts:
                out.append(record.prompt)
            out += [record.prompt + (c if eos is None or c.endswith(eos) else c + eos) for c in record.completions]
    ids = {conversational: iter(tokenizer(items, add_special_tokens=not conversational)["input_ids"] if items else [])
           for conversational, items in texts.items()}  # (a chat's special tokens come from its template)
    made = []
    for record in records:
        source = ids[record.conversational]
        prompt = next(source) if prompts else []
        wholes = [next(source) for _ in record.completions]
        start = min(common_prefix(prompt, whole) for whole in wholes) if prompts else 0
        made.append((start, wholes, len(prompt) - start))
    return made


class Counts(dict):
    """A build's counts (bad rows, truncated, dropped as too long, prompts cut) and the first cut prompt's end."""

    def __init__(self):
        super().__init__(bad_rows=0, truncated=0, too_long=0, prompt_cut=0, cut_text=None)

    def cut(self, tokenizer, ids: Sequence[int], start: int, missing: int) -> None:
        if missing > 0:
            self["prompt_cut"] += 1
            self["cut_text"] = self["cut_text"] or tokenizer.decode(list(ids[start:start + missing]))


def bad(source: Source, where: str, reason: str, bad_rows: str) -> None:
    if bad_rows == "error":
        raise ConfigError(f"--data-path {source.path}: bad preference row at {where} ({reason}); fix or remove it, "
                          "or pass --bad-rows skip")


def flat(rows: List[Tuple[Sequence[int], int]], **extra) -> dict:
    """Rows of (ids, completion start) as flat arrays: ``ids``, ``offsets``, ``start``, and ``extra``."""
    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
    return dict(ids=torch.from_numpy(np.concatenate([np.zeros(0, np.int32)]
                                                    + [np.asarray(ids, np.int32) for ids, _ in rows])),
                offsets=torch.from_numpy(np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])),
                start=torch.tensor([start for _, start in rows], dtype=torch.int32), **extra)


def usable(tokenizer, items, seq_length: int, system_prompt, bad_rows: str, source, counts: Counts,
           prompts: bool = True, drop_longer: bool = False):
    """(record, completion start, each whole sequence's ids) of every (where, record) in ``items`` a run can use,
    tokenized by TRL's rules a chunk at a time: a prompt that alone fills ``seq_length`` is a bad row; with
    ``drop_longer`` (reward pairs) a record with a longer sequence is dropped; ``counts`` keeps the tally."""
    for begin in range(0, len(items), sft.TOKENIZE_CHUNK):
        chunk = items[begin:begin + sft.TOKENIZE_CHUNK]
        made = tokenize(tokenizer, [record for _, record in chunk], system_prompt, prompts=prompts)
        for (where, record), (start, wholes, missing) in zip(chunk, made):
            longest = max(map(len, wholes))
            if drop_longer and longest > seq_length:
                counts["too_long"] += 1
                continue
            if start >= seq_length:
                counts["bad_rows"] += 1
                bad(source, where, f"the prompt alone fills --seq-length {seq_length}", bad_rows)
                continue
            counts.cut(tokenizer, wholes[0], start, missing)
            counts["truncated"] += longest > seq_length
            yield record, start, wholes


def _pairs(tokenizer, records, seq_length: int, system_prompt, bad_rows: str, source, reward: bool = False):
    """Both sequences of every usable pair (chosen at 2i, rejected at 2i+1), cut at ``seq_length`` (DPO) or
    dropped when longer (reward), and their margins."""
    counts, rows, margins = Counts(), [], []
    for record, start, wholes in usable(tokenizer, records, seq_length, system_prompt, bad_rows, source, counts,
                                        prompts=not reward, drop_longer=reward):
        rows += [(whole[:seq_length], start) for whole in wholes]
        margins.append(record.value)
    return flat(rows, margin=torch.tensor(margins, dtype=torch.float32)), counts


def _build_cache(path: str, source: Source, tokenizer, seq_length: int, data_split: str,
                 system_prompt: Optional[str], bad_rows: str, seed: int, layout: Layout) -> None:
    rows, fmt, num_bad = [], None, 0
    for where, row in source.rows():
        fmt = fmt or layout.detect(row, source.path)
        try:
            rows.append((where, layout.read(row, fmt)))
        except chat.BadRow as e:
            num_bad += 1
            bad(source, where, str(e), bad_rows)
    if not rows:
        raise ConfigError(f"--data-path {source.path}: no usable preference rows ({num_bad} bad rows skipped)")
    payload = dict(info=dict(Counts(), records=len(rows) + num_bad, bad_rows=num_bad,
                             format=FORMATS[fmt.split()[0]] + ("" if fmt.endswith("messages") else ", text")))
    # each split in the file's order (KTO's sequential batches read it so, as TRL's), its rows drawn by the seed
    splits = sft.split_records(list(enumerate(rows)), data_split, seed)
    for name, part in zip(("train", "valid"), splits):
        payload[name], counts = layout.tokenize(tokenizer, [row for _, row in sorted(part, key=lambda r: r[0])],
                                                seq_length, system_prompt, bad_rows, source)
        for key in ("bad_rows", "truncated", "too_long", "prompt_cut"):
            payload["info"][key] += counts[key]
        payload["info"]["cut_text"] = payload["info"]["cut_text"] or counts["cut_text"]
        payload["info"][f"{name}_samples"] = layout.dataset.samples(payload[name])
    cache.atomic_save(payload, path)


class PreferenceDataset(torch.utils.data.Dataset):
    """Pair ``i``: tokens/labels/position_ids/padding_mask/completion_mask [2, S] (chosen, rejected) and its
    ``margin``. ``reference`` ([N, 2] float32: the starting model's log-probabilities of both completions) is set once
    it is known."""

    def __init__(self, arrays: Dict[str, torch.Tensor], seq_length: int, pad_id: int):
        self.ids, self.offsets, self.start = arrays["ids"], arrays["offsets"], arrays["start"]
        self.seq_length, self.pad_id = seq_length, pad_id
        self.reference: Optional[torch.Tensor] = None
        self.margin = arrays.get("margin", torch.zeros(len(self)))

    @staticmethod
    def samples(arrays: Dict[str, torch.Tensor]) -> int:
        return (len(arrays["offsets"]) - 1) // 2

    def __len__(self) -> int:
        return self.samples(dict(offsets=self.offsets))

    def row(self, r: int) -> Tuple[torch.Tensor, int]:
        """Stored row ``r``: its ids and where its completion starts."""
        return self.ids[int(self.offsets[r]):int(self.offsets[r + 1])], int(self.start[r])

    @property
    def chosen_tokens(self) -> torch.Tensor:
        """Each pair's chosen completion tokens with a label (the "sft" loss's count)."""
        lengths = self.offsets[1::2] - self.offsets[0:-1:2]
        return lengths - self.start[0::2].clamp(min=1)

    def rows(self, rows: Sequence[Tuple[torch.Tensor, int]], index: int) -> Dict[str, torch.Tensor]:
        """Sequences (ids, completion start) as model rows [len(rows), S]: inputs, labels, the labels' completion
        mask (a label at position k is token k + 1)."""
        s, n = self.seq_length, len(rows)
        tokens = torch.full((n, s), self.pad_id, dtype=torch.int64)
        labels = torch.full((n, s), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(n, s, dtype=torch.float32)
        padding = torch.ones(n, s, dtype=torch.bool)
        for k, (ids, start) in enumerate(rows):
            m = len(ids) - 1
            tokens[k, :m], labels[k, :m] = ids[:-1], ids[1:]
            mask[k, max(start, 1) - 1:m], padding[k, :m] = 1.0, False
        return dict(tokens=tokens, labels=labels, completion_mask=mask, padding_mask=padding,
                    position_ids=torch.arange(s).expand(n, s), index=torch.tensor(index))

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return dict(self.rows([self.row(2 * index), self.row(2 * index + 1)], index), margin=self.margin[index])


PAIRS = Layout("dpo", detect, pair, _pairs, PreferenceDataset)
REWARD_PAIRS = Layout("reward", detect, pair, lambda *a: _pairs(*a, reward=True), PreferenceDataset)


def collate(samples: Sequence[Dict[str, torch.Tensor]], reference: Optional[torch.Tensor],
            sft_scale: float = 0.0, ld_alpha: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """b pairs -> rows [chosen_1..b; rejected_1..b] ([2b, S]); ``loss_mask`` [b] counts pairs (what the engines
    normalise by), ``reference`` [b, 2], ``index`` [b], ``sft_scale`` [b] (the global batch's pairs per chosen
    completion token: the "sft" loss's normalisation, objectives/dpo.py), ``margin`` [b]. With ``ld_alpha`` (LD-DPO) also
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
    bad_rows, truncated, too_long, prompt_cut, cut_text, format, train_samples, valid_samples, cache, cache_path,
    seconds, pad_id, vocab_size), cached as ``sft.build_datasets`` caches."""
    layout = layout or PAIRS
    start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_path)
    payload, path, built = cache.locate_or_build(
        layout.objective, data_path, tokenizer, cache_dir,
        lambda path, source: _build_cache(path, source, tokenizer, seq_length, data_split, system_prompt, bad_rows,
                                          seed, layout),
        format=sft.CACHE_FORMAT, objective=layout.objective, dpo_format=CACHE_FORMAT, seq_length=seq_length,
        data_split=data_split, system_prompt=system_prompt, bad_rows=bad_rows, seed=seed)
    pad_id = pad_token_id(tokenizer)
    info = dict(payload["info"], cache="build" if built else "hit", cache_path=path,
                seconds=time.perf_counter() - start, pad_id=pad_id, vocab_size=len(tokenizer))
    train, valid = (layout.dataset(payload[name], seq_length, pad_id) for name in ("train", "valid"))
    return train, valid, info


def summary(info: dict, what: str) -> str:
    """The data line every preference objective prints: rows, format, what was skipped, cut or dropped."""
    dropped = f", {info['too_long']} longer than --seq-length dropped" if info.get("too_long") else ""
    return (f"megatron_ext: {info['records']} preference rows ({info['format']}; {info['bad_rows']} bad rows skipped, "
            f"{info['truncated']} truncated{dropped}) -> {what}; cache {info['cache']} in {info['seconds']:.1f}s")


def cut_warning(info: dict) -> Optional[str]:
    """TRL's warning where the tokenized prompt is not a prefix of the whole sequence: what was cut, and how often."""
    if not info.get("prompt_cut"):
        return None
    return (f"megatron_ext: warning: in {info['prompt_cut']} rows the tokenized prompt is not a prefix of prompt + "
            f"completion (the template renders the prompt alone otherwise, or tokens merge across the boundary); the "
            f"completion starts where they diverge, leaving out of the sequence {info['cut_text']!r} (TRL's rule); "
            "use a template that renders the prompt the same in both, or end text prompts on a token boundary")
