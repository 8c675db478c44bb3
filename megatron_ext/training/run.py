"""Everything between a parsed command line and the loop that does not depend on the model family:
engine, initialisation, resume, loggers, MFU settings. Entry scripts supply the model builder and the data."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_ext.arguments import RunConfig
from megatron_ext.config.engine import Engine
from megatron_ext.config.training import Fusions, Training
from megatron_ext.convert import source as pretrained_source
from megatron_ext.engines.megatron import MegatronEngine, build_model_chunks
from megatron_ext.engines.optimizer import OptimizerSettings
from megatron_ext.errors import ConfigError
from megatron_ext.models import lora
from megatron_ext.models.hf_rules import read_json
from megatron_ext.models.qwen.config import Adapters
from megatron_ext.models.init import init_mesh_independent, initial_value
from megatron_ext.models.spec import compile_layers, params_dtype
from megatron_ext.objectives.base import Objective, print_rank0
from megatron_ext.observability import flops
from megatron_ext.observability.loggers import MetricsLogger
from megatron_ext.observability.metrics import device_memory_capacity
from megatron_ext import checkpoint
from megatron_ext.checkpoint import files
from megatron_ext.checkpoint.writer import budget_warning
from megatron_ext.training.loop import LoopSettings, is_logging_rank, train


def moe_experts(config) -> Optional[str]:
    """Which routed-expert implementation an MoE model runs (summary.json's run.experts)."""
    if not getattr(config, "num_moe_experts", None):
        return None
    return "grouped (torch._grouped_mm)" if config.moe_grouped_gemm else "sequential (SequentialMLP)"


def start(run: RunConfig) -> torch.device:
    """Process groups for the validated mesh, then a hub --pretrained fetched once per node (its tokenizer, when
    that is the run's, read from the local snapshot); returns this rank's device."""
    from megatron_ext import parallel

    device = parallel.init_distributed(run.parallel.distributed_backend, run.reliability.distributed_timeout_minutes)
    parallel.init_model_parallel(run.mesh, run.training.seed)
    from megatron_ext.convert.pretrained import resumes

    source = run.pretrained.source
    if source is not None and not resumes(run.checkpoint):
        pretrained_source.fetch(source)
        if getattr(run.data, "tokenizer", None) == source.name:
            run.data.tokenizer = source.directory
    return device


def build_engine(chunks, device, step_func, *, mesh, engine: Engine, training: Training,
                 optimizer: OptimizerSettings, fusions: Optional[Fusions] = None, initial_values=None,
                 rows_per_sample: int = 1):
    """The megatron-core engine, DeepSpeed's (ZeRO) or FSDP2 around the same chunks, built from the run's sections
    (``RunConfig.engine_sections``; tests and benchmarks pass their own): one interface for the loop.
    ``step_func``: the objective's forward step; ``rows_per_sample``: sequences a sample puts in a micro-batch
    (DPO: 2), which megatron-core's pipeline buffers are shaped by (``objectives/base.py``)."""
    fusions = fusions or Fusions()
    if fusions.compile_layers:  # before any engine wraps or shards the layers (torchtitan's order)
        compile_layers(chunks)
    if engine.engine == "megatron":
        return MegatronEngine(chunks, device=device, settings=optimizer,
                              use_distributed_optimizer=engine.use_distributed_optimizer,
                              micro_batch_size=training.micro_batch_size * rows_per_sample,
                              seq_length=training.seq_length,
                              gradient_accumulation_fusion=fusions.gradient_accumulation_fusion and
                              not fusions.compile_layers,  # (its backward's main_grad update breaks the graphs)
                              step_func=step_func, ddp_bucket_size=engine.ddp_bucket_size)
    if engine.engine == "fsdp":
        from megatron_ext.engines.fsdp import FSDPEngine

        return FSDPEngine(chunks, device=device, settings=optimizer, step_func=step_func, seed=training.seed,
                          initial_values=initial_values,
                          compute_dtype=torch.bfloat16 if training.bf16 else torch.float32)
    from megatron_ext.engines import deepspeed as ds

    if training.fp16 and device.type != "cuda":
        raise ConfigError("--fp16 with --engine deepspeed needs a GPU (DeepSpeed's CPU accelerator has bf16 and "
                          "fp32 only); use --bf16 or --engine megatron")

    zero = ds.zero_config(stage=engine.zero_stage, offload_optimizer=engine.offload_optimizer,
                          offload_param=engine.offload_param, offload_path=engine.offload_path,
                          hpz_partition_size=engine.zero_hpz_partition_size,
                          quantized_weights=engine.zero_quantized_weights,
                          quantized_gradients=engine.zero_quantized_gradients, on_cuda=device.type == "cuda")
    config = ds.deepspeed_config(micro_batch_size=training.micro_batch_size,
                                 global_batch_size=training.global_batch_size, settings=optimizer, zero=zero,
                                 bf16=training.bf16, fp16=training.fp16, user_config=engine.deepspeed_config)
    if mesh.pp > 1:
        from megatron_ext.engines.deepspeed_pipe import DeepSpeedPipelineEngine

        return DeepSpeedPipelineEngine(chunks, device=device, settings=optimizer, ds_config=config,
                                       step_func=step_func)  # (its schedule runs the language model's loss)
    return ds.DeepSpeedEngine(chunks, device=device, settings=optimizer, ds_config=config, step_func=step_func)


# The flags that decide which samples a step reads: a checkpoint records them, a resume says which changed.
DATA_FLAGS = ("data_path", "train_data_path", "mock_data", "seq_length", "global_batch_size", "seed", "pack_sequences",
              "data_split", "rampup_batch_size")


def data_flags(run: RunConfig) -> dict:
    flags = run.flags()
    return {name: flags[name] for name in DATA_FLAGS if name in flags}


def data_changes(saved: dict, run: RunConfig) -> str:
    """What a resume changed of the data, as flags (``--seed 7 (the checkpoint's: 1234)``), or ''."""
    now = data_flags(run)
    return ", ".join(f"--{k.replace('_', '-')} {now[k]} (the checkpoint's: {v})" for k, v in (saved or {}).items()
                     if k in now and now[k] != v)


def run_mesh(mesh) -> dict:
    """The mesh as a run records it; expert TP only where there are experts to split."""
    sizes = dataclasses.asdict(mesh)
    return sizes if mesh.ep > 1 else {k: v for k, v in sizes.items() if k != "etp"}


def trace_metadata(run: RunConfig) -> dict:
    """What a trace says about its rank: the mesh and this rank's place in it (tools/merge_traces.py names rows
    with it), and the engine."""
    from megatron.core import parallel_state as ps

    mesh = run.mesh
    return dict(engine=run.engine.engine, model=run.label, mesh=dict(
        tp=mesh.tp, pp=mesh.pp, dp=mesh.dp, cp=mesh.cp, ep=mesh.ep, vpp=mesh.vpp, sp=mesh.sequence_parallel),
        coords=dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                    dp=ps.get_data_parallel_rank(), cp=ps.get_context_parallel_rank()))


def _starting_point(run: RunConfig):
    """(a Hugging Face --pretrained source, or None; one of our checkpoints to take the weights of, or None)."""
    from megatron_ext.convert import pretrained

    source, resumes, load = run.pretrained.source, pretrained.resumes(run.checkpoint), run.checkpoint.load
    base = files.saved_common(load).get("lora_base") if resumes else None
    if base is not None:  # a LoRA run's checkpoint holds its adapters: the frozen base comes from where it began
        _check_lora_base(run, source, base)
        return (None, source.directory) if source is not None and source.kind == "ours" else (source, None)
    if source is not None and resumes:
        print_rank0(f"megatron_ext: --load {load} holds a checkpoint of this run: resuming it, --pretrained "
                    f"{source.name} is not read")
        return None, None
    root = source.directory if source is not None and source.kind == "ours" else \
        load if load and run.checkpoint.finetune else None
    if root is not None and files.saved_common(root).get("lora_base"):
        flag = f"--pretrained {root}" if source is not None else f"--load {root} --finetune"
        raise ConfigError(f"{flag}: a LoRA run's checkpoint holds its adapters, not the model; resume it with its "
                          "own flags, or export it first (tools/convert_mcore_to_hf.py)")
    return (None, root) if root is not None else (source, None)


def lora_base(run: RunConfig, source) -> dict:
    """What a LoRA run's base is (recorded in its checkpoints, which leave the base out)."""
    return dict(pretrained=source.name if source is not None else None, seed=run.training.seed,
                directory=os.path.abspath(source.directory) if source is not None and source.directory else None,
                revision=os.path.basename(source.directory) if source is not None and source.kind == "hub" else None)


def _check_lora_base(run: RunConfig, source, base: dict) -> None:
    """Resuming a LoRA run: the same base, or one line."""
    load = run.checkpoint.load
    if base["pretrained"] is None and source is None:
        if run.training.seed != base["seed"]:
            raise ConfigError(f"--load {load}: this LoRA run's base is the random init of --seed {base['seed']}; "
                              f"resume with --seed {base['seed']}")
        return
    if source is None:
        raise ConfigError(f"--load {load} holds the LoRA adapters of a run from --pretrained "
                          f"{base['pretrained']}; resume with --pretrained {base['pretrained']}")
    if base["pretrained"] is None or source.name != base["pretrained"]:
        raise ConfigError(f"--load {load} holds LoRA adapters for --pretrained {base['pretrained'] or 'none'}, "
                          f"not {source.name}; resume with the base it was trained on")
    if base.get("revision") and source.kind == "hub" and source.directory and \
            os.path.basename(source.directory) != base["revision"]:
        raise ConfigError(f"--pretrained {source.name} is now revision {os.path.basename(source.directory)}, but "
                          f"--load {load} holds adapters for revision {base['revision']}; use that revision "
                          "(a local copy of it as --pretrained)")


def _build_chunks(run: RunConfig, build_chunk, model_meta: dict, new_head):
    """The model chunks with their first weights, before any engine wraps them (an optimizer keeping fp32 master
    copies then starts from them); returns (chunks, the values FSDP shards itself, or None).

    Built on the meta device under FSDP (the engine fills each rank's shards), partitioned over DP under ZeRO-3
    (``deepspeed.zero.Init``, filled one parameter at a time), else whole on each rank. The weights are a
    mesh-independent random init, a Hugging Face --pretrained streamed in, or one of our checkpoints."""
    from megatron_ext.convert import pretrained

    mesh = run.mesh
    source, root = _starting_point(run)
    deferred = run.engine.engine == "fsdp"
    partitioned = run.engine.engine == "deepspeed" and run.engine.zero_stage == 3 and run.lora is None and root is None
    if deferred and root is not None:
        raise ConfigError("--engine fsdp starts from a random init or a Hugging Face --pretrained; for one of "
                          "our checkpoints export it first (tools/convert_mcore_to_hf.py)")
    if deferred:
        context = torch.device("meta")
    elif partitioned:
        from megatron_ext.engines.deepspeed import partitioned_construction

        context = partitioned_construction(params_dtype(run), run.engine.offload_param)
    else:
        context = contextlib.nullcontext()
    with context:
        chunks = build_model_chunks(build_chunk, mesh.vpp)
    value = None
    if source is not None:
        start = time.perf_counter()
        pretrained_source.fetch(source)
        weights = pretrained.HFWeights(source.directory, type(run.shape)(**model_meta["model_shape"]),
                                       run.training.seed,
                                       source.name, first_layers=run.pretrained.first_layers)
        value, fresh = pretrained.values(weights, chunks, set(new_head))
    elif partitioned:
        value = functools.partial(_initial_value, seed=run.training.seed)
    if deferred:
        pass  # the engine fills each rank's shards
    elif partitioned:
        from megatron_ext.engines.deepspeed import fill_partitioned

        fill_partitioned(chunks, value)
    else:
        init_mesh_independent(chunks, run.training.seed, value)
    if source is not None:
        how = " (upcycled to MoE while loading)" if weights.upcycled else ""
        print_rank0(f"megatron_ext: weights from --pretrained {source.name}{how} in "
                    f"{time.perf_counter() - start:.1f}s{pretrained.describe(fresh)}")
    if root is not None:  # one of our checkpoints: weights only, any mesh
        fresh = checkpoint.load_weights(root, chunks, model_meta.get("model_shape"), replaceable=set(new_head))
        if new_head:  # the head lives on the last pipeline stage; rank 0 reports
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, fresh)
            fresh = sorted(set(sum(everyone, [])))
        new = f"; new, zero-initialised: {', '.join(fresh)}" if fresh else ""
        flag = f"--pretrained {root}" if root != run.checkpoint.load else f"--load {root} (--finetune)"
        print_rank0(f"megatron_ext: weights from {flag}{new}")
    return chunks, value if deferred else None


def _initial_value(gname, name, param, chunk, seed):
    return initial_value(gname, name, param, chunk, seed, param.device)


def build_model(run: RunConfig, *, device: torch.device, build_chunk: Callable[..., torch.nn.Module],
                model_meta: dict, objective: Objective):
    """The engine around the model as a run starts it (its outputs checked, its weights loaded, LoRA applied) for
    ``objective`` (its step, rows per sample, new head): ``run_training``'s, and ``tools/verify_model.py``'s.
    Returns (engine, chunks, model_meta as checkpoints record it)."""
    adapter = run.section(Adapters) or Adapters()  # (a family without PEFT adapters: none)
    source = run.pretrained.source
    if source is not None and source.config_path and not model_meta.get("hf_config"):
        model_meta = dict(model_meta, hf_config=read_json(source.config_path, f"--pretrained {source.name}"))
    if run.pretrained.save_hf:  # a model no Hugging Face class holds is refused now, not after training
        from megatron_ext.convert import export

        export.check_exportable(model_meta, export.export_dtype(run))
    # A --save DIR holding checkpoints this run does not resume is refused before anything is built.
    files.check_save_dir(run.checkpoint.save, load=run.checkpoint.load, finetune=run.checkpoint.finetune,
                              model_shape=model_meta.get("model_shape"))
    files.check_shared(run.checkpoint.save, "--save", in_parent=False)  # every node writes there: no node-local disks
    files.check_shared(run.pretrained.save_hf, "--save-hf")  # beside it: DIR.partial, renamed into place
    files.check_shared(adapter.save_peft, "--save-peft")
    chunks, initial_values = _build_chunks(run, build_chunk, model_meta, objective.new_head)
    if run.lora is not None:  # after loading the plain weights, before the engine sees which ones train
        lora.apply(chunks, run.lora, run.training.seed)
        # checkpoints leave the frozen base out: they say where it is
        model_meta = dict(model_meta, lora=dataclasses.asdict(run.lora),
                          lora_base=lora_base(run, run.pretrained.source))
        adapter_values = None
        if adapter.pretrained_adapter:
            from megatron_ext.convert import adapters

            if run.engine.engine == "fsdp":  # on the meta device until the engine shards it
                adapter_values = adapters.values(adapter.pretrained_adapter, run.lora, model_meta)
            else:
                adapters.load(chunks, adapter.pretrained_adapter, run.lora, model_meta)
            print_rank0(f"megatron_ext: adapters from --pretrained-adapter {adapter.pretrained_adapter} "
                        f"(r={run.lora.rank}, {','.join(run.lora.targets)})")
        if run.engine.engine == "fsdp":  # the adapters are drawn (or read) with the base, each rank its shards
            initial_values = lora.initial_values(run.training.seed, initial_values, adapter_values)
        print_rank0(f"megatron_ext: {lora.trainable_summary(chunks)}")
    engine = build_engine(chunks, device, objective.step_func, initial_values=initial_values,
                          rows_per_sample=objective.rows_per_sample, **run.engine_sections())
    return engine, chunks, model_meta


def run_training(run: RunConfig, *, device: torch.device, build_chunk: Callable[..., torch.nn.Module], data,
                 flops_per_token: float, model_meta: dict, objective: Objective,
                 eval_metrics=None) -> List[dict]:
    """Build the engine around ``build_chunk(pre_process, post_process, vp_stage)``, resume if asked, train for
    ``objective`` (``objectives/base.py``: its step, rows per sample, FLOPs scale, new head: parameters --finetune
    starts afresh, at zero, when --load lacks them or holds another shape; what it computes from the starting
    weights). ``model_meta`` (``model_shape``, ``params_dtype``, ``hf_config``) goes into every checkpoint.
    ``eval_metrics(engine, step)``: what each evaluation adds (``LoopSettings``)."""
    mesh, training, checkpoint = run.mesh, run.training, run.checkpoint
    adapter = run.section(Adapters) or Adapters()
    rows = objective.rows_per_sample
    engine, chunks, model_meta = build_model(run, device=device, build_chunk=build_chunk, model_meta=model_meta,
                                             objective=objective)
    print_rank0(f"megatron_ext: {mesh.describe()} on {device.type} ({dist.get_backend()}), "
                f"{sum(getattr(p, 'ds_numel', p.numel()) for c in chunks for p in c.parameters()):,} parameters "
                "on rank 0")
    if device.type == "cuda" and not all(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")):
        print_rank0("megatron_ext: torch stand-ins for the TransformerEngine/apex kernels megatron-core would use "
                    "(megatron_ext/platform/kernels.py)")

    line = objective.before_training(engine, data, model_meta)  # from the starting weights: before a checkpoint
    if line:
        print_rank0(line)
    start = 0
    if checkpoint.load and not checkpoint.finetune:
        state = engine.load_checkpoint(checkpoint.load, mesh=dataclasses.asdict(mesh),
                                       model_shape=model_meta.get("model_shape"))
        if state is None:
            print_rank0(f"megatron_ext: no checkpoint in --load {checkpoint.load} yet; starting from scratch")
        else:
            start = state["iteration"]
            data.load_state_dict(state["data"])
            print_rank0(f"megatron_ext: resumed from --load {checkpoint.load} at step {start}")
            changed = data_changes(state.get("data_flags"), run)
            if changed:
                print_rank0(f"megatron_ext: resuming with {changed}: the data goes on from the checkpoint's position "
                            "in this run's order (samples may repeat or be skipped)")
            warning = budget_warning(checkpoint.load, run.reliability.exit_duration_mins) if dist.get_rank() == 0 \
                else None
            if warning:
                print_rank0(warning)

    samples = "images" if model_meta.get("model_type") == "vit" else "samples"  # what throughput counts
    step_metrics = None
    if getattr(chunks[0].config, "num_moe_experts", None):
        from megatron_ext.models.moe import RouterStats

        step_metrics = RouterStats(chunks, chunks[0].config.num_layers, run.num_microbatches)
    settings = LoopSettings(
        train_iters=training.train_iters, tokens_per_step=training.global_batch_size * training.seq_length * rows,
        samples_per_step=training.global_batch_size, samples=samples,
        flops_per_token=flops_per_token * objective.flops_scale,
        peak_flops=flops.peak_flops(device, training.compute_dtype, run.logging.peak_tflops),
        eval_interval=training.eval_interval, eval_iters=training.eval_iters, save=checkpoint.save,
        save_interval=checkpoint.save_interval, async_save=checkpoint.async_save,
        exit_interval=training.exit_interval,
        checkpoint_extra=dict(mesh=dataclasses.asdict(mesh), data_flags=data_flags(run), **model_meta),
        step_metrics=step_metrics,
        eval_metrics=eval_metrics,
        profile=run.profile if run.profile.enabled else None, trace_metadata=trace_metadata(run),
        reliability=run.reliability,
        gc_interval=training.gc_interval)
    batching = dict(micro_batch_size=training.micro_batch_size, num_microbatches=run.num_microbatches,
                    memory_capacity=device_memory_capacity(device))
    log = run.logging
    logger = MetricsLogger(log.log_dir, log.tensorboard_dir, log.wandb_project, log.wandb_exp_name,
                           config=run.flags(), enabled=is_logging_rank() and training.train_iters > start,
                           total_steps=training.train_iters, resumed_at=start,
                           batching=batching, samples=samples, run_info=dict(
                               world_size=mesh.world, mesh=run_mesh(mesh), engine=run.engine.engine,
                               zero_stage=run.engine.zero_stage if run.engine.engine == "deepspeed" else None,
                               zeropp=run.engine.zeropp, model=run.label,
                               family=model_meta.get("model_type"), device=device.type,
                               experts=moe_experts(chunks[0].config)))
    with logger:
        records = train(engine, data, settings, logger, start_iteration=start)
    if training.train_iters <= start:  # (--train-iters 0: the starting point, exported)
        print_rank0(f"megatron_ext: no step to run (--train-iters {training.train_iters}, at step {start})")
    source = run.pretrained.source
    if adapter.save_peft:  # before --save-hf, which folds the adapters into the base
        from megatron_ext.convert import adapters, export

        print_rank0(adapters.save_peft(engine, adapter.save_peft, lora=run.lora, model_meta=model_meta,
                                       base=source.name if source is not None else None,
                                       dtype=export.export_dtype(run)))
    if run.pretrained.save_hf:  # the end of training or a graceful exit (signal, time limit): train returned
        from megatron_ext.convert import export

        print_rank0(export.save_hf(engine, run.pretrained.save_hf, model_meta=model_meta,
                                   dtype=export.export_dtype(run),
                                   tokenizer=getattr(run.data, "tokenizer", None), lora=run.lora is not None,
                                   source_dir=source.directory if source is not None and source.kind != "ours"
                                   else None))
    return records
