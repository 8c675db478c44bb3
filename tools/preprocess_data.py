"""Text to a Megatron pretraining corpus (.bin/.idx), as Megatron-LM's tools/preprocess_data.py writes it.

    python tools/preprocess_data.py --input openwebtext.jsonl --output-prefix data/owt --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2 --append-eod --workers 8

Input: .jsonl/.json/.parquet (the --json-keys field of each row is a document), .txt (one text, cut into
documents at points where tokenizing is unaffected), or a datasets hub id (its train split). Output:
PREFIX_KEY_document.bin/.idx through megatron-core's IndexedDatasetBuilder, token dtype from the vocabulary
(uint16 below 65,500 tokens, else int32), which Megatron-LM and ``pretrain_gpt.py --data-path PREFIX_KEY_document``
read. Written under temporary names and renamed when complete: a failed run leaves nothing.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.errors import ConfigError  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="a .jsonl/.json/.parquet/.txt file or a datasets hub id")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="the field holding each document's text")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=["HuggingFaceTokenizer"],
                   help="Megatron-LM's name for a transformers tokenizer (the only kind here)")
    g.add_argument("--tokenizer-model", "--tokenizer", dest="tokenizer", required=True,
                   help="a tokenizer directory or hub id (gpt2, examples/tokenizers/tiny-gpt2)")
    g.add_argument("--append-eod", action="store_true", help="an EOS token after every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    args = p.parse_args(argv)
    if len(args.json_keys) != 1:
        raise ConfigError(f"--json-keys {' '.join(args.json_keys)}: give one key (one corpus per run)")
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    from tqdm import tqdm

    from megatron_ext.data import tokens

    tokenizer = tokens.load_tokenizer(args.tokenizer)
    prefix = f"{args.output_prefix}_{args.json_keys[0]}_document"
    for suffix in (".bin", ".idx"):
        if os.path.exists(prefix + suffix):
            raise ConfigError(f"--output-prefix {args.output_prefix}: {prefix + suffix} exists; choose another "
                              "prefix or remove it (nothing is overwritten)")
    source = tokens._Source(args.input, args.json_keys[0], "--input")
    start = time.perf_counter()
    with tqdm(desc="documents", unit="doc", file=sys.stderr, mininterval=1) as bar:
        def progress(documents: int, total_tokens: int) -> None:
            bar.update(documents)
            seconds = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{bar.n / seconds:,.0f} docs/s, {total_tokens / seconds:,.0f} tokens/s",
                                refresh=False)

        counts = tokens.write_corpus(source, tokenizer, prefix, append_eod=args.append_eod,
                                     tokenizer_path=args.tokenizer, workers=args.workers, progress=progress)
    seconds = time.perf_counter() - start
    counts.update(prefix=prefix, seconds=seconds, documents_per_sec=counts["documents"] / seconds,
                  tokens_per_sec=counts["tokens"] / seconds)
    print(f"{prefix}.bin/.idx: {counts['documents']:,} documents ({counts['empty_documents']:,} empty, skipped), "
          f"{counts['tokens']:,} tokens in {seconds:.1f}s ({counts['documents_per_sec']:,.0f} docs/s, "
          f"{counts['tokens_per_sec']:,.0f} tokens/s)", flush=True)
    return counts


if __name__ == "__main__":
    run_main(main)
