"""Activation recomputation (``--recompute-granularity full``, ``models/spec.Recompute``): uniform groups and
Megatron-LM's block method rerun exactly the layers they name in backward, and every variant computes the loss and
gradients of no recomputation (one rank, fp32, the tiny Qwen)."""

import dataclasses

import pytest
import torch

from megatron_ext.arguments import parse
from megatron_ext.errors import ConfigError
from megatron_ext.models.spec import Recompute


def step(recompute: Recompute):
    """One forward and backward of the tiny Qwen (4 layers) built under ``recompute``: the loss, every gradient,
    and how often each layer's forward ran (twice: recomputed in backward)."""
    from megatron_ext.mesh import Mesh
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent
    from megatron_ext.models.qwen.shape import PRESETS

    shape = dataclasses.replace(PRESETS["tiny"], num_layers=4)
    model = qwen.build_qwen(qwen.transformer_config(shape, Mesh(world=1), recompute=recompute), shape,
                            vocab_size=qwen.padded_vocab_size(shape.vocab_size, 128, 1))
    init_mesh_independent([model], 1)
    calls = [0] * shape.num_layers
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(0, shape.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], torch.arange(16).expand(2, 16), None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("recompute, rerun", [
    (Recompute("full", "uniform", 2), [0, 1, 2, 3]),
    (Recompute("full", "block", 1), [0]),
    (Recompute("full", "block", 3), [0, 1, 2]),
    (Recompute("selective"), []),
], ids=["uniform2", "block1", "block3", "selective"])
def test_recomputation_reruns_the_chosen_layers_and_changes_nothing(single_rank, recompute, rerun):
    loss, grads, calls = step(recompute)
    reference_loss, reference, once = step(Recompute())
    assert once == [1, 1, 1, 1] and [i for i, n in enumerate(calls) if n == 2] == rerun and set(calls) <= {1, 2}
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("flags, says", [
    ("--recompute-method block", "--recompute-method block chooses which layers full recompute checkpoints; add "
                                 "--recompute-granularity full"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 5",
     "--recompute-num-layers 5 exceeds the 4 layers of each pipeline chunk"),
    ("--recompute-granularity full --recompute-num-layers 3", "--recompute-num-layers 3 must divide the 4 layers"),
])
def test_recompute_flags_that_cannot_work_are_refused(flags, says):
    with pytest.raises(ConfigError, match=says):
        parse(flags.split(), world_size=1)


def test_block_takes_any_count_up_to_the_chunk():
    run = parse("--recompute-granularity full --recompute-method block --recompute-num-layers 3".split(),
                world_size=1)
    assert Recompute.of(run.training).config_fields() == dict(recompute_granularity="full", recompute_method="block",
                                                             recompute_num_layers=3)
