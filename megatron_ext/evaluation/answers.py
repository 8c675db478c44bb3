"""Answers to math problems: what a model's output says (MetaMath's and lm-evaluation-harness' extractors), the
reference answer of a solution, and whether the two are the same.

The primary extractor is MetaMath's, which reads what follows the LAST "The answer is". Against a GSM8K gold
(``#### 18``) the first number there decides, whatever follows it ("18 dollars", "18 (9 * 2)", "$18 + tax"), as
MetaMath's GSM8K scoring does (commas and $ dropped, fractions evaluated, rounded). Otherwise an answer in
mathematical notation (``\\frac{3}{4}``, ``\\sqrt{2}``,
``(1, 2)``, ``x + 1``) is compared whole, as MetaMath's MATH scoring does, after the MATH data set's own clean-up
(``strip_string`` of hendrycks/math, which lm-evaluation-harness' MATH tasks use too): no spaces, $, ``\\left``/
``\\right``, ``\\boxed{}``, ``\\text{}``, units, degrees or trailing full stop; ``\\dfrac``/``\\tfrac`` read as
``\\frac``, ``\\frac12`` as ``\\frac{1}{2}``, ``\\sqrt3`` as ``\\sqrt{3}``; a short left side ``x =`` dropped. Two
answers that are then both numbers (``\\frac{3}{4}`` and 0.75 are) are compared numerically, others as text.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Dict, Optional, Tuple

MARKER = "The answer is"
THINK_START, THINK_END = "<think>", "</think>"
PRIMARY = "metamath"
METAMATH_NUMBER = re.compile(r"[\-+]?\d*[\.,/]?\d+")
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# What makes an answer notation rather than a number with words after it: LaTeX, braces, operators, relations, or
# a tuple or interval ("(1, 2)", "[0, 1)").
NOTATION = re.compile(r"[\\{}^_=*+<>|]|^[(\[]")
PLAIN_FRAC = re.compile(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")
TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\{([^{}]*)\}")
SQRT_BARE = re.compile(r"\\sqrt(\w)")
FRAC_BARE = (re.compile(r"\\frac(\w)(\w)"), re.compile(r"\\frac(\w)(?=\{)"), re.compile(r"\\frac(\{[^{}]*\})(\w)"))
NOISE = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "^{\\circ}", "^\\circ", "\\$", "$", "\\%", "%")


def to_number(text: str) -> Optional[float]:
    """A number (thousands commas dropped) or a fraction a/b evaluated; None for anything else (also "1,2")."""
    text = THOUSANDS.sub("", text)
    try:
        if text.count("/") == 1:
            numerator, denominator = text.split("/")
            value = float(numerator) / float(denominator)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def _strip_number(text: str) -> Optional[str]:
    """lm-eval's answer clean-up: no commas, no $, no trailing full stop; None where no digit is left."""
    text = text.replace(",", "").replace("$", "").rstrip(".")
    return text if re.search(r"\d", text) else None


def after_reasoning(text: str) -> str:
    """What a reasoning model answers (Qwen3): the text after its last ``</think>``; nothing when its reasoning never
    ended (cut off at the token limit: a number inside unfinished reasoning is not an answer); the whole text of a
    model that does not reason."""
    if THINK_END in text:
        return text.rsplit(THINK_END, 1)[1]
    return "" if THINK_START in text else text


def after_marker(text: str) -> Optional[str]:
    """The line after the last "The answer is" (its colon, spaces and trailing full stops dropped), as MetaMath's
    MATH scoring reads it; None without the marker or with nothing after it."""
    if MARKER not in text:
        return None
    rest = text.split(MARKER)[-1].lstrip().lstrip(":").strip().split("\n")[0].strip().rstrip(".").strip()
    return rest or None


def extract_metamath(text: str, integer: bool = False, numeric: bool = False) -> Optional[str]:
    """MetaMath's answer: after the LAST "The answer is", the first number (thousands commas dropped first so
    1,234,567 stays whole) unless the answer is written in notation, which is kept whole (outer $ dropped);
    ``numeric``: the first number whatever follows it (MetaMath's GSM8K scoring), unless a LaTeX command comes
    before it (``\\frac{36}{2}`` is read whole); ``integer``: a numeric answer rounded, as MetaMath does for GSM8K
    (fractions evaluated first)."""
    rest = after_marker(text)
    if rest is None:
        return None
    answer = rest.strip("$").strip() or None
    cleaned = THOUSANDS.sub("", rest)
    match = METAMATH_NUMBER.search(cleaned)
    if match is not None and (not NOTATION.search(rest) or numeric and "\\" not in cleaned[:match.start()]):
        answer = match.group(0).replace(",", "")
    if answer is not None and integer:
        value = _number(normalize(answer))
        return answer if value is None else str(round(value))
    return answer


def extract_gsm8k(text: str) -> Optional[str]:
    """lm-eval's strict-match: the first ``#### N``."""
    match = GSM8K_STRICT.search(text)
    return None if match is None else _strip_number(match.group(1))


def extract_last_number(text: str) -> Optional[str]:
    """lm-eval's flexible-extract: the last number in the text, whatever surrounds it."""
    for match in reversed(FLEXIBLE.findall(text)):
        answer = _strip_number(match[0] or match[1])
        if answer is not None:
            return answer
    return None


EXTRACTORS: Dict[str, Callable[[str], Optional[str]]] = {
    "metamath": extract_metamath, "gsm8k": extract_gsm8k, "last_number": extract_last_number}


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced; MATH's answers nest them), or ``\\boxed N``."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        bare = re.findall(r"\\boxed ([^\s$]+)", text)
        return bare[-1] if bare else None
    opening, depth = text.index("{", start), 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1:i]
    return None


def gold_answer(text: str) -> Tuple[str, str]:
    """(answer, kind) from a reference solution: GSM8K's ``#### N`` (commas removed), MATH's last ``\\boxed{}``,
    MetaMathQA's ``The answer is: X``, else the whole text (a bare answer column)."""
    if "####" in text:
        return text.split("####")[-1].strip().replace(",", ""), "gsm8k"
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    stated = after_marker(text)
    if stated is not None:
        return stated, "metamath"
    return text.strip(), "plain"


def normalize(answer: str) -> str:
    """The MATH clean-up (hendrycks/math's ``strip_string``, modestly): see the module's docstring."""
    boxed = last_boxed(answer)
    text = (answer if boxed is None else boxed).replace("\n", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    if "\\text{ " in text:  # units: "5 \text{ cm}"
        text = text.split("\\text{ ")[0]
    for noise in NOISE:
        text = text.replace(noise, "")
    text = TEXT.sub(r"\1", text).replace(" .", " 0.").replace("{.", "{0.")
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # "x = 5"
        text = sides[1]
    text = SQRT_BARE.sub(r"\\sqrt{\1}", "".join(text.split()))
    for bare in FRAC_BARE:
        text = bare.sub(lambda m: "\\frac" + "".join(g if g.startswith("{") else "{" + g + "}" for g in m.groups()),
                        text)
    text = text.rstrip(".")
    return "0" + text if text.startswith(".") else text


def _number(normalized: str) -> Optional[float]:
    return to_number(PLAIN_FRAC.sub(r"\1/\2", normalized))


def equivalent(predicted: Optional[str], gold: str) -> bool:
    """Numerically within 1e-6 when both are numbers after ``normalize`` (fractions evaluated), else the same
    normalised text; no answer is never right."""
    if predicted is None:
        return False
    predicted, gold = normalize(predicted), normalize(gold)
    a, b = _number(predicted), _number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6
    return predicted == gold


def is_integer(text: str) -> bool:
    value = _number(normalize(text))
    return value is not None and value == int(value)
