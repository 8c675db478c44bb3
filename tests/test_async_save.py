"""--async-save: checkpoints written in the background, committed in order, and failed or cut saves in one line.

The megatron engine (TP2 x PP2), DeepSpeed ZeRO-3 (DP2) and FSDP (DP2) each train six steps saving every two
steps in the background: the losses and every file of every checkpoint (bar the manifest's timing) equal a run that
saves in the foreground, and a run resumed from its first checkpoint continues with the uninterrupted losses.
Faults (megatron engine, DP2): the background writer dies mid-write, a rank dies while a slow save is in flight,
the disk is full (background and foreground): each leaves the last committed checkpoint, which resumes exactly;
failed writes end the run with exit 1 and one line per rank naming the OS error.
"""

import json
import os
import pickle
import shutil

import pytest

import forked_ranks
from conftest import REPO, free_port

TOL = 1e-5
BASE = ["finetune_qwen.py", "--model", "tiny", "--mock-data", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-3", "--seed", "7", "--save-interval", "2"]
ENGINES = {
    "megatron_tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "zero3_dp2": (2, ["--engine", "deepspeed", "--zero-stage", "3"]),
    "fsdp_dp2": (2, ["--engine", "fsdp"]),
}
DP2 = (2, [])


def launch(nproc, args, faults="", **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGATRON_EXT_FAULTS=faults, **env)
    port = free_port()
    return forked_ranks.launch(nproc, [str(a) for a in args], dict(env, MASTER_PORT=str(port)), REPO, 300, port)


def ok(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def losses(log_dir):
    return {r["step"]: r["loss"] for r in records(log_dir)}


def assert_same(actual, expected):
    assert actual, "no steps"
    for step, loss in actual.items():
        assert abs(loss - expected[step]) <= TOL * abs(expected[step]), (step, actual, expected)


def rewound(save, step, to):
    """A copy of ``save`` whose trackers name ``step``: a resume from that checkpoint."""
    shutil.copytree(save, to)
    (to / "latest_checkpointed_iteration.txt").write_text(str(step))
    if (to / "latest").exists():
        (to / "latest").write_text(f"iter_{step:07d}")
    return to


def tracker(save):
    return int((save / "latest_checkpointed_iteration.txt").read_text())


def files(checkpoint):
    """Every file's bytes; the manifest (timing) left out, DCP's .metadata without the path and id of its save."""
    out = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != "manifest.json"):
        out[str(path.relative_to(checkpoint))] = path.read_bytes()
        if path.name == ".metadata":
            meta = pickle.loads(path.read_bytes())
            out[str(path.relative_to(checkpoint))] = (meta.state_dict_metadata, meta.storage_data, meta.planner_data)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    for name, (world, flags) in ENGINES.items():
        run = root / name
        ok(launch(world, BASE + flags + ["--save", run / "async", "--async-save", "--log-dir", run / "async_log"]))
        ok(launch(world, BASE + flags + ["--save", run / "sync", "--log-dir", run / "sync_log"]))
        ok(launch(world, BASE + flags + ["--load", rewound(run / "async", 2, run / "from2"),
                                         "--log-dir", run / "resumed_log"]))
    return root


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_async_checkpoints_equal_sync_ones_and_resume_exactly(engines, engine):
    run = engines / engine
    background, foreground = losses(run / "async_log"), losses(run / "sync_log")
    assert sorted(background) == list(range(1, 7)) and background == foreground
    for step in (2, 4, 6):
        saved, reference = files(run / "async" / f"iter_{step:07d}"), files(run / "sync" / f"iter_{step:07d}")
        assert saved.keys() == reference.keys() and saved == reference, step
    resumed = losses(run / "resumed_log")
    assert sorted(resumed) == [3, 4, 5, 6]
    assert_same(resumed, background)


def test_the_step_waits_only_for_staging_and_commits_follow(engines):
    """Each save's staging and blocking times are logged at its step; a background save is committed at a later
    step (the last save, before the run ends, in the foreground); the summary has the totals and means."""
    log = records(engines / "megatron_tp2_pp2" / "async_log")
    assert [r["step"] for r in log if "save_staging_time" in r] == [2, 4, 6]
    assert all(r["save_blocking_time"] >= r.get("save_staging_time", 0) for r in log if "save_blocking_time" in r)
    committed = [(r["step"], r["saved_step"]) for r in log if "saved_step" in r]
    assert [saved for _, saved in committed] == [2, 6] or [saved for _, saved in committed] == [2, 4, 6]
    assert all(step > saved for step, saved in committed if saved != 6)
    summary = json.loads((engines / "megatron_tp2_pp2" / "async_log" / "summary.json").read_text())
    assert summary["saves"] == 3 and summary["mean_save_staging_time"] > 0 and summary["mean_save_total_time"] > 0
    assert summary["save_blocking_time"] >= 3 * summary["mean_save_staging_time"]
    manifest = json.loads((engines / "megatron_tp2_pp2" / "async" / "iter_0000002" / "manifest.json").read_text())
    assert manifest["save_seconds"] > 0


@pytest.fixture(scope="module")
def reference(engines):
    return losses(engines / "megatron_tp2_pp2" / "sync_log")  # every mesh trains the same losses


@pytest.mark.parametrize("fault,async_save,env", [
    ("die_in_write@4", True, {}),
    ("enospc@4:1", True, {}),
    ("enospc@4:1", False, {}),
    ("slow_save@4,die@5:1", True, {"MEGATRON_EXT_SLOW_SAVE_SECONDS": "4"}),
], ids=["writer_killed", "disk_full", "disk_full_sync", "rank_killed_while_writing"])
def test_a_failed_or_cut_save_keeps_the_last_checkpoint(tmp_path, reference, fault, async_save, env):
    world, flags = DP2
    save = tmp_path / "ckpt"
    command = BASE + flags + ["--save", save] + (["--async-save"] if async_save else [])
    proc = launch(world, command + ["--log-dir", tmp_path / "first"], faults=fault, **env)
    assert proc.returncode != 0
    assert tracker(save) == 2 and not (save / "iter_0000004").exists()
    if "die@5" not in fault:  # a failed write: one line per rank, exit 1
        assert proc.returncode == 1
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == world and all("saving step 4 to --save" in line for line in lines), proc.stderr[-3000:]
        assert all("step 2, the last committed checkpoint, is intact" in line for line in lines)
        why = "No space left on device (ENOSPC)" if "enospc" in fault else "writer process ended with exit code 9"
        assert any(why in line for line in lines) and "Traceback" not in proc.stderr
    ok(launch(world, command + ["--load", save, "--log-dir", tmp_path / "second"]))
    assert sorted(losses(tmp_path / "second")) == [3, 4, 5, 6] and tracker(save) == 6
    assert_same(losses(tmp_path / "second"), reference)


def test_the_preemption_budget_is_checked_at_start(tmp_path):
    from megatron_ext.checkpoint.writer import budget_warning

    root = tmp_path / "ckpt"
    (root / "iter_0000004").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    assert budget_warning(str(root), env={"SHUTDOWN_TIMEOUT": "5"}) is None  # no timing recorded
    (root / "iter_0000004" / "manifest.json").write_text(json.dumps({"iteration": 4, "files": {},
                                                                     "save_seconds": 80.0}))
    line = budget_warning(str(root), env={"SHUTDOWN_TIMEOUT": "60"})
    assert "took 80 s" in line and "SHUTDOWN_TIMEOUT=60" in line and "at least 100 s" in line
    assert budget_warning(str(root), env={"SHUTDOWN_TIMEOUT": "300"}) is None
    line = budget_warning(str(root), 59, env={"SLURM_JOB_END_TIME": "3600"}, now=0.0)
    assert "--exit-duration-in-mins 59 leaves 60 s" in line and "at most --exit-duration-in-mins 58" in line
    assert budget_warning(str(root), 58, env={"SLURM_JOB_END_TIME": "3600"}, now=0.0) is None


@pytest.mark.parametrize("budget,kept", [(40, True), (2, False)], ids=["budget_covers_the_save", "budget_too_short"])
def test_sigterm_to_torchrun_lets_the_ranks_save_within_the_launchers_budget(tmp_path, budget, kept):
    """SIGTERM to the torchrun a launcher started (as a scheduler sends it), while every save takes 6 s: torchrun
    passes it on and waits SHUTDOWN_TIMEOUT (its own default is 30 s) before killing the ranks. With room for the
    save, every rank finishes its step, saves and exits 0, and the checkpoint is complete; with 2 s, the save is cut
    and nothing new is committed (the tracker is written last)."""
    import signal
    import subprocess
    import time

    from megatron_ext.checkpoint import files as checkpoint_files

    save, log = tmp_path / "ckpt", tmp_path / "log"
    env = dict(os.environ, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), SHUTDOWN_TIMEOUT=str(budget),
               OMP_NUM_THREADS="1", MEGATRON_EXT_FAULTS="slow_save@0", MEGATRON_EXT_SLOW_SAVE_SECONDS="6")
    proc = subprocess.Popen(["bash", "examples/cpu_quickstart.sh", "--tensor-model-parallel-size", "1",
                             "--pipeline-model-parallel-size", "1", "--seq-length", "64", "--train-iters", "10000",
                             "--eval-interval", "0", "--save", str(save), "--save-interval", "100000",
                             "--log-dir", str(log)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not ((log / "metrics.jsonl").exists() and len((log / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the launcher exec'd torchrun: this is torchrun
    output = proc.communicate(timeout=budget + 60)[0]
    took = time.monotonic() - start
    if kept:
        assert "SIGTERM received" in output, output[-3000:]
        assert "exiting (the same command with --load resumes)" in output
        step = checkpoint_files.latest_iteration(str(save))
        assert step is not None and checkpoint_files.check_complete(checkpoint_files.iteration_dir(str(save), step),
                                                                   str(save)) is None
        assert took >= 6, "the save's 6 s were waited for"
    else:
        assert checkpoint_files.latest_iteration(str(save)) is None and took < 20, output[-3000:]
