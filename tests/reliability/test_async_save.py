"""--async-save: checkpoints written in the background, committed in order, and failed or cut saves in one line.

The megatron engine (TP2 x PP2), DeepSpeed ZeRO-3 (DP2) and FSDP (DP2) each train six steps saving every two
steps in the background: the losses and every file of every checkpoint (bar the manifest's timing) equal a run that
saves in the foreground, and a run resumed from any of its checkpoints (2 and 4; 6 ends it) continues with the
uninterrupted losses.
Faults (megatron engine, DP2): the background writer dies mid-write, a rank dies while a slow save is in flight
(--save-retain 2 keeps the two committed ones), megatron-core's writer cannot open its files (disk full in the
background, read-only filesystem and permission denied in the foreground): each leaves the last committed
checkpoint, which resumes exactly; failed writes end the run with exit 1 and one line per rank naming the file and
the OS error. SIGTERM to torchrun with a save in flight: waited for, then the final save, and the resume is exact.
"""

import json
import os
import pickle
import shutil
import signal
import subprocess
import time

import pytest

from support import REPO, faults
from support.ranks import free_port, run_ranks
from support.launcher_commands import clean_env, parse_command

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
    return run_ranks(nproc, args, timeout=300, check=False, fault=faults, **env)


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
        for step in (2, 4):  # every checkpoint the run goes on from
            ok(launch(world, BASE + flags + ["--load", rewound(run / "async", step, run / f"from{step}"),
                                             "--log-dir", run / f"resumed{step}_log"]))
    return root


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_async_checkpoints_equal_sync_ones_and_resume_exactly(engines, engine):
    run = engines / engine
    background, foreground = losses(run / "async_log"), losses(run / "sync_log")
    assert sorted(background) == list(range(1, 7)) and background == foreground
    for step in (2, 4, 6):
        saved, reference = files(run / "async" / f"iter_{step:07d}"), files(run / "sync" / f"iter_{step:07d}")
        assert saved.keys() == reference.keys() and saved == reference, step
    for step in (2, 4):
        resumed = losses(run / f"resumed{step}_log")
        assert sorted(resumed) == list(range(step + 1, 7)), step
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


# Each rank's line, by fault: megatron-core's writer names the file it could not open and the OS error.
FAILED_WRITES = {
    "die_in_write@4": ["the writer process ended with exit code 9"] * 2,  # or the other rank's writer died first
    "enospc@4:1": ["another rank's save failed", "No space left on device (ENOSPC) writing {file}"],
    "erofs@4:0,eacces@4:1": ["Read-only file system (EROFS) writing {file}",
                             "Permission denied (EACCES) writing {file}"],
}


@pytest.mark.parametrize("fault,flags,env", [
    ("die_in_write@4", ["--async-save"], {}),
    ("enospc@4:1", ["--async-save"], {}),
    ("erofs@4:0,eacces@4:1", [], {}),
    ("slow_save@4,die@5:1", ["--async-save", "--save-interval", "1", "--save-retain", "2"],
     {"MEGATRON_EXT_SLOW_SAVE_SECONDS": "4"}),
], ids=["writer_killed", "disk_full", "read_only_and_permission_denied", "rank_killed_while_writing_retain_2"])
def test_a_failed_or_cut_save_keeps_the_last_checkpoint(tmp_path, reference, fault, flags, env):
    """The write errors arise where the filesystem raises them: opening a checkpoint file inside megatron-core's
    writer (forked, in the background or the foreground), which hands the error back through its results queue.
    With --save-retain 2 and a save every step, the rank dies while step 4's save is in flight: the committed 2 and
    3 are both kept (the one in flight is not counted), 3 resumes."""
    world, mesh = DP2
    save = tmp_path / "ckpt"
    command = BASE + mesh + ["--save", save] + flags
    # No --log-dir: rank 0 would draw its plot before its error line, and the launch stops the others 1 s after
    # the first rank exits (torchrun gives them SHUTDOWN_TIMEOUT).
    proc = launch(world, command, faults=fault, **env)
    assert proc.returncode != 0
    retained = "--save-retain" in flags
    last = 3 if retained else 2
    assert tracker(save) == last and not (save / "iter_0000004").exists()
    assert [p.name for p in sorted(save.glob("iter_???????"))] == [f"iter_{s:07d}" for s in range(2, last + 1)]
    if not retained:  # a failed write: one line per rank, exit 1
        assert proc.returncode == 1
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == world and all("saving step 4 to --save" in line for line in lines), proc.stderr[-3000:]
        assert all("step 2, the last committed checkpoint, is intact" in line for line in lines)
        assert "Traceback" not in proc.stderr
        for rank, line in enumerate(lines):
            assert line.startswith(f"error: rank {rank}: "), lines
            said = FAILED_WRITES[fault][rank].format(file=save / "iter_0000004.tmp" / f"__{rank}_0.distcp")
            assert said in line or (fault == "die_in_write@4" and "another rank's save failed" in line), line
    ok(launch(world, command + ["--load", save, "--log-dir", tmp_path / "second"]))
    assert sorted(losses(tmp_path / "second")) == list(range(last + 1, 7)) and tracker(save) == 6
    assert_same(losses(tmp_path / "second"), reference)
    if retained:  # committed ones only, the newest two
        assert sorted(os.listdir(save)) == ["iter_0000005", "iter_0000006", "latest_checkpointed_iteration.txt"]


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


def sigterm_torchrun(tmp_path, budget, flags, ready):
    """examples/cpu_quickstart.sh (DP2, every save slowed by 6 s) with ``flags``; SIGTERM to its torchrun once
    ``ready(records)``, as a scheduler sends it. Returns (return code, output, seconds from the signal to the end)."""
    log = tmp_path / "log"
    env = dict(os.environ, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), SHUTDOWN_TIMEOUT=str(budget),
               OMP_NUM_THREADS="1", MEGATRON_EXT_SLOW_SAVE_SECONDS="6", **faults.env("slow_save@0"))
    proc = subprocess.Popen(["bash", "examples/cpu_quickstart.sh", *QUICKSTART, *flags, "--log-dir", str(log)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not ((log / "metrics.jsonl").exists() and ready(records(log))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the launcher exec'd megatron_ext.launch (torchrun's agent): this is it
    output = proc.communicate(timeout=budget + 60)[0]
    return proc.returncode, output, time.monotonic() - start


QUICKSTART = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seq-length", "64",
              "--train-iters", "10000", "--eval-interval", "0"]


def test_sigterm_to_torchrun_lets_the_ranks_save_within_the_launchers_budget(tmp_path):
    """SIGTERM to the torchrun a launcher started (megatron_ext.launch), while every save takes 6 s: it passes it on
    and waits SHUTDOWN_TIMEOUT (torchrun's own default is 30 s) before killing the ranks. With room (40 s) and
    --async-save, the signal arrives while step 2's save is in flight: the ranks finish the step, wait for that save
    (committed), make their final save and exit 0, and so does the launcher (it kills none); resumed (with a time limit too close for a save: its one
    start-up line says so), the run continues with the uninterrupted losses. With 2 s, the final save is cut and
    nothing new is committed (the tracker is written last), one line says so, exit 1; that run, uninterrupted until the signal, is the
    reference."""
    from megatron_ext.checkpoint import files as checkpoint_files

    save = tmp_path / "kept" / "ckpt"
    code, output, took = sigterm_torchrun(tmp_path / "kept", 40, ["--save", str(save), "--save-interval", "2",
                                                                 "--async-save"],
                                          lambda log: any(r["step"] >= 2 for r in log))
    # Every rank finished its save and exited by itself, none was killed, and so the launcher exits 0 (torchrun
    # alone exits 1 whatever its ranks did: it re-raises the signal once they are done).
    assert code == 0 and "still running" not in output, output[-3000:]
    assert "SIGTERM received" in output and "exiting (the same command with --load resumes)" in output
    assert all(output.count(f"rank {rank} received SIGTERM") == 1 for rank in (0, 1)), output[-3000:]  # not the writer
    stop = checkpoint_files.latest_iteration(str(save))
    assert stop is not None and stop > 2 and took >= 6, (stop, took)
    for step in (2, stop):  # the save in flight at the signal, committed; then the final one
        path = checkpoint_files.iteration_dir(str(save), step)
        assert os.path.isdir(path) and checkpoint_files.check_complete(path, str(save)) is None, step
    first = losses(tmp_path / "kept" / "log")
    assert sorted(first) == list(range(1, stop + 1))

    line = subprocess.run(["bash", "examples/cpu_quickstart.sh", *QUICKSTART], cwd=REPO, env=clean_env(DRY_RUN=1),
                          capture_output=True, text=True, timeout=30).stdout
    flags = parse_command(line).flags
    resumed = ok(launch(2, ["finetune_qwen.py", *flags, "--load", save, "--exit-interval", stop + 2,
                            "--exit-duration-in-mins", "5", "--log-dir", tmp_path / "resumed"],
                        SHUTDOWN_TIMEOUT="", SLURM_JOB_END_TIME=str(time.time() + 5 * 60 + 1)))
    warning = [line for line in resumed.stdout.splitlines() if "--exit-duration-in-mins 5 leaves" in line]
    assert len(warning) == 1 and f"the last save to {save} took" in warning[0], resumed.stdout[-3000:]
    second = losses(tmp_path / "resumed")
    assert sorted(second) == [stop + 1, stop + 2]

    cut = tmp_path / "cut" / "ckpt"
    code, output, took = sigterm_torchrun(tmp_path / "cut", 2, ["--save", str(cut), "--save-interval", "100000"],
                                          lambda log: len(log) >= stop + 2)
    assert code == 1 and "rank(s) still running 2 s after SIGTERM" in output and took < 20, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert checkpoint_files.latest_iteration(str(cut)) is None
    assert_same({**first, **second}, losses(tmp_path / "cut" / "log"))


def test_a_full_disk_is_named_by_the_os_on_every_rank(monkeypatch, tmp_path):
    """torch.save's writer reports a full disk as "[enforce fail at inline_container.cc] unexpected pos": a write
    failing so names the OS's cause when the checkpoint's filesystem has no space left (one cause, one text on every
    rank), and only then."""
    from megatron_ext.checkpoint import writer

    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(writer, "_full", lambda directory: True)
    assert writer.describe(torn, str(tmp_path)) == f"No space left on device (ENOSPC) writing {tmp_path}"
    assert writer.describe(torn) == "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    monkeypatch.setattr(writer, "_full", lambda directory: False)
    assert writer.describe(torn, str(tmp_path)).startswith("RuntimeError: [enforce fail")


def test_a_real_full_disk_reads_the_same_on_both_tp_ranks(tmp_path):
    """TP2 saving into a 3 MB filesystem (tmpfs; skipped where this machine may not mount one): both ranks' lines
    say "No space left on device (ENOSPC)", neither torch's writer text (rank 1 said that before)."""
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("this machine may not mount a tmpfs (the unit test above holds the rule)")
    try:
        proc = launch(2, BASE + ["--tensor-model-parallel-size", "2", "--save", small / "ckpt", "--save-interval", "2"])
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr[-3000:]
    assert all("No space left on device (ENOSPC)" in line and "inline_container" not in line for line in lines), lines
