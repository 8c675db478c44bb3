"""KTO (``--objective kto``): TRL's ``KTOTrainer`` losses and metrics, and runs whose KL estimate is the global
batch's on every mesh. (Examples and KL rows = TRL's prepared rows: tests/data/test_preference_rows.py.)

In process: bad labels are counted or one line; the loss and metrics equal ``KTOTrainer._compute_loss`` on the same
weights and rows for kto (KL above and below zero, weighted) and apo_zero_unpaired. Runs: step 1's log-probabilities
are TRL's from its own prepared rows, with zero rewards and KL (loss 0.5); step 2's loss, metrics and KL are TRL's from
its own rows with the step-1 weights; one rank, DP2 x PP2, CP2, FSDP2 and ZeRO-3 give the same three steps, and
TRL's per-micro-batch KL (gradient accumulation) planted does not.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from support import hf_fixtures
from support.ranks import run_ranks
from support.step_checks import records

TOKENIZER = "examples/tokenizers/tiny-qwen"
SEQ = 96
KL_BATCH = 4  # the runs' --micro-batch-size: TRL's per_device_train_batch_size
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def pairs():
    """Conversational pairs with a system turn and two user turns (TRL's layout)."""
    system = {"role": "system", "content": "Be brief."}
    return [{"prompt": [system, {"role": "user", "content": f"Hi {a}."}, {"role": "assistant", "content": "Hi."},
                        {"role": "user", "content": f"What is {a} + {a}?"}],
             "chosen": [{"role": "assistant", "content": f"It is {2 * a}."}],
             "rejected": [{"role": "assistant", "content": f"It is {2 * a + 1} or so."}]} for a in range(2, 10)]


def unpaired():
    """The pairs as TRL's unpaired rows, desirable and undesirable alternating (so every batch holds both)."""
    return [dict(prompt=r["prompt"], completion=r[k], label=k == "chosen") for r in pairs()
            for k in ("chosen", "rejected")]


def write(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def build(path, **kw):
    from megatron_ext.data import unpaired

    train, _, info = unpaired.build_datasets(str(path), TOKENIZER, SEQ, KL_BATCH, data_split="1,0", **kw)
    return train, info


@pytest.fixture(scope="module")
def kto_trainer(tmp_path_factory):
    """TRL's KTOTrainer around a tiny Qwen2 on the unpaired rows, preparing its own (max_length: our --seq-length)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    root = tmp_path_factory.mktemp("kto")
    base = hf_fixtures.make_qwen(root / "base")
    config = KTOConfig(output_dir=str(root / "trl"), report_to=[], use_cpu=True, beta=0.1, bf16=False,
                       max_length=SEQ, per_device_train_batch_size=KL_BATCH)
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         ref_model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=config,
                         train_dataset=Dataset.from_list(unpaired()),
                         processing_class=AutoTokenizer.from_pretrained(base))
    return trainer, base


def test_bad_labels_are_counted_or_one_line(tmp_path):
    from megatron_ext.errors import ConfigError

    rows = [dict(prompt="Hi", completion="Hello", label=True), dict(prompt="Hi", completion="Hey", label="yes"),
            dict(prompt="Hi", completion=" ", label=False), dict(prompt="Yo", completion="Hi there", label=False)]
    path = write(tmp_path / "u.jsonl", rows)
    train, info = build(path)
    assert len(train) == 2 and info["bad_rows"] == 2
    with pytest.raises(ConfigError, match=r"u.jsonl: bad preference row at line 2 \('label' is 'yes'"):
        build(path, bad_rows="error", cache_dir=str(tmp_path / "other"))


def test_a_micro_batch_of_one_is_refused_for_the_kl_estimate():
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="--micro-batch-size 1 has none; use 2 or more"):
        parse(["--objective", "kto", "--micro-batch-size", "1"], world_size=1)
    assert parse(["--objective", "kto", "--micro-batch-size", "1", "--kto-loss", "apo_zero_unpaired"],
                 world_size=1).objective.loss == "apo_zero_unpaired"


def transformers_logps(model, batch, rows) -> torch.Tensor:
    tokens, labels, mask = (batch[k][rows] for k in ("tokens", "labels", "completion_mask"))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    token_logps = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (token_logps * mask).sum(-1)


def trl_step(trainer, batch, settings, reference=None):
    """TRL's loss and metrics with ``settings`` (KTOConfig): on one of our batches (rows [examples; KL rows]),
    or (``batch`` a list of indices) on the rows TRL's own collator makes of its prepared examples; the reference
    from ``reference`` ([b, 2]) or TRL's own reference model."""
    if isinstance(batch, list):
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in batch])
    else:
        b = len(batch["index"])
        tokens = torch.cat([batch["tokens"][:, :1], batch["labels"]], dim=1)  # the whole ids
        completion = torch.nn.functional.pad(batch["completion_mask"], (1, 0))
        attention = torch.nn.functional.pad(~batch["padding_mask"], (1, 0), value=True).long()
        inputs = dict(input_ids=tokens[:b], attention_mask=attention[:b], completion_mask=completion[:b],
                      KL_input_ids=tokens[b:], KL_attention_mask=attention[b:], KL_completion_mask=completion[b:],
                      label=batch["desirable"].bool())
    trainer.precompute_ref_logps = reference is not None
    if reference is not None:
        inputs.update(ref_logps=reference[:, 0], ref_KL_logps=reference[:, 1])
    trainer.loss_type, trainer.beta = settings.loss, settings.beta
    trainer.calculate_KL = settings.loss == "kto"
    trainer.desirable_weight, trainer.undesirable_weight = settings.desirable_weight, settings.undesirable_weight
    trainer._metrics["train"].clear()
    trainer.model.train()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, False).item()
    return dict(loss=loss, **{k: v[-1] for k, v in trainer._metrics["train"].items()})


def ours(settings, model, batch, reference):
    """Our loss and metrics on ``batch`` as one global batch: transformers' log-probabilities, the KL estimate over
    its KL rows, ``kto.example_losses``."""
    from megatron_ext.objectives import kto

    b = len(batch["index"])
    logps, kl_logps = transformers_logps(model, batch, slice(0, b)), transformers_logps(model, batch, slice(b, None))
    kl = torch.tensor(0.0)
    if settings.loss == "kto":  # the KL pass's global mean of the KL rows' log-ratios, as Objective takes it
        objective = object.__new__(kto.KTO)
        objective.step_func = kto.KTOStep(settings)
        mean = (kl_logps - reference[:, 1]).mean().item()
        kl = torch.tensor(objective.kl_estimate(SimpleNamespace(forward_backward=lambda batches, forward_only: mean),
                                                []))
    losses, metrics = kto.example_losses(settings, logps, reference[:, 0], kl.expand(b), batch["desirable"],
                                         batch["chosen_scale"], batch["rejected_scale"])
    return dict(loss=losses.mean().item(), **{k: v.mean().item() for k, v in metrics.items()})


def batch_of(train, indices, reference=None):
    from megatron_ext.data import unpaired

    good = int(train.desirable[indices].sum())
    n = len(indices)
    return unpaired.collate([train[i] for i in indices], reference, n / good, n / (n - good))


@pytest.mark.parametrize("loss, weights, kl_shift", [("kto", (1.0, 1.0), -3.0), ("kto", (1.3, 0.7), 3.0),
                                                      ("apo_zero_unpaired", (1.0, 2.0), 3.0)],
                         ids=["kto-kl-above-0", "kto-weighted-kl-clamped", "apo_zero_unpaired"])
def test_losses_and_metrics_are_trls(kto_trainer, tmp_path, loss, weights, kl_shift):
    """Our example losses and metrics on transformers' log-probabilities = TRL's _compute_loss (fp32, 1e-5), the
    KL estimate positive, or negative and clamped to 0."""
    from megatron_ext.objectives.config import KTOConfig

    trainer, _ = kto_trainer
    train, _ = build(write(tmp_path / "p.jsonl", pairs()))
    indices = [0, 3, 5, 9, 12]
    batch = batch_of(train, indices)
    b = len(indices)
    logps = torch.stack([transformers_logps(trainer.model, batch, slice(0, b)),
                         transformers_logps(trainer.model, batch, slice(b, None))], dim=1)
    reference = logps + torch.tensor([[1.5, kl_shift], [-2.0, kl_shift], [1.0, kl_shift + 1], [3.0, kl_shift - 1],
                                      [-1.0, kl_shift]])
    settings = KTOConfig(beta=0.3, loss=loss, desirable_weight=weights[0], undesirable_weight=weights[1])
    mine, theirs = ours(settings, trainer.model, batch, reference), trl_step(trainer, batch, settings, reference)
    assert mine["kl"] == pytest.approx(max(-kl_shift, 0.0) if loss == "kto" else 0.0, abs=1e-4)
    for key in ("loss",) + METRICS:  # (rewards: small log-ratios of ~100-nat sums, fp32: 1e-5 absolute)
        assert math.isclose(mine[key], theirs[key], rel_tol=1e-5, abs_tol=1e-5), (key, mine[key], theirs[key])


def kto_run(world, base, data, log, *flags, script="finetune_qwen.py"):
    return run_ranks(world, [*script.split(), "--objective", "kto", "--pretrained", str(base), "--data-path",
                             str(data), "--data-split", "1,0", "--seq-length", str(SEQ), "--global-batch-size", "4",
                             "--lr-warmup-iters", "0", "--log-dir", str(log), *map(str, flags)])


def test_steps_one_and_two_are_trls_from_its_own_rows(kto_trainer, tmp_path):
    """TP2, one micro-batch of 4 a step (TRL's batch), undesirable examples weighted 0.2: step 1's log-probabilities
    are TRL's from its own prepared rows [0, 4) on the base (1e-4), with zero rewards and KL and the loss 0.5 x the
    mean weight; step 2's loss, metrics and KL are TRL's from its rows [4, 8) with the step-1 weights (our
    checkpoint, converted) as policy and the base as reference; resumed on one rank, step 2 again, the reference
    read from its cache."""
    from transformers import AutoModelForCausalLM

    from support.ranks import run_tool
    from megatron_ext.objectives.config import KTOConfig

    trainer, base = kto_trainer
    data = write(tmp_path / "unpaired.jsonl", unpaired())
    flags = ("--micro-batch-size", KL_BATCH, "--global-batch-size", KL_BATCH, "--train-iters", 2, "--lr", "1e-2",
             "--kto-undesirable-weight", 0.2)
    proc = kto_run(2, base, data, tmp_path / "a", "--tensor-model-parallel-size", 2, *flags, "--save",
                   tmp_path / "ckpt", "--save-interval", 1)
    assert "KTO reference log-probabilities of 16 + 0 examples and their KL rows computed into" in proc.stdout
    first = records(tmp_path / "a")
    assert len(first) == 2
    settings = KTOConfig(undesirable_weight=0.2)
    theirs = trl_step(trainer, [0, 1, 2, 3], settings)  # TRL's sequential first batch
    assert first[0]["rewards/chosen"] == first[0]["kl"] == theirs["kl"] == 0
    assert math.isclose(first[0]["loss"], 0.5 * (1 + 0.2) / 2, rel_tol=1e-6)
    for key in ("logps/chosen", "logps/rejected", "loss"):
        assert math.isclose(first[0][key], theirs[key], rel_tol=1e-4), (key, first[0][key], theirs[key])

    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ckpt" / "iter_0000001", "--save", tmp_path / "policy")
    from trl.trainer.dpo_trainer import add_fused_lm_head

    policy = trainer.model
    trainer.model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    add_fused_lm_head(trainer.model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # as TRL's init
    try:
        theirs = trl_step(trainer, [4, 5, 6, 7], settings)
    finally:
        trainer.model = policy
    assert first[1]["kl"] > 0 and first[1]["rewards/margins"] != 0
    for key in ("loss",) + METRICS:
        assert math.isclose(first[1][key], theirs[key], rel_tol=1e-4, abs_tol=1e-5), (key, first[1][key], theirs)

    proc = kto_run(1, base, data, tmp_path / "b", *flags, "--load", tmp_path / "ckpt" / "iter_0000001")
    assert "read from" in proc.stdout and "resumed from --load" in proc.stdout
    again = records(tmp_path / "b")
    assert [r["step"] for r in again] == [2]
    for key in ("loss", "kl", "rewards/margins"):
        assert math.isclose(again[0][key], first[1][key], rel_tol=1e-5), key


def test_meshes_agree_and_a_per_micro_batch_kl_does_not(kto_trainer, tmp_path):
    """Three clipped steps (each with its KL pass) on one rank equal DP2 x PP2, CP2, FSDP2 x DP2 and DeepSpeed
    ZeRO-3 x DP2 (1e-5), all with TRL's KL rows of 2-example micro-batches; TRL's KL over each micro-batch step (its
    gradient accumulation), planted under DP2 x PP2, gives other gradients."""
    _, base = kto_trainer
    rows = unpaired()  # both kinds in every micro-batch, each of its examples from another prompt
    data = write(tmp_path / "mixed.jsonl", rows[0::4] + rows[3::4] + rows[1::4] + rows[2::4])
    common = ("--train-iters", 3, "--lr", "1e-3", "--clip-grad", 1.0, "--global-batch-size", 8, "--micro-batch-size",
              2, "--kto-undesirable-weight", 0.2, "--data-cache-dir", tmp_path / "cache")
    runs = {"one": (1, ()), "dp2_pp2": (4, ("--pipeline-model-parallel-size", 2)),
            "cp2": (2, ("--context-parallel-size", 2)), "fsdp2": (2, ("--engine", "fsdp")),
            "zero3": (2, ("--engine", "deepspeed", "--zero-stage", 3))}
    logs = {}
    for name, (world, flags) in runs.items():
        kto_run(world, base, data, tmp_path / name, *flags, *common)
        logs[name] = records(tmp_path / name)
    for name in runs:
        assert [r["step"] for r in logs[name]] == [1, 2, 3], name
        for mine, one in zip(logs[name], logs["one"]):
            for key in ("loss", "kl", "rewards/margins", "grad_norm"):
                # the KL is a difference of log-probability sums of ~50: fp32 rounding of those sums, which differs
                # with the mesh and the machine's vector units, is ~1e-5 of it (CP2 read 1.9e-6 at step 1, where it
                # is 0, and 0.601319 for 0.601309 at step 2 on one CI machine)
                tol = 5e-5 if key == "kl" else 1e-6
                assert math.isclose(mine[key], one[key], rel_tol=1e-5, abs_tol=tol), (name, mine["step"], key)
    assert logs["one"][1]["kl"] > 0 and logs["one"][2]["kl"] > 0
    kto_run(4, base, data, tmp_path / "planted", *runs["dp2_pp2"][1], *common,
            script="tests/support/patched.py kl_per_micro_batch finetune_qwen.py")
    planted = records(tmp_path / "planted")
    # (each micro-batch's KL differs from the batch's by a shift that averages out of the loss: the gradient shows it,
    # 3e-4 of its norm at step 2, thirty times the meshes' agreement)
    assert len(planted) == 3 and not math.isclose(planted[1]["grad_norm"], logs["one"][1]["grad_norm"], rel_tol=5e-5)


def test_forward_only_passes_leave_the_router_statistics_alone(tmp_path):
    """MoE load and aux loss count the training pass only: a run evaluating every step logs the same statistics as
    one that does not, and KTO's step 1 (its KL pass first) the same as apo_zero_unpaired's (no KL pass)."""
    keys = ("moe_aux_loss", "moe_load_max", "moe_load_cv")
    tiny = ("finetune_qwen.py", "--model", "tiny-moe", "--seq-length", SEQ, "--micro-batch-size", 2,
            "--global-batch-size", 4, "--lr", "1e-2", "--log-dir")
    run_ranks(1, [*tiny, tmp_path / "plain", "--mock-data", "--train-iters", 3])
    run_ranks(1, [*tiny, tmp_path / "evaluated", "--mock-data", "--train-iters", 3, "--eval-interval", 1])
    plain, evaluated = records(tmp_path / "plain"), records(tmp_path / "evaluated")
    assert "val_loss" in evaluated[0] and "moe_aux_loss" in plain[0]
    for step in range(3):
        assert [plain[step][k] for k in keys] == pytest.approx([evaluated[step][k] for k in keys], rel=1e-6), step
    kto = [*tiny[:-1], "--objective", "kto", "--data-path", "examples/data/preference_sample.jsonl", "--tokenizer",
           TOKENIZER, "--train-iters", 1, "--data-cache-dir", tmp_path / "cache", "--log-dir"]
    run_ranks(1, [*kto, tmp_path / "kto"])
    run_ranks(1, [*kto, tmp_path / "apo", "--kto-loss", "apo_zero_unpaired"])
    with_kl, without = records(tmp_path / "kto")[0], records(tmp_path / "apo")[0]
    assert with_kl["kl"] == 0 and [with_kl[k] for k in keys] == pytest.approx([without[k] for k in keys], rel=1e-6)


def test_batches_of_one_kind_are_pointed_out():
    """KTO reads in order: global batches of only desirable (or undesirable) examples get one line, mixed ones none."""
    from megatron_ext.objectives.kto import one_kind_note

    assert one_kind_note(torch.tensor([True, False] * 8), 4) is None
    note = one_kind_note(torch.tensor([True] * 8 + [False] * 8 + [True, False] * 2), 4)
    assert note.startswith("megatron_ext: note: 4 of 5 global batches hold one kind of example only")
