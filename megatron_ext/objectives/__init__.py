"""What a run trains for, behind one interface (``base.Objective``): SFT, DPO with its reference-free variants, KTO
and reward models (``--objective``), or a family's own loss (``base.FamilyStep``: GPT-2's, ViT's). ``SECTIONS``:
their options (torch-free, for the command line); ``REGISTRY``: name -> class, imported on first use."""

from megatron_ext.objectives.config import CONFIGS, SECTIONS, from_args

__all__ = ("CONFIGS", "SECTIONS", "REGISTRY", "from_args")


def __getattr__(name: str):
    if name == "REGISTRY":  # (the objectives import torch; the command line does not)
        from megatron_ext.objectives import dpo, kto, reward, sft

        return {"sft": sft.SFT, "dpo": dpo.DPO, "kto": kto.KTO, "reward": reward.Reward}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
