"""The repository's promises: README's commands are the ones CI and users run, and the quickstart trains."""

import json
import os
import re

from conftest import REPO, run_ranks


def readme_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    quickstart, tests = readme_commands()
    assert quickstart == "bash examples/cpu_quickstart.sh"
    ci = open(os.path.join(REPO, ".ci/run")).read().strip().splitlines()[-1]
    assert ci == tests


def test_quickstart_mesh_trains(tmp_path):
    """finetune_qwen.py end to end on the quickstart's TP2 x PP2 mesh: metrics per step, loss falls."""
    run_ranks(4, ["finetune_qwen.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "64", "--train-iters", "8",
                  "--lr", "3e-3", "--log-dir", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.15
    assert all(r["tokens_per_sec"] > 0 and r["grad_norm"] > 0 for r in records)
