"""Reward models (``--objective reward``): a Qwen with a score head trained on preference pairs, TRL's
``RewardTrainer`` definitions, exported as transformers' ``Qwen2ForSequenceClassification``.

With lr 0 from a Hugging Face reward model, step 1's loss and TRL's metrics equal ``RewardTrainer.compute_loss``
on the same pairs (transformers' rewards at each row's last non-padding token) under TP2 + SP and PP2, and the
export is the source bit for bit; trained from a language model (a new, zero score head) the losses of one rank,
DP2 and TP2 + SP agree step for step, and the export loads as a sequence classifier that scores as the run did.
"""

import json
import math
import os

import pytest
import torch

from support import REPO, hf_fixtures
from support.ranks import run_ranks
from support.pretrained_runs import assert_same_tensors
from support.step_checks import by_step, records

SEQ = 64  # the shipped pairs' chats are 52 to 62 tokens
PAIRS = "examples/data/preference_sample.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 language model and a reward model made from it (a random score head), as TRL makes one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("reward")
    base = hf_fixtures.make_qwen(root / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return dict(base=base, rm=root / "rm", root=root)


def run(world, source, log, *flags, data=PAIRS):
    return run_ranks(world, ["finetune_qwen.py", "--objective", "reward", "--pretrained", str(source), "--data-path",
                             str(data), "--data-split", "1,0", "--seq-length", str(SEQ), "--micro-batch-size", "2",
                             "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-dir", str(log),
                             *map(str, flags)])


def first_step_pairs(models, data=PAIRS):
    """Step 1's global batch as a reward run reads it (4 pairs, [chosen x 4; rejected x 4] whole rows)."""
    from megatron_ext.data import preference
    from megatron_ext.objectives.reward import RewardData

    train, valid, _ = preference.build_datasets(str(data), str(models["rm"]), SEQ, data_split="1,0",
                                                cache_dir=str(models["root"] / "cache"),
                                                layout=preference.REWARD_PAIRS)
    return RewardData(train, valid, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1,
                      seed=1234).train_microbatches()[0]


def trl_metrics(models, data, indices, center=None) -> dict:
    """TRL's RewardTrainer.compute_loss and its metrics, the reward model as the policy, on the rows its collator
    makes of the pairs ``indices`` of the ones it prepares itself from ``data`` (max_length = our --seq-length)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(models["rm"], dtype=torch.float32)
    config = RewardConfig(output_dir=str(models["root"] / "trl"), report_to=[], use_cpu=True, bf16=False,
                          center_rewards_coefficient=center, max_length=SEQ)
    rows = [json.loads(line) for line in open(os.path.join(REPO, data))]
    trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(models["rm"]))
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in indices])
    trainer.model.train()  # (its metrics are kept by mode; no dropout in Qwen2)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs).item()
    return dict(loss=loss, **{k: v[-1] for k, v in trainer._metrics["train"].items()})


@pytest.mark.parametrize("mesh", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                  ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]],
                         ids=["tp2_sp", "pp2_margins", "cp2"])
def test_lr0_step_equals_trl_and_the_export_is_the_source(models, tmp_path, mesh):
    """lr 0 from a Hugging Face reward model (a random score head): step 1 = TRL's loss (with centring), accuracy,
    margin, mean, min and max reward from the rows TRL prepares itself from the same file (PP2: with a margin column,
    which the loss subtracts); --save-hf gives back every tensor bit for bit and a sequence classifier's config."""
    data = PAIRS
    if "--pipeline-model-parallel-size" in mesh:
        rows = [json.loads(line) for line in open(os.path.join(REPO, PAIRS))]
        data = tmp_path / "margins.jsonl"
        data.write_text("".join(json.dumps(dict(row, margin=0.5 * (i % 3))) + "\n" for i, row in enumerate(rows)))
    proc = run(2, models["rm"], tmp_path / "log", *mesh, "--train-iters", 1, "--lr", 0, "--center-rewards-coefficient",
               0.01, "--save-hf", tmp_path / "hf", data=data)
    assert "new, zero-initialised" not in proc.stdout
    ours = records(tmp_path / "log")[0]
    from megatron_ext.data.sampler import GlobalBatchSampler

    indices = GlobalBatchSampler(len(open(os.path.join(REPO, PAIRS)).readlines()), 4, 1234).next_global_batch()
    assert first_step_pairs(models, data)["margin"].any() == (data != PAIRS)
    theirs = trl_metrics(models, data, indices, center=0.01)  # TRL's own rows of step 1's pairs
    assert abs(theirs["margin"]) > 1e-3 and theirs["min_reward"] < theirs["max_reward"]  # a non-zero head
    for key in ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert math.isclose(ours[key], theirs[key], rel_tol=1e-5, abs_tol=1e-6), (key, ours[key], theirs[key])
    assert_same_tensors(tmp_path / "hf", models["rm"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1


def test_trained_from_a_language_model_every_mesh_agrees_and_exports(models, tmp_path):
    """From the language model: a new, zero score head (step 1 is ln 2 with zero rewards); 4 steps give the same
    losses and min/max rewards on one rank, DP2, TP2 + SP (SP gathers the sequence for the head; its gradients are
    not summed over TP), CP2 (each row's last token on one CP rank: the scores gathered), DeepSpeed ZeRO-3 and
    FSDP2, and the export scores the step-1 pairs as the run's final weights do."""
    from transformers import AutoModelForSequenceClassification

    losses, extremes = {}, {}
    for name, world, flags in (("one", 1, ["--save-hf", tmp_path / "hf"]), ("dp2", 2, []),
                               ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                               ("cp2", 2, ["--context-parallel-size", "2"]),
                               ("zero3", 2, ["--engine", "deepspeed", "--zero-stage", "3"]),
                               ("fsdp2", 2, ["--engine", "fsdp"])):
        proc = run(world, models["base"], tmp_path / name, "--train-iters", 4, "--lr", "3e-3", *flags)
        assert "new, zero-initialised: output_layer.weight [1, 64]" in proc.stdout
        losses[name] = by_step(records(tmp_path / name))
        extremes[name] = [r[k] for r in records(tmp_path / name) for k in ("min_reward", "max_reward")]
    assert math.isclose(losses["one"][1], math.log(2), rel_tol=1e-6) and losses["one"][4] < losses["one"][1] - 1e-3
    assert extremes["one"][:2] == [0.0, 0.0] and extremes["one"][6] < extremes["one"][7]
    for name in ("dp2", "tp2_sp", "cp2", "zero3", "fsdp2"):  # (the extremes over both DP ranks' rows)
        for step, loss in losses["one"].items():
            assert math.isclose(losses[name][step], loss, rel_tol=1e-5), (name, step, losses[name][step], loss)
        assert extremes[name] == pytest.approx(extremes["one"], rel=1e-5, abs=1e-6), name
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.score.weight.abs().sum() > 0
    again = run(1, tmp_path / "hf", tmp_path / "again", "--train-iters", 1, "--lr", 0)
    assert "new, zero-initialised" not in again.stdout
    batch = first_step_pairs(models)
    with torch.no_grad():
        rewards = model(input_ids=batch["tokens"], attention_mask=(~batch["padding_mask"]).long()).logits[:, 0]
    margin = (rewards[:4] - rewards[4:]).mean().item()
    assert math.isclose(records(tmp_path / "again")[0]["margin"], margin, rel_tol=1e-5, abs_tol=1e-6)


def test_a_lora_reward_model_trains_its_head_whole(models, tmp_path):
    """LoRA from the language model: adapters on qkv and fc1, the new score head trained whole (PEFT's
    modules_to_save); one rank = TP2 + SP over 4 steps (1e-5) and the loss falls; the merged export loads as a
    sequence classifier whose scores of step 1's pairs are the run's (its margin, 1e-5). A frozen head would leave
    every reward at 0 (the loss at ln 2). The PEFT adapter (``--save-peft``: the score head as PEFT's module to
    save) on the language model in transformers scores as the merged export, and read back with
    ``--pretrained-adapter`` onto the language model it gives the run's margin, also under FSDP2 (left out, the head
    would start afresh)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    lora = ("--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", "qkv,fc1", "--train-iters", 4, "--lr", "3e-3")
    run(1, models["base"], tmp_path / "one", *lora, "--save-hf", tmp_path / "hf", "--save-peft", tmp_path / "peft")
    run(2, models["base"], tmp_path / "tp2", *lora, "--tensor-model-parallel-size", 2, "--sequence-parallel")
    one, tp2 = by_step(records(tmp_path / "one")), by_step(records(tmp_path / "tp2"))
    assert math.isclose(one[1], math.log(2), rel_tol=1e-6) and one[4] < one[1] - 1e-3
    assert tp2 == pytest.approx(one, rel=1e-5)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    base = AutoModelForSequenceClassification.from_pretrained(models["base"], dtype=torch.float32)
    assert model.score.weight.abs().sum() > 0
    layer, plain = model.model.layers[0], base.model.layers[0]
    assert not torch.equal(layer.self_attn.q_proj.weight, plain.self_attn.q_proj.weight)  # adapters merged
    assert torch.equal(layer.self_attn.o_proj.weight, plain.self_attn.o_proj.weight)  # no adapter there
    run(1, tmp_path / "hf", tmp_path / "again", "--train-iters", 1, "--lr", 0)
    batch = first_step_pairs(models)
    with torch.no_grad():
        rewards = model(input_ids=batch["tokens"], attention_mask=(~batch["padding_mask"]).long()).logits[:, 0]
    margin = (rewards[:4] - rewards[4:]).mean().item()
    assert math.isclose(records(tmp_path / "again")[0]["margin"], margin, rel_tol=1e-5, abs_tol=1e-6)

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    peft = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(
        models["base"], dtype=torch.float32, num_labels=1, pad_token_id=model.config.pad_token_id), tmp_path / "peft")
    with torch.no_grad():
        theirs = peft(input_ids=batch["tokens"], attention_mask=(~batch["padding_mask"]).long()).logits[:, 0]
    torch.testing.assert_close(theirs, rewards, rtol=1e-5, atol=1e-5)
    run(1, models["base"], tmp_path / "adapter", "--pretrained-adapter", tmp_path / "peft", "--train-iters", 1,
        "--lr", 0)
    run(2, models["base"], tmp_path / "fsdp", "--pretrained-adapter", tmp_path / "peft", "--train-iters", 1,
        "--lr", 0, "--engine", "fsdp")  # (each rank draws its shards, the head's too, from the adapter)
    for name in ("adapter", "fsdp"):
        assert math.isclose(records(tmp_path / name)[0]["margin"], margin, rel_tol=1e-5, abs_tol=1e-6), name
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="carries a score head .* add --objective reward"):
        parse(["--pretrained", str(models["base"]), "--pretrained-adapter", str(tmp_path / "peft")], world_size=1)


@pytest.mark.parametrize("flags, message", [
    ("--pack-sequences", "--pack-sequences does not go with --objective reward"),
    ("--cross-entropy-loss-fusion", "--cross-entropy-loss-fusion does not go with --objective reward"),
])
def test_what_a_reward_model_cannot_take_is_one_line(flags, message):
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse(["--objective", "reward", *flags.split()], world_size=2)
    with pytest.raises(ConfigError, match="--center-rewards-coefficient is for --objective reward"):
        parse(["--center-rewards-coefficient", "0.1"], world_size=1)
    assert parse(["--objective", "reward"], world_size=1).shape.head == "score"


def test_a_reward_model_is_trained_as_one(models):
    """--pretrained a sequence classifier without --objective reward: one line (SFT has no score to train)."""
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="is a reward model .* train it with --objective reward"):
        parse(["--pretrained", str(models["rm"])], world_size=1)


def test_the_converters_round_trip_a_reward_model(models, tmp_path):
    """tools/convert_hf_to_mcore.py and back: every tensor (``score.weight`` included) and the config as they were."""
    from support.ranks import run_tool

    run_tool("convert_hf_to_mcore", "--hf-path", models["rm"], "--save", tmp_path / "mcore")
    run_tool("convert_mcore_to_hf", "--load", tmp_path / "mcore", "--save", tmp_path / "hf")
    assert_same_tensors(tmp_path / "hf", models["rm"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((models["rm"] / "config.json")
                                                                                     .read_text())


def test_the_dpo_quickstart_trains_a_reward_model_when_asked():
    """``bash examples/dpo_cpu_quickstart.sh --objective reward`` (DRY_RUN) parses for its 4 ranks as a reward model
    on the shipped pairs (run by hand: docs/data.md)."""
    import os
    import shlex
    import subprocess

    from support import REPO
    from megatron_ext.arguments import parse

    line = subprocess.run(["bash", "examples/dpo_cpu_quickstart.sh", "--objective", "reward"], cwd=REPO,
                          capture_output=True, text=True, env=dict(os.environ, DRY_RUN="1"), timeout=60).stdout.strip()
    argv = shlex.split(line)
    run = parse(argv[argv.index("finetune_qwen.py") + 1:], world_size=4)
    assert run.objective.NAME == "reward" and run.shape.head == "score" and run.mesh.tp == 2
