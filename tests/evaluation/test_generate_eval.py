"""--eval-generate-samples: greedy answers to held-out problems inside the run, on every engine and mesh.

A tiny Qwen2 (weights spread enough that greedy decoding wanders over the vocabulary instead of repeating one
token) starts from --pretrained with --lr 0, so every run holds the same weights at its evaluation: the answers on
one rank must be transformers' own greedy generation of the same prompts, token for token, and every layout (TP2 +
SP x PP2 x VPP2, CP2, DeepSpeed ZeRO-3 DP2 and its pipeline engine, FSDP DP2) must give the same answers, as must an
MoE upcycled from it, on one rank and under EP2. Reading
the logits one position early (a planted bug) must not. The logged accuracy is the file's.
"""

import json

import pytest

from support import hf_fixtures
from support.ranks import run_ranks

SEQ = 96
SAMPLES = 5  # odd: DP2 replicas hold 3 and 2 problems and must still run the same forward passes
LAYOUTS = {
    "tp2_sp_pp2_vpp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "zero3_dp2": (2, ["--engine", "deepspeed", "--zero-stage", "3"]),
    "deepspeed_pp2": (2, ["--engine", "deepspeed", "--pipeline-model-parallel-size", "2"]),
    "fsdp_dp2": (2, ["--engine", "fsdp"]),
}
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]  # upcycled from the dense model as it loads
MOE_LAYOUTS = {"moe_1rank": (1, MOE), "moe_ep2": (2, MOE + ["--expert-model-parallel-size", "2"])}


def generations(log_dir):
    (path,) = (log_dir / "generations").iterdir()
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    hf = hf_fixtures.make_qwen(str(root / "hf"), scale=0.3)
    common = ["finetune_qwen.py", "--pretrained", hf, "--seq-length", str(SEQ), "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "1", "--lr", "0", "--eval-interval", "1",
              "--eval-iters", "1", "--eval-generate-samples", str(SAMPLES), "--data-cache-dir", str(root / "cache")]
    out = {"hf": hf}
    for name, (world, flags) in {"1rank": (1, []), **LAYOUTS, **MOE_LAYOUTS}.items():
        run_ranks(world, common + flags + ["--log-dir", str(root / name)])
        out[name] = root / name
    run_ranks(1, ["tests/support/patched.py", "next_token_off_by_one"] + common + ["--log-dir", str(root / "off_by_one")])
    out["off_by_one"] = root / "off_by_one"
    return out


def answers(log_dir):
    return [(r["index"], r["output"], r["generated_tokens"]) for r in generations(log_dir)]


def test_one_rank_answers_as_transformers_generates(runs):
    from megatron_ext.data import sft
    from megatron_ext.evaluation.math_eval import TransformersBackend

    results = generations(runs["1rank"])
    assert [r["index"] for r in results] == list(range(SAMPLES))
    backend = TransformersBackend(runs["hf"], sft.load_tokenizer(runs["hf"]))
    for r in results:
        (text, tokens), = backend.generate([r["prompt"]], SEQ - backend.length(r["prompt"]))
        assert (r["output"], r["generated_tokens"]) == (text, tokens), r["index"]
    assert len({r["output"] for r in results}) == SAMPLES and all(len(set(r["output"])) > 5 for r in results)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_gives_the_same_answers(runs, layout):
    assert answers(runs[layout]) == answers(runs["1rank"])


def test_expert_parallel_gives_the_same_answers(runs):
    """Experts upcycled from the dense MLP compute the dense model (top-2 weights sum to one), so the answers are
    the dense model's; under EP2 every token goes through the all-to-all and must come back to its place."""
    assert answers(runs["moe_ep2"]) == answers(runs["moe_1rank"]) == answers(runs["1rank"])


def test_reading_the_wrong_position_is_caught(runs):
    assert answers(runs["off_by_one"]) != answers(runs["1rank"])


@pytest.mark.parametrize("layout", ["1rank", "zero3_dp2", "fsdp_dp2"])
def test_logged_accuracy_is_the_answers_of_every_replica(runs, layout):
    (record,) = [json.loads(line) for line in (runs[layout] / "metrics.jsonl").read_text().splitlines()]
    results = generations(runs[layout])
    assert len(results) == SAMPLES
    assert record["val_math_accuracy"] == sum(r["correct"]["metamath"] for r in results) / SAMPLES
    assert record["val_math_no_answer"] == sum(r["extracted"]["metamath"] is None for r in results) / SAMPLES
    assert record["val_math_tokens_per_sec"] > 0
    summary = json.loads((runs[layout] / "summary.json").read_text())
    assert summary["final_val_math_accuracy"] == record["val_math_accuracy"]


def test_accuracy_counts_right_wrong_and_missing_answers(single_rank, tmp_path):
    """Canned answers in place of the decoder: 3 of 6 right (one after a unit and a comma, one in LaTeX, scored
    whole as MetaMath scores MATH), two wrong ("(1,2)" is no 12), one with no answer; the file holds each line in
    eval_math.py's format."""
    from types import SimpleNamespace

    import torch

    from megatron_ext.data import sft
    from megatron_ext.evaluation.generate import MathAccuracy

    tokenizer = sft.load_tokenizer(hf_fixtures.TOKENIZER)
    golds = ["1200", "7", "3", "5", "\\frac{3}{4}", "12"]
    said = ["The answer is: $1,200 dollars.", "The answer is: 7", "The answer is: 4", "I do not know",
            "The answer is: \\frac{3}{4}", "The answer is: (1,2)"]
    problems = [dict(question=f"q{i}", answer=f"... The answer is: {g}", prompt=f"p{i}", ids=[5] * (i + 1))
                for i, g in enumerate(golds)]
    accuracy = MathAccuracy(problems, tokenizer, seq_length=64, micro_batch_size=2, log_dir=str(tmp_path),
                            device=torch.device("cpu"))
    canned = {p["prompt"]: tokenizer(text, add_special_tokens=False)["input_ids"] for p, text in zip(problems, said)}
    accuracy.decoder = lambda modules, prompts, length: [canned[f"p{len(ids) - 1}"] for ids in prompts]
    metrics = accuracy(SimpleNamespace(forward_modules=[]), 3)
    assert (metrics["val_math_accuracy"], metrics["val_math_no_answer"]) == (0.5, pytest.approx(1 / 6))
    lines = [json.loads(line) for line in (tmp_path / "generations" / "step_0000003.jsonl").read_text().splitlines()]
    assert [r["correct"]["metamath"] for r in lines] == [True, True, False, False, True, False]
    assert [r["output"] for r in lines] == said and [r["gold"] for r in lines] == golds


@pytest.mark.parametrize("flags, message", [
    ([], "give --eval-interval N too"),
    (["--eval-interval", "2", "--mock-data"], "drop --mock-data"),
])
def test_flags_it_needs(flags, message):
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse(["--eval-generate-samples", "4"] + flags, world_size=1)


def test_data_without_checkable_answers_is_refused(tmp_path):
    from megatron_ext.data import chat, sft
    from megatron_ext.errors import ConfigError
    from megatron_ext.evaluation.generate import held_out_problems

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Greet {i}", "output": "Hello there"}) + "\n"
                            for i in range(50)))
    with pytest.raises(ConfigError, match="no validation row of --data-path ends in an assistant turn with a "
                                          "checkable answer"):
        held_out_problems([(1.0, str(path))], chat.RowFormat(), "50,50", 1, None,
                          sft.load_tokenizer(hf_fixtures.TOKENIZER), 64, 4)
