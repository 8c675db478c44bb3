"""Pretraining data on megatron-core's stack (``data/pretrain.py``, ``data/indexed.py``, ``data/tokens.py``,
``tools/preprocess_data.py``): corpora written by megatron-core itself read back token for token, our tool's output
is the tokenizer's ids plus EOS per document, text and nanoGPT .bin files go through the front door, blends follow
their weights, and bad corpora or weights are one line. (Same losses on every mesh and exact resume with a 0.3/0.7
blend: tests/test_pretrain_gpt.py.)"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, run_tool

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-gpt2")
SAMPLE = os.path.join(REPO, "examples", "data", "tiny_shakespeare_sample.txt")
DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "",
        "All:\nSpeak, speak. <|endoftext|> is only text here.", "Zürich — naïve café ☕"]


def megatron_corpus(prefix, documents, dtype=np.uint16):
    """A corpus written by megatron-core's own builder, not by our tool."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def build(single_rank, tmp_path, *flags, train_iters=4, global_batch_size=4):
    from megatron_ext.arguments import parse
    from megatron_ext.data import pretrain

    run = parse(["--tokenizer", TOKENIZER, "--seq-length", "16", "--train-iters", str(train_iters),
                 "--global-batch-size", str(global_batch_size), "--micro-batch-size", "2",
                 "--data-cache-path", str(tmp_path / "cache"), *map(str, flags)], world_size=1, family="gpt")
    return pretrain.build(run.args, vocab_size=run.shape.vocab_size, global_batch_size=global_batch_size,
                          micro_batch_size=2, dp_rank=0, dp_size=1, seed=run.args.seed)


def test_a_corpus_written_by_megatron_core_reads_as_written(single_rank, tmp_path):
    """Documents of consecutive ids (document d starts at 100 d): every sample is a run of its documents, cut only
    where one ends, and the first epoch's samples cover every token of the training documents."""
    docs = [list(range(100 * d, 100 * d + 20 + 3 * d)) for d in range(12)]
    prefix = megatron_corpus(tmp_path / "corpus", docs)
    data, info = build(single_rank, tmp_path, "--data-path", prefix, "--split", "100,0,0", train_iters=50)
    first = {d[0] for d in docs}
    seen = set()
    for i in range(len(data.train)):
        sample = data.train[i]
        ids = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
        for a, b in zip(ids, ids[1:]):
            assert b == a + 1 or b in first, (i, ids)
        seen.update(ids)
    assert set().union(*map(set, docs)) <= seen
    batch = data.train_microbatches()[0]
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"} and batch["tokens"].shape == (2, 16)
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:]) and bool(batch["loss_mask"].all())


def test_preprocess_writes_the_tokenizers_ids_and_eos_per_document(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"content": t}) + "\n" for t in DOCS * 40))
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    eos = tokenizer.eos_token_id
    expected = [tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [eos]
                for t in DOCS * 40 if t]
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run_tool("preprocess_data", "--input", source, "--output-prefix", out, "--json-keys", "content",
                 "--tokenizer-model", TOKENIZER, "--append-eod", "--workers", workers)
        corpus = IndexedDataset(f"{out}_content_document")
        assert corpus.index.dtype == np.uint16 and len(corpus) == len(expected)
        assert [corpus[i].tolist() for i in range(len(corpus))] == expected
    assert (tmp_path / "w1_content_document.bin").read_bytes() == (tmp_path / "w2_content_document.bin").read_bytes()


def test_text_and_nanogpt_bin_go_through_the_front_door(single_rank, tmp_path):
    """A .txt is preprocessed once (then a cache hit), its token stream that of the whole text with one EOS; a
    nanoGPT train.bin beside a val.bin becomes two prefixes without a copy, validation from val.bin."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_ext.data import tokens

    info = tokens.text_prefix(SAMPLE, TOKENIZER, str(tmp_path / "cache"))
    assert info["cache"] == "build" and tokens.text_prefix(SAMPLE, TOKENIZER, str(tmp_path / "cache"))["cache"] == "hit"
    corpus = IndexedDataset(info["prefix"])
    tokenizer = tokens.load_tokenizer(TOKENIZER)
    whole = tokenizer(open(SAMPLE, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    assert len(corpus) > 100 and np.concatenate([corpus[i] for i in range(len(corpus))]).tolist() == \
        whole + [tokenizer.eos_token_id]
    (np.arange(3000, dtype=np.uint16) % 1000).tofile(tmp_path / "train.bin")
    (np.arange(500, dtype=np.uint16) + 1000).tofile(tmp_path / "val.bin")
    data, info = build(single_rank, tmp_path, "--data-path", tmp_path / "train.bin", "--eval-interval", "1",
                       "--eval-iters", "1")
    links = sorted(p for p in (tmp_path / "cache").glob("bin-*.bin"))
    assert len(links) == 2 and all(p.is_symlink() for p in links)
    assert int(data.train_microbatches()[0]["tokens"].max()) < 1000
    valid = next(data.valid_microbatches(1))[0]["tokens"]
    assert int(valid.min()) >= 1000 and info["valid_samples"] >= 4


def test_a_blend_follows_its_weights(single_rank, tmp_path):
    a = megatron_corpus(tmp_path / "a", [list(range(1, 200))] * 30)
    b = megatron_corpus(tmp_path / "b", [list(range(500, 700))] * 30)
    data, info = build(single_rank, tmp_path, "--data-path", "0.3", a, "0.7", b, "--split", "100,0,0",
                       train_iters=250)
    first = [int(data.train.dataset_index[i]) for i in range(1000)]
    assert abs(first.count(0) / 1000 - 0.3) <= 0.02 and abs(first.count(1) / 1000 - 0.7) <= 0.02
    from_b = sum(int(data.train[i]["tokens"][0]) >= 500 for i in range(200))
    assert abs(from_b / 200 - 0.7) <= 0.05


def idx_with(path, *, version=1, code=8):
    raw = bytearray(open(path, "rb").read())
    raw[9:17] = struct.pack("<Q", version)
    raw[17] = code
    return bytes(raw)


def test_bad_corpora_and_weights_are_one_line(single_rank, tmp_path):
    from megatron_ext.errors import ConfigError

    good = megatron_corpus(tmp_path / "good", [list(range(1, 100))] * 20)
    other = megatron_corpus(tmp_path / "other", [list(range(1, 100))] * 20, dtype=np.int32)
    for name, suffix in (("no_idx", ".idx"), ("no_bin", ".bin")):
        megatron_corpus(tmp_path / name, [[1, 2, 3]])
        os.unlink(tmp_path / f"{name}{suffix}")
    megatron_corpus(tmp_path / "v2", [[1, 2, 3]] * 20)
    (tmp_path / "v2.idx").write_bytes(idx_with(tmp_path / "v2.idx", version=2))
    megatron_corpus(tmp_path / "empty", [])
    megatron_corpus(tmp_path / "short", [[1, 2, 3]])
    cases = [
        (["--data-path", tmp_path / "no_idx"], f"{tmp_path / 'no_idx'}.idx is missing"),
        (["--data-path", tmp_path / "no_bin"], f"{tmp_path / 'no_bin'}.bin is missing"),
        (["--data-path", tmp_path / "v2"], "is index version 2"),
        (["--data-path", "0.5", good, "0.5", other], "the corpora hold different token dtypes (int32, uint16)"),
        (["--data-path", tmp_path / "empty"], "the corpus is empty"),
        (["--data-path", tmp_path / "short"], "3 tokens, not more than one --seq-length 16 sequence"),
    ]
    for flags, message in [c for c in cases if c[1]]:
        with pytest.raises(ConfigError) as error:
            build(single_rank, tmp_path, *flags)
        assert message in str(error.value) and "\n" not in str(error.value), (flags, str(error.value))
    assert not any(p.name.startswith("tokens-") for p in (tmp_path / "cache").glob("*")) \
        if (tmp_path / "cache").exists() else True
    for flags, message in ((["--data-path", "0.3", good, good], "odd number of values"),
                           (["--data-path", "x", good, "0.7", good], "'x' is not a weight"),
                           (["--data-path", "-1", good, "1", good], "must be positive"),
                           (["--valid-data-path", good], "--valid-data-path needs --train-data-path")):
        proc = subprocess.run([sys.executable, "pretrain_gpt.py", *map(str, flags)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and message in lines[-1] and lines[-1].startswith("error:"), proc.stderr[-2000:]


def test_preprocess_refuses_to_overwrite_and_empty_input(tmp_path):
    from megatron_ext.errors import ConfigError

    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ConfigError, match="no text to train on"):
        run_tool("preprocess_data", "--input", empty, "--output-prefix", tmp_path / "out", "--tokenizer-model",
                 TOKENIZER)
    assert not list(tmp_path.glob("out*"))
    (tmp_path / "taken_text_document.idx").write_text("x")
    with pytest.raises(ConfigError, match="exists; choose another prefix"):
        run_tool("preprocess_data", "--input", SAMPLE, "--output-prefix", tmp_path / "taken", "--tokenizer-model",
                 TOKENIZER)
