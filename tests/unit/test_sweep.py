"""The sweep flow's pieces that decide what runs and what is recorded: a point's settings, the
`dvc exp run -S` arguments that put them in the active profile's overlay, and the table that
merges the points of several invocations."""

import json

import pytest

from dspark.config import load_params
from dspark.errors import ConfigError
from dspark.train.cost import PointCost
from flows.sweep import (
    _cli_value,
    _done_rows,
    _write_table,
    check_equal_compute,
    dvc_sets,
    main,
    parse_point,
    parse_seeds,
    workspace_files,
)
from tests.conftest import ROOT


def test_a_point_splits_on_spaces_outside_brackets():
    point = parse_point("train.epochs=3  train.drafts=[dspark, eagle3] x.y=0.002")
    assert point == {"train.epochs": 3, "train.drafts": ["dspark", "eagle3"], "x.y": 0.002}
    with pytest.raises(ConfigError, match="no KEY=VALUE"):
        parse_point("   ")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_point("train.epochs")


def test_settings_go_into_the_active_profiles_overlay(tmp_path):
    """A key the overlay has is set; one it lacks is added (Hydra's `+`); both win over the
    sections, whatever the profile sets."""
    path = tmp_path / "params.yaml"
    path.write_text(
        "profile: full\ntrain: {epochs: 1}\nprofiles:\n  full:\n    train: {epochs: 2}\n"
    )
    sets = dvc_sets(
        path, {"train.epochs": 5, "train.dspark.max_anchors": 32, "t.l": [1, 2], "t.s": "null"}
    )
    assert sets == [
        "-S",
        "profiles.full.train.epochs=5",
        "-S",
        "+profiles.full.train.dspark.max_anchors=32",
        "-S",
        "+profiles.full.t.l=[1, 2]",
        "-S",
        '+profiles.full.t.s="null"',  # a string stays one
    ]


def test_a_point_that_sets_the_drafts_writes_the_lists_that_follow_them():
    """In a sweep the stage reads params.yaml as dvc wrote it, where the lists would not follow
    train.drafts as `--set` makes them: the point writes them as resolved."""
    sets = dvc_sets(ROOT / "params.yaml", {"train.drafts": ["dflash"]})
    written = dict(s.split("=", 1) for s in sets[1::2])
    profile = load_params(ROOT / "params.yaml").profile
    resolved = load_params(ROOT / "params.yaml", overrides=["train.drafts=[dflash]"])
    assert written[f"profiles.{profile}.train.drafts"] == '["dflash"]'
    for key, value in (
        ("evaluate.methods", resolved.evaluate.methods),
        ("evaluate.lm_eval.methods", resolved.evaluate.lm_eval.methods),
        ("benchmark.modes", resolved.benchmark.modes),
    ):
        full = next(k for k in written if k.lstrip("+") == f"profiles.{profile}.{key}")
        assert json.loads(written[full]) == value and "dspark" not in written[full]
    # A list the point sets itself is written as the point says.
    sets = dvc_sets(ROOT / "params.yaml", {"train.drafts": ["dspark"], "benchmark.modes": ["none"]})
    assert sets.count(f'profiles.{profile}.benchmark.modes=["none"]') == 1


def test_the_table_merges_invocations_and_ranks_by_the_metric(tmp_path):
    stem = tmp_path / "sweeps" / "recipe"
    _write_table(stem, [{"exp": "r-0", "a": 1, "tau": 1.05}], "tau", "default")
    rows = _write_table(
        stem, [{"exp": "r-1", "a": 2, "tau": 1.2}, {"exp": "r-0", "a": 1, "tau": 1.1}], "tau", "d"
    )
    assert [r["exp"] for r in rows] == ["r-1", "r-0"] and rows[1]["tau"] == 1.1  # replaced
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["points"] == rows and len(doc["commands"]) == 1  # the same command, once
    assert stem.with_suffix(".csv").read_text().splitlines()[0] == "exp,a,tau"


def test_the_sweep_puts_back_what_the_upstream_stages_rewrite(tmp_path):
    """A train point reruns provision, prepare and extract (the profile overlay it changes is
    theirs too), so their metrics go back with train's, params.yaml and dvc.lock."""
    for rel in ("params.yaml", "dvc.lock", "metrics/extract.json", "metrics/train.json",
                "plots/train_curves.csv", "metrics/unrelated.json"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    got = {p.relative_to(tmp_path).as_posix() for p in workspace_files(tmp_path)}
    assert got == {
        "params.yaml",
        "dvc.lock",
        "metrics/extract.json",
        "metrics/train.json",
        "plots/train_curves.csv",
    }


def test_seeds_and_equal_compute_are_checked_before_anything_runs():
    assert parse_seeds("0, 1,2") == (0, 1, 2) and parse_seeds("") == ()
    with pytest.raises(ConfigError, match="comma-separated integers"):
        parse_seeds("0,one")
    with pytest.raises(ConfigError, match="a seed twice"):
        parse_seeds("1,1")
    point = [{"train.dspark.feature_input": "first"}]
    check_equal_compute(1500, 4, "train", {}, point)
    for args, message in (
        ((0, 4, "train", {}, point), "at least 1 step"),
        ((1500, 1, "train", {}, point), "the first warms up"),
        ((1500, 4, "evaluate", {}, point), "train stage's, not evaluate's"),
        ((1500, 4, "train", {"train.max_steps": 9}, point), "leave it out"),
        ((1500, 4, "train", {}, [{"train.max_steps": 9}]), "leave it out"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_equal_compute(*args)


def test_the_cli_refuses_a_bad_study_in_one_line(capsys):
    assert (
        main(["--name", "s", "--point", "a=1", "--equal-compute", "10", "--stage", "export"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == "sweep: error: --equal-compute: step costs are the train stage's, not export's"


def test_a_continued_sweep_keeps_its_plan_and_the_points_it_ran(tmp_path, monkeypatch):
    """--resume gives every point the steps the first run measured (no timing again) and
    skips the points the table holds with the same settings; a plan for another sweep is
    refused."""
    import flows.sweep as sweep_flow

    timed = []

    def fake_costs(root, settings, steps, batches):
        timed.append(len(settings))
        return [{**s, "train.max_steps": steps * (i + 1)} for i, s in enumerate(settings)], [
            PointCost({"dspark": 1.0 / (i + 1)}, {"dspark": [1.0 / (i + 1)]})
            for i in range(len(settings))
        ]

    monkeypatch.setattr(sweep_flow, "_equal_compute", fake_costs)
    stem = tmp_path / "sweeps" / "slot0"
    stem.parent.mkdir()
    asked = [{"train.dspark.feature_input": "none"}, {"train.dspark.feature_input": "first"}]
    first, step_s = sweep_flow.plan_points(stem, tmp_path, "train", asked, 10, (0, 1), 4, False)
    assert [p["train.seed"] for p in first] == [0, 0, 1, 1] and step_s == [1.0, 0.5, 1.0, 0.5]
    assert [p["train.max_steps"] for p in first] == [10, 20, 10, 20] and timed == [2]
    plan = json.loads((stem.parent / "slot0.plan.json").read_text())
    assert plan["step_timed"][3] == {"dspark": [0.5]}  # the measure's every step, on record

    again, same_s = sweep_flow.plan_points(stem, tmp_path, "train", asked, 10, (0, 1), 4, True)
    assert (again, same_s, timed) == (first, step_s, [2])  # read back, not timed again

    ran = [{"exp": "slot0-0", **{k: _cli_value(v) for k, v in first[0].items()}, "tau": 1.2}]
    ran.append({"exp": "slot0-1", **{k: _cli_value(v) for k, v in first[0].items()}, "tau": 1})
    _write_table(stem, ran, "tau", "full")
    done = _done_rows(stem, "slot0", first, 0)
    assert set(done) == {"slot0-0"}  # slot0-1's row holds run 0's settings: not run 1's

    with pytest.raises(ConfigError, match="made for other points"):
        sweep_flow.plan_points(stem, tmp_path, "train", asked[:1], 10, (0, 1), 4, True)
    fresh, _ = sweep_flow.plan_points(stem, tmp_path, "train", asked[:1], 10, (0, 1), 4, False)
    assert len(fresh) == 2 and timed == [2, 1]  # without --resume: planned anew


def test_single_item_runs_the_stage_alone():
    from flows.sweep import exp_run_args

    sets = ["-S", "profiles.full.train.seed=1"]
    assert exp_run_args("train", "s-0", sets, False) == [
        "exp",
        "run",
        "train",
        "--name",
        "s-0",
        *sets,
    ]
    alone = exp_run_args("train", "s-0", sets, True)
    assert alone[:4] == ["exp", "run", "train", "--single-item"] and alone[-2:] == sets
