"""Rank 0's one-off preparation (tokenizing an SFT set, a pretraining corpus, downloading images, converting a
DeepSpeed checkpoint: ``parallel.on_rank0``) may take longer than --distributed-timeout-minutes; the other ranks
wait for it in a gloo group of their own with a 12-hour timeout, and its failure reaches every rank. SFT sets of
more than four 4,096-record chunks are tokenized in parallel processes, to the same cache."""

import os

import pytest
import torch

from support.ranks import run_ranks


def launch(mode: str):
    return run_ranks(2, ["tests/support/rank0_worker.py", mode], timeout=120, check=False)


def test_ranks_wait_past_the_collective_timeout_for_rank_0():
    proc = launch("slow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0: 7" in proc.stdout and "rank 1: 7" in proc.stdout
    control = launch("default_group")  # the same 5 s wait in the world's group, whose collectives time out at 3 s
    assert control.returncode != 0 and "rank 1: 7" not in control.stdout


@pytest.mark.parametrize("mode, line", [
    ("config_error", "ConfigError: --data-path x.jsonl: no usable rows"),
    ("crash", "RuntimeError: rank 0 failed preparing this run: ValueError: the tokenizer broke"),
])
def test_rank_0s_failure_reaches_every_rank(mode, line):
    proc = launch(mode)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"rank 1: {line}" in proc.stdout, proc.stdout
    assert "rank 0: " in proc.stdout


def test_parallel_tokenizing_builds_the_same_samples(monkeypatch):
    """The shipped MetaMathQA sample in chunks of 256 records, 160-token samples (some cut): 1 process and 3 give
    the same arrays, packed or not (the pool keeps the records' order)."""
    from megatron_ext.data import sft

    monkeypatch.setattr(sft, "TOKENIZE_CHUNK", 256)
    tokenizer_path = "examples/tokenizers/tiny-qwen"
    tokenizer = sft.load_tokenizer(tokenizer_path)
    records, _ = sft.load_records("examples/data/metamathqa_sample.jsonl", "skip", sft.chat.RowFormat())
    assert len(records) >= 8 * 256 and sft.tokenizing_processes(4 * 256 - 1) == 1
    assert sft.tokenizing_processes(len(records)) == min(32, len(os.sched_getaffinity(0)))
    for pack in (False, True):
        one, counts = sft._sample_arrays(tokenizer, records, None, 160, pack, workers=1)
        three, counts3 = sft._sample_arrays(tokenizer, records, None, 160, pack, tokenizer_path=tokenizer_path,
                                            workers=3)
        assert counts == counts3 and counts["truncated"] > 0
        assert all(torch.equal(one[key], three[key]) for key in one), pack
