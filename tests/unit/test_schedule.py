"""The learning-rate schedule and the routing of per-draft metrics to MLflow child runs."""

from itertools import pairwise

import pytest

from dspark.config import OptimConfig
from dspark.train.trainer import lr_at
from tasks.stage import split_by_child


def test_warmup_then_cosine_to_zero():
    cfg = OptimConfig(lr=1.0, warmup_fraction=0.1, schedule="cosine")
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in pairwise(lrs[9:]))
    assert lrs[-1] < 0.01
    const = OptimConfig(lr=0.5, warmup_fraction=0.0, schedule="constant")
    assert {lr_at(s, 10, const) for s in range(10)} == {0.5}


def test_metrics_route_to_their_draft():
    own, routed = split_by_child(
        {"tokens": 9, "dspark/loss": 1.0, "eagle3/tau_sim": 2.0, "other/x": 3},
        ("dspark", "eagle3"),
    )
    assert own == {"tokens": 9, "other/x": 3}
    assert routed == {"dspark": {"loss": 1.0}, "eagle3": {"tau_sim": 2.0}}
