"""Reward models (``--objective reward``): a Qwen with a score head (``models/reward.py``) trained on preference
pairs with the Bradley-Terry loss, TRL's ``RewardTrainer`` definitions.

A pair's rows are its two whole conversations (prompt and completion, as the chat template renders them); the
reward is the score at each row's last token (transformers' ``*ForSequenceClassification``: its last non-padding
token). Loss per pair: ``-logsigmoid(r_chosen - r_rejected - m)`` (m: the data's ``margin`` column, 0 without
one), plus ``--center-rewards-coefficient`` x ``(r_chosen + r_rejected)^2`` (TRL's centring); metrics with TRL's
names: ``accuracy`` (r_chosen > r_rejected), ``margin`` (r_chosen - r_rejected), ``mean_reward``, ``min_reward`` and
``max_reward`` (over the global batch's rows). The pairs are ``data/preference.py``'s, tokenized as TRL's
``RewardTrainer`` tokenizes them: whole sequences of at most ``--seq-length`` tokens (longer pairs are dropped, as
TRL filters them); DPO's rows hold a sequence's ids but the last as inputs and all but the first as labels, so the
first input and the labels are the whole sequence.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state

from megatron_ext.data.sources import PreferenceData
from megatron_ext.models import context_parallel
from megatron_ext.models.reward import SCORE
from megatron_ext.objectives.base import Objective, loss_sums, print_rank0
from megatron_ext.objectives.config import RewardConfig
from megatron_ext.objectives.sft import language_model_forward

def whole_rows(batch: dict) -> dict:
    """DPO's micro-batch of b pairs (rows of at most S - 1 inputs and labels) as a reward model's: [2b, S] token
    rows, ``last`` (each row's last token), ``padding_mask``, ``position_ids``, ``loss_mask`` [b] (pairs)."""
    tokens = torch.cat([batch["tokens"][:, :1], batch["labels"][:, :-1]], dim=1)
    last = (~batch["padding_mask"]).sum(-1)
    at = torch.arange(tokens.shape[1])
    return dict(tokens=tokens, position_ids=at.expand_as(tokens).contiguous(), padding_mask=at > last[:, None],
                last=last, loss_mask=batch["loss_mask"], margin=batch["margin"])


class RewardData(PreferenceData):
    """Preference pairs as whole conversations (``whole_rows``)."""

    def _microbatches(self, dataset, indices) -> List[dict]:
        return [whole_rows(batch) for batch in super()._microbatches(dataset, indices)]


class RewardStep:
    """The engines' ``step_func``: the model's scores, then the pairs' loss at each row's last token."""

    def __init__(self, settings: RewardConfig):
        self.settings = settings

    def __call__(self, device: torch.device, data_iterator, model):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
        pairs, last, margin = batch.pop("loss_mask"), batch.pop("last"), batch.pop("margin")
        batch.update(labels=None, loss_mask=(~batch["padding_mask"]).float())  # (MoE: the tokens routing counts)
        output, batch = language_model_forward(batch, model)
        return output, functools.partial(self.loss, pairs, last, margin, batch["position_ids"])

    def loss(self, pairs: torch.Tensor, last: torch.Tensor, margin: torch.Tensor, positions: torch.Tensor,
             scores: torch.Tensor):
        scores = scores[..., 0].float()  # [2b, s]: this CP rank's positions of each row
        if parallel_state.get_context_parallel_world_size() > 1:
            # Each row's last token lives on one CP rank: every rank gathers the rows' scores (backward: each rank's
            # part of the sum of the identical losses' gradients, i.e. CP x its own, which the engine's division by
            # the CP-summed count undoes) and their positions, and reads the score at the last position.
            group = parallel_state.get_context_parallel_group()
            scores = context_parallel.gather(scores.t(), group).t()
            every = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, positions.contiguous(), group=group)
            last = (torch.cat(every, dim=1) == last[:, None]).int().argmax(1)
        rewards = scores.gather(1, last[:, None]).squeeze(1)  # [2b]
        losses, metrics = pair_losses(self.settings, *rewards.chunk(2), margin)
        loss_sum, count, sums = loss_sums(losses, metrics, pairs.sum(), pairs)
        real, rewards = torch.cat([pairs, pairs]).bool(), rewards.detach()  # the extremes over every row (the
        far = torch.full_like(rewards, float("inf"))  # engines reduce "max:" keys); masks without a host sync
        sums.update({"min:min_reward": torch.where(real, rewards, far).min(),
                     "max:max_reward": torch.where(real, rewards, -far).max()})
        return loss_sum, count, sums


def pair_losses(settings: RewardConfig, chosen: torch.Tensor, rejected: torch.Tensor,
                margin: Optional[torch.Tensor] = None):
    """Each pair's loss and TRL's per-pair metrics (detached) from its two rewards; ``margin``: the pairs' margin
    column, which the reward difference must exceed (TRL's)."""
    losses = -F.logsigmoid(chosen - rejected - (0 if margin is None else margin))
    if settings.center_rewards_coefficient is not None:
        losses = losses + settings.center_rewards_coefficient * (chosen + rejected) ** 2
    chosen, rejected = chosen.detach(), rejected.detach()
    return losses, {"accuracy": (chosen > rejected).float(), "margin": chosen - rejected,
                    "mean_reward": (chosen + rejected) / 2}


class Reward(Objective):
    """Pairs, and the score head, which starts at zero when the starting weights lack it (a language model)."""

    rows_per_sample = 2
    new_head = (SCORE,)

    def __init__(self, run):
        super().__init__(run)
        self.step_func = RewardStep(self.config)

    def data(self, batches: dict):
        """Pairs of whole sequences of up to --seq-length tokens, served as whole rows."""
        from megatron_ext.data import preference

        opts, training = self.run.data, self.run.training
        train, valid, self.info = preference.build_datasets(
            opts.data_path, opts.tokenizer, training.seq_length, data_split=opts.data_split,
            system_prompt=opts.system_prompt, bad_rows=opts.bad_rows, seed=training.seed, cache_dir=opts.data_cache_dir,
            layout=preference.REWARD_PAIRS)
        print_rank0(preference.summary(self.info, f"{self.info['train_samples']} train / "
                                                  f"{self.info['valid_samples']} validation pairs of up to 2 x "
                                                  f"{training.seq_length} tokens"))
        return RewardData(train, valid, **batches), self.info

    def before_training(self, engine, data, model_meta: dict) -> str:
        return "megatron_ext: reward model: Bradley-Terry loss on the pairs' scores at their last tokens"
