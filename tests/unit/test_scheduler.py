"""Confidence-scheduled verification: the budget and its split are the best possible on
synthetic confidences and cost tables (checked against brute force)."""

import itertools

import pytest
import torch

from dspark.serve.scheduler import AdaptiveScheduler, VerifyCost, allocate, best_budget, survival


def brute_force(surv: torch.Tensor, cost: VerifyCost) -> float:
    """The best expected tokens per ms over every choice of per-request prefix lengths."""
    b, k = surv.shape
    best = 0.0
    for lengths in itertools.product(range(k + 1), repeat=b):
        gain = b + sum(float(surv[r, :n].sum()) for r, n in enumerate(lengths))
        best = max(best, gain / cost(b + sum(lengths)))
    return best


def rate(surv, lengths, cost):
    b = surv.shape[0]
    gain = b + sum(float(surv[r, :n].sum()) for r, n in enumerate(lengths.tolist()))
    return gain / cost(b + int(lengths.sum()))


COSTS = {
    "flat then steep": VerifyCost((1, 4, 8, 16), (50.0, 55.0, 80.0, 200.0)),
    "linear": VerifyCost((1, 16), (10.0, 160.0)),
    "cpu-like": VerifyCost((1, 2, 4, 9, 16), (52.0, 59.0, 80.0, 102.0, 115.0)),
}


@pytest.mark.parametrize("name", COSTS)
@pytest.mark.parametrize("seed", range(6))
def test_budget_and_split_match_brute_force(name, seed):
    cost = COSTS[name]
    gen = torch.Generator().manual_seed(seed)
    b, k = 3, 3
    surv = survival(torch.rand(b, k, generator=gen) ** 0.5)
    lengths = allocate(surv, best_budget(surv, cost))
    assert rate(surv, lengths, cost) == pytest.approx(brute_force(surv, cost), rel=1e-9)


def test_split_is_a_prefix_per_request_and_favours_the_confident():
    surv = survival(torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5], [0.99, 0.1, 0.9]]))
    assert allocate(surv, 4).tolist() == [3, 0, 1]
    assert allocate(surv, 0).tolist() == [0, 0, 0]
    assert allocate(surv, 99).tolist() == [3, 3, 3]


def test_costly_verification_sends_no_drafts():
    surv = survival(torch.full((2, 4), 0.3))
    steep = VerifyCost((1, 2, 10), (10.0, 100.0, 1000.0))
    assert best_budget(surv, steep) == 0


def test_budget_follows_the_smoothed_curve_and_split_the_current_one():
    cost = VerifyCost((1, 6, 7, 12), (50.0, 50.0, 120.0, 300.0))  # flat to 6 tokens, then dear
    sched = AdaptiveScheduler(cost, smoothing=0.8)
    sure = torch.full((2, 4), 0.95)
    first = sched.plan(sure)
    assert first.tolist() == [2, 2]  # 2 anchors + 4 drafts fill the flat part
    # One step of very low confidence barely moves the budget (the EMA remembers) ...
    doubtful = torch.tensor([[0.95, 0.95, 0.95, 0.95], [0.05, 0.05, 0.05, 0.05]])
    second = sched.plan(doubtful)
    assert int(second.sum()) == int(first.sum())
    # ... but the current confidences decide who gets it.
    assert second.tolist() == [4, 0]


def test_cost_table_checks_its_input():
    with pytest.raises(ValueError, match="increase"):
        VerifyCost((4, 2), (1.0, 2.0))
    assert VerifyCost((1, 3), (10.0, 30.0))(2) == 20.0
    assert VerifyCost((1, 3), (10.0, 30.0))(5) == 50.0  # extended past the last point


def test_drafting_backs_off_while_it_does_not_pay_and_resumes_when_it_does():
    steep = VerifyCost((1, 2), (10.0, 1000.0))
    sched = AdaptiveScheduler(steep, probe_every=4, max_probe_every=16)
    drafted = []
    for step in range(60):  # the engine: plan only on the steps that draft
        if sched.wants_draft():
            drafted.append(step)
            sched.plan(torch.full((2, 3), 0.5))
    gaps = [b - a for a, b in itertools.pairwise(drafted)]
    assert gaps[:4] == [4, 8, 16, 16]
    sched.cost = VerifyCost((1, 64), (10.0, 10.0))  # verification became free: drafts pay
    sched.plan(torch.full((2, 3), 0.9))
    assert sched.pays and all(sched.wants_draft() for _ in range(5))
