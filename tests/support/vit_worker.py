"""ViT logits under TP2 and PP2 on two CPU ranks: ``torchrun --nproc-per-node 2 tests/support/vit_worker.py HF_DIR
PIXELS.pt OUT.pt [MCORE_DIR]``. Converts the HF checkpoint with the ViT table, loads each rank's shards
(models/sharding.py), runs the forward pass (megatron-core's forward-only schedule, as tools/verify_model.py does)
and saves the last stage's logits per layout. With MCORE_DIR (tools/convert_hf_to_mcore.py's output) each layout, TP1 too, loads
that distributed checkpoint instead; with ``hf`` the --pretrained loader reads HF_DIR straight into the shards (a
headless backbone gets an identity head of width ``hidden``: its "logits" are ViTModel's class-token features)."""

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # megatron_ext and support, run as a script

from support import thread_guard  # noqa: E402
from megatron_ext import parallel  # noqa: E402
from megatron_ext.mesh import Mesh  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}


def logits_under(mesh: Mesh, load, shape, pixels, num_labels: int):
    """The last stage's logits (None elsewhere) through tools/verify_model.py's forward (convert/verify.py)."""
    from megatron.core import parallel_state

    from megatron_ext.convert import verify
    from megatron_ext.models.vit import model as vit

    parallel.init_model_parallel(mesh, seed=0)
    thread_guard.check(f"building {mesh.describe()}")
    model = vit.ViTClassifier(vit.transformer_config(shape, mesh), shape, num_labels,
                              pre_process=parallel_state.is_pipeline_first_stage(),
                              post_process=parallel_state.is_pipeline_last_stage())
    load(model)
    return verify.image_outputs([model], pixels, shape.seq_length)


def main(hf_dir: str, pixels_path: str, out_path: str, mcore_dir: Optional[str] = None) -> None:
    from megatron.core import dist_checkpointing
    from support.hf_fixtures import tensors

    from megatron_ext.models import hf_rules
    from megatron_ext.models.vit import hf as convert
    from megatron_ext.models.vit import model as vit
    from megatron_ext.models.sharding import load_full_state

    parallel.init_distributed("gloo")
    shape = vit.vit_shape_from_hf_config(hf_dir)
    if mcore_dir == "hf":
        from megatron_ext.convert import pretrained

        def load(model):
            fresh = pretrained.load(pretrained.HFWeights(hf_dir, shape, 0), [model],
                                    replaceable={"head.weight", "head.bias"})
            if fresh and model.post_process:
                with torch.no_grad():
                    model.head.weight.copy_(torch.eye(shape.hidden_size))

        reader = pretrained.SafetensorsReader(hf_dir)
        classes = (reader.get("classifier.weight").shape[0] if "classifier.weight" in reader.weight_map
                   else shape.hidden_size)
        layouts = {"tp1": dict(), **LAYOUTS}
        results = {name: logits_under(Mesh(world=2, **sizes), load, shape, torch.load(pixels_path), classes)
                   for name, sizes in layouts.items()}
        gathered = [None, None]
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            torch.save({name: next(part[name] for part in reversed(gathered) if part[name] is not None)
                        for name in layouts}, out_path)
        parallel.teardown()
        return
    saved = tensors(hf_dir)
    state = hf_rules.hf_to_mcore(convert, saved, shape)
    layouts, load = LAYOUTS, lambda model: load_full_state([model], state)
    if mcore_dir:
        layouts = {"tp1": dict(), **LAYOUTS}
        load = lambda model: model.load_state_dict(  # noqa: E731
            dist_checkpointing.load({"model": model.sharded_state_dict()}, mcore_dir)["model"])
    pixels = torch.load(pixels_path)
    results = {}
    for name, sizes in layouts.items():
        logits = logits_under(Mesh(world=2, **sizes), load, shape, pixels, saved["classifier.weight"].shape[0])
        gathered = [None, None]
        dist.all_gather_object(gathered, logits)
        results[name] = next(t for t in reversed(gathered) if t is not None)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    parallel.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
