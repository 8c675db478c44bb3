"""``--objective dpo``: Direct Preference Optimization on the same engines as SFT (``training/dpo.py``). Torch-free,
like ``arguments``: every check runs before any process group exists."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import fraction, positive_float, shipped

LOSSES = ("sigmoid", "ipo", "hinge")


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    loss: str = "sigmoid"  # TRL's loss_type: sigmoid (DPO; cDPO with label smoothing), ipo, hinge
    label_smoothing: float = 0.0


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("objective (SFT, or DPO on preference pairs)")
    g.add_argument("--objective", default="sft", choices=["sft", "dpo"],
                   help="sft: next-token loss on the assistant's turns; dpo: preference pairs (prompt, chosen, "
                        "rejected) against the starting model, TRL's definitions")
    g.add_argument("--dpo-beta", type=positive_float, default=0.1, help="DPO's beta (IPO's tau)")
    g.add_argument("--dpo-loss", default="sigmoid", choices=LOSSES, help="TRL's loss_type")
    g.add_argument("--dpo-label-smoothing", type=fraction, default=0.0,
                   help="conservative DPO (cDPO): the probability that a pair's labels are flipped, in [0, 0.5)")


SFT_SAMPLE, PREFERENCE_SAMPLE = (shipped("examples/data/metamathqa_sample.jsonl"),
                                 shipped("examples/data/preference_sample.jsonl"))


def apply_defaults(args: argparse.Namespace) -> None:
    """DPO reads preference pairs: the shipped sample unless --data-path names data (one file or data set)."""
    if getattr(args, "objective", "sft") != "dpo":
        return
    if args.data_path == [SFT_SAMPLE]:
        args.data_path = [PREFERENCE_SAMPLE]
    if len(args.data_path) != 1:
        raise ConfigError("--objective dpo reads one --data-path (a file or data set of pairs), not a mixture")


def settings_from_args(args: argparse.Namespace) -> Optional[DPOSettings]:
    """The DPO settings, or None for SFT; one line naming the flag for what DPO cannot take."""
    if args.objective != "dpo":
        return None
    if not 0.0 <= args.dpo_label_smoothing < 0.5:
        raise ConfigError(f"--dpo-label-smoothing {args.dpo_label_smoothing}: must be in [0, 0.5)")
    if args.dpo_label_smoothing and args.dpo_loss != "sigmoid":
        raise ConfigError(f"--dpo-label-smoothing applies to --dpo-loss sigmoid (cDPO), not {args.dpo_loss}")
    for flag, value, why in (("--mock-data", args.mock_data, "preference pairs come from --data-path"),
                             ("--pack-sequences", args.pack_sequences, "each pair is its own two rows"),
                             ("--eval-generate-samples", args.eval_generate_samples, "DPO evaluates pairs")):
        if value:
            raise ConfigError(f"{flag} does not go with --objective dpo ({why}); drop it")
    if args.engine == "deepspeed" and args.pipeline_model_parallel_size > 1:
        raise ConfigError("--objective dpo under DeepSpeed's pipeline engine is not supported (its schedule owns the "
                          "loss); use --engine megatron for pipeline parallelism")
    return DPOSettings(beta=args.dpo_beta, loss=args.dpo_loss, label_smoothing=args.dpo_label_smoothing)
