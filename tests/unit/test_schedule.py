"""The learning-rate schedule and the routing of per-draft metrics to MLflow child runs."""

from itertools import pairwise

import pytest

from dspark.config import OptimConfig
from dspark.train.trainer import cut, lr_at
from tasks.repro import split_by_child


def test_warmup_then_cosine_to_zero():
    cfg = OptimConfig(lr=1.0, warmup_fraction=0.1, schedule="cosine")
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in pairwise(lrs[9:]))
    assert lrs[-1] < 0.01
    const = OptimConfig(lr=0.5, warmup_fraction=0.0, schedule="constant")
    assert {lr_at(s, 10, const) for s in range(10)} == {0.5}


def test_max_steps_cuts_the_plan_across_epochs():
    plans = [[[1], [2], [3]], [[4], [5], [6]]]
    assert cut(plans, None) == plans
    assert cut(plans, 4) == [[[1], [2], [3]], [[4]]]
    assert cut(plans, 2) == [[[1], [2]]]
    assert cut(plans, 9) == plans


def test_metrics_route_to_their_draft():
    own, routed = split_by_child(
        {"tokens": 9, "dspark/loss": 1.0, "eagle3/tau_sim": 2.0, "other/x": 3},
        ("dspark", "eagle3"),
    )
    assert own == {"tokens": 9, "other/x": 3}
    assert routed == {"dspark": {"loss": 1.0}, "eagle3": {"tau_sim": 2.0}}


def test_wall_clock_goal_interpolates_between_evaluations():
    from dspark.train.stage import wall_clock_goal

    eagle3 = {"tau_sim": 1.3, "wall_s": 50.0, "curve": [[0.0, 0, 1.0], [50.0, 9, 1.3]]}
    goal = wall_clock_goal([[0.0, 0, 1.0], [10.0, 3, 1.2], [20.0, 6, 1.4]], eagle3)
    assert goal["dspark_wall_s_to_reach"] == 15.0 and goal["ratio"] == 0.3 and goal["met"]
    assert wall_clock_goal([[0.0, 0, 1.0], [10.0, 3, 1.1]], eagle3)["met"] is False
    flat = {"tau_sim": 1.0, "wall_s": 5.0, "curve": [[0.0, 0, 1.0]]}
    assert wall_clock_goal([[0.0, 0, 1.0]], flat)["met"] is None  # EAGLE-3 learned nothing
