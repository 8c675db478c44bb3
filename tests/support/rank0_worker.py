"""Ranks waiting for rank 0's one-off preparation (``parallel.on_rank0``) in a world whose collectives time out
after 3 s: ``python tests/support/rank0_worker.py MODE`` on 2 ranks (tests/data/test_rank0_wait.py)."""

import datetime
import sys
import time

import torch.distributed as dist

from megatron_ext import parallel
from megatron_ext.errors import ConfigError


def task(mode: str):
    if mode == "config_error":
        raise ConfigError("--data-path x.jsonl: no usable rows")
    if mode == "crash":
        raise ValueError("the tokenizer broke")
    if dist.get_rank() == 0:
        time.sleep(5)  # past the 3 s every collective of this world may take
    return 7


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    try:
        if mode == "default_group":  # the same wait in the world's own group: the control, which times out
            box = [task(mode)]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        else:
            try:
                result = parallel.on_rank0(lambda: task(mode))
            except Exception as e:
                result = f"{type(e).__name__}: {e}"
        print(f"rank {dist.get_rank()}: {result}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
