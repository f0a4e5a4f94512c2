"""Served tau beside offline tau: matched by method and category, the mixed cell pooled over
the nine; a gap is judged only on the very prompts the cell served, to the same length."""

from dspark.serve.offline import served_vs_offline
from dspark.serve.report import served_lines


def cell(mode, c, workload, tau, served=()):
    return {
        "mode": mode,
        "concurrency": c,
        "workload": workload,
        "tau": tau,
        "prompt_ids": list(served),
    }


EVAL = {
    "categories": {
        # two prompts of tau 2 and 3: pooled 2.5, the interval [2, 3]
        "math_reasoning": {
            "dspark": {"outcomes": [[2, 1], [3, 1]]},
            "ngram": {"outcomes": [[4, 2], [4, 2]]},
        },
        "writing": {"dspark": {"outcomes": [[6, 2]]}},
    }
}


def test_served_is_set_beside_the_same_method_and_category():
    cells = [
        cell("none", 1, "math_reasoning", 1.0),
        cell("dspark_fixed", 1, "math_reasoning", 2.4),
        cell("dspark_fixed", 4, "math_reasoning", 9.9),  # only c=1 speaks for the workload
        cell("ngram", 1, "math_reasoning", 1.2),
        cell("dspark_adaptive", 1, "math_reasoning", 1.5),
        cell("dspark_fixed", 4, "mix", 2.6),
    ]
    rows = served_vs_offline(cells, EVAL, "math_reasoning", 4)
    by = {(r["mode"], r["category"]): r for r in rows}
    assert set(by) == {
        ("dspark_fixed", "math_reasoning"),
        ("ngram", "math_reasoning"),
        ("dspark_adaptive", "math_reasoning"),
        ("dspark_fixed", "mix"),
    }
    fixed = by["dspark_fixed", "math_reasoning"]
    assert (fixed["offline_tau"], fixed["offline_ci95"], fixed["gap"]) == (2.5, [2.0, 3.0], False)
    # No prompt ids or lengths to match: the category's figure is context, never a gap.
    assert by["ngram", "math_reasoning"]["gap"] is False
    assert by["ngram", "math_reasoning"]["like_for_like"] is False
    mix = by["dspark_fixed", "mix"]
    assert mix["offline_tau"] == round(11 / 4, 4)  # the nine pooled: (2 + 3 + 6) / (1 + 1 + 2)


def test_a_gap_is_judged_on_the_prompts_the_cell_served():
    """Prompt b alone has tau 3: a cell that served b twice at 2.98 matches it (within the
    tolerance), though it sits above the category's pooled 2.5; one at 2.5 on b differs. A cell
    served to another length than the evaluation decoded is context only."""
    doc = {
        **EVAL,
        "prompt_ids": {"math_reasoning": ["a", "b"], "writing": ["w"]},
        "max_new_tokens": {"math_reasoning": 64, "writing": 64},
    }
    cells = [
        cell("dspark_fixed", 1, "math_reasoning", 2.98, ["b", "b"]),
        cell("ngram", 1, "math_reasoning", 1.5, ["a", "b"]),
        cell("dspark_adaptive", 1, "math_reasoning", 2.5, ["b"]),
    ]
    by = {r["mode"]: r for r in served_vs_offline(cells, doc, "math_reasoning", None, 64)}
    assert by["dspark_fixed"]["offline_same_prompts"] == 3.0
    assert by["dspark_fixed"]["like_for_like"] and not by["dspark_fixed"]["gap"]
    assert by["ngram"]["offline_same_prompts"] == 2.0 and by["ngram"]["gap"]  # 1.5 vs 2.0
    assert by["dspark_adaptive"]["gap"] and by["dspark_adaptive"]["expected"]
    assert "expected" not in by["ngram"]  # verifying every draft, a gap is a defect
    # Planned by the cost model (its server said so), ngram too verifies fewer by design.
    planned = {**cells[1], "cost_model": True}
    (row,) = served_vs_offline([planned], doc, "math_reasoning", None, 64)
    assert row["gap"] and row["expected"] == "the cost model verifies fewer drafts"
    lines = "\n".join(served_lines(list(by.values())))
    assert "| ngram | math_reasoning | 1 | 1.5 | 2.0 | 2.0 [2.0, 2.0] | differs" in lines
    other = served_vs_offline(cells, doc, "math_reasoning", None, 128)
    assert not any(r["like_for_like"] or r["gap"] for r in other)
    unseen = served_vs_offline(
        [cell("ngram", 1, "math_reasoning", 1.5, ["z"])], doc, "math_reasoning", None, 64
    )
    assert unseen[0]["offline_same_prompts"] is None


def test_no_evaluation_no_rows():
    assert served_vs_offline([cell("dspark_fixed", 1, "qa", 2.0)], {}, "qa", None) == []
    assert served_lines([]) == []
