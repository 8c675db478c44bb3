"""What tests/convert/test_pretrained.py's runs share: the --mock-data shape, a run from --pretrained (lr 0 unless told, then
--save-hf), transformers' loss on the same batches (also per document of a pretraining sample), and the bit-exact
comparison of an export with its source."""

import json
import os

import torch

from support import hf_fixtures
from support.ranks import run_ranks

SEQ, GBS, MBS = 32, 4, 1


def offline(cache) -> dict:
    """The environment of a run that reads the hub cache only (set before huggingface_hub is imported)."""
    return dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))


def gpt_mock_batches(vocab):
    """pretrain_gpt.py's --mock-data global batches (megatron-core's MockGPTDataset), in step order."""
    from megatron_ext.arguments import parse
    from megatron_ext.data import pretrain

    run = parse(["--mock-data", "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--global-batch-size",
                 str(GBS), "--train-iters", "8"], world_size=1, family="gpt")
    data, _ = pretrain.build(run, vocab_size=vocab, global_batch_size=GBS, micro_batch_size=MBS, dp_rank=0,
                             dp_size=1, seed=1234)
    steps = [data.train_microbatches() for _ in range(8)]
    return lambda step: steps[step - 1]


def hf_losses(model_dir, steps, vocab, dtype=torch.float32, family="qwen", **batch):
    """transformers' mean per-token loss on each step's --mock-data global batch."""
    from transformers import AutoModelForCausalLM

    from megatron_ext.data import synthetic

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    kwargs = dict(seed=1234, global_batch_size=GBS, micro_batch_size=MBS, seq_length=SEQ, vocab_size=vocab, **batch)
    batches = gpt_mock_batches(vocab) if family == "gpt" else lambda step: synthetic.global_batch(step, **kwargs)
    out = {}
    with torch.no_grad():
        for step in steps:
            micro = batches(step)
            tokens, labels = torch.cat([m["tokens"] for m in micro]), torch.cat([m["labels"] for m in micro])
            logits = model(tokens).logits.float()
            out[step] = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                          labels.reshape(-1)).item()
    return out


def train(nproc, script, source, tmp_path, *flags, env=None, steps=2):
    args = [script, "--pretrained", str(source), "--mock-data", "--seq-length", str(SEQ), "--micro-batch-size",
            str(MBS), "--global-batch-size", str(GBS), "--train-iters", str(steps), "--lr", "0",
            "--log-dir", str(tmp_path / "logs"), "--save-hf", str(tmp_path / "hf"), *map(str, flags)]
    return run_ranks(nproc, args, **(env or {}))


def assert_same_tensors(exported_dir, source_dir, ignore=()):
    exported, source = hf_fixtures.tensors(exported_dir), hf_fixtures.tensors(source_dir)
    expected = {k: v for k, v in source.items() if k not in ignore}
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def short_documents(root) -> list:
    """pretrain_gpt.py's data flags for a corpus of short documents (the Shakespeare sample's lines, a few to a
    few dozen tokens: several in every 32-token sample), preprocessed with the tiny Qwen's tokenizer."""
    lines = [line for line in open(os.path.join(hf_fixtures.REPO, "examples/data/tiny_shakespeare_sample.txt"))
             .read().splitlines() if line.strip()][:600]
    (root / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return ["--data-path", str(root / "lines.jsonl"), "--data-cache-path", str(root / "cache")]


def per_document_losses(model_dir, data_flags, steps):
    """transformers' mean token loss over each step's samples cut into documents after every end-of-text token,
    each document run on its own (positions from 0), predictions from end-of-text tokens left out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ext.arguments import parse
    from megatron_ext.data import pretrain

    run = parse([*data_flags, "--tokenizer", str(model_dir), "--seq-length", str(SEQ), "--micro-batch-size", str(MBS),
                 "--global-batch-size", str(GBS), "--train-iters", str(max(steps)), *DOCUMENTS], world_size=1,
                family="gpt")
    data, _ = pretrain.build(run, vocab_size=0, global_batch_size=GBS, micro_batch_size=MBS, dp_rank=0,
                             dp_size=1, seed=1234)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eod = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    out, documents = {}, 0
    with torch.no_grad():
        for step in range(1, max(steps) + 1):
            total = count = 0.0
            for micro in data.train_microbatches():
                assert torch.equal(micro["loss_mask"], (micro["tokens"] != eod).float())
                for tokens, labels in zip(micro["tokens"], micro["labels"]):
                    cuts = [0] + [i + 1 for i in (tokens == eod).nonzero().flatten().tolist() if i + 1 < len(tokens)]
                    for begin, end in zip(cuts, cuts[1:] + [len(tokens)]):
                        keep, documents = tokens[begin:end] != eod, documents + 1
                        logits = model(tokens[begin:end][None]).logits[0].float()
                        losses = torch.nn.functional.cross_entropy(logits, labels[begin:end], reduction="none")
                        total, count = total + losses[keep].sum().item(), count + keep.sum().item()
            out[step] = total / count
    assert documents >= 2 * GBS * len(steps)  # more than one document per sample
    return {s: out[s] for s in steps}
