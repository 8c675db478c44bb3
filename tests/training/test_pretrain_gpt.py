"""pretrain_gpt.py end to end on a 0.3/0.7 blend of two Megatron corpora (the shipped Shakespeare sample's two halves,
written by tools/preprocess_data.py) and the tiny GPT-2 tokenizer (fp32, CPU ranks).

The same five steps (clipping active) give the same losses and grad norms on one rank, DP2, TP2 + SP, TP2 x PP2, and
under torch FSDP2 (``--engine fsdp``) over DP2 and 2D FSDP2 x TP2: megatron-core's blended sample index is the same
on every mesh and the initialisation is mesh-independent. A TP2 run saved at
step 3 resumes on one rank to the same steps 4-5 (weights, optimizer and the data position); so does an FSDP2 x TP2
run resumed with one DP rank. Deferred initialisation builds only each rank's shards. Bad flags are one line.
"""

import json

import pytest

from support import flag_values
from support import REPO
from support.ranks import run_ranks, run_script, run_tool

TOL = 1e-5
COMMON = ["pretrain_gpt.py", "--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--train-iters", "5", "--lr", "3e-3", "--lr-warmup-iters", "1",
          "--clip-grad", "0.5"]
MESHES = {"1rank": (1, []), "dp2": (2, []), "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
          "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
          # torch FSDP2 over DP, and 2D: FSDP over DP x megatron-core TP (engines/fsdp.py)
          "fsdp2": (2, ["--engine", "fsdp"]),
          "fsdp2_tp2": (4, ["--engine", "fsdp", "--tensor-model-parallel-size", "2"])}


def records(path):
    return {r["step"]: r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}


def blend(root):
    """Two corpora from the halves of the Shakespeare sample, blended 0.3/0.7."""
    text = open(f"{REPO}/examples/data/tiny_shakespeare_sample.txt", encoding="utf-8").read()
    cut = text.index("\n\n", len(text) // 2) + 1
    prefixes = []
    for name, part in (("first", text[:cut]), ("second", text[cut:])):
        (root / f"{name}.txt").write_text(part, encoding="utf-8")
        run_tool("preprocess_data", "--input", root / f"{name}.txt", "--output-prefix", root / name,
                 "--tokenizer-model", f"{REPO}/examples/tokenizers/tiny-gpt2", "--append-eod")
        prefixes.append(str(root / f"{name}_text_document"))
    return ["--data-path", "0.3", prefixes[0], "0.7", prefixes[1]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    cache = ["--data-cache-path", str(root / "cache")] + blend(root)
    out = {}
    for name, (world, flags) in MESHES.items():
        run_ranks(world, COMMON + flags + cache + ["--log-dir", str(root / name)])
        out[name] = records(root / name)
    ckpt = ["--save", str(root / "ckpt"), "--save-interval", "3", "--exit-interval", "3"]
    run_ranks(2, COMMON + MESHES["tp2_sp"][1] + cache + ckpt + ["--log-dir", str(root / "first3")])
    run_ranks(1, COMMON + cache + ["--load", str(root / "ckpt"), "--log-dir", str(root / "resumed")])
    out["first3"], out["resumed"] = records(root / "first3"), records(root / "resumed")
    # FSDP2 x TP2 saved at step 3 (torch.distributed.checkpoint, each rank its shards), resumed as FSDP1 x TP2.
    fsdp_ckpt = ["--save", str(root / "fsdp_ckpt"), "--save-interval", "3", "--exit-interval", "3"]
    run_ranks(4, COMMON + MESHES["fsdp2_tp2"][1] + cache + fsdp_ckpt + ["--log-dir", str(root / "fsdp_first3")])
    run_ranks(2, COMMON + MESHES["fsdp2_tp2"][1] + cache + ["--load", str(root / "fsdp_ckpt"),
                                                            "--log-dir", str(root / "fsdp_resumed")])
    out["fsdp_resumed"], out["fsdp_ckpt"] = records(root / "fsdp_resumed"), root / "fsdp_ckpt"
    return out


@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "1rank"])
def test_same_steps_on_every_mesh(runs, mesh):
    ours, ref = runs[mesh], runs["1rank"]
    assert sorted(ours) == [1, 2, 3, 4, 5] and all(r["grad_norm"] > 0.5 for r in ref.values())
    for step, r in ref.items():
        assert abs(ours[step]["loss"] - r["loss"]) <= TOL * r["loss"], (mesh, step, ours[step]["loss"], r["loss"])
        assert abs(ours[step]["grad_norm"] - r["grad_norm"]) <= TOL * r["grad_norm"], (mesh, step)


def test_it_learns_and_resumes_exactly_on_another_mesh(runs):
    ref = runs["1rank"]
    assert ref[5]["loss"] < ref[1]["loss"] - 0.2
    assert sorted(runs["first3"]) == [1, 2, 3] and sorted(runs["resumed"]) == [4, 5]
    for step in (4, 5):
        assert abs(runs["resumed"][step]["loss"] - ref[step]["loss"]) <= TOL * ref[step]["loss"], step


def test_fsdp_resumes_exactly_under_another_mesh_and_only_under_fsdp(runs, tmp_path):
    ref = runs["1rank"]
    assert sorted(runs["fsdp_resumed"]) == [4, 5]
    for step in (4, 5):
        assert abs(runs["fsdp_resumed"][step]["loss"] - ref[step]["loss"]) <= TOL * ref[step]["loss"], step
    proc = run_script(["pretrain_gpt.py", "--train-iters", "5", "--load", runs["fsdp_ckpt"], "--log-dir", tmp_path])
    assert proc.returncode == 2 and "written by --engine fsdp" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_qwen_continues_pretraining_on_a_corpus_and_resumes_on_another_mesh(tmp_path):
    """Continued pretraining of a Qwen3 (the tiny preset) on a corpus preprocessed with its own tokenizer: it learns,
    a TP2 + SP run saved at step 3 resumes on one rank to the same steps 4-5, and the export is a Qwen3 that
    transformers loads."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "text.txt").write_text(open(f"{REPO}/examples/data/tiny_shakespeare_sample.txt").read())
    tokenizer = f"{REPO}/examples/tokenizers/tiny-qwen"
    run_tool("preprocess_data", "--input", tmp_path / "text.txt", "--output-prefix", tmp_path / "corpus",
             "--tokenizer-model", tokenizer, "--append-eod")
    qwen = ["--model", "tiny-qwen3", "--tokenizer", tokenizer, "--data-path", str(tmp_path / "corpus_text_document"),
            "--data-cache-path", str(tmp_path / "cache")] + COMMON[3:]
    run_ranks(1, ["pretrain_gpt.py", *qwen, "--log-dir", str(tmp_path / "one"), "--save-hf", str(tmp_path / "hf")])
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--exit-interval", "3"]
    run_ranks(2, ["pretrain_gpt.py", *qwen, *MESHES["tp2_sp"][1], *ckpt, "--log-dir", str(tmp_path / "first3")])
    run_ranks(1, ["pretrain_gpt.py", *qwen, "--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "resumed")])
    one, resumed = records(tmp_path / "one"), records(tmp_path / "resumed")
    assert one[5]["loss"] < one[1]["loss"] - 0.2 and sorted(resumed) == [4, 5]
    assert all(abs(resumed[s]["loss"] - one[s]["loss"]) <= TOL * one[s]["loss"] for s in (4, 5)), (resumed, one)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.model_type == "qwen3"


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "1024"], "--seq-length 1024 exceeds the model's 512 learned positions"),
    (["--engine", "fsdp", "--load", "ckpt", "--finetune"], "--engine fsdp does not take --load --finetune"),
    (["--num-experts", "4"], "--num-experts 4 makes a Qwen model MoE; GPT-2 has no MoE form here"),
    (["--reset-attention-mask"], "--reset-attention-mask packs each sample's documents, whose positions restart too"),
    (["--model", "qwen2.5-0.5b", "--reset-position-ids"], "a Qwen's rotary positions restart with its packed documents"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse(COMMON[1:] + flags, world_size=1, family="gpt")


@pytest.mark.parametrize("flags, world, layers, experts", [
    (["--pretrained", "Qwen/Qwen2.5-0.5B"], 1, 24, None), (["--model", "qwen3-8b"], 1, 36, None),
    (["--pretrained", "Qwen/Qwen3-30B-A3B", "--expert-model-parallel-size", "8"], 8, 48, 128),
    (["--pretrained", "Qwen/Qwen2.5-0.5B", "--num-experts", "4"], 1, 24, 4)],  # upcycled while loading
    ids=["qwen2.5_0.5b", "qwen3_8b_preset", "qwen3_30b_a3b_ep8", "upcycled"])
def test_published_qwen_models_parse_for_continued_pretraining(flags, world, layers, experts):
    """From the published config (offline: the session's hub cache) or a preset; the tokenizer is the model's; MoE
    models (published, or a dense one upcycled) with their router settings."""
    from megatron_ext.arguments import parse
    from megatron_ext.models.qwen.shape import ModelShape

    run = parse(COMMON[3:] + flags + ["--bf16", "--seq-length", "4096", "--global-batch-size", "16"],
                world_size=world, family="gpt")
    assert isinstance(run.shape, ModelShape) and run.shape.num_layers == layers
    assert flag_values(run).tokenizer.endswith("tiny-gpt2") == ("--model" in flags)
    assert (run.shape.moe and run.shape.moe.num_experts) == experts and (run.moe is None) == (experts is None)
    assert run.mesh.ep == world


def test_document_masks_give_the_same_steps_on_deepspeeds_pipeline(tmp_path):
    """--reset-position-ids --reset-attention-mask (each sample's documents packed) on one rank and on DeepSpeed's
    pipeline engine (PP2: the documents' offsets travel with the activations): the same losses."""
    docs = COMMON + ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
                     "--data-cache-path", str(tmp_path / "cache")]
    run_ranks(1, docs + ["--log-dir", str(tmp_path / "one")])
    run_ranks(2, docs + ["--engine", "deepspeed", "--pipeline-model-parallel-size", "2", "--log-dir",
                         str(tmp_path / "pipe")])
    one, pipe = records(tmp_path / "one"), records(tmp_path / "pipe")
    assert sorted(pipe) == [1, 2, 3, 4, 5]
    assert all(abs(pipe[s]["loss"] - one[s]["loss"]) <= TOL * one[s]["loss"] for s in one), (pipe, one)


def test_documents_under_context_parallelism_are_refused():
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="--reset-attention-mask with --context-parallel-size > 1"):
        parse(COMMON[1:] + ["--reset-position-ids", "--reset-attention-mask", "--context-parallel-size", "2",
                            "--global-batch-size", "2"], world_size=2, family="gpt")


def test_a_missing_corpus_is_one_line_and_exit_2(tmp_path):
    """After the process group exists: the data is read on every rank, the error stays one line."""
    proc = run_script(["pretrain_gpt.py", "--train-iters", "1", "--log-dir", tmp_path, "--data-path", "missing.txt"])
    assert proc.returncode == 2 and "missing.txt" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_fsdp_builds_only_each_ranks_shards(tmp_path):
    """Deferred initialisation: GPT-2 medium (1.42 GB of fp32 parameters) built on the meta device, sharded, then
    initialised shard by shard: under DP2 each rank's resident memory grows by about half the model while it is
    built, not by the whole model (one rank: 1.46 GB measured; DP2: 0.72-0.76 GB)."""
    run_ranks(2, ["tests/support/fsdp_memory_worker.py", str(tmp_path / "memory.json"), "gpt2-medium"])
    ranks = json.loads((tmp_path / "memory.json").read_text())
    for rank in ranks:
        assert rank["local_bytes"] == rank["full_bytes"] // 2
        assert rank["peak_increase"] < 0.6 * rank["full_bytes"], rank


def test_fsdp_refuses_what_it_does_not_compose_with_yet():
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    base = COMMON[1:] + ["--engine", "fsdp"]
    for flags, message in ((["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1"),
                           (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "--sequence-parallel"),
                           (["--use-distributed-optimizer"], "--use-distributed-optimizer")):
        with pytest.raises(ConfigError, match=message):
            parse(base + flags, world_size=4, family="gpt")
