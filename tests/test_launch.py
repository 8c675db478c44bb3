"""megatron_ext.launch, the torchrun every launcher starts, as a newcomer meets it (examples/cpu_quickstart.sh):
a mistake is one line of ours and exit 2, caught before any rank starts where the flags show it; a rank that fails
later is named once, never under torchrun's traceback. SIGTERM is test_async_save.py's, two Slurm "nodes"
test_multinode.py's."""

import os
import subprocess
import time

import pytest

from conftest import REPO, free_port
from launcher_commands import clean_env

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
                                 MEGATRON_EXT_FAULTS="die@2:1")
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
