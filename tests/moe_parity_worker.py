"""MoE parity worker: expert-parallel layouts of the tiny Qwen2-MoE compared with one process (fp32).

The comparison machinery is ``parity_worker``'s (reference run, weights loaded into the shards, every gradient
gathered back to full shape, three optimizer steps); this module adds the MoE family: top-2 of 4 experts, a gated
shared expert, load-balancing and z-loss on, clipping active. Layout names carry what is not a ``Mesh`` size:
``allgather`` (dispatcher; else alltoall), ``distopt``, ``wrong`` (expert gradients reduced over the dense
data-parallel group instead of the expert-data-parallel one: must fail).

    python tests/moe_parity_worker.py reference OUT_DIR    (writes OUT_DIR/moe.pt)
    torchrun --nproc-per-node N tests/moe_parity_worker.py compare REF_DIR OUT.json LAYOUT...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parity_worker as pw  # noqa: E402

from megatron_ext.models.moe_flags import MoESettings  # noqa: E402
from megatron_ext.models.shapes import PRESETS  # noqa: E402

SHAPE = PRESETS["tiny-moe"]
LAYOUTS = {
    "moe_ep2": dict(world=2, ep=2),
    "moe_ep2_allgather": dict(world=2, ep=2),
    "moe_dp2_ep2_distopt": dict(world=4, ep=2),
    "moe_dp2_ep2_wrong": dict(world=4, ep=2),
    "moe_tp2_sp_ep2": dict(world=4, tp=2, ep=2, sequence_parallel=True),
    "moe_tp2_sp_etp2_ep2_allgather": dict(world=4, tp=2, etp=2, ep=2, sequence_parallel=True),
    "moe_pp2_ep2": dict(world=4, pp=2, ep=2),
    "moe_cp2_ep2": dict(world=4, cp=2, ep=2),  # routing statistics and the aux-loss scale over TP x CP
    # The 5D layout: DP2 x PP2 x TP2+SP x EP2 (EP folded over DP x TP), distributed optimizer.
    "moe_dp2_pp2_tp2_sp_ep2_distopt": dict(world=8, tp=2, pp=2, ep=2, sequence_parallel=True),
}


def settings(name: str) -> MoESettings:
    return MoESettings(aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                       dispatcher="allgather" if "allgather" in name else "alltoall")


def reduce_experts_over_dense_dp(engine) -> None:
    """The deliberate bug: expert gradients all-reduced over the dense DP group, mixing different experts."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for model in engine.model:
        for bucket_group in model.expert_parallel_bucket_groups:
            bucket_group.data_parallel_group = bucket_group.intra_distributed_optimizer_instance_group = group


def build_engine(mesh, device, distributed_optimizer: bool, full_state=None, family: str = "moe",
                 recompute: bool = False, wrong: bool = False, layout: str = ""):
    from megatron_ext import parallel
    from megatron_ext.engines.megatron import MegatronEngine, OptimizerSettings, build_model_chunks
    from megatron_ext.models import qwen
    from megatron_ext.models.sharding import load_full_state

    parallel.init_model_parallel(mesh, seed=pw.SEED)
    config = qwen.transformer_config(SHAPE, mesh, moe_settings=settings(layout))
    vocab = qwen.padded_vocab_size(SHAPE.vocab_size, 128, mesh.tp)
    chunks = build_model_chunks(lambda **kw: qwen.build_qwen(config, SHAPE, vocab_size=vocab, **kw), mesh.vpp)
    if full_state is not None:
        load_full_state(chunks, full_state)
    engine = MegatronEngine(chunks, device=device, settings=OptimizerSettings(**pw.SETTINGS),
                            use_distributed_optimizer=distributed_optimizer, micro_batch_size=pw.MICRO_BATCH,
                            seq_length=pw.SEQ)
    if wrong:
        reduce_experts_over_dense_dp(engine)
    return engine


def install() -> None:
    """Route parity_worker's layouts named ``moe_*`` to this family."""
    base_build, base_family = pw.build_engine, pw.family
    pw.LAYOUTS.update(LAYOUTS)
    pw.family = lambda name: "moe" if name.startswith("moe") else base_family(name)

    def build(mesh, device, distributed_optimizer, full_state=None, family="qwen", **kw):
        if family != "moe":
            return base_build(mesh, device, distributed_optimizer, full_state=full_state, family=family, **kw)
        return build_engine(mesh, device, distributed_optimizer, full_state, family, layout=_current[0], **kw)

    base_run = pw.run_layout

    def run_layout(name, ref, device):
        _current[0] = name
        return base_run(name, ref, device)

    pw.build_engine, pw.run_layout = build, run_layout


_current = [""]

if __name__ == "__main__":
    install()
    if sys.argv[1] == "reference":
        _current[0] = "moe_ep2"
        pw.run_reference(sys.argv[2], ["moe"])
    else:
        pw.run_compare(sys.argv[2], sys.argv[3], sys.argv[4:])
