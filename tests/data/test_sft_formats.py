"""SFT rows in every format (data/chat.py): the same conversation gives the same tokens and loss mask whatever its
format; masks by hand on the Qwen2.5-style template (multi-turn, system prompt, a tool turn) and token by token
against transformers' own assistant mask on a template with {% generation %} markers; Qwen3's template, which
rewrites earlier turns, token by token; undecodable lines are bad rows; formats and --loss-on reach the cached samples."""

import json
import os

import pytest

from support import REPO
from megatron_ext.data import chat, sft
from megatron_ext.errors import ConfigError

TOKENIZER = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen")
Q1, A1, Q2, A2 = "What is 2 + 3?", "2 + 3 = 5.\nThe answer is: 5", "And times 4?", "5 * 4 = 20.\nThe answer is: 20"
TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q1},
             {"role": "assistant", "content": A1}, {"role": "user", "content": Q2},
             {"role": "assistant", "content": A2}]


@pytest.fixture(scope="module")
def tokenizer():
    return sft.load_tokenizer(TOKENIZER)


def one_turn_rows():
    """The conversation [user Q1, assistant A1] in each format."""
    return {"metamath": dict(query=Q1, response=A1),
            "alpaca": dict(instruction=Q1, input="", output=A1),
            "sharegpt": dict(conversations=[dict(**{"from": "human"}, value=Q1), dict(**{"from": "gpt"}, value=A1)]),
            "messages": dict(messages=[dict(role="user", content=Q1), dict(role="assistant", content=A1)]),
            "prompt-completion": dict(prompt=Q1, completion=A1)}


def two_turn_rows():
    """TWO_TURNS in the formats that hold history."""
    return {"alpaca": dict(system="Be brief.", history=[[Q1, A1]], instruction=Q2, output=A2),
            "sharegpt": dict(conversations=[{"from": "system", "value": "Be brief."}, {"from": "human", "value": Q1},
                                            {"from": "gpt", "value": A1}, {"from": "human", "value": Q2},
                                            {"from": "gpt", "value": A2}]),
            "messages": dict(messages=TWO_TURNS)}


def arrays(tokenizer, row, how=chat.RowFormat(), loss_on="assistant"):
    return chat.tokenize_conversations(tokenizer, [chat.conversation(row, how)], loss_on)[0]


def trained_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_every_format_gives_the_same_tokens_and_mask(tokenizer):
    expected = sft.tokenize_example(tokenizer, Q1, A1)
    for fmt, row in one_turn_rows().items():
        assert chat.detect(row, chat.RowFormat()) == fmt
        assert arrays(tokenizer, row) == expected, fmt
        assert arrays(tokenizer, row, chat.RowFormat(format=fmt)) == expected, fmt
    two = {fmt: arrays(tokenizer, row) for fmt, row in two_turn_rows().items()}
    assert two["alpaca"] == two["sharegpt"] == two["messages"]


def test_multi_turn_masks_by_hand(tokenizer):
    """Both assistant turns and their <|im_end|> are trained; the system prompt, the user turns, the role headers
    and the newline after each <|im_end|> are not. last-turn keeps only the second; all trains every token."""
    ids, mask = arrays(tokenizer, dict(messages=TWO_TURNS))
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    assert trained_text(tokenizer, ids, mask) == A1 + "<|im_end|>" + A2 + "<|im_end|>"
    runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert len(runs) == 2 and tokenizer.decode(ids[runs[0] - 3:runs[0]]) == "<|im_start|>assistant\n"
    ids_last, mask_last = arrays(tokenizer, dict(messages=TWO_TURNS), loss_on="last-turn")
    assert ids_last == ids and trained_text(tokenizer, ids, mask_last) == A2 + "<|im_end|>"
    assert arrays(tokenizer, dict(messages=TWO_TURNS), loss_on="all") == (ids, [1] * len(ids))


def test_tool_turns_are_context(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Calling it."},
                {"role": "tool", "content": "22 C, sunny"}, {"role": "assistant", "content": "22 C and sunny."}]
    ids, mask = arrays(tokenizer, dict(messages=messages))
    assert trained_text(tokenizer, ids, mask) == "Calling it.<|im_end|>22 C and sunny.<|im_end|>"
    assert "22 C, sunny" in tokenizer.decode(ids)
    sharegpt = dict(conversations=[{"from": "human", "value": "Weather in Paris?"},
                                   {"from": "function_call", "value": "Calling it."},
                                   {"from": "observation", "value": "22 C, sunny"},
                                   {"from": "gpt", "value": "22 C and sunny."}])
    assert arrays(tokenizer, sharegpt) == (ids, mask)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22 C, sunny"},
             {"role": "assistant", "content": "22 C and sunny."}]


def test_a_tool_call_turn_by_hand(tokenizer):
    """OpenAI messages with tools: the assistant turn that only calls a tool (no text) is trained, rendered as
    Qwen2.5 writes calls (arguments as JSON, not quoted text), through its <|im_end|>; the tool's answer is not."""
    ids, mask = arrays(tokenizer, dict(messages=TOOL_CHAT, tools=[WEATHER]))
    system = ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
              "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              + json.dumps(WEATHER) + "\n</tools>\n\nFor each function call, return a json object with function name "
              "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
              "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    pieces = [(system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
              ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', 1),
              ("\n<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
              ("22 C and sunny.<|im_end|>", 1), ("\n", 0)]
    tokens = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in pieces]
    assert ids == sum(tokens, []) and mask == sum(([m] * len(t) for t, (_, m) in zip(tokens, pieces)), [])
    # The same conversation as ShareGPT: a tools column (JSON text) and a function_call turn holding the call
    sharegpt = dict(tools=json.dumps([WEATHER]), conversations=[
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "22 C, sunny"}, {"from": "gpt", "value": "22 C and sunny."}])
    assert arrays(tokenizer, sharegpt) == (ids, mask)
    # --data-role-tags apply to messages too
    tags = chat.row_format("messages", None, "role_tag=speaker,content_tag=text,user_tag=human,assistant_tag=bot,"
                                             "observation_tag=result")
    renamed = [{"speaker": {"user": "human", "assistant": "bot", "tool": "result"}.get(m["role"], m["role"]),
                "text": m["content"], **{k: v for k, v in m.items() if k not in ("role", "content")}} for m in TOOL_CHAT]
    assert arrays(tokenizer, dict(messages=renamed, tools=[WEATHER]), tags) == (ids, mask)


@pytest.mark.parametrize("turn, reason", [
    ({"role": "assistant", "content": None}, "an assistant turn without text"),
    ({"role": "assistant", "content": "", "tool_calls": []}, "'tool_calls' is not a non-empty list"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "a tool call without a function"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}, "'arguments' text is not"),
])
def test_malformed_tool_calls_are_bad_rows(turn, reason):
    with pytest.raises(chat.BadRow, match=reason):
        chat.conversation(dict(messages=[{"role": "user", "content": Q1}, turn]), chat.RowFormat())
    with pytest.raises(chat.BadRow, match="'tools' is not JSON"):
        chat.conversation(dict(messages=[{"role": "user", "content": Q1}, {"role": "assistant", "content": A1}],
                               tools="[{"), chat.RowFormat())


MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_generation_markers_and_the_prefix_method_agree_token_by_token():
    marked = sft.load_tokenizer(TOKENIZER)
    marked.chat_template = MARKED
    assert chat.has_generation_markers(marked)
    from_markers = chat.tokenize_conversations(marked, [(TWO_TURNS, None)])[0]
    transformers_mask = marked.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)["assistant_masks"]
    assert from_markers[1] == list(transformers_mask) and sum(transformers_mask) > 0
    plain = sft.load_tokenizer(TOKENIZER)
    plain.chat_template = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not chat.has_generation_markers(plain)
    assert chat.tokenize_conversations(plain, [(TWO_TURNS, None)])[0] == from_markers


def test_marker_templates_train_the_end_of_turn_and_last_turn(tokenizer):
    """Markers around the text and <|im_end|>, or around the text only (transformers' mask then leaves <|im_end|>
    out): either way each trained turn ends with its <|im_end|>, as the prefix method trains it, and --loss-on
    last-turn keeps the last. A template with no end-of-turn token is refused in one line."""
    def with_template(template):
        tok = sft.load_tokenizer(TOKENIZER)
        tok.chat_template = template
        return tok

    inside = with_template(MARKED)
    outside = with_template(MARKED.replace("{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
                                           "{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}"))
    plain = with_template(MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    own = outside.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert trained_text(tokenizer, own["input_ids"], own["assistant_masks"]) == A1 + A2
    for marked in (inside, outside):
        assert chat.has_generation_markers(marked)
        ids, mask = chat.tokenize_conversations(marked, [(TWO_TURNS, None)])[0]
        assert trained_text(tokenizer, ids, mask) == A1 + "<|im_end|>" + A2 + "<|im_end|>"
        assert (ids, mask) == chat.tokenize_conversations(plain, [(TWO_TURNS, None)])[0]
        last = chat.tokenize_conversations(marked, [(TWO_TURNS, None)], "last-turn")[0]
        assert last[0] == ids and trained_text(tokenizer, *last) == A2 + "<|im_end|>"
        assert last == chat.tokenize_conversations(plain, [(TWO_TURNS, None)], "last-turn")[0]
    no_end = with_template(MARKED.replace("{{ message['content'] + '<|im_end|>' }}", "{{ message['content'] }}"))
    with pytest.raises(ConfigError, match="markers leave out the token that ends the assistant's turn") as e:
        chat.tokenize_conversations(no_end, [(TWO_TURNS, None)])
    assert "\n" not in str(e.value)


REWRITING = ("{% for message in messages %}{% set content = message['content'] %}"
             "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('\\n')[-1] %}"
             "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN3 = os.path.join(REPO, "examples", "tokenizers", "tiny-qwen3")


def test_a_template_that_rewrites_earlier_turns_trains_them_as_the_final_conversation_shows_them(tokenizer):
    """The one-turn render is not a prefix of the two-turn one (the first answer keeps its last line once a turn
    follows): each turn is trained as the whole conversation renders it. A template whose generation prompt is not
    a prefix of the conversation is refused in one line."""
    rewriting = sft.load_tokenizer(TOKENIZER)
    rewriting.chat_template = REWRITING
    ids, mask = chat.tokenize_conversations(rewriting, [(TWO_TURNS, None)])[0]
    assert trained_text(rewriting, ids, mask) == A1.split("\n")[-1] + "<|im_end|>" + A2 + "<|im_end|>"
    other = sft.load_tokenizer(TOKENIZER)
    other.chat_template = REWRITING.replace("'<|im_start|>' + message['role']", "'<|im_start|>' + "
                                            "(message['role'] if message['role'] != 'assistant' else 'bot')")
    with pytest.raises(ConfigError, match="at turn 2 its chat template's generation prompt is not a prefix") as e:
        chat.tokenize_conversations(other, [(TWO_TURNS, None)])
    assert "\n" not in str(e.value)


def qwen3_turns(reasoning_column: bool):
    """Three exchanges; the second and third answers reason, by the ``reasoning_content`` column or in content."""
    def answer(text, reasoning=None):
        if reasoning is None:
            return {"role": "assistant", "content": text}
        if reasoning_column:
            return {"role": "assistant", "content": text, "reasoning_content": reasoning}
        return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{text}"}
    return [{"role": "user", "content": Q1}, answer(A1), {"role": "user", "content": Q2},
            answer(A2, "Multiply 5 by 4."), {"role": "user", "content": "Thanks"}, answer("Welcome.", "Be kind.")]


@pytest.mark.parametrize("reasoning_column", [True, False])
def test_qwen3_template_masks_token_by_token(reasoning_column):
    """Qwen3's template as published: earlier turns' reasoning dropped (the turns before the last user message),
    the final turn's kept in its <think> block; each trained turn is exactly its text in the final conversation,
    pinned token by token against the pieces written out by hand. A final turn without reasoning trains its empty
    think block, as the template renders it for a model answering with thinking off."""
    qwen3 = sft.load_tokenizer(QWEN3)
    row = {"messages": qwen3_turns(reasoning_column)}
    ids, mask = arrays(qwen3, row)
    context = ["<|im_start|>user\n" + Q1 + "<|im_end|>\n<|im_start|>assistant\n",
               "\n<|im_start|>user\n" + Q2 + "<|im_end|>\n<|im_start|>assistant\n",
               "\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n", "\n"]
    trained = [A1 + "<|im_end|>", A2 + "<|im_end|>", "<think>\nBe kind.\n</think>\n\nWelcome.<|im_end|>"]
    pieces = [context[0], trained[0], context[1], trained[1], context[2], trained[2], context[3]]
    assert "".join(pieces) == qwen3.apply_chat_template(row["messages"], tokenize=False)
    expected_ids, expected_mask = [], []
    for k, piece in enumerate(pieces):
        piece_ids = qwen3(piece, add_special_tokens=False)["input_ids"]
        expected_ids += piece_ids
        expected_mask += [k % 2] * len(piece_ids)
    assert (ids, mask) == (expected_ids, expected_mask)
    last = arrays(qwen3, {"messages": qwen3_turns(reasoning_column)[:2]})
    assert trained_text(qwen3, *last) == "<think>\n\n</think>\n\n" + A1 + "<|im_end|>"


def test_qwen3_generation_prompt_with_thinking_off():
    qwen3 = sft.load_tokenizer(QWEN3)
    prompt = qwen3.apply_chat_template([{"role": "user", "content": Q1}], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_remapped_columns_and_role_tags(tokenizer):
    how = chat.row_format("auto", "query=question,response=answer", None)
    assert arrays(tokenizer, dict(question=Q1, answer=A1), how) == sft.tokenize_example(tokenizer, Q1, A1)
    tags = chat.row_format("sharegpt", "conversations=turns", "role_tag=speaker,content_tag=text,user_tag=u,"
                                                              "assistant_tag=a")
    row = dict(turns=[dict(speaker="u", text=Q1), dict(speaker="a", text=A1)])
    assert arrays(tokenizer, row, tags) == sft.tokenize_example(tokenizer, Q1, A1)
    with pytest.raises(ConfigError, match="--data-columns 'question': expected name=value pairs"):
        chat.row_format("auto", "question", None)


@pytest.mark.parametrize("row,reason", [
    (dict(messages=[dict(role="user", content=Q1)]), "no assistant turn to train on"),
    (dict(messages=[dict(role="robot", content=Q1)]), "a message whose 'role' is not"),
    (dict(conversations=[{"from": "alien", "value": Q1}]), "a turn whose 'from' is not one of"),
    (dict(instruction=Q1), "missing 'output'"),
    (dict(prompt=Q1, completion=" "), "'completion' is empty"),
    (dict(text="just text"), "no known format's columns"),
    (dict(instruction=Q1, output=A1, history=[["only one"]]), "not a list of [prompt, response] pairs"),
])
def test_malformed_rows_are_bad_rows(row, reason):
    with pytest.raises(chat.BadRow) as e:
        chat.conversation(row, chat.RowFormat())
    assert reason in str(e.value)


def test_an_undecodable_line_is_a_bad_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps(dict(query=Q1, response=A1)).encode()
    path.write_bytes(good + b"\n" + b'{"query": "caf\xe9?", "response": "x"}\n' + good + b"\n")
    records, bad = sft.load_records(str(path))
    assert (len(records), bad) == (2, 1)
    with pytest.raises(ConfigError) as e:
        sft.load_records(str(path), bad_rows="error")
    assert str(e.value) == (f"--data-path {path}: bad row at line 2 (not valid UTF-8); fix or remove it, or pass "
                            "--bad-rows skip")


def test_formats_and_loss_on_reach_the_samples(tmp_path, tokenizer):
    """A ShareGPT file under --loss-on last-turn: the cached sample trains exactly the last answer; the settings
    are part of the cache key."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(two_turn_rows()["sharegpt"]) + "\n")
    common = dict(data_path=str(path), tokenizer_path=TOKENIZER, seq_length=128, data_split="1,0",
                  cache_dir=str(tmp_path / "cache"))
    train, _, info = sft.build_datasets(**common, loss_on="last-turn")
    sample = train[0]
    labels = [int(t) for t, m in zip(sample["labels"], sample["loss_mask"]) if m]
    assert tokenizer.decode(labels) == A2 + "<|im_end|>" and info["cache"] == "build"
    train_all, _, info = sft.build_datasets(**common)
    labels = [int(t) for t, m in zip(train_all[0]["labels"], train_all[0]["loss_mask"]) if m]
    assert tokenizer.decode(labels) == A1 + "<|im_end|>" + A2 + "<|im_end|>" and info["cache"] == "build"


def test_blend_order_follows_the_weights():
    from megatron_ext.data import mixture

    order = mixture.blend_order([100, 50], [0.75, 0.25], 150)
    for n in range(1, 151):  # every prefix as close to 3:1 as whole samples allow
        assert abs(int((order[:n, 0] == 0).sum()) - 0.75 * n) <= 0.75, n
    second = order[order[:, 0] == 1, 1].tolist()
    assert second == list(range(len(second)))  # the second set in order, no repeats yet
    assert mixture.parse(["2", "a.jsonl", "6", "b.jsonl"]) == [(0.25, "a.jsonl"), (0.75, "b.jsonl")]
    # What the run prints for a mixture: each data set's records, samples and realised share (113 of the 150
    # blended samples: a wraps around), not only totals
    info = dict(records=0, bad_rows=0, truncated=0, dropped=0, seconds=0.0, vocab_size=8, cache="hit")
    sets = {"a.jsonl": (list(range(100)), 130), "b.jsonl": (list(range(50)), 60)}
    _, _, blended = mixture.build([(0.75, "a.jsonl"), (0.25, "b.jsonl")],
                                  lambda path: (sets[path][0], [], dict(info, records=sets[path][1])))
    assert mixture.describe(blended) == ["0.75 a.jsonl: 130 records -> 100 train samples, 75.3% of the blend",
                                         "0.25 b.jsonl: 60 records -> 50 train samples, 24.7% of the blend"]
    assert blended["records"] == 190
    for bad, message in ((["a.jsonl", "b.jsonl"], "is not a weight"), (["1", "a", "2"], "odd number"),
                         (["0", "a", "1", "b"], "must be positive")):
        with pytest.raises(ConfigError, match=message):
            mixture.parse(bad)


def test_a_mixture_gives_the_same_steps_on_every_mesh_and_resumes_exactly(tmp_path):
    """MetaMathQA-style rows and two-turn ShareGPT chats blended 0.6/0.4: 1 rank, TP2 x PP2 and a TP2 run resumed
    from step 2 give the same four losses (1e-5)."""
    from support.ranks import run_ranks
    from support.step_checks import assert_close, by_step, records

    metamath, chats = tmp_path / "math.jsonl", tmp_path / "chats.jsonl"
    metamath.write_text("".join(json.dumps(dict(query=f"What is {i} + {i + 1}?", response=f"{i} + {i + 1} = "
                                                f"{2 * i + 1}.\nThe answer is: {2 * i + 1}")) + "\n"
                                for i in range(40)))
    chats.write_text("".join(json.dumps(two_turn_rows()["sharegpt"]) + "\n" for _ in range(20)))
    common = ["finetune_qwen.py", "--model", "tiny", "--data-path", "0.6", str(metamath), "0.4", str(chats),
              "--seq-length", "96", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
              "--lr", "2e-3", "--data-cache-dir", str(tmp_path / "cache")]
    layouts = {"1rank": (1, []), "tp2_pp2": (4, ["--tensor-model-parallel-size", "2",
                                                  "--pipeline-model-parallel-size", "2"])}
    for name, (world, flags) in layouts.items():
        run_ranks(world, common + flags + ["--log-dir", str(tmp_path / name)])
    tp2 = ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ckpt")]
    run_ranks(2, common + tp2 + ["--exit-interval", "2", "--log-dir", str(tmp_path / "first")])
    run_ranks(2, common + tp2 + ["--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "resumed")])
    single = by_step(records(tmp_path / "1rank"))
    assert_close(by_step(records(tmp_path / "tp2_pp2")), single, 1e-5, steps=range(1, 5))
    assert_close(by_step(records(tmp_path / "resumed")), {s: single[s] for s in (3, 4)}, 1e-5, steps=[3, 4])
