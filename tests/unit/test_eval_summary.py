"""The evaluation's accounting on hand-made traces: tau, per-position acceptance, calibration
and distinct-n; prompt selection; the report."""

import pytest

from dspark.config import EvalGoals, NgramConfig
from dspark.data.prompts import Prompt, user
from dspark.decode.engine import RowTrace, Timing
from dspark.evaluate.report import report_markdown
from dspark.evaluate.stage import goals, select_prompts
from dspark.evaluate.summary import Calibration, Tally, distinct_n


def trace(accepted, proposed, emitted=None, conf=None, tokens=None):
    t = RowTrace(
        tokens=tokens or list(range(1 + sum(emitted or [a + 1 for a in accepted]))),
        accepted=list(accepted),
        proposed=list(proposed),
        emitted=list(emitted or [a + 1 for a in accepted]),
        confidence=conf or [],
    )
    return t


def test_tau_and_per_position_acceptance():
    tally = Tally()
    # three steps of 4 drafts: all accepted (5 tokens), 1 accepted (2), none accepted (1)
    tally.add(trace([4, 1, 0], [4, 4, 4]), Timing(0.5, 0.25, 0.25))
    s = tally.summary()
    assert s["tau"] == pytest.approx(8 / 3, abs=1e-4)
    # slot 0 reached 3 times, accepted twice; slot 1 reached twice, accepted once; slots 2, 3
    # reached once and accepted
    assert s["pos_accept"] == [pytest.approx(2 / 3, abs=1e-4), 0.5, 1.0, 1.0]
    assert s["draft_share"] == 0.5
    assert s["tok_s"] == pytest.approx(9 / 1.0)  # prefill's token + 8, over 1 s


def test_tau_counts_a_truncated_last_step_as_emitted():
    tally = Tally()
    tally.add(trace([3, 3], [3, 3], emitted=[4, 2]), Timing())  # EOS cut the last step at 2
    assert tally.tau == 3.0


def test_plain_decoding_has_tau_one_and_no_positions():
    tally = Tally()
    tally.add(trace([0, 0, 0], [0, 0, 0]), Timing(0.1, 0.0, 0.3))
    assert tally.summary()["tau"] == 1.0
    assert tally.summary()["pos_accept"] == []


def test_merge_equals_adding_everything_to_one():
    a, b, both = Tally(), Tally(), Tally()
    for t, target in ((trace([2, 0], [3, 3]), a), (trace([3, 1], [3, 2]), b)):
        target.add(t, Timing(1, 1, 1))
        both.add(t, Timing(1, 1, 1))
    a.merge(b)
    assert a.summary() == both.summary()


def test_calibration_per_slot_and_ece():
    cal = Calibration(bins=2)
    # step 1: slots 0, 1 accepted, slot 2 rejected; step 2: slot 0 rejected
    cal.add(trace([2, 0], [3, 3], conf=[[0.9, 0.8, 0.2], [0.7, 0.5, 0.5]]))
    s = cal.summary()
    assert [p["n"] for p in s["per_slot"]] == [2, 1, 1]
    assert s["per_slot"][0]["observed"] == 0.5
    assert s["per_slot"][0]["predicted"] == pytest.approx(0.8)
    # bin [0, .5): conf 0.2, rejected -> |0.2 - 0| ; bin [.5, 1]: 0.9, 0.8 accepted, 0.7 not
    high = abs((0.9 + 0.8 + 0.7) / 3 - 2 / 3)
    assert s["ece"] == pytest.approx((1 * 0.2 + 3 * high) / 4, abs=1e-4)


def test_distinct_n():
    assert distinct_n([1, 2, 3, 4]) == 1.0
    assert distinct_n([7, 7, 7, 7, 7]) == 0.25  # one distinct bigram of four
    assert distinct_n([5]) == 1.0


def test_select_prompts_keeps_order_and_caps():
    ps = [Prompt(f"{c}-{i}", c, user("x")) for c in ("qa", "writing") for i in range(3)]
    chosen = select_prompts(ps, 2)
    assert [p.id for p in chosen["qa"]] == ["qa-0", "qa-1"]
    assert len(select_prompts(ps, None)["writing"]) == 3


def test_goals_and_ngram_windows():
    mean = {"dspark": 2.4, "eagle3": 2.0, "ngram": 1.5, "none": 1.0}
    g = goals(mean, EvalGoals())
    assert g["dspark_over_eagle3"] == {"ratio": 1.2, "goal": 1.15, "met": True}
    assert g["dspark_over_ngram"]["met"] is True
    # The thresholds are evaluate.goals', not the code's.
    stricter = goals(mean, EvalGoals(dspark_over_eagle3=1.25))
    assert stricter["dspark_over_eagle3"] == {"ratio": 1.2, "goal": 1.25, "met": False}
    assert "dspark_over_ngram" not in goals({"dspark": 2.4, "eagle3": 2.0}, EvalGoals())
    with pytest.raises(ValueError, match="min above max"):
        NgramConfig(windows=[(4, 2)])


def test_report_names_the_seed_and_what_was_not_evaluated():
    summary = {"tau": 2.0, "pos_accept": [0.5], "tok_s": 10.0, "decode_tok_s": 11.0,
               "draft_share": 0.1, "distinct_2": 0.9, "tokens": 10, "verify_steps": 5}  # fmt: skip
    result = {
        "profile": "smoke",
        "categories": {"math_reasoning": {"dspark": summary}},
        "mean": {"dspark": 2.0},
        "overall": {"dspark": summary},
        "prompts": {"math_reasoning": 1},
        "lossless_mismatches": 0,
        "lossless_ties": 0,
        "lossless": {"checked": 1},
        "calibration": {},
    }
    md = report_markdown(result)
    assert "| math_reasoning | 2.00 | 1 |" in md
    assert "| math_reasoning | 6.42 | 2.0 |" in md
    assert "Not evaluated: HumanEval, qa" in md
