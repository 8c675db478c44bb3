"""The torch stand-ins for apex/TE kernels (megatron_ext/platform/kernels.py) and the sync-free packed RoPE compute
what they replace; the engine's step issues no host sync per micro-batch.

fp32 on CPU. The GPU tier (tests/gpu/test_gpu_megatron.py) repeats the fused-vs-unfused comparison in bf16 on CUDA,
where the weight-gradient accumulation takes cuBLAS's fp32-output path.
"""

import os
import sys

import pytest
import torch

import megatron_ext
from megatron_ext.platform import kernels

OURS = os.path.dirname(megatron_ext.__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep


def test_wgrad_accumulation_matches_add():
    g = torch.Generator().manual_seed(0)
    x, gout = torch.randn(64, 24, generator=g), torch.randn(64, 40, generator=g)
    main_grad = torch.randn(40, 24, generator=g)
    expected = main_grad + gout.t() @ x
    kernels.TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, gout, main_grad)
    torch.testing.assert_close(main_grad, expected, rtol=1e-6, atol=1e-5)
    bf16 = torch.zeros(40, 24, dtype=torch.bfloat16)
    kernels.TorchWgradAccumulation.wgrad_gemm_accum_fp16(x.bfloat16(), gout.bfloat16(), bf16)
    torch.testing.assert_close(bf16.float(), gout.t() @ x, rtol=2e-2, atol=0.5)


def test_foreach_norm_and_scale_match_megatron_fallbacks(single_rank):
    from megatron.core import utils

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=g) for n in (3, 100, 7, 1)]
    ours, _ = kernels.foreach_l2_norm(0, None, [grads], False)
    theirs, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    torch.testing.assert_close(ours, theirs.to(ours.device), rtol=1e-6, atol=0)
    scaled = [t.clone() for t in grads]
    kernels.foreach_scale(0, None, [scaled, scaled], 0.25)
    copies = [torch.empty_like(t) for t in grads]
    kernels.foreach_scale(0, None, [grads, copies], 1.0)
    for t, s, c in zip(grads, scaled, copies):
        assert torch.equal(s, t * 0.25) and torch.equal(c, t)


def test_rope_is_bit_identical_to_megatron_core(single_rank):
    """Our cached RoPE (plain and packed) against megatron-core's own functions: bit-identical, for documents of
    uneven lengths (where megatron-core's packed RoPE is right: max_seqlen below the token count), in fp32 and
    bf16, and a second call with other documents or frequencies is not served from the cache."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_ext.models import rope

    rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is rope.packed_rope
    assert rope_utils._apply_rotary_pos_emb_bshd is rope.rope_bshd
    megatron_thd, megatron_bshd = rope._MEGATRON["thd"], rope._MEGATRON["bshd"]
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)(20)  # [20, 1, 1, 16]
    cp = parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(40, 3, 16, generator=g).to(dtype)
        plain = torch.randn(20, 2, 3, 16, generator=g).to(dtype)
        assert torch.equal(rope.rope_bshd(plain, freqs), megatron_bshd(plain, freqs))
        part = plain[..., :8], freqs[..., :4]  # rotary on half of the head dims: a pass-through part
        assert torch.equal(rope.rope_bshd(*part), megatron_bshd(*part))
        for cu in ([0, 5, 12, 20, 23, 40], [0, 17, 20, 40]):
            cu = torch.tensor(cu, dtype=torch.int32)
            for _ in range(2):  # the second call is served from the cache
                assert torch.equal(rope.packed_rope(t, cu, freqs, cp_group=cp), megatron_thd(t, cu, freqs, cp_group=cp))



def test_compiled_rope_rotation_is_one_kernel_and_equals_eager():
    """What CUDA runs (the rotation ``torch.compile``d, here by Inductor's CPU backend): the same values forward and
    backward as eager, the forward one fused kernel call where eager dispatches five operators."""
    import re

    from torch._inductor.utils import run_and_get_code

    from megatron_ext.models import rope
    from megatron_ext.platform import kernels

    g = torch.Generator().manual_seed(0)
    t = torch.randn(20, 2, 3, 16, generator=g, requires_grad=True)
    cos_, sin_ = torch.randn(20, 1, 1, 16, generator=g), torch.randn(20, 1, 1, 16, generator=g)
    weights = torch.randn(20, 2, 3, 16, generator=g)
    torch._dynamo.reset()
    results = []
    eager, options = rope._rotate.__wrapped__, kernels.COMPILE
    for function in (rope._rotate, torch.compile(eager, **options)):  # a CPU call of ours: eager
        out = function(t, cos_, sin_, False)
        (out * weights).sum().backward()
        results.append((out.detach(), t.grad))
        t.grad = None
    for ours, expected in zip(results[1], results[0]):
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(eager, **options), t, cos_, sin_, False)
    calls = re.findall(r"^\s+(cpp_fused_\w+)\(", "\n".join(code), re.MULTILINE)
    assert len(calls) == 1, calls
    torch._dynamo.reset()

def _tiny_engine(fusion: bool, micro_batches: int = 4):
    from support.parity_layouts import MICRO_BATCH, SEQ, SETTINGS, SHAPE

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from support import engines
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent

    parallel.init_model_parallel(Mesh(world=1), seed=1234)
    chunk = qwen.build_qwen(qwen.transformer_config(SHAPE, Mesh(world=1)), SHAPE, vocab_size=256)
    init_mesh_independent([chunk], 1234)
    return engines.build([chunk], torch.device("cpu"), forward_step, Mesh(world=1), micro_batch_size=MICRO_BATCH,
                         seq_length=SEQ, gradient_accumulation_fusion=fusion, **SETTINGS)


def _main_grads(engine):
    return {name: p.main_grad.clone() for name, p in engine.model[0].module.named_parameters()}


def test_gradient_accumulation_fusion_equals_unfused(single_rank, monkeypatch):
    """Four micro-batches accumulate into main_grad: fused and unfused gradients agree (fp32), and a stand-in that
    overwrote instead of accumulating would be caught."""
    from support.parity_layouts import global_batch

    reference = _tiny_engine(fusion=False)
    reference.forward_backward(global_batch(0))
    expected = _main_grads(reference)
    fused = _tiny_engine(fusion=True)
    assert fused.model[0].module.decoder.layers[0].mlp.linear_fc1.gradient_accumulation_fusion
    fused.forward_backward(global_batch(0))
    for name, grad in _main_grads(fused).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)

    monkeypatch.setattr(kernels.TorchWgradAccumulation, "wgrad_gemm_accum_fp32",
                        staticmethod(lambda x, gout, main_grad: main_grad.copy_(gout.t() @ x)))
    wrong = _tiny_engine(fusion=True)
    wrong.forward_backward(global_batch(0))
    worst = max(((g - expected[n]).abs().max() / expected[n].abs().max()).item()
                for n, g in _main_grads(wrong).items())
    assert worst > 1e-2


def _bf16_engine():
    from support.parity_layouts import MICRO_BATCH, SEQ, SETTINGS, SHAPE

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from support import engines
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.qwen import model as qwen
    from megatron_ext.models.init import init_mesh_independent

    parallel.init_model_parallel(Mesh(world=1), seed=1234)
    chunk = qwen.build_qwen(qwen.transformer_config(SHAPE, Mesh(world=1), params_dtype=torch.bfloat16), SHAPE,
                            vocab_size=256)
    init_mesh_independent([chunk], 1234)
    return engines.build([chunk], torch.device("cpu"), forward_step, Mesh(world=1), micro_batch_size=MICRO_BATCH,
                         seq_length=SEQ, **SETTINGS)


def _three_steps():
    """bf16 weights, fp32 main weights and clipping that bites (SETTINGS): every weight after three steps."""
    from support.parity_layouts import global_batch

    engine = _bf16_engine()
    for step in range(3):
        engine.forward_backward(global_batch(step))
        assert engine.optimizer_step()["grad_norm"] > 0.5  # the clip coefficient is below 1: clipping runs
    main = [p for opt in engine.optimizer.chained_optimizers for p in opt.get_parameters()]
    return [p.detach().clone() for p in engine.model[0].module.parameters()], [p.detach().clone() for p in main]


def test_optimizer_step_stand_ins_leave_megatron_cores_bits(single_rank, monkeypatch):
    """Our copy of the fp32 main weights into the bf16 ones and our clip against megatron-core's own (its Python
    loop of ``copy_`` in ``_multi_tensor_copy_this_to_that``, its clip through its DTensor check): the same bits in
    both the bf16 and the fp32 weights after three clipped steps; a clip that drops megatron-core's epsilon is
    caught."""
    from megatron.core.optimizer import optimizer

    from support import REPO

    sys.path.insert(0, os.path.join(REPO, "bench"))
    import host_ops  # megatron-core's copy loop and clip, as the benchmark's fallbacks run them

    assert optimizer._multi_tensor_copy_this_to_that is kernels.foreach_copy
    ours = _three_steps()
    # the engine installs kernels.foreach_copy into megatron-core when it is built: patch that, and put ours back after
    monkeypatch.setattr(optimizer, "_multi_tensor_copy_this_to_that", optimizer._multi_tensor_copy_this_to_that)
    monkeypatch.setattr(kernels, "foreach_copy", host_ops.megatron_copy)
    monkeypatch.setattr(kernels, "clip_by_total_norm", host_ops.megatron_clip)
    theirs = _three_steps()
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert {a.dtype for a in ours[0]} == {torch.bfloat16} and {a.dtype for a in ours[1]} == {torch.float32}

    monkeypatch.setattr(kernels, "clip_by_total_norm", lambda params, max_norm, total_norm: torch._foreach_mul_(
        [p.grad for p in params], max_norm / total_norm))
    wrong = _three_steps()
    assert any(not torch.equal(a, b) for a, b in zip(ours[1], wrong[1]))


def test_dtensor_checks_answer_as_megatron_cores(single_rank):
    """The grad norm's and clip's DTensor checks: a plain tensor or parameter is itself with no group, as in
    megatron-core; a DTensor still gets megatron-core's answers (its local shard, its mesh's group)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert clip_grads.to_local_if_dtensor is not utils.to_local_if_dtensor  # installed by the engines
    to_local, group = kernels.dtensor_checks(utils.to_local_if_dtensor, utils.get_data_parallel_group_if_dtensor)
    mesh = init_device_mesh("cpu", (1,))
    for tensor in (torch.ones(3), torch.nn.Parameter(torch.ones(3)), distribute_tensor(torch.ones(3), mesh,
                                                                                        [Replicate()])):
        ours, theirs = to_local(tensor), utils.to_local_if_dtensor(tensor)
        assert type(ours) is type(theirs) and torch.equal(ours, theirs) and (ours is tensor) == (theirs is tensor)
        assert group(tensor) is utils.get_data_parallel_group_if_dtensor(tensor)
    assert group(distribute_tensor(torch.ones(3), mesh, [Replicate()])) is mesh.get_group()


def _packed_microbatches(count: int):
    from support.parity_layouts import MICRO_BATCH, SEQ

    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 256, (MICRO_BATCH, SEQ + 1), generator=g)
        cuts = [0, 10, SEQ, SEQ + 7, 2 * SEQ]  # two rows, documents inside rows
        positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).view(MICRO_BATCH, SEQ)
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(MICRO_BATCH, SEQ),
                        position_ids=positions, cu_seqlens=torch.tensor(cuts, dtype=torch.int32)))
    return out


def ours_on_the_stack() -> bool:
    """Whether any frame of the caller's stack is our package: our own reads, reads torch's helpers make on our
    behalf (``Tensor.__format__`` calls ``item``), and reads a library makes inside a call of ours."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(OURS):
            return True
        frame = frame.f_back
    return False


def count_host_reads(monkeypatch, only_ours=False) -> list:
    """Record every way a tensor reaches the host; with ``only_ours``, those made while our package is on the
    stack (directly, through torch's helpers, or by a library we called)."""
    calls = []
    for method in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _name=method, **kwargs):
            if not only_ours or ours_on_the_stack():
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return calls


def test_host_reads_through_torch_helpers_are_ours(monkeypatch):
    """A tensor formatted in our code reads the host through ``Tensor.__format__`` -> ``item``: counted; the same
    from another package is not, unless our code called it."""
    code = "def show(t):\n    return f'{t:.3f}'\n"
    ours, theirs = {}, {}
    exec(compile(code, os.path.join(OURS, "_probe.py"), "exec"), ours)
    exec(compile(code, os.path.join(os.path.dirname(TORCH), "deepspeed", "_probe.py"), "exec"), theirs)
    calls = count_host_reads(monkeypatch, only_ours=True)
    assert theirs["show"](torch.tensor(1.0)) == "1.000" and calls == []
    assert ours["show"](torch.tensor(1.0)) == "1.000" and calls == ["item"], calls
    calling = {"show": theirs["show"]}
    exec(compile("def call(t):\n    return show(t)\n", os.path.join(OURS, "_caller.py"), "exec"), calling)
    assert calling["call"](torch.tensor(1.0)) == "1.000" and calls == ["item", "item"], calls


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_host_sync_per_micro_batch(single_rank, monkeypatch, packed):
    """Every way a tensor reaches the host (item, tolist, float/int/bool, cpu, numpy) is counted during
    ``forward_backward``: 2 and 6 micro-batches must cost the same, per-step reads: our one loss read at the end
    and megatron-core's ``if num_tokens > 0`` in ``finalize_model_grads``. On a GPU each would stall the launch
    queue, so one per micro-batch would be a bubble per micro-batch."""
    from support.parity_layouts import global_batch

    counts = {}
    for n in (2, 6):
        engine = _tiny_engine(fusion=True)
        batches = _packed_microbatches(n) if packed else (global_batch(0) * 2)[:n]
        calls = count_host_reads(monkeypatch)
        engine.forward_backward(batches)
        monkeypatch.undo()
        counts[n] = list(calls)
    assert counts[2] == counts[6] == ["__bool__", "tolist"], counts


def test_deepspeed_engine_in_a_plain_process_reads_the_loss_once(single_rank, monkeypatch):
    """A world of one started without a launcher (no LOCAL_RANK) builds the DeepSpeed engine, and our part of its
    step reads nothing back per micro-batch: counted as above, every read made while our package is on the stack
    (DeepSpeed's reads inside our calls included: its ZeRO step's three grad-norm checks, once per step)."""
    from support.parity_layouts import MICRO_BATCH, SETTINGS, SHAPE, global_batch

    from support.engines import build

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh
    from megatron_ext.objectives.sft import forward_step
    from megatron_ext.models.qwen import model as qwen

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    parallel.init_model_parallel(Mesh(world=1), seed=1234)
    counts = {}
    for n in (2, 6):
        chunk = qwen.build_qwen(qwen.transformer_config(SHAPE, Mesh(world=1)), SHAPE, vocab_size=256)
        engine = build([chunk], torch.device("cpu"), forward_step, Mesh(world=1), engine="deepspeed",
                       micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * n, **SETTINGS)
        calls = count_host_reads(monkeypatch, only_ours=True)
        engine.forward_backward((global_batch(0) * 2)[:n])
        monkeypatch.undo()
        os.environ.pop("LOCAL_RANK", None)  # the engine's default for a plain process (engines/deepspeed.py)
        counts[n] = calls
    # per step, not per micro-batch: DeepSpeed's ZeRO step checks the grad norm three times (is_invalid_grad_norm's
    # bool), then our one loss read
    assert counts[2] == counts[6] == ["__bool__"] * 3 + ["tolist"], counts
    # nor did DeepSpeed's comm compile its shared-memory inference all-reduce (minutes of C++ on a fresh machine)
    import deepspeed.comm.comm as ds_comm

    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None


def test_compiled_on_cuda_leaves_cpu_calls_eager(monkeypatch):
    """``compiled_on_cuda`` compiles at the first CUDA call only: a CPU run never reaches ``torch.compile`` (no
    TorchDynamo import at start-up: importing it there once let kineto's profiler lines through in the MoE
    quickstart), and CPU calls stay eager whatever was imported first (CPU tests compare the eager math bit for
    bit)."""
    from megatron_ext.platform import kernels

    compiled, calls = [], []
    monkeypatch.setattr(torch, "compile", lambda f, **options: compiled.append(options) or (
        lambda *a: calls.append(a) or f(*a)))
    double = kernels.compiled_on_cuda(lambda x: x * 2)
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0)) and compiled == calls == []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    for _ in range(2):
        assert double(torch.ones(2, device="meta")).shape == (2,)
    assert compiled == [kernels.COMPILE] and len(calls) == 2


@pytest.mark.gpu
def test_compiled_functions_equal_eager_on_the_gpu():
    """What Triton generates for RoPE's rotation and the fused loss's chunk work equals the eager functions on the
    same CUDA tensors (fp32 tight; bf16 within a few roundings: compiled rounds once, eager after every operation),
    forward and, for RoPE, backward. (Rehearsed on CPU with Inductor's CPU backend in place of Triton.)"""
    from megatron_ext.models import linear_cross_entropy as lce
    from megatron_ext.models import rope

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-5)), (torch.bfloat16, dict(rtol=2e-2, atol=5e-2))):
        t = torch.randn(64, 2, 14, 64, generator=g).to("cuda", dtype)
        cos_, sin_ = (torch.randn(64, 1, 1, 64, generator=g).to("cuda", dtype) for _ in range(2))
        weights = torch.randn(64, 2, 14, 64, generator=g).to("cuda", dtype)
        results = []
        for function in (rope._rotate, rope._rotate.__wrapped__):
            x = t.clone().requires_grad_()
            out = function(x, cos_, sin_, False)
            (out.float() * weights).sum().backward()
            results.append((out, x.grad))
        for ours, expected in zip(*results):
            torch.testing.assert_close(ours.float(), expected.float(), **tol)
        logits = torch.randn(300, 1000, generator=g).mul_(4).to("cuda", dtype)
        local, mine = torch.randint(0, 1000, (300,), generator=g).cuda(), (torch.rand(300, generator=g) > 0.3).cuda()
        lse, grad = (torch.randn(300, generator=g).cuda() + 8, torch.randn(300, generator=g).cuda())
        for function, args in ((lce._logit_statistics, (local, mine)), (lce._logit_gradients, (lse, local, mine, grad))):
            ours, expected = function(logits.clone(), *args), function.__wrapped__(logits.clone(), *args)
            for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (ours, expected))):
                assert a.dtype == b.dtype
                torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.gpu
def test_foreach_copy_rounds_as_copy_on_the_gpu():
    """CUDA's multi-tensor copy from fp32 into bf16 (and fp16) rounds each value as ``copy_`` does."""
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=g).mul_(3).cuda() for n in (1, 5, 4099, 65537)]
    for dtype in (torch.bfloat16, torch.float16):
        ours, loop = ([torch.empty_like(t, dtype=dtype) for t in sources] for _ in range(2))
        kernels.foreach_copy(sources, ours)
        for source, target in zip(sources, loop):
            target.copy_(source)
        assert all(torch.equal(a, b) for a, b in zip(ours, loop))
