"""The objectives' options, one section each (``config.Section``), on a shared base for the preference objectives as
TRL's trainer configs sit on theirs: ``--objective`` chooses the section a run holds (``RunConfig.objective``).
Torch-free, like ``arguments``: every check runs before any process group exists."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import ClassVar, Optional, Tuple

from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, nonneg_float, positive_float, shipped, unit_interval

GROUP = "objective (SFT, or DPO, KTO or a reward model on preference data)"
# TRL 1.16's DPOTrainer loss types, each on a pair's summed log-probabilities (objectives/dpo.py). Left out: "aot" and
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
KTO_LOSSES = ("kto", "apo_zero_unpaired")  # TRL 1.16's KTOTrainer loss types
SFT_SAMPLE, PREFERENCE_SAMPLE = (shipped("examples/data/metamathqa_sample.jsonl"),
                                 shipped("examples/data/preference_sample.jsonl"))


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


@dataclasses.dataclass
class Choice(Section):
    GROUP = GROUP
    objective: str = option("sft", choices=("sft", "dpo", "kto", "reward"),
                            help="sft: next-token loss on the assistant's turns; dpo: preference pairs (prompt, chosen, "
                                 "rejected) against the starting model; kto: examples marked desirable or not (prompt, "
                                 "completion, label; pairs are unpaired); reward: a reward model (a score head, the "
                                 "Bradley-Terry loss) on pairs; TRL's definitions")


class ObjectiveConfig(Section):
    GROUP = GROUP
    NAME: ClassVar[str] = ""  # its --objective
    HEAD: ClassVar[str] = "lm"  # the model's output: the vocabulary's logits, or a reward model's "score"

    def defaults(self, data) -> None:
        """What the objective changes of the data section's defaults, before they are read."""


@dataclasses.dataclass
class SFTConfig(ObjectiveConfig):
    """SFT: no options of its own (its data's are the data group's)."""

    NAME: ClassVar[str] = "sft"


@dataclasses.dataclass
class PreferenceConfig(ObjectiveConfig):
    """What DPO, KTO and reward models share: preference data and what they cannot take."""

    beta: float = option(0.1, flags=("--dpo-beta",), type=positive_float, help="DPO's and KTO's beta (IPO's tau)")

    def defaults(self, data) -> None:
        """The shipped pairs unless --data-path names data (one file or data set)."""
        if data.data_path == [SFT_SAMPLE]:
            data.data_path = [PREFERENCE_SAMPLE]
        if len(data.data_path) != 1:
            raise ConfigError(f"--objective {self.NAME} reads one --data-path (a file or data set of pairs), not a "
                              "mixture")

    def check(self, run) -> None:
        data = run.data
        for flag, value, why in (("--mock-data", data.mock_data, "preference pairs come from --data-path"),
                                 ("--pack-sequences", data.pack_sequences, "each sample keeps its own rows"),
                                 ("--eval-generate-samples", data.eval_generate_samples, "it evaluates pairs")):
            if value:
                raise ConfigError(f"{flag} does not go with --objective {self.NAME} ({why}); drop it")
        if run.engine.engine == "deepspeed" and run.mesh.pp > 1:
            raise ConfigError(f"--objective {self.NAME} under DeepSpeed's pipeline engine is not supported (its "
                              "schedule owns the loss); use --engine megatron for pipeline parallelism")


@dataclasses.dataclass
class DPOConfig(PreferenceConfig):
    NAME: ClassVar[str] = "dpo"
    # TRL's loss_type list, summed with ``weights`` (TRL's loss_weights)
    losses: Tuple[str, ...] = option(("sigmoid",), flags=("--dpo-loss",), type=loss_list, metavar="LOSS[,LOSS...]",
                                     help=f"TRL's loss_type, or several summed (MPO: sigmoid,bco_pair,sft): "
                                          f"{', '.join(LOSSES)}")
    weights: Optional[Tuple[float, ...]] = option(None, flags=("--dpo-loss-weights",), type=weight_list,
                                                  metavar="W[,W...]",
                                                  help="TRL's loss_weights: one per --dpo-loss entry (default 1 each)")
    label_smoothing: float = option(0.0, flags=("--dpo-label-smoothing",), type=fraction,
                                    help="the probability that a pair's labels are flipped, in [0, 0.5): "
                                         "conservative DPO with sigmoid, robust DPO; EXO's epsilon (exo_pair needs it "
                                         "> 0, the paper: 1e-3)")
    f_divergence: str = option("reverse_kl", flags=("--dpo-f-divergence",), choices=F_DIVERGENCES,
                               help="f-DPO's divergence from the reference (reverse_kl: DPO)")
    f_alpha: float = option(0.5, flags=("--dpo-f-alpha",), type=positive_float,
                            help="alpha of --dpo-f-divergence alpha_divergence")
    discopop_tau: float = option(0.05, flags=("--dpo-discopop-tau",), type=positive_float,
                                 help="DiscoPOP's tau (--dpo-loss discopop)")
    ld_alpha: Optional[float] = option(None, flags=("--dpo-ld-alpha",), type=unit_interval,
                                       help="LD-DPO (TRL's ld_alpha, in [0, 1]): each completion's tokens past the "
                                            "pair's shorter completion count this much in its log-probability (policy "
                                            "and reference)")
    use_weighting: bool = option(False, flags=("--dpo-use-weighting",),
                                 help="WPO (TRL's use_weighting): weigh each pair's losses by how likely the policy "
                                      "finds its two completions (their mean token log-probability less log sum p^2, "
                                      "exponentiated)")
    simpo_gamma: float = option(0.5, flags=("--dpo-simpo-gamma",), type=nonneg_float,
                                help="SimPO's target reward margin gamma (--dpo-loss simpo; TRL's simpo_gamma)")

    def __post_init__(self):
        self.weights = self.weights or (1.0,) * len(self.losses)

    @property
    def reference_free(self) -> Optional[str]:
        """The reference-free loss (cpo, simpo or orpo) when there is one: then no reference pass runs."""
        return next((name for name in self.losses if name in REFERENCE_FREE), None)

    def check(self, run) -> None:
        losses, smoothing, weights, named = self.losses, self.label_smoothing, self.weights, ",".join(self.losses)
        if len(weights) != len(losses):
            raise ConfigError(f"--dpo-loss-weights has {len(weights)} weights for the {len(losses)} losses of "
                              f"--dpo-loss {named}; give one each")
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
        if self.ld_alpha is not None and free:
            raise ConfigError(f"--dpo-ld-alpha weighs the log-ratios to the reference; --dpo-loss {free[0]} has none "
                              "(TRL's CPOTrainer and ORPOTrainer take no ld_alpha); drop one of them")
        if self.use_weighting and (free or "sft" in losses):
            raise ConfigError(f"--dpo-use-weighting weighs pair losses against the reference; --dpo-loss {named} has "
                              f"{free[0] if free else 'sft'}, a term it does not weigh per pair here; drop one of them")
        if self.use_weighting and run.fusions.cross_entropy_loss_fusion:
            raise ConfigError("--dpo-use-weighting reads the logits, which --cross-entropy-loss-fusion never holds; "
                              "drop one of them (the Qwen launchers: CE_FUSION=0)")
        others = sorted(set(losses) - set(F_DIVERGENCE_LOSSES))
        if self.f_divergence != "reverse_kl" and others:
            raise ConfigError(f"--dpo-f-divergence {self.f_divergence} does not go with --dpo-loss "
                              f"{','.join(others)} (f-DPO generalises {', '.join(F_DIVERGENCE_LOSSES)} only)")
        super().check(run)


@dataclasses.dataclass
class KTOConfig(PreferenceConfig):
    NAME: ClassVar[str] = "kto"
    loss: str = option("kto", flags=("--kto-loss",), choices=KTO_LOSSES,
                       help="TRL's KTOTrainer loss_type: kto (rewards against the batch's KL estimate) or "
                            "apo_zero_unpaired (no KL estimate)")
    desirable_weight: float = option(1.0, flags=("--kto-desirable-weight",), type=positive_float,
                                     help="the weight of desirable examples' losses (TRL's desirable_weight)")
    undesirable_weight: float = option(1.0, flags=("--kto-undesirable-weight",), type=positive_float,
                                       help="the weight of undesirable examples' losses (TRL's undesirable_weight)")

    def check(self, run) -> None:
        super().check(run)
        if self.loss == "kto" and run.training.micro_batch_size < 2:
            raise ConfigError("--objective kto pairs each example's prompt with another completion of its micro-batch "
                              "for the KL estimate (TRL's per_device_train_batch_size), so --micro-batch-size 1 has "
                              "none; use 2 or more, or --kto-loss apo_zero_unpaired")


@dataclasses.dataclass
class RewardConfig(PreferenceConfig):
    NAME: ClassVar[str] = "reward"
    HEAD: ClassVar[str] = "score"  # a score head in the output layer's place
    center_rewards_coefficient: Optional[float] = option(
        None, type=nonneg_float, help="--objective reward: add this x (r_chosen + r_rejected)^2, centring the rewards "
                                      "(TRL's)")

    def check(self, run) -> None:
        super().check(run)
        if run.fusions.cross_entropy_loss_fusion:
            raise ConfigError("--cross-entropy-loss-fusion does not go with --objective reward (a reward model has no "
                              "vocabulary output); drop it")


CONFIGS = {cls.NAME: cls for cls in (SFTConfig, DPOConfig, KTOConfig, RewardConfig)}
SECTIONS = (Choice, *CONFIGS.values())  # the flags (a base's field, shared, is one flag)


def chosen(sections: dict, data) -> ObjectiveConfig:
    """--objective's section among a command line's (``sections``: by class), its defaults applied to the data
    section; checked by ``check(run)``."""
    name = sections[Choice].objective
    if sections[RewardConfig].center_rewards_coefficient is not None and name != "reward":
        raise ConfigError("--center-rewards-coefficient is for --objective reward; drop it")
    section = sections[CONFIGS[name]]
    section.defaults(data)
    return section
