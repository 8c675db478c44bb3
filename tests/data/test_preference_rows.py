"""Preference rows are TRL's: for every format and objective, our token ids and completion masks equal the rows TRL
1.16's own trainers (``DPOTrainer``, ``KTOTrainer``, ``RewardTrainer``) prepare from the same file and tokenizer
(their ``train_dataset``, through their collators for KTO's KL rows), and three planted mistakes are caught: the
template's text after the end-of-turn token dropped, a chat template applied to text rows, KL rows from another
micro-batch. Step-1 metrics against TRL's from its own rows: tests/objectives/test_dpo.py, test_kto.py, test_reward.py.
"""

import dataclasses
import json
import os
import shutil

import pytest

from support import hf_fixtures

# TRL's max_length, per format: some rows are longer (truncation, and the reward filter, are exercised)
SEQ = {"explicit-text": 40, "hh-rlhf": 40, "unpaired-text": 40, "tools": 395, "template-kwargs": 100}
KL_BATCH = 3  # TRL's per_device_train_batch_size: 10 examples in 3 chunks of 3 and one of 1
SYSTEM = {"role": "system", "content": "You are a careful calculator."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def sums(n=10):
    return [(a, 2 * a, f"{a} + {a} = {2 * a}. The answer is {2 * a}." + " Surely." * (a % 4),
             "I would rather not say." if a % 2 else f"It is {2 * a + 1}.") for a in range(2, 2 + n)]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {}}}}]


def formats():
    """Each format TRL names, as a user's file has it: rows in it."""
    multi = [dict(prompt=[SYSTEM, user(f"Hi, {a}?"), assistant("Hello."), user(f"What is {a} + {a}?")],
                  chosen=[assistant(c)], rejected=[assistant(r)]) for a, _, c, r in sums()]
    text = [dict(prompt=f"Question: what is {a} + {a}?\nAnswer:", chosen=f" {c}", rejected=f" {r}")
            for a, _, c, r in sums()]
    text[3]["prompt"], text[3]["chosen"] = "Say hel", "lo to everyone."  # tokens merge across the boundary
    return {
        "explicit-messages": multi,
        "explicit-text": text,
        "implicit-messages": [dict(chosen=r["prompt"] + r["chosen"], rejected=r["prompt"] + r["rejected"])
                              for r in multi],
        "hh-rlhf": [dict(chosen=f"\n\nHuman: What is {a} + {a}?\n\nAssistant: {c}",
                         rejected=f"\n\nHuman: What is {a} + {a}?\n\nAssistant: {r}") for a, _, c, r in sums()],
        "tools": [dict(r, tools=json.dumps(TOOLS)) for r in multi],
        "template-kwargs": [dict(r, chat_template_kwargs={"enable_thinking": False}) for r in multi],
        "margins": [dict(r, margin=0.25 * (i % 3)) for i, r in enumerate(multi)],
    }


def unpaired_formats():
    flat = formats()
    return {"unpaired-text": [dict(prompt=r["prompt"], completion=r[k], label=k == "chosen")
                              for r in flat["explicit-text"] for k in ("chosen", "rejected")][:10],
            "unpaired-messages": [dict(prompt=r["prompt"], completion=r[k], label=k == "chosen")
                                  for r in flat["explicit-messages"] for k in ("rejected", "chosen")][:10]}


def seq_for(name):
    return SEQ.get(name, 80)


def tokenizer_for(name):
    return "tiny-qwen3" if name == "template-kwargs" else "tiny-qwen"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny Qwen2 causal LM and sequence classifier per tokenizer (the trainers need a model; the rows do not)."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("rows")
    made = {}
    for name in ("tiny-qwen", "tiny-qwen3"):
        base = hf_fixtures.make_qwen(root / name)
        tokenizer = os.path.join(hf_fixtures.REPO, "examples", "tokenizers", name)
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(root / f"{name}-rm")
        for file in os.listdir(tokenizer):
            for directory in (base, root / f"{name}-rm"):
                shutil.copy(os.path.join(tokenizer, file), directory)
        made[name] = base
    return made


def trl_rows(objective, rows, base, root, seq):
    """What TRL's trainer of ``objective`` prepares from ``rows``: per sample, a list of (ids, completion start)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    common = dict(output_dir=str(root / "trl"), report_to=[], use_cpu=True, max_length=seq)
    tokenizer, data = AutoTokenizer.from_pretrained(base), Dataset.from_list(rows)
    if objective == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(f"{base}-rm", num_labels=1)
        prepared = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data,
                                 processing_class=tokenizer).train_dataset
        return [[(e["chosen_ids"], 0), (e["rejected_ids"], 0)] for e in prepared], [e.get("margin", 0.0)
                                                                                     for e in prepared]
    model = AutoModelForCausalLM.from_pretrained(base)
    if objective == "dpo":
        prepared = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=data,
                              processing_class=tokenizer).train_dataset
        return [[((e["prompt_ids"] + e[k])[:seq], len(e["prompt_ids"])) for k in ("chosen_ids", "rejected_ids")]
                for e in prepared], None
    trainer = KTOTrainer(model=model, args=KTOConfig(**common, per_device_train_batch_size=KL_BATCH),
                         train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator(list(trainer.train_dataset))  # its collator: the rows it trains on
    out = []
    for i, example in enumerate(trainer.train_dataset):
        out.append([(ids[mask.bool()].tolist(), int(completion.nonzero()[0]))
                    for ids, mask, completion in ((batch[f"{p}input_ids"][i], batch[f"{p}attention_mask"][i],
                                                   batch[f"{p}completion_mask"][i]) for p in ("", "KL_"))])
    return out, [e["label"] for e in trainer.train_dataset]


def our_rows(objective, path, base, root, seq):
    """Our prepared samples from ``path``: per sample, a list of (ids, completion start) as the model sees them
    (the first input, then the labels; the completion starts one past the first masked label)."""
    from megatron_ext.data import preference, unpaired

    kw = dict(data_split="1,0", cache_dir=str(root / "cache"))
    if objective == "kto":
        train, _, info = unpaired.build_datasets(str(path), str(base), seq, KL_BATCH, **kw)
    else:
        layout = preference.REWARD_PAIRS if objective == "reward" else preference.PAIRS
        train, _, info = preference.build_datasets(str(path), str(base), seq, layout=layout, **kw)
    out = []
    for i in range(len(train)):
        sample = train[i]
        rows = []
        for r in range(2):
            n = int((~sample["padding_mask"][r]).sum())
            ids = [int(sample["tokens"][r, 0])] + sample["labels"][r, :n].tolist()
            mask = sample["completion_mask"][r, :n]
            start = 0 if objective == "reward" else int(mask.nonzero()[0]) + 1
            rows.append((ids, start))
        out.append(rows)
    extra = train.desirable.tolist() if objective == "kto" else train.margin.tolist() if objective == "reward" \
        else None
    return out, extra, info


def compare(objective, name, rows, bases, root):
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = bases[tokenizer_for(name)]
    theirs, their_extra = trl_rows(objective, rows, base, root, seq_for(name))
    ours, our_extra, info = our_rows(objective, path, base, root, seq_for(name))
    return ours, theirs, our_extra, their_extra, info


CASES = [(objective, name) for name in formats() for objective in ("dpo", "kto", "reward")
         if not (name == "margins" and objective != "reward")] + \
        [("kto", name) for name in unpaired_formats()]


@pytest.mark.parametrize("objective, name", CASES, ids=[f"{o}-{n}" for o, n in CASES])
def test_rows_and_masks_are_the_ones_trl_prepares(bases, tmp_path, objective, name):
    rows = {**formats(), **unpaired_formats()}[name]
    ours, theirs, our_extra, their_extra, info = compare(objective, name, rows, bases, tmp_path)
    assert len(ours) == len(theirs) > 0
    assert ours == theirs
    if their_extra is not None:
        assert our_extra == pytest.approx(their_extra)
    if objective != "reward":  # the rows are exercised: some cut at max_length, and (text) a merged boundary
        assert info["truncated"] > 0, info
        assert (info["prompt_cut"] > 0) == (name in ("explicit-text", "unpaired-text")), info
        if info["prompt_cut"]:  # TRL's warning, as one line: how often, and what was left out
            from megatron_ext.data import preference

            line = preference.cut_warning(info)
            assert f"in {info['prompt_cut']} rows" in line and repr(info["cut_text"]) in line and "\n" not in line
    else:
        assert info["too_long"] > 0 and len(ours) < len(rows)
    if name == "margins":
        assert any(our_extra)


def plant_dropped_newline(monkeypatch):
    """The completion stops at ``<|im_end|>``: the text the template writes after it dropped."""
    from megatron_ext.data import chat

    render = chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **kw: render(*a, **kw) if kw.get("add_generation_prompt")
                        else render(*a, **kw).rstrip("\n"))


def plant_template_on_text(monkeypatch):
    """Text rows rendered as a one-turn chat."""
    from megatron_ext.data import preference

    read = preference.pair

    def as_chat(row, fmt):
        record = read(row, fmt)
        if record.conversational:
            return record
        return preference.Record([user(record.prompt)], tuple([assistant(c)] for c in record.completions), True)

    monkeypatch.setattr(preference, "PAIRS", dataclasses.replace(preference.PAIRS, read=as_chat))


def plant_kl_from_another_batch(monkeypatch):
    """Each KL row takes the previous example's completion over the whole split (our rows before TRL's)."""
    from megatron_ext.data import unpaired

    monkeypatch.setattr(unpaired.UnpairedDataset, "kl_partner", lambda self, index: (index - 1) % len(self))


@pytest.mark.parametrize("plant, objective, name", [
    (plant_dropped_newline, "dpo", "explicit-messages"), (plant_dropped_newline, "kto", "unpaired-messages"),
    (plant_template_on_text, "dpo", "explicit-text"), (plant_kl_from_another_batch, "kto", "explicit-messages")],
    ids=["newline-dropped-dpo", "newline-dropped-kto", "template-on-text", "kl-from-another-batch"])
def test_planted_mistakes_are_caught(bases, tmp_path, monkeypatch, plant, objective, name):
    rows = {**formats(), **unpaired_formats()}[name]
    plant(monkeypatch)
    ours, theirs, _, _, _ = compare(objective, name, rows, bases, tmp_path)
    assert len(theirs) > 0 and ours != theirs
