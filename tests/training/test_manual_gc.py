"""Manual garbage collection (``--manual-gc``, on by default; ``training/loop.manual_gc``): Python's automatic
collector is off while the loop runs, and every rank collects at the same steps, timed as the step's "gc" part.
Without it each rank pauses for a collection when its own allocation count says so, and on a big mesh every
collective waits for the slowest rank's pause (Megatron-LM's --manual-gc; torchtitan collects every 50 steps)."""

import gc
import json
import re

import pytest

from support.ranks import run_ranks

RUN = ["tests/support/patched.py", "count_gc", "pretrain_gpt.py", "--model", "tiny", "--mock-data", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "0"]


def test_the_collector_is_off_inside_and_restored_after():
    from megatron_ext.training.loop import manual_gc

    assert gc.isenabled()
    started = []
    with manual_gc(3):
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # what existed before is frozen
        gc.callbacks.append(lambda phase, info: started.append(info) if phase == "start" else None)
        try:
            junk = [[i] for i in range(50_000)]  # far past generation 0's threshold (700): no automatic collection
        finally:
            gc.callbacks.pop()
        del junk
    assert not started
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(KeyError), manual_gc(3):
        raise KeyError("a failing run")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with manual_gc(None):
        assert gc.isenabled()


@pytest.mark.parametrize("flags, young, full, collected_at", [
    (["--manual-gc-interval", "2"], 0, 3, [2, 4]),  # the freeze's collection, then steps 2 and 4
    (["--no-manual-gc"], None, None, []),
])
def test_a_run_collects_only_at_its_interval(tmp_path, flags, young, full, collected_at):
    proc = run_ranks(1, RUN + flags + ["--log-dir", str(tmp_path)])
    counted = re.search(r"collections while training: (\d+) young, (\d+) full", proc.stdout)
    if young is None:  # Python's own collector ran while training: the control
        assert int(counted[1]) > 0
    else:
        assert (int(counted[1]), int(counted[2])) == (young, full)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["gc_time"] > 0] == collected_at
    assert all(r["gc_time"] == 0.0 for r in records if r["step"] not in collected_at)
