"""The pretrain_gpt.py launchers (examples/gpt2_*.sh, and Qwen's continued pretraining), without GPUs: each DRY_RUN=1
line is parsed back and its pretrain_gpt.py flags must pass ``arguments.parse(..., family="gpt")`` for the world the
name promises, on one node and on two, with the mesh the name promises."""

import os
import subprocess

import pytest

from megatron_ext.arguments import parse
from megatron_ext.models.qwen.shape import PRESETS
from megatron_ext.models.gpt2.shape import GPT2_PRESETS
from support import flag_values
from support.launcher_commands import EXAMPLES, dry_run

# name -> (GPUs per node, TP, PP, sequence parallel, engine, preset, data)
SHAKESPEARE, OWT = "karpathy/tiny_shakespeare", "Skylion007/openwebtext"
EXPECTED = {"gpt2_ddp_2gpu": (2, 1, 1, False, "megatron", "gpt2", SHAKESPEARE),
            "gpt2_tp_2gpu": (2, 2, 1, True, "megatron", "gpt2", SHAKESPEARE),
            "gpt2_pp_4gpu": (4, 1, 4, False, "megatron", "gpt2", SHAKESPEARE),
            "gpt2_fsdp_2gpu": (2, 1, 1, False, "fsdp", "gpt2", SHAKESPEARE),
            "gpt2_fsdp_tp_4gpu": (4, 2, 1, False, "fsdp", "gpt2", SHAKESPEARE),
            "gpt2_fsdp_tp_8gpu_owt": (8, 2, 1, False, "fsdp", "gpt2-medium", OWT)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("nodes", [1, 2])
def test_gpt2_launcher_mesh_and_flags(name, nodes, tmp_path):
    gpus, tp, pp, sp, engine, preset, data = EXPECTED[name]
    command = dry_run(os.path.join(EXAMPLES, f"{name}.sh"), cwd=tmp_path, NNODES=nodes, NODE_RANK=nodes - 1)
    assert command.opts["--nproc-per-node"] == str(gpus) and command.opts["--nnodes"] == str(nodes)
    run = parse(command.flags, world_size=gpus * nodes, family="gpt")
    mesh, args = run.mesh, flag_values(run)
    assert run.shape == GPT2_PRESETS[preset] and args.bf16 and args.seq_length == 1024 and args.engine == engine
    assert (mesh.tp, mesh.pp, mesh.dp, mesh.sequence_parallel) == (tp, pp, gpus * nodes // (tp * pp), sp)
    assert (args.data_path, args.tokenizer) == ([data], "openai-community/gpt2")
    assert args.save == args.load == f"runs/{name}/checkpoints" and args.save_hf == f"runs/{name}/hf"
    assert args.pretrained is None  # pretraining from scratch unless PRETRAINED says otherwise


def test_gpt2_launcher_from_the_published_weights(tmp_path):
    command = dry_run(os.path.join(EXAMPLES, "gpt2_tp_2gpu.sh"), cwd=tmp_path, PRETRAINED="openai-community/gpt2")
    run = parse(command.flags, world_size=2, family="gpt")
    assert (flag_values(run).pretrained, flag_values(run).tokenizer) == ("openai-community/gpt2", "openai-community/gpt2")
    assert run.shape == GPT2_PRESETS["gpt2"]


def test_scaling_runs_dp_on_1_2_4_gpus_then_compares(tmp_path):
    """gpt2_scaling.sh: three runs of one global batch (equal tokens per step: comparable), then the report."""
    from support.launcher_commands import clean_env, parse_command

    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "gpt2_scaling.sh"), "--train-iters", "50"], cwd=tmp_path,
                          env=clean_env(DRY_RUN=1, RUN_DIR="/runs/s"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *runs, report = proc.stdout.strip().splitlines()
    for gpus, line in zip((1, 2, 4), runs):
        command = parse_command(line)
        run = parse(command.flags, world_size=gpus, family="gpt")
        assert run.mesh.dp == gpus and flag_values(run).global_batch_size == 64 and flag_values(run).train_iters == 50
        assert flag_values(run).log_dir == f"/runs/s/dp{gpus}/logs"
    assert report.split() == ["python", "tools/compare_runs.py", "/runs/s/dp1/logs:1gpu", "/runs/s/dp2/logs:2gpu",
                              "/runs/s/dp4/logs:4gpu", "-o", "/runs/s/report"]


def test_data_path_takes_weighted_megatron_prefixes(tmp_path):
    command = dry_run(os.path.join(EXAMPLES, "gpt2_fsdp_tp_8gpu_owt.sh"), cwd=tmp_path,
                      DATA_PATH="0.3 data/wiki_text_document 0.7 data/owt_text_document")
    args = flag_values(parse(command.flags, world_size=8, family="gpt"))
    assert args.data_path == ["0.3", "data/wiki_text_document", "0.7", "data/owt_text_document"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_qwen_continued_pretraining_launcher(nodes, tmp_path):
    """qwen3b_cpt_8gpu.sh: Qwen2.5-3B from the published weights (and tokenizer) on OpenWebMath, TP2 + SP x DP with
    the distributed optimizer, WSD's last 200 of 2,000 steps annealing 3e-5 to 3e-6."""
    command = dry_run(os.path.join(EXAMPLES, "qwen3b_cpt_8gpu.sh"), cwd=tmp_path, NNODES=nodes, NODE_RANK=nodes - 1)
    run = parse(command.flags, world_size=8 * nodes, family="gpt")
    mesh, args = run.mesh, flag_values(run)
    assert run.shape == PRESETS["qwen2.5-3b"] and (args.pretrained, args.tokenizer) == ("Qwen/Qwen2.5-3B",) * 2
    assert (mesh.tp, mesh.dp, mesh.sequence_parallel, args.use_distributed_optimizer) == (2, 4 * nodes, True, True)
    assert (args.bf16, args.seq_length, args.global_batch_size, args.data_path) == (
        True, 4096, 64, ["open-web-math/open-web-math"])
    assert (args.lr, args.min_lr, args.lr_decay_style, args.lr_wsd_decay_iters, args.train_iters) == (
        3e-5, 3e-6, "WSD", 200, 2000)
    assert args.save_hf == "runs/qwen3b_cpt_8gpu/hf"
