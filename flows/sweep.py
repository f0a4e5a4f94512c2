"""Flow `dspark-sweep`: tracked experiments over one stage, judged on its own held-out split.

    python -m flows.sweep --name recipe --stage train \\
        --point 'train.dspark.max_anchors=512' \\
        --point 'train.dspark.max_anchors=32 train.batch_size=8' \\
        [--set train.epochs=3] [--metric dspark.tau_decode] [--column eagle3.tau_decode] [--first N]

Each point is a DVC experiment (`dvc exp run STAGE -S ...`, named `<name>-<i>`; `dvc exp show`
lists them with their params and metrics) and an MLflow run, a child of the sweep's parent run,
with the point's settings as params and every number of the stage's metrics file. `--set`
applies to every point. The train stage's metric is tau_decode on its held-out samples (tokens per
verify step, walked as greedy decoding walks them), drawn from the training data, which the
prepare stage keeps disjoint from the evaluation prompts: a sweep never sees them. Sweeps before
2026-12-05 ranked by tau_sim, a per-position mean that overstates what decoding gets wherever
acceptance comes in stretches.

A study compares arms at equal compute and over seeds:

    python -m flows.sweep --name slot0 --equal-compute 1500 --seeds 0,1 \
        --point 'train.dspark.feature_input=none' --point 'train.dspark.feature_input=first'

`--equal-compute N` first measures every point's optimizer step side by side on the same
batches (dspark/train/cost.py; run it with nothing else on the machine), then gives the first
point N steps and every other point the steps the same compute buys it (`train.max_steps`);
the table keeps each point's step_s. `--seeds` runs every point once per `train.seed`, seed by seed.

A sweep that stops part way (a session ends) continues with the same command and `--resume`:
the points its table already holds with the same settings are kept, the rest run, and equal
compute reuses the step costs measured the first time (kept in `<name>.plan.json` beside the
table), so no point's budget depends on when it ran.

`--single-item` runs only the swept stage on the upstream outputs as they are (`dvc exp run -s`):
a study on one extraction stays on it even after the code it depends on moves on.

`dvc exp run -S` writes into params.yaml, so the file is restored after every point and points
never accumulate. The table, one row per point ranked by `--metric`, goes to
metrics/sweeps/<name>.csv (and .json, with the command that made it).
"""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow, get_run_logger

from dspark import pipeline
from dspark.config import load_params, parse_override
from dspark.errors import ConfigError
from dspark.io import atomic_path, write_text
from dspark.metrics import git_commit, write_metrics
from tasks.repro import dvc
from tasks.tracking import Tracker

if TYPE_CHECKING:
    from dspark.train.cost import PointCost

ROOT = Path(__file__).resolve().parents[1]
# The held-out figure that counts acceptance as the evaluation does (see the docstring).
DEFAULT_METRIC = "dspark.tau_decode"


def parse_point(text: str) -> dict[str, object]:
    """'a.b=1 c=[1, 2]' -> {'a.b': 1, 'c': [1, 2]}: settings split on spaces outside brackets."""
    out, depth, word = {}, 0, ""
    for ch in text.strip() + " ":
        depth += (ch in "[{") - (ch in "]}")
        if ch == " " and depth == 0:
            if word:
                parts, value = parse_override(word)
                out[".".join(parts)] = value
            word = ""
        else:
            word += ch
    if not out:
        raise ConfigError(f"--point {text!r}: no KEY=VALUE settings")
    return out


def _cli_value(value: object) -> str:
    """A value as a `-S` override reads it (strings quoted: Hydra would parse `null` or `1`)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value)


def dvc_sets(params_file: Path, point: dict[str, object]) -> list[str]:
    """`-S` arguments that set each key in the active profile's overlay, which wins over the
    sections (a key the file lacks is added: Hydra's `+`). A point that sets train.drafts also
    writes the lists that follow it (dspark.config.FOLLOWS_DRAFTS) as `--set` resolves them:
    the stage reads params.yaml as written, where they would not follow."""
    from dspark.config import FOLLOWS_DRAFTS, read_yaml

    tree = read_yaml(params_file)
    profile = tree.get("profile", "default")
    if "train.drafts" in point:
        resolved = load_params(params_file, overrides=overrides(point)).model_dump()
        for path in FOLLOWS_DRAFTS:
            key = ".".join(path)
            if key not in point:
                node = resolved
                for part in path:
                    node = node[part]
                point = {**point, key: node}
    out = []
    for key, value in point.items():
        path = ["profiles", profile, *key.split(".")]
        node, present = tree, True
        for part in path:
            if not isinstance(node, dict) or part not in node:
                present = False
                break
            node = node[part]
        out += ["-S", f"{'' if present else '+'}{'.'.join(path)}={_cli_value(value)}"]
    return out


def workspace_files(root: Path) -> list[Path]:
    """What a sweep puts back as it found it: params.yaml, dvc.lock, and the metrics and plots
    every stage writes uncached. A point may rerun stages upstream of the swept one too (those
    watching the overlay section it changes: prepare reads train's block size), and they
    rewrite theirs."""
    names = ["params.yaml", "dvc.lock"]
    for s in pipeline.STAGES:
        names += [s.metrics, *(p.path for p in s.plots)]
    return [root / n for n in dict.fromkeys(names) if (root / n).is_file()]


def _dig(doc: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            raise KeyError(f"the metrics file has no {dotted!r}")
        doc = doc[part]
    return doc


@flow(name="dspark-sweep", log_prints=True)
def sweep(
    name: str,
    points: list[dict[str, object]],
    stage: str = "train",
    fixed: dict[str, object] | None = None,
    metric: str = DEFAULT_METRIC,
    root: str = str(ROOT),
    first: int = 0,
    columns: tuple[str, ...] = (),
    equal_compute: int | None = None,
    seeds: tuple[int, ...] = (),
    cost_batches: int = 9,
    resume: bool = False,
    single_item: bool = False,
) -> list[dict]:
    logger = get_run_logger()
    root_path = Path(root)
    params_file = root_path / "params.yaml"
    spec = pipeline.get(stage)
    fixed = fixed or {}
    settings = [{**fixed, **p} for p in points]
    pipeline.check_profile_sections(params_file)
    for s in settings:  # every point validates before the first one runs
        load_params(params_file, overrides=overrides(s))
    stem = root_path / "metrics" / "sweeps" / name
    settings, step_s = plan_points(
        stem, root_path, stage, settings, equal_compute, seeds, cost_batches, resume
    )
    if equal_compute:
        for s, cost in zip(settings, step_s, strict=True):
            logger.info("%s: %.3f s a step -> %d steps", s, cost, s["train.max_steps"])
    done = _done_rows(stem, name, settings, first) if resume else {}
    params = load_params(params_file)
    tracker = Tracker(params, root_path)
    parent = tracker.start(
        f"sweep-{name}",
        tags={"sweep": name, "stage": stage, "git_commit": git_commit(root_path)},
    )
    tracker.params(parent, {f"fixed.{k}": v for k, v in fixed.items()})
    # `dvc exp run` leaves the last point's lock, outputs and metrics in the workspace: they
    # are put back afterwards (the outputs from DVC's cache), so a sweep changes nothing there.
    kept = {f: f.read_bytes() for f in workspace_files(root_path)}
    rows, ok = [], False
    try:
        for i, point in enumerate(settings, start=first):
            exp = f"{name}-{i}"
            if exp in done:
                logger.info("%s: done earlier (%s = %s), kept", exp, metric, done[exp].get(metric))
                continue
            t0 = time.perf_counter()
            doc = _exp_run(exp, point, spec, root_path, kept[params_file], single_item, logger)
            child = tracker.start(exp, parent=parent, tags={"sweep": name, "dvc.exp": exp})
            tracker.params(child, point)
            tracker.metrics(child, doc)
            tracker.finish(child, True)
            row = {"exp": exp, **{k: _cli_value(v) for k, v in point.items()}}
            if step_s[i - first] is not None:
                row["step_s"] = round(step_s[i - first], 4)
            row |= {key: _dig(doc, key) for key in (metric, *columns)}
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            logger.info("%s: %s = %s", exp, metric, row[metric])
            _write_table(stem, rows, metric, params.profile)  # a later failure keeps this row
        ok = True
    finally:
        tracker.finish(parent, ok)
        for path, data in kept.items():
            with atomic_path(path) as tmp:
                tmp.write_bytes(data)
        dvc(["checkout"], root_path)  # every stage's: a point may rerun those upstream
    return _write_table(stem, rows, metric, params.profile)


def _exp_run(
    exp: str,
    point: dict,
    spec: pipeline.Stage,
    root: Path,
    params_text: bytes,
    single_item: bool,
    logger,
) -> dict:
    """One point as the DVC experiment `exp` (replacing one of that name), and the metrics it
    wrote; params.yaml is put back as it was (`params_text`) so every point starts alike."""
    params_file = root / "params.yaml"
    sets = dvc_sets(params_file, point)
    logger.info("%s: %s", exp, " ".join(sets[1::2]))
    dvc(["exp", "remove", exp], root)  # a rerun of the sweep replaces its points
    try:
        rc, out = dvc(exp_run_args(spec.name, exp, sets, single_item), root)
    finally:
        write_text(params_file, params_text.decode())
    if rc != 0:
        raise RuntimeError(f"{exp}: dvc exp run failed ({rc}): {out.strip()[-2000:]}")
    return json.loads((root / spec.metrics).read_text())


def overrides(setting: dict[str, object]) -> list[str]:
    return [f"{k}={_cli_value(v)}" for k, v in setting.items()]


def _equal_compute(
    root: Path, settings: list[dict], baseline_steps: int, batches: int
) -> tuple[list[dict], list[PointCost]]:
    """Each setting with the `train.max_steps` that buys it the first one's compute at
    `baseline_steps`, and the measured step costs behind it."""
    from dspark.train.cost import equal_steps, measure_step_costs

    params_file = root / "params.yaml"
    points = [load_params(params_file, overrides=overrides(s)) for s in settings]
    costs = measure_step_costs(points, pipeline.train_paths(root), batches)
    steps = equal_steps(costs, baseline_steps)
    return [{**s, "train.max_steps": n} for s, n in zip(settings, steps, strict=True)], costs


def exp_run_args(stage: str, exp: str, sets: list[str], single_item: bool) -> list[str]:
    """`dvc exp run` for one point; `single_item` runs the stage alone on the outputs upstream
    as they are, even where upstream code has changed since they were made (a study on a fixed
    extraction: DVC would otherwise extract again, hours, before the first point)."""
    return ["exp", "run", stage, *(["--single-item"] if single_item else []), "--name", exp, *sets]


def plan_points(
    stem: Path,
    root: Path,
    stage: str,
    settings: list[dict],
    equal_compute: int | None,
    seeds: tuple[int, ...],
    cost_batches: int,
    resume: bool,
) -> tuple[list[dict], list[float | None]]:
    """Every run's settings (equal compute's steps and the seeds applied) and the measured
    seconds per step behind them. The plan is kept beside the table (`<name>.plan.json`), so a
    sweep stopped part way (a session ends) continues with `--resume` on the same steps,
    without timing again on a machine that may be busy by then."""
    asked = _json(
        {
            "stage": stage,
            "settings": settings,
            "equal_compute": equal_compute,
            "seeds": list(seeds),
            "cost_batches": cost_batches if equal_compute else None,
        }
    )
    plan = _read_plan(stem, asked) if resume else None
    if plan is None:
        step_s: list[float | None] = [None] * len(settings)
        timed: list[dict | None] = [None] * len(settings)
        if equal_compute:
            settings, costs = _equal_compute(root, settings, equal_compute, cost_batches)
            step_s, timed = [c.step_s for c in costs], [c.timed for c in costs]
        if seeds:
            # seed by seed, so a sweep stopped part way has run every point before any twice
            step_s = [c for _ in seeds for c in step_s]
            timed = [t for _ in seeds for t in timed]
            settings = [{**s, "train.seed": seed} for seed in seeds for s in settings]
        # step_timed: every timed step behind step_s (its median), per draft, so the spread
        # of the measure is on record beside the steps it decided
        plan = {"asked": asked, "settings": _json(settings), "step_s": step_s, "step_timed": timed}
        write_text(_plan_path(stem), json.dumps(plan, indent=1) + "\n")
    return plan["settings"], plan["step_s"]


def _json(value):
    """As it reads back from the plan file (tuples become lists)."""
    return json.loads(json.dumps(value))


def _plan_path(stem: Path) -> Path:
    return stem.with_name(stem.name + ".plan.json")


def _read_plan(stem: Path, asked: dict) -> dict | None:
    """The plan an earlier run of this sweep wrote; None when there is none, an error when it
    was made for another sweep."""
    path = _plan_path(stem)
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("asked") != asked:
        raise ConfigError(
            f"{path}: made for other points, settings, seeds or budget; "
            "rerun without --resume, or under another --name"
        )
    return plan


def _done_rows(stem: Path, name: str, settings: list[dict], first: int) -> dict[str, dict]:
    """Rows of the table whose point ran with exactly these settings: a continued sweep
    keeps them and runs the rest."""
    table = stem.with_suffix(".json")
    if not table.is_file():
        return {}
    rows = {r["exp"]: r for r in json.loads(table.read_text())["points"]}
    done = {}
    for i, point in enumerate(settings, start=first):
        row = rows.get(f"{name}-{i}")
        if row and all(row.get(k) == _cli_value(v) for k, v in point.items()):
            done[row["exp"]] = row
    return done


def _write_table(stem: Path, rows: list[dict], metric: str, profile: str) -> list[dict]:
    """Merge into the sweep's table (a point run again replaces its row), ranked by metric."""
    old = stem.with_suffix(".json")
    commands = ["python -m flows.sweep " + shlex.join(sys.argv[1:])]
    if old.is_file():
        before = json.loads(old.read_text())
        mine = {r["exp"] for r in rows}
        rows = [r for r in before["points"] if r["exp"] not in mine] + rows
        commands = [c for c in before.get("commands", []) if c != commands[0]] + commands
    rows.sort(key=lambda r: -float(r[metric]) if r[metric] is not None else float("inf"))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns)
    writer.writeheader()
    writer.writerows(rows)
    write_text(stem.with_suffix(".csv"), buf.getvalue())
    write_metrics(stem.with_suffix(".json"), profile, {"commands": commands, "points": rows})
    return rows


def parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: comma-separated integers") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed twice")
    return seeds


def check_equal_compute(steps: int, batches: int, stage: str, fixed: dict, points: list) -> None:
    if steps < 1:
        raise ConfigError(f"--equal-compute {steps}: at least 1 step")
    if batches < 2:
        raise ConfigError(f"--cost-batches {batches}: at least 2 (the first warms up)")
    if stage != "train":
        raise ConfigError(f"--equal-compute: step costs are the train stage's, not {stage}'s")
    if any("train.max_steps" in p for p in (fixed, *points)):
        raise ConfigError("--equal-compute sets train.max_steps: leave it out of --set/--point")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="tracked experiments over one stage")
    ap.add_argument("--name", required=True, help="the sweep's name: exps are <name>-<i>")
    ap.add_argument("--stage", default="train")
    ap.add_argument("--point", action="append", required=True, help="'KEY=VALUE KEY=VALUE ...'")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every point")
    ap.add_argument("--metric", default=DEFAULT_METRIC, help="dotted key of the metrics file")
    ap.add_argument("--first", type=int, default=0, help="number the points from here")
    ap.add_argument(
        "--column",
        action="append",
        default=[],
        help="another dotted key of the metrics file to tabulate (e.g. eagle3.tau_decode)",
    )
    ap.add_argument(
        "--equal-compute",
        type=int,
        default=None,
        metavar="STEPS",
        help="the first point's steps; every other point gets the steps its measured step cost "
        "buys with the same compute (sets train.max_steps)",
    )
    ap.add_argument(
        "--cost-batches", type=int, default=9, help="batches the step cost is timed on (median)"
    )
    ap.add_argument("--seeds", default="", help="comma-separated train.seed values per point")
    ap.add_argument(
        "--single-item",
        action="store_true",
        help="run the stage alone on the upstream outputs as they are (dvc exp run -s), even "
        "where upstream code changed since they were made",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue this sweep where it stopped: keep the points its table already has and "
        "the step costs it measured (refused if the points or settings differ)",
    )
    args = ap.parse_args(argv)
    try:
        points = [parse_point(p) for p in args.point]
        fixed = parse_point(" ".join(args.set)) if args.set else {}
        pipeline.get(args.stage)
        seeds = parse_seeds(args.seeds)
        if args.equal_compute is not None:
            check_equal_compute(args.equal_compute, args.cost_batches, args.stage, fixed, points)
    except (ConfigError, KeyError) as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    try:
        rows = sweep(
            args.name,
            points,
            args.stage,
            fixed,
            args.metric,
            first=args.first,
            columns=tuple(args.column),
            equal_compute=args.equal_compute,
            seeds=seeds,
            cost_batches=args.cost_batches,
            resume=args.resume,
            single_item=args.single_item,
        )
    except ConfigError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
