"""The cost model: the budget and its split are the best possible on synthetic survivals and
cost tables (checked against brute force); the acceptance measured per slot counts what a hand
count does; measured rates and calibrated confidences decide as the costs say."""

import itertools

import pytest
import torch

from dspark.decode.acceptance import AcceptanceMeter, trials
from dspark.serve.scheduler import (
    AdaptiveScheduler,
    VerifyCost,
    allocate,
    best_budget,
    cost_modelled,
    survival,
)

FLAT = VerifyCost((1, 64), (10.0, 10.0))  # verifying more costs nothing: draft all you can
STEEP = VerifyCost((1, 2), (10.0, 1000.0))  # every extra token costs 100x a step: never


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


# --- the acceptance measured per slot, and the plan from it -------------------------------------


def test_acceptance_meter_counts_trials_and_hits_as_counted_by_hand():
    meter = AcceptanceMeter(rows=5, k=4, decay=0.5)
    # Row 0 verified 3 drafts and kept 1: slot 0 a hit, slot 1 a miss, slot 2 never decided.
    # Row 1 kept both of 2. Row 2 verified none. Row 4 missed its first of 4.
    rows, proposed, accepted = torch.tensor([0, 1, 2, 4]), [3, 2, 0, 4], [1, 2, 0, 0]
    meter.observe(rows, torch.tensor(proposed), torch.tensor(accepted))
    assert meter.tried.tolist() == [3, 2, 0, 0] and meter.hit.tolist() == [2, 1, 0, 0]
    assert meter.pooled().tolist() == pytest.approx([3 / 5, 2 / 4, 1 / 2, 1 / 2])
    # A row's own counts, drawn toward the pool by SHRINK = 2 pseudo-trials.
    assert meter.row_tried[0].tolist() == [1, 1, 0, 0] and meter.row_hit[0].tolist() == [1, 0, 0, 0]
    want = [(1 + 2 * 3 / 5) / 3, (0 + 2 * 2 / 4) / 3, 1 / 2]
    assert meter.rates(torch.tensor([0]), 3)[0].tolist() == pytest.approx(want)
    # The next step weighs the counts before it by the decay (0.5): 1 trial, 1 hit at slot 0.
    meter.observe(torch.tensor([3]), torch.tensor([1]), torch.tensor([1]))
    assert meter.tried.tolist() == [2.5, 1, 0, 0] and meter.hit.tolist() == [2, 0.5, 0, 0]
    meter.reset(0)  # a new request in row 0: only the pool remembers the last
    assert meter.row_tried[0].sum() == 0 and meter.rates(torch.tensor([0]), 1)[0, 0] == (
        pytest.approx(meter.pooled()[0].item())
    )
    with pytest.raises(ValueError, match="decay"):
        AcceptanceMeter(1, 1, decay=1.0)


def test_trials_match_the_definition_on_random_verdicts():
    gen = torch.Generator().manual_seed(0)
    k = 5
    proposed = torch.randint(0, k + 1, (200,), generator=gen)
    accepted = (torch.rand(200, generator=gen) * (proposed + 1)).long()  # 0..proposed
    tried, hit = trials(proposed, accepted, k)
    for i in range(200):
        for j in range(k):
            before_all_kept = all(s < accepted[i] for s in range(j))
            assert tried[i, j] == (j < proposed[i] and before_all_kept)
            assert hit[i, j] == (tried[i, j] and j < accepted[i])


def measured(rate: float, rows: int, k: int, steps: int, conf=None, decay=0.99):
    """A scheduler whose meter has seen `steps` steps of `rows` rows verifying all k drafts,
    each accepted with probability `rate` once the ones before it were."""
    sched = AdaptiveScheduler(CPU, decay=decay)
    sched.start(rows, k)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        kept = (torch.rand(rows, k, generator=gen) < rate).long().cumprod(1).sum(1)
        c = None if conf is None else torch.full((rows, k), conf)
        sched.observe(torch.arange(rows), torch.full((rows,), k), kept, c)
    return sched


CPU = VerifyCost((1, 2, 4, 8, 16), (55.8, 81.4, 85.7, 92.0, 127.8))  # run 6's verify cost


def test_measured_rates_flat_cost_verifies_every_draft_steep_cost_none():
    """Without a confidence head: a free verify takes every draft of every row, a dear one
    takes none (the step only probes: one row's whole block, to go on measuring)."""
    rows, k_row = torch.arange(3), torch.tensor([4, 2, 0])  # row 2 found nothing to propose
    flat = measured(0.6, rows=3, k=4, steps=50)
    flat.cost = FLAT
    assert flat.decide(rows, k_row, None).tolist() == [4, 2, 0] and flat.pays
    steep = measured(0.6, rows=3, k=4, steps=50)
    steep.cost = STEEP
    probe = steep.decide(rows, k_row, None)
    assert not steep.pays and steep.probes == 1
    assert probe.tolist() == [4, 0, 0]  # one proposing row's whole block ...
    assert steep.decide(rows, k_row, None).tolist() == [0, 2, 0]  # ... the next one's next time
    assert not any(steep.wants_draft() for _ in range(7))  # and no drafting in between


def test_measured_rates_decide_where_a_block_stops():
    """On run 6's CPU cost (a second token in the pass costs +46%, more are cheap) a row whose
    drafts are accepted 90% of the time verifies its block; at 20% drafting does not pay."""
    rows, k_row = torch.arange(1), torch.tensor([7])
    good = measured(0.9, rows=1, k=7, steps=200)
    assert good.decide(rows, k_row, None).tolist() == [7] and good.pays
    poor = measured(0.2, rows=1, k=7, steps=200)
    poor.decide(rows, k_row, None)
    assert not poor.pays
    rates = good.meter.pooled()
    assert rates[0].item() == pytest.approx(0.9, abs=0.05)


def test_calibration_lifts_a_biased_low_head_to_what_was_measured():
    """A head that says 0.1 where 80% are accepted (run 6's DSpark head was low): after
    verification measured it, its calibrated confidences are the measured rates, and the mode
    drafts where uncalibrated it would not."""
    k, rows = 4, 4
    # Enough history that the prior (a ratio of 1 over one unit of confidence) weighs little.
    sched = measured(0.8, rows=rows, k=k, steps=2000, conf=0.1, decay=0.999)
    m = sched.meter
    rate = (m.hit / m.tried)[:k]
    low = torch.full((rows, k), 0.1)
    lifted = m.calibrate(low)
    assert lifted[0].tolist() == pytest.approx(rate.tolist(), abs=0.01)
    assert lifted[0, 0].item() == pytest.approx(0.8, abs=0.05)
    # One stream on run 6's costs: the head as it speaks predicts no gain ...
    plain = AdaptiveScheduler(CPU)
    plain.plan(low[:1])
    assert not plain.pays
    # ... calibrated, it predicts one, and the whole block is verified.
    lengths = sched.decide(torch.tensor([0]), torch.tensor([k]), low[:1])
    assert sched.pays and lengths.tolist() == [k]
    assert sched.state()["acceptance"]["calibration"][0] == pytest.approx(8.0, rel=0.1)


def test_a_request_with_nothing_to_propose_does_not_pull_down_the_budget():
    """Prompt lookup finds nothing for one of two requests: the other's block is worth what its
    own rates say (the curve averages slots where they were proposed), and it is verified."""
    cost = VerifyCost((2, 3, 4, 5, 8), (20.0, 30.0, 31.0, 34.0, 80.0))
    sched = AdaptiveScheduler(cost)
    lengths = sched.plan(torch.full((2, 3), 0.9), k_row=torch.tensor([3, 0]))
    assert lengths.tolist() == [3, 0] and sched.pays
    # Counted as if the empty request had proposed slots worth nothing, it would not pay.
    halved = AdaptiveScheduler(cost)
    halved.plan(torch.tensor([[0.9, 0.9, 0.9], [0.0, 0.0, 0.0]]))
    assert not halved.pays


def test_which_modes_the_cost_model_plans():
    from dspark.config import serving_modes

    assert {m for m in serving_modes() if cost_modelled(m, True)} == {
        "ngram", "eagle3", "dflash", "hybrid", "dspark_adaptive",
    }  # fmt: skip
    # Off, only the mode that is the cost model on a head; dspark_fixed never: its k is fixed.
    assert {m for m in serving_modes() if cost_modelled(m, False)} == {"dspark_adaptive"}


def test_a_probe_after_a_long_pause_is_not_held_off_by_the_stale_curve():
    """The curve's memory runs in engine steps: a probe 16 steps after the last plan weighs
    the old (low) curve as 16 steps of smoothing leave it, so good news pays at once."""
    low, high = torch.full((1, 4), 0.1), torch.full((1, 4), 0.95)
    sched = AdaptiveScheduler(CPU, probe_every=16, max_probe_every=16)
    sched.plan(low)
    assert not sched.pays
    drafted = [sched.wants_draft() for _ in range(16)]
    assert drafted == [False] * 15 + [True]
    assert sched.plan(high).tolist() == [4] and sched.pays
    # Planned step after step instead, one good step is not enough to turn the EMA round.
    steady = AdaptiveScheduler(CPU)
    steady.plan(low)
    steady.plan(high)
    assert not steady.pays
