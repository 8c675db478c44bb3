"""Faults injected into real runs (``tests/support/faults.py``, planted from outside): preemption signals with
resume parity under TP2 x PP2 and ZeRO-3, the time limit, non-finite steps (stop and skip, every engine), a loss
spike, a hung rank past --distributed-timeout-minutes, and a dead rank under torchrun."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from support import REPO, faults
from support.ranks import free_port, run_ranks

BASE = ["finetune_qwen.py", "--model", "tiny", "--mock-data", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", "5", "--seed", "7"]


def launch(nproc, args, faults="", timeout=300):
    return run_ranks(nproc, args, timeout=timeout, check=False, fault=faults)


def ok(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def records(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Five uninterrupted steps on one process: the losses every interrupted-and-resumed mesh must give."""
    log = tmp_path_factory.mktemp("reference")
    ok(launch(1, BASE + ["--log-dir", log]))
    return [(r["loss"], r["grad_norm"]) for r in records(log)]


@pytest.mark.parametrize("mesh,nproc,fault", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4, "sigterm@2:3"),
    (["--engine", "deepspeed", "--zero-stage", "3"], 2, "sigusr1@3:1"),
], ids=["tp2xpp2_sigterm", "zero3_sigusr1"])
def test_preempted_run_resumes_with_the_same_losses(tmp_path, reference, mesh, nproc, fault):
    """The signal reaches ONE rank; every rank finishes the step, saves, exits 0; the same command resumes and
    the joined losses equal the uninterrupted run."""
    save, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    command = BASE + mesh + ["--save", save, "--load", save]
    proc = ok(launch(nproc, command + ["--log-dir", first], faults=fault))
    stop = int(fault.split("@")[1].split(":")[0])
    signal_name = fault.split("@")[0].upper()
    assert tracker(save) == stop
    assert f"SIG{signal_name.removeprefix('SIG')} received (rank {fault.split(':')[1]})" in proc.stdout
    assert [r["step"] for r in records(first)] == list(range(1, stop + 1))
    ok(launch(nproc, command + ["--log-dir", second]))
    joined = records(first) + records(second)
    assert [r["step"] for r in joined] == [1, 2, 3, 4, 5]
    for record, (loss, grad_norm) in zip(joined, reference):
        assert record["loss"] == pytest.approx(loss, rel=1e-5), record["step"]
        assert record["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), record["step"]


@pytest.mark.parametrize("command", [
    ["pretrain_vit.py", "--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4"],
    ["pretrain_gpt.py", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
     "--engine", "fsdp"],
], ids=["vit", "gpt2_fsdp"])
def test_every_family_and_engine_resumes_after_sigterm(tmp_path, command):
    """The loop is shared: ViT (megatron engine) and GPT-2 (FSDP engine) stop at the signal and resume exactly."""
    command = command + ["--train-iters", "4", "--lr", "2e-3"]
    save = tmp_path / "ckpt"
    ok(launch(1, command + ["--log-dir", tmp_path / "reference"]))
    ok(launch(1, command + ["--save", save, "--log-dir", tmp_path / "first"], faults="sigterm@2"))
    assert tracker(save) == 2
    ok(launch(1, command + ["--save", save, "--load", save, "--log-dir", tmp_path / "second"]))
    joined = records(tmp_path / "first") + records(tmp_path / "second")
    reference = records(tmp_path / "reference")
    assert [r["step"] for r in joined] == [1, 2, 3, 4]
    assert [r["loss"] for r in joined] == pytest.approx([r["loss"] for r in reference], rel=1e-6)


def test_nonfinite_steps_and_time_limit(tmp_path):
    """--on-nan skip drops the poisoned update on the megatron engine and DeepSpeed (ZeRO-0 with our clipping
    hook, ZeRO-2 natively): later steps are finite and equal across engines. Without clipping DeepSpeed's ZeRO-0
    applies the NaN update (the wrong variant: later losses NaN). --on-nan stop exits 1 with one line naming the
    step and rank and saves nothing of it. --exit-duration-in-mins saves and exits 0."""
    runs = {"megatron": [], "ds_zero0": ["--engine", "deepspeed", "--zero-stage", "0"],
            "ds_zero2": ["--engine", "deepspeed", "--zero-stage", "2"],
            "ds_zero0_noclip": ["--engine", "deepspeed", "--zero-stage", "0", "--clip-grad", "0"]}
    losses = {}
    for name, extra in runs.items():
        ok(launch(1, BASE + extra + ["--on-nan", "skip", "--log-dir", tmp_path / name], faults="nan@3"))
        got = records(tmp_path / name)
        assert got[2]["nonfinite"] and not got[1]["skipped"]
        assert got[2]["skipped"] == (name != "ds_zero0_noclip"), name
        losses[name] = [r["loss"] for r in got]
    for name in ("megatron", "ds_zero0", "ds_zero2"):
        assert all(math.isfinite(x) for x in losses[name][3:]), name
        assert losses[name][3:] == pytest.approx(losses["megatron"][3:], rel=1e-5), name
    assert all(x is None or math.isnan(x) for x in losses["ds_zero0_noclip"][3:])  # JSON writes NaN as null

    save = tmp_path / "stop"
    proc = launch(1, BASE + ["--save", save, "--save-interval", "1", "--log-dir", tmp_path / "stop_log"],
                  faults="nan@3")
    assert proc.returncode == 1
    (line,) = error_lines(proc)
    assert "step 3: non-finite loss on rank 0" in line and "--on-nan" in line and "Traceback" not in proc.stderr
    assert tracker(save) == 2 and not (save / "iter_0000003").exists()

    save = tmp_path / "time"
    proc = ok(launch(1, BASE + ["--save", save, "--exit-duration-in-mins", "0.0001"]))
    assert tracker(save) == 1 and "--exit-duration-in-mins 0.0001 reached: saved step 1" in proc.stdout


def test_loss_spike_is_flagged_and_training_goes_on(tmp_path):
    """A loss 10x its running mean at step 7 (after the 5 warm-up losses) is flagged in the metrics and in one line;
    no other step is, and the run finishes."""
    proc = ok(launch(1, BASE + ["--train-iters", "8", "--loss-spike-factor", "2", "--log-dir", tmp_path],
                     faults="spike@7"))
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["step"] for r in got if r.get("loss_spike")] == [7], got
    assert got[6]["loss"] > 5 * got[5]["loss"] and all(math.isfinite(r["loss"]) for r in got)
    assert "megatron_ext: loss spike at step 7:" in proc.stdout and "--loss-spike-factor 2 x running mean" in proc.stdout


def test_loss_spikes_against_the_running_mean():
    from megatron_ext.training.guard import LossSpikes

    spikes = LossSpikes(3.0, window=4, warmup=2)
    found = [spikes.check(x) for x in (2.0, 2.0, 5.9, float("nan"), 12.0, 2.0)]
    assert found[:4] == [None, None, None, None] and found[4] == pytest.approx((2 + 2 + 5.9) / 3) and found[5] is None
    assert LossSpikes(None).check(100.0) is None


def test_hung_rank_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 hangs at step 2; rank 0's next collective gives up after --distributed-timeout-minutes (6 s) and
    says where, in one line; the launcher then stops the hung rank."""
    start = time.monotonic()
    proc = launch(2, BASE + ["--distributed-timeout-minutes", "0.1"], faults="hang@2:1", timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    (line,) = error_lines(proc)
    assert line.startswith("error: rank 0: a collective failed at step 2") and "--distributed-timeout-minutes 0.1" \
        in line, line
    assert "Traceback" not in proc.stderr and elapsed < 60


def test_dead_rank_ends_the_job_under_torchrun(tmp_path):
    """A rank that dies mid-run: torchrun stops the others and exits nonzero (nothing hangs)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **faults.env("die@2:1"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", *BASE, "--distributed-timeout-minutes", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and time.monotonic() - start < 120
    assert "rank 1 dies at step 2" in proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_fingerprint_catches_every_single_flipped_bit(dtype, monkeypatch):
    """training/replicas.py's fingerprint (computed where the weights live, no host copy): equal for equal bits,
    different for every single flipped bit of an element (each of its 16 or 32 bits, the sign's included, at the
    start, middle and end of a tensor) and for two swapped elements; the same whether or not it is taken in chunks."""
    from megatron_ext.training import replicas

    x = torch.randn(333, 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = replicas.fingerprints([x])
    assert base.dtype == torch.int64 and base.shape == (1, 2) and torch.equal(base, replicas.fingerprints([x.clone()]))
    ints = replicas._BITS[x.element_size()]
    for index in (0, x.numel() // 2, x.numel() - 1):
        for bit in range(torch.iinfo(ints).bits):
            flipped = x.clone().reshape(-1).view(ints)
            flipped[index] ^= torch.tensor(1, dtype=torch.int64).bitwise_left_shift(bit).to(ints)
            assert not torch.equal(replicas.fingerprints([flipped.view(dtype)]), base), (index, bit)
    swapped = x.clone().reshape(-1)
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(replicas.fingerprints([swapped]), base) and not torch.equal(swapped[3], swapped[4])
    monkeypatch.setattr(replicas, "_CHUNK", 1000)
    assert torch.equal(replicas.fingerprints([x]), base)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_fingerprint_only_reads_the_weights(dtype):
    """Fingerprinting leaves every weight's bits as they were, whatever its width (an 8-byte dtype's int64 view is
    the parameter's own memory: an in-place product there rewrote fp64 weights), a parameter shared by two modules
    included (taken twice, the same fingerprint)."""
    from megatron_ext.training import replicas

    shared = torch.nn.Parameter(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(dtype))
    model = torch.nn.ModuleDict(dict(a=torch.nn.Linear(16, 64), b=torch.nn.Linear(16, 64))).to(dtype)
    model["a"].weight = model["b"].weight = shared
    params = [model["a"].weight, model["b"].weight, model["a"].bias, torch.ones(4, dtype=dtype)]
    before = [p.detach().clone() for p in params]
    prints = replicas.fingerprints(params)
    assert all(torch.equal(p.detach().reshape(-1).view(replicas._BITS[p.element_size()]),
                           b.reshape(-1).view(replicas._BITS[b.element_size()])) for p, b in zip(params, before))
    assert torch.equal(prints[0], prints[1]) and torch.equal(prints, replicas.fingerprints(params))


def test_replicas_whose_weights_drift_apart_stop_the_run(tmp_path):
    """--check-weight-hash-across-dp-replicas-interval (Megatron-LM's): DP2 with and without the distributed
    optimizer passes every step's check and trains as without it; one flipped bit of one weight on rank 1 at step 3
    stops the run at that step's check, exit 1, one line naming rank 1 and the parameter, step 3 not saved; so does
    DeepSpeed ZeRO-0's (each replica keeps its own weights, as DDP's); FSDP refuses the flag in one line."""
    check = ["--check-weight-hash-across-dp-replicas-interval", "1"]
    ok(launch(2, BASE + ["--log-dir", tmp_path / "plain"]))
    ok(launch(2, BASE + check + ["--log-dir", tmp_path / "checked"]))
    ok(launch(2, BASE + check + ["--use-distributed-optimizer", "--log-dir", tmp_path / "distopt"]))
    plain = [r["loss"] for r in records(tmp_path / "plain")]
    assert [r["loss"] for r in records(tmp_path / "checked")] == plain
    assert [r["loss"] for r in records(tmp_path / "distopt")] == pytest.approx(plain, rel=1e-5)

    save = tmp_path / "flipped"
    proc = launch(2, BASE + check + ["--save", save, "--save-interval", "1", "--log-dir", tmp_path / "flipped_log"],
                  faults="bitflip@3:1")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    (line,) = set(error_lines(proc))
    assert "step 3: the data-parallel replicas' weights differ" in line and "on rank(s) 1 (" in line
    assert "embedding" in line and "Traceback" not in proc.stderr
    assert tracker(save) == 2 and not (save / "iter_0000003").exists()

    proc = launch(2, BASE + check + ["--engine", "deepspeed", "--zero-stage", "0", "--log-dir", tmp_path / "ds"],
                  faults="bitflip@2:1")
    assert proc.returncode == 1 and "step 2: the data-parallel replicas' weights differ" in error_lines(proc)[0]
    assert [r["step"] for r in records(tmp_path / "ds")] == [1, 2]  # (step 1 passed its check)
    proc = launch(2, BASE + check + ["--engine", "fsdp"])
    assert proc.returncode == 2 and "--engine fsdp shards them (no replicas)" in proc.stderr
