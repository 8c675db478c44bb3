"""Per-step comparisons of runs' metrics, in a module of their own so that the CPU suite proves they can fail
(tests/training/test_step_checks.py) before the GPU tier relies on them: every comparison pins the exact set of steps,
requires every value to be finite, and pairs values by step, never by position."""

from __future__ import annotations

import json
import math
from typing import Dict, Iterable


def worst(diffs) -> float:
    """The largest difference, a NaN or None counted as infinitely wrong, nothing at all too (Python's ``max`` keeps
    or drops a NaN depending on where it stands: ``max([1e-7, nan]) == 1e-7``). Every aggregate of differences in
    the suite goes through it."""
    return max((math.inf if d is None or math.isnan(d) else d for d in diffs), default=math.inf)


def records(log_dir) -> list:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(steps: list, key: str = "loss") -> Dict[int, float]:
    """{step: value}; a step logged twice is an error, not a silent overwrite."""
    out = {r["step"]: r.get(key) for r in steps}
    assert len(out) == len(steps), f"a step was logged twice: {[r['step'] for r in steps]}"
    return out


def assert_steps(values: Dict[int, float], steps: Iterable[int]) -> None:
    """Exactly these steps, each with a finite value (JSON writes NaN as null, a missing key reads as None)."""
    steps = list(steps)
    assert sorted(values) == steps, f"steps {sorted(values)}, expected {steps}"
    bad = {s: v for s, v in values.items() if v is None or not math.isfinite(v)}
    assert not bad, f"non-finite values at {bad}"


def assert_close(actual: Dict[int, float], expected: Dict[int, float], tol: float, steps: Iterable[int]) -> None:
    """Both runs have exactly ``steps``, finite, and agree step by step within ``tol`` (relative)."""
    steps = list(steps)
    assert_steps(actual, steps)
    assert_steps(expected, steps)
    off = {s: (actual[s], expected[s]) for s in steps if abs(actual[s] - expected[s]) > tol * abs(expected[s])}
    assert not off, f"beyond {tol:g} relative at {off}"


def close(actual: Dict[int, float], expected: Dict[int, float], tol: float, steps: Iterable[int]) -> bool:
    """``assert_close`` as a yes/no, for the negative controls."""
    try:
        assert_close(actual, expected, tol, steps)
    except AssertionError:
        return False
    return True


def assert_trains(values: Dict[int, float], steps: Iterable[int], by: float = 0.0) -> None:
    """Exactly ``steps``, finite, and the last loss below the first (by more than ``by``)."""
    steps = list(steps)
    assert_steps(values, steps)
    assert values[steps[-1]] < values[steps[0]] - by, f"the loss did not fall by more than {by:g}: {values}"


def assert_skips_then_trains(steps: list, count: int, most_skipped: int, least_trained: int) -> None:
    """fp16 dynamic loss scaling: exactly steps 1..``count``; the first steps overflow and are skipped (at least one,
    at most ``most_skipped``), every later step trains (at least ``least_trained`` of them) and lowers the loss;
    every loss is finite."""
    assert_steps(by_step(steps), range(1, count + 1))
    skipped = [r["skipped"] for r in steps]
    first_trained = skipped.index(False) if False in skipped else len(skipped)
    assert 1 <= first_trained <= most_skipped and not any(skipped[first_trained:]), skipped
    trained = by_step(steps[first_trained:])
    assert len(trained) >= least_trained, skipped
    assert_trains(trained, sorted(trained))
