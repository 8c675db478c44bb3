"""DPO (``--objective dpo``): preference rows in TRL's layouts, masks on the completion only, TRL's losses and
metrics, and real runs against transformers and TRL.

In process: every format gives the same pair; the mask covers the final assistant turn through <|im_end|>, the
prompt tokens are shared; bad rows are counted or (--bad-rows error) one line naming the file and row; our pair
losses and metrics equal TRL's ``DPOTrainer`` on the same weights, batch and reference log-probabilities for
sigmoid, ipo and hinge. Runs: see the last test. Meshes: tests/training/test_parity_megatron.py (dpo_*).
"""

import json
import math
import re

import pytest
import torch

from support import flag_values
from support import hf_fixtures
from support.ranks import run_ranks
from support.step_checks import by_step, records

TOKENIZER = "examples/tokenizers/tiny-qwen"
SEQ = 48
CHAT_SEQ = 96  # chats(): a system turn and two user turns


def rows():
    return [{"prompt": f"What is {a} + {a}?", "chosen": f"It is {2 * a}.", "rejected": f"It is {2 * a + 1}."}
            for a in range(2, 10)]


def uneven_rows():
    """Pairs whose completions differ in length, one way or the other (LD-DPO weighs the excess)."""
    return [{"prompt": f"What is {a} + {a}?", "chosen": f"It is {2 * a}" + ", surely." * (a % 3),
             "rejected": f"It is {2 * a + 1}" + " or so." * (a % 2 + 1)} for a in range(2, 10)]


def write(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def chats():
    """Conversational pairs with a system turn and two user turns (the layout TRL's conversational datasets have)."""
    system = {"role": "system", "content": "Be brief."}
    return [{"prompt": [system, {"role": "user", "content": f"Hi {a}."}, {"role": "assistant", "content": "Hi."},
                        {"role": "user", "content": f"What is {a} + {a}?"}],
             "chosen": [{"role": "assistant", "content": f"The answer is {2 * a}."}],
             "rejected": [{"role": "assistant", "content": f"It is {2 * a + 1}."}]} for a in range(2, 10)]


def test_every_layout_reads_as_trls_prompt_extraction():
    """Each layout's prompt and completions are TRL's ``maybe_extract_prompt``'s: explicit rows as they are, implicit
    ones (conversations, HH-RLHF's text, a text prompt beside conversations as in H4's UltraFeedback) split at their
    shared start."""
    from trl.data_utils import maybe_extract_prompt

    from megatron_ext.data import preference

    user, good, bad = ({"role": r, "content": c} for r, c in (("user", "Hi?"), ("assistant", "Hello."),
                                                                ("assistant", "Go.")))
    layouts = [({"prompt": "Hi?", "chosen": " Hello.", "rejected": " Go."}, "explicit text"),
               ({"prompt": [user], "chosen": [good], "rejected": [bad]}, "explicit messages"),
               ({"chosen": [user, good], "rejected": [user, bad]}, "implicit messages"),
               ({"prompt": "Hi?", "chosen": [user, good], "rejected": [user, bad]}, "implicit messages"),
               ({"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.", "rejected": "\n\nHuman: Hi?\n\nAssistant: Go."},
                "implicit text")]
    for row, fmt in layouts:
        assert preference.detect(row, "f.jsonl") == fmt, row
        record, theirs = preference.pair(row, fmt), maybe_extract_prompt(row)
        assert (record.prompt, record.completions) == (theirs["prompt"], (theirs["chosen"], theirs["rejected"])), row
        assert record.conversational == fmt.endswith("messages")


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "Hi?", "chosen": "Same.", "rejected": "Same."}, "identical completions"),
    ({"prompt": "Hi?", "chosen": " ", "rejected": "Go."}, "empty chosen completion"),
    ({"prompt": "Hi?", "chosen": 3, "rejected": "Go."}, "'chosen' is not text"),
    ({"prompt": "Hi?", "chosen": "Yes.", "rejected": "Go.", "margin": "big"}, "'margin' is 'big', not a finite number"),
])
def test_bad_rows_are_counted_or_one_line(tmp_path, row, reason):
    from megatron_ext.data import preference
    from megatron_ext.errors import ConfigError

    path = write(tmp_path / "pairs.jsonl", rows()[:3] + [row] + rows()[3:])
    train, valid, info = preference.build_datasets(str(path), TOKENIZER, SEQ, data_split="1,0")
    assert info["bad_rows"] == 1 and len(train) == 8 and info["format"] == "prompt/chosen/rejected, text"
    with pytest.raises(ConfigError, match=rf"^--data-path {path}: bad preference row at line 4 \({reason}\)"):
        preference.build_datasets(str(path), TOKENIZER, SEQ, data_split="1,0", bad_rows="error",
                                  cache_dir=str(tmp_path / "other"))


def test_masks_cover_the_completion_and_a_long_prompt_is_a_bad_row(tmp_path):
    """The mask covers each completion through what the template writes after its end-of-turn token (text rows:
    through the EOS appended), never the shared prompt; a pair whose prompt fills --seq-length is a bad row."""
    from transformers import AutoTokenizer

    from megatron_ext.data import preference

    long = {"prompt": [{"role": "user", "content": "word " * 80}], "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}]}
    path = write(tmp_path / "pairs.jsonl", chats()[:2] + [long])
    train, _, info = preference.build_datasets(str(path), TOKENIZER, 96, data_split="1,0")
    assert info["bad_rows"] == 1 and len(train) == 2  # the prompt alone fills the sequence
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    batch = preference.collate([train[0], train[1]], None)
    assert batch["tokens"].shape == (4, 96) and batch["loss_mask"].tolist() == [1.0, 1.0]
    texts = set()
    for row in range(4):  # rows: chosen 0, chosen 1, rejected 0, rejected 1
        trained = batch["labels"][row][batch["completion_mask"][row].bool()].tolist()
        text = tokenizer.decode(trained)
        assert text.endswith("<|im_end|>\n") and text.startswith(("The answer is ", "It is ")), text
        texts.add(text)
        prompt_end = int(batch["completion_mask"][row].nonzero()[0])
        partner = (row + 2) % 4
        assert torch.equal(batch["tokens"][row, :prompt_end + 1], batch["tokens"][partner, :prompt_end + 1])
    assert len(texts) == 4
    text_pairs, _, _ = preference.build_datasets(str(write(tmp_path / "text.jsonl", rows())), TOKENIZER, SEQ,
                                                 data_split="1,0")
    sample = text_pairs[0]
    assert tokenizer.decode(sample["labels"][0][sample["completion_mask"][0].bool()].tolist()).endswith(
        tokenizer.eos_token)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's DPOTrainer around a tiny Qwen2 (the base of the runs below), preparing its own rows of ``chats()``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    root = tmp_path_factory.mktemp("dpo")
    base = hf_fixtures.make_qwen(root / "base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = DPOConfig(output_dir=str(root / "trl"), report_to=[], use_cpu=True, beta=0.1, bf16=False)  # fp32
    trainer = DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         args=config, train_dataset=Dataset.from_list(chats()),
                         processing_class=AutoTokenizer.from_pretrained(base))
    return trainer, base


def trl_step(trainer, batch, settings, reference=None):
    """TRL's loss and metrics with ``settings`` (DPOConfig) as its config: on one of our batches (its rows as
    input_ids, the completion mask on the positions of the tokens it covers), or (``batch`` a list of indices) on the
    rows TRL's collator makes of its own prepared pairs; the reference from ``reference`` ([b, 2]) or TRL's own
    reference model."""
    if isinstance(batch, list):
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in batch])
    else:
        tokens = torch.cat([batch["tokens"][:, :1], batch["labels"]], dim=1)  # the whole ids
        completion = torch.nn.functional.pad(batch["completion_mask"], (1, 0))
        attention = torch.nn.functional.pad(~batch["padding_mask"], (1, 0), value=True).long()
        inputs = dict(input_ids=tokens, attention_mask=attention, completion_mask=completion)
    trainer.precompute_ref_logps = reference is not None
    if reference is not None:
        inputs.update(ref_chosen_logps=reference[:, 0], ref_rejected_logps=reference[:, 1])
    trainer.loss_types, trainer.loss_weights = list(settings.losses), list(settings.weights)
    trainer.beta, trainer.label_smoothing = settings.beta, settings.label_smoothing
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef = settings.f_divergence, settings.f_alpha
    trainer.args.discopop_tau = settings.discopop_tau
    trainer.ld_alpha, trainer.use_weighting = settings.ld_alpha, settings.use_weighting
    trainer._metrics["train"].clear()
    trainer.model.train()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, False).item()
    return dict(loss=loss, **{k: v[-1] for k, v in trainer._metrics["train"].items()})


def one(name, **kw):
    from megatron_ext.objectives.config import DPOConfig

    return pytest.param(DPOConfig(beta=0.3, losses=(name,), **kw), id=name + "".join(f"-{v}" for v in kw.values()))


SETTINGS = [one(name) for name in ("sigmoid", "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                                   "apo_down", "sft", "sigmoid_norm")] + [
    one("robust", label_smoothing=0.1), one("exo_pair", label_smoothing=1e-3), one("discopop", discopop_tau=0.3),
    one("sigmoid", f_divergence="forward_kl"), one("hinge", f_divergence="js_divergence"),
    one("ipo", f_divergence="alpha_divergence", f_alpha=0.3),
    one("sigmoid", f_divergence="alpha_divergence", f_alpha=1.0), one("sigmoid", ld_alpha=0.5),
    one("ipo", ld_alpha=0.0), one("sigmoid", use_weighting=True), one("hinge", use_weighting=True)]


@pytest.mark.parametrize("settings", SETTINGS + [
    pytest.param(None, id="mpo"), pytest.param("rpo-ld", id="rpo-ld-0.3")])
def test_pair_losses_and_metrics_are_trls(trl_trainer, tmp_path, settings):
    """Log-probabilities from transformers on our rows, our pair losses on them = TRL's _compute_loss (fp32), for
    each of TRL's loss types our flags take, f-DPO's divergences, MPO's weighted sum (sigmoid, bco_pair, sft) and
    LD-DPO's weights (on pairs of unequal completions; "sft" reads the unweighted sum, as TRL's)."""
    from megatron_ext.data import preference
    from megatron_ext.objectives import dpo
    from megatron_ext.objectives.config import DPOConfig

    if settings == "rpo-ld":
        settings = DPOConfig(beta=0.3, losses=("sigmoid", "sft"), weights=(1.0, 0.5), ld_alpha=0.3)
    settings = settings or DPOConfig(beta=0.3, losses=("sigmoid", "bco_pair", "sft"), weights=(0.8, 0.2, 1.0))
    trainer, _ = trl_trainer
    ld = settings.ld_alpha is not None
    train, _, _ = preference.build_datasets(str(write(tmp_path / "p.jsonl", uneven_rows() if ld else rows())),
                                            TOKENIZER, SEQ, data_split="1,0")
    batch = preference.collate([train[i] for i in range(4)], None, ld_alpha=settings.ld_alpha)
    reference = torch.tensor([[-40.0, -41.5], [-38.0, -37.0], [-45.0, -44.0], [-39.0, -42.0]])
    logps, tokens = transformers_logps(trainer.model, batch), batch["completion_mask"].sum(-1)
    assert len(set(tokens[:4].tolist())) > 1  # "sft": a mean over tokens, not over pairs
    plain = None
    if ld:  # both orders of unequal lengths; the weighted sums differ from the plain ones
        assert (tokens[:4] > tokens[4:]).any() and (tokens[:4] < tokens[4:]).any()
        plain, logps = logps[:4], transformers_logps(trainer.model, batch, batch["completion_weight"])
        assert (plain - logps[:4]).abs().max() > 1.0
    sft_scale = 4 / train.chosen_tokens[:4].sum()
    weights = wpo_weights(trainer.model, batch) if settings.use_weighting else None
    losses, metrics = dpo.pair_losses(settings, *logps.chunk(2), reference[:, 0], reference[:, 1], *tokens.chunk(2),
                                      sft_scale=sft_scale, chosen_unweighted=plain, pair_weights=weights)
    ours = dict(loss=losses.mean().item(), **{k: v.mean().item() for k, v in metrics.items()})
    policy = trainer.model
    if settings.use_weighting:  # TRL's fused head computes log sum p^2 only when asked at its start
        from transformers import AutoModelForCausalLM
        from trl.trainer.dpo_trainer import add_fused_lm_head

        trainer.model = AutoModelForCausalLM.from_pretrained(trl_trainer[1], dtype=torch.float32)
        add_fused_lm_head(trainer.model, outputs=("log_probs", "entropy", "mean_logits", "is_top1",
                                                  "log_sum_sq_probs"))
        assert (1 - weights).min() > 0.05  # (weights that matter)
    try:
        theirs = trl_step(trainer, batch, settings, reference)
    finally:
        trainer.model = policy
    for key, value in ours.items():
        assert math.isclose(value, theirs[key], rel_tol=1e-5, abs_tol=1e-6), (key, value, theirs[key])


@pytest.fixture(scope="module")
def cpo_orpo(trl_trainer, tmp_path_factory):
    """TRL's CPOTrainer and ORPOTrainer around the same tiny Qwen2 (trl.experimental)."""
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trainer, base = trl_trainer
    root = tmp_path_factory.mktemp("cpo")
    common = dict(report_to=[], use_cpu=True, bf16=False)
    made = {}
    for name, trainer_class, config in (("cpo", CPOTrainer, CPOConfig), ("orpo", ORPOTrainer, ORPOConfig)):
        made[name] = trainer_class(model=trainer.model, args=config(output_dir=str(root / name), **common),
                                   train_dataset=Dataset.from_list(rows()),
                                   processing_class=AutoTokenizer.from_pretrained(base))
    return made


@pytest.mark.parametrize("losses, trl_loss, alpha", [(("cpo",), "sigmoid", 1.0), (("simpo",), "simpo", 0.0),
                                                     (("simpo", "sft"), "simpo", 1.0)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reference_free_losses_are_trls(cpo_orpo, tmp_path, losses, trl_loss, alpha, smoothing):
    """cpo, simpo and simpo + sft (CPO-SimPO) = TRL's CPOTrainer (loss_type sigmoid with cpo_alpha 1, simpo with 0
    and 1) on the same batch: the loss and the metrics it shares with DPO's."""
    from megatron_ext.data import preference
    from megatron_ext.objectives.config import DPOConfig

    settings = DPOConfig(beta=0.3, losses=losses, weights=(1.0,) * len(losses), label_smoothing=smoothing,
                           simpo_gamma=0.7)
    train, _, _ = preference.build_datasets(str(write(tmp_path / "p.jsonl", rows())), TOKENIZER, SEQ,
                                            data_split="1,0")
    batch = preference.collate([train[i] for i in range(4)], None)
    ours = reference_free_losses(settings, cpo_orpo["cpo"].model, batch, 4 / train.chosen_tokens[:4].sum())
    cpo = cpo_orpo["cpo"]
    cpo.loss_type, cpo.cpo_alpha, cpo.beta, cpo.label_smoothing, cpo.simpo_gamma = trl_loss, alpha, 0.3, smoothing, 0.7
    with torch.no_grad():
        loss, theirs = cpo.get_batch_loss_metrics(cpo.model, trl_batch(batch))
    theirs["loss"] = loss.item()
    for key, value in ours.items():
        assert math.isclose(value, theirs[key], rel_tol=1e-5, abs_tol=1e-6), (key, value, theirs[key])


def test_orpo_is_trls_odds_ratio_and_the_chosen_tokens_loss(cpo_orpo, tmp_path):
    """orpo = the chosen completions' mean token loss - beta x TRL ORPOTrainer's odds-ratio term on the
    length-averaged log-probabilities (TRL's token loss also counts the prompt's tokens; ORPO's paper and ours do
    not), with TRL's metrics."""
    from megatron_ext.data import preference
    from megatron_ext.objectives.config import DPOConfig

    train, _, _ = preference.build_datasets(str(write(tmp_path / "p.jsonl", rows())), TOKENIZER, SEQ,
                                            data_split="1,0")
    batch = preference.collate([train[i] for i in range(4)], None)
    orpo = cpo_orpo["orpo"]
    orpo.beta = 0.3
    ours = reference_free_losses(DPOConfig(beta=0.3, losses=("orpo",)), orpo.model, batch,
                                 4 / train.chosen_tokens[:4].sum())
    logps, tokens = transformers_logps(orpo.model, batch), batch["completion_mask"].sum(-1)
    average = logps / tokens
    ratio, chosen_reward, rejected_reward, *_ = orpo.odds_ratio_loss(*average.chunk(2))
    nll = -logps[:4].sum() / tokens[:4].sum()
    theirs = {"loss": (nll - ratio.mean()).item(), "rewards/chosen": chosen_reward.mean().item(),
              "rewards/rejected": rejected_reward.mean().item(), "logps/chosen": average[:4].mean().item(),
              "rewards/accuracies": (chosen_reward > rejected_reward).float().mean().item(),
              "rewards/margins": (chosen_reward - rejected_reward).mean().item(),
              "logps/rejected": average[4:].mean().item()}
    for key, value in ours.items():
        assert math.isclose(value, theirs[key], rel_tol=1e-5, abs_tol=1e-6), (key, value, theirs[key])


def reference_free_losses(settings, model, batch, sft_scale) -> dict:
    """Our loss and metrics (means over the pairs) on transformers' log-probabilities, with no reference."""
    from megatron_ext.objectives import dpo

    logps, tokens = transformers_logps(model, batch), batch["completion_mask"].sum(-1)
    nothing = torch.full((len(logps) // 2,), float("nan"))  # a reference read anywhere would show
    losses, metrics = dpo.pair_losses(settings, *logps.chunk(2), nothing, nothing, *tokens.chunk(2),
                                      sft_scale=sft_scale)
    return dict(loss=losses.mean().item(), **{k: v.mean().item() for k, v in metrics.items()})


def trl_batch(batch) -> dict:
    """Our rows [chosen; rejected] as CPOTrainer's batch: whole sequences, labels -100 outside the completions."""
    ids = torch.cat([batch["tokens"][:, :1], batch["labels"]], dim=1)  # the whole ids
    attention = torch.nn.functional.pad(~batch["padding_mask"], (1, 0), value=True).long()
    labels = torch.where(torch.nn.functional.pad(batch["completion_mask"], (1, 0)) > 0, ids, -100)
    b = len(ids) // 2
    return {f"{side}_{key}": value[rows] for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, None)))
            for key, value in (("input_ids", ids), ("attention_mask", attention), ("labels", labels))}


def test_the_sft_term_is_a_token_mean_over_the_global_batch(tmp_path):
    """Every micro-batch of a step carries the same ``sft_scale`` (the global batch's pairs / chosen completion
    tokens) on any DP size and micro-batch size, so the "sft" loss summed over the step's pairs and divided by its
    pairs is the chosen tokens' mean loss, as one batch in TRL gives it."""
    from megatron_ext.data import preference
    from megatron_ext.data.sources import PreferenceData

    train, _, _ = preference.build_datasets(str(write(tmp_path / "p.jsonl", rows())), TOKENIZER, SEQ,
                                            data_split="1,0")
    scales, pairs_seen = set(), 0
    for dp, micro in ((1, 4), (2, 1), (2, 2)):
        step = [batch for rank in range(dp) for batch in PreferenceData(
            train, train, global_batch_size=4, micro_batch_size=micro, dp_rank=rank, dp_size=dp,
            seed=7).train_microbatches()]
        chosen = torch.cat([b["completion_mask"][:len(b["index"])].sum(-1) for b in step])
        assert len({round(c, 3) for c in chosen.tolist()}) > 1, "the pairs' chosen completions differ in length"
        scale = {float(v) for b in step for v in b["sft_scale"]}
        assert len(scale) == 1 and math.isclose(scale.pop(), 4 / float(chosen.sum()), rel_tol=1e-6), (dp, micro)
        scale = {round(float(step[0]["sft_scale"][0]), 6)}
        scales |= scale
        pairs_seen += len(chosen)
    assert len(scales) == 1 and pairs_seen == 12


@pytest.mark.parametrize("flags, message", [
    ("--dpo-loss sigmoid,bco_pair,sft --dpo-loss-weights 0.8,0.2", "has 2 weights for the 3 losses"),
    ("--dpo-loss hinge --dpo-label-smoothing 0.1",
     "applies to --dpo-loss sigmoid, robust, exo_pair, cpo, simpo, not hinge"),
    ("--dpo-loss exo_pair", "needs --dpo-label-smoothing > 0"),
    ("--dpo-loss sigmoid,bco_pair --dpo-f-divergence forward_kl", "does not go with --dpo-loss bco_pair"),
    ("--dpo-loss robust --dpo-label-smoothing 0.5", "must be in [0, 0.5)"),
    ("--dpo-loss aot", "sorts the pairs of each micro-batch"),
    ("--dpo-loss sigmoid,simpo", "simpo is reference-free (no reference pass); it goes alone or with sft, not with "
                                 "sigmoid"),
    ("--dpo-loss sigmoid,sft --dpo-use-weighting", "--dpo-loss sigmoid,sft has sft, a term it does not weigh"),
    ("--dpo-use-weighting --cross-entropy-loss-fusion", "reads the logits, which --cross-entropy-loss-fusion never"),
    ("--dpo-loss orpo --dpo-ld-alpha 0.5", "--dpo-loss orpo has none"),
])
def test_loss_settings_that_cannot_work_are_one_line(flags, message):
    from megatron_ext.arguments import parse
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(["--objective", "dpo", *flags.split()], world_size=1)
    run = parse(["--objective", "dpo", "--dpo-loss", "sigmoid,bco_pair,sft", "--dpo-loss-weights", "0.8,0.2,1"],
                world_size=1)
    assert (run.objective.losses, run.objective.weights) == (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0))


def dpo_run(world, base, data, log, *flags):
    return run_ranks(world, ["finetune_qwen.py", "--objective", "dpo", "--pretrained", str(base), "--data-path",
                             str(data), "--data-split", "1,0", "--seq-length", str(SEQ), "--micro-batch-size", "2",
                             "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-dir", str(log),
                             *map(str, flags)])


def wpo_weights(model, batch) -> torch.Tensor:
    """WPO's per-pair weight from transformers' logits: exp(mean over each completion of log p - log sum_v p_v^2),
    chosen x rejected."""
    with torch.no_grad():
        log_probs = model(batch["tokens"]).logits.float().log_softmax(-1)
    token = log_probs.gather(-1, batch["labels"][..., None])[..., 0] - torch.logsumexp(2 * log_probs, dim=-1)
    mask = batch["completion_mask"]
    return torch.exp((token * mask).sum(-1) / mask.sum(-1)).view(2, -1).prod(0)


def transformers_logps(model, batch, weight=None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch["tokens"]).logits.float()
    token_logps = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    return (token_logps * (batch["completion_mask"] if weight is None else weight)).sum(-1)


def test_runs_start_at_ln2_equal_trl_and_resume_exactly(trl_trainer, tmp_path):
    """TP2 from --pretrained on conversational pairs: step 1 is ln 2 with zero rewards and the log-probabilities TRL
    computes from its own prepared rows of the same pairs (1e-4); step 2's loss and every metric are TRL's from its
    own rows with the step-1 weights (our checkpoint, converted) as policy and the base as reference; resumed from
    step 1 on one rank, step 2 again, the reference read from its cache. LoRA from a PEFT adapter: the reference is
    the model as it starts (base + adapter, as TRL's "ref" copy), so step 1 is ln 2 again."""
    from transformers import AutoModelForCausalLM

    from support.ranks import run_tool
    from megatron_ext.data import preference
    from megatron_ext.data.sampler import GlobalBatchSampler
    from megatron_ext.data.sources import PreferenceData
    from megatron_ext.objectives.config import DPOConfig

    trainer, base = trl_trainer
    data = write(tmp_path / "pairs.jsonl", chats())
    proc = dpo_run(2, base, data, tmp_path / "a", "--tensor-model-parallel-size", 2, "--train-iters", 2,
                   "--lr", "1e-2", "--save", tmp_path / "ckpt", "--save-interval", 1, "--save-hf", tmp_path / "hf",
                   "--seq-length", CHAT_SEQ)
    assert "DPO reference log-probabilities of 8 + 0 pairs computed into" in proc.stdout
    first = records(tmp_path / "a")
    assert len(first) == 2 and math.isclose(first[0]["loss"], math.log(2), rel_tol=1e-6)
    assert first[0]["rewards/margins"] == first[0]["rewards/chosen"] == 0.0
    sampler = GlobalBatchSampler(8, 4, 1234)  # the run's steps (our pairs in the file's order, as TRL's)
    indices1, indices2 = sampler.next_global_batch(), sampler.next_global_batch()
    theirs = trl_step(trainer, indices1, DPOConfig())
    for key in ("logps/chosen", "logps/rejected", "loss"):
        assert math.isclose(first[0][key], theirs[key], rel_tol=1e-4), (key, first[0][key], theirs[key])
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # the export loads

    run_tool("convert_mcore_to_hf", "--load", tmp_path / "ckpt" / "iter_0000001", "--save", tmp_path / "policy")
    from trl.trainer.dpo_trainer import add_fused_lm_head

    policy = trainer.model
    trainer.model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    add_fused_lm_head(trainer.model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # as TRL's init
    try:
        theirs = trl_step(trainer, indices2, DPOConfig())
    finally:
        trainer.model = policy
    assert first[1]["rewards/margins"] != 0.0
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert math.isclose(first[1][key], theirs[key], rel_tol=1e-4, abs_tol=1e-5), (key, first[1][key], theirs)
    train, _, _ = preference.build_datasets(str(data), TOKENIZER, CHAT_SEQ, data_split="1,0")
    step1 = PreferenceData(train, train, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1,
                           seed=1234).train_microbatches()[0]
    chosen = transformers_logps(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), step1)[:4]
    assert math.isclose(first[0]["logps/chosen"], chosen.mean().item(), rel_tol=1e-5)

    proc = dpo_run(1, base, data, tmp_path / "b", "--train-iters", 2, "--lr", "1e-2", "--load",
                   tmp_path / "ckpt" / "iter_0000001", "--seq-length", CHAT_SEQ)
    assert "read from" in proc.stdout and "resumed from --load" in proc.stdout
    again = by_step(records(tmp_path / "b"))
    assert list(again) == [2] and math.isclose(again[2], first[1]["loss"], rel_tol=1e-5)

    adapter = hf_fixtures.make_adapter(base, tmp_path / "adapter")
    dpo_run(1, base, data, tmp_path / "c", "--pretrained-adapter", adapter, "--train-iters", 1, "--lr", "1e-3",
            "--seq-length", CHAT_SEQ)
    lora = records(tmp_path / "c")[0]
    from peft import PeftModel

    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    adapted = transformers_logps(policy, step1)[:4].mean().item()
    assert math.isclose(lora["loss"], math.log(2), rel_tol=1e-6) and abs(adapted - chosen.mean().item()) > 1e-3
    assert math.isclose(lora["logps/chosen"], adapted, rel_tol=1e-5)


def test_a_reference_free_run_skips_the_reference_pass(trl_trainer, cpo_orpo, tmp_path):
    """--dpo-loss orpo under CP2 (each rank holds half of every row): no reference pass, and step 1's loss and
    metrics are ORPO's from transformers' log-probabilities of the starting weights on that step's pairs."""
    from megatron_ext.data import preference
    from megatron_ext.data.sources import PreferenceData
    from megatron_ext.objectives.config import DPOConfig

    _, base = trl_trainer
    data = write(tmp_path / "pairs.jsonl", rows())
    proc = dpo_run(2, base, data, tmp_path / "a", "--context-parallel-size", 2, "--train-iters", 1, "--lr", "1e-3",
                   "--dpo-loss", "orpo", "--dpo-beta", 0.3)
    assert "--dpo-loss orpo is reference-free: no reference pass" in proc.stdout
    assert "reference log-probabilities" not in proc.stdout
    train, _, _ = preference.build_datasets(str(data), TOKENIZER, SEQ, data_split="1,0")
    step1 = PreferenceData(train, train, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1,
                           seed=1234).train_microbatches()[0]
    expected = reference_free_losses(DPOConfig(beta=0.3, losses=("orpo",)), cpo_orpo["orpo"].model, step1,
                                     step1["sft_scale"][0])
    first = records(tmp_path / "a")[0]
    for key, value in expected.items():
        assert math.isclose(first[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, first[key], value)


def test_ld_dpo_runs_agree_under_cp_and_have_their_own_reference(trl_trainer, tmp_path):
    """--dpo-ld-alpha 0.3 on pairs of unequal completions: two steps on one rank = CP2 (each rank keeps its part of
    the token weights; 1e-5); a run without it starts at ln 2 too (its own reference, not LD's from the shared
    cache) with other log-probabilities, and its step 2 differs."""
    _, base = trl_trainer
    data = write(tmp_path / "pairs.jsonl", uneven_rows())
    common = ("--train-iters", 2, "--lr", "1e-2", "--data-cache-dir", tmp_path / "cache")
    dpo_run(1, base, data, tmp_path / "one", *common, "--dpo-ld-alpha", 0.3)
    dpo_run(2, base, data, tmp_path / "cp2", *common, "--dpo-ld-alpha", 0.3, "--context-parallel-size", 2)
    dpo_run(1, base, data, tmp_path / "plain", *common)
    one, cp2, plain = (records(tmp_path / name) for name in ("one", "cp2", "plain"))
    assert [r["step"] for r in one] == [r["step"] for r in cp2] == [r["step"] for r in plain] == [1, 2]
    for mine, theirs in zip(cp2, one):
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-5, abs_tol=1e-6), (mine["step"], key)
    assert math.isclose(plain[0]["loss"], math.log(2), rel_tol=1e-6) and math.isclose(one[0]["loss"], math.log(2),
                                                                                       rel_tol=1e-6)
    assert plain[0]["logps/chosen"] < one[0]["logps/chosen"] - 1 and abs(plain[1]["loss"] - one[1]["loss"]) > 1e-4


def test_wpo_weights_read_the_whole_vocabulary_on_every_mesh(trl_trainer, tmp_path):
    """--dpo-use-weighting: step 1 (zero rewards) is ln 2 x the mean WPO weight of its pairs as transformers' logits
    of the starting weights give them, under TP2 + SP (each rank holds half of the vocabulary: the softmax's sums
    cross TP) and CP2 (half of every row)."""
    from transformers import AutoModelForCausalLM

    from megatron_ext.data import preference
    from megatron_ext.data.sources import PreferenceData

    _, base = trl_trainer
    data = write(tmp_path / "pairs.jsonl", rows())
    train, _, _ = preference.build_datasets(str(data), TOKENIZER, SEQ, data_split="1,0")
    step1 = PreferenceData(train, train, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1,
                           seed=1234).train_microbatches()[0]
    expected = math.log(2) * wpo_weights(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                         step1).mean().item()
    assert expected < 0.9 * math.log(2)
    for name, flags in (("tp2_sp", ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
                        ("cp2", ["--context-parallel-size", 2])):
        dpo_run(2, base, data, tmp_path / name, "--train-iters", 1, "--lr", "1e-3", "--dpo-use-weighting", *flags)
        assert math.isclose(records(tmp_path / name)[0]["loss"], expected, rel_tol=1e-5), name


def test_the_cpu_quickstart_is_dpo_on_the_shipped_pairs(tmp_path):
    """examples/dpo_cpu_quickstart.sh's command (DRY_RUN) parses for its 4 ranks: DPO, TP2 x DP2, the shipped
    sample (run by hand: rewards/accuracies 0 -> 100%, margins 0 -> 5.8 in 30 steps, about a minute)."""
    import shlex
    import subprocess

    from support import REPO
    from megatron_ext.arguments import parse

    line = subprocess.run(["bash", "examples/dpo_cpu_quickstart.sh"], cwd=REPO, capture_output=True, text=True,
                          env=dict(__import__("os").environ, DRY_RUN="1"), timeout=60).stdout.strip()
    argv = shlex.split(line)
    run = parse(argv[argv.index("finetune_qwen.py") + 1:], world_size=4)
    assert (run.mesh.tp, run.mesh.dp, run.objective.losses) == (2, 2, ("sigmoid",))
    assert flag_values(run).data_path == "examples/data/preference_sample.jsonl" and not flag_values(run).pack_sequences


def test_the_8gpu_launcher_takes_a_weighted_sum_of_losses():
    """examples/qwen3b_dpo_8gpu.sh with DPO_LOSS and DPO_LOSS_WEIGHTS (MPO) parses to those losses and weights."""
    import os
    import shlex
    import subprocess

    from support import REPO
    from megatron_ext.arguments import parse

    env = dict(os.environ, DRY_RUN="1", DPO_LOSS="sigmoid,bco_pair,sft", DPO_LOSS_WEIGHTS="0.8,0.2,1")
    line = subprocess.run(["bash", "examples/qwen3b_dpo_8gpu.sh"], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60).stdout.strip()
    argv = shlex.split(line)
    run = parse(argv[argv.index("finetune_qwen.py") + 1:], world_size=8)
    assert (run.objective.losses, run.objective.weights) == (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0))
