"""One process builds mesh after mesh, engine after engine, as a notebook or a sweep over layouts would: DP2 and TP2
on the megatron engine, ZeRO-1 on DeepSpeed's, FSDP2, then the world itself torn down and joined again. Every rank
records the first step's loss of each and the threads it holds after each teardown.

    python tests/support/teardown_worker.py OUT.json [megatron_core_only]

``megatron_core_only``: the deliberate mistake, megatron-core's own ``destroy_model_parallel`` between meshes (it
drops its references and leaves every group's threads running)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from support import engines, thread_guard  # noqa: E402
from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402
from support.parity_layouts import MICRO_BATCH, SEED, SEQ, SETTINGS, SHAPE, global_batch, my_microbatches  # noqa: E402

LAYOUTS = [("dp2", dict(), "megatron"), ("tp2", dict(tp=2), "megatron"), ("dp2_zero1", dict(), "deepspeed"),
           ("dp2_fsdp", dict(), "fsdp")]


def first_loss(sizes: dict, engine_name: str, device) -> float:
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent

    mesh = Mesh(world=dist.get_world_size(), **sizes)
    parallel.init_model_parallel(mesh, seed=SEED)
    config = qwen.transformer_config(SHAPE, mesh)
    chunk = qwen.build_qwen(config, SHAPE, vocab_size=qwen.padded_vocab_size(SHAPE.vocab_size, 128, mesh.tp))
    init_mesh_independent([chunk], SEED)
    engine = engines.build([chunk], device, forward_step, mesh, engine=engine_name, micro_batch_size=MICRO_BATCH,
                           global_batch_size=len(global_batch(0)) * MICRO_BATCH, seq_length=SEQ, **SETTINGS)
    loss = engine.forward_backward(my_microbatches(0, mesh))
    engine.optimizer_step()  # clipping and the update too: FSDP's redistributions made the planners that held its mesh
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, loss)
    return next(x for x in everyone if x is not None)


def gloo_threads() -> int:
    """Threads of live gloo groups (three per group), whatever else the process runs."""
    held = thread_guard.names()
    return held["pt_gloo_runloop"] + held["gloo_tcp_loop"]


def main(out_path: str, mistake: bool) -> None:
    device = parallel.init_distributed("gloo")
    dist.barrier()  # the world's gloo threads start with its first collective
    world_only, world_gloo = thread_guard.count(), gloo_threads()
    losses, threads, gloo = {}, {}, {}
    for name, sizes, engine_name in LAYOUTS:
        losses[name] = first_loss(sizes, engine_name, device)
        if mistake:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            import gc

            gc.collect()
        else:
            parallel.destroy_model_parallel()
        threads[name], gloo[name] = thread_guard.count(), gloo_threads()
    parallel.teardown()
    threads["teardown"] = thread_guard.count()
    parallel.init_distributed("gloo")  # a new world: the same rendezvous again
    losses["tp2_again"] = first_loss(dict(tp=2), "megatron", device)
    parallel.teardown()
    if os.environ.get("RANK", "0") == "0":
        with open(out_path, "w") as f:
            json.dump(dict(world_only=world_only, world_gloo=world_gloo, losses=losses, threads=threads,
                           gloo=gloo), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["megatron_core_only"])
