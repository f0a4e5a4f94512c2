"""What the block-draft study (issue 48) measures and changes: conditional acceptance per slot,
the copy-bias check, the fitted learning curves, and the levers' masks and inputs."""

import math
from dataclasses import replace

import pytest
import torch

from dspark.config import load_params
from dspark.errors import ConfigError
from dspark.models.dspark import block_mask
from dspark.train.curves import fit_history, fit_power
from dspark.train.diagnostics import CopyBias, recent_tokens
from dspark.train.losses import AcceptanceStats
from dspark.train.trainer import slot_metrics

from .test_config import PARAMS
from .test_drafts import tiny_dspark


def test_conditional_acceptance_counts_a_slot_only_after_every_earlier_one_accepted():
    greedy = torch.tensor(
        [
            [1.0, 1.0, 0.0],  # slot 2 reached, missed
            [1.0, 0.0, 1.0],  # slot 2 not reached: its 1 is no link of the chain
            [0.0, 1.0, 1.0],  # slots 1 and 2 not reached
            [1.0, 1.0, 1.0],  # slot 2 unsupervised below
        ]
    )
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[3, 2] = False
    stats = AcceptanceStats(3)
    stats.add(greedy, mask, greedy)
    assert stats.cond_greedy == [0.75, round(2 / 3, 4), 0.0]
    assert stats.pos_greedy == [0.75, 0.75, round(2 / 3, 4)]  # marginal: mixes the links
    never = AcceptanceStats(2)
    never.add(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2))
    assert never.cond_greedy == [0.0, None]  # slot 1 never reached: no rate, not 0


def test_recent_tokens_end_at_the_anchor_and_pad_before_the_start():
    draft_input = torch.tensor([[5, 6, 7, 8], [9, -1, 3, 4]])
    at = torch.tensor([[0, 2], [1, 3], [0, 0]])
    assert recent_tokens(draft_input, at, 3).tolist() == [[5, 6, 7], [-1, 3, 4], [-1, -1, 5]]


def test_copy_bias_sets_the_drafts_copies_beside_the_targets():
    recent = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])  # anchor last
    proposed = torch.tensor([3, 4, 3, 1])  # the anchor, a recent token, neither, the anchor
    truth = torch.tensor([3, 7, 2, -1])  # the anchor, neither, neither, out of reach
    bias = CopyBias(window=3)
    bias.add(proposed, truth, recent)
    out = bias.summary()
    assert out["blocks"] == 3  # the block whose truth no draft can propose is left out
    assert (out["draft_anchor"], out["target_anchor"]) == (round(1 / 3, 4), round(1 / 3, 4))
    assert (out["draft_recent"], out["target_recent"]) == (round(2 / 3, 4), round(1 / 3, 4))
    assert out["excess_anchor"] == 1.0 and out["excess_recent"] == 2.0


def test_a_power_law_is_recovered_and_extrapolated():
    steps = [40, 80, 160, 320, 640, 1280]
    values = [3.0 - 2.0 * t**-0.5 for t in steps]
    fit = fit_power(steps, values)
    assert fit.a == pytest.approx(3.0, abs=0.02) and fit.c == pytest.approx(0.5, rel=0.05)
    assert fit.reliable and fit.r2 > 0.999
    summary = fit.summary(reach=2.95)
    assert summary["at_10x"] == pytest.approx(3.0 - 2.0 * 12800**-0.5, abs=0.01)
    assert summary["steps_to_reach"] == pytest.approx((2.0 / 0.05) ** 2, rel=0.1)
    assert fit.steps_to(3.5) is None  # above the level: never


def test_a_curve_with_too_few_points_or_a_slow_exponent_says_so():
    assert fit_power([0, 10, 20, 30], [1.0, 1.1, 1.2, 1.3]) is None  # step 0 cannot be fitted
    slow = fit_power(
        [100, 200, 400, 800, 1600], [1.2 + 0.1 * math.log(t) for t in [100, 200, 400, 800, 1600]]
    )
    assert not slow.reliable  # a logarithm has no level: the fit must not claim one
    history = [{"step": s, "tau_decode": 1.0 + s / 1000} for s in (0, 100, 200, 300, 400)]
    assert fit_history(history).points == 4


def test_slot_metrics_flatten_the_per_slot_rates_for_the_tracker():
    result = {
        "pos_greedy": [0.5, 0.2],
        "cond_greedy": [0.5, None],
        "copy": {"window": 16, "draft_anchor": 0.1},
    }
    assert slot_metrics("dspark", result) == {
        "dspark/eval_greedy_slot0": 0.5,
        "dspark/eval_greedy_slot1": 0.2,
        "dspark/eval_cond_slot0": 0.5,
        "dspark/eval_cond_slot1": None,
        "dspark/eval_copy_draft_anchor": 0.1,
    }


def test_a_causal_block_sees_only_itself_and_the_slots_before():
    anchors = torch.tensor([[2, 5]])
    full = block_mask(anchors, 3, 8)
    causal = block_mask(anchors, 3, 8, causal=True)
    assert torch.equal(full[..., :8], causal[..., :8])  # the context part is the same
    block = causal[0, :, 8:].int()
    expected = torch.block_diag(torch.ones(3, 3).tril(), torch.ones(3, 3).tril()).int()
    assert torch.equal(block, expected)


def test_the_anchor_as_bonus_layout_drafts_one_slot_fewer():
    model = tiny_dspark(block=4)
    bonus = replace(model.cfg, sample_from_anchor=False)
    assert (model.cfg.draft_slots, bonus.draft_slots) == (4, 3)
    with pytest.raises(ValueError, match="at least 2 slots"):
        replace(model.cfg, block_size=1, sample_from_anchor=False)
    with pytest.raises(ValueError, match="feature_input"):
        replace(model.cfg, feature_input="middle")


def test_feature_input_reaches_the_slots_it_names_and_starts_at_zero():
    base = tiny_dspark(block=4)
    for where, touched in (("first", [True, False, False, False]), ("all", [True] * 4)):
        cfg = replace(base.cfg, feature_input=where)
        model = type(base)(cfg, base.embed, base.lm_head.weight.detach())
        ids = torch.tensor([[3, 0, 0, 0]])
        feature = torch.randn(1, cfg.layer.hidden_size)
        start = model.block_input(ids, feature)
        assert torch.equal(start, model.embed(ids))  # zero at the start: the plain layout
        torch.nn.init.normal_(model.feature_fc.weight)
        moved = (model.block_input(ids, feature) != model.embed(ids)).any(-1)[0]
        assert moved.tolist() == touched


def test_params_reject_an_unknown_lever(tmp_path):
    text = PARAMS.replace("    gamma: 4.0 ", "    block_attention: sideways\n    gamma: 4.0 ", 1)
    assert text != PARAMS
    bad = tmp_path / "params.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"train\.dflash\.block_attention"):
        load_params(bad)


def test_anchor_as_bonus_drafts_from_the_slots_after_the_anchor():
    """Drafting slot k of the anchor-as-bonus layout is block position k + 1, and predicts the
    token every-slot layout's slot k predicts (x_{p+k+1}), with the same Markov input."""
    base = tiny_dspark(block=4)
    cfg = replace(base.cfg, sample_from_anchor=False)
    model = type(base)(cfg, base.embed, base.lm_head.weight.detach())
    model.load_state_dict(base.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    aux = torch.randn(1, 12, len(cfg.aux_layers) * cfg.layer.hidden_size)
    anchors = torch.tensor([[2, 5]])
    with torch.no_grad():
        logits, conf = model.forward_train(ids, aux, anchors)
        hidden = model.backbone(model.context(aux), ids[:, [2, 5]], anchors)[0, :, 1:]
        prev = torch.stack([ids[0, p : p + 3] for p in (2, 5)])
        expected, _ = model.heads(hidden, prev)
    assert logits.shape == (2, 3, cfg.draft_vocab_size) and conf.shape == (2, 3)
    assert torch.allclose(logits, expected)
