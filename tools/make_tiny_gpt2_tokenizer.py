"""Train a 2048-token GPT-2-style tokenizer on the shipped Shakespeare sample, so pretraining needs no download.

It is GPT-2's tokenizer in miniature: byte-level BPE with GPT-2's split regex (``ByteLevel(use_regex=True)``, no
normalizer, no prefix space), the byte-level decoder, and ``<|endoftext|>`` as the last id and as bos, eos and unk.
Only the merges (and so the size) differ, so code tested against it works unchanged with the real ``gpt2``.

The sample, ``examples/data/tiny_shakespeare_sample.txt``, is the first 150,006 bytes (up to a blank line) of
Karpathy's tiny_shakespeare corpus (public-domain Shakespeare; the hub's ``karpathy/tiny_shakespeare``).

    python tools/make_tiny_gpt2_tokenizer.py     # -> examples/tokenizers/tiny-gpt2
"""

from __future__ import annotations

import argparse
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2TokenizerFast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_SIZE = 2048
EOT = "<|endoftext|>"


def train(data_path: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # GPT-2's tokenizer.json, stage by stage: no normalizer; ByteLevel pre-tokenizer (its regex, no prefix space);
    # ByteLevel post-processor and decoder.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    learned = VOCAB_SIZE - 1  # <|endoftext|> comes after the learned vocabulary, as GPT-2's 50256
    trainer = trainers.BpeTrainer(vocab_size=learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(data_path, encoding="utf-8") as f:
        paragraphs = f.read().split("\n\n")
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    if tokenizer.get_vocab_size() != learned:
        raise SystemExit(f"BPE learned {tokenizer.get_vocab_size()} tokens, wanted {learned}; use more data")
    tokenizer.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "examples", "data", "tiny_shakespeare_sample.txt"))
    parser.add_argument("--out", default=os.path.join(REPO, "examples", "tokenizers", "tiny-gpt2"))
    args = parser.parse_args()
    wrapped = GPT2TokenizerFast(tokenizer_object=train(args.data), bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                add_prefix_space=False, model_max_length=1024, clean_up_tokenization_spaces=False,
                                errors="replace")
    if len(wrapped) != VOCAB_SIZE or wrapped.eos_token_id != VOCAB_SIZE - 1:
        raise SystemExit(f"tokenizer has {len(wrapped)} tokens, eos id {wrapped.eos_token_id}; wanted "
                         f"{VOCAB_SIZE} and {VOCAB_SIZE - 1}")
    wrapped.save_pretrained(args.out)
    print(f"wrote a {len(wrapped)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
