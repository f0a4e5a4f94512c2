"""Served tau beside offline tau: matched by method and category, the mixed cell pooled over
the nine, and a served tau outside the offline interval flagged."""

from dspark.serve.offline import served_vs_offline
from dspark.serve.report import served_lines


def cell(mode, c, workload, tau):
    return {"mode": mode, "concurrency": c, "workload": workload, "tau": tau}


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
    assert by["ngram", "math_reasoning"]["gap"] is True  # 1.2 served, 2.0 offline, no spread
    assert by["dspark_adaptive", "math_reasoning"]["expected"] == "adaptive verification"
    mix = by["dspark_fixed", "mix"]
    assert mix["offline_tau"] == round(11 / 4, 4)  # the nine pooled: (2 + 3 + 6) / (1 + 1 + 2)
    lines = "\n".join(served_lines(rows))
    assert "| ngram | math_reasoning | 1 | 1.2 | 2.0 [2.0, 2.0] | outside the interval |" in lines


def test_no_evaluation_no_rows():
    assert served_vs_offline([cell("dspark_fixed", 1, "qa", 2.0)], {}, "qa", None) == []
    assert served_lines([]) == []
