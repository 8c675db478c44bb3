"""The CPU adaptation of megatron-core: what it redirects, and that it fails loudly when megatron-core changes."""

import sys

import pytest
import torch

from megatron_ext.platform import cpu

cpu.install()


def test_megatron_modules_see_the_cpu_view():
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.pipeline_parallel.schedules as schedules

    assert layers.torch is cpu.TORCH_ON_CPU and schedules.torch is cpu.TORCH_ON_CPU
    assert torch.cuda is not cpu.TORCH_ON_CPU.cuda, "the real torch must stay untouched"


def test_modules_imported_later_get_the_view_too():
    name = "megatron.core.models.bert.bert_model"
    assert name not in sys.modules
    __import__(name)
    assert sys.modules[name].torch is cpu.TORCH_ON_CPU


def test_cuda_requests_land_on_cpu():
    view = cpu.TORCH_ON_CPU
    for device in ("cuda", "cuda:1", 0, torch.device("cuda"), view.cuda.current_device()):
        assert view.zeros(2, device=device).device.type == "cpu"
    assert view.empty(3, device="cuda", pin_memory=True).device.type == "cpu"
    with view.cuda.stream(view.cuda.Stream()):
        view.cuda.current_stream().wait_stream(view.cuda.Stream())
    view.cuda.nvtx.range_push("x")
    view.cuda.nvtx.range_pop()


def test_cuda_rng_tracker_uses_the_cpu_generator():
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-stream", 7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("test-stream"):
        forked = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    torch.manual_seed(7)
    assert torch.equal(forked, torch.rand(3)), "the forked stream must be the one seeded with 7"


@pytest.mark.parametrize("module, owner, attr, replacements", cpu.SOURCE_PATCHES)
def test_every_source_patch_is_applied(module, owner, attr, replacements):
    target = getattr(sys.modules[module], owner) if owner else sys.modules[module]
    patched = cpu.PATCHED[f"{module}.{(owner + '.') if owner else ''}{attr}"]
    assert target.__dict__[attr] is patched


def test_source_patch_refuses_when_megatron_changed():
    """An upgrade that moves patched code must stop us at install time, not silently skip the patch."""
    import megatron.core.optimizer.clip_grads as clip_grads

    with pytest.raises(RuntimeError, match="megatron-core changed"):
        cpu._replace_in_source(clip_grads, "clip_grad_by_total_norm_fp32", [("text that is not there", "x")])


def test_pinned_megatron_core():
    import megatron.core

    assert megatron.core.__version__ == "0.16.1", "platform/cpu.py was measured against megatron-core 0.16.1"
