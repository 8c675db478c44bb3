"""The GPU queue: every experiment a GPU window may run, in priority order, and the ledger of what is measured.

GPU time comes in rare windows of about ten minutes, so each run of ``bench/gpu_check.py`` takes ``QUEUE`` from the
top, skips what ``bench/results/gpu_queue.json`` (the ledger) says is measured on the same device and versions, runs
what fits its budget and records the rest as not reached: the next window starts where this one stopped.

An entry (``Entry``) has a stable ``id`` (the ledger's key; a change to what it runs, its ``spec``, unmeasures it), the
function of ``bench/gpu_stages.py`` that runs it, its expected seconds on a GPU (the H200 windows of 2026-11-27 and
2026-12-04, ``bench/results/nvidia-h200_gpu_check*``; estimates where marked) and in a rehearsal on CPU, and what it
measures. Benchmark entries name their command's parts (``script``, ``model``, ``mbs``, ``flags``): ``commands``
builds the GPU command line (or the rehearsal's tiny one). An A/B entry (stage ``ab``) runs a lever (``lever`` flags,
or ``scale_mbs`` for a micro-batch sweep) against the ``base`` entry's command, our default, in the same run: its
ratio says whether the lever wins, with equal losses. A default changes only after a GPU run shows such a win, in the
commit that records that run; that commit bumps ``REV``, so every row is measured again under the new default.

New experiments: add an ``Entry`` to ``QUEUE`` where its priority puts it. One whose flags the bench scripts do not
accept yet names them in ``needs``: ``gpu_check.py`` checks every command line against its script's parser first
(``gpu_stages.py probe``) and records such an entry "skipped: needs <flag>" until the flag lands. ``cuda`` says why
an entry is meaningless on CPU: a rehearsal records it "skipped: needs CUDA" (its GPU command is still checked).

The ledger: ``{"runs": {KEY: {"device", "versions", "entries": {ID: {"status", "date", "headline", "result",
"spec"}}}}}``, KEY the device and versions (``key``); a test of the correctness or rest entries is its own ID (its
pytest node id). Only status "measured" with the entry's current ``spec`` counts; a KEY with "unknown" in it (versions
not recorded) never does. Standard library only (gpu_check.py runs before the wheels are installed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEDGER = os.path.join(REPO, "bench", "results", "gpu_queue.json")
REV = 1  # bump when a default every row runs under changes (in the commit that records the GPU run that won it)
LOSS_RTOL = 0.01  # A/B: first and last loss within 1% count as equal (bf16, a few steps)
WIN = 1.02  # A/B: the lever at least 2% faster than the default (window-to-window noise is about that)

# The deciding GPU tests (the correctness entry; rest runs the others) in the order they run, by file: the seconds a
# file's tests took together on the 2026-12-04 H200 (test_gpu_megatron's share one run: 31 s; the varlen kernel 3 s;
# the A2.7B MoE runs 94 s one after another, the three start together since; the pretrained round trip 40 s in bf16,
# 51 s in fp32: that one runs in rest). A file costs its seconds when any of its tests is not yet measured.
CORRECTNESS_FILES = [
    ("tests/gpu/test_gpu_megatron.py", 32, [
        "test_megatron_engine_trains_a_real_preset_in_bf16", "test_fused_paths_match_unfused[real_bf16_unfused]",
        "test_fused_paths_match_unfused[real_bf16_ce_fusion]",
        "test_fusion_that_overwrites_instead_of_accumulating_is_detected",
        "test_distributed_optimizer_equals_the_megatron_engine_on_gpu",
        "test_deepspeed_equals_megatron_engine_on_gpu[zero1]", "test_deepspeed_equals_megatron_engine_on_gpu[zero3]"]),
    ("tests/models/test_attention.py", 4, ["test_packed_documents_take_the_varlen_kernel_on_the_gpu"]),
    ("tests/gpu/test_gpu_moe.py", 95, ["test_real_moe_layers_train_in_bf16",
                                       "test_grouped_experts_match_the_expert_loop_in_bf16"]),
    ("tests/convert/test_pretrained.py", 41, ["test_pretrained_load_and_save_hf_on_the_gpu[bf16]"]),
]
CORRECTNESS = [f"{path}::{name}" for path, _, names in CORRECTNESS_FILES for name in names]
PYTEST_S = 20  # a pytest process's imports and collection before its first test


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str
    stage: str  # the function of bench/gpu_stages.py that runs it
    gpu_s: Optional[float]  # expected seconds on a GPU; None: whatever the budget has left
    cpu_s: float  # expected seconds in a rehearsal (tiny shapes, one busy CPU core)
    what: str
    script: str = ""  # bench_qwen / bench_vit: the entry is that benchmark's command
    model: str = ""
    mbs: int = 0
    flags: Tuple[str, ...] = ()
    cpu_model: str = "tiny"  # the rehearsal's model
    base: str = ""  # A/B: the entry whose command is the default
    lever: Tuple[str, ...] = ()  # A/B: the lever's flags, added to the default's command
    scale_mbs: int = 1  # A/B: the lever is a micro-batch this many times the default's
    needs: str = ""  # flags the bench scripts must accept first
    cuda: str = ""  # why a rehearsal on CPU skips it


HF, NONE = ("--baseline", "hf"), ("--baseline", "none")
PEERS = ("--baseline", "hf", "liger")  # on CPU the Liger side is a row saying why it is skipped
LORA = ("--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "qkv,proj,fc1,fc2")  # bench/lora_memory.py's
# After what decides trust (correctness): where we stand on every target row beside its peers, then the levers' A/Bs.
QUEUE: List[Entry] = [
    Entry("env", "env", 25, 3, "device and driver (nvidia-smi), torch, CUDA, library versions, free memory, the "
          "wheel install's time: the ledger's key (always runs; a cold `import torch` took over 10 s on 2026-12-04)"),
    Entry("correctness", "tests", PYTEST_S + sum(s for _, s, _ in CORRECTNESS_FILES), 8,
          "the GPU tests that decide whether any number can be trusted (CORRECTNESS), each its own ledger item"),
    Entry("speed.qwen2.5-1.5b", "bench", 65, 12, "Qwen2.5-1.5B, ours beside transformers and transformers + "
          "Liger's kernels: tokens/s, MFU, peak memory, the step's split (Liger's side: estimate)", "bench_qwen",
          "qwen2.5-1.5b", 2, PEERS),
    Entry("speed.qwen2.5-0.5b", "bench", 55, 12, "Qwen2.5-0.5B, ours beside transformers and transformers + Liger",
          "bench_qwen", "qwen2.5-0.5b", 4, PEERS),
    Entry("speed.qwen2.5-1.5b.lora", "bench", 60, 12, "Qwen2.5-1.5B with LoRA r=16 on every linear beside PEFT and "
          "PEFT + Liger: tokens/s and peak memory (estimate)", "bench_qwen", "qwen2.5-1.5b", 2, LORA + PEERS),
    Entry("speed.qwen3-30b-a3b.2-layers", "bench", 60, 10, "a 2-layer slice of Qwen3-30B-A3B, whole steps, beside "
          "transformers (grouped_mm experts) and + Liger (estimate)", "bench_qwen", "qwen3-30b-a3b", 1,
          ("--num-layers", "2", "--global-batch-size", "8") + PEERS, cpu_model="tiny-qwen3-moe"),
    Entry("vit", "bench", 50, 10, "ViT-H/14 at batch 64, 224 px, ours beside transformers: images/s, MFU, memory, "
          "each side's top operators (a warm-up step profiled)", "bench_vit", "vit-huge-14", 64,
          HF + ("--profile-ops", "20")),
    Entry("ab.qwen2.5-0.5b.cudnn", "ab", 25, 8, "cuDNN's attention kernel first (--sdpa-backend cudnn) against "
          "the default order (flash first)", base="speed.qwen2.5-0.5b", lever=("--sdpa-backend", "cudnn"),
          cuda="cuDNN's attention is CUDA's"),
    Entry("ab.qwen2.5-1.5b.compile-layers", "ab", 60, 10, "each transformer layer compiled (--compile-layers) "
          "against the default (estimate)", base="speed.qwen2.5-1.5b", lever=("--compile-layers",),
          cuda="torch.compile's Triton kernels (a CPU compile takes minutes)"),
    Entry("ab.qwen2.5-0.5b.compile-layers", "ab", 45, 10, "Qwen2.5-0.5B with each layer compiled against the "
          "default: at hidden 896 the elementwise work between GEMMs weighs most (estimate)",
          base="speed.qwen2.5-0.5b", lever=("--compile-layers",),
          cuda="torch.compile's Triton kernels (a CPU compile takes minutes)"),
    Entry("moe_layer", "moe_layer", 45, 8, "one A2.7B layer and one Qwen3-30B-A3B layer (bench/moe_experts.py): "
          "grouped GEMM vs SequentialMLP vs transformers (eager, grouped_mm), forward and backward"),
    Entry("ab.vit.compile-layers", "ab", 50, 10, "ViT-H/14 with each layer compiled (--compile-layers fuses the "
          "bias adds megatron-core leaves unfused) against the default (estimate)", base="vit",
          lever=("--compile-layers",), cuda="torch.compile's Triton kernels (a CPU compile takes minutes)"),
    Entry("ab.qwen2.5-0.5b.mbs", "ab", 25, 8, "Qwen2.5-0.5B at twice the micro-batch (the fused loss freed "
          "memory) against the default", base="speed.qwen2.5-0.5b", scale_mbs=2),
    Entry("ab.qwen2.5-1.5b.mbs", "ab", 35, 8, "Qwen2.5-1.5B at twice the micro-batch against the default "
          "(the profile's verdict)", base="speed.qwen2.5-1.5b", scale_mbs=2),
    Entry("profile", "profile", 40, 8, "one profiled Qwen2.5-1.5B step and its trace report (HTA where installed)"),
    Entry("verify", "verify", 60, 15, "tools/verify_model.py's card for a random-weight Qwen2.5-1.5B in the "
          "published shape, bf16"),
    Entry("rest", "tests", None, 8, "every other GPU test, then the whole tier's report"),
]
BY_ID: Dict[str, Entry] = {e.id: e for e in QUEUE}


@dataclasses.dataclass(frozen=True)
class Target:
    """A target of issue 64, judged from one window's rows of ``entry``: our MFU at least ``mfu``, or our speed at
    least ``ratio`` times side ``peer``'s (and with ``memory``, our peak memory at most the peer's)."""
    entry: str
    what: str
    mfu: float = 0.0
    peer: str = ""
    ratio: float = 0.0
    memory: bool = False


TARGETS = [
    Target("speed.qwen2.5-1.5b", "Qwen2.5-1.5B: MFU >= 50%", mfu=0.50),
    Target("speed.qwen2.5-1.5b", "Qwen2.5-1.5B: >= 1.15x transformers + Liger", peer="transformers+liger",
           ratio=1.15),
    Target("speed.qwen2.5-0.5b", "Qwen2.5-0.5B: MFU >= 40%", mfu=0.40),
    Target("speed.qwen2.5-1.5b.lora", "LoRA on Qwen2.5-1.5B: >= 1.5x PEFT at no more memory", peer="peft",
           ratio=1.5, memory=True),
    Target("vit", "ViT-H/14: >= 1.2x transformers", peer="transformers", ratio=1.2),
    Target("speed.qwen3-30b-a3b.2-layers", "Qwen3-30B-A3B slice: >= 1.2x transformers (grouped_mm experts)",
           peer="transformers", ratio=1.2),
]


def judge(target: Target, entry_row: Optional[dict], rehearse: bool) -> Tuple[str, str]:
    """(verdict, evidence) from this window's report row of the target's entry: "met" or "missed" only from rows
    a GPU measured in this window, "not judged" with the reason otherwise."""
    if rehearse:
        return "not judged", "rehearsal on CPU"
    if not entry_row or not entry_row.get("ran"):
        return "not judged", f"{target.entry} not run in this window" + (
            f" ({entry_row['note']})" if entry_row and entry_row.get("note") else "")
    sides = {r["side"]: r for r in (entry_row.get("results") or {}).get("rows") or []}
    ours = sides.get("megatron_ext")
    if not ours or "skipped" in ours:
        return "not judged", f"no row of ours ({entry_row['status']})"
    if target.mfu:
        if not ours["mfu"].endswith("%"):
            return "not judged", f"MFU {ours['mfu']}"
        return ("met" if float(ours["mfu"][:-1]) / 100 >= target.mfu else "missed"), f"MFU {ours['mfu']}"
    peer = sides.get(target.peer)
    if not peer or "skipped" in peer:
        return "not judged", f"{target.peer}: " + (peer["skipped"] if peer else "no row")
    unit = "tokens_per_sec" if "tokens_per_sec" in ours else "images_per_sec"
    ratio = ours[unit] / peer[unit]
    met = ratio >= target.ratio
    evidence = f"{ratio:.2f}x {target.peer}"
    if target.memory:
        met = met and ours["peak_gib"] <= peer["peak_gib"]
        evidence += f", {ours['peak_gib']} against {peer['peak_gib']} GiB"
    return ("met" if met else "missed"), evidence

QWEN_SHAPE = {False: ["--bf16", "--seq-length", "4096", "--global-batch-size", "16", "--bench-steps", "4",
                      "--warmup-steps", "2"],
              True: ["--seq-length", "128", "--global-batch-size", "4", "--bench-steps", "2", "--warmup-steps", "1"]}
VIT_SHAPE = {False: ["--bf16", "--num-classes", "1000", "--bench-steps", "4", "--warmup-steps", "2"],
             True: ["--num-classes", "10", "--global-batch-size", "8", "--bench-steps", "2", "--warmup-steps", "1"]}


def command(entry: Entry, rehearse: bool, total_gib: float = 0.0, scale_mbs: int = 1) -> List[str]:
    """A benchmark entry's command line (without --bench-out). Qwen rows take twice their micro-batch on a device of
    over 100 GiB (an H200: the first window's peaks doubled fit); a rehearsal runs the tiny model, micro-batch 2 (4
    for ViT), without the ViT baseline."""
    if entry.script == "bench_vit":
        mbs = 4 if rehearse else entry.mbs
        return ["bench/bench_vit.py", "--model", "tiny" if rehearse else entry.model, "--micro-batch-size",
                str(mbs * scale_mbs), *VIT_SHAPE[rehearse], *entry.flags, *NONE * rehearse]
    mbs = 2 if rehearse else entry.mbs * (2 if total_gib > 100 else 1)
    return ["bench/bench_qwen.py", "--model", entry.cpu_model if rehearse else entry.model, "--micro-batch-size",
            str(mbs * scale_mbs), *QWEN_SHAPE[rehearse], "--cross-entropy-loss-fusion", *entry.flags]


def commands(entry: Entry, rehearse: bool, total_gib: float = 0.0) -> List[List[str]]:
    """Every command line the entry runs: an A/B's default (its base's command) then its lever (ours alone)."""
    if entry.base:
        base = BY_ID[entry.base]
        return [command(base, rehearse, total_gib),
                command(base, rehearse, total_gib, entry.scale_mbs) + [*NONE, *entry.lever]]
    return [command(entry, rehearse, total_gib)] if entry.script else []


def spec(entry: Entry) -> str:
    """What the entry runs, hashed: a measurement counts only for the definition that made it."""
    fields = dataclasses.asdict(entry)
    for words in ("gpu_s", "cpu_s", "what", "needs", "cuda", "cpu_model"):  # (not what a GPU runs)
        fields.pop(words)
    if entry.base:
        fields["base"] = spec(BY_ID[entry.base])
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


VERSIONS = ("torch", "cuda", "megatron-core", "transformers")


def key(info: dict) -> str:
    """The ledger's key for the env entry's ``info``: device and versions (one not recorded reads "unknown"; CUDA
    on a CPU build "none")."""
    return " | ".join([str(info.get("device") or "unknown device")] + [
        f"{name} {'unknown' if name not in info else info[name] or 'none'}" for name in VERSIONS] + [f"queue r{REV}"])


def load(path: str) -> dict:
    if not os.path.exists(path):
        return dict(runs={})
    with open(path) as f:
        return json.load(f)


def save(path: str, ledger: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(ledger, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def records(ledger: dict, run_key: Optional[str]) -> Dict[str, dict]:
    """The entries recorded under ``run_key`` (none where it holds "unknown": they never count as measured)."""
    if not run_key or "unknown" in run_key:
        return {}
    return ledger["runs"].get(run_key, {}).get("entries", {})


def measured(entry_id: str, found: Dict[str, dict]) -> Optional[dict]:
    """The record that makes ``entry_id`` measured, or None. The correctness entry is measured when every deciding
    test is."""
    if entry_id == "correctness":
        tests = [found.get(t) for t in CORRECTNESS]
        if all(t and t["status"] == "measured" for t in tests):
            return dict(date=max(t["date"] for t in tests), headline=f"{len(tests)} deciding tests passed")
        return None
    r = found.get(entry_id)
    want = spec(BY_ID[entry_id]) if entry_id in BY_ID else ""
    return r if r and r["status"] == "measured" and r.get("spec", "") == want else None


def expected(entry: Entry, rehearse: bool, found: Dict[str, dict], ran: set) -> Optional[float]:
    """Seconds the entry should take now: correctness only for its files with a test not yet measured, an A/B its
    base's too when the base did not run in this window."""
    if rehearse:
        seconds = entry.cpu_s
    elif entry.id == "correctness":
        files = [s for path, s, names in CORRECTNESS_FILES
                 if any(not measured(f"{path}::{n}", found) for n in names)]
        seconds = PYTEST_S + sum(files)
    else:
        seconds = entry.gpu_s
    if entry.base and entry.base not in ran and seconds is not None:
        base = BY_ID[entry.base]
        seconds += base.cpu_s if rehearse else base.gpu_s
    return seconds


def node_id(junit_id: str) -> str:
    """bench/gpu_tier.py's test id (``tests.gpu.test_x::name``) as pytest's (``tests/gpu/test_x.py::name``)."""
    module, _, name = junit_id.partition("::")
    return f"{module.replace('.', '/')}.py::{name}"


def probe(work: str, rehearse: bool) -> int:
    """DIR/probe.json: {entry id: what its script refused in its command line (GPU's, and the rehearsal's in a
    rehearsal), or null}. Parsing only: a flag not there yet is found in a second, not in a window's minute."""
    import contextlib
    import io
    import sys

    sys.path.insert(0, REPO)
    from bench import bench_qwen, bench_vit  # (their parsers import no torch)

    scripts = {"bench/bench_qwen.py": bench_qwen, "bench/bench_vit.py": bench_vit}
    refused = {}
    for entry in QUEUE:
        refused[entry.id] = None
        for argv in commands(entry, False, 0.0) + commands(entry, True) * rehearse:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    scripts[argv[0]].split_argv(argv[1:])
            except SystemExit:
                refused[entry.id] = err.getvalue().strip().splitlines()[-1]
            except Exception as e:  # ConfigError: the benchmark's own checks
                refused[entry.id] = f"{type(e).__name__}: {e}"
            if refused[entry.id]:
                break
    with open(os.path.join(work, "probe.json"), "w") as f:
        json.dump(refused, f, indent=1)
    return 0
