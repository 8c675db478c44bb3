"""LoRA in one process (``megatron_ext/models/lora.py``): the model starts as its base, merging is exact, the
engines hold buffers and optimizer state for the trainable parameters only, and checkpoints keep the base's names.
TP/SP, PP/VPP, CP, DP and recompute correctness: tests/training/test_parity_megatron.py; DeepSpeed: tests/training/test_deepspeed_engine.py;
end to end: tests/training/test_pretrain_vit.py, tests/convert/test_peft.py (PEFT adapters in and out, resume)."""

import torch

from megatron_ext.mesh import Mesh
from megatron_ext.models import lora
from megatron_ext.models.vit import model as vit
from megatron_ext.models.init import init_mesh_independent

SHAPE = vit.VIT_PRESETS["tiny"]
CONFIG = lora.LoRAConfig(rank=4, alpha=8.0, targets=("qkv", "proj", "fc1", "fc2"))


def model():
    chunk = vit.ViTClassifier(vit.transformer_config(SHAPE, Mesh(world=1)), SHAPE, 10)
    init_mesh_independent([chunk], 7)
    return chunk


def test_starts_as_base_and_merges_exactly(single_rank):
    pixels = torch.randn(3, 3, SHAPE.image_size, SHAPE.image_size)
    chunk = model()
    plain = chunk(pixels)
    lora.apply([chunk], CONFIG, seed=7)
    assert torch.equal(chunk(pixels), plain), "B starts at zero: the adapted model is the base model"
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if "lora_b" in name:
                param.normal_(0.0, 0.2)
    adapted = chunk(pixels)
    assert (adapted - plain).abs().max() > 1e-2
    lora.merge([chunk])
    assert not any(".lora_" in name for name, _ in chunk.named_parameters())
    torch.testing.assert_close(chunk(pixels), adapted, rtol=1e-5, atol=1e-5)


def test_only_trainable_parameters_get_buffers_and_optimizer_state(single_rank):
    from support import engines

    chunk = model()
    lora.apply([chunk], CONFIG, seed=7)
    trainable = {id(p) for p in chunk.parameters() if p.requires_grad}
    names = [n for n, p in chunk.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n or n.startswith("head.") for n in names)
    engine = engines.build([chunk], torch.device("cpu"), vit.forward_step, Mesh(world=1), micro_batch_size=2,
                           seq_length=SHAPE.seq_length, lr=1e-3)
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == trainable
    buffered = sum(b.numel_unpadded for m in engine.model for b in m.buffers)
    assert buffered == sum(p.numel() for p in chunk.parameters() if p.requires_grad)


def test_checkpoint_names_are_the_base_names_plus_adapters(single_rank):
    plain = set(model().state_dict())
    chunk = model()
    lora.apply([chunk], CONFIG, seed=7)
    adapted = chunk.state_dict()
    assert set(adapted) - plain == {k for k in adapted if ".lora_" in k} and plain <= set(adapted)
    assert set(chunk.sharded_state_dict()) - {k for k in adapted if ".lora_" in k} == set(model().sharded_state_dict())
    again = model()
    lora.apply([again], CONFIG, seed=8)
    again.load_state_dict(adapted)  # torch's own names round-trip through the wrapper
    loaded = again.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in adapted.items() if torch.is_tensor(v))
