"""What every flag module shares: a parser whose errors are one line (a ``ConfigError``, so entry points print
``error: ...`` and exit 2 like any other bad input), floats that must be finite, and range-checked number types for
``add_argument(type=...)``. A range error reads ``--flag must be >= 1, got 0``: the flag, the value, the fix.
Torch-free: it runs before any process group exists.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from megatron_ext.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise ``ConfigError`` (one line) instead of printing the usage block;
    every ``type=float`` flag refuses nan and inf. ``--help`` is unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse looks each type up in this registry before calling it: plain ``type=float`` becomes finite_float
        self.register("type", float, finite_float)

    def error(self, message: str):
        from megatron_ext.megatron_lm_flags import explain_unknown

        message = explain_unknown(message, self._option_string_actions) or message
        message = message.replace("\r", "\\r").replace("\n", "\\n")
        # "argument --lr: must be > 0, got -1.0" (our types) -> "--lr must be > 0, got -1.0", as ConfigErrors read
        message = re.sub(r"^argument (\S+): (must be )", r"\1 \2", message)
        raise ConfigError(message)


class _Number:
    """A ``type=`` callable: parse ``text`` as int (``integer``) or finite float and check ``low``/``high``."""

    def __init__(self, integer: bool, low=None, high=None, low_open: bool = False, high_open: bool = False):
        self.integer, self.low, self.high, self.low_open, self.high_open = integer, low, high, low_open, high_open
        self.bounds = ""  # as errors read it: ">= 1", "> 0", "in [0, 1)"
        if low is not None and high is not None:
            self.bounds = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            self.bounds = f"{'>' if low_open else '>='} {low}"
        elif high is not None:
            self.bounds = f"{'<' if high_open else '<='} {high}"

    def _refuse(self, what: str, shown: str):
        raise argparse.ArgumentTypeError(f"must be {what}, got {shown}")

    def __call__(self, text):
        kind = "an integer" if self.integer else "a number"
        try:
            value = int(text) if self.integer else float(text)
        except (TypeError, ValueError):
            self._refuse(f"{kind} {self.bounds}".strip(), repr(text))
        if not self.integer and not math.isfinite(value):
            self._refuse(f"a finite number {self.bounds}".strip(), str(value))
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            self._refuse(self.bounds, str(value))
        return value


finite_float = _Number(integer=False)
positive_int = _Number(integer=True, low=1)
nonneg_int = _Number(integer=True, low=0)
positive_float = _Number(integer=False, low=0, low_open=True)
nonneg_float = _Number(integer=False, low=0)
fraction = _Number(integer=False, low=0, high=1, high_open=True)  # probabilities such as dropout: [0, 1)
unit_interval = _Number(integer=False, low=0, high=1)  # [0, 1]


def int_at_least(low: int) -> _Number:
    return _Number(integer=True, low=low)


def int_range(low: int, high: int) -> _Number:
    return _Number(integer=True, low=low, high=high)


def split_weights3(text: str) -> str:
    """``--split``: train,validation[,test] finite non-negative weights, the train one positive (969,30,1)."""
    try:
        weights = [float(w) for w in str(text).split(",")]
    except ValueError:
        weights = []
    if len(weights) not in (2, 3) or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two or three finite non-negative train,validation[,test] "
                                         "weights with a positive train weight, e.g. 969,30,1")
    return text


def split_weights(text: str) -> str:
    """``--data-split``: two finite non-negative train,validation weights, the train one positive (e.g. 98,2).
    Returns the text unchanged; the data modules read it."""
    try:
        weights = [float(w) for w in str(text).split(",")]
    except ValueError:
        weights = []
    if len(weights) != 2 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two finite non-negative train,validation weights "
                                         "with a positive train weight, e.g. 98,2")
    return text


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # what a Hugging Face hub id looks like: [namespace/]name
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped(path: str) -> str:
    """A default that the repository ships (``examples/...``): as written where the working directory has it (the
    launchers run from the repository), else inside the repository, so ``python ~/megatron_ext/finetune_qwen.py``
    from anywhere runs its defaults too."""
    return path if os.path.exists(path) else os.path.join(REPO, path)
