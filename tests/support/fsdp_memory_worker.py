"""Peak host memory of building a GPT-2 under --engine fsdp (deferred: meta device, then each rank's shards only).

``python tests/support/fsdp_memory_worker.py OUT.json MODEL`` on 1 or N ranks: every rank samples its resident memory while
the model is built and FSDPEngine shards and initialises it, and reports the peak increase, the bytes of parameters
it holds and the full model's bytes.
"""

import json
import os
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402
from support import engines  # noqa: E402


def main(out_path: str, model: str) -> None:
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.gpt2 import model as gpt2
    from megatron_ext.models.gpt2.shape import GPT2_PRESETS

    device = parallel.init_distributed("gloo")
    mesh = Mesh(world=dist.get_world_size())
    parallel.init_model_parallel(mesh, seed=1)
    shape = GPT2_PRESETS[model]
    config = gpt2.transformer_config(shape, mesh)
    process, peak, done = psutil.Process(), [0], threading.Event()
    base = process.memory_info().rss

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with torch.device("meta"):
        chunk = gpt2.build_gpt2(config, shape, vocab_size=50304)
    engine = engines.build([chunk], device, forward_step, mesh, engine="fsdp", seed=1, lr=1e-4)
    done.set()
    sampler.join()
    params = list(engine.module.parameters())
    mine = dict(peak_increase=peak[0] - base, local_bytes=sum(p.to_local().numel() * 4 for p in params),
                full_bytes=sum(p.numel() * 4 for p in params),
                largest_bytes=max(p.numel() for p in params) * 4)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
