"""Fine-tuning rows in the formats people bring, as conversations, and their loss masks from the chat template.

Formats (``--data-format``, ``auto`` by the row's keys): ``metamath`` (query/response), ``alpaca`` (instruction,
input, output, optional system and history), ``sharegpt`` (conversations of from/value, role tags mapped),
``messages`` (role/content, OpenAI style, optional tools), ``prompt-completion``. Column names and role tags are
remapped as LLaMA-Factory's dataset_info.json allows (``--data-columns``, ``--data-role-tags``). Every row becomes
a list of ``{"role", "content"}`` messages plus optional tools.

Masks (``--loss-on``): every assistant turn (default), the last one, or every token. The trained text of a turn is
found from the template itself: its ``{% generation %}`` markers when it has them, else the difference between the
chat rendered up to the turn's generation prompt and with the turn; a template whose rendering of earlier turns
changes when a turn is added is refused (one line), never trained on a wrong mask. A trained turn ends with the
special token that closes it (``<|im_end|>``); what the template appends after it (a newline) is context.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_ext.errors import ConfigError

FORMATS = ("auto", "metamath", "alpaca", "sharegpt", "messages", "prompt-completion")
LOSS_ON = ("assistant", "last-turn", "all")
COLUMNS = ("query", "response", "instruction", "input", "output", "system", "history", "conversations",
           "messages", "tools", "prompt", "completion")
TAGS = dict(role_tag="from", content_tag="value", user_tag="human", assistant_tag="gpt", system_tag="system",
            observation_tag="observation", function_tag="function_call")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class BadRow(ValueError):
    """A row that cannot be a conversation: skipped and counted, or (--bad-rows error) one line naming it."""


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """How rows are read: the format, the column of each field, the ShareGPT role tags."""

    format: str = "auto"
    columns: Tuple[Tuple[str, str], ...] = ()
    tags: Tuple[Tuple[str, str], ...] = ()

    def column(self, field: str) -> str:
        return dict(self.columns).get(field, field)

    def tag(self, name: str) -> str:
        return dict(self.tags).get(name, TAGS[name])


def _pairs(text: Optional[str], allowed: Sequence[str], flag: str) -> Tuple[Tuple[str, str], ...]:
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in allowed or not value.strip():
            raise ConfigError(f"{flag} {text!r}: expected name=value pairs with names from {', '.join(allowed)}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def row_format(data_format: str = "auto", columns: Optional[str] = None, tags: Optional[str] = None) -> RowFormat:
    """The flags as a RowFormat; ConfigError (one line) for a malformed mapping."""
    if data_format not in FORMATS:
        raise ConfigError(f"--data-format {data_format}: choose from {', '.join(FORMATS)}")
    return RowFormat(data_format, _pairs(columns, COLUMNS, "--data-columns"), _pairs(tags, tuple(TAGS),
                                                                                      "--data-role-tags"))


def _text(row: dict, field: str, how: RowFormat, required: bool = True) -> Optional[str]:
    value = row.get(how.column(field))
    if value is None and not required:
        return None
    if value is None:
        raise BadRow(f"missing '{how.column(field)}'")
    if not isinstance(value, str):
        raise BadRow(f"'{how.column(field)}' is not a string")
    if required and not value.strip():
        raise BadRow(f"'{how.column(field)}' is empty")
    return value


def detect(row: dict, how: RowFormat) -> str:
    if how.format != "auto":
        return how.format
    formats = (("messages", ("messages",)), ("sharegpt", ("conversations",)), ("alpaca", ("instruction", "output")),
               ("metamath", ("query", "response")), ("prompt-completion", ("prompt", "completion")))
    for fmt, fields in formats:  # every column there, else the first format with its first column (which then
        if all(how.column(f) in row for f in fields):  # names the missing one)
            return fmt
    for fmt, fields in formats:
        if how.column(fields[0]) in row:
            return fmt
    raise BadRow("no known format's columns (query/response, instruction/output, conversations, messages, "
                 "prompt/completion)")


def conversation(row, how: RowFormat) -> Tuple[List[Dict[str, str]], Optional[list]]:
    """(messages, tools) of one row; BadRow with the reason otherwise."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    fmt = detect(row, how)
    system = _text(row, "system", how, required=False)
    messages = [{"role": "system", "content": system}] if system else []
    tools = None
    if fmt == "metamath":
        messages += [_turn("user", _text(row, "query", how)), _turn("assistant", _text(row, "response", how))]
    elif fmt == "alpaca":
        for pair in row.get(how.column("history")) or []:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise BadRow(f"'{how.column('history')}' is not a list of [prompt, response] pairs")
            messages += [_turn("user", pair[0]), _turn("assistant", pair[1])]
        query = _text(row, "instruction", how)
        extra = _text(row, "input", how, required=False)
        messages += [_turn("user", f"{query}\n{extra}" if extra else query),
                     _turn("assistant", _text(row, "output", how))]
    elif fmt == "sharegpt":
        messages += _sharegpt(row.get(how.column("conversations")), how)
    elif fmt == "messages":
        messages += _openai(row.get(how.column("messages")), how)
        tools = row.get(how.column("tools")) or None
    else:  # prompt-completion: the completion is the one trained turn
        messages += [_turn("user", _text(row, "prompt", how)), _turn("assistant", _text(row, "completion", how))]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn to train on")
    return messages, tools


def _turn(role: str, content) -> Dict[str, str]:
    if not isinstance(content, str) or not content.strip():
        raise BadRow(f"a {role} turn without text")
    return {"role": role, "content": content}


def _sharegpt(turns, how: RowFormat) -> List[Dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{how.column('conversations')}' is not a non-empty list")
    roles = {how.tag("user_tag"): "user", how.tag("assistant_tag"): "assistant", how.tag("system_tag"): "system",
             how.tag("observation_tag"): "tool", how.tag("function_tag"): "assistant", "tool": "tool"}
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(how.tag("role_tag")) not in roles:
            raise BadRow(f"a turn whose '{how.tag('role_tag')}' is not one of {', '.join(roles)}")
        out.append(_turn(roles[turn[how.tag("role_tag")]], turn.get(how.tag("content_tag"))))
    return out


def _openai(turns, how: RowFormat) -> List[Dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{how.column('messages')}' is not a non-empty list")
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant", "tool"):
            raise BadRow("a message whose 'role' is not system, user, assistant or tool")
        out.append(_turn(turn["role"], turn.get("content")))
    return out


# ----------------------------------------------------------------------------------------------- masks


def _render(tokenizer, messages, tools, **kwargs) -> str:
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def trained_pieces(tokenizer, messages, tools, loss_on: str) -> List[Tuple[str, bool]]:
    """The rendered chat cut into (text, trained) pieces by the per-turn prefix method."""
    full = _render(tokenizer, messages, tools)
    if loss_on == "all":
        return [(full, True)]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        upto = full if i == len(messages) - 1 else _render(tokenizer, messages[:i + 1], tools)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: at turn {i} its chat template's generation "
                              "prompt is not a prefix of the conversation, or its rendering of earlier turns changes "
                              "when a turn is added, so the assistant's tokens cannot be located; use a template that "
                              "keeps earlier turns as they were, or one with {% generation %} markers")
        spans.append((len(prompt), len(upto)))
    if loss_on == "last-turn":
        spans = spans[-1:]
    pieces, at = [], 0
    for start, end in spans:
        pieces += [(full[at:start], False), (full[start:end], True)]
        at = end
    return [p for p in pieces + [(full[at:], False)] if p[0]]


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return bool(isinstance(template, str) and _GENERATION.search(template))


def close_turn(ids: List[int], special: set, tokenizer) -> List[int]:
    """The mask of one trained piece: up to and including its last special token (the one closing the turn)."""
    closing = max((i for i, t in enumerate(ids) if t in special), default=None)
    if closing is None:
        raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: its chat template does not close the assistant's "
                          "turn with a special token, so generation could never learn to stop")
    return [1] * (closing + 1) + [0] * (len(ids) - closing - 1)


def tokenize_conversations(tokenizer, chats: Sequence[Tuple[list, Optional[list]]], loss_on: str = "assistant",
                           system_prompt: Optional[str] = None) -> List[Tuple[List[int], List[int]]]:
    """``(input_ids, loss_mask)`` per conversation. Pieces go through the tokenizer in one batch (its fast path),
    each on its own, so a trained turn starts and ends on a token boundary."""
    if loss_on not in LOSS_ON:
        raise ConfigError(f"--loss-on {loss_on}: choose from {', '.join(LOSS_ON)}")
    chats = [(_with_system(messages, system_prompt), tools) for messages, tools in chats]
    if has_generation_markers(tokenizer) and loss_on != "all":
        return [_marked(tokenizer, messages, tools, loss_on) for messages, tools in chats]
    cut = [trained_pieces(tokenizer, messages, tools, loss_on) for messages, tools in chats]
    flat = [text for pieces in cut for text, _ in pieces]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    special, out, k = set(tokenizer.all_special_ids), [], 0
    for pieces in cut:
        tokens, mask = [], []
        for _, trained in pieces:
            tokens += ids[k]
            mask += close_turn(ids[k], special, tokenizer) if trained and loss_on != "all" else \
                [int(trained)] * len(ids[k])
            k += 1
        out.append((tokens, mask))
    return out


def generation_prompt(tokenizer, messages, tools, system_prompt: Optional[str] = None) -> str:
    """The text a model continues to say the next assistant turn: ``messages`` rendered as training renders
    them (same system turn), followed by the template's generation prompt."""
    return _render(tokenizer, _with_system(messages, system_prompt), tools, add_generation_prompt=True)


def _with_system(messages, system_prompt: Optional[str]):
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def _marked(tokenizer, messages, tools, loss_on: str) -> Tuple[List[int], List[int]]:
    """The template's own ``{% generation %}`` spans (transformers' assistant mask; needs a fast tokenizer)."""
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    if not any(out["assistant_masks"]):
        raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: its {{% generation %}} markers mark no token of an "
                          "assistant turn (a slow tokenizer, or markers outside the assistant's text)")
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if loss_on == "last-turn":
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        mask = [m if starts and i >= starts[-1] else 0 for i, m in enumerate(mask)]
    return ids, mask
