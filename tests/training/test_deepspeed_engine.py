"""--engine deepspeed (ZeRO, and DeepSpeed's pipeline engine) trains the same megatron-core Qwen as the megatron
engine on one process.

Five SFT steps (fp32, packed, clipping at 0.5 so it bites: grad norms are ~1.7-2.5) must give the same losses and
grad norms within 1e-5 under ZeRO-2, -3 (DP2; ZeRO-1: the pipeline runs and the DP1 -> DP2 resume below), ZeRO-3 with optimizer offload, ZeRO-3 with hpZ (DP4, secondary
partitions of 2), TP2 x DP2 with ZeRO-2 (megatron-core's parallel state is DeepSpeed's mpu), TP2+SP x DP2 with
ZeRO-3 (the SP norm gradients summed over TP in backward), and DeepSpeed's pipeline engine with 2 stages and
4 micro-batches: ZeRO-0 (whose own clipping sees each stage's parameters only: with it, step 5 is off by 4.6e-5,
run as a negative control that must fail), DP2 x PP2 with ZeRO-1 and activation checkpointing every 2 layers, and TP2 x PP2 with
ZeRO-1 (the tied embedding's gradient summed between the first and last stage); LoRA on every linear under ZeRO-2 and TP2 x DP2 ZeRO-3, and DPO under ZeRO-2, each against its own one-rank run. Checkpoints saved at step 3 resume
exactly on another mesh (DeepSpeed's universal checkpoint, converted at start-up): ZeRO-3 with optimizer and parameter
offload DP2 -> DP1 in a plain python process, ZeRO-1 with offload DP1 -> DP2, ZeRO-2 DP2 -> DP4, ZeRO-3 TP2 x DP2 -> TP2 x DP1,
ZeRO-2 TP1 x DP2 -> TP2 x DP1 (with SwiGLU's halves cut as one tensor instead, a negative control that must fail),
the pipeline engine DP2 x PP2 -> DP1 x PP2; the weights the first and the last export load in the megatron engine with
the same loss. Every run uses DeepSpeed at test scale (conftest.run_ranks): ZeRO-3 partitions every parameter and
gradients and weights move in buckets of 4,096 elements (DeepSpeed's defaults would keep each of the tiny model's
parameters whole and every step one bucket).
"""

import json
import os
import re

import pytest
import torch

from support import flag_values
from support.ranks import run_ranks
from megatron_ext.engines.deepspeed import deepspeed_config, zero_config
from megatron_ext.engines.megatron import OptimizerSettings
from megatron_ext.errors import ConfigError
from support.step_checks import worst

TOL = 1e-5
COMMON = ["finetune_qwen.py", "--model", "tiny", "--pack-sequences", "--seq-length", "128", "--micro-batch-size",
          "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "2e-3", "--lr-warmup-iters", "1",
          "--clip-grad", "0.5", "--weight-decay", "0.1"]  # (decay on matrices only, as megatron-core's)
DS = ["--engine", "deepspeed"]
# (the adapters' grad norms are 0.30-0.44: clipped at 0.2)
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "qkv,proj,fc1,fc2", "--clip-grad", "0.2"]
RUNS = {
    "zero2": (2, DS + ["--zero-stage", "2"]),
    "zero3": (2, DS + ["--zero-stage", "3"]),
    "zero3_offload": (2, DS + ["--zero-stage", "3", "--offload-optimizer", "cpu"]),
    "zero3_hpz": (4, DS + ["--zero-stage", "3", "--zero-hpz-partition-size", "2"]),
    "tp2_dp2_zero2": (4, DS + ["--zero-stage", "2", "--tensor-model-parallel-size", "2"]),
    "tp2_sp_dp2_zero3": (4, DS + ["--zero-stage", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_zero0": (2, DS + ["--zero-stage", "0", "--pipeline-model-parallel-size", "2"]),
    "dp2_pp2_zero1_recompute": (4, DS + ["--zero-stage", "1", "--pipeline-model-parallel-size", "2",
                                         "--recompute-granularity", "full", "--recompute-num-layers", "2"]),
    "tp2_pp2_zero1": (4, DS + ["--zero-stage", "1", "--pipeline-model-parallel-size", "2",
                               "--tensor-model-parallel-size", "2"]),
    # LoRA on every linear (frozen base: no gradient, no optimizer state), against its own reference
    "lora_zero2": (2, DS + ["--zero-stage", "2"] + LORA),
    "lora_tp2_dp2_zero3": (4, DS + ["--zero-stage", "3", "--tensor-model-parallel-size", "2"] + LORA),
    # Qwen3 (query/key norms: their gradients summed over TP by our hook), against its own reference
    "qwen3_tp2_dp2_zero3": (4, DS + ["--zero-stage", "3", "--tensor-model-parallel-size", "2",
                                     "--model", "tiny-qwen3"]),
    # DPO (pairs, unpacked; the reference log-probabilities computed by its one-rank run, read back from the cache),
    # with the chosen completions' token loss added (its mean over the global batch: 4 micro-batches on one rank,
    # 2 on each of two here)
    "dpo_zero2": (2, DS + ["--zero-stage", "2"] + ["--objective", "dpo", "--data-path", "{pairs}", "--dpo-loss",
                                                   "sigmoid,sft"]),
}
REFERENCES = {"reference": [], "reference_qwen3": ["--model", "tiny-qwen3"], "reference_lora": LORA,
              "reference_dpo": ["--objective", "dpo", "--data-path", "{pairs}", "--dpo-loss", "sigmoid,sft"]}
# The negative control: DeepSpeed's pipeline engine clipping by the norm of each stage's own parameters
# (tests/support/patched.py), the bug our clipping fixes.
PATCHED = {"pp2_zero0_stage_clipping": (2, RUNS["pp2_zero0"][1], "pipeline_stage_clipping"),
           "qwen3_tp2_dp2_zero3_no_tp_sum": (4, RUNS["qwen3_tp2_dp2_zero3"][1], "no_tp_sum_of_query_key_norms")}
EXPORTED = ["zero3_offload", "pipeline"]  # whole models in mcore/: the megatron engine evaluates them
PROFILED = {"zero2", "pp2_zero0"}  # DeepSpeed's engine and its pipeline engine label their parts too
# name: (flags, ranks saving at step 3, ranks resuming[, flags the resume adds]): a resume on another data-parallel
# or TP size goes through DeepSpeed's universal checkpoint (converted at start-up; the pipeline engine's too); one
# rank is a plain `python` process (no LOCAL_RANK).
TP2 = ["--tensor-model-parallel-size", "2"]
SAVED = {"zero3_offload": (DS + ["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"], 2, 1),
         "zero1_offload": (DS + ["--zero-stage", "1", "--offload-optimizer", "cpu"], 1, 2),
         "zero2": (DS + ["--zero-stage", "2"], 2, 4),
         "tp2_zero3": (DS + ["--zero-stage", "3"] + TP2, 4, 2),  # TP2 x DP2 -> TP2 x DP1: each TP rank its piece
         "zero2_to_tp2": (DS + ["--zero-stage", "2"], 2, 2, TP2),  # TP1 x DP2 -> TP2 x DP1: SwiGLU's halves
         "pipeline": (DS + ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"], 4, 2),  # DP2 x PP2 -> DP1
         "lora_zero2": (RUNS["lora_zero2"][1], 2, 2)}  # (its checkpoints hold the adapters, not the frozen base)
# The negative control of a TP change: the loader slicing the merged [gate; up] as one tensor (tests/support/patched.py).
WRONG_RESUME = ("zero2_to_tp2", "universal_halves_as_columns")

def records(path):
    return {r["step"]: r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    cache = ["--data-cache-dir", str(root / "cache")]
    pairs = root / "pairs.jsonl"  # completions that share no words: at step 1 the policy is the reference, and
    # the chosen and rejected gradients of shared text would cancel, leaving rounding noise to compare
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + {2 * a}?", "chosen": f"{3 * a}.",
                                         "rejected": f"I do not know; maybe {3 * a + 5} or so, sorry."}) + "\n"
                             for a in range(2, 18)))
    out = {}
    references = {name: (1, flags) for name, flags in REFERENCES.items()}
    for name, (world, flags, *patch) in {**references, **RUNS, **PATCHED}.items():
        profile = ["--profile", "--profile-step-end", "4"] if name in PROFILED else []
        patched = ["tests/support/patched.py", *patch] if patch else []
        common = [a for a in COMMON if "dpo" not in name or a != "--pack-sequences"]  # (DPO's pairs: unpacked)
        flags = [str(pairs) if a == "{pairs}" else a for a in flags]
        run_ranks(world, patched + common + flags + cache + profile + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    out["logs"] = root
    evals = ["--eval-iters", "2"]
    for name, (flags, saving, resuming, *later) in SAVED.items():
        ckpt = str(root / f"ckpt_{name}")
        run_ranks(saving, COMMON + flags + cache + evals + ["--save", ckpt, "--save-interval", "3", "--exit-interval",
                                                            "3", "--eval-interval", "3", "--log-dir", str(root / name)])
        resume = COMMON + flags + sum(later, []) + cache + ["--load", ckpt]
        out[f"resumed_output_{name}"] = run_ranks(resuming, resume + ["--log-dir", str(root / f"{name}_resumed")]).stdout
        out[f"ckpt_{name}"] = ckpt
        if name == WRONG_RESUME[0]:  # (the universal form is there now: converted, as always, without the patch)
            run_ranks(resuming, ["tests/support/patched.py", WRONG_RESUME[1]] + resume + ["--log-dir", str(root / "wrong")])
            out["saved_wrong"] = records(root / "wrong")
        if name not in EXPORTED:
            continue
        # The exported weights, evaluated by the megatron engine (lr 0: the one step changes nothing).
        run_ranks(1, COMMON + cache + evals + ["--load", f"{ckpt}/iter_0000003/mcore", "--finetune", "--lr", "0",
                                               "--train-iters", "1", "--eval-interval", "1",
                                               "--log-dir", str(root / f"{name}_exported")])
    for name in SAVED:
        for run in (name, f"{name}_resumed", f"{name}_exported"):
            if (root / run).is_dir():
                out[f"saved_{run}"] = records(root / run)
    return out


def worst_loss_diff(ours, ref) -> float:
    assert sorted(ours) == sorted(ref) == [1, 2, 3, 4, 5]
    return worst(abs(ours[step]["loss"] - ref[step]["loss"]) / ref[step]["loss"] for step in ref)


@pytest.mark.parametrize("name", list(RUNS))
def test_zero_matches_one_process(runs, name):
    kind = name.split("_")[0]
    ours, ref = runs[name], runs[f"reference_{kind}" if f"reference_{kind}" in runs else "reference"]
    clip = 0.2 if kind == "lora" else 0.5
    assert all(r["grad_norm"] > clip for r in ref.values()), "clipping must be active for this test to mean much"
    assert worst_loss_diff(ours, ref) <= TOL, (name, ours, ref)
    for step in ref:
        assert abs(ours[step]["grad_norm"] - ref[step]["grad_norm"]) <= TOL * ref[step]["grad_norm"], (name, step)


def test_pipeline_clipping_by_each_stage_is_detected(runs):
    """DeepSpeed's own clipping sees one stage's parameters: the comparison above must fail it."""
    assert worst_loss_diff(runs["pp2_zero0_stage_clipping"], runs["reference"]) > TOL


def test_qwen3_query_key_norms_not_summed_over_tp_are_detected(runs):
    """Without the TP sum of the query/key norms' gradients, the comparison every layout passes (1e-5) fails."""
    ours, ref = runs["qwen3_tp2_dp2_zero3_no_tp_sum"], runs["reference_qwen3"]
    norms = worst(abs(ours[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in ref)
    assert max(norms, worst_loss_diff(ours, ref)) > 3 * TOL


@pytest.mark.parametrize("name", sorted(PROFILED))
def test_profile_labels_every_part_of_the_deepspeed_step(runs, name):
    from megatron_ext.observability.regions import LABELS
    from analysis.traces import load_traces

    traces = {t.rank: t.data for t in load_traces(str(runs["logs"] / name / "traces"))}
    assert sorted(traces) == [0, 1]
    pipelined = name.startswith("pp")
    for trace in traces.values():
        names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        expected = set(LABELS.values()) - {LABELS["gc"]} - (set() if pipelined else {LABELS["pipeline_comm"]})
        assert expected <= names, expected - names
    step = runs[name][5]
    assert step["forward_time"] > 0 and step["backward_time"] > 0 and step["optimizer_time"] > 0
    assert (step["pipeline_comm_time"] > 0) == pipelined


@pytest.mark.parametrize("name", list(SAVED))
def test_checkpoint_resumes_exactly(runs, name):
    """Steps 4-5 after the resume equal the uninterrupted one-rank run's, also on another data-parallel size (then
    said in one line, converted once into iter_0000003/universal)."""
    first, resumed = runs[f"saved_{name}"], runs[f"saved_{name}_resumed"]
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5]
    reference = runs["reference_lora" if name.startswith("lora") else "reference"]
    for step in (4, 5):
        expected = reference[step]["loss"]
        assert abs(resumed[step]["loss"] - expected) <= TOL * expected, (name, step, resumed[step], expected)
    flags, saving, resuming, *later = SAVED[name]
    pp = 2 if "--pipeline-model-parallel-size" in flags else 1
    tp_saving, tp_resuming = (2 if "--tensor-model-parallel-size" in f else 1 for f in (flags, flags + sum(later, [])))
    dp_saving, dp_resuming = saving // pp // tp_saving, resuming // pp // tp_resuming
    converted = os.path.isdir(os.path.join(runs[f"ckpt_{name}"], "iter_0000003", "universal"))
    layouts = (f"saved at TP{tp_saving} x DP{dp_saving}, resumed at TP{tp_resuming} x DP{dp_resuming}"
               if tp_saving != tp_resuming else f"saved at DP{dp_saving}, resumed at DP{dp_resuming}")
    said = f"{layouts}: converted once to DeepSpeed's universal checkpoint"
    changed = (tp_saving, dp_saving) != (tp_resuming, dp_resuming)
    assert converted == changed == (said in runs[f"resumed_output_{name}"]), (name, runs[f"resumed_output_{name}"])


def test_a_tp_change_that_slices_swiglu_as_one_tensor_is_detected(runs):
    """The negative control of the TP1 -> TP2 resume: with fc1's [gate; up] cut as one tensor, step 4 is off."""
    expected = runs["reference"][4]["loss"]
    assert abs(runs["saved_wrong"][4]["loss"] - expected) > 100 * TOL * expected, runs["saved_wrong"][4]


def test_deepspeeds_own_tools_read_our_checkpoints(runs):
    """zero_to_fp32 and ds_to_universal (run at the DP2 -> DP1 resume) read a ZeRO-3 checkpoint of ours and agree on
    every weight; an unconverted directory is converted, not reused half-written."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(runs["ckpt_zero3_offload"], tag="iter_0000003")
    universal = os.path.join(runs["ckpt_zero3_offload"], "iter_0000003", "universal", "zero")
    assert sorted(weights) == sorted(n for n in os.listdir(universal) if os.path.isdir(os.path.join(universal, n)))
    assert len(weights) > 10
    for name, tensor in weights.items():
        converted = torch.load(os.path.join(universal, name, "fp32.pt"), map_location="cpu", weights_only=False)
        converted = converted["param"] if isinstance(converted, dict) else converted
        assert torch.equal(converted.reshape(tensor.shape), tensor), name


def test_the_saved_layout_decides_load_convert_or_refuse(tmp_path):
    """From the checkpoint files' names: the same layout loads as it is, ZeRO-0 (no partitions) at any DP size,
    another DP or TP size converts, what DeepSpeed cannot resume (a TP x PP change of its pipeline engine or of
    ZeRO-0) is one line naming both layouts and the weights-only way."""
    from megatron_ext.engines import deepspeed_checkpoint as universal

    path = tmp_path / "iter_0000003"
    path.mkdir()
    (path / "mp_rank_00_model_states.pt").touch()
    assert universal.plan(str(path), dp=4, tp=1) is None  # ZeRO-0
    with pytest.raises(ConfigError, match=r"resumes ZeRO-0 on another data-parallel size only"):
        universal.plan(str(path), dp=1, tp=2)
    for dp in range(2):
        (path / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").touch()
    assert universal.saved_layout(str(path)) == (2, 1, False) and universal.plan(str(path), dp=2, tp=1) is None
    assert universal.plan(str(path), dp=1, tp=1) == "saved at DP2, resumed at DP1"
    assert universal.plan(str(path), dp=1, tp=2) == "saved at TP1 x DP2, resumed at TP2 x DP1"
    with pytest.raises(ConfigError, match=r"on 1 tensor x pipeline rank\(s\) and this run has 2 \(pipeline engine\): "
                                          r".* keep TP x PP = 1, or start from its weights alone with --load "
                                          r".*iter_0000003/mcore --finetune"):
        universal.plan(str(path), dp=1, tp=1, pp=2)
    (path / "layer_01-model_00-model_states.pt").touch()  # DeepSpeed's pipeline engine wrote it
    with pytest.raises(ConfigError, match=r"rank\(s\) \(pipeline engine\) and this run has 1: DeepSpeed resumes its "
                                          r"pipeline engine"):
        universal.plan(str(path), dp=2, tp=1)


def test_lora_checkpoints_hold_the_adapters_and_say_where_the_base_is(runs):
    """DeepSpeed's files and the mcore/ copy of a LoRA run: adapters (with their optimizer state), not the frozen
    base; the record of the base is what a resume checks (tests/convert/test_peft.py does that for the megatron engine)."""
    from megatron_ext.checkpoint import files

    step = files.iteration_dir(runs["ckpt_lora_zero2"], 3)
    module = torch.load(os.path.join(step, "mp_rank_00_model_states.pt"), map_location="cpu",
                        weights_only=False)["module"]
    assert module and all(".lora_" in k for k in module if torch.is_tensor(module[k])), sorted(module)
    saved = torch.load(os.path.join(step, "mcore", "common.pt"), map_location="cpu", weights_only=True)
    assert saved["lora_base"] == dict(pretrained=None, seed=1234, directory=None, revision=None)
    from torch.distributed.checkpoint import FileSystemReader

    names = [n for n in FileSystemReader(os.path.join(step, "mcore")).read_metadata().state_dict_metadata
             if "_extra_state" not in n]
    assert names and all(".lora_" in n for n in names), sorted(names)


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_weights_load_in_the_megatron_engine(runs, name):
    deepspeed_val, megatron_val = runs[f"saved_{name}"][3]["val_loss"], runs[f"saved_{name}_exported"][1]["val_loss"]
    assert abs(megatron_val - deepspeed_val) <= TOL * deepspeed_val, (megatron_val, deepspeed_val)


def zero(**overrides):
    kwargs = dict(stage=3, offload_optimizer=None, offload_param=None, offload_path=None, hpz_partition_size=1,
                  quantized_weights=False, quantized_gradients=False, on_cuda=False)
    return zero_config(**{**kwargs, **overrides})


def test_zeropp_quantization_is_refused_on_cpu_and_configured_on_gpu():
    with pytest.raises(ConfigError, match="need CUDA GPUs"):
        zero(quantized_weights=True)
    config = zero(quantized_weights=True, quantized_gradients=True, hpz_partition_size=8, on_cuda=True)
    assert (config["zero_quantized_weights"], config["zero_quantized_gradients"],
            config["zero_hpz_partition_size"]) == (True, True, 8)


@pytest.mark.parametrize("overrides, message", [
    (dict(stage=2, quantized_gradients=True, on_cuda=True), "DeepSpeed ignores it at stage 2"),
    (dict(stage=2, hpz_partition_size=2), "need --zero-stage 3"),
    (dict(stage=2, offload_param="cpu"), "--offload-param needs --zero-stage 3"),
])
def test_settings_deepspeed_would_ignore_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        zero(**overrides)


def test_user_config_may_add_but_not_contradict(tmp_path):
    settings = OptimizerSettings(clip_grad=0.5)
    common = dict(micro_batch_size=2, global_batch_size=8, settings=settings, zero=zero(), bf16=False, fp16=False)
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.5}))
    config = deepspeed_config(**common, user_config=str(extra))
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000 and config["gradient_clipping"] == 0.5
    extra.write_text(json.dumps({"gradient_clipping": 1.0}))
    with pytest.raises(ConfigError, match="sets gradient_clipping=1.0 but the flags set 0.5"):
        deepspeed_config(**common, user_config=str(extra))


@pytest.mark.parametrize("world, gpus, flag, weights, gradients, notice", [
    (1, 1, "--zeropp", False, False, "without qwZ (int8 weight all-gather): data-parallel size 1 gathers nothing; "
                                     "without qgZ"),
    (8, 8, "--zeropp", True, False, "without qgZ (int4 gradient all-to-all): 8 rank(s) on machines of 8 GPU(s) are "
                                    "one node"),
    (16, 8, "--zeropp", True, True, None),
    (16, 8, "--zero-quantized-gradients", False, True, None),
    (2, 2, "--zero-quantized-weights", True, False, None),
])
def test_zeropp_turns_on_what_this_topology_quantizes(monkeypatch, capsys, world, gpus, flag, weights, gradients,
                                                      notice):
    """DeepSpeed gathers unquantized over a partition group of one, and quantizes gradients only when world size //
    GPUs per machine > 1: --zeropp keeps what applies and says what it drops, in one line, on rank 0."""
    import torch

    from megatron_ext.arguments import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = flag_values(parse(["--engine", "deepspeed", "--zero-stage", "3", flag], world_size=world))
    assert (args.zero_quantized_weights, args.zero_quantized_gradients) == (weights, gradients)
    out = capsys.readouterr().out
    assert (f"megatron_ext: --zeropp {notice}" in out) if notice else out == "", out


@pytest.mark.parametrize("world, gpus, flag, expected", [
    (1, 1, "--zero-quantized-weights", "--zero-quantized-weights would quantize nothing here, qwZ (int8 weight "
                                       "all-gather): data-parallel size 1 gathers nothing; drop the flag"),
    (8, 8, "--zero-quantized-gradients", "--zero-quantized-gradients would quantize nothing here, qgZ"),
    (4, 8, "--zero-quantized-gradients", "4 rank(s) on machines of 8 GPU(s) are one node"),
])
def test_quantization_deepspeed_would_skip_is_refused(monkeypatch, world, gpus, flag, expected):
    import torch

    from megatron_ext.arguments import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse(["--engine", "deepspeed", "--zero-stage", "3", flag], world_size=world)


def test_a_vocabulary_padded_otherwise_is_one_line(tmp_path):
    """A TP size that does not divide --make-vocab-size-divisible-by pads the vocabulary to another size: the merged
    embedding cannot be cut for it, said in one line before DeepSpeed's loader sees it; the same padding passes."""
    from megatron_ext.engines import deepspeed_checkpoint as universal

    saved = tmp_path / "universal" / "zero" / "embedding.word_embeddings.weight"
    saved.mkdir(parents=True)
    torch.save(torch.zeros(2048 * 8), saved / "fp32.pt")  # (as DeepSpeed 0.19.8 writes it: flat)
    model = torch.nn.Module()
    model.embedding = torch.nn.Module()
    model.embedding.word_embeddings = torch.nn.Embedding(2304, 8)
    with pytest.raises(ConfigError, match=r"its vocabulary is padded to 2048 rows and this mesh pads it to 2304"):
        universal._same_vocabulary(str(tmp_path / "universal"), model)
    model.embedding.word_embeddings = torch.nn.Embedding(2048, 8)
    universal._same_vocabulary(str(tmp_path / "universal"), model)
