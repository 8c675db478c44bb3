"""The peers the benchmarks train beside ours, in the same process, on the same device, batches and dtype.

``train_peer`` is the loop every peer shares (bench_qwen.py's, bench_gpt.py's, bench_vit.py's). The Qwen peers
(``run_qwen_peer``, ``--baseline hf liger``) are the family's own transformers class (Qwen2, Qwen2-MoE, Qwen3,
Qwen3-MoE with its grouped_mm experts on CUDA) built from our shape:
- ``hf``: plain transformers ("transformers"), or PEFT LoRA on it when our run has LoRA ("peft");
- ``liger``: the same with Liger kernels applied as TRL's and transformers' ``use_liger_kernel`` does (RoPE, RMSNorm,
  SwiGLU, fused linear cross-entropy on the model instance; the loss through its forward with labels, so FLCE runs),
  "transformers+liger" / "peft+liger". Liger patches transformers' modules for the rest of the process, so it runs
  after the plain peer (``PEERS``' order).
A peer that cannot run here comes back as ``skipped`` with the reason, never as an error.
"""

from __future__ import annotations

import gc
import importlib
import re
import traceback
from types import SimpleNamespace
from typing import Callable, Optional

PEERS = ("hf", "liger")  # --baseline's peers, in the order they run
LIGER = {"qwen2": "apply_liger_kernel_to_qwen2", "qwen3": "apply_liger_kernel_to_qwen3",
         "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}  # liger_kernel.transformers' patch of each family
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def short(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return SHORT.get(name, name)


def our_numerics(run, dtype) -> str:
    """What our side computes and keeps: half-precision compute over fp32 master weights and Adam states, from the
    run's dtype, engine and LoRA (only the adapters train then)."""
    flags = run.flags()
    engine = "megatron-core" if flags.get("engine", "megatron") == "megatron" else \
        f"DeepSpeed ZeRO-{flags.get('zero_stage')}"
    d = short(dtype)
    trained = f"adapters ({d} frozen base)" if run.lora is not None else "weights"
    if d == "fp32":
        return f"fp32 {trained} and Adam states ({engine})"
    return f"{d} compute, fp32 master {trained} and Adam states ({engine})"


def peer_numerics(model) -> str:
    """What a peer keeps, read from its parameters: torch AdamW's states take each parameter's dtype."""
    trained = sorted({short(p.dtype) for p in model.parameters() if p.requires_grad})
    frozen = sorted({short(p.dtype) for p in model.parameters() if not p.requires_grad})
    if not frozen:
        return f"{'/'.join(trained)} weights and AdamW states"
    return f"{'/'.join(frozen)} frozen weights, {'/'.join(trained)} adapters and AdamW states"


def reset_peak_memory(device) -> None:
    """Free what the previous run left and restart the peak, so the baseline's peak is its own. On CPU the peak is
    the process's maximum RSS, which Linux restarts through /proc/self/clear_refs; elsewhere it keeps the old peak."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def train_peer(run, device, steps: int, model_class, config, batches, micro_loss,
               prepare: Optional[Callable] = None) -> dict:
    """The peer's optimizer steps, the way ours runs them: the run's dtype and seed, gradient checkpointing with
    full recompute, torch AdamW (fused on CUDA) over the trainable parameters with the run's lr, weight decay, betas
    and clipping, gradient accumulation over ``batches(step)``'s micro-batches, ``micro_loss(model, micro)`` each;
    ``prepare(model)`` (Liger, PEFT) returns the model to train. Returns the class, step times, losses, peak memory,
    parameter counts (all, trainable) and the numerics."""
    import torch

    from megatron_ext.observability.metrics import StepTimer, memory_stats
    from megatron_ext.models.spec import params_dtype

    args = SimpleNamespace(**run.flags())  # flag values by name
    reset_peak_memory(device)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = model_class._from_config(config, dtype=params_dtype(run))
    if args.recompute_granularity == "full":
        model.gradient_checkpointing_enable()
    if prepare is not None:
        model = prepare(model)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    settings = run.optimizer  # the run's own (a --adam-beta2 given reaches the peer too)
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay,
                                  betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps,
                                  fused=device.type == "cuda")
    timer = StepTimer(device)
    step_times, losses = [], []
    for step in range(1, steps + 1):
        timer.start()
        microbatches = batches(step)  # timed, as our loop's data region is
        loss_sum = 0.0
        for micro in microbatches:
            loss = micro_loss(model, micro) / len(microbatches)
            loss.backward()
            loss_sum += loss.detach()
        if settings.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(trainable, settings.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(timer.lap())
        losses.append(float(loss_sum))
    return dict(model_class=model_class.__name__, step_times=step_times, losses=losses,
                mem_peak=memory_stats(device)["mem_peak"],
                parameters=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in trainable),
                numerics=peer_numerics(model))


def train_lm_peer(run, device, steps: int, model_class, config, prepare: Optional[Callable] = None) -> dict:
    """``train_peer`` on the batches --mock-data feeds ours at each step; loss = the causal LM's own mean
    next-token cross entropy (``labels=input_ids``, through the model's forward: Liger's fused one when patched)."""
    from megatron_ext.data import synthetic

    args = SimpleNamespace(**run.flags())  # flag values by name

    def batches(step):  # what --mock-data feeds megatron_ext at this step
        return synthetic.global_batch(step, seed=args.seed, global_batch_size=args.global_batch_size,
                                      micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                      vocab_size=run.shape.vocab_size)

    def micro_loss(model, micro):
        tokens = micro["tokens"].to(device)
        return model(input_ids=tokens, labels=tokens).loss

    return train_peer(run, device, steps, model_class, config, batches, micro_loss, prepare)


def qwen_model(run, device):
    """transformers' class of the shape's family and its config (models/qwen/hf.py's fields: Qwen3's head dimension
    and query/key norms, the MoE fields), SDPA attention; MoE: the run's load-balancing loss, and on CUDA the
    grouped_mm experts, the faster of transformers' implementations there."""
    import transformers

    from megatron_ext.models.qwen.hf import HF_CLASSES, config_fields

    args, shape = SimpleNamespace(**run.flags()), run.shape
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[shape.model_type])
    fields = dict(config_fields(shape), max_position_embeddings=max(shape.max_position_embeddings, args.seq_length),
                  attn_implementation="sdpa", use_cache=False)
    if shape.moe is not None:
        fields.update(output_router_logits=bool(args.moe_aux_loss_coeff), router_aux_loss_coef=args.moe_aux_loss_coeff)
        if device.type == "cuda":
            fields["experts_implementation"] = "grouped_mm"
    return model_class, config_class(**fields)


def peft_targets(shape, lora) -> list:
    """PEFT's ``target_modules`` for our LoRA targets: the Hugging Face linears each targeted linear of ours is made
    of (the family's name table: qkv -> q_proj,k_proj,v_proj; fc1 -> gate_proj,up_proj; ...)."""
    from megatron_ext.models.lora import TARGETS
    from megatron_ext.models.qwen.hf import rules

    ours = re.compile(r"decoder\.layers\.\d+\.(%s)\.weight" % "|".join(re.escape(TARGETS[t]) for t in lora.targets))
    return sorted({name.rsplit(".", 2)[-2] for rule in rules(shape) if ours.fullmatch(rule.mcore) for name in rule.hf})


def side_name(kind: str, lora) -> str:
    return ("peft" if lora is not None else "transformers") + ("+liger" if kind == "liger" else "")


def unavailable(kind: str, run, device) -> Optional[str]:
    """Why peer ``kind`` cannot run here, or None."""
    shape, lora = run.shape, run.lora
    if lora is not None and shape.moe is not None and {"fc1", "fc2"} & set(lora.targets):
        return "LoRA on routed experts: PEFT adapts expert parameters by name (target_parameters); no peer built"
    if kind != "liger":
        return None
    if device.type != "cuda":
        return f"liger-kernel's Triton kernels need a CUDA device; this run is on {device.type}"
    if shape.model_type not in LIGER:
        return f"liger-kernel patches {', '.join(LIGER)} models, not {shape.model_type}"
    for module in ("triton", "liger_kernel.transformers"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"{module} is not importable ({e}); install liger-kernel==0.8.5 (pyproject's gpu extra)"
    return None


def run_qwen_peer(run, device, steps: int, kind: str) -> dict:
    """Peer ``kind`` of a Qwen run on the batches --mock-data fed ours: its side name and ``train_lm_peer``'s
    result, or ``skipped`` with the reason (out of memory or a failure included: ours is measured already)."""
    side = side_name(kind, run.lora)
    reason = unavailable(kind, run, device)
    if reason:
        return dict(side=side, skipped=reason)
    shape, lora = run.shape, run.lora

    def prepare(model):
        if kind == "liger":
            import liger_kernel.transformers as liger

            getattr(liger, LIGER[shape.model_type])(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                                    fused_linear_cross_entropy=True, model=model)
        if lora is None:
            return model
        from peft import LoraConfig, get_peft_model

        if run.flags()["recompute_granularity"] == "full":
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still get a grad input
        return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                target_modules=peft_targets(shape, lora), task_type="CAUSAL_LM"))

    try:
        return dict(side=side, **train_lm_peer(run, device, steps, *qwen_model(run, device), prepare=prepare))
    except Exception as e:  # noqa: BLE001 (a GPU window's rows of ours must still be written)
        traceback.print_exc()
        name = "out of memory" if "OutOfMemoryError" in type(e).__name__ else f"failed: {type(e).__name__}"
        return dict(side=side, skipped=f"{name}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    finally:
        reset_peak_memory(device)
