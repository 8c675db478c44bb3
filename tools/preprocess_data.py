"""Text to a Megatron pretraining corpus (.bin/.idx), as Megatron-LM's tools/preprocess_data.py writes it.

    python tools/preprocess_data.py --input openwebtext.jsonl --output-prefix data/owt --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2 --append-eod --workers 8

Input: .jsonl/.json/.parquet (each --json-keys field of each row is a document), .txt (one text, cut into
documents at points where tokenizing is unaffected), a datasets hub id (its train split) or a save_to_disk
directory. Output: one corpus per key, PREFIX_KEY_document.bin/.idx (Megatron-LM's names), through megatron-core's
IndexedDatasetBuilder, token dtype from the vocabulary (uint16 below 65,500 tokens, else int32), which Megatron-LM and
``pretrain_gpt.py --data-path PREFIX_KEY_document`` read. Keys are tokenized one after the other (a pass over the
input each). Written under temporary names and renamed when complete: a failed run leaves nothing.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)
from megatron_ext.errors import ConfigError  # noqa: E402


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="a .jsonl/.json/.parquet/.txt file, a datasets hub id or a save_to_disk directory")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="the fields holding each row's documents: one corpus per key, PREFIX_KEY_document")
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
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress updates (the bar's rate and tokens/s; also when not a terminal)")
    args = p.parse_args(argv)
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ConfigError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated; give each once")
    if len(args.json_keys) > 1 and args.input.endswith(".txt"):
        raise ConfigError(f"--json-keys {' '.join(args.json_keys)}: --input {args.input} is one text, not rows with "
                          "fields; give one key")
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: must be at least 1")
    if args.log_interval < 1:
        raise ConfigError(f"--log-interval {args.log_interval}: must be at least 1 (documents between updates)")
    return args


def main(argv=None) -> dict:
    """Every key's corpus; returns the totals and each key's counts (``corpora``)."""
    args = parse(argv)
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (its import, seconds, is not the tool's throughput)

    from megatron_ext.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, chat=False)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}  # Megatron-LM's names
    for prefix in prefixes.values():
        for suffix in (".bin", ".idx"):
            if os.path.exists(prefix + suffix):
                raise ConfigError(f"--output-prefix {args.output_prefix}: {prefix + suffix} exists; choose another "
                                  "prefix or remove it (nothing is overwritten)")
    corpora, start = {}, time.perf_counter()
    try:
        for key, prefix in prefixes.items():
            corpora[key] = _write(args, tokenizer, key, prefix)
    except BaseException:  # the keys written before the failure go too: a failed run leaves nothing
        for prefix in (prefixes[key] for key in corpora):
            for suffix in (".bin", ".idx"):
                os.unlink(prefix + suffix)
        raise
    seconds = time.perf_counter() - start
    totals = {k: sum(c[k] for c in corpora.values()) for k in ("documents", "empty_documents", "tokens")}
    return dict(corpora[args.json_keys[0]], **totals, corpora=corpora, seconds=seconds,
                documents_per_sec=totals["documents"] / seconds, tokens_per_sec=totals["tokens"] / seconds)


def _write(args, tokenizer, key: str, prefix: str) -> dict:
    """One key's documents into ``prefix``, with a progress bar (documents/s, tokens/s) and a summary line."""
    from tqdm import tqdm

    from megatron_ext.data import tokens

    source = tokens.open_text(args.input, "--input")
    start = time.perf_counter()
    counted = [0, 0]  # documents so far, and at the last update: one every --log-interval, as Megatron-LM logs
    with tqdm(desc=f"{key} documents", unit="doc", file=sys.stderr, mininterval=0, miniters=1) as bar:
        def progress(documents: int, total_tokens: int) -> None:
            counted[0] += documents
            if counted[0] - counted[1] < args.log_interval:
                return
            seconds = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{counted[0] / seconds:,.0f} docs/s, {total_tokens / seconds:,.0f} tokens/s",
                                refresh=False)
            bar.update(counted[0] - counted[1])
            counted[1] = counted[0]

        counts = tokens.write_corpus(source, tokenizer, prefix, append_eod=args.append_eod,
                                     tokenizer_path=args.tokenizer, workers=args.workers, progress=progress, key=key)
        bar.update(counted[0] - counted[1])
    seconds = time.perf_counter() - start
    counts.update(prefix=prefix, seconds=seconds, documents_per_sec=counts["documents"] / seconds,
                  tokens_per_sec=counts["tokens"] / seconds)
    print(f"{prefix}.bin/.idx: {counts['documents']:,} documents ({counts['empty_documents']:,} empty, skipped), "
          f"{counts['tokens']:,} tokens in {seconds:.1f}s ({counts['documents_per_sec']:,.0f} docs/s, "
          f"{counts['tokens_per_sec']:,.0f} tokens/s)", flush=True)
    return counts


if __name__ == "__main__":
    run_main(main)
