"""The one tokenizer loader (--tokenizer) for chats (SFT, preference data, evaluation) and pretraining text, and the
id samples are padded with."""

from __future__ import annotations

from typing import Optional

from megatron_ext.data.rows import first_line
from megatron_ext.errors import ConfigError


def load_tokenizer(path: str, chat: bool = True):
    """A Hugging Face tokenizer: with ``chat``, one that can format chats (a chat template, and a pad or eos token to
    pad samples with); without, one with an EOS token (the document separator)."""
    from transformers import AutoTokenizer

    example = "examples/tokenizers/tiny-qwen" if chat else "examples/tokenizers/tiny-gpt2"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer ({first_line(e)}); pass a local tokenizer "
                          f"directory such as {example} or a hub id already in the HF cache") from None
    if not chat and tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer {path} has no eos token to end documents with; use a GPT-2 style tokenizer "
                          f"(gpt2 or examples/tokenizers/tiny-gpt2)")
    if chat and not tokenizer.chat_template:
        raise ConfigError(f"--tokenizer {path} has no chat template; use an Instruct tokenizer "
                          f"(e.g. Qwen/Qwen2.5-0.5B-Instruct) or examples/tokenizers/tiny-qwen")
    if chat and pad_token_id(tokenizer) is None:
        raise ConfigError(f"--tokenizer {path} has neither a pad nor an eos token to pad samples with")
    return tokenizer


def pad_token_id(tokenizer) -> Optional[int]:
    """The pad token's id, else the EOS token's (what samples are padded with)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
