"""tools/eval_math.py and megatron_ext/evaluation/math_eval.py: the scoring loop on canned outputs, real greedy
generation (left padding must not change a single token), a tiny model fine-tuned until it reproduces its data
scoring >= 90% on it, and one-line errors that write nothing. (Answer extraction: tests/evaluation/test_math_answers.py.)"""

import json
import os
import random
import subprocess
import sys

import pytest

from support import REPO
from support.ranks import run_ranks, run_tool
from megatron_ext.errors import ConfigError
from megatron_ext.evaluation import math_eval as ev

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen")
FALLBACK = "vllm is not installed; using the transformers backend"


class StubBackend:
    """Canned completions, looked up by the question inside the prompt; records the batches it was given."""

    name = "stub"

    def __init__(self, answers):
        self.answers, self.batches = answers, []

    def generate(self, prompts, max_new_tokens):
        self.batches.append(list(prompts))
        outputs = [next(a for q, a in self.answers.items() if q in p) for p in prompts]
        return [(text, len(text.split())) for text in outputs]


def test_scoring_loop_with_stub_backend(tmp_path):
    problems = [{"question": "q1?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"},
                {"question": "a longer q2?", "answer": "#### 1,000"},
                {"question": "q3?", "answer": "x. The answer is: 3/4"},
                {"question": "an even longer q4?", "answer": "\\boxed{7}"},
                {"question": "q5?", "answer": "#### 5"}]
    outputs = {"q1?": "1 + 1 = 2. The answer is: 2", "a longer q2?": "So 1,000 in all.\n#### 1,000",
               "q3?": "The answer is: 0.75", "an even longer q4?": "The answer is: 6 or maybe 7",
               "q5?": "I do not know"}
    prompts = ev.build_prompts([p["question"] for p in problems], None, "metamath")
    backend = StubBackend(outputs)
    results, summary = ev.evaluate(problems, prompts, backend, max_new_tokens=16, batch_size=2)
    assert [len(b) for b in backend.batches] == [2, 2, 1]
    assert [p for b in backend.batches for p in b][:2] == [prompts[3], prompts[1]]  # longest first
    ev.write_results(str(tmp_path / "out"), results, summary)
    with open(tmp_path / "out" / "summary.json") as f:
        written = json.load(f)
    assert written["accuracy"] == pytest.approx(2 / 5)  # q1, q3 (q2 has no marker, q4's first number is 6)
    assert written["accuracy_by_extractor"] == pytest.approx({"metamath": 2 / 5, "gsm8k": 1 / 5,
                                                              "last_number": 4 / 5})
    assert written["no_answer_rate"] == pytest.approx(2 / 5)
    assert written["samples"] == 5 and written["generated_tokens"] == sum(len(o.split()) for o in outputs.values())
    with open(tmp_path / "out" / "results.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [r["index"] for r in lines] == list(range(5)) and [r["question"] for r in lines] == list(outputs)
    assert lines[1]["extracted"] == {"metamath": None, "gsm8k": "1000", "last_number": "1000"}
    assert lines[1]["correct"] == {"metamath": False, "gsm8k": True, "last_number": True}
    assert lines[3]["gold"] == "7" and lines[3]["gold_kind"] == "boxed" and lines[3]["prompt"] == prompts[3]
    assert lines[4]["output"] == "I do not know" and not any(lines[4]["correct"].values())
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left beside it


def test_stub_backend_scores_math_answers_exactly():
    """MATH-style golds (\\boxed{} solutions, a MetaMathQA answer in LaTeX): 5 of 7 right by MetaMath's extractor,
    which the first-number reading got wrong (3/4 -> 3, sqrt 2 -> 2) or right by accident ((1,2) -> 12)."""
    cases = [("q1?", "So $\\boxed{\\frac{3}{4}}$.", "Thus $\\frac{3}{4}$.\nThe answer is: \\frac{3}{4}", True),
             ("q2?", "\\boxed{\\sqrt{2}}", "The answer is: $\\sqrt{2}$.", True),
             ("q3?", "\\boxed{(1,2)}", "The answer is: \\left( 1, 2 \\right)", True),
             ("q4?", "\\boxed{\\dfrac{1}{2}}", "The answer is: \\frac12", True),
             ("q5?", "It is 3/4. The answer is: \\frac{3}{4}", "The answer is: 0.75", True),
             ("q6?", "\\boxed{12}", "The answer is: (1,2)", False),
             ("q7?", "\\boxed{2\\sqrt{3}}", "The answer is: \\sqrt{3}", False)]
    problems = [{"question": q, "answer": gold} for q, gold, _, _ in cases]
    backend = StubBackend({q: said for q, _, said, _ in cases})
    results, summary = ev.evaluate(problems, ev.build_prompts([p["question"] for p in problems], None, "metamath"),
                                   backend, max_new_tokens=16, batch_size=4)
    assert [r["correct"]["metamath"] for r in results] == [right for *_, right in cases]
    assert summary["accuracy"] == pytest.approx(5 / 7) and summary["no_answer_rate"] == 0
    assert [r["extracted"]["metamath"] for r in results[:3]] == ["\\frac{3}{4}", "\\sqrt{2}", "\\left( 1, 2 \\right)"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ev.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        ev.write_results(str(tmp_path / "out"), [{"index": 0}], {"accuracy": 0.0})
    assert os.listdir(tmp_path) == []


def test_chat_prompt_is_what_training_renders():
    from transformers import AutoTokenizer

    from megatron_ext.data.sft import tokenize_example

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    for system in (None, "You solve math problems."):
        ids, mask = tokenize_example(tokenizer, "What is 2 plus 3?", "The answer is: 5", system)
        prompt = ev.build_prompts(["What is 2 plus 3?"], tokenizer, "chat", system)[0]
        assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == ids[:mask.index(1)]
    assert "You are Qwen" in ev.build_prompts(["q"], tokenizer)[0]  # the template's default system turn
    assert ev.build_prompts(["q"], tokenizer, "metamath")[0].endswith("q\n\n### Response: Let's think step by step.")


def test_generation_stops_at_the_templates_own_end_of_turn():
    """A base model's EOS (<|endoftext|>) plus whatever closes an assistant turn in the chat template: <|im_end|>
    for ChatML, <|box_end|> for a Gemma-like template built from the tokenizer's spare special tokens (a hard-coded
    <|im_end|> would never stop it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.eos_token = "<|endoftext|>"
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|box_end|>"])
    assert ev.stop_ids(tokenizer) == ids[:2]
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|box_start|>' + m['role'] + '\\n' + m['content'] + "
                               "'<|box_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|box_start|>assistant\\n' }}{% endif %}")
    assert ev.stop_ids(tokenizer) == [ids[0], ids[2]]
    assert ev.stop_ids(tokenizer, type("Config", (), {"eos_token_id": [7, ids[0]]})) == [ids[0], ids[2], 7]
    tokenizer.chat_template = None  # --prompt metamath with a base tokenizer: its EOS only
    assert ev.stop_ids(tokenizer) == [ids[0]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from support import hf_fixtures

    return str(hf_fixtures.make_qwen(tmp_path_factory.mktemp("eval") / "m"))


def test_generation_on_tiny_model(tiny_model, tmp_path, capsys):
    data, out = tmp_path / "gsm8k_lookalike.jsonl", tmp_path / "out"
    run_tool("make_gsm8k_lookalike", "--out", data, "--num-records", 4, "--seed", 3)
    run_tool("eval_math", "--model", tiny_model, "--data", data, "--output", out, "--max-new-tokens", 8,
             "--batch-size", 3)
    assert capsys.readouterr().out.count(FALLBACK) == 1
    assert sorted(os.listdir(out)) == ["results.jsonl", "summary.json"]
    with open(out / "results.jsonl") as f:
        lines = [json.loads(line) for line in f]
    with open(data) as f:
        questions = [json.loads(line)["question"] for line in f]
    assert [r["question"] for r in lines] == questions
    assert all(0 < r["generated_tokens"] <= 8 and r["gold_kind"] == "gsm8k" for r in lines)
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["samples"] == 4 and summary["backend"] == "transformers"
    # the summary's accuracy is what its lines say, and each line's verdict is its output re-scored
    assert summary["accuracy"] == sum(r["correct"]["metamath"] for r in lines) / 4
    problems = [json.loads(line) for line in open(data)]
    assert [ev.score(i, p, r["prompt"], r["output"], r["generated_tokens"]) for i, (p, r) in
            enumerate(zip(problems, lines))] == lines
    assert summary["generated_tokens"] == sum(r["generated_tokens"] for r in lines)


def test_left_padding_does_not_change_greedy_outputs(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    backend = ev.TransformersBackend(tiny_model, tokenizer)
    assert tokenizer.padding_side == "left" and backend.stop_ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = ev.build_prompts(["What is 2 plus 3?", "A train travels 40 miles per hour for 3 hours and then "
                                                     "55 miles per hour for 2 hours. How far does it go?"], tokenizer)
    assert backend.length(prompts[1]) > backend.length(prompts[0]) + 10
    together = backend.generate(prompts, max_new_tokens=10)
    assert together == [backend.generate([p], max_new_tokens=10)[0] for p in prompts]


def test_new_tokens_are_capped_at_the_models_positions_and_said_once(tiny_model, capsys):
    """tools/eval_math.py's default 512 new tokens past a small model's positions: capped at what the prompt leaves,
    one line of ours (not transformers' "exceeded the model's predefined maximum length" reminder)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    backend = ev.TransformersBackend(tiny_model, tokenizer)
    limit = backend.model.config.max_position_embeddings
    (prompt,) = ev.build_prompts(["What is 2 plus 3?"], tokenizer)
    for _ in range(2):
        (_, tokens), = backend.generate([prompt], max_new_tokens=limit)
        assert tokens <= limit - backend.length(prompt)
    out = capsys.readouterr()
    assert out.out.count("eval_math: --max-new-tokens") == 1 and "maximum length" not in out.out + out.err
    assert backend._within_positions(10, limit - 10) == limit - 10  # within the positions: as asked


def test_vllm_absent_falls_back_once(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not
    assert ev.resolve_backend("auto") == "transformers"
    assert capsys.readouterr().out == FALLBACK + "\n"
    assert ev.resolve_backend("transformers") == "transformers" and capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="--backend vllm: vllm is not installed"):
        ev.resolve_backend("vllm")


def test_memorised_set_scores_at_least_90_percent(tmp_path):
    rng = random.Random(7)
    pairs = [(rng.randint(2, 99), rng.randint(2, 99)) for _ in range(8)]
    train, gold = tmp_path / "train.jsonl", tmp_path / "gold.jsonl"
    with open(train, "w") as f:
        f.writelines(json.dumps({"query": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}. The answer "
                                 f"is: {a + b}"}) + "\n" for a, b in pairs)
    with open(gold, "w") as f:
        f.writelines(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>"
                                 f"{a + b}\n#### {a + b}"}) + "\n" for a, b in pairs)
    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    run_ranks(1, ["finetune_qwen.py", "--model", "tiny", "--data-path", str(train), "--tokenizer", TOKENIZER,
                  "--data-split", "100,0", "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size",
                  "8", "--train-iters", "150", "--lr", "3e-3", "--lr-warmup-iters", "0", "--save-hf", str(hf),
                  "--save", str(ckpt), "--data-cache-dir", str(tmp_path / "cache")])
    run_tool("eval_math", "--model", hf, "--data", gold, "--output", tmp_path / "eval", "--max-new-tokens", 32)
    with open(tmp_path / "eval" / "summary.json") as f:
        summary = json.load(f)
    assert summary["accuracy"] >= 0.9, summary
    print(f"memorised set: accuracy {summary['accuracy']} after 150 steps")
    # Our checkpoint (exported in-process first) on the MetaMathQA rows themselves, one prompt at a time: the same
    # outputs as the Hugging Face export's, which ran as one left-padded batch of prompts of different lengths.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    assert len({len(tokenizer(f"What is {a} plus {b}?")["input_ids"]) for a, b in pairs}) > 1
    run_tool("eval_math", "--model", ckpt, "--tokenizer", TOKENIZER, "--data", train, "--output",
             tmp_path / "eval_ckpt", "--max-new-tokens", 32, "--backend", "transformers", "--batch-size", 1)
    outputs = []
    for name in ("eval", "eval_ckpt"):
        with open(tmp_path / name / "results.jsonl") as f:
            outputs.append([json.loads(line)["output"] for line in f])
    assert outputs[0] == outputs[1]
    with open(tmp_path / "eval_ckpt" / "summary.json") as f:
        assert json.load(f)["accuracy"] == summary["accuracy"]


def test_bad_input_subprocess_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "tools/eval_math.py", "--model", str(tmp_path / "missing"), "--data",
                           str(tmp_path / "d.jsonl"), "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: --model "), proc.stderr
    assert not out.exists()


def test_invalid_utf8_data_is_one_line_exit_2(tmp_path):
    """A .jsonl with a Latin-1 byte on line 2: one line naming the file and the line, exit 2, nothing written (it
    was a UnicodeDecodeError traceback, exit 1)."""
    model, data, out = tmp_path / "model", tmp_path / "gsm8k.jsonl", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the data is read before the model loads
    good = json.dumps({"question": "q?", "answer": "#### 1"}).encode()
    data.write_bytes(good + b"\n" + b'{"question": "caf\xe9?", "answer": "#### 2"}\n')
    proc = subprocess.run([sys.executable, "tools/eval_math.py", "--model", str(model), "--data", str(data),
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (2, f"error: --data {data}: line 2 is not valid UTF-8; re-save the "
                                                 "file as UTF-8\n")
    assert sorted(os.listdir(tmp_path)) == ["gsm8k.jsonl", "model"]
    listed = tmp_path / "list.json"
    listed.write_bytes(b'[\n{"question": "q?", "answer": "#### 1"},\n{"question": "\xff", "answer": "#### 2"}]')
    with pytest.raises(ConfigError, match="line 3 is not valid UTF-8"):
        ev.load_problems(str(listed))
    bad_json = _write(tmp_path / "bad.jsonl", [{"question": "q?", "answer": "#### 1"}])
    with open(bad_json, "a") as f:
        f.write("{not json\n")
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        ev.load_problems(str(bad_json))


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


@pytest.mark.parametrize("case, message", [
    ("no_model", "--model .*no such directory"),
    ("not_a_model", "--model .*neither a Hugging Face model"),
    ("ckpt_without_tokenizer", "--model .*megatron-core checkpoint, which holds no tokenizer; pass --tokenizer"),
    ("no_data", "--data .*no such file"),
    ("no_columns", "--data .*no question/answer columns \\(found \\['text'\\]\\)"),
    ("max_samples", "--max-samples must be >= 1, got 0"),
    ("output_not_empty", "--output .*is not an empty directory"),
    ("hub_unreachable", "--data no-such-org/no-such-set: cannot load it as a datasets hub id"),
])
def test_bad_input_in_process(tiny_model, tmp_path, case, message):
    data = _write(tmp_path / "d.jsonl", [{"question": "q?", "answer": "#### 1"}])
    out = tmp_path / "out"
    args = {"--model": tiny_model, "--data": data, "--output": out}
    extra = []
    if case == "no_model":
        args["--model"] = tmp_path / "missing"
    elif case == "not_a_model":
        os.makedirs(tmp_path / "empty_dir")
        args["--model"] = tmp_path / "empty_dir"
    elif case == "ckpt_without_tokenizer":
        os.makedirs(tmp_path / "ckpt" / "iter_0000001")
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
        args["--model"] = tmp_path / "ckpt"
    elif case == "no_data":
        args["--data"] = tmp_path / "missing.jsonl"
    elif case == "no_columns":
        args["--data"] = _write(tmp_path / "t.jsonl", [{"text": "hello"}])
    elif case == "max_samples":
        extra = ["--max-samples", "0"]
    elif case == "output_not_empty":
        os.makedirs(out)
        (out / "keep.txt").write_text("mine")
    elif case == "hub_unreachable":
        args["--data"] = "no-such-org/no-such-set"
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=message) as error:
        run_tool("eval_math", *[str(x) for kv in args.items() for x in kv], *extra)
    assert "\n" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == before
    if case == "output_not_empty":
        assert os.listdir(out) == ["keep.txt"]
