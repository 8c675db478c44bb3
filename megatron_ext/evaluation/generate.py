"""Math accuracy inside a training run (``--eval-generate-samples N``): greedy answers to N held-out problems at
every evaluation, on the mesh and engine the run trains with, scored as tools/eval_math.py scores them.

Each decoding step is one forward-only pass of megatron-core's schedule over the engine's own modules (DDP chunks,
DeepSpeed's engine or its pipeline stage, FSDP's module), so TP, SP, PP (+VPP), CP and EP work as in training.
There is no KV cache: a new token re-reads its whole row, O(length^2) but nothing asked of the model beyond its
forward. Rows are right-padded, so causal attention never sees the padding; a row's next token is the argmax of its
logits at its last position over the vocabulary shards (TP) and sequence chunks (CP), lowest id on ties as torch and
transformers take it; the last pipeline stage broadcasts it. DP replicas take every DP-th problem, longest first,
and agree each step on how many micro-batches to run: ZeRO-3 and FSDP gather weights inside forward.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ext.data import chat, sft
from megatron_ext.data.tokenizer import load_tokenizer, pad_token_id
from megatron_ext.errors import ConfigError
from megatron_ext.evaluation import answers, math_eval
from megatron_ext.models import context_parallel
from megatron_ext.parallel import on_rank0

MAX_NEW_TOKENS = 512  # tools/eval_math.py's default: MetaMath's GSM8K answers run to about 300 tokens


def held_out_problems(data_mixture, row_format, data_split: str, seed: int, system_prompt: Optional[str],
                      tokenizer, seq_length: int, count: int) -> List[dict]:
    """Up to ``count`` validation rows (the records training never sees, split as sft.py splits them) that end in
    an assistant turn with a checkable answer, taken in turn from each data set of the mixture:
    ``{question, answer, prompt, ids}``, the prompt rendered as training renders the conversation before it."""
    pools = []
    for _, path in data_mixture:
        records, _ = sft.load_records(path, "skip", row_format)
        pools.append(_problems(sft.split_records(records, data_split, seed)[1], row_format, system_prompt,
                               tokenizer, seq_length))
    problems = []
    while pools and len(problems) < count:
        for pool in list(pools):
            problem = next(pool, None)
            if problem is None:
                pools.remove(pool)
            elif len(problems) < count:
                problems.append(problem)
    if not problems:
        raise ConfigError(f"--eval-generate-samples {count}: no validation row of --data-path ends in an assistant "
                          "turn with a checkable answer ('#### N', \\boxed{...} or 'The answer is: X') and a prompt "
                          f"shorter than --seq-length {seq_length}; use math data or drop the flag")
    return problems


def _problems(rows, row_format, system_prompt, tokenizer, seq_length):
    for row in rows:
        messages, tools = chat.conversation(row, row_format)
        if messages[-1]["role"] != "assistant":
            continue
        answer = messages[-1]["content"]
        if answers.gold_answer(answer)[1] == "plain":
            continue
        prompt = chat.generation_prompt(tokenizer, messages[:-1], tools, system_prompt)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) < seq_length:
            question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            yield dict(question=question, answer=answer, prompt=prompt, ids=ids)


def _pick_next_token(position_ids: torch.Tensor, last: torch.Tensor, logits: torch.Tensor):
    """The loss function's place in the schedule: each row's greedy token from the logits [b, s, vocab/TP] of the
    positions this rank holds, agreed over TP and CP (max logit, then the lowest id holding it)."""
    hit = position_ids == last[:, None]  # [b, s]: the row's last real position, on one CP rank
    rows = torch.arange(hit.shape[0], device=hit.device)
    row_logits = logits[rows, hit.float().argmax(1)].float()  # [b, vocab/TP]
    index = row_logits.argmax(-1)
    value = row_logits.gather(-1, index[:, None]).squeeze(-1).masked_fill(~hit.any(1), -math.inf)
    index = index + ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = ps.get_tensor_and_context_parallel_group()
    if dist.get_world_size(group) > 1:
        best = value.clone()
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
        index = torch.where(value == best, index, torch.iinfo(index.dtype).max)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    zero = logits.new_zeros((), dtype=torch.float32)
    return zero, torch.ones((), dtype=torch.int, device=logits.device), {"next_token": index}


def next_token_step(device: torch.device, data_iterator, model):
    """megatron-core's forward-step contract for decoding: the logits of the rows, and ``_pick_next_token``."""
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    last = batch.pop("last")
    cp_size = ps.get_context_parallel_world_size()
    if cp_size > 1:
        batch = context_parallel.batch_on_this_rank(batch, cp_size, ps.get_context_parallel_rank())
    logits = model(batch["tokens"], batch["position_ids"], attention_mask=None)
    return logits, functools.partial(_pick_next_token, batch["position_ids"], last)


class GreedyDecoder:
    """Greedy decoding through an engine's ``forward_modules``; every rank of a DP replica gets the same tokens."""

    def __init__(self, device: torch.device, micro_batch_size: int, pad_id: int, stop_ids: Sequence[int]):
        self.device, self.micro_batch_size, self.pad_id, self.stop = device, micro_batch_size, pad_id, set(stop_ids)
        cp = ps.get_context_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        # Row lengths that sequence parallelism (TP) and CP's 2 x CP chunks cut evenly.
        self.multiple_of = (2 * cp if cp > 1 else 1) * ps.get_tensor_model_parallel_world_size()

    def __call__(self, modules, prompts: Sequence[List[int]], max_length: int) -> List[List[int]]:
        """The tokens generated after each prompt, up to a stop token (kept), ``MAX_NEW_TOKENS`` or ``max_length``
        tokens in all."""
        rows, generated = [list(p) for p in prompts], [[] for _ in prompts]
        limits = [min(max_length, len(p) + MAX_NEW_TOKENS) for p in prompts]
        active = [i for i, row in enumerate(rows) if len(row) < limits[i]]
        interleaved = len(modules) > 1
        while True:
            most = torch.tensor([len(active)], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # every rank runs as many forward passes
            most = int(most.item())
            if not most:
                return generated
            count = math.ceil(most / self.micro_batch_size)
            if interleaved:  # megatron-core's interleaved schedule takes whole groups of PP micro-batches
                count = math.ceil(count / self.pp) * self.pp
            batches, length = self._batches([rows[i] for i in active], count)
            for i, token in zip(active, self._forward(modules, batches, length)):
                rows[i].append(token)
                generated[i].append(token)
            active = [i for i in active if generated[i][-1] not in self.stop and len(rows[i]) < limits[i]]

    def _batches(self, rows: List[List[int]], count: int):
        size = self.micro_batch_size
        length = max((len(r) for r in rows), default=1)
        length = math.ceil(length / self.multiple_of) * self.multiple_of
        tokens = torch.full((count * size, length), self.pad_id, dtype=torch.long)
        last = torch.zeros(count * size, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
            last[i] = len(row) - 1
        positions = torch.arange(length).expand(size, length)
        return [dict(tokens=tokens[k * size:(k + 1) * size], position_ids=positions, last=last[k * size:(k + 1) * size])
                for k in range(count)], length

    def _forward(self, modules, batches, length: int) -> List[int]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterators = [iter(batches) for _ in modules]
        outputs = get_forward_backward_func()(
            forward_step_func=functools.partial(next_token_step, self.device),
            data_iterator=iterators if len(iterators) > 1 else iterators[0], model=list(modules),
            num_microbatches=len(batches), seq_length=length, micro_batch_size=self.micro_batch_size,
            forward_only=True)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            tokens = torch.cat([out["next_token"] for out in outputs])
        else:
            tokens = torch.empty(len(batches) * self.micro_batch_size, dtype=torch.long, device=self.device)
        if self.pp > 1:
            dist.broadcast(tokens, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return tokens.tolist()  # one host read per decoding step


class MathAccuracy:
    """The loop's ``eval_metrics``: accuracy on the held-out problems (MetaMath's extractor, as eval_math.py's
    primary score), the share without an answer and the decoding speed; the answers of each evaluation go to
    ``log_dir/generations/step_N.jsonl`` in eval_math.py's results format."""

    def __init__(self, problems: List[dict], tokenizer, *, seq_length: int, micro_batch_size: int,
                 log_dir: Optional[str], device: torch.device, model_eos=None):
        self.problems, self.tokenizer, self.seq_length, self.log_dir = problems, tokenizer, seq_length, log_dir
        stop = math_eval.stop_ids(tokenizer, SimpleNamespace(eos_token_id=model_eos))
        pad = pad_token_id(tokenizer)
        self.decoder = GreedyDecoder(device, micro_batch_size, pad if pad is not None else stop[0], stop)
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        longest_first = sorted(range(len(problems)), key=lambda i: -len(problems[i]["ids"]))
        self.mine = longest_first[rank::dp]
        self.device = device

    def __call__(self, engine, step: int) -> Dict[str, float]:
        modules = engine.forward_modules
        modes = [m.training for m in modules]
        for m in modules:
            m.train(False)
        start = time.perf_counter()
        with torch.no_grad():
            outputs = self.decoder(modules, [self.problems[i]["ids"] for i in self.mine], self.seq_length)
        for m, mode in zip(modules, modes):
            m.train(mode)
        results = []
        for i, ids in zip(self.mine, outputs):
            problem = self.problems[i]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            results.append(math_eval.score(i, problem, problem["prompt"], text, len(ids)))
        correct = sum(r["correct"][answers.PRIMARY] for r in results)
        missing = sum(r["extracted"][answers.PRIMARY] is None for r in results)
        totals = torch.tensor([correct, missing, sum(len(ids) for ids in outputs)], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        seconds = time.perf_counter() - start
        if self.log_dir:
            self._write(step, results)
        n = len(self.problems)
        return dict(val_math_accuracy=totals[0].item() / n, val_math_no_answer=totals[1].item() / n,
                    val_math_tokens_per_sec=totals[2].item() / seconds, val_math_seconds=seconds)

    def _write(self, step: int, results: List[dict]) -> None:
        everyone = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(everyone, results, group=ps.get_data_parallel_group())
        from megatron_ext.training.loop import is_logging_rank

        if is_logging_rank():
            path = os.path.join(self.log_dir, "generations", f"step_{step:07d}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n"
                             for r in sorted(sum(everyone, []), key=lambda r: r["index"]))


def from_run(run, device: torch.device) -> Optional[MathAccuracy]:
    """``--eval-generate-samples N``'s evaluation, or None; the problems are read on rank 0, the others wait."""
    data, training = run.data, run.training
    count = getattr(data, "eval_generate_samples", 0)
    if not count:
        return None
    tokenizer = load_tokenizer(data.tokenizer)
    problems = on_rank0(lambda: held_out_problems(
        data.mixture, data.row_format, data.data_split, training.seed, data.system_prompt, tokenizer,
        training.seq_length, count))
    if dist.get_rank() == 0:
        fewer = f" (of {count} asked: the validation split holds no more)" if len(problems) < count else ""
        print(f"megatron_ext: math accuracy on {len(problems)} held-out problems{fewer} at every evaluation",
              flush=True)
    return MathAccuracy(problems, tokenizer, seq_length=training.seq_length, micro_batch_size=training.micro_batch_size,
                        log_dir=run.logging.log_dir, device=device, model_eos=_model_eos(run))


def _model_eos(run):
    """The model's own EOS ids, which its export's generation config keeps: from --pretrained's
    generation_config.json, else its (or --hf-config's) config.json."""
    source, hf_config = run.pretrained.source, getattr(run.model, "hf_config", None)
    directory = source.directory if source is not None and source.kind != "ours" else None
    paths = [os.path.join(directory, name) for name in ("generation_config.json", "config.json")] if directory \
        else [hf_config] if hf_config else []
    for path in paths:
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f).get("eos_token_id")
    return None
