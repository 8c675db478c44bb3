"""Pretraining token streams: tokenizing and caching text, nanoGPT .bin files, the train/validation split, and
windows that are identical on every mesh and resume exactly."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from megatron_ext.data import tokens
from megatron_ext.errors import ConfigError

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-gpt2")
SAMPLE = os.path.join(REPO, "examples", "data", "tiny_shakespeare_sample.txt")
EOT = 2047
DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "",
        "All:\nSpeak, speak. <|endoftext|> is only text here."]


@pytest.fixture(scope="module")
def tokenizer():
    return tokens.load_tokenizer(TOKENIZER)


def batching(dp_rank=0, dp_size=1, global_batch_size=8, micro_batch_size=2, seed=5):
    return dict(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                dp_size=dp_size, seed=seed)


def write_bin(path, ids):
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


def one_line_error(call, *starts):
    with pytest.raises(ConfigError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and message.startswith(starts), message
    return message


def test_shipped_tokenizer_is_gpt2_in_miniature():
    from transformers import AutoTokenizer, GPT2TokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    assert isinstance(tokenizer, GPT2TokenizerFast) and len(tokenizer) == 2048
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == EOT  # last, as GPT-2's 50256
    spec = json.load(open(os.path.join(TOKENIZER, "tokenizer.json")))
    assert spec["normalizer"] is None and spec["model"]["type"] == "BPE"
    assert spec["pre_tokenizer"] == dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    assert spec["decoder"]["type"] == "ByteLevel"
    for text in ("First Citizen:\nBefore we proceed any further, hear me speak.", "  tabs\tand  ünïcödé 日本 😀\n"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer("Speak")["input_ids"] != tokenizer(" Speak")["input_ids"]  # no prefix space, as GPT-2
    text = open(SAMPLE, encoding="utf-8").read()
    assert 100_000 < len(text.encode()) < 200_000 and text.startswith("First Citizen:")


def test_txt_is_one_document_cached_by_content(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "plays.txt"
    shutil.copy(SAMPLE, path)
    train, valid, info = tokens.load_token_arrays(str(path), TOKENIZER, "99,1")
    expected = tokenizer(path.read_text())["input_ids"] + [EOT]
    stream = np.concatenate([train, valid])
    assert stream.dtype == np.uint16 and stream.tolist() == expected
    assert (info["documents"], info["tokens"], info["vocab_size"], info["eos_id"]) == (1, len(expected), 2048, EOT)
    assert info["cache"] == "build" and os.path.dirname(info["cache_path"]) == str(tmp_path / ".cache" / "megatron_ext")
    again = tokens.load_token_arrays(str(path), TOKENIZER, "90,10")[2]  # the split is not part of the cache key
    assert (again["cache"], again["cache_path"]) == ("hit", info["cache_path"])
    assert not [f for f in os.listdir(os.path.dirname(info["cache_path"])) if f.startswith(".tmp-")]
    with open(path, "a") as f:
        f.write("\nAll:\nAmen.\n")
    changed = tokens.load_token_arrays(str(path), TOKENIZER, cache_dir=str(tmp_path / "elsewhere"))[2]
    assert changed["cache"] == "build" and changed["cache_path"] != info["cache_path"]
    assert changed["cache_path"].startswith(str(tmp_path / "elsewhere"))
    # A big .txt is encoded in pieces, cut where GPT-2's pre-tokenizer makes the ids those of the whole text.
    monkeypatch.setattr(tokens, "TEXT_PIECE_CHARS", 1000)
    pieces = tokens.load_token_arrays(str(path), TOKENIZER, cache_dir=str(tmp_path / "pieces"))
    assert np.concatenate(pieces[:2]).tolist() == tokenizer(path.read_text())["input_ids"] + [EOT]


def test_records_get_an_eos_after_every_document(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(dict(text=t, n=i)) + "\n" for i, t in enumerate(DOCS)))
    (tmp_path / "docs.json").write_text(json.dumps([dict(text=t) for t in DOCS]))
    pq.write_table(pa.table(dict(text=DOCS, id=[0, 1, 2])), tmp_path / "docs.parquet")
    expected = [i for text in DOCS if text for i in tokenizer(text, split_special_tokens=True)["input_ids"] + [EOT]]
    for name in ("docs.jsonl", "docs.json", "docs.parquet"):
        train, valid, info = tokens.load_token_arrays(str(tmp_path / name), TOKENIZER, "100,0")
        assert train.tolist() == expected and len(valid) == 0, name
        assert (info["documents"], info["empty_documents"], info["source"]) == (2, 1, name.split(".")[1])
        assert train.tolist().count(EOT) == 2  # the literal "<|endoftext|>" in a document is only text


def test_bin_files_map_directly_with_sibling_validation(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50257, 5000)
    train_bin, val_bin = write_bin(tmp_path / "train.bin", ids), write_bin(tmp_path / "val.bin", ids[:700] % 300)
    train, valid, info = tokens.load_token_arrays(train_bin, None, "50,50")  # no tokenizer; val.bin beats the split
    assert isinstance(train, np.memmap) and train.tolist() == ids.tolist() and valid.tolist() == (ids[:700] % 300
                                                                                                   ).tolist()
    assert (info["vocab_size"], info["valid_from"], info["cache"]) == (int(ids.max()) + 1, val_bin, "none")
    os.rename(tmp_path / "train.bin", tmp_path / "stream.bin")  # no sibling: --data-split cuts the stream
    train, valid, info = tokens.load_token_arrays(str(tmp_path / "stream.bin"), "ignored", "98,2")
    assert (len(train), len(valid), info["valid_from"]) == (4900, 100, "--data-split 98,2")


def test_split_is_contiguous_and_windows_stay_inside(tmp_path):
    stream = write_bin(tmp_path / "stream.bin", np.arange(10_000))
    data, info = tokens.build_token_data(stream, None, seq_length=32, data_split="90,10", **batching())
    assert (info["train_tokens"], info["valid_tokens"]) == (9000, 1000)
    assert (data.train_size, data.valid_size) == (8999 // 32, 999 // 32)
    seen_train = {int(t) for _ in range(data.train_size // 8) for b in data.train_microbatches()
                  for t in torch.cat([b["tokens"], b["labels"]], 1).flatten()}
    seen_valid = {int(t) for batches in data.valid_microbatches(4) for b in batches
                  for t in torch.cat([b["tokens"], b["labels"]], 1).flatten()}
    assert max(seen_train) < 9000 <= min(seen_valid)
    no_valid, info = tokens.build_token_data(stream, None, seq_length=32, data_split="100,0", **batching())
    assert info["valid_tokens"] == 0 and list(no_valid.valid_microbatches(3)) == []


def cat(microbatches):
    return {key: torch.cat([b[key] for b in microbatches]) for key in ("tokens", "labels", "loss_mask", "position_ids")}


def test_windows_are_identical_on_every_mesh_and_resume_exactly(tmp_path):
    seq, stream = 16, write_bin(tmp_path / "stream.bin", np.arange(2000))  # a token's id is its position

    def build(**kw):
        return tokens.build_token_data(stream, None, seq_length=seq, data_split="100,0", **batching(**kw))[0]

    reference = build()
    steps = [cat(reference.train_microbatches()) for _ in range(30)]  # 124 windows: 15 steps an epoch
    for batch in steps:
        starts = batch["tokens"][:, 0]
        assert torch.equal(batch["tokens"], starts[:, None] + torch.arange(seq))
        assert torch.equal(batch["labels"], batch["tokens"] + 1) and bool((starts % seq == 0).all())
        assert torch.equal(batch["position_ids"], torch.arange(seq).expand(8, seq))
        assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    epochs = [torch.cat([b["tokens"][:, 0] for b in steps[e * 15:(e + 1) * 15]]) for e in (0, 1)]
    for epoch in epochs:  # 120 distinct windows of the 124 (the last incomplete global batch is dropped)
        assert len(set(epoch.tolist())) == 120 and set(epoch.tolist()) <= set(range(0, 124 * seq, seq))
    assert not torch.equal(epochs[0], epochs[1])  # each epoch is a new permutation
    for dp_size in (2, 4):
        ranks = [build(dp_rank=r, dp_size=dp_size, micro_batch_size=1) for r in range(dp_size)]
        for step in steps[:17]:
            assert all(torch.equal(t, u) for t, u in zip(cat([b for d in ranks for b in d.train_microbatches()])
                                                         .values(), step.values()))
    interrupted = build()
    for _ in range(13):
        interrupted.train_microbatches()
    resumed = build(dp_rank=1, dp_size=2, micro_batch_size=4)  # resumed on another mesh
    resumed.load_state_dict(interrupted.state_dict())
    other = build(dp_rank=0, dp_size=2, micro_batch_size=4)
    other.load_state_dict(interrupted.state_dict())
    for step in steps[13:20]:  # across the epoch boundary
        assert torch.equal(cat(other.train_microbatches() + resumed.train_microbatches())["tokens"],
                           step["tokens"])


def test_validation_is_the_same_batches_every_time(tmp_path):
    stream = write_bin(tmp_path / "stream.bin", np.arange(3000))
    data = tokens.build_token_data(stream, None, seq_length=16, data_split="90,10", **batching())[0]
    first = [cat(batches)["tokens"] for batches in data.valid_microbatches(3)]
    data.train_microbatches()
    again = [cat(batches)["tokens"] for batches in data.valid_microbatches(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(first) == 3
    assert first[0][:, 0].tolist() == [2700 + 16 * i for i in range(8)]  # in order from the split, wrapping
    assert first[2][:, 0].tolist() == [2700 + 16 * (i % 18) for i in range(16, 24)]


def test_errors_are_one_line_naming_the_flag_or_file(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    message = one_line_error(lambda: tokens.build_token_data(str(short), TOKENIZER, seq_length=64, **batching()),
                             f"--data-path {short}: ")
    assert "training tokens, fewer than one window of --seq-length 64 + 1 = 65" in message
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    assert "odd" in one_line_error(lambda: tokens.load_token_arrays(str(odd)), f"--data-path {odd}: 3 bytes")
    one_line_error(lambda: tokens.load_token_arrays(str(tmp_path / "none.txt"), TOKENIZER),
                   f"--data-path {tmp_path / 'none.txt'}: no such file")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    one_line_error(lambda: tokens.load_token_arrays(str(tmp_path / "data.csv"), TOKENIZER),
                   f"--data-path {tmp_path / 'data.csv'}: unsupported file type '.csv'")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    one_line_error(lambda: tokens.load_token_arrays(str(tmp_path / "rows.jsonl"), TOKENIZER),
                   f"--data-path {tmp_path / 'rows.jsonl'}: line 2 has no string 'text' field")
    one_line_error(lambda: tokens.load_token_arrays(str(short)), f"--data-path {short} is text: pass --tokenizer")
    one_line_error(lambda: tokens.load_token_arrays(str(short), TOKENIZER, "99"), "--data-split '99'")
    one_line_error(lambda: tokens.load_token_arrays(str(short), str(tmp_path / "no-tokenizer")),
                   f"--tokenizer {tmp_path / 'no-tokenizer'}: cannot load a tokenizer")
    assert tokens.token_dtype(2048) == np.uint16 and tokens.token_dtype(65536) == np.uint16
    assert tokens.token_dtype(65537) == np.uint32  # e.g. a Qwen or Llama-3 vocabulary
    one_line_error(lambda: tokens.token_dtype(2 ** 32 + 1, "--tokenizer huge"), "--tokenizer huge: 4294967297 tokens")
    stream = write_bin(tmp_path / "stream.bin", np.arange(1000))
    message = one_line_error(lambda: tokens.build_token_data(stream, None, seq_length=64, data_split="99,1",
                                                             **batching()), "--data-split 99,1: 10 validation tokens")
    assert "--seq-length 64" in message
    one_line_error(lambda: tokens.build_token_data(stream, None, seq_length=64, data_split="100,0",
                                                   **batching(global_batch_size=32)),
                   f"--data-path {stream}: 1000 training tokens make 15 windows")


def test_hub_ids_offline(tmp_path):
    """Offline, a hub id is a one-line --data-path error; a local datasets directory goes through ``datasets``.
    In a subprocess: huggingface_hub reads HF_HUB_OFFLINE once, at import."""
    local = tmp_path / "local_hub_copy"
    local.mkdir()
    (local / "train.jsonl").write_text("".join(json.dumps(dict(text=t)) + "\n" for t in DOCS))
    script = f"""
from megatron_ext.data import tokens
from megatron_ext.errors import ConfigError
train, valid, info = tokens.load_token_arrays({str(local)!r}, {TOKENIZER!r}, "100,0", {str(tmp_path / "c")!r})
print(info["source"], info["documents"], train.tolist().count({EOT}))
try:
    tokens.load_token_arrays("karpathy/tiny_shakespeare", {TOKENIZER!r})
except ConfigError as e:
    print(e)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    local_line, hub_line = out.stdout.strip().splitlines()
    assert local_line == "hub 2 2"
    assert hub_line.startswith("--data-path karpathy/tiny_shakespeare: cannot load it as a datasets hub id")
