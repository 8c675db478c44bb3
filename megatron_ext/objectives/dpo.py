"""Direct Preference Optimization on every engine and mesh SFT runs on, with TRL's definitions (``DPOTrainer``).

A micro-batch of b pairs is 2b rows, chosen then rejected (``data/preference.py``). Each row's log-probability is
the sum over its completion of -(the model's per-token cross entropy), summed over context-parallel ranks (each holds
part of every row); the loss of a pair compares the policy's log-ratio to the reference's:
``delta = (logp_c - ref_c) - (logp_r - ref_r)``; sigmoid: ``-logsigmoid(beta delta)`` (cDPO with label smoothing
e: ``-(1-e) logsigmoid(beta delta) - e logsigmoid(-beta delta)``), hinge: ``relu(1 - beta delta)``, ipo:
``(delta / completion length - 1 / (2 beta))^2`` with each log-ratio averaged over its own completion's tokens, and
the rest of TRL 1.16's loss types by its definitions, several of them weighted and summed (MPO), with f-DPO's
transforms of the log-ratios and LD-DPO's weight on the tokens past the pair's shorter completion; and the
reference-free cpo, simpo and orpo of TRL's CPOTrainer and ORPOTrainer (no reference pass). "sft" is the chosen
completions' mean token loss over the whole global batch (TRL's over its batch), so it does not change with the
micro-batch size or the mesh.
The reference log-probabilities come from the starting weights in one forward-only pass over every pair before
training, cached beside the data cache; so step 1's sigmoid loss is ln 2. A LoRA run's reference is its model as it
starts: the base for new adapters (B = 0), the base with the adapters of --pretrained-adapter for continued ones, as
TRL's (it keeps a "ref" copy of a pretrained adapter).
Metrics carry TRL's names: ``rewards/{chosen,rejected,accuracies,margins}``, ``logps/{chosen,rejected}``.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from megatron_ext.models.sharding import unwrap
from megatron_ext.objectives.base import Objective, loss_sums, print_rank0
from megatron_ext.objectives.config import DPOConfig
from megatron_ext.objectives.reference import cache_path, completion_logps, prepare, record, reference_pass
from megatron_ext.objectives.sft import language_model_forward

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def _scores(settings: DPOConfig, log_ratio: torch.Tensor) -> torch.Tensor:
    """f-DPO: the log-ratio log(pi/ref) through f'(pi/ref) of the chosen f-divergence (reverse KL: itself)."""
    f = settings.f_divergence
    if f == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if f == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if f == "alpha_divergence" and abs(settings.f_alpha - 1.0) >= 1e-6:
        t = ((settings.f_alpha - 1.0) * log_ratio).clamp(max=80.0)  # TRL's clamp keeps exp finite
        return (torch.exp(t) - 1.0) / (settings.f_alpha - 1.0)
    return log_ratio


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (TRL's log1mexp)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(settings: DPOConfig, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                sft_scale: Optional[torch.Tensor] = None, chosen_unweighted: Optional[torch.Tensor] = None,
                pair_weights: Optional[torch.Tensor] = None):
    """Each pair's loss (TRL's loss types, weighted and summed) and TRL's per-pair metrics (detached) from its summed
    log-probabilities. ``sft_scale``: pairs / chosen completion tokens of the whole global batch, so the mean of the
    "sft" term over the global batch is TRL's mean token loss of its chosen completions. Under LD-DPO the
    log-probabilities are LD-weighted and ``chosen_unweighted`` is the plain sum the "sft" term reads. WPO's
    ``pair_weights`` multiply every loss term (detached)."""
    plain = chosen if chosen_unweighted is None else chosen_unweighted
    nll = None if sft_scale is None else -plain * sft_scale  # each pair's share of the chosen tokens' mean loss
    if nll is None and ("sft" in settings.losses or settings.reference_free in ("cpo", "orpo")):
        raise ValueError("the chosen tokens' loss needs sft_scale (pairs / chosen tokens of the global batch)")
    chosen_length, rejected_length = chosen_tokens.clamp(min=1), rejected_tokens.clamp(min=1)
    if settings.reference_free in ("simpo", "orpo"):  # (TRL: the length-averaged log-probabilities, everywhere)
        chosen, rejected = chosen / chosen_length, rejected / rejected_length
    if settings.reference_free:  # rewards are beta x the policy's log-probabilities
        ref_chosen, ref_rejected = torch.zeros_like(chosen), torch.zeros_like(rejected)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_score, rejected_score = _scores(settings, chosen_ratio), _scores(settings, rejected_ratio)
    beta, eps = settings.beta, settings.label_smoothing
    z = beta * (chosen_score - rejected_score)
    total = 0
    for name, weight in zip(settings.losses, settings.weights):
        if name == "sigmoid":  # cDPO with label smoothing e
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        elif name == "hinge":
            losses = torch.relu(1 - z)
        elif name in ("ipo", "sigmoid_norm"):  # log-ratios averaged over each completion's tokens
            normed = chosen_score / chosen_length - rejected_score / rejected_length
            losses = (normed - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * normed)
        elif name == "exo_pair":  # KL(softmax over the pair's rewards || (1 - e, e))
            losses = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                      + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
        elif name == "robust":
            losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        elif name in ("nca_pair", "bco_pair"):
            c, r = beta * chosen_ratio, beta * rejected_ratio
            losses = (-F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r) if name == "nca_pair"
                      else -F.logsigmoid(c) - F.logsigmoid(-r))
        elif name == "sppo_hard":
            losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif name == "apo_zero":
            losses = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        elif name == "apo_down":
            losses = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
        elif name == "discopop":
            mix = torch.sigmoid(z / settings.discopop_tau)
            losses = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
        elif name in ("cpo", "simpo"):  # (simpo: on the averages, less its margin gamma)
            margin = z - settings.simpo_gamma if name == "simpo" else z
            losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
            losses = losses + nll if name == "cpo" else losses
        elif name == "orpo":  # log odds(chosen) - log odds(rejected) of the averages, log1mexp(x) = log(1 - e^x)
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            losses = nll - beta * F.logsigmoid(log_odds)
        elif name == "sft":  # the chosen completions' negative log-likelihood
            losses = nll
        else:
            raise ValueError(f"unknown DPO loss {name!r}")
        total = total + weight * losses * (1 if pair_weights is None else pair_weights)
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
               "rewards/accuracies": (chosen_reward > rejected_reward).float(),
               "rewards/margins": chosen_reward - rejected_reward,
               "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
    return total, metrics


def log_sum_sq_probs(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log sum_v p_v^2 of each token ([b, s]) from this TP rank's part of its logits ([s, b, v / tp]), softmax over
    the whole vocabulary (two all-reduces over TP per chunk of ``chunk`` positions, in fp32, no graph)."""
    group = parallel_state.get_tensor_model_parallel_group()
    out = []
    with torch.no_grad():
        for part in logits.detach().split(chunk):
            x = part.float()
            peak = x.amax(-1)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            total = torch.exp(x - peak[..., None]).sum(-1)
            dist.all_reduce(total, group=group)
            x = 2 * (x - (peak + total.log())[..., None])  # 2 log p
            peak = x.amax(-1)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            total = torch.exp(x - peak[..., None]).sum(-1)
            dist.all_reduce(total, group=group)
            out.append(peak + total.log())
    return torch.cat(out).t()


class DPOStep:
    """The engines' ``step_func`` for DPO: the language model's forward, then the pair loss. With ``collect`` a
    list, it records each micro-batch's (pair indices, [b, 2] log-probabilities) instead: the reference pass."""

    def __init__(self, settings: DPOConfig):
        self.settings = settings
        self.collect: Optional[list] = None
        self._hooked = weakref.WeakSet()  # WPO: output layers whose logits give log sum p^2
        self._log_sum_sq: Optional[torch.Tensor] = None

    def _capture(self, module, inputs, output) -> None:
        if self.collect is None:  # (the reference pass reads no weights)
            self._log_sum_sq = log_sum_sq_probs(output[0])

    def __call__(self, device: torch.device, data_iterator, model):
        layer = getattr(unwrap(model), "output_layer", None)
        if self.settings.use_weighting and layer is not None and layer not in self._hooked:
            layer.register_forward_hook(self._capture)  # after the vocabulary padding's mask (qwen.py)
            self._hooked.add(layer)
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
        pairs, reference, index = batch.pop("loss_mask"), batch.pop("reference"), batch.pop("index")
        sft_scale = batch.pop("sft_scale")
        batch.pop("margin", None)  # (a reward model's)
        batch["loss_mask"] = batch.pop("completion_mask")  # what context parallelism cuts and MoE counts
        output, batch = language_model_forward(batch, model)  # (LD-DPO's completion_weight cut with the rest)
        log_sum_sq, self._log_sum_sq = self._log_sum_sq, None
        return output, functools.partial(self.loss, batch["loss_mask"], pairs, reference, index, sft_scale,
                                         batch.get("completion_weight"), log_sum_sq)

    def loss(self, mask: torch.Tensor, pairs: torch.Tensor, reference: torch.Tensor, index: torch.Tensor,
             sft_scale: torch.Tensor, weight: Optional[torch.Tensor], log_sum_sq: Optional[torch.Tensor],
             per_token_loss: torch.Tensor):
        logps, tokens = completion_logps(mask, per_token_loss)
        pair_weights = None
        if log_sum_sq is not None:  # WPO (its Eq. 2, TRL's): exp(mean over the completion of log p - log sum p^2)
            aligned, _ = completion_logps(mask, per_token_loss.detach().float() + log_sum_sq)
            pair_weights = torch.exp(aligned / tokens.clamp(min=1)).view(2, -1).prod(0)
        plain = None
        if weight is not None:  # LD-DPO: the weighted sums compare; the plain chosen ones feed "sft"
            plain, (logps, _) = logps.chunk(2)[0], completion_logps(weight, per_token_loss)
        cp = parallel_state.get_context_parallel_world_size()
        count = pairs.sum()
        if self.collect is not None:
            return record(self.collect, index, logps.view(2, -1).t(), count)
        chosen, rejected = logps.chunk(2)
        losses, metrics = pair_losses(self.settings, chosen, rejected, reference[:, 0], reference[:, 1],
                                      *tokens.chunk(2), sft_scale=sft_scale, chosen_unweighted=plain,
                                      pair_weights=pair_weights)
        loss_sum, count, sums = loss_sums(losses, metrics, count, pairs)
        # Every CP rank holds the whole pair loss and its count: the engine sums gradients and counts over DP x CP,
        # so the gradient (each rank's part of it) is scaled by CP to stay d(sum of pair losses) / (pairs).
        return loss_sum * cp, count, sums


class DPO(Objective):
    """Pairs, and the reference pass before training unless the loss is reference-free."""

    rows_per_sample = 2

    def __init__(self, run):
        super().__init__(run)
        self.step_func = DPOStep(self.config)

    def data(self, batches: dict):
        """The pairs of --data-path, and the build's ``info`` (printed here)."""
        from megatron_ext.data import preference
        from megatron_ext.data.sources import PreferenceData

        opts, training = self.run.data, self.run.training
        train, valid, info = preference.build_datasets(
            opts.data_path, opts.tokenizer, training.seq_length, data_split=opts.data_split,
            system_prompt=opts.system_prompt, bad_rows=opts.bad_rows, seed=training.seed, cache_dir=opts.data_cache_dir)
        self.info = info
        print_rank0(preference.summary(info, f"{info['train_samples']} train / {info['valid_samples']} validation "
                                             f"pairs of up to 2 x {training.seq_length} tokens"))
        if preference.cut_warning(info):
            print_rank0(preference.cut_warning(info))
        data = PreferenceData(train, valid, **batches)
        data.ld_alpha = self.config.ld_alpha  # LD-DPO's token weights, in every batch (the reference pass's too)
        return data, info

    def before_training(self, engine, data, model_meta: dict) -> str:
        free = self.config.reference_free
        if free:  # the batches carry zeros for the reference, which the loss does not read
            return f"megatron_ext: --dpo-loss {free} is reference-free: no reference pass"
        path = cache_path(self.run, self.info, model_meta, ld_alpha=self.config.ld_alpha)
        return prepare(data, path, lambda dataset: reference_pass(engine, self.step_func, data, dataset),
                       what="DPO reference log-probabilities of {} + {} pairs")
