"""DeepSpeed features that need CUDA (marked ``gpu``; skipped on CPU machines): ZeRO++ and optimizer offload with
DeepSpeed's CPU Adam.

ZeRO++ quantizes weights to int8 for the all-gather (qwZ) and gradients to int4 for the reduce-scatter (qgZ), so it
cannot match exact ZeRO-3 to fp32 tolerance: five bf16 SFT steps must stay within 2% of plain ZeRO-3's losses and
train, and the quantizer must have run (tests/support/patched.py counts its calls on every rank). DeepSpeed 0.19.8 gathers
unquantized over a partition group of one rank, and quantizes gradients only between nodes (world size // GPUs per
machine > 1): qwZ needs 2 GPUs (``multigpu``), and qgZ runs as two torchrun nodes of one GPU each, which is what a
two-node job looks like to DeepSpeed. CPU-offloaded AdamW is the same update as on the GPU: within bf16 noise (0.5%).
"""

import os
import re
import subprocess
import sys

import pytest

from support import REPO
from support.ranks import free_port, run_ranks
from support.step_checks import assert_close, assert_trains, by_step, records

pytestmark = pytest.mark.gpu
STEPS = range(1, 6)


def gpus():
    import torch

    return torch.cuda.device_count()


def common():
    return ["finetune_qwen.py", "--model", "tiny", "--bf16", "--pack-sequences", "--seq-length", "128",
            "--micro-batch-size", "2", "--global-batch-size", str(4 * gpus()), "--train-iters", "5", "--lr", "2e-3",
            "--lr-warmup-iters", "1", "--clip-grad", "0.5", "--engine", "deepspeed", "--zero-stage", "3"]


RUNS = {"zero3": [], "zeropp": ["--zeropp"], "quantized_weights": ["--zero-quantized-weights"],
        "offload_cpu_adam": ["--offload-optimizer", "cpu"]}


def quantizer_calls(output: str) -> list:
    """[(weights, gradients)] per rank, from tests/support/patched.py's count_zeropp lines."""
    return [(int(w), int(g)) for w, g in re.findall(r"zeropp calls rank \d+: weights=(\d+) gradients=(\d+)", output)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_deepspeed")


@pytest.fixture(scope="module")
def run(root):
    """name -> ({step: loss}, quantizer calls per rank), each run once, on every GPU of the machine."""
    done = {}

    def get(name):
        if name not in done:
            log = root / name
            proc = run_ranks(gpus(), ["tests/support/patched.py", "count_zeropp", *common(), *RUNS[name],
                                      "--data-cache-dir", str(root / "cache"), "--log-dir", str(log)])
            done[name] = by_step(records(log)), quantizer_calls(proc.stdout)
        return done[name]
    return get


def test_offload_with_cpu_adam_equals_zero3(run):
    ours, ref = run("offload_cpu_adam")[0], run("zero3")[0]
    assert_close(ours, ref, 0.005, STEPS)
    assert_trains(ours, STEPS)


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("name", ["quantized_weights", "zeropp"])
def test_quantized_weight_gathers_stay_close_to_zero3(run, name):
    """qwZ on one node: every rank gathers through the int8 quantizer; --zeropp leaves qgZ off here (one node)."""
    (ours, calls), (ref, plain) = run(name), run("zero3")
    assert_close(ours, ref, 0.02, STEPS)
    assert_trains(ours, STEPS)
    assert len(calls) == gpus() and all(w > 0 and g == 0 for w, g in calls), calls
    assert len(plain) == gpus() and all(c == (0, 0) for c in plain), plain  # the counter sees plain ZeRO-3 too


@pytest.mark.multigpu(2)
def test_quantized_gradients_between_two_nodes(run, root):
    """qgZ: two torchrun nodes of one GPU each (CUDA_VISIBLE_DEVICES per node), rendezvous on this machine; both
    ranks' gradients go through the int4 all-to-all."""
    port, log = free_port(), root / "two_nodes_qgz"
    argv = ["tests/support/patched.py", "count_zeropp", *common(), "--zero-quantized-gradients", "--data-cache-dir",
            str(root / "cache"), "--log-dir", str(log)]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), PYTHONWARNINGS="ignore"))
             for i in range(2)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    calls = quantizer_calls("".join(outputs))
    assert len(calls) == 2 and all(g > 0 for _, g in calls), calls
    ours = by_step(records(log))
    assert_close(ours, run("zero3")[0], 0.02, STEPS)
    assert_trains(ours, STEPS)
