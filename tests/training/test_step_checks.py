"""The per-step comparisons the GPU tier relies on (tests/support/step_checks.py) fail where they must: an empty or partial
metrics file, a missing, extra or repeated step, a NaN, a run that stops training after its loss-scale skips."""

import json
import math

import pytest

from support.step_checks import assert_close, assert_skips_then_trains, assert_trains, by_step, close, records

REF = {1: 12.0, 2: 11.5, 3: 11.0}


@pytest.mark.parametrize("actual", [{}, {1: 12.0, 2: 11.5}, {1: 12.0, 2: 11.5, 3: 11.0, 4: 10.5},
                                    {1: 12.0, 2: math.nan, 3: 11.0}, {1: 12.0, 2: None, 3: 11.0},
                                    {1: 12.0, 2: 11.5, 3: 11.1}, {2: 12.0, 3: 11.5, 4: 11.0}],
                         ids=["empty", "missing", "extra", "nan", "null", "off", "shifted"])
def test_close_refuses(actual):
    assert not close(actual, REF, 1e-4, [1, 2, 3])
    assert not close(REF, actual, 1e-4, [1, 2, 3])  # the reference side is checked the same way


def test_close_accepts_the_same_steps_within_tolerance():
    assert close({1: 12.0, 2: 11.5005, 3: 11.0}, REF, 1e-4, [1, 2, 3])


def test_a_step_logged_twice_and_an_empty_metrics_file(tmp_path):
    with pytest.raises(AssertionError, match="logged twice"):
        by_step([dict(step=1, loss=1.0), dict(step=1, loss=2.0)])
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(AssertionError, match="steps"):
        assert_close(by_step(records(tmp_path)), REF, 1e-4, [1, 2, 3])


def test_training_must_lower_the_loss():
    assert_trains(REF, [1, 2, 3])
    for bad in ({1: 12.0, 2: 11.5, 3: 12.5}, {1: 12.0, 2: 11.5}, {1: 12.0, 2: 11.5, 3: math.inf}):
        with pytest.raises(AssertionError):
            assert_trains(bad, [1, 2, 3])
    with pytest.raises(AssertionError):
        assert_trains(REF, [1, 2, 3], by=1.5)


def steps(skipped, losses):
    return [dict(step=i + 1, skipped=s, loss=l) for i, (s, l) in enumerate(zip(skipped, losses))]


def test_fp16_skips_then_trains():
    assert_skips_then_trains(steps([True, True, False, False, False], [9, 9, 8.5, 8, 7.5]), 5, 3, 3)
    for skipped, losses in (([False] * 5, [9, 8.5, 8, 7.5, 7]),  # never overflowed: the scale was not exercised
                            ([True] * 5, [9] * 5),  # never trained
                            ([True, False, True, False, False], [9, 8.5, 8.5, 8, 7.5]),  # skips again later
                            ([True, False, False, False, False], [9, 8.5, math.inf, 8, 7.5]),  # an inf loss
                            ([True, False, False, False, False], [9, 8.5, 8.6, 8.7, 8.8]),  # trains nowhere
                            ([True, False, False, False], [9, 8.5, 8, 7.5])):  # a step missing at the end
        with pytest.raises(AssertionError):
            assert_skips_then_trains(steps(skipped, losses), 5, 3, 3)


def test_records_read_null_as_not_finite(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(dict(step=s, loss=v)) for s, v in
                                                      ((1, 12.0), (2, float("nan")), (3, 11.0))).replace("NaN", "null"))
    assert not close(by_step(records(tmp_path)), REF, 1e-4, [1, 2, 3])


def test_every_aggregate_of_differences_counts_a_later_nan():
    """Python's ``max`` drops a NaN that is not first: each aggregate the suite compares with gets a NaN at a later
    step (or parameter) and must call it infinitely wrong. Planted where the audit found plain ``max``: grouped vs
    sequential experts, DeepSpeed vs one process, convert_worker's lr-0 losses and its per-rank record, the
    naive-slicing control of test_pretrained."""
    import torch

    from support.experts_worker import _nan_last, relative_by_parameter, worst_diff
    from support.step_checks import worst
    from test_deepspeed_engine import worst_loss_diff

    assert worst([1e-7, math.nan, 2e-7]) == worst([None, 1e-7]) == worst([]) == math.inf
    assert worst([1e-7, 2e-7]) == 2e-7
    ref = dict(losses=[2.0, 1.5, 1.0], norms=[0.9, 0.8, 0.7])
    run = lambda **kw: dict(ref, worst={"v": 0.0, "w": 0.0}, **kw)  # noqa: E731
    assert worst_diff(run(), ref) == 0.0
    assert worst_diff(dict(run(), losses=[2.0, 1.5, math.nan]), ref) == math.inf  # the third step's loss
    assert worst_diff(dict(run(), norms=[0.9, math.nan, 0.7]), ref) == math.inf  # the second step's grad norm
    nan_grad = relative_by_parameter({"w": torch.tensor([1.0, math.nan, 1.0])}, {"w": torch.ones(3)})
    assert worst_diff(dict(run(), worst={"v": 0.0, **nan_grad}), ref) == math.inf  # a parameter's gradient
    assert math.isnan(max(1e-7, math.nan, key=_nan_last))  # a later step's NaN stays in the running worst
    ref = {s: dict(loss=2.0 - s / 10) for s in range(1, 6)}
    assert worst_loss_diff(ref, ref) == 0.0
    assert worst_loss_diff({**ref, 4: dict(loss=math.nan)}, ref) == math.inf
    expected = 2.5  # convert_worker.engines: both lr-0 losses against transformers', then the largest over ranks
    assert worst(abs(loss - expected) for loss in (2.5, math.nan)) == math.inf
    assert worst([1e-7, math.nan]) > 1e-4  # test_pretrained: a NaN under PP2 fails the control's "tp1/pp2 match"
