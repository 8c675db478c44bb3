"""MetaMathQA SFT data: chat formatting and loss masks, packing, caching, bad rows, and the resumable sampler."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from support import REPO
from megatron_ext.data import sft
from megatron_ext.data.sampler import GlobalBatchSampler, rank_microbatches
from megatron_ext.errors import ConfigError

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen")
SAMPLE = os.path.join(REPO, "examples", "data", "metamathqa_sample.jsonl")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = 1003, 1004, 1002

QUERY = "Tom buys 3 pencils at $2 each. How much does he spend?"
RESPONSE = "He spends 3 * 2 = $6.\nThe answer is: 6"
# <|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\n{QUERY}<|im_end|>\n
# <|im_start|>assistant\n{RESPONSE}<|im_end|>\n
PINNED_IDS = [1003, 327, 198, 276, 270, 328, 11, 329, 320, 325, 326, 13, 314, 270, 256, 330, 316, 13, 1004, 198,
              1003, 321, 198, 958, 583, 220, 18, 835, 402, 297, 17, 406, 13, 348, 440, 364, 300, 557, 67, 30, 1004,
              198, 1003, 310, 198, 39, 68, 593, 220, 18, 336, 220, 17, 265, 297, 21, 275, 285, 289, 266, 25, 220, 21,
              1004, 198]


@pytest.fixture(scope="module")
def tokenizer():
    return sft.load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The first 120 shipped records in a data file of its own (so its cache lands in a temporary directory)."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    with open(SAMPLE) as f:
        path.write_text("".join(next(f) for _ in range(120)))
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_shipped_tokenizer_is_a_qwen25_chat_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    assert len(tokenizer) == 1024
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT, IM_START, IM_END]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_shipped_sample_has_metamathqa_schema():
    records, num_bad = sft.load_records(SAMPLE, bad_rows="error")
    assert (len(records), num_bad) == (3000, 0) and os.path.getsize(SAMPLE) < 1.5e6
    assert {r["type"] for r in records} == {"GSM_AnsAug", "GSM_Rephrased", "GSM_FOBAR", "MATH_AnsAug"}
    assert all(set(r) == {"query", "response", "type", "original_question"} for r in records)
    assert all(re.fullmatch(r"(?s).+\nThe answer is: \d+", r["response"]) for r in records)


def test_formatted_example_ids_and_loss_mask_are_pinned(tokenizer):
    ids, mask = sft.tokenize_example(tokenizer, QUERY, RESPONSE)
    assert ids == PINNED_IDS
    assert mask == [0] * 45 + [1] * 19 + [0]  # prompt and role header | response + <|im_end|> | trailing newline
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == RESPONSE + "<|im_end|>"
    assert ids[44] == 198 and ids[-2:] == [IM_END, 198]
    full = tokenizer.apply_chat_template([{"role": "user", "content": QUERY},
                                          {"role": "assistant", "content": RESPONSE}], tokenize=False)
    assert tokenizer(full, add_special_tokens=False)["input_ids"] == ids  # splitting at the prompt changes nothing


def test_system_prompt_defaults_to_qwens_and_the_flag_replaces_it(tokenizer):
    default_ids, _ = sft.tokenize_example(tokenizer, QUERY, RESPONSE)
    custom_ids, custom_mask = sft.tokenize_example(tokenizer, QUERY, RESPONSE, system_prompt="Solve step by step.")
    assert tokenizer.decode(default_ids).startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                                                    f"<|im_start|>user\n{QUERY}")
    custom = tokenizer.decode(custom_ids)
    assert custom.startswith("<|im_start|>system\nSolve step by step.<|im_end|>\n<|im_start|>user\n")
    assert DEFAULT_SYSTEM not in custom
    assert tokenizer.decode([t for t, m in zip(custom_ids, custom_mask) if m]) == RESPONSE + "<|im_end|>"


def test_template_whose_prompt_is_not_a_prefix_is_refused():
    class Reordering:
        name_or_path = "reordering"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt=False):
            return "prompt" if add_generation_prompt else "different"

    with pytest.raises(ConfigError, match="--tokenizer reordering: .*prefix"):
        sft.tokenize_example(Reordering(), QUERY, RESPONSE)


def test_unpacked_samples_pad_and_truncate(tmp_path, tokenizer):
    short = dict(query="What is 1 + 1?", response="1 + 1 = 2.\nThe answer is: 2")
    long = dict(query="Add the numbers.", response=" ".join(["1 + 1 = 2."] * 60) + "\nThe answer is: 2")
    data = write_jsonl(tmp_path / "two.jsonl", [short, long])
    train, valid, info = sft.build_datasets(data, TOKENIZER, seq_length=96, data_split="1,0",
                                            cache_dir=str(tmp_path / "cache"))
    assert (len(train), len(valid), info["truncated"], info["dropped"]) == (2, 0, 1, 0)
    for sample in train:
        assert {k: (v.dtype, tuple(v.shape)) for k, v in sample.items()} == {
            "tokens": (torch.int64, (96,)), "labels": (torch.int64, (96,)), "loss_mask": (torch.float32, (96,)),
            "position_ids": (torch.int64, (96,)), "padding_mask": (torch.bool, (96,))}
        assert torch.equal(sample["position_ids"], torch.arange(96))
    padded, truncated = (train[0], train[1]) if train[0]["tokens"][-1] == ENDOFTEXT else (train[1], train[0])
    ids, mask = sft.tokenize_example(tokenizer, short["query"], short["response"])
    n = len(ids) - 1
    assert padded["tokens"][:n].tolist() == ids[:-1] and padded["labels"][:n].tolist() == ids[1:]
    assert padded["loss_mask"][:n].tolist() == mask[1:]
    assert (padded["tokens"][n:] == ENDOFTEXT).all() and (padded["labels"][n:] == ENDOFTEXT).all()
    assert not padded["loss_mask"][n:].any()
    assert padded["padding_mask"].tolist() == [False] * n + [True] * (96 - n) and not truncated["padding_mask"].any()
    ids, mask = sft.tokenize_example(tokenizer, long["query"], long["response"])
    assert truncated["tokens"].tolist() == ids[:96] and truncated["labels"].tolist() == ids[1:97]
    assert truncated["loss_mask"].tolist() == mask[1:97] and truncated["loss_mask"][-1] == 1
    # a window that the prompt fills leaves nothing to learn: such examples are dropped, and counted
    _, _, info = sft.build_datasets(data, TOKENIZER, seq_length=16, data_split="1,0", cache_dir=str(tmp_path))
    assert (info["train_samples"], info["truncated"], info["dropped"]) == (0, 2, 2)


def by_tokens(samples) -> dict:
    """Unpacked samples by their tokens (without the padding): what a packed row's segment must be one of."""
    out = {tuple(s["tokens"][~s["padding_mask"]].tolist()): s for s in samples}
    assert len(out) == len(samples)
    return out


def test_packed_rows_fill_better_than_data_order(small_data, tmp_path):
    """Best-fit decreasing: fewer rows than filling them in data order (each row closed when the next example does
    not fit), so less padding trained on per step."""
    seq = 256
    train, _, _ = sft.build_datasets(small_data, TOKENIZER, seq, pack=True, data_split="1,0", cache_dir=str(tmp_path))
    unpacked, _, _ = sft.build_datasets(small_data, TOKENIZER, seq, data_split="1,0", cache_dir=str(tmp_path))
    from bench.packing import in_data_order

    lengths = [int((~s["padding_mask"]).sum()) for s in unpacked]
    in_order, real = in_data_order(lengths, seq), sum(lengths)
    assert -(-real // seq) <= len(train) < in_order, (len(train), in_order, real / seq)


def test_packed_samples_keep_examples_whole_and_restart_positions(small_data, tmp_path):
    seq = 256
    train, _, info = sft.build_datasets(small_data, TOKENIZER, seq, pack=True, data_split="1,0",
                                        cache_dir=str(tmp_path))
    unpacked, _, _ = sft.build_datasets(small_data, TOKENIZER, seq, pack=False, data_split="1,0",
                                        cache_dir=str(tmp_path))
    assert info["truncated"] == 0 and len(train) < len(unpacked) == 120
    examples = by_tokens(unpacked)
    for sample in train:
        seqlens = sample["seqlens"].tolist()
        assert sample["seqlens"].dtype == torch.int32 and sum(seqlens) == seq
        start = 0
        for length in seqlens:
            segment = slice(start, start + length)
            assert torch.equal(sample["position_ids"][segment], torch.arange(length))
            if sample["tokens"][start] == IM_START:  # an example: exactly one unpacked sample, nothing cut off
                example = examples.pop(tuple(sample["tokens"][segment].tolist()))
                assert torch.equal(sample["tokens"][segment], example["tokens"][:length])
                assert torch.equal(sample["labels"][segment], example["labels"][:length])
                assert torch.equal(sample["loss_mask"][segment], example["loss_mask"][:length])
                assert (example["tokens"][length:] == ENDOFTEXT).all() and not example["loss_mask"][length:].any()
                assert not sample["padding_mask"][segment].any() and example["padding_mask"][length:].all()
            else:  # the padding tail, last and masked
                assert start + length == seq and (sample["tokens"][segment] == ENDOFTEXT).all()
                assert not sample["loss_mask"][segment].any() and sample["padding_mask"][segment].all()
            start += length
    assert not examples  # every example landed in exactly one row

    batch = sft.collate([train[0], train[1]])
    assert {k: (v.dtype, tuple(v.shape)) for k, v in batch.items() if k != "cu_seqlens"} == {
        "tokens": (torch.int64, (2, seq)), "labels": (torch.int64, (2, seq)),
        "loss_mask": (torch.float32, (2, seq)), "position_ids": (torch.int64, (2, seq)),
        "padding_mask": (torch.bool, (2, seq))}
    rows = [train[0]["seqlens"].cumsum(0).tolist(), train[1]["seqlens"].cumsum(0).tolist()]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0] + rows[0] + [seq + end for end in rows[1]]
    starts = batch["cu_seqlens"][:-1].tolist()
    assert (batch["position_ids"].flatten()[starts] == 0).all()  # every segment starts a document


def test_packing_for_context_parallelism_pads_every_document(small_data, tmp_path):
    """pad_multiple (2 x CP): every segment a multiple of it, each example whole at its start, then pad tokens
    outside the loss with positions continuing; the same examples as without padding, each once."""
    seq, multiple = 256, 4
    train, _, _ = sft.build_datasets(small_data, TOKENIZER, seq, pack=True, data_split="1,0", cache_dir=str(tmp_path),
                                     pad_multiple=multiple)
    unpacked, _, _ = sft.build_datasets(small_data, TOKENIZER, seq, data_split="1,0", cache_dir=str(tmp_path),
                                        pad_multiple=multiple)  # ignored without packing
    assert len(unpacked) == 120
    examples = by_tokens(unpacked)
    for sample in train:
        start = 0
        for length in sample["seqlens"].tolist():
            assert length % multiple == 0
            segment = slice(start, start + length)
            assert torch.equal(sample["position_ids"][segment], torch.arange(length))
            if sample["tokens"][start] == IM_START:
                real = sample["tokens"][segment][~sample["padding_mask"][segment]]
                example = examples.pop(tuple(real.tolist()))
                n = int((example["tokens"] != ENDOFTEXT).sum())  # the example's tokens, without its padding
                assert torch.equal(sample["tokens"][start:start + n], example["tokens"][:n])
                assert torch.equal(sample["loss_mask"][start:start + n], example["loss_mask"][:n])
                assert length - n < multiple and (sample["tokens"][start + n:start + length] == ENDOFTEXT).all()
                assert not sample["loss_mask"][start + n:start + length].any()
                # CP padding: never routed to experts
                assert not sample["padding_mask"][start:start + n].any()
                assert sample["padding_mask"][start + n:start + length].all()
            start += length
    assert not examples
    with pytest.raises(ConfigError, match="--seq-length 254 must be a multiple of 4"):
        sft.build_datasets(small_data, TOKENIZER, 254, pack=True, cache_dir=str(tmp_path), pad_multiple=multiple)


def test_cache_is_reused_and_keyed_by_settings(small_data, tmp_path):
    def build(**overrides):
        settings = dict(data_path=small_data, tokenizer_path=TOKENIZER, seq_length=128, pack=True, seed=7)
        return sft.build_datasets(**{**settings, **overrides})

    train, valid, info = build()
    cache_dir = os.path.join(os.path.dirname(small_data), ".cache", "megatron_ext")
    assert info["cache"] == "build" and os.path.dirname(info["cache_path"]) == cache_dir
    assert open(os.path.join(cache_dir, ".gitignore")).read() == "*\n"
    train2, valid2, info2 = build()
    assert info2["cache"] == "hit" and info2["cache_path"] == info["cache_path"]
    assert {k: info2[k] for k in ("records", "train_samples", "valid_samples")} == {
        k: info[k] for k in ("records", "train_samples", "valid_samples")}
    for first, second in ((train, train2), (valid, valid2)):
        assert len(first) == len(second)
        for a, b in zip(first, second):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert build(seq_length=160)[2]["cache"] == "build"
    assert build(system_prompt="Think.")[2]["cache"] == "build"
    assert build(cache_dir=str(tmp_path))[2]["cache"] == "build"
    assert build()[2]["cache"] == "hit"


def test_bad_rows_are_counted_or_named_by_line(tmp_path):
    good = dict(query="What is 2 + 2?", response="2 + 2 = 4.\nThe answer is: 4", type="GSM_AnsAug")
    data = write_jsonl(tmp_path / "bad.jsonl", [good, dict(query="q?"), dict(query=" ", response="r"), "",
                                                dict(query="q?", response=5), "{not json", [1, 2], good])
    records, num_bad = sft.load_records(data, bad_rows="skip")
    assert records == [good, good] and num_bad == 5
    with pytest.raises(ConfigError) as error:
        sft.load_records(data, bad_rows="error")
    message = str(error.value)
    assert message == (f"--data-path {data}: bad row at line 2 (missing 'response'); fix or remove it, "
                       f"or pass --bad-rows skip")
    json_list = tmp_path / "list.json"
    json_list.write_text(json.dumps([good, dict(query="q?", response="")]))
    assert sft.load_records(str(json_list)) == ([good], 1)
    with pytest.raises(ConfigError, match=r"bad row at row index 1 \('response' is empty\)"):
        sft.load_records(str(json_list), bad_rows="error")


def test_missing_file_is_a_one_line_data_path_error(tmp_path):
    for path, reason in ((str(tmp_path / "nope.jsonl"), "no such file"),
                         (write_jsonl(tmp_path / "data.csv", ["a,b"]), "unsupported file type")):
        with pytest.raises(ConfigError) as error:
            sft.load_records(path)
        assert str(error.value).startswith(f"--data-path {path}: {reason}") and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="--tokenizer .*no-tokenizer-here: cannot load a tokenizer"):
        sft.load_tokenizer(str(tmp_path / "no-tokenizer-here"))


def test_hub_ids_offline(tmp_path):
    """Offline, an unknown hub id is a one-line --data-path error; a local datasets directory loads by row index.
    In a subprocess: huggingface_hub reads HF_HUB_OFFLINE once, at import."""
    data_dir = tmp_path / "local_hub_copy"
    data_dir.mkdir()
    write_jsonl(data_dir / "train.jsonl", [dict(query="q?", response="r."), dict(query="q?")])
    script = f"""
from megatron_ext.data import sft
from megatron_ext.errors import ConfigError
print(sft.load_records({str(data_dir)!r}))
for path, bad_rows in (("no-such-owner/no-such-dataset", "skip"), ({str(data_dir)!r}, "error")):
    try:
        sft.load_records(path, bad_rows)
    except ConfigError as e:
        print(e)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, unknown, bad = out.stdout.strip().splitlines()
    assert loaded == "([{'query': 'q?', 'response': 'r.'}], 1)"
    assert unknown.startswith("--data-path no-such-owner/no-such-dataset: cannot load it as a datasets hub id")
    assert bad.startswith(f"--data-path {data_dir}: bad row at row index 1 (missing 'response')")


def test_save_to_disk_directories_load(tmp_path):
    """A Dataset.save_to_disk directory (and a DatasetDict's, by its train split) reads as its rows, for training
    and for tools/eval_math.py; load_dataset refused both ("use load_from_disk"). Its cache lands beside it."""
    import datasets

    from megatron_ext.data import cache
    from megatron_ext.data.rows import Source
    from megatron_ext.evaluation.math_eval import load_problems

    rows = [dict(query=f"What is {i} + 1?", response=f"{i} + 1 = {i + 1}.\nThe answer is: {i + 1}") for i in range(6)]
    saved, saved_dict = tmp_path / "saved", tmp_path / "saved_dict"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:4]),
                         test=datasets.Dataset.from_list(rows[4:])).save_to_disk(str(saved_dict))
    assert sft.load_records(str(saved)) == (rows, 0)
    assert sft.load_records(str(saved_dict)) == (rows[:4], 0)
    source = Source(str(saved))
    assert cache.default_dir(source.path, source.is_local, "sft") == str(tmp_path / ".cache" / "megatron_ext")
    problems = load_problems(str(saved_dict))  # eval_math's default --split test
    assert problems == [dict(question=r["query"], answer=r["response"]) for r in rows[4:]]
    with pytest.raises(ConfigError, match="the saved DatasetDict has no 'valid' split \\(it has train, test\\)"):
        load_problems(str(saved_dict), split="valid")


def test_split_is_deterministic_and_weighted():
    records = [dict(i=i) for i in range(100)]
    train, valid = sft.split_records(records, "98,2", seed=3)
    assert (len(train), len(valid)) == (98, 2) and sorted(r["i"] for r in train + valid) == list(range(100))
    assert sft.split_records(records, "98,2", seed=3) == (train, valid) != sft.split_records(records, "98,2", seed=4)
    assert len(sft.split_records(records[:10], "99,1", seed=3)[1]) == 1  # never an empty validation set
    with pytest.raises(ConfigError, match="--data-split"):
        sft.split_records(records, "98")


def test_sampler_is_deterministic_and_resumes_exactly():
    def batches(sampler, n):
        return [sampler.next_global_batch() for _ in range(n)]

    reference = batches(GlobalBatchSampler(10, 4, seed=5), 6)  # 2 full batches per epoch; the rest is dropped
    assert reference == batches(GlobalBatchSampler(10, 4, seed=5), 6)
    assert reference != batches(GlobalBatchSampler(10, 4, seed=6), 6)
    for epoch in range(3):
        seen = reference[2 * epoch] + reference[2 * epoch + 1]
        assert len(set(seen)) == 8 and set(seen) <= set(range(10))
    assert reference[0:2] != reference[2:4]  # a new permutation each epoch

    first = GlobalBatchSampler(10, 4, seed=5)
    batches(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"consumed_samples": 12}
    resumed = GlobalBatchSampler(10, 4, seed=5)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and batches(resumed, 3) == reference[3:]
    with pytest.raises(ConfigError, match="--global-batch-size"):
        GlobalBatchSampler(3, 4, seed=5)


def test_rank_microbatches_are_contiguous_shares():
    indices = list(range(100, 108))
    assert rank_microbatches(indices, 0, 2, 2) == [[100, 101], [102, 103]]
    assert rank_microbatches(indices, 1, 2, 2) == [[104, 105], [106, 107]]
    assert rank_microbatches(indices, 0, 1, 4) == [[100, 101, 102, 103], [104, 105, 106, 107]]
    with pytest.raises(ValueError):
        rank_microbatches(indices, 0, 3, 1)


def test_build_under_torch_distributed(single_rank, small_data, tmp_path):
    """Rank 0's build result, and its errors, reach every rank through one broadcast (here a world of one)."""
    train, _, info = sft.build_datasets(small_data, TOKENIZER, 128, cache_dir=str(tmp_path))
    assert info["cache"] == "build" and len(train) > 0
    assert sft.build_datasets(small_data, TOKENIZER, 128, cache_dir=str(tmp_path))[2]["cache"] == "hit"
    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(query="q?")])
    with pytest.raises(ConfigError, match="bad row at line 1"):
        sft.build_datasets(bad, TOKENIZER, 128, bad_rows="error", cache_dir=str(tmp_path))
