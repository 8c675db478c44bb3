"""A long-lived process (the test runner, a notebook, a sweep over layouts, bench scripts) builds mesh after mesh:
``parallel.destroy_model_parallel`` between them, ``parallel.teardown`` for the world, and nothing keeps running.

gloo gives every process group three threads that spin until the group is destroyed; megatron-core's own
``destroy_model_parallel`` only forgets its groups. Left alive, 2,500 of them made the suite four times slower."""

import json

import pytest
import torch

from support import thread_guard
from support.ranks import run_ranks


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    root = tmp_path_factory.mktemp("teardown")
    run_ranks(2, ["tests/support/teardown_worker.py", str(root / "ours.json")])
    run_ranks(2, ["tests/support/teardown_worker.py", str(root / "mistake.json"), "megatron_core_only"])
    return {name: json.loads((root / f"{name}.json").read_text()) for name in ("ours", "mistake")}


def test_every_mesh_and_engine_after_another_in_one_process(switched):
    """DP2 and TP2 (megatron engine), ZeRO-1 (DeepSpeed), FSDP2, one after another in the same two processes, then
    the world torn down and joined again: every first-step loss is the same model's on the same batch (fp32, 1e-5),
    and TP2 rebuilt in the new world gives its first loss bit for bit."""
    losses = switched["ours"]["losses"]
    assert sorted(losses) == ["dp2", "dp2_fsdp", "dp2_zero1", "tp2", "tp2_again"], losses
    assert all(abs(v - losses["dp2"]) <= 1e-5 * abs(losses["dp2"]) for v in losses.values()), losses
    assert losses["tp2_again"] == losses["tp2"]


def test_no_thread_outlives_its_mesh(switched):
    """After each teardown a rank holds what the world alone held (plus a little: torch's own pools); after the
    world's, almost nothing. megatron-core's destroy alone leaves every mesh's groups running: the same check fails
    it. Gloo's own threads exactly: FSDP's mesh, kept by DTensor's redistribution planners, once left three."""
    ours, mistake = switched["ours"], switched["mistake"]
    base = ours["world_only"]
    assert all(n <= base + thread_guard.SLACK for name, n in ours["threads"].items() if name != "teardown"), ours
    assert set(ours["gloo"].values()) == {ours["world_gloo"]}, ours
    assert ours["threads"]["teardown"] <= base, ours
    assert mistake["threads"]["dp2_fsdp"] > base + 4 * thread_guard.SLACK, mistake
    assert mistake["losses"]["tp2"] == ours["losses"]["tp2"]  # what it computes is the same: only threads leak


def test_destroy_model_parallel_in_this_process(single_rank):
    """The runner's own world of one: an engine built, its mesh destroyed and rebuilt, and the threads are back
    where they started (the mesh the session fixture made included)."""
    from megatron_ext import parallel
    from support import engines
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from support.parity_worker import MICRO_BATCH, SEQ, SHAPE, global_batch

    before = thread_guard.count()
    for _ in range(3):
        parallel.init_model_parallel(Mesh(world=1), seed=1)
        chunk = qwen.build_qwen(qwen.transformer_config(SHAPE, Mesh(world=1)), SHAPE, vocab_size=256)
        engine = engines.build([chunk], torch.device("cpu"), forward_step, Mesh(world=1),
                               micro_batch_size=MICRO_BATCH, seq_length=SEQ, lr=1e-3)
        engine.forward_backward(global_batch(0))
        del engine, chunk
    parallel.destroy_model_parallel()
    world_only = thread_guard.count()
    parallel.init_model_parallel(Mesh(world=1), seed=1)  # as the session fixture left it
    assert world_only < before - 30 and thread_guard.count() <= before + thread_guard.SLACK
