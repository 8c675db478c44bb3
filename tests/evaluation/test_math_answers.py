"""Answer extraction and scoring (megatron_ext/evaluation/answers.py, math_eval.score) on the cases that trip
extractors up: MetaMath's "The answer is:", GSM8K's "####", the last number, MATH notation kept whole, and Qwen3's
reasoning before its answer."""

import pytest

from megatron_ext.evaluation import answers
from megatron_ext.evaluation import math_eval as ev


@pytest.mark.parametrize("extractor, text, expected", [
    ("metamath", "So she pays 18 dollars.\nThe answer is: 18", "18"),
    ("metamath", "The answer is: 1,000", "1000"),
    ("metamath", "The answer is: 1,234,567 apples", "1234567"),
    ("metamath", "The answer is: $18", "18"),
    ("metamath", "The answer is: 18 dollars.", "18"),
    ("metamath", "The answer is: 3/4", "3/4"),
    ("metamath", "The answer is: -5", "-5"),
    ("metamath", "The answer is: 2.5.", "2.5"),
    ("metamath", "The answer is: 5\nWait, recheck. The answer is: 7", "7"),
    ("metamath", "The answer is 12", "12"),
    ("metamath", "The answer is: 6 or maybe 7", "6"),
    # MATH-style answers are kept whole (MetaMath's MATH scoring), not cut to their first number
    ("metamath", "The answer is: \\frac{3}{4}", "\\frac{3}{4}"),
    ("metamath", "The answer is: $\\sqrt{2}$.", "\\sqrt{2}"),
    ("metamath", "The answer is: (1,2)", "(1,2)"),
    ("metamath", "The answer is: 2\\sqrt{3}", "2\\sqrt{3}"),
    ("metamath", "The answer is: x^2 + 1\nMore text 5", "x^2 + 1"),
    ("metamath", "The answer is: odd", "odd"),
    ("metamath", "The answer is:  \n", None),
    ("metamath", "12 + 7 = 19, so she has 19.", None),
    ("metamath", "", None),
    ("gsm8k", "4 * 5 = <<4*5=20>>20\n#### 20", "20"),
    ("gsm8k", "#### 1,000", "1000"),
    ("gsm8k", "#### -3", "-3"),
    ("gsm8k", "#### 2.5.", "2.5"),
    ("gsm8k", "#### 4\n#### 5", "4"),
    ("gsm8k", "The answer is: 18", None),
    ("last_number", "The answer is: 18 dollars.", "18"),
    ("last_number", "It costs $1,000.", "1000"),
    ("last_number", "from 3 down to -7", "-7"),
    ("last_number", "a ratio of 3/4", "4"),
    ("last_number", "3.5 hours... and more...", "3.5"),
    ("last_number", "no digits here...", None),
])
def test_extractors(extractor, text, expected):
    assert answers.EXTRACTORS[extractor](text) == expected


# Against a GSM8K gold (#### 18) MetaMath scores the first number after the marker, whatever follows it; these were
# read whole as notation and scored wrong. MATH-style golds still compare notation whole.
GSM8K_SAID = ["The answer is: 18 (9 * 2)", "The answer is 18 = 9 * 2", "The answer is $18 + tax",
              "The answer is: [18]", "The answer is 18 students | ok", "The answer is: 18", "The answer is: 81 (not 18)"]


@pytest.mark.parametrize("text", GSM8K_SAID)
def test_gsm8k_golds_are_scored_by_the_first_number(text):
    row = ev.score(0, {"question": "q", "answer": "9 * 2 = <<9*2=18>>18\n#### 18"}, "p", text, 1)
    assert row["gold_kind"] == "gsm8k"
    assert row["correct"]["metamath"] is (text != "The answer is: 81 (not 18)"), row["extracted"]


@pytest.mark.parametrize("text, expected", [
    ("The answer is: 18 (9 * 2)", "18"), ("The answer is 18 = 9 * 2", "18"), ("The answer is $18 + tax", "18"),
    ("The answer is: [18]", "18"), ("The answer is 18 students | ok", "18"), ("The answer is: x = 18", "18"),
    ("The answer is: \\frac{36}{2}", "\\frac{36}{2}"),  # a LaTeX command first: read whole (18 once rounded)
    ("The answer is: 9 * 2 = 18", "9"),  # the first number, as MetaMath's regex takes it
])
def test_metamath_numeric_takes_the_first_number(text, expected):
    assert answers.extract_metamath(text, numeric=True) == expected


def test_math_golds_still_compare_notation_whole():
    for gold in ("\\frac{3}{4}", "The answer is: \\frac{3}{4}"):
        row = ev.score(0, {"question": "q", "answer": gold}, "p", "The answer is: 3", 1)
        assert row["gold_kind"] != "gsm8k" and not row["correct"]["metamath"], row


@pytest.mark.parametrize("text, expected", [
    ("The answer is: 3/4", "1"),  # MetaMath's GSM8K scoring: fractions evaluated, then rounded
    ("The answer is: 17.6", "18"),
    ("The answer is: -2,500", "-2500"),
    ("The answer is: \\frac{36}{2}", "18"),
    ("The answer is: \\sqrt{2}", "\\sqrt{2}"),
    ("no marker 17", None),
])
def test_metamath_rounds_for_gsm8k(text, expected):
    assert answers.extract_metamath(text, integer=True) == expected


@pytest.mark.parametrize("solution, expected", [
    ("She has 2 * 3 = <<2*3=6>>6.\n#### 6", ("6", "gsm8k")),
    ("#### 1,250", ("1250", "gsm8k")),
    ("So $x = \\boxed{\\frac{1}{2}}$ and then \\boxed{\\frac{\\sqrt{3}}{2}}.", ("\\frac{\\sqrt{3}}{2}", "boxed")),
    ("\\boxed{\\{1, 2\\}}", ("\\{1, 2\\}", "boxed")),
    ("12 + 7 = 19. The answer is: 19", ("19", "metamath")),
    ("The answer is: 4. The answer is: \\frac{3}{4}.", ("\\frac{3}{4}", "metamath")),
    (" 42 ", ("42", "plain")),
])
def test_gold_answer(solution, expected):
    assert answers.gold_answer(solution) == expected


@pytest.mark.parametrize("predicted, gold, same", [
    ("1000", "1,000", True), ("$18", "18", True), ("18.0", "18", True), ("0.75", "3/4", True),
    ("3/4", "\\frac{3}{4}", True), ("18.0000001", "18", True), ("18.01", "18", False), ("-5", "5", False),
    ("\\sqrt{3}", " \\sqrt{3} ", True), ("x+1", "x + 2", False), (None, "18", False),
    # MATH's clean-up: $, \\left/\\right, \\boxed, \\text, units, dfrac, \\frac12, "x =", trailing period
    ("(1, 2)", "(1,2)", True), ("\\left( 1, 2 \\right)", "(1,2)", True), ("1,2", "12", False),
    ("$\\dfrac{1}{2}$", "\\frac{1}{2}", True), ("\\frac12", "0.5", True), ("\\boxed{5}.", "5", True),
    ("5 \\text{ cm}", "5", True), ("\\text{odd}", "odd", True), ("x = 5", "5", True), ("\\sqrt3", "\\sqrt{3}", True),
    ("90^\\circ", "90", True), ("50\\%", "50", True), ("\\sqrt{2}", "2", False), ("2\\sqrt{3}", "\\sqrt{3}", False),
    ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}", True),
])
def test_equivalent(predicted, gold, same):
    assert answers.equivalent(predicted, gold) is same


def test_math_answers_are_scored_whole():
    """The audit's cases: each was cut to its first number (3, 2, 12) and so scored wrong, or right by accident."""
    for said, gold in (("\\frac{3}{4}", "\\frac{3}{4}"), ("\\sqrt{2}", "\\sqrt{2}"), ("(1,2)", "(1, 2)")):
        assert answers.equivalent(answers.extract_metamath(f"The answer is: {said}"), gold), said
    assert not answers.equivalent(answers.extract_metamath("The answer is: (1,2)"), "12")


@pytest.mark.parametrize("output, correct", [
    ("<think>\nLet me try 17. No: 9 * 2 = 18.\n</think>\n\nThe answer is: 18", True),
    ("<think>\nThe answer is: 18\n</think>\n\nThe answer is: 17", False),  # the reasoning's number is not the answer
    ("<think>\n9 * 2 = 18, so the answer is 18 and", False),  # cut off while reasoning: no answer
    ("The answer is: 18", True),  # a model that does not reason
])
def test_reasoning_is_not_scored_only_the_answer_after_it(output, correct):
    """Qwen3 answers after its <think> block: every extractor reads what follows the last </think>."""
    from megatron_ext.evaluation import math_eval

    line = math_eval.score(0, {"question": "q", "answer": "9 * 2 = 18\n#### 18"}, "p", output, 10)
    assert line["correct"]["metamath"] is correct and line["correct"]["last_number"] is correct
