"""The benchmark's rounds: merging a cell's rounds, and ratios taken within a round."""

from pathlib import Path

import pytest

from dspark.config import load_params
from dspark.serve.bench import assemble
from dspark.serve.measure import step_costs
from dspark.serve.report import goal_lines, table
from dspark.serve.rounds import merge_rounds, paired_ratio, rotated, round_max, spread

ROOT = Path(__file__).resolve().parents[2]


def _cell(mode, tok_s, c=1, steps=10, draft_ms=1.0, verify_ms=9.0, **more):
    return {
        "mode": mode,
        "concurrency": c,
        "workload": "math_reasoning",
        "requests": 2,
        "errors": 0,
        "tokens": 100,
        "wall_s": 1.5,
        "tok_s": tok_s,
        "ttft_p50_ms": 10.0 * tok_s,
        "itl_p50_ms": None,
        "tau": 1.0,
        "steps": steps,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "step_ms": draft_ms + verify_ms,
        "draft_share": draft_ms / (draft_ms + verify_ms),
        "cost_model": mode != "none",
        **more,
    }


def test_each_round_starts_at_the_next_mode():
    modes = ["a", "b", "c"]
    assert [rotated(modes, i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
    ]  # fmt: skip
    assert rotated([], 3) == []


def test_merged_cell_has_medians_sums_and_step_weighted_costs():
    rounds = [
        [_cell("none", 10.0), _cell("dspark", 20.0, steps=10, draft_ms=2.0, draft_steps=1)],
        [_cell("dspark", 30.0, steps=30, draft_ms=6.0, draft_steps=3), _cell("none", 12.0)],
        [_cell("none", 50.0), _cell("dspark", 25.0, steps=10, draft_ms=2.0, draft_steps=1)],
    ]
    none, dspark = merge_rounds(rounds)
    assert (none["mode"], dspark["mode"]) == ("none", "dspark")  # the first round's order
    assert none["tok_s"] == 12.0 and none["ttft_p50_ms"] == 120.0  # medians, not means
    assert none["tok_s_rounds"] == [10.0, 12.0, 50.0]  # round i at index i
    assert dspark["tok_s_rounds"] == [20.0, 30.0, 25.0]
    assert (none["requests"], none["tokens"], none["steps"], none["wall_s"]) == (6, 300, 30, 4.5)
    assert dspark["draft_ms"] == pytest.approx((20 + 180 + 20) / 50)  # over all 50 steps
    assert dspark["draft_steps"] == 5  # counted over the rounds, like steps
    assert dspark["step_ms"] == pytest.approx(13.4)
    assert dspark["draft_share"] == pytest.approx(4.4 / 13.4, abs=1e-4)  # of the merged step
    assert dspark["cost_model"] is True and none["cost_model"] is False  # a flag, not a median
    assert none["itl_p50_ms"] is None and none["mode"] == "none"


def test_one_round_changes_nothing_but_adds_its_series():
    cell = _cell("none", 10.0)
    (merged,) = merge_rounds([[cell]])
    assert merged == {**cell, "tok_s_rounds": [10.0]}


def test_ratios_pair_rounds():
    assert paired_ratio([98.0, 70.0, 97.0], [100.0, 100.0, 100.0]) == 0.97
    assert paired_ratio([10.0], [20.0]) == 0.5
    assert paired_ratio(None, [1.0]) is None
    assert round_max([1.0, 5.0], None, [3.0, 2.0]) == [3.0, 5.0]
    assert round_max(None) is None
    assert spread([90.0, 100.0, 110.0]) == 0.2
    assert spread([90.0]) is None


def test_a_burst_in_one_round_does_not_decide_the_adaptive_goal():
    params = load_params(
        ROOT / "params.yaml",
        overrides=[
            "benchmark.modes=[none, dspark_fixed, dspark_adaptive]",
            "benchmark.concurrency=[1]",
            "benchmark.mixed_concurrency=null",
            "benchmark.rounds=3",
        ],
    )
    # Round 2 ran adaptive through a neighbour's burst: 70 against 100. Its median throughput
    # (97) over none's median (100) is within the 5% noise, and so is the same-round ratio.
    rounds = [
        [_cell("none", 100.0), _cell("dspark_fixed", 50.0), _cell("dspark_adaptive", 98.0)],
        [_cell("dspark_fixed", 50.0), _cell("dspark_adaptive", 70.0), _cell("none", 101.0)],
        [_cell("dspark_adaptive", 97.0), _cell("none", 99.0), _cell("dspark_fixed", 50.0)],
    ]
    result = assemble(params, merge_rounds(rounds))
    goal = result["goals"]["adaptive_loses_nowhere"]
    (row,) = goal["cells"]
    assert row["ratio"] == 0.98  # the median of 98/100, 70/101 and 97/99
    assert row["met"] and goal["met"]
    assert row["none_spread"] == 0.02
    by_mode = {x["mode"]: x for x in result["cells"]}
    assert by_mode["dspark_fixed"]["speedup"] == 0.5
    assert result["crossover_concurrency"] == 1
    line = next(x for x in goal_lines(result["goals"]) if x.startswith("goal adaptive"))
    assert "met; worst dspark_adaptive 0.98x" in line and "none moved up to 2%" in line

    # A loss in every round is a loss.
    for group in rounds:
        for x in group:
            if x["mode"] == "dspark_adaptive":
                x["tok_s"] = 90.0
    goal = assemble(params, merge_rounds(rounds))["goals"]["adaptive_loses_nowhere"]
    assert not goal["met"] and goal["cells"][0]["ratio"] == pytest.approx(0.9, abs=0.01)


def test_the_choosing_modes_answer_to_every_other_mode_and_the_best_to_none():
    """dspark_adaptive and the hybrid are held to the best of every other mode of ours (ngram
    and each other included), at every concurrency; the best speculative mode's ratio over
    none is reported single stream and in the mixed cell."""
    params = load_params(
        ROOT / "params.yaml",
        overrides=[
            "benchmark.modes=[none, ngram, dspark_fixed, dspark_adaptive, hybrid, llamacpp]",
            "benchmark.concurrency=[1, 2]",
            "benchmark.mixed_concurrency=2",
        ],
    )

    def mix(mode, tok_s):
        return _cell(mode, tok_s, c=2, workload="mix")

    c1 = [
        _cell("none", 10.0),
        _cell("ngram", 13.0),
        _cell("dspark_fixed", 8.0),
        _cell("dspark_adaptive", 12.0),
        _cell("hybrid", 13.5),
        _cell("llamacpp", 30.0),
    ]
    c2 = [
        _cell(m, t, c=2)
        for m, t in (
            ("none", 16.0),
            ("ngram", 15.0),
            ("dspark_fixed", 17.0),
            ("dspark_adaptive", 17.0),
            ("hybrid", 16.9),
        )
    ]
    mixed = [
        mix("none", 10.0),
        mix("ngram", 16.0),
        mix("dspark_adaptive", 12.0),
        mix("hybrid", 15.0),
    ]
    cells = [x for group in (c1, c2, mixed) for x in merge_rounds([group])]  # one round each
    goals = assemble(params, cells)["goals"]
    rows = {(r["mode"], r["concurrency"]): r for r in goals["adaptive_loses_nowhere"]["cells"]}
    assert sorted(rows) == [
        ("dspark_adaptive", 1),
        ("dspark_adaptive", 2),
        ("hybrid", 1),
        ("hybrid", 2),
    ]
    # Adaptive at c=1 against the hybrid's 13.5 (the peer, llama.cpp, is not ours to beat here).
    assert rows["dspark_adaptive", 1]["best_other"] == 13.5
    assert rows["dspark_adaptive", 1]["ratio"] == 0.889 and not rows["dspark_adaptive", 1]["met"]
    assert (
        rows["hybrid", 1]["ratio"] == pytest.approx(13.5 / 13.0, abs=1e-3)
        and rows["hybrid", 1]["met"]
    )
    assert rows["hybrid", 2]["met"]  # 16.9 / 17.0: within the 5% noise
    assert not goals["adaptive_loses_nowhere"]["met"]
    assert goals["best_over_none_c1"] == {"mode": "hybrid", "ratio": 1.35, "goal": 1.3, "met": True}
    assert goals["best_over_none_mixed"] == {
        "mode": "ngram",
        "ratio": 1.6,
        "goal": 1.5,
        "met": True,
    }
    lines = goal_lines(goals)
    assert "NOT met at dspark_adaptive c=1" in next(x for x in lines if "every other mode" in x)
    assert "goal best mode >= 1.5x none at the mixed cell: ngram 1.6x (met)" in lines


@pytest.mark.parametrize(("goal", "met"), [(1.5, True), (3.0, False)])
def test_the_goal_thresholds_are_the_configs(goal, met):
    params = load_params(
        ROOT / "params.yaml",
        overrides=[
            "benchmark.modes=[none, dspark_fixed]",
            "benchmark.concurrency=[1]",
            "benchmark.mixed_concurrency=null",
            f"benchmark.goals.single_stream_speedup={goal}",
            "benchmark.goals.ttft_overhead=0.5",
        ],
    )
    # dspark_fixed: twice none's throughput, TTFT 10.0 x tok_s (+100%).
    cells = merge_rounds([[_cell("none", 10.0), _cell("dspark_fixed", 20.0)]])
    goals = assemble(params, cells)["goals"]
    assert goals["single_stream"]["goal"] == goal and goals["single_stream"]["met"] is met
    assert goals["ttft_overhead"]["goal"] == 0.5 and not goals["ttft_overhead"]["met"]
    lines = goal_lines(goals)
    assert any(x.startswith(f"goal single stream >= {goal}x") for x in lines)
    assert any(x.startswith("goal TTFT overhead <= 50%") for x in lines)


def test_a_cells_step_costs_count_the_steps_that_drafted():
    before = {"steps": 5, "draft_steps": 2, "draft_s": 0.1, "verify_s": 0.4}
    after = {"steps": 15, "draft_steps": 4, "draft_s": 0.3, "verify_s": 1.4}
    costs = step_costs(before, after)
    assert (costs["steps"], costs["draft_steps"]) == (10, 2)
    assert (costs["draft_ms"], costs["verify_ms"]) == (20.0, 100.0)
    assert step_costs(after, after)["draft_steps"] == 0


def test_a_cells_time_is_split_into_the_steps_parts_prefill_and_the_rest():
    """10 steps of 2 + 10 + 1 + 0.5 ms (13.5 ms a step), 20 ms of prefill, in a cell the client
    timed at 0.2 s: 200 - 135 - 20 = 45 ms were neither steps nor prefill (HTTP and the rest)."""
    zero = dict.fromkeys(("draft_s", "verify_s", "accept_s", "schedule_s", "step_s"), 0.0)
    before = {"steps": 0, "draft_steps": 0, "prefill_s": 0.0, **zero}
    after = {
        "steps": 10, "draft_steps": 10, "prefill_s": 0.02, "draft_s": 0.02, "verify_s": 0.1,
        "accept_s": 0.01, "schedule_s": 0.005, "step_s": 0.135,
    }  # fmt: skip
    costs = step_costs(before, after, wall_s=0.2)
    parts = [costs[k] for k in ("draft_ms", "verify_ms", "accept_ms", "schedule_ms")]
    assert parts == [2.0, 10.0, 1.0, 0.5] and costs["step_ms"] == 13.5 == sum(parts)
    assert (costs["prefill_ms"], costs["other_ms"]) == (2.0, 4.5)
    assert costs["draft_share"] == pytest.approx(2.0 / 13.5, abs=1e-4)
    assert step_costs(before, after)["other_ms"] is None  # no wall time: no remainder
    idle = step_costs(after, after, wall_s=0.2)
    assert idle["steps"] == 0 and idle["step_ms"] is None and idle["other_ms"] is None


def test_the_report_prints_each_cells_step_cost_split():
    params = load_params(
        ROOT / "params.yaml",
        overrides=["benchmark.modes=[none, ngram]", "benchmark.concurrency=[1]"],
    )
    cells = merge_rounds(
        [[_cell("none", 10.0), _cell("ngram", 12.0, draft_ms=0.5, accept_ms=0.25, other_ms=7.0)]]
    )
    result = assemble(params, cells)
    lines = table(result).splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("ms per engine step"))
    assert lines[head + 1].split() == [
        "mode", "c", "workload", "draft", "verify", "accept", "sched", "step", "prefill", "HTTP+",
    ]  # fmt: skip
    ngram = next(x for x in lines[head:] if x.split()[0] == "ngram").split()
    assert ngram == ["ngram", "1", "math_reasoning", "0.5", "9", "0.25", "-", "9.5", "-", "7"]
    end = next(i for i, x in enumerate(lines) if x.startswith("predicted"))
    assert end == head + 5 and max(len(x) for x in lines[head:end]) <= 100  # two cells
    # The prediction reads whole steps: tau 1 x none's 10 ms / ngram's 9.5 ms.
    assert result["predicted_speedup_c1_by_mode"]["ngram"] == pytest.approx(10 / 9.5, abs=1e-3)
