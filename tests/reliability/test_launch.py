"""megatron_ext.launch, the torchrun every launcher starts, as a newcomer meets it (examples/cpu_quickstart.sh):
a mistake is one line of ours and exit 2, caught before any rank starts where the flags show it; a rank that fails
later is named once, never under torchrun's traceback. SIGTERM is test_async_save.py's, two Slurm "nodes"
test_multinode.py's."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from support import REPO, faults
from support.ranks import free_port
from support.launcher_commands import clean_env

from megatron_ext import launch

SMALL = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seq-length", "64",
         "--eval-interval", "0"]


def quickstart(*flags, **env):
    start = time.monotonic()
    proc = subprocess.run(["bash", "examples/cpu_quickstart.sh", *map(str, flags)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=clean_env(MASTER_PORT=free_port(), OMP_NUM_THREADS=1, **env))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def errors(output):
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("flags, env, says", [
    (["--data-format", "nope"], {}, "argument --data-format: invalid choice: 'nope'"),
    (["--data-path", "examples/data/nope.jsonl"], {}, "--data-path examples/data/nope.jsonl: no such file"),
    ([], {"GPUS_PER_NODE": 3}, "world size 3 is not divisible by TP x PP x CP = 2 x 2 x 1 = 4"),
    (["--global-batch-size", "6"], {"GPUS_PER_NODE": 8}, "--global-batch-size 6"),
    ([], {"NNODES": 2, "NODE_RANK": 1, "GPUS_PER_NODE": 2}, "NNODES=2 NODE_RANK=1 with MASTER_ADDR=127.0.0.1"),
], ids=["flag", "missing_file", "world", "global_batch", "second_node_on_loopback"])
def test_bad_input_is_one_line_before_any_rank_starts(flags, env, says, tmp_path):
    """Checked once in one process: the whole output is that line, exit 2, in seconds (every rank starting first
    took 12-22 s), and no rank ran (nothing written to the log directory)."""
    code, output, took = quickstart(*flags, "--log-dir", tmp_path / "log", **env)
    assert code == 2 and [line.strip() for line in output.splitlines() if line.strip()] == errors(output), output
    assert len(errors(output)) == 1 and says in output and took < 30, (output, took)
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("script, flags, says", [
    ("pretrain_vit.py", ["--data-path", "examples/data/nope.parquet"], "--data-path examples/data/nope.parquet: no such"),
    ("pretrain_gpt.py", ["--data-path", "data/corpus_text_document"], "data/corpus_text_document.idx is missing"),
    ("pretrain_gpt.py", ["--data-path", "./nope.txt"], "--data-path ./nope.txt: no such file"),
    ("tools/verify_model.py", [], "tools/verify_model.py checks a model against transformers: give --pretrained"),
])
def test_every_entry_point_checks_its_data_files_before_the_ranks(script, flags, says, tmp_path):
    """The single-process check covers each family's local data (ViT images, GPT-2 text and prefixes) and the parity
    card's flags: its line names no rank (no rank started)."""
    proc = subprocess.run(["python", "-m", "megatron_ext.launch", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), script, "--model", "tiny", *flags, "--log-dir", str(tmp_path / "log")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=clean_env(PATH=os.path.join(REPO, ".venv", "bin") + os.pathsep + os.environ["PATH"]))
    assert proc.returncode == 2 and errors(proc.stdout + proc.stderr) == [line for line in (
        proc.stdout + proc.stderr).splitlines() if line.strip()] and says in proc.stderr, proc.stdout + proc.stderr
    assert ": rank " not in proc.stderr and not (tmp_path / "log").exists(), proc.stderr


def test_a_rank_that_fails_later_is_named_once(tmp_path):
    """Bad input only the data can show (a row that is not JSON, --bad-rows error): every rank raises it, the launcher
    prints it once, exit 2. A rank that dies without a word (crash, os._exit) is named as the cause before the
    failed collectives of the others, exit 1. Neither shows torchrun's traceback."""
    data = tmp_path / "broken.jsonl"
    data.write_text(open(os.path.join(REPO, "examples/data/metamathqa_sample.jsonl")).readline() + "{not json\n")
    code, output, _ = quickstart(*SMALL, "--data-path", data, "--bad-rows", "error", "--train-iters", 2,
                                 "--log-dir", tmp_path / "a", GPUS_PER_NODE=2)
    (line,) = errors(output)
    assert code == 2 and line.startswith("error: finetune_qwen.py: rank ") and f"{data}" in line, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]

    code, output, _ = quickstart(*SMALL, "--train-iters", 4, "--log-dir", tmp_path / "b", GPUS_PER_NODE=2,
                                 **faults.env("die@2:1"))
    assert code == 1 and errors(output)[-1] == ("error: finetune_qwen.py: rank 1 ended (exit status 1) without a "
                                                "word of ours; its output is above"), output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]


class _Failure:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_the_first_failure_is_bad_input_then_a_silent_death_then_the_earliest_line():
    collective = {"rank": 0, "code": 1, "time": 5.0, "line": "rank 0: a collective failed at step 2"}
    bad = {"rank": 3, "code": 2, "time": 9.0, "line": "--data-path x: line 2 is not JSON"}
    nan = {"rank": 2, "code": 1, "time": 4.0, "line": "step 2: non-finite loss"}
    failures = {r: _Failure(1) for r in range(4)}
    assert launch.first_failure(failures, {0: collective, 3: bad}) == "rank 3: --data-path x: line 2 is not JSON"
    assert launch.first_failure(failures, {0: collective, 2: nan}) == \
        "rank 1 ended (exit status 1) without a word of ours; its output is above"
    failures[1], failures[3] = _Failure(-15), _Failure(-15)  # stopped by torchrun after the first failure
    assert launch.first_failure(failures, {0: collective, 2: nan}) == "rank 2: step 2: non-finite loss"
    assert launch.first_failure({1: _Failure(-9)}, {}) == \
        "rank 1 ended (killed by SIGKILL) without a word of ours; its output is above"


@pytest.mark.parametrize("argv, backend, endpoint, port", [
    (["--nproc-per-node", "2"], "c10d", "localhost:0", 29500),  # one node, no port: a free one, as torchrun picks
    (["--standalone", "--nproc-per-node", "2"], "c10d", "localhost:0", 29500),
    (["--nproc-per-node", "2", "--master-port", "1234"], "static", "", 1234),
    (["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"], "static", "", 29500),
], ids=["no_port", "standalone", "port", "two_nodes"])
def test_torchruns_own_defaults_are_applied(argv, backend, endpoint, port, monkeypatch):
    """What torchrun's run() settles before launching (the launcher calls its agent directly): without them a plain
    ``--nproc-per-node 2`` failed on "127.0.0.1:None"."""
    from torch.distributed.run import parse_args

    for name in ("MASTER_PORT", "MASTER_ADDR", "PET_MASTER_PORT", "PET_STANDALONE", "PET_NNODES"):
        monkeypatch.delenv(name, raising=False)
    args = launch._torchrun_defaults(parse_args([*argv, "train.py"]))
    assert (args.rdzv_backend, args.rdzv_endpoint, args.master_port) == (backend, endpoint, port)


def test_a_rank_stopped_by_torchrun_is_not_blamed():
    """torchrun kills the ranks left in a collective after the first failure (SIGTERM, SIGKILL after its grace):
    the rank that raised is named, not the one killed first; with no line at all the killed rank is named."""
    raised = {"rank": 1, "code": 1, "time": 3.0, "line": "rank 1: RuntimeError: boom (traceback above)"}
    assert launch.first_failure({0: _Failure(-9), 1: _Failure(1)}, {1: raised}) == raised["line"]
    assert launch.first_failure({0: _Failure(-15), 1: _Failure(1)}, {1: raised}) == raised["line"]
    assert launch.first_failure({0: _Failure(-9), 1: _Failure(-15)}, {}).startswith("rank 0 ended (killed by SIGKILL)")
    assert launch.first_failure({0: _Failure(-11), 1: _Failure(1)}, {1: raised}).startswith(
        "rank 0 ended (killed by SIGSEGV)")  # a crash of its own still comes first


def test_status_lines_are_written_whole(tmp_path, monkeypatch):
    """A rank's line for the launcher goes to a temporary file renamed into place: a rank killed while writing
    leaves no half line (the rename never happened), and a finished write leaves only the line."""
    import json

    from megatron_ext import cli

    monkeypatch.setenv(cli.STATUS_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed mid-write")))
    with pytest.raises(KeyboardInterrupt):
        cli._report(1, "a long line", False)
    assert launch._statuses(str(tmp_path)) == {}  # (the .tmp is not a status)
    monkeypatch.undo()
    monkeypatch.setenv(cli.STATUS_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    cli._report(1, "a long line", False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3.json"]
    assert json.loads((tmp_path / "rank3.json").read_text())["line"] == "a long line"


def test_torchruns_signals_to_handle_is_honoured_without_ours(monkeypatch):
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    default = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert launch._agent_signals(["--nproc-per-node", "2", "x.py"], default) == "SIGINT,SIGHUP,SIGQUIT"
    assert launch._agent_signals(["--signals-to-handle", "SIGINT,SIGHUP", "x.py"], "SIGINT,SIGHUP") == "SIGINT,SIGHUP"
    with pytest.raises(ValueError, match="SIGTERM is megatron_ext.launch's"):
        launch._agent_signals(["--signals-to-handle=SIGINT,SIGTERM", "x.py"], "SIGINT,SIGTERM")


def test_an_internal_error_names_its_own_cause():
    try:
        try:
            raise ConnectionRefusedError("[Errno 111] connection refused by node 1")
        except OSError as e:
            raise RuntimeError("the agent could not start its workers") from e
    except RuntimeError as e:
        said = launch._reason(e)
    assert said == ("RuntimeError: the agent could not start its workers (caused by ConnectionRefusedError: "
                    "[Errno 111] connection refused by node 1)")


LAUNCH = [sys.executable, "-m", "megatron_ext.launch"]
TINY = ["finetune_qwen.py", "--model", "tiny", "--mock-data", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--seq-length", "64", "--train-iters", "40"]


def signalled(tmp_path, torchrun, sig, when):
    """The launcher with ``torchrun`` options and the tiny run, ``sig`` sent to it at the moment ``when`` (a
    predicate on its child processes' environments, or seconds); (exit status, output lines, seconds from the
    signal to its end, processes of its session left, steps logged, step saved)."""
    import json

    import psutil

    command = [*LAUNCH, *torchrun, "--master-port", str(free_port()), *TINY, "--save", str(tmp_path / "ckpt"),
               "--log-dir", str(tmp_path / "log")]
    proc = subprocess.Popen(command, cwd=REPO, env=clean_env(OMP_NUM_THREADS=1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    start = time.monotonic()
    while not isinstance(when, float) and time.monotonic() - start < 120:
        try:
            envs = [c.environ() for c in psutil.Process(proc.pid).children()]
        except psutil.Error:
            envs = []
        if when(envs):
            break
        time.sleep(0.01)
    if isinstance(when, float):
        time.sleep(when)
    sent = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    left = [p.pid for p in psutil.process_iter() if p.pid != proc.pid and _session(p) == proc.pid]
    log, tracker = tmp_path / "log" / "metrics.jsonl", tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, out.splitlines(), took, left, steps, tracker.read_text() if tracker.exists() else None


def _session(process):
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


def preflight_running(envs):
    return any("MEGATRON_EXT_PREFLIGHT" in env for env in envs)


def ranks_starting(envs):
    return len([env for env in envs if "RANK" in env and "MEGATRON_EXT_PREFLIGHT" not in env]) == 2


def ranks_holding(envs):
    ranks = [env for env in envs if "RANK" in env and "MEGATRON_EXT_PREFLIGHT" not in env]
    return len(ranks) == 2 and len(glob.glob(os.path.join(ranks[0]["MEGATRON_EXT_STATUS_DIR"], "ready.*"))) == 2


@pytest.mark.parametrize("torchrun, sig, when", [
    (["--nproc-per-node", "2"], signal.SIGTERM, preflight_running),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--nproc-per-node", "2"], signal.SIGTERM,
     6.0),
], ids=["flag_check", "rendezvous_alone"])
def test_a_signal_before_any_rank_runs_ends_the_launch_at_once(tmp_path, torchrun, sig, when):
    """During the single-process flag check, or node 0 of two waiting alone for its rendezvous (SIGTERM after 6 s:
    still waiting 31 s later before): one line, ended within 10 s, exit 0, no process of the launch left."""
    code, lines, took, left, steps, saved = signalled(tmp_path, torchrun, sig, when)
    assert code == 0 and took < 10 and left == [] and steps == [] and saved is None, (code, took, left, lines)
    assert len(lines) <= 3 and lines[-1] == "megatron_ext.launch: SIGTERM before any rank started: nothing to save; " \
                                            "stopped", lines


@pytest.mark.parametrize("sig, when", [(signal.SIGUSR1, ranks_starting), (signal.SIGTERM, ranks_holding)],
                         ids=["usr1_while_ranks_import", "term_before_the_loop"])
def test_a_signal_before_the_loop_saves_after_the_first_step_and_exits_0(tmp_path, sig, when):
    """Ranks still importing (the launcher passes the signal on once each holds it) or up and preparing, before
    their first step (Slurm's --signal=USR1 lands there too; it killed them, exit 1): the run stops after step 1,
    saved, exit 0, nothing left."""
    code, lines, took, left, steps, saved = signalled(tmp_path, ["--nproc-per-node", "2"], sig, when)
    assert code == 0 and steps == [1] and saved == "1" and left == [], (code, steps, saved, lines[-10:])
    assert sum(f"received {sig.name} outside the training loop: held" in line for line in lines) == 2, lines


def test_a_signal_during_the_final_save_lets_it_complete(tmp_path):
    """The run's last save written slowly (the ``slow_save`` fault: 4 s in the writer), SIGTERM while it is being
    written: each rank notes it once, the save completes and commits, exit 0."""
    def writing(envs):
        return (tmp_path / "ckpt" / "iter_0000002.tmp").exists()

    run = [*LAUNCH, "--nproc-per-node", "2", "--master-port", str(free_port()), *TINY[:-1], "2",
           "--save", str(tmp_path / "ckpt"), "--save-interval", "100"]
    proc = subprocess.Popen(run, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(OMP_NUM_THREADS=1, **faults.env("slow_save@2"),
                                          MEGATRON_EXT_SLOW_SAVE_SECONDS="4"))
    start = time.monotonic()
    while not writing(None) and time.monotonic() - start < 120:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2", out[-3000:]
    assert out.count("received SIGTERM") == 2 and "Traceback" not in out, out[-3000:]  # (each rank once)
