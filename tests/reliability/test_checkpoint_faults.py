"""Checkpoints are never lost or half-written (pretrain_gpt.py, tiny GPT, mock data, CPU ranks).

A crash inside a save (``MEGATRON_EXT_FAULTS=crash_in_save@4``, after every rank wrote, before the rename) leaves
the previous checkpoint loadable and only an ignored ``.tmp`` sibling; the resumed run repeats the crashed run's
steps and matches an uninterrupted one (DeepSpeed ZeRO-2 over DP2; the megatron engine on one rank), cleans the
leftover and keeps ``--save-retain 2``. A truncated file, a missing iteration directory or a deleted shard is a
one-line error naming it (exit 2), never a restart from scratch; a --save directory of another run is refused; a
checkpoint whose pickles would run code (``os.system`` in ``__reduce__``) is refused before anything is unpickled.
"""

import json
import os
import pickle
import shutil
import signal
import uuid

import pytest

from support.ranks import run_ranks

TOL = 1e-5
COMMON = ["pretrain_gpt.py", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--mock-data", "--lr", "3e-3", "--lr-warmup-iters", "1", "--clip-grad", "0.5"]
DS = ["--engine", "deepspeed", "--zero-stage", "2"]


def launch(nproc, flags, fault="", **env):
    return run_ranks(nproc, COMMON + list(flags), timeout=300, check=False, fault=fault, **env)


def crash(nproc, flags, fault):
    """A launch whose ranks die inside a save. Any process one leaves behind (a writer, megatron-core's helpers)
    is ended here, by its environment's id. Always forked ranks: under torchrun an orphan would hold the captured
    output open."""
    marker = f"MEGATRON_EXT_TEST_CRASH={uuid.uuid4().hex}"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MEGATRON_EXT_TEST_LAUNCHER", raising=False)
        proc = launch(nproc, flags, fault, MEGATRON_EXT_TEST_CRASH=marker.partition("=")[2])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    return proc


def ok(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def losses(log_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def assert_same(actual, expected):
    for step, loss in actual.items():
        assert abs(loss - expected[step]) <= TOL * abs(expected[step]), (step, actual, expected)


def held(root):
    return sorted(os.listdir(root))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    out = {"root": root}
    # DeepSpeed ZeRO-2 over DP2: saves at 2, crashes inside the save of 4; resumed with --save-retain 2 to step 6.
    out["ds_crash"] = crash(2, DS + ["--train-iters", "6", "--save", root / "ds", "--save-interval", "2",
                                     "--log-dir", root / "ds_crashed"], "crash_in_save@4")
    out["ds_after_crash"] = held(root / "ds")
    ok(launch(2, DS + ["--train-iters", "6", "--save", root / "ds", "--load", root / "ds", "--save-interval", "2",
                       "--save-retain", "2", "--log-dir", root / "ds_resumed"]))
    ok(launch(1, DS + ["--train-iters", "6", "--log-dir", root / "ds_reference"]))
    # The megatron engine on one rank: saves 1, 2, crashes saving 3; resumed, re-saves 3, keeps 2 (iter_1 goes).
    out["mg_crash"] = crash(1, ["--train-iters", "3", "--save", root / "mg", "--save-interval", "1",
                                "--log-dir", root / "mg_crashed"], "crash_in_save@3")
    out["mg_after_crash"] = held(root / "mg")
    ok(launch(1, ["--train-iters", "3", "--save", root / "mg", "--load", root / "mg", "--save-interval", "1",
                  "--save-retain", "2", "--log-dir", root / "mg_resumed"]))
    ok(launch(1, ["--train-iters", "3", "--log-dir", root / "mg_reference"]))
    return out


def test_a_crash_during_save_leaves_the_previous_checkpoint_and_resumes_exactly(runs):
    root = runs["root"]
    assert runs["ds_crash"].returncode != 0 and "crashes while saving step 4" in runs["ds_crash"].stdout
    assert runs["ds_after_crash"] == ["iter_0000002", "iter_0000004.tmp", "latest",
                                      "latest_checkpointed_iteration.txt", "zero_to_fp32.py", "zero_to_torch.py"]
    crashed, resumed = losses(root / "ds_crashed"), losses(root / "ds_resumed")
    # A step is logged once its save is done (the record carries the save's time): step 4 died in its save.
    assert sorted(crashed) == [1, 2, 3] and sorted(resumed) == [3, 4, 5, 6]
    assert_same(resumed, losses(root / "ds_reference"))
    assert_same({3: resumed[3]}, crashed)
    # The leftover is cleaned, --save-retain 2 kept the newest two, DeepSpeed's latest names the newest.
    assert [n for n in held(root / "ds") if n.startswith("iter_")] == ["iter_0000004", "iter_0000006"]
    assert (root / "ds" / "latest").read_text() == "iter_0000006"

    assert runs["mg_crash"].returncode != 0 and runs["mg_after_crash"] == [
        "iter_0000001", "iter_0000002", "iter_0000003.tmp", "latest_checkpointed_iteration.txt"]
    assert sorted(losses(root / "mg_resumed")) == [3] and sorted(losses(root / "mg_crashed")) == [1, 2]
    assert_same(losses(root / "mg_resumed"), losses(root / "mg_reference"))
    assert held(root / "mg") == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    manifest = json.loads((root / "mg" / "iter_0000003" / "manifest.json").read_text())
    assert {"common.pt", "metadata.json", ".metadata"} <= set(manifest["files"])


def damaged(runs, tmp_path, source):
    """A copy of a checkpoint directory to damage."""
    shutil.copytree(runs["root"] / source, tmp_path / source)
    return tmp_path / source


def one_line_error(func, *args, **kwargs):
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        func(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_truncated_missing_or_deleted_files_are_named(runs, tmp_path):
    from megatron_ext.engines.deepspeed_checkpoint import checked_checkpoint_tag
    from megatron_ext import checkpoint
    from megatron_ext.checkpoint import files

    mg = damaged(runs, tmp_path, "mg")
    shard = mg / "iter_0000003" / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    line = one_line_error(checkpoint.find, str(mg))
    assert f"{shard} is truncated (100 of" in line and files.TRACKER in line
    shard.write_bytes(whole)
    (mg / "iter_0000003" / "common.pt").unlink()
    assert "common.pt is missing" in one_line_error(checkpoint.find, str(mg))
    shutil.rmtree(mg / "iter_0000003")
    assert "iter_0000003, which is missing" in one_line_error(checkpoint.find, str(mg))
    (mg / files.TRACKER).unlink()  # iter_ directories without a tracker: not a fresh start either
    assert "no latest_checkpointed_iteration.txt" in one_line_error(checkpoint.find, str(mg))
    assert checkpoint.find(str(tmp_path / "nothing")) is None  # nothing there: a first run starts from scratch

    ds = damaged(runs, tmp_path, "ds")
    optim = ds / "iter_0000006" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:-10])
    assert f"{optim} is truncated" in one_line_error(checked_checkpoint_tag, str(ds))
    shutil.rmtree(ds / "iter_0000006")
    assert "iter_0000006, which is missing" in one_line_error(checked_checkpoint_tag, str(ds))
    # Another engine's complete checkpoint: said so, not a fresh start.
    assert "written by --engine deepspeed" in one_line_error(checkpoint.find, str(runs["root"] / "ds"))


class Malicious:
    """Unpickling it would create ``path`` (as ``os.system("touch ...")`` would run anything)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def plant(path, marker):
    """Replace ``path`` by a pickle that would run code, with the manifest's size updated (as an attacker would)."""
    import torch

    if path.name.endswith(".pt"):
        torch.save({"model_shape": Malicious(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(Malicious(marker)))
    manifest_path = next(p / "manifest.json" for p in path.parents if (p / "manifest.json").exists())
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][str(path.relative_to(manifest_path.parent))] = path.stat().st_size
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_that_would_run_code_is_refused(runs, tmp_path):
    from megatron_ext.engines.deepspeed_checkpoint import checked_checkpoint_tag
    from megatron_ext import checkpoint

    marker = tmp_path / "pwned"
    for name in ("common.pt", ".metadata"):
        mg = tmp_path / name / "mg"
        shutil.copytree(runs["root"] / "mg", mg)
        plant(mg / "iter_0000003" / name, marker)
        line = one_line_error(checkpoint.find, str(mg))
        assert "system when unpickled" in line and name in line, line
    ds = damaged(runs, tmp_path, "ds")
    plant(ds / "iter_0000006" / "mp_rank_00_model_states.pt", marker)
    assert "system when unpickled" in one_line_error(checked_checkpoint_tag, str(ds))
    # Through the entry point: one line, exit 2, and nothing ran.
    proc = launch(1, DS + ["--train-iters", "7", "--load", ds, "--save", ds])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "system when unpickled" in proc.stderr.strip().splitlines()[-1]
    assert not marker.exists()


def test_a_save_directory_of_another_run_is_refused(runs, tmp_path):
    from megatron_ext.checkpoint import files

    mg = str(runs["root"] / "mg")
    shape = files.saved_model_shape(os.path.join(mg, "iter_0000003"))
    other = dict(shape, num_layers=1)
    assert "holds checkpoints of another model" in one_line_error(
        files.check_save_dir, mg, load=None, finetune=False, model_shape=other)
    assert "of a run this one does not resume" in one_line_error(
        files.check_save_dir, mg, load=str(tmp_path), finetune=False, model_shape=shape)
    assert "of a run this one does not resume" in one_line_error(
        files.check_save_dir, mg, load=mg, finetune=True, model_shape=shape)
    for load in (mg, os.path.join(mg, "iter_0000002")):  # resuming it (or one of its iterations)
        files.check_save_dir(mg, load=load, finetune=False, model_shape=shape)
    files.check_save_dir(str(tmp_path / "new"), load=None, finetune=False, model_shape=shape)
    # Through the entry point, before anything is built: one line, exit 2; the truncated file likewise.
    proc = launch(1, ["--train-iters", "1", "--num-layers", "1", "--save", mg])
    assert proc.returncode == 2 and "holds checkpoints of another model" in proc.stderr.strip().splitlines()[-1]
    broken = damaged(runs, tmp_path, "mg")
    (broken / "iter_0000003" / "metadata.json").write_text("{")
    proc = launch(1, ["--train-iters", "4", "--load", broken])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "metadata.json is truncated" in proc.stderr.strip().splitlines()[-1]


def test_resaving_an_iteration_leftovers_and_retention(single_rank, tmp_path):
    """In a world of one: the same iteration saved twice is replaced whole; what crashed saves and deletions left
    is removed by the next save; --save-retain never deletes the iteration a tracker names."""
    from megatron_ext.checkpoint import files

    root = tmp_path / "ckpt"
    for content in ("first", "second"):
        staging = files.begin_save(str(root), 5)
        (root / "iter_0000005.tmp" / content).write_text(content)
        assert files.iterations(str(root)) == ([5] if content == "second" else [])
        files.commit_save(str(root), 5, staging)
    assert sorted(os.listdir(root / "iter_0000005")) == ["manifest.json", "second"]
    assert json.loads((root / "iter_0000005" / "manifest.json").read_text())["files"] == {"second": 6}
    (root / "iter_0000007.tmp").mkdir()
    (root / "iter_0000003.del").mkdir()
    for iteration in (6, 8):
        files.commit_save(str(root), iteration, files.begin_save(str(root), iteration))
    assert held(root) == ["iter_0000005", "iter_0000006", "iter_0000008", files.TRACKER]
    (root / files.TRACKER).write_text("5")  # pointed back by hand: kept whatever N says
    files.retain(str(root), 1)
    assert held(root) == ["iter_0000005", "iter_0000008", files.TRACKER]
    assert files.locate(str(root)) == str(root / "iter_0000005")


@pytest.mark.parametrize("flag", ["--save-hf", "--save"])
def test_an_output_other_nodes_do_not_see_is_refused_at_start_up(tmp_path, flag):
    """On node-local disks rank 0's directory is not the other nodes': --save and --save-hf are refused in one line
    on every rank before anything is built (not after training, with the peers waiting); nothing is written."""
    out = tmp_path / "out" / "hf"
    proc = run_ranks(2, ["tests/support/patched.py", "node_local_disk", *COMMON, "--train-iters", "1",
                         "--log-dir", tmp_path / "logs", flag, out], timeout=300, check=False)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # rank 0's, once
    assert len(errors) == 1 and errors[0].startswith(f"error: {flag} {out}: 1 of 2 ranks"), proc.stderr[-3000:]
    assert "every node shares" in errors[0]
    assert os.listdir(tmp_path / "out") == [] and not (tmp_path / "logs" / "metrics.jsonl").exists()
    # the same launch without the planted node-local disk passes the check (one step, the model exported)
    proc = run_ranks(2, [*COMMON, "--train-iters", "1", flag, out], timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert os.listdir(tmp_path / "out") == ["hf"]
