"""The evaluation's accounting on hand-made traces: tau, per-position acceptance, calibration
and distinct-n; prompt selection; the report."""

import pytest

from dspark.config import EvalGoals, NgramConfig
from dspark.data.prompts import Prompt, user
from dspark.decode.decoder import RowTrace, Timing
from dspark.evaluate.report import report_markdown
from dspark.evaluate.stage import batches, goals, pairs, select_prompts
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


def test_select_prompts_draws_a_seeded_sample_in_order():
    ps = [Prompt(f"{c}-{i}", c, user("x")) for c in ("qa", "writing") for i in range(30)]
    chosen = select_prompts(ps, 4)
    ids = [p.id for p in chosen["qa"]]
    assert len(ids) == 4 and ids == sorted(ids, key=lambda i: int(i.split("-")[1]))
    assert ids != ["qa-0", "qa-1", "qa-2", "qa-3"]  # a draw, not the source's first four
    assert [p.id for p in select_prompts(ps, 4)["qa"]] == ids  # reproducible
    assert [p.id for p in select_prompts(ps, 4, seed=1)["qa"]] != ids  # and the seed matters
    assert len(select_prompts(ps, None)["writing"]) == 30
    assert len(select_prompts(ps, 40)["writing"]) == 30


def test_select_prompts_takes_its_own_count_for_the_long_cases():
    ps = [Prompt(f"{c}-{i}", c, user("x")) for c in ("qa", "long_context") for i in range(6)]
    chosen = select_prompts(ps, 4, 2)
    assert len(chosen["qa"]) == 4 and len(chosen["long_context"]) == 2


def test_goals_are_judged_on_the_paired_interval():
    pairs = {
        "dspark/eagle3": {"ratio": 1.2, "ci95": [1.16, 1.24]},
        "dspark/ngram": {"ratio": 1.6, "ci95": [1.3, 1.9]},
    }
    g = goals(pairs, EvalGoals())
    assert g["dspark_over_eagle3"] == {
        "ratio": 1.2, "ci95": [1.16, 1.24], "goal": 1.15, "verdict": "met", "met": True
    }  # fmt: skip
    # 1.6 clears 1.5, but the interval reaches down to 1.3: the prompts cannot tell.
    assert g["dspark_over_ngram"]["verdict"] == "straddles"
    assert g["dspark_over_ngram"]["met"] is False
    # The thresholds are evaluate.goals', not the code's.
    stricter = goals(pairs, EvalGoals(dspark_over_eagle3=1.25))
    assert stricter["dspark_over_eagle3"]["verdict"] == "missed"
    assert "dspark_over_ngram" not in goals({"dspark/eagle3": pairs["dspark/eagle3"]}, EvalGoals())
    with pytest.raises(ValueError, match="min above max"):
        NgramConfig(windows=[(4, 2)])


def test_pairs_cover_every_draft_pair_and_each_draft_over_ngram():
    one = {"qa": [(3, 1), (4, 2)]}
    got = pairs({"dspark": one, "eagle3": one, "ngram": one, "none": one})
    assert set(got) == {"dspark/eagle3", "dspark/ngram", "eagle3/ngram"}
    assert got["dspark/eagle3"] == {"ratio": 1.0, "ci95": [1.0, 1.0]}
    # The hybrid against both of its sources' own methods: its draft's and n-gram's.
    with_hybrid = pairs({"dspark": one, "eagle3": one, "ngram": one, "hybrid": one}, "eagle3")
    assert set(with_hybrid) - set(got) == {"hybrid/eagle3", "hybrid/ngram"}


def test_the_hybrids_goal_needs_both_sources_beaten():
    pairs = {
        "hybrid/dspark": {"ratio": 1.6, "ci95": [1.4, 1.8]},
        "hybrid/ngram": {"ratio": 1.3, "ci95": [1.2, 1.4]},
    }
    g = goals(pairs, EvalGoals(), "dspark")["hybrid_over_sources"]
    assert g == {
        "ratio": 1.3, "ci95": [1.2, 1.4], "goal": 1.25, "verdict": "straddles", "met": False
    }  # fmt: skip
    assert goals(pairs, EvalGoals(hybrid_over_sources=1.1), "dspark")["hybrid_over_sources"]["met"]
    missed = goals(pairs, EvalGoals(hybrid_over_sources=1.5), "dspark")["hybrid_over_sources"]
    assert missed["verdict"] == "missed"  # n-gram's interval falls short, whatever DSpark's does
    assert "hybrid_over_sources" not in goals(pairs, EvalGoals(), "eagle3")


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
    assert "| math_reasoning | 1 | 10 | 2.00 |" in md
    result["categories"]["math_reasoning"]["dspark"] = {**summary, "tau_ci95": [1.5, 2.5]}
    result["mean_ci95"] = {"dspark": [1.5, 2.5]}
    md = report_markdown(result)
    assert "| math_reasoning | 1 | 10 | 2.00 [1.50, 2.50] |" in md
    assert "| mean of the nine | | | **2.00 [1.50, 2.50]** |" in md
    assert "| math_reasoning | 6.42 | 2.0 |" in md
    assert "Not evaluated: HumanEval, qa" in md


def test_batches_share_a_cap_and_long_context_goes_alone():
    cats = ("qa", "writing", "long_context")
    ps = [Prompt(f"{c}-{i}", c, user("x")) for c in cats for i in range(3)]
    caps = {"qa": 16, "writing": 32, "long_context": 16}
    got = [[p.id for p in b] for b in batches(ps, 2, caps)]
    assert got == [
        ["qa-0", "qa-1"], ["qa-2"], ["writing-0", "writing-1"], ["writing-2"],
        ["long_context-0"], ["long_context-1"], ["long_context-2"],
    ]  # fmt: skip
    caps["writing"] = 16  # one cap: the nine's prompts share batches across categories
    assert [len(b) for b in batches(ps[:6], 4, caps)] == [4, 2]
    # With lengths, shortest first: a batch pads to its longest row.
    length = {p.id: 10 - i for i, p in enumerate(ps)}
    got = [[p.id for p in b] for b in batches(ps[:6], 4, caps, length)]
    assert got == [["writing-2", "writing-1", "writing-0", "qa-2"], ["qa-1", "qa-0"]]
