"""Pretraining data on megatron-core's stack (``data/pretrain.py``, ``data/indexed.py``, ``data/tokens.py``,
``tools/preprocess_data.py``): corpora written by megatron-core itself read back token for token, our tool's output
is the tokenizer's ids plus EOS per document, text and nanoGPT .bin files go through the front door, blends follow
their weights, and bad corpora or weights are one line. (Same losses on every mesh and exact resume with a 0.3/0.7
blend: tests/training/test_pretrain_gpt.py.)"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from support import REPO
from support.ranks import run_tool
from megatron_ext.data.tokenizer import load_tokenizer

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
    return pretrain.build(run, vocab_size=run.shape.vocab_size, global_batch_size=global_batch_size,
                          micro_batch_size=2, dp_rank=0, dp_size=1, seed=run.training.seed)


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
    tokenizer = load_tokenizer(TOKENIZER, chat=False)
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


def test_a_large_corpus_is_tokenized_in_processes_to_the_same_tokens(tmp_path, monkeypatch, capsys):
    """The front door tokenizes a corpus past PARALLEL_BYTES in forked processes (every CPU, at most 32): the same
    .bin and .idx bytes as one process."""
    import os

    from megatron_ext.data import tokens

    one = tokens.text_prefix(SAMPLE, TOKENIZER, str(tmp_path / "one"))["prefix"]
    assert tokens.corpus_processes(tokens.open_text(SAMPLE)) == 1  # (the sample is small)
    monkeypatch.setattr(tokens, "PARALLEL_BYTES", 1)
    assert tokens.corpus_processes(tokens.open_text(SAMPLE)) == min(32, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(tokens, "corpus_processes", lambda source: 3)  # (a test lane may have one core)
    three = tokens.text_prefix(SAMPLE, TOKENIZER, str(tmp_path / "three"))["prefix"]
    out = capsys.readouterr().out
    assert "tokenizing --data-path" in out and "in 3 processes" in out, out
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == open(three + suffix, "rb").read(), suffix


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


def test_short_corpora_and_bad_weights_are_one_line(single_rank, tmp_path):
    """(Missing, other-version, mixed and empty corpora: test_bad_corpora_exit_2_before_anything_starts.)"""
    from megatron_ext.errors import ConfigError

    good = megatron_corpus(tmp_path / "good", [list(range(1, 100))] * 20)
    megatron_corpus(tmp_path / "short", [[1, 2, 3]])
    with pytest.raises(ConfigError) as error:
        build(single_rank, tmp_path, "--data-path", tmp_path / "short")
    assert "3 tokens, not more than one --seq-length 16 sequence" in str(error.value) and "\n" not in str(error.value)
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


def test_train_and_valid_data_paths_train_and_validate_on_their_own_corpora(single_rank, tmp_path):
    """--train-data-path (a 0.5/0.5 blend) gives every training sample, --valid-data-path every validation one."""
    a = megatron_corpus(tmp_path / "a", [list(range(1, 200))] * 30)
    b = megatron_corpus(tmp_path / "b", [list(range(200, 400))] * 30)
    valid = megatron_corpus(tmp_path / "valid", [list(range(500, 700))] * 30)
    data, info = build(single_rank, tmp_path, "--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", valid,
                       "--eval-interval", "2", "--eval-iters", "2")
    assert info["train_samples"] >= 16 and info["valid_samples"] >= 8
    train = torch.cat([m["tokens"] for _ in range(4) for m in data.train_microbatches()])
    assert int(train.max()) < 400 and int(train.min()) < 200 <= int(train.max())
    evaluations = [torch.cat([m["tokens"] for m in batch]) for batch in data.valid_microbatches(2)]
    assert len(evaluations) == 2 and all(int(t.min()) >= 500 and t.shape == (4, 16) for t in evaluations)


def _hub_dataset(tmp_path, monkeypatch, repo_id, rows):
    """``repo_id`` in an offline datasets cache (HF_HUB_OFFLINE): as load_dataset leaves a hub data set."""
    import shutil

    import datasets
    from datasets.packaged_modules.json.json import Json

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    source = tmp_path / f"{repo_id.replace('/', '_')}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = Json(data_files={"train": str(source)}, dataset_name=repo_id.split("/")[1],
                   cache_dir=str(tmp_path / "hf_build"))
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, tmp_path / "hf_datasets" / repo_id.replace("/", "___") / "default" / "0.0.0" /
                    ("1" * 40))
    return repo_id


def test_json_parquet_hub_and_saved_datasets_through_both_front_doors(single_rank, tmp_path, monkeypatch):
    """A .json list, a .parquet, a hub id (offline, from the datasets cache) and a save_to_disk directory give the
    tokenizer's ids + EOS per non-empty document, through --data-path's cache and tools/preprocess_data.py alike;
    a hub id still trains through --data-path."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_ext.data import tokens

    tokenizer = load_tokenizer(TOKENIZER, chat=False)
    texts = DOCS * 10
    expected = [tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] +
                [tokenizer.eos_token_id] for t in texts if t]
    (tmp_path / "docs.json").write_text(json.dumps([{"text": t} for t in texts]))
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), tmp_path / "docs.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    hub = _hub_dataset(tmp_path, monkeypatch, "someone/tiny_text", [{"text": t} for t in texts])
    for k, data in enumerate([tmp_path / "docs.json", tmp_path / "docs.parquet", tmp_path / "saved", hub]):
        prefixes = [tokens.text_prefix(str(data), TOKENIZER, str(tmp_path / "cache"))["prefix"]]
        run_tool("preprocess_data", "--input", data, "--output-prefix", tmp_path / f"out{k}", "--tokenizer-model",
                 TOKENIZER, "--append-eod")
        for prefix in prefixes + [f"{tmp_path / f'out{k}'}_text_document"]:
            corpus = IndexedDataset(prefix)
            assert [corpus[i].tolist() for i in range(len(corpus))] == expected, (data, prefix)
    data, info = build(single_rank, tmp_path, "--data-path", hub, "--split", "100,0,0")
    assert info["train_samples"] >= 16 and int(data.train_microbatches()[0]["tokens"].max()) < len(tokenizer)


def test_bad_rows_are_one_line_naming_flag_file_and_row_and_write_nothing(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron_ext.data import tokens
    from megatron_ext.errors import ConfigError

    good = json.dumps({"text": "fine"})
    (tmp_path / "not_json.jsonl").write_text(f"{good}\n{{not json\n")
    (tmp_path / "no_field.jsonl").write_text(f"{good}\n{json.dumps({'body': 'x'})}\n")
    (tmp_path / "bad_list.json").write_text(f"[{good}, ")
    (tmp_path / "number.json").write_text(json.dumps([{"text": "fine"}, {"text": 3}]))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_column.parquet")
    hub = _hub_dataset(tmp_path, monkeypatch, "someone/no_text", [{"body": "x"}])
    cases = [("not_json.jsonl", "line 2 is not valid JSON"), ("no_field.jsonl", "line 2 has no string 'text' field"),
             ("bad_list.json", "invalid JSON list"), ("number.json", "row index 1 has no string 'text' field"),
             ("no_column.parquet", "no 'text' column (columns: body)"), (hub, "no 'text' column (columns: body)"),
             ("data/typo_text_document.jsonl", "no such file")]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name, message in cases + [("data/typo", "no such file")]:
        data = name if name == hub or name.startswith("data/") else str(tmp_path / name)
        for flag, call in (("--data-path", lambda: tokens.text_prefix(data, TOKENIZER, str(tmp_path / "cache"))),
                           ("--input", lambda: run_tool("preprocess_data", "--input", data, "--output-prefix",
                                                        tmp_path / "out", "--tokenizer-model", TOKENIZER))):
            with pytest.raises(ConfigError) as error:
                call()
            line = str(error.value)
            assert line.startswith(f"{flag} {data}: ") and message in line and "\n" not in line, (flag, line)
    assert not list(tmp_path.glob("out*")) and not list((tmp_path / "cache").glob("tokens-*"))


def test_bad_corpora_exit_2_before_anything_starts(single_rank, tmp_path, monkeypatch):
    """pretrain_gpt.py checks the corpora named by prefix before any process group: each error one line naming the
    file, exit 2, no log or cache written; the same checks in-process (data/pretrain.py), a typo'd relative prefix
    among them (its .idx missing, not a hub look-up), and a token id outside the tokenizer's vocabulary."""
    from megatron_ext.errors import ConfigError

    good = megatron_corpus(tmp_path / "good", [list(range(1, 100))] * 20)
    other = megatron_corpus(tmp_path / "other", [list(range(1, 100))] * 20, dtype=np.int32)
    for name, suffix in (("no_idx", ".idx"), ("no_bin", ".bin")):
        megatron_corpus(tmp_path / name, [[1, 2, 3]])
        os.unlink(tmp_path / f"{name}{suffix}")
    for name, header in (("v2", dict(version=2)), ("code99", dict(code=99))):
        megatron_corpus(tmp_path / name, [[1, 2, 3]] * 20)
        (tmp_path / f"{name}.idx").write_bytes(idx_with(tmp_path / f"{name}.idx", **header))
    megatron_corpus(tmp_path / "empty", [])
    (tmp_path / "data").mkdir()
    cases = [  # (a real subprocess: one per class of error, flags, message)
        (True, ["--data-path", tmp_path / "no_idx"], f"{tmp_path / 'no_idx'}.idx is missing"),
        (False, ["--data-path", tmp_path / "no_bin"], f"{tmp_path / 'no_bin'}.bin is missing"),
        (False, ["--data-path", "data/wiki_text_documnet"], "--data-path data/wiki_text_documnet: "
                                                            "data/wiki_text_documnet.idx is missing"),
        (True, ["--train-data-path", good, "--valid-data-path", tmp_path / "v2"],
         f"--valid-data-path {tmp_path / 'v2'}: {tmp_path / 'v2'}.idx is index version 2"),
        (False, ["--data-path", tmp_path / "code99"], "names an unknown token dtype (code 99; known: 1-8)"),
        (True, ["--data-path", "0.5", good, "0.5", other], "the corpora hold different token dtypes (int32, uint16)"),
        (True, ["--data-path", tmp_path / "empty"], f"--data-path {tmp_path / 'empty'}: the corpus is empty")]
    monkeypatch.chdir(tmp_path)
    for subprocess_too, flags, message in cases:
        if subprocess_too:
            proc = subprocess.run([sys.executable, f"{REPO}/pretrain_gpt.py", "--log-dir", "log", "--data-cache-path",
                                   "cache", *map(str, flags)], capture_output=True, text=True, timeout=120)
            line = proc.stderr.strip().splitlines()[-1]
            assert proc.returncode == 2 and line.startswith("error: ") and message in line, proc.stderr[-2000:]
            assert not (tmp_path / "log").exists() and not (tmp_path / "cache").exists()
        with pytest.raises(ConfigError) as error:
            build(single_rank, tmp_path, *flags)
        assert message in str(error.value) and "\n" not in str(error.value), (flags, str(error.value))
    # tiny-gpt2 has 2048 tokens: an id of 2048 in the corpus's last document, past the first 64, is found
    outside = megatron_corpus(tmp_path / "outside", [list(range(1, 100))] * 99 + [[5, 2048, 7]])
    with pytest.raises(ConfigError, match=f"--data-path {outside}: token id 2048 is outside --tokenizer .*tiny-gpt2's "
                                          "vocabulary of 2048; pass the tokenizer the corpus was made with"):
        build(single_rank, tmp_path, "--data-path", outside)


def test_preprocess_writes_one_corpus_per_json_key(tmp_path):
    """Megatron-LM's naming, PREFIX_KEY_document per key; a key missing from a row leaves no corpus at all."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_ext.errors import ConfigError

    rows = [{"title": f"Act {i}", "text": t} for i, t in enumerate(DOCS * 3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_tool("preprocess_data", "--input", tmp_path / "rows.jsonl", "--output-prefix", tmp_path / "play",
             "--json-keys", "title", "text", "--tokenizer-model", TOKENIZER, "--append-eod")
    tokenizer = load_tokenizer(TOKENIZER, chat=False)
    for key in ("title", "text"):
        corpus = IndexedDataset(str(tmp_path / f"play_{key}_document"))
        assert [corpus[i].tolist() for i in range(len(corpus))] == [
            tokenizer(r[key], add_special_tokens=False, split_special_tokens=True)["input_ids"] +
            [tokenizer.eos_token_id] for r in rows if r[key]], key
    (tmp_path / "partial.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"title": "only"}) + "\n")
    with pytest.raises(ConfigError, match="line 2 has no string 'text' field"):
        run_tool("preprocess_data", "--input", tmp_path / "partial.jsonl", "--output-prefix", tmp_path / "cut",
                 "--json-keys", "title", "text", "--tokenizer-model", TOKENIZER)
    assert not list(tmp_path.glob("cut*"))


@pytest.mark.parametrize("interval, shown", [(1, [0, 4, 8, 12, 16, 20, 22]), (8, [0, 8, 16, 22]), (1000, [0, 22])])
def test_preprocess_updates_every_log_interval_documents(tmp_path, monkeypatch, capsys, interval, shown):
    """--log-interval N: the progress line moves every N documents (tokenizer batches of 4 here), then once at the
    end with the total; it was accepted and ignored."""
    import re

    from megatron_ext.data import tokens

    monkeypatch.setattr(tokens, "TOKENIZE_CHUNK", 4)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(22)))
    capsys.readouterr()
    run_tool("preprocess_data", "--input", tmp_path / "rows.jsonl", "--output-prefix", tmp_path / "c",
             "--tokenizer-model", TOKENIZER, "--log-interval", interval)
    counts = [int(n) for n in re.findall(r"text documents: (\d+)doc", capsys.readouterr().err)]
    assert sorted(set(counts)) == shown, counts
