"""The objectives on preference data: ``--objective dpo``, Direct Preference Optimization (``training/dpo.py``),
``--objective kto`` on unpaired examples (``training/kto.py``) and ``--objective reward``, a reward model
(``training/reward.py``), on the same engines as SFT. Torch-free, like ``arguments``: every check runs before any
process group exists."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, nonneg_float, positive_float, shipped, unit_interval

# TRL 1.16's DPOTrainer loss types, each on a pair's summed log-probabilities (training/dpo.py). Left out: "aot" and
# "aot_unpaired", which sort the pairs of a micro-batch, so their loss changes with the micro-batch size and DP.
# Reference-free, as TRL's CPOTrainer and ORPOTrainer run them by default (no reference pass): cpo (sigmoid of the
# summed log-probabilities' difference, plus the chosen tokens' loss), simpo (of the length-averaged ones minus
# --dpo-simpo-gamma, no token loss: TRL's cpo_alpha 0, as SimPO's authors advise), orpo (the odds ratio of the
# length-averaged ones, plus the chosen tokens' loss). "sft" may be added to any.
REFERENCE_FREE = ("cpo", "simpo", "orpo")
LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
          "apo_down", "discopop", "sft", "sigmoid_norm") + REFERENCE_FREE
SMOOTHED = ("sigmoid", "robust", "exo_pair", "cpo", "simpo")  # what --dpo-label-smoothing enters (sigmoid: cDPO)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")  # TRL's


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    losses: Tuple[str, ...] = ("sigmoid",)  # TRL's loss_type list, summed with ``weights`` (TRL's loss_weights)
    weights: Tuple[float, ...] = (1.0,)
    label_smoothing: float = 0.0
    f_divergence: str = "reverse_kl"  # f-DPO: the log-ratios' transform before the pair losses
    f_alpha: float = 0.5  # alpha_divergence's alpha
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    ld_alpha: Optional[float] = None  # LD-DPO: completion tokens past the pair's shorter length count ld_alpha x
    use_weighting: bool = False  # WPO: each pair's losses x its completions' mean token probability (adjusted)

    @property
    def reference_free(self) -> Optional[str]:
        """The reference-free loss (cpo, simpo or orpo) when there is one: then no reference pass runs."""
        return next((name for name in self.losses if name in REFERENCE_FREE), None)


KTO_LOSSES = ("kto", "apo_zero_unpaired")  # TRL 1.16's KTOTrainer loss types


@dataclasses.dataclass(frozen=True)
class KTOSettings:
    beta: float = 0.1
    loss: str = "kto"  # kto: against the batch's KL estimate; apo_zero_unpaired: none
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    center_coefficient: Optional[float] = None  # TRL's center_rewards_coefficient


def loss_list(text: str) -> Tuple[str, ...]:
    """``--dpo-loss``: one of TRL's loss types, or several joined by commas (MPO: sigmoid,bco_pair,sft)."""
    names = tuple(name.strip() for name in str(text).split(","))
    for name in names:
        if name in ("aot", "aot_unpaired"):
            raise argparse.ArgumentTypeError(f"{name} sorts the pairs of each micro-batch, so its loss would change "
                                             "with --micro-batch-size and the data-parallel size; choose another")
        if name not in LOSSES:
            raise argparse.ArgumentTypeError(f"{name!r} is not a DPO loss; choose from {', '.join(LOSSES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a loss twice")
    return names


def weight_list(text: str) -> Tuple[float, ...]:
    """``--dpo-loss-weights``: a finite non-negative weight per --dpo-loss entry, joined by commas."""
    try:
        weights = tuple(float(w) for w in str(text).split(","))
    except ValueError:
        weights = ()
    if not weights or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite non-negative weights joined by commas, "
                                         "e.g. 0.8,0.2,1")
    return weights


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("objective (SFT, or DPO, KTO or a reward model on preference data)")
    g.add_argument("--objective", default="sft", choices=["sft", "dpo", "kto", "reward"],
                   help="sft: next-token loss on the assistant's turns; dpo: preference pairs (prompt, chosen, "
                        "rejected) against the starting model; kto: examples marked desirable or not (prompt, "
                        "completion, label; pairs are unpaired); reward: a reward model (a score head, the "
                        "Bradley-Terry loss) on pairs; TRL's definitions")
    g.add_argument("--center-rewards-coefficient", type=nonneg_float, default=None,
                   help="--objective reward: add this x (r_chosen + r_rejected)^2, centring the rewards (TRL's)")
    g.add_argument("--dpo-beta", type=positive_float, default=0.1, help="DPO's and KTO's beta (IPO's tau)")
    g.add_argument("--dpo-loss", type=loss_list, default=("sigmoid",), metavar="LOSS[,LOSS...]",
                   help=f"TRL's loss_type, or several summed (MPO: sigmoid,bco_pair,sft): {', '.join(LOSSES)}")
    g.add_argument("--dpo-loss-weights", type=weight_list, default=None, metavar="W[,W...]",
                   help="TRL's loss_weights: one per --dpo-loss entry (default 1 each)")
    g.add_argument("--dpo-label-smoothing", type=fraction, default=0.0,
                   help="the probability that a pair's labels are flipped, in [0, 0.5): conservative DPO with "
                        "sigmoid, robust DPO; EXO's epsilon (exo_pair needs it > 0, the paper: 1e-3)")
    g.add_argument("--dpo-f-divergence", default="reverse_kl", choices=F_DIVERGENCES,
                   help="f-DPO's divergence from the reference (reverse_kl: DPO)")
    g.add_argument("--dpo-f-alpha", type=positive_float, default=0.5,
                   help="alpha of --dpo-f-divergence alpha_divergence")
    g.add_argument("--dpo-discopop-tau", type=positive_float, default=0.05,
                   help="DiscoPOP's tau (--dpo-loss discopop)")
    g.add_argument("--dpo-ld-alpha", type=unit_interval, default=None,
                   help="LD-DPO (TRL's ld_alpha, in [0, 1]): each completion's tokens past the pair's shorter "
                        "completion count this much in its log-probability (policy and reference)")
    g.add_argument("--dpo-use-weighting", action="store_true",
                   help="WPO (TRL's use_weighting): weigh each pair's losses by how likely the policy finds its two "
                        "completions (their mean token log-probability less log sum p^2, exponentiated)")
    g.add_argument("--kto-loss", default="kto", choices=KTO_LOSSES,
                   help="TRL's KTOTrainer loss_type: kto (rewards against the batch's KL estimate) or "
                        "apo_zero_unpaired (no KL estimate)")
    g.add_argument("--kto-desirable-weight", type=positive_float, default=1.0,
                   help="the weight of desirable examples' losses (TRL's desirable_weight)")
    g.add_argument("--kto-undesirable-weight", type=positive_float, default=1.0,
                   help="the weight of undesirable examples' losses (TRL's undesirable_weight)")
    g.add_argument("--dpo-simpo-gamma", type=nonneg_float, default=0.5,
                   help="SimPO's target reward margin gamma (--dpo-loss simpo; TRL's simpo_gamma)")


SFT_SAMPLE, PREFERENCE_SAMPLE = (shipped("examples/data/metamathqa_sample.jsonl"),
                                 shipped("examples/data/preference_sample.jsonl"))


def apply_defaults(args: argparse.Namespace) -> None:
    """DPO, KTO and reward models read preference data: the shipped pairs unless --data-path names data (one file
    or data set)."""
    if getattr(args, "objective", "sft") == "sft":
        return
    if args.data_path == [SFT_SAMPLE]:
        args.data_path = [PREFERENCE_SAMPLE]
    if len(args.data_path) != 1:
        raise ConfigError(f"--objective {args.objective} reads one --data-path (a file or data set of pairs), not a "
                          "mixture")


def _check_losses(args: argparse.Namespace) -> Tuple[float, ...]:
    losses, smoothing = args.dpo_loss, args.dpo_label_smoothing
    weights = args.dpo_loss_weights or (1.0,) * len(losses)
    named = ",".join(losses)
    if len(weights) != len(losses):
        raise ConfigError(f"--dpo-loss-weights has {len(weights)} weights for the {len(losses)} losses of --dpo-loss "
                          f"{named}; give one each")
    if not 0.0 <= smoothing < 0.5:
        raise ConfigError(f"--dpo-label-smoothing {smoothing}: must be in [0, 0.5)")
    if smoothing and not set(losses) & set(SMOOTHED):
        raise ConfigError(f"--dpo-label-smoothing applies to --dpo-loss {', '.join(SMOOTHED)}, not {named}")
    if "exo_pair" in losses and not smoothing:
        raise ConfigError("--dpo-loss exo_pair needs --dpo-label-smoothing > 0 (EXO's epsilon; the paper: 1e-3)")
    free = [name for name in losses if name in REFERENCE_FREE]
    needs_reference = [name for name in losses if name not in REFERENCE_FREE + ("sft",)]
    if free and (needs_reference or len(free) > 1):
        raise ConfigError(f"--dpo-loss {named}: {free[0]} is reference-free (no reference pass); it goes alone or "
                          f"with sft, not with {','.join(needs_reference + free[1:])}")
    if args.dpo_ld_alpha is not None and free:
        raise ConfigError(f"--dpo-ld-alpha weighs the log-ratios to the reference; --dpo-loss {free[0]} has none "
                          "(TRL's CPOTrainer and ORPOTrainer take no ld_alpha); drop one of them")
    if args.dpo_use_weighting and (free or "sft" in losses):
        raise ConfigError(f"--dpo-use-weighting weighs pair losses against the reference; --dpo-loss {named} has "
                          f"{free[0] if free else 'sft'}, a term it does not weigh per pair here; drop one of them")
    if args.dpo_use_weighting and args.cross_entropy_loss_fusion:
        raise ConfigError("--dpo-use-weighting reads the logits, which --cross-entropy-loss-fusion never holds; drop "
                          "one of them (the Qwen launchers: CE_FUSION=0)")
    others = sorted(set(losses) - set(F_DIVERGENCE_LOSSES))
    if args.dpo_f_divergence != "reverse_kl" and others:
        raise ConfigError(f"--dpo-f-divergence {args.dpo_f_divergence} does not go with --dpo-loss {','.join(others)} "
                          f"(f-DPO generalises {', '.join(F_DIVERGENCE_LOSSES)} only)")
    return weights


def _check_pairs(args: argparse.Namespace) -> None:
    """What no preference objective (dpo, kto, reward) can take, in one line naming the flag."""
    objective = args.objective
    for flag, value, why in (("--mock-data", args.mock_data, "preference pairs come from --data-path"),
                             ("--pack-sequences", args.pack_sequences, "each sample keeps its own rows"),
                             ("--eval-generate-samples", args.eval_generate_samples, "it evaluates pairs")):
        if value:
            raise ConfigError(f"{flag} does not go with --objective {objective} ({why}); drop it")
    if args.engine == "deepspeed" and args.pipeline_model_parallel_size > 1:
        raise ConfigError(f"--objective {objective} under DeepSpeed's pipeline engine is not supported (its schedule "
                          "owns the loss); use --engine megatron for pipeline parallelism")


def reward_settings_from_args(args: argparse.Namespace) -> Optional[RewardSettings]:
    """The reward model's settings, or None for another objective; one line for what it cannot take."""
    if args.center_rewards_coefficient is not None and args.objective != "reward":
        raise ConfigError("--center-rewards-coefficient is for --objective reward; drop it")
    if args.objective != "reward":
        return None
    _check_pairs(args)
    if args.cross_entropy_loss_fusion:
        raise ConfigError("--cross-entropy-loss-fusion does not go with --objective reward (a reward model has no "
                          "vocabulary output); drop it")
    return RewardSettings(center_coefficient=args.center_rewards_coefficient)


def settings_from_args(args: argparse.Namespace) -> Optional[DPOSettings]:
    """The DPO settings, or None for another objective; one line naming the flag for what DPO cannot take."""
    if args.objective != "dpo":
        return None
    weights = _check_losses(args)
    _check_pairs(args)
    return DPOSettings(beta=args.dpo_beta, losses=args.dpo_loss, weights=weights,
                       label_smoothing=args.dpo_label_smoothing, f_divergence=args.dpo_f_divergence,
                       f_alpha=args.dpo_f_alpha, discopop_tau=args.dpo_discopop_tau,
                       simpo_gamma=args.dpo_simpo_gamma, ld_alpha=args.dpo_ld_alpha,
                       use_weighting=args.dpo_use_weighting)


def kto_settings_from_args(args: argparse.Namespace) -> Optional[KTOSettings]:
    """KTO's settings, or None for another objective; one line naming the flag for what KTO cannot take."""
    if args.objective != "kto":
        return None
    _check_pairs(args)
    if args.kto_loss == "kto" and args.micro_batch_size < 2:
        raise ConfigError("--objective kto pairs each example's prompt with another completion of its micro-batch for "
                          "the KL estimate (TRL's per_device_train_batch_size), so --micro-batch-size 1 has none; use "
                          "2 or more, or --kto-loss apo_zero_unpaired")
    return KTOSettings(beta=args.dpo_beta, loss=args.kto_loss, desirable_weight=args.kto_desirable_weight,
                       undesirable_weight=args.kto_undesirable_weight)
