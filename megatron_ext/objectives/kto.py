"""Kahneman-Tversky Optimization on unpaired examples (``--objective kto``), with TRL's definitions (``KTOTrainer``).

Each example's reward is beta x its completion's log-ratio to the reference, r = beta (logp - ref). KTO compares it
with a KL estimate z: desirable examples lose ``1 - sigmoid(beta (logp - ref) - beta z)``, undesirable ones
``1 - sigmoid(beta z - beta (logp - ref))``, weighted by --kto-desirable-weight / --kto-undesirable-weight and
averaged over the examples; ``apo_zero_unpaired`` takes z = 0 and the undesirable ``sigmoid(r)``.
z is the step's mean log-ratio of the KL rows (each prompt with another example's completion, ``data/unpaired.py``),
clamped at 0 and held constant in the gradient. TRL averages it over one accumulation step's batch on all ranks; here
it is the whole global batch's, from a forward-only pass over the KL rows before the step's forward and backward, so
it does not change with the micro-batch size or the mesh (one micro-batch = the global batch: TRL's exactly). That
pass is the forward TRL runs on the KL rows anyway. The reference log-probabilities of both rows come from the
starting weights in one forward-only pass before training, cached as DPO's (``objectives/reference.py``).
Metrics carry TRL's names: ``rewards/{chosen,rejected,margins}``, ``logps/{chosen,rejected}`` (means over the
global batch's desirable / undesirable examples) and ``kl``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_ext.objectives.base import Objective, loss_sums, print_rank0
from megatron_ext.objectives.config import KTOConfig
from megatron_ext.objectives.reference import cache_path, completion_logps, prepare, record, reference_pass
from megatron_ext.objectives.sft import language_model_forward

ROWS = ("tokens", "labels", "completion_mask", "padding_mask", "position_ids")
EXAMPLE, KL = 0, 1  # which half of a micro-batch's rows a pass reads


def example_losses(settings: KTOConfig, logps: torch.Tensor, reference: torch.Tensor, kl: torch.Tensor,
                   desirable: torch.Tensor, chosen_scale: torch.Tensor, rejected_scale: torch.Tensor):
    """Each example's weighted loss and TRL's metrics as per-example shares of their global-batch means
    (``chosen_scale``: the global batch's examples per desirable one; ``rejected_scale`` likewise)."""
    ratio, beta = logps - reference, settings.beta
    if settings.loss == "kto":
        chosen, rejected = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:  # apo_zero_unpaired
        chosen, rejected = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    good = desirable.float()
    losses = good * settings.desirable_weight * chosen + (1 - good) * settings.undesirable_weight * rejected
    reward, logps = beta * ratio.detach(), logps.detach()
    good_share, bad_share = good * chosen_scale, (1 - good) * rejected_scale
    metrics = {"rewards/chosen": reward * good_share, "rewards/rejected": reward * bad_share,
               "rewards/margins": reward * (good_share - bad_share),
               "logps/chosen": logps * good_share, "logps/rejected": logps * bad_share, "kl": kl.detach()}
    return losses, metrics


class KTOStep:
    """The engines' ``step_func`` for KTO: the language model's forward on one half of each micro-batch's rows
    (``rows``: EXAMPLE, or KL for the KL pass), then the loss. With ``collect`` a list it records each micro-batch's
    (indices, [b, 1] log-probabilities) instead: the reference pass."""

    def __init__(self, settings: KTOConfig):
        self.settings = settings
        self.rows = EXAMPLE
        self.collect: Optional[list] = None

    def __call__(self, device: torch.device, data_iterator, model):
        batch = next(data_iterator)
        b = len(batch["index"])
        half = slice(self.rows * b, (self.rows + 1) * b)
        rows = {k: batch[k][half].to(device, non_blocking=True) for k in ROWS}
        extra = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k not in ROWS}
        rows["loss_mask"] = rows.pop("completion_mask")  # what context parallelism cuts and MoE counts
        output, rows = language_model_forward(rows, model)
        return output, functools.partial(self.loss, rows["loss_mask"], extra)

    def loss(self, mask: torch.Tensor, extra: dict, per_token_loss: torch.Tensor):
        logps, _ = completion_logps(mask, per_token_loss)
        count = extra["loss_mask"].sum()
        if self.collect is not None:  # the reference pass
            return record(self.collect, extra["index"], logps.view(-1, 1), count)
        if self.rows == KL:  # the KL pass: the KL rows' summed log-ratios (the engine returns their global mean)
            return loss_sums((logps.detach() - extra["reference"][:, KL]).sum(), {}, count)
        losses, metrics = example_losses(self.settings, logps, extra["reference"][:, EXAMPLE], extra["kl"],
                                         extra["desirable"], extra["chosen_scale"], extra["rejected_scale"])
        loss_sum, count, sums = loss_sums(losses, metrics, count)
        # every CP rank holds whole examples: scaled by CP as DPO's (objectives/dpo.py)
        return loss_sum * parallel_state.get_context_parallel_world_size(), count, sums


def one_kind_note(desirable: torch.Tensor, global_batch_size: int) -> Optional[str]:
    """A line when some global batches hold only desirable or only undesirable examples: KTO reads the data in order
    (TRL's sequential sampling), and paired rows unpair per 1,000-row block, chosen first."""
    batches = desirable[:len(desirable) - len(desirable) % global_batch_size].view(-1, global_batch_size).float()
    one_kind = int(((batches.mean(1) == 0) | (batches.mean(1) == 1)).sum()) if len(batches) else 0
    if not one_kind:
        return None
    return (f"megatron_ext: note: {one_kind} of {len(batches)} global batches hold one kind of example only (KTO reads "
            "the data in order, as TRL's sequential sampler does; paired rows unpair per 1,000-row block, every chosen "
            "completion first); shuffle the rows beforehand for batches that mix them")


def weight_hint(good: int, bad: int, desirable_weight: float, undesirable_weight: float) -> Optional[str]:
    """KTO paper's Eq. 8 (TRL's warning): with unbalanced data, one of the two weights should bring
    desirable_weight x good / (undesirable_weight x bad) into [1, 4/3]."""
    good, bad = max(good, 1), max(bad, 1)
    if good == bad:
        return None
    low, high = round(bad * undesirable_weight / good, 2), round(bad * undesirable_weight / good * 1.33, 2)
    low_u, high_u = round(good * desirable_weight / bad / 1.33, 2), round(good * desirable_weight / bad, 2)
    if low <= desirable_weight <= high or low_u <= undesirable_weight <= high_u:
        return None
    return (f"megatron_ext: {good} desirable and {bad} undesirable examples: the KTO paper advises either "
            f"--kto-desirable-weight in [{low}, {high}] or --kto-undesirable-weight in [{low_u}, {high_u}]")


class KTO(Objective):
    """The reference pass over both rows of every example; the KL pass before each step (run by the data source)."""

    def __init__(self, run):
        super().__init__(run)
        self.step_func = KTOStep(self.config)
        self.flops_scale = 4 / 3 if self.config.loss == "kto" else 1.0  # the KL rows' forward

    def data(self, batches: dict):
        """The examples of --data-path (pairs unpaired), in order, each with its KL row from its micro-batch (TRL's),
        and the build's ``info``."""
        from megatron_ext.data import preference, unpaired
        from megatron_ext.data.sources import UnpairedData

        opts, training, config = self.run.data, self.run.training, self.config
        train, valid, info = unpaired.build_datasets(
            opts.data_path, opts.tokenizer, training.seq_length, training.micro_batch_size, data_split=opts.data_split,
            system_prompt=opts.system_prompt, bad_rows=opts.bad_rows, seed=training.seed, cache_dir=opts.data_cache_dir)
        self.info, good = info, int(train.desirable.sum())
        print_rank0(preference.summary(info, f"{info['train_samples']} train ({good} desirable) / "
                                             f"{info['valid_samples']} validation examples, each with its KL row, of "
                                             f"up to {training.seq_length} tokens"))
        for line in (preference.cut_warning(info), one_kind_note(train.desirable, training.global_batch_size),
                     weight_hint(good, len(train) - good, config.desirable_weight, config.undesirable_weight)):
            if line:
                print_rank0(line)
        return UnpairedData(train, valid, **batches), info

    def _table(self, engine, data, dataset) -> torch.Tensor:
        step, columns = self.step_func, []
        for rows in (EXAMPLE, KL) if self.step_func.settings.loss == "kto" else (EXAMPLE,):
            step.rows = rows
            try:
                columns.append(reference_pass(engine, step, data, dataset, width=1))
            finally:
                step.rows = EXAMPLE
        columns += [torch.zeros(len(dataset), 1)] * (2 - len(columns))  # apo_zero_unpaired reads no KL row
        return torch.cat(columns, dim=1)

    def kl_estimate(self, engine, microbatches) -> float:
        """The global batch's mean KL-row log-ratio, clamped at 0 (None off the last pipeline stage: no loss)."""
        self.step_func.rows = KL
        try:
            with torch.no_grad():  # constant in the gradient; MoE routers count only the training pass
                value = engine.forward_backward(microbatches, forward_only=True)
        finally:
            self.step_func.rows = EXAMPLE
        return max(value, 0.0) if value is not None else 0.0

    def before_training(self, engine, data, model_meta: dict) -> str:
        path = cache_path(self.run, self.info, model_meta, ld_alpha=None,
                          kl_batch=self.run.training.micro_batch_size)
        line = prepare(data, path, functools.partial(self._table, engine, data),
                       what="KTO reference log-probabilities of {} + {} examples and their KL rows")
        if self.step_func.settings.loss == "kto":
            data.kl_pass = functools.partial(self.kl_estimate, engine)
        return line
