"""Accuracy of a fine-tuned model on GSM8K- and MATH-style problems by greedy generation.

    python tools/eval_math.py --model runs/sft/hf --data gsm8k_test.jsonl --output runs/sft/eval_gsm8k
    python tools/eval_math.py --model runs/sft/checkpoints --tokenizer Qwen2.5-0.5B/ --data openai/gsm8k \
        --output eval/ --max-samples 200 --batch-size 16

--model is a Hugging Face directory (a --save-hf output), a hub id (the published model, from the Hugging Face cache
or downloaded) or one of our megatron-core checkpoints (exported first, in this process, by
tools/convert_mcore_to_hf.py). Prompts use the tokenizer's chat template exactly as training
rendered them (same --system-prompt; none = the template's default), or MetaMath's Alpaca prompt (--prompt
metamath). Writes results.jsonl (one line per question) and summary.json (accuracy by the MetaMath extractor, the
strict #### and last-number extractors beside it, no-answer rate, tokens/s); megatron_ext/evaluation/math_eval.py
says how answers are extracted and compared.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)

TOOLS = os.path.dirname(os.path.abspath(__file__))
CHECKPOINT_MARKS = ("latest_checkpointed_iteration.txt", "metadata.json")  # a training run's root, a converted one


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", required=True, help="Hugging Face model directory, hub id (Qwen/Qwen2.5-0.5B) or "
                                                  "megatron-core checkpoint")
    p.add_argument("--data", required=True, help=".jsonl/.json/.parquet with question/answer (query/response, "
                                                 "problem/solution) columns, a save_to_disk directory, or a "
                                                 "datasets hub id")
    p.add_argument("--data-config", default=None, help="hub data sets: the config (openai/gsm8k: main)")
    p.add_argument("--split", default="test", help="hub data sets and saved DatasetDicts: the split")
    p.add_argument("--output", required=True, help="results directory (must be empty or absent)")
    p.add_argument("--max-samples", type=int, default=None, help="the first N problems only")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--prompt", default="chat", choices=["chat", "metamath"])
    p.add_argument("--system-prompt", default=None, help="as in training (default: the chat template's own)")
    p.add_argument("--backend", default="auto", choices=["auto", "transformers", "vllm"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    return p.parse_args(argv)


def model_kind(path: str) -> str:
    """``hf`` (config.json), ``hub`` (a hub id) or ``mcore`` (one of our checkpoints), or a ConfigError saying what
    --model needs."""
    from megatron_ext.convert.source import is_hub_id
    from megatron_ext.errors import ConfigError

    if is_hub_id(path):
        return "hub"
    if not os.path.isdir(path):
        raise ConfigError(f"--model {path}: no such directory; pass a Hugging Face model directory (e.g. a "
                          f"--save-hf output) or one of our megatron-core checkpoints")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    names = os.listdir(path)
    if any(n in names for n in CHECKPOINT_MARKS) or any(n.startswith("iter_") for n in names):
        return "mcore"
    raise ConfigError(f"--model {path}: neither a Hugging Face model (no config.json) nor a megatron-core "
                      f"checkpoint (no latest_checkpointed_iteration.txt or iter_* directory)")


def load_tokenizer(path: str, flag: str):
    from transformers import AutoTokenizer

    from megatron_ext.errors import ConfigError

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{flag} {path}: cannot load a tokenizer ({reason}); pass --tokenizer DIR, the tokenizer "
                          f"used in training") from None


def export_checkpoint(load: str, tokenizer, out: str) -> None:
    """One of our checkpoints as a Hugging Face directory: tools/convert_mcore_to_hf.py, in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_mcore_to_hf", os.path.join(TOOLS, "convert_mcore_to_hf.py"))
    exporter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exporter)
    exporter.main(["--load", load, "--save", out, "--overwrite"] + (["--tokenizer", tokenizer] if tokenizer else []))


def main(argv=None):
    args = parse(argv)
    from megatron_ext.errors import ConfigError
    from megatron_ext.evaluation import math_eval as ev

    for flag in ("max_samples", "batch_size", "max_new_tokens"):  # every input checked before the model loads
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    ev.check_output(args.output)
    kind = model_kind(args.model)
    if kind == "hub":
        from megatron_ext.convert.source import hub_directory

        args.model, kind = hub_directory(args.model, "--model"), "hf"
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise ConfigError(f"--tokenizer {args.tokenizer}: no such directory")
    if kind == "mcore" and args.tokenizer is None:
        raise ConfigError(f"--model {args.model} is a megatron-core checkpoint, which holds no tokenizer; pass "
                          f"--tokenizer DIR (the one used in training)")
    problems = ev.load_problems(args.data, args.data_config, args.split)[:args.max_samples]
    backend = ev.resolve_backend(args.backend)
    parent = os.path.dirname(os.path.abspath(args.output))  # beside the results, not in a small /tmp
    with tempfile.TemporaryDirectory(prefix=".eval_math_export-", dir=parent if os.path.isdir(parent) else None) \
            as exported:
        model_dir = args.model if kind == "hf" else exported
        if kind == "mcore":
            export_checkpoint(args.model, args.tokenizer, exported)
        tokenizer_dir = args.tokenizer or model_dir
        tokenizer = load_tokenizer(tokenizer_dir, "--tokenizer" if args.tokenizer else "--model")
        prompts = ev.build_prompts([p["question"] for p in problems], tokenizer, args.prompt, args.system_prompt)
        special = args.prompt == "metamath"  # a chat template writes its own special tokens
        engine = (ev.VLLMBackend(model_dir, tokenizer_dir, tokenizer, args.dtype, special) if backend == "vllm"
                  else ev.TransformersBackend(model_dir, tokenizer, args.dtype, special))
        print(f"first prompt: {prompts[0]!r}", flush=True)
        results, summary = ev.evaluate(problems, prompts, engine, args.max_new_tokens, args.batch_size)
    print(f"first output: {results[0]['output'][:500]!r}")
    summary.update(backend=backend, model=os.path.abspath(args.model), data=args.data, prompt=args.prompt,
                   system_prompt=args.system_prompt, max_new_tokens=args.max_new_tokens)
    ev.write_results(args.output, results, summary)
    others = ", ".join(f"{k} {v:.4f}" for k, v in summary["accuracy_by_extractor"].items() if k != ev.PRIMARY)
    print(f"accuracy {summary['accuracy']:.4f} ({ev.PRIMARY}; {others}), no answer {summary['no_answer_rate']:.4f}, "
          f"{summary['samples']} samples, {summary['tokens_per_second']:.1f} tokens/s -> {args.output}")


if __name__ == "__main__":
    run_main(main)
