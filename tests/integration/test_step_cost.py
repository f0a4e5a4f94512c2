"""The sweep's equal-compute measure: every point's drafts built as the train stage builds them
and stepped side by side on the same batches; each point then gets the steps its cost buys."""

import pytest

from dspark.train.cost import PointCost, equal_steps, measure_step_costs, point_cost, rotation

from .test_distributed_train import data, smoke, stage_paths  # noqa: F401 (a fixture)


def test_every_points_drafts_are_timed_on_the_same_batches(tiny_target_dir, data, tmp_path):  # noqa: F811
    paths = stage_paths(tiny_target_dir, data, tmp_path)
    points = [smoke(), smoke("train.dspark.feature_input=first", "train.dflash.num_layers=2")]
    costs = measure_step_costs(points, paths, batches=2)
    assert [set(c.seconds) for c in costs] == [{"dspark", "dflash", "eagle3"}] * 2
    assert all(len(steps) == 1 for c in costs for steps in c.timed.values())  # warm-up untimed
    assert all(s > 0 for c in costs for s in c.seconds.values())
    assert costs[1].step_s == pytest.approx(sum(costs[1].seconds.values()))
    with pytest.raises(ValueError, match=r"train\.draft_vocab_size: the points"):
        measure_step_costs([points[0], smoke("train.draft_vocab_size=512")], paths, batches=2)
    with pytest.raises(ValueError, match="fewer than"):
        measure_step_costs(points, paths, batches=50)


def test_a_point_twice_as_costly_gets_half_the_steps():
    costs = [
        PointCost({"dspark": 0.5}),
        PointCost({"dspark": 1.0}),
        PointCost({"a": 0.2, "b": 0.05}),
    ]
    assert equal_steps(costs, 1500) == [1500, 750, 3000]
    assert equal_steps([PointCost({"x": 1.0}), PointCost({"x": 1e6})], 10) == [10, 1]  # never 0


def test_a_stalled_step_does_not_move_a_points_cost():
    # the full profile's slot-0 sweep measured 2.15 s for a 0.9 s step: one 4.2 s stall in a
    # mean of three steps; the median of the same steps is the step's cost
    cost = point_cost({"dspark": [0.91, 4.2, 0.95, 0.92, 0.90]})
    assert cost.step_s == pytest.approx(0.92)
    assert cost.timed == {"dspark": [0.91, 4.2, 0.95, 0.92, 0.90]}


def test_every_point_steps_first_on_some_batch():
    orders = [rotation(3, b) for b in range(6)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert [o[0] for o in orders] == [0, 1, 2, 0, 1, 2]
