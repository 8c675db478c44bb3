"""Accuracy of a fine-tuned model on GSM8K- and MATH-style problems by greedy generation.

The primary score is MetaMath's (what follows the last "The answer is": a number, rounded for GSM8K, or a MATH
answer in notation compared whole; answers.py): MetaMathQA fine-tunes answer "The answer is: N", which
lm-evaluation-harness' strict ``#### N`` regex never matches. The strict and the flexible (last number) extractions
are reported beside it, so a format problem shows as a gap between them rather than as a low score. Prompts render through the tokenizer's chat template exactly as training renders them
(megatron_ext/data/sft.py), since a different system turn alone costs a small model much of its accuracy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_ext.data.rows import Accepts, NotUtf8, Source, first_line
from megatron_ext.errors import ConfigError
from megatron_ext.evaluation.answers import (EXTRACTORS, PRIMARY, after_reasoning, equivalent, extract_metamath,
                                             gold_answer, is_integer)

ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{query}\n\n### Response: Let's think step by step.")
COLUMNS = (("question", "answer"), ("query", "response"), ("problem", "answer"), ("problem", "solution"))
PROBLEMS = Accepts((".jsonl", ".json", ".parquet"), ".jsonl, .json or .parquet", "openai/gsm8k")


def _rows(data: str, config: Optional[str], split: str) -> List[dict]:
    """Every row of ``data`` (``data/rows.py``'s reader); a line that does not decode is an error here."""
    if config is None and data.rstrip("/").lower().endswith("gsm8k"):
        config = "main"
    out, source = [], Source(data, "--data", PROBLEMS, split, config)
    for where, row in source.rows():
        if isinstance(row, NotUtf8) or (row is None and where.startswith("line")):
            raise ConfigError(f"--data {source.path}: {where} is not valid "
                              f"{'UTF-8; re-save the file as UTF-8' if row else 'JSON; write one JSON object per line'}")
        out.append(dict(row) if isinstance(row, dict) else row)
    return out


def load_problems(data: str, config: Optional[str] = None, split: str = "test") -> List[Dict[str, str]]:
    """``[{"question", "answer"}]`` from question/answer, query/response or problem/solution (or answer) columns
    of a local file or save_to_disk directory (``split`` of a DatasetDict), or of a datasets hub id (openai/gsm8k:
    config main)."""
    rows = _rows(data, config, split)
    if not rows:
        raise ConfigError(f"--data {data}: no rows")
    first = rows[0] if isinstance(rows[0], dict) else {}
    keys = next(((q, a) for q, a in COLUMNS if q in first and a in first), None)
    if keys is None:
        raise ConfigError(f"--data {data}: no question/answer columns (found {sorted(first)}); give rows with "
                          f"question+answer, query+response or problem+solution")
    problems = []
    for i, row in enumerate(rows):
        question, answer = (row.get(k) if isinstance(row, dict) else None for k in keys)
        if not isinstance(question, str) or not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise ConfigError(f"--data {data}: row {i} has no string '{keys[0]}' and '{keys[1]}'; fix or remove it")
        problems.append({"question": question, "answer": str(answer)})
    return problems


def build_prompts(questions: Sequence[str], tokenizer, style: str = "chat",
                  system_prompt: Optional[str] = None) -> List[str]:
    """``chat``: the template's generation prompt after [system?, user] as sft.py renders training chats (no
    --system-prompt: the template's own default); ``metamath``: MetaMath's zero-shot Alpaca prompt."""
    if style == "metamath":
        if system_prompt is not None:
            raise ConfigError("--system-prompt applies to --prompt chat only; MetaMath's Alpaca prompt has no "
                              "system turn")
        return [ALPACA.format(query=q) for q in questions]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--prompt chat: the tokenizer has no chat template; pass --tokenizer DIR (the one used "
                          "in training) or use --prompt metamath")
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [tokenizer.apply_chat_template(system + [{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def stop_ids(tokenizer, generation_config=None) -> List[int]:
    """The tokenizer's EOS, the chat template's end of turn (``chat.turn_end``: ``<|im_end|>`` for ChatML, whatever
    closes an assistant turn in others) and the model's own EOS ids: a chat fine-tune of a base model otherwise never
    stops (QwenLM/Qwen3#927)."""
    from megatron_ext.data import chat

    ids = [tokenizer.eos_token_id, chat.turn_end(tokenizer)]
    configured = getattr(generation_config, "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


class _Backend:
    """What both backends share: prompts are tokenized as training tokenized them (chat templates carry their own
    special tokens, so none are added then)."""

    def __init__(self, tokenizer, add_special_tokens: bool):
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens

    def ids(self, prompts: Sequence[str]) -> List[List[int]]:
        return self.tokenizer(list(prompts), add_special_tokens=self.add_special_tokens)["input_ids"]

    def length(self, prompt: str) -> int:
        return len(self.ids([prompt])[0])


class TransformersBackend(_Backend):
    """Greedy ``model.generate`` on left-padded batches (right padding would put pads between prompt and answer)."""

    name = "transformers"

    def __init__(self, model_dir: str, tokenizer, dtype: Optional[str] = None, add_special_tokens: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        super().__init__(tokenizer, add_special_tokens)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = dtype or ("bf16" if self.device == "cuda" else "fp32")
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]).to(self.device).eval()
        except Exception as e:
            raise ConfigError(f"--model {model_dir}: transformers cannot load it ({first_line(e)}); pass a "
                              f"Hugging Face causal LM directory") from None
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:  # Llama-style tokenizers have none
            tokenizer.pad_token = tokenizer.eos_token
        self.stop_ids = stop_ids(tokenizer, self.model.generation_config)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stop_ids or [0])[0]

    def generate(self, prompts: Sequence[str], max_new_tokens: int) -> List[Tuple[str, int]]:
        import torch
        from transformers import GenerationConfig

        self.tokenizer.padding_side = "left"
        batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True,
                               add_special_tokens=self.add_special_tokens).to(self.device)
        max_new_tokens = self._within_positions(batch["input_ids"].shape[1], max_new_tokens)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id,
                                  eos_token_id=self.stop_ids or None)
        with torch.inference_mode():
            out = self.model.generate(**batch, generation_config=config)
        results = []
        for ids in out[:, batch["input_ids"].shape[1]:].tolist():
            end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
            results.append((self.tokenizer.decode(ids[:end], skip_special_tokens=True), end))
        return results


    def _within_positions(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """--max-new-tokens past the model's positions (prompt + answer): capped at what is left, said once."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not limit or prompt_tokens + max_new_tokens <= limit:
            return max_new_tokens
        room = max(1, limit - prompt_tokens)
        if not getattr(self, "_capped", False):
            self._capped = True
            print(f"eval_math: --max-new-tokens {max_new_tokens} runs past the model's {limit} positions after "
                  f"a {prompt_tokens}-token prompt; answers are capped at the positions left ({room} here)",
                  flush=True)
        return room


class VLLMBackend(_Backend):
    """vLLM at temperature 0 (MetaMath's own setting); it schedules the whole set itself."""

    name = "vllm"
    whole_set = True

    def __init__(self, model_dir: str, tokenizer_dir: str, tokenizer, dtype: Optional[str] = None,
                 add_special_tokens: bool = False):
        from vllm import LLM

        super().__init__(tokenizer, add_special_tokens)
        self.llm = LLM(model=model_dir, tokenizer=tokenizer_dir, seed=0,
                       dtype={"bf16": "bfloat16", "fp32": "float32"}.get(dtype, "auto"))
        self.stop_ids = stop_ids(tokenizer)

    def generate(self, prompts: Sequence[str], max_new_tokens: int) -> List[Tuple[str, int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_new_tokens, stop_token_ids=self.stop_ids)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in self.ids(prompts)], params)
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]


def resolve_backend(choice: str) -> str:
    """``auto``: vLLM where it imports and a GPU is there, else transformers (said once, on stdout)."""
    if choice == "transformers":
        return choice
    import importlib

    try:
        importlib.import_module("vllm")
        reason = None
    except Exception as e:  # ImportError, or a broken install
        reason = "vllm is not installed" if isinstance(e, ImportError) else f"vllm cannot be imported ({e})"
    if choice == "vllm" and reason:
        raise ConfigError(f"--backend vllm: {reason}; pip install vllm on a GPU machine or pass --backend "
                          f"transformers")
    if reason is None and choice == "auto":
        import torch

        reason = None if torch.cuda.is_available() else "no CUDA GPU for vllm"
    if reason:
        print(f"{reason}; using the transformers backend", flush=True)
    return "transformers" if reason else "vllm"


def score(index: int, problem: Dict[str, str], prompt: str, output: str, tokens: int) -> dict:
    """One results.jsonl line: what every extractor found in ``output`` (after its reasoning, if it reasons) and
    whether it equals the gold answer."""
    gold, kind = gold_answer(problem["answer"])
    answer = after_reasoning(output)
    extracted = {name: fn(answer) for name, fn in EXTRACTORS.items()}
    extracted[PRIMARY] = extract_metamath(answer, integer=kind == "gsm8k" and is_integer(gold),
                                          numeric=kind == "gsm8k")
    return dict(index=index, question=problem["question"], prompt=prompt, output=output, generated_tokens=tokens,
                extracted=extracted, gold=gold, gold_kind=kind,
                correct={name: equivalent(answer, gold) for name, answer in extracted.items()})


def evaluate(problems: Sequence[Dict[str, str]], prompts: Sequence[str], backend, max_new_tokens: int,
             batch_size: int) -> Tuple[List[dict], dict]:
    """Generate with any ``backend`` (``generate(prompts, max_new_tokens) -> [(text, tokens)]``, optional
    ``length(prompt)``), longest prompts first so batches pad little, then score in input order."""
    from tqdm import tqdm

    length = getattr(backend, "length", len)
    order = sorted(range(len(prompts)), key=lambda i: -length(prompts[i]))
    step = len(prompts) if getattr(backend, "whole_set", False) else batch_size
    outputs: List[Tuple[str, int]] = [("", 0)] * len(prompts)
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="question", file=sys.stderr) as bar:
        for k in range(0, len(order), step):
            chunk = order[k:k + step]
            for i, out in zip(chunk, backend.generate([prompts[i] for i in chunk], max_new_tokens)):
                outputs[i] = out
            bar.update(len(chunk))
    seconds = time.perf_counter() - start
    results = [score(i, p, prompt, text, tokens)
               for i, (p, prompt, (text, tokens)) in enumerate(zip(problems, prompts, outputs))]
    n, tokens = max(len(results), 1), sum(r["generated_tokens"] for r in results)
    accuracy = {name: sum(r["correct"][name] for r in results) / n for name in EXTRACTORS}
    missing = {name: sum(r["extracted"][name] is None for r in results) / n for name in EXTRACTORS}
    summary = dict(accuracy=accuracy[PRIMARY], primary_extractor=PRIMARY, accuracy_by_extractor=accuracy,
                   no_answer_rate=missing[PRIMARY], no_answer_rate_by_extractor=missing, samples=len(results),
                   generated_tokens=tokens, generation_seconds=round(seconds, 3),
                   tokens_per_second=tokens / seconds if seconds > 0 else 0.0)
    return results, summary


def check_output(path: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"--output {path} is not an empty directory; choose a new or empty one (results are "
                          f"never overwritten)")


def write_results(output: str, results: Sequence[dict], summary: dict) -> None:
    """results.jsonl and summary.json written into a temporary sibling that then replaces ``output``: a run that
    fails leaves nothing behind."""
    output = os.path.abspath(output)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    partial = tempfile.mkdtemp(dir=os.path.dirname(output), prefix=f".{os.path.basename(output)}.partial-")
    try:
        with open(os.path.join(partial, "results.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
        with open(os.path.join(partial, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o777 & ~umask)
        check_output(output)
        os.replace(partial, output)  # an empty directory is replaced, a non-empty one refused
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise

