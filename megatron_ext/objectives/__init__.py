"""What a run trains for, behind ``base.Objective``: SFT, DPO (and reference-free variants), KTO, reward models
(``--objective``) or a family's own loss. ``SECTIONS``: their options (torch-free); ``REGISTRY``: name -> class."""

from megatron_ext.objectives.config import CONFIGS, SECTIONS, chosen

__all__ = ("CONFIGS", "SECTIONS", "REGISTRY", "chosen")


def __getattr__(name: str):
    if name == "REGISTRY":  # imported on first use: the objectives import torch, the command line does not
        from megatron_ext.objectives import dpo, kto, reward, sft

        return {"sft": sft.SFT, "dpo": dpo.DPO, "kto": kto.KTO, "reward": reward.Reward}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
