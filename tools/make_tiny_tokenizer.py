"""Train a 1024-token Qwen2.5-style tokenizer on the shipped MetaMathQA sample, so SFT needs no download.

It is Qwen2.5's tokenizer in miniature: the same byte-level BPE pipeline (NFC, Qwen2's split regex with single
digits, byte-level pre-tokenizer and decoder), all 22 of Qwen2.5's added tokens after the learned vocabulary (in
Qwen2.5's order, ``<|endoftext|>`` first), eos ``<|im_end|>``, pad ``<|endoftext|>``, and Qwen2.5-Instruct's exact
chat template. Only the merges differ, so code tested against it works unchanged with the real tokenizer.

    python tools/make_tiny_tokenizer.py     # -> examples/tokenizers/tiny-qwen
"""

from __future__ import annotations

import argparse
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_SIZE = 1024

# Qwen2.5's added tokens in id order (151643...151664); the first 13 after <|endoftext|> are its
# additional_special_tokens, the tool-call/FIM/repo ones are added but not special.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
NON_SPECIAL_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]

QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen/Qwen2.5-*-Instruct tokenizer_config.json "chat_template", verbatim.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def training_texts(data_path: str):
    """What the tokenizer will see: the records rendered as chats, including the default system prompt."""
    default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    with open(data_path) as f:
        for line in f:
            record = json.loads(line)
            yield f"system\n{default_system}\nuser\n{record['query']}\nassistant\n{record['response']}\n"


def train(data_path: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    learned = VOCAB_SIZE - len(SPECIAL_TOKENS) - len(NON_SPECIAL_ADDED)
    trainer = trainers.BpeTrainer(vocab_size=learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_texts(data_path), trainer=trainer)
    if tokenizer.get_vocab_size() != learned:
        raise SystemExit(f"BPE learned {tokenizer.get_vocab_size()} tokens, wanted {learned}; use more data")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "examples", "data", "metamathqa_sample.jsonl"))
    parser.add_argument("--out", default=os.path.join(REPO, "examples", "tokenizers", "tiny-qwen"))
    args = parser.parse_args()
    wrapped = Qwen2Tokenizer(
        tokenizer_object=train(args.data), eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=QWEN25_CHAT_TEMPLATE,
        model_max_length=131072, clean_up_tokenization_spaces=False, split_special_tokens=False, errors="replace")
    if len(wrapped) != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {len(wrapped)} tokens, wanted {VOCAB_SIZE}")
    wrapped.save_pretrained(args.out)
    print(f"wrote a {len(wrapped)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
