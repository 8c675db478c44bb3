"""Fine-tuning rows in the formats people bring, as conversations, and their loss masks from the chat template.

Formats (``--data-format``, ``auto`` by the row's keys): ``metamath`` (query/response), ``alpaca`` (instruction,
input, output, optional system and history), ``sharegpt`` (conversations of from/value, role tags mapped),
``messages`` (role/content, OpenAI style, optional tools), ``prompt-completion``. Column names and role tags are
remapped as LLaMA-Factory's dataset_info.json allows (``--data-columns``; ``--data-role-tags`` for ``sharegpt`` and
``messages``). Every row becomes a list of ``{"role", "content"}`` messages plus optional tools (a ``tools`` column of
function schemas, a list or its JSON text). Tool calls reach the template as it expects them: a message's
``tool_calls`` (``arguments`` given as JSON text are parsed), ``tool_call_id`` and ``name`` pass through, an
assistant turn with tool calls may have no text, and a ShareGPT ``function_call`` turn holding ``{"name",
"arguments"}`` JSON becomes such a turn.

Masks (``--loss-on``): every assistant turn (default), the last one, or every token. The trained text of a turn is
found from the template itself: its ``{% generation %}`` markers when it has them, else the difference between the
chat rendered up to the turn's generation prompt and with the turn. Templates that render earlier turns otherwise
once later ones follow (Qwen3 keeps the reasoning of the turns after the last user message only) train each turn as
the final conversation renders it, through its end-of-turn token; one whose generation prompt is not a prefix of the
conversation is refused (one line), never trained on a wrong mask. A trained turn ends with the
special token that closes it (``<|im_end|>``), also where a template's markers leave it out; what the template
appends after it (a newline) is context (the markers decide that where they include it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_ext.errors import ConfigError

FORMATS = ("auto", "metamath", "alpaca", "sharegpt", "messages", "prompt-completion")
LOSS_ON = ("assistant", "last-turn", "all")
COLUMNS = ("query", "response", "instruction", "input", "output", "system", "history", "conversations",
           "messages", "tools", "prompt", "completion")
TAGS = dict(role_tag="from", content_tag="value", user_tag="human", assistant_tag="gpt", system_tag="system",
            observation_tag="observation", function_tag="function_call")
MESSAGE_TAGS = dict(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
                    system_tag="system", observation_tag="tool", function_tag=None)  # OpenAI's: --data-role-tags remaps
PASSED_THROUGH = ("tool_calls", "tool_call_id", "name", "reasoning_content")
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

    def tag(self, name: str, defaults: Optional[dict] = None) -> Optional[str]:
        return dict(self.tags).get(name, (defaults or TAGS)[name])

    def roles(self, defaults: Optional[dict] = None) -> Dict[str, str]:
        """Role tag -> chat role (``function_call``-style tags are assistant turns, observations tool turns)."""
        roles = {"tool": "tool"}
        for tag, role in (("user_tag", "user"), ("assistant_tag", "assistant"), ("system_tag", "system"),
                          ("observation_tag", "tool"), ("function_tag", "assistant")):
            if self.tag(tag, defaults):
                roles[self.tag(tag, defaults)] = role
        return roles


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
        tools = _tools(row.get(how.column("tools")), how)
    elif fmt == "messages":
        messages += _openai(row.get(how.column("messages")), how)
        tools = _tools(row.get(how.column("tools")), how)
    else:  # prompt-completion: the completion is the one trained turn
        messages += [_turn("user", _text(row, "prompt", how)), _turn("assistant", _text(row, "completion", how))]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn to train on")
    return messages, tools


def _turn(role: str, content, extra: Optional[dict] = None) -> Dict[str, object]:
    """One message; ``extra``'s tool fields pass through, and an assistant turn with tool calls needs no text."""
    message = {"role": role, "content": content}
    message.update({key: extra[key] for key in PASSED_THROUGH if extra and extra.get(key) is not None})
    if "tool_calls" in message:
        message["tool_calls"] = _tool_calls(message["tool_calls"])
        if role == "assistant" and content in (None, ""):
            message["content"] = ""
            return message
    if not isinstance(content, str) or not content.strip():
        raise BadRow(f"{'an' if role[0] in 'aeiou' else 'a'} {role} turn without text")
    return message


def _tool_calls(calls) -> List[dict]:
    """OpenAI's ``[{"type": "function", "function": {"name", "arguments"}}]`` (or ``{"name", "arguments"}``
    items), ``arguments`` as JSON text parsed: templates write them with ``tojson``, which would quote the text."""
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) for c in calls):
        raise BadRow("'tool_calls' is not a non-empty list of calls")
    out = []
    for call in calls:
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow("a tool call without a function 'name'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise BadRow("a tool call whose 'arguments' text is not JSON") from None
        function = dict(function, arguments=arguments)
        out.append(dict(call, function=function) if "function" in call else function)
    return out


def _tools(value, how: RowFormat) -> Optional[list]:
    """The row's function schemas: a list, one schema, or either as JSON text (LLaMA-Factory's ``tools``)."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow(f"'{how.column('tools')}' is not JSON") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"'{how.column('tools')}' is not a list of function schemas")
    return value or None


def _function_call(value) -> Optional[List[dict]]:
    """A ShareGPT ``function_call`` value that is ``{"name", "arguments"}`` JSON (or a list of them) as tool calls."""
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [{"type": "function", "function": c} for c in calls]


def _sharegpt(turns, how: RowFormat) -> List[Dict[str, object]]:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{how.column('conversations')}' is not a non-empty list")
    roles, role_key, content_key = how.roles(), how.tag("role_tag"), how.tag("content_tag")
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) not in roles:
            raise BadRow(f"a turn whose '{role_key}' is not one of {', '.join(roles)}")
        content = turn.get(content_key)
        calls = _function_call(content) if turn[role_key] == how.tag("function_tag") else None
        out.append(_turn("assistant", "", dict(tool_calls=calls)) if calls else _turn(roles[turn[role_key]], content))
    return out


def _openai(turns, how: RowFormat) -> List[Dict[str, object]]:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{how.column('messages')}' is not a non-empty list")
    roles = how.roles(MESSAGE_TAGS)
    role_key, content_key = how.tag("role_tag", MESSAGE_TAGS), how.tag("content_tag", MESSAGE_TAGS)
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) not in roles:
            raise BadRow(f"a message whose '{role_key}' is not one of {', '.join(roles)}")
        out.append(_turn(roles[turn[role_key]], turn.get(content_key), turn))
    return out


# ----------------------------------------------------------------------------------------------- masks


def render(tokenizer, messages, tools, **kwargs) -> str:
    """The chat as the template writes it (with the row's ``tools``), untokenized."""
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def trained_pieces(tokenizer, messages, tools, loss_on: str) -> List[Tuple[str, bool]]:
    """The rendered chat cut into (text, trained) pieces: each assistant turn of the final conversation, as the
    template renders it there. A turn starts where the chat up to it, rendered with the generation prompt, ends (that
    must be a prefix of the whole); it ends where the chat rendered through it does, or, for templates that rewrite
    earlier turns once later ones follow (Qwen3 drops their reasoning), at its first end-of-turn token."""
    full = render(tokenizer, messages, tools)
    if loss_on == "all":
        return [(full, True)]
    spans, end_text = [], None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        upto = full if i == len(messages) - 1 else render(tokenizer, messages[:i + 1], tools)
        end = len(upto) if upto.startswith(prompt) and full.startswith(upto) else None
        if end is None and full.startswith(prompt):  # this turn is rendered otherwise in the final conversation
            end_text = end_text or _turn_end_text(tokenizer)
            at = full.find(end_text, len(prompt)) if end_text else -1
            end = at + len(end_text) if at >= 0 else None
        if end is None:
            raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: at turn {i} its chat template's generation "
                              "prompt is not a prefix of the conversation, so the assistant's tokens cannot be "
                              "located; use a template that renders earlier turns the same whatever follows them, "
                              "or one with {% generation %} markers")
        spans.append((len(prompt), end))
    if loss_on == "last-turn":
        spans = spans[-1:]
    pieces, at = [], 0
    for start, end in spans:
        pieces += [(full[at:start], False), (full[start:end], True)]
        at = end
    return [p for p in pieces + [(full[at:], False)] if p[0]]


def _turn_end_text(tokenizer) -> Optional[str]:
    """The end-of-turn token's text, found once per tokenizer and template (every conversation asks)."""
    key = getattr(tokenizer, "chat_template", None)
    cached = getattr(tokenizer, "_megatron_ext_turn_end", None)
    if cached is None or cached[0] != key:
        end = turn_end(tokenizer)
        cached = (key, None if end is None else tokenizer.decode([end]))
        tokenizer._megatron_ext_turn_end = cached
    return cached[1]


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
    chats = [(with_system(messages, system_prompt), tools) for messages, tools in chats]
    if has_generation_markers(tokenizer) and loss_on != "all":
        end = turn_end(tokenizer)
        return [_marked(tokenizer, messages, tools, loss_on, end) for messages, tools in chats]
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
    return render(tokenizer, with_system(messages, system_prompt), tools, add_generation_prompt=True)


def with_system(messages, system_prompt: Optional[str]):
    """``messages`` led by a system turn of ``system_prompt``, unless they have one or it is None."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def turn_end(tokenizer) -> Optional[int]:
    """The special token closing an assistant turn in the tokenizer's chat template (``<|im_end|>``, Llama 3's
    ``<|eot_id|>``, ...): the last special token of the trained text of a minimal chat; None without a template or
    such a token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        pieces = trained_pieces(tokenizer, messages, None, "assistant")
    except Exception:  # a template that cannot render this minimal chat: nothing to say
        return None
    ids = tokenizer([text for text, trained in pieces if trained][-1], add_special_tokens=False)["input_ids"]
    special = [t for t in ids if t in set(tokenizer.all_special_ids)]
    return special[-1] if special else None


def _marked(tokenizer, messages, tools, loss_on: str, end: Optional[int]) -> Tuple[List[int], List[int]]:
    """The template's own ``{% generation %}`` spans (transformers' assistant mask; needs a fast tokenizer), each
    through the end-of-turn token ``end``."""
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    if not any(out["assistant_masks"]):
        raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: its {{% generation %}} markers mark no token of an "
                          "assistant turn (a slow tokenizer, or markers outside the assistant's text)")
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    for k, start in enumerate(starts):
        _close_marked_turn(tokenizer, ids, mask, start, starts[k + 1] if k + 1 < len(starts) else len(ids), end)
    if loss_on == "last-turn":
        mask = [m if i >= starts[-1] else 0 for i, m in enumerate(mask)]
    return ids, mask


def _close_marked_turn(tokenizer, ids: List[int], mask: List[int], start: int, limit: int, end: Optional[int]):
    """A marked span that stops before its turn's end-of-turn token is extended through it (across whitespace
    only): the model must learn to stop. Without that token in reach, one line refusing the template."""
    stop = next((i for i in range(start, limit) if not mask[i]), limit)
    if end is None:  # the end of turn is unknown (the minimal chat did not render): a span ending in a special token
        text = [t for t in ids[start:stop] if tokenizer.decode([t]).strip()]
        if text and text[-1] in set(tokenizer.all_special_ids):
            return
    elif end in ids[start:stop]:
        return
    at = stop
    while at < limit and ids[at] != end and not tokenizer.decode([ids[at]]).strip():
        at += 1
    if end is None or at == limit or ids[at] != end:
        what = "the token that ends the assistant's turn" if end is None else repr(tokenizer.decode([end]))
        raise ConfigError(f"--tokenizer {tokenizer.name_or_path}: its {{% generation %}} markers leave out {what} "
                          "and no such token follows them, so the model would never learn to stop; put the "
                          "end-of-turn token inside {% generation %}...{% endgeneration %}")
    mask[stop:at + 1] = [1] * (at + 1 - stop)
