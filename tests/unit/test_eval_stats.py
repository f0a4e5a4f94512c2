"""Bootstrap intervals for tau on hand-made cases whose answer is known."""

import pytest

from dspark.evaluate.stats import mean_tau_interval, paired_ratio, tau_interval, verdict


def test_identical_prompts_give_a_point_interval():
    assert tau_interval([(6, 2)] * 5) == [3.0, 3.0]


def test_two_prompts_span_their_extremes():
    # Prompts of tau 2 and 4 with one step each: a resample of two holds {2,2}, {2,4} or {4,4},
    # pooled tau 2, 3 or 4 with probability 1/4, 1/2, 1/4; the 95% interval is [2, 4].
    assert tau_interval([(2, 1), (4, 1)], resamples=4000) == [2.0, 4.0]
    # A 40% interval cuts 30% from each side, more than either 25% tail: only 3 is left.
    lo, hi = tau_interval([(2, 1), (4, 1)], resamples=4000, level=0.4)
    assert lo == hi == 3.0


def test_pooling_weighs_each_prompt_by_its_steps():
    # One prompt of 10 steps at tau 2, one of 1 step at tau 8: pooled 28/11, never above 8.
    lo, hi = tau_interval([(20, 10), (8, 1)])
    assert 2.0 <= lo <= 28 / 11 <= hi <= 8.0


def test_a_set_without_prompts_or_steps_has_no_interval():
    assert tau_interval([]) is None
    assert tau_interval([(1, 0)]) is None


def test_mean_over_categories_resamples_within_each():
    by_cat = {"a": [(2, 1)] * 3, "b": [(4, 1)] * 3}
    assert mean_tau_interval(by_cat) == [3.0, 3.0]


def test_paired_ratio_uses_the_same_prompts_for_both_methods():
    # b emits exactly half of a on every prompt with the same steps: whatever prompts a draw
    # picks, the ratio is 2. Unpaired draws would scatter it.
    a = {"x": [(2, 1), (8, 1), (30, 3)], "y": [(5, 5), (12, 2)]}
    b = {c: [(e / 2, s) for e, s in o] for c, o in a.items()}
    got = paired_ratio(a, b)
    assert got == {"ratio": 2.0, "ci95": [2.0, 2.0]}


def test_paired_ratio_of_a_method_with_itself_is_one():
    a = {"x": [(2, 1), (8, 1), (3, 3)]}
    assert paired_ratio(a, a) == {"ratio": 1.0, "ci95": [1.0, 1.0]}


def test_paired_ratio_refuses_different_prompt_counts():
    with pytest.raises(ValueError, match="x: the methods were decoded on different"):
        paired_ratio({"x": [(2, 1)]}, {"x": [(2, 1), (3, 1)]})


def test_verdict_says_when_an_interval_straddles_the_goal():
    assert verdict([1.2, 1.4], 1.15) == "met"
    assert verdict([0.9, 1.1], 1.15) == "missed"
    assert verdict([1.1, 1.2], 1.15) == "straddles"
    assert verdict(None, 1.15) == "unknown"
