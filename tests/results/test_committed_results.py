"""The committed results (metrics/ and metrics/full/) hold together: their headline figures
(dspark.headline) and the summary `make run` prints come out of them whole. Checks of what is
committed, not of the code alone: `make check-results` runs them, apart from the unit tests, so
a unit test never fails because a figure changed (`make test` runs both)."""

import json
import shutil
from pathlib import Path

import pytest

from dspark.config import load_params
from dspark.headline import HEADLINE_DIR, headline, read_docs, summary, table
from tests.conftest import dvc_metrics_show

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["metrics", "metrics/full"])
def test_headline_of_the_committed_metrics(folder):
    docs = read_docs(ROOT / folder)
    assert set(docs) == {"train", "eval", "bench", "run", "extract"}
    metrics, tags = headline(docs)
    ev, bench, train, run = (docs[k] for k in ("eval", "bench", "train", "run"))
    methods = {k: v for k, v in ev["mean"].items() if k != "none"}
    assert {k: metrics[f"tau_mean.{k}"] for k in methods} == methods
    assert "tau_mean.none" not in metrics and "speedup_c1.none" not in metrics
    assert metrics["lossless_mismatches"] == ev["lossless"]["mismatches"]
    modes = [m for m in bench["overall"] if m != "none"]
    assert {f"speedup_c1.{m}": bench["overall"][m]["speedup_c1"] for m in modes} == {
        k: v for k, v in metrics.items() if k.startswith("speedup_c1.")
    }
    assert metrics["tau_sim.dspark"] == train["dspark"]["tau_sim"]
    assert metrics["tau_sim.eagle3"] == train["eagle3"]["tau_sim"]
    assert metrics["total_wall_s"] == run["total_wall_s"]
    assert "tau_mean.dspark" in metrics and "speedup_c1.dspark_adaptive" in metrics
    assert all(isinstance(v, float) for v in metrics.values())
    assert tags["profile"] == run["profile"] and tags["git_commit"] == run["git_commit"]


@pytest.mark.parametrize("folder", ["metrics", "metrics/full"])
def test_the_committed_headline_table_is_its_folders(folder):
    """metrics/headline/ and metrics/full/headline/ hold the table of the files beside them, as
    the run summary writes it (after copying a full run into metrics/full/, copy its headline/
    too, or write it: `dspark.headline.write_table(folder, read_docs(folder))`)."""
    docs = read_docs(ROOT / folder, json.loads((ROOT / folder / "run.json").read_text())["profile"])
    committed = {
        p.stem: json.loads(p.read_text()) for p in sorted((ROOT / folder / HEADLINE_DIR).iterdir())
    }
    assert committed == table(docs)


def test_the_committed_headline_tables_fit_a_terminal():
    """`dvc metrics show -R metrics/headline metrics/full/headline`, the README's command."""
    files = {
        p.relative_to(ROOT).as_posix(): json.loads(p.read_text())
        for folder in ("metrics", "metrics/full")
        for p in sorted((ROOT / folder / HEADLINE_DIR).glob("*.json"))
    }
    lines = dvc_metrics_show(files)
    assert len(lines) == 1 + len(files) and max(map(len, lines)) <= 100, "\n".join(lines)


def test_the_two_committed_profiles_differ_where_a_table_should_show_it():
    default, _ = headline(read_docs(ROOT / "metrics"))
    full, tags = headline(read_docs(ROOT / "metrics/full"))
    # Same columns in the runs table, except the full profile's third draft (DFlash), the modes
    # only the full profile serves, and what one profile's committed run recorded and the
    # other's code did not yet: greedy held-out tau.
    newer = {k for k in set(default) ^ set(full) if k.startswith("tau_greedy.")}
    assert set(default) - newer <= set(full)
    assert "total_cpu_s" in default and "total_cpu_s" in full
    served = {
        p: set(load_params(ROOT / "params.yaml", profile=p).benchmark.modes)
        for p in ("default", "full")
    }
    only_full = {k.rsplit(".", 1)[1] for k in set(full) - set(default) - newer}
    assert only_full <= {"dflash"} | (served["full"] - served["default"])
    assert default["total_wall_s"] != full["total_wall_s"]
    assert tags["profile"] == "full"


def test_missing_stale_and_cached_files(tmp_path):
    for name in ("eval.json", "run.json"):
        shutil.copy(ROOT / "metrics" / name, tmp_path / name)
    (tmp_path / "bench.json").write_text("{not json")
    train = json.loads((ROOT / "metrics/full/train.json").read_text())  # profile `full`
    (tmp_path / "train.json").write_text(json.dumps(train))
    run = json.loads((tmp_path / "run.json").read_text())
    for stage in run["stages"].values():  # whatever the committed run had cached
        stage["cached"] = False
    run["stages"]["train"]["cached"] = True
    (tmp_path / "run.json").write_text(json.dumps(run))

    metrics, tags = headline(read_docs(tmp_path, profile="default"))
    assert "tau_mean.dspark" in metrics and "total_wall_s" in metrics
    assert not any(k.startswith(("speedup_c1.", "tau_sim.")) for k in metrics)
    assert tags["cached_stages"] == "train"
    assert "tau_sim.dspark" in headline(read_docs(tmp_path))[0]  # no profile: any file counts
    assert headline({}) == ({}, {})


@pytest.mark.parametrize("folder", ["metrics", "metrics/full"])
def test_the_printed_summary_of_the_committed_metrics(folder):
    """What `make run` ends by printing: every method's tau with its interval, every pair, the
    held-out tau_sim, every mode's single-stream speedup, and where to look."""
    docs = read_docs(ROOT / folder)
    text = summary(docs, "mlflow server --backend-store-uri sqlite:///mlflow.db", "p", folder)
    ev, bench, train = docs["eval"], docs["bench"], docs["train"]
    for m, tau in ev["mean"].items():
        if m != "none":
            lo, hi = ev["mean_ci95"][m]
            assert f"{m} {tau:.2f} [{lo:.2f}, {hi:.2f}]" in text
    assert "none 1.00" not in text  # the plain target is the baseline, not a row
    for name, p in ev["pairs"].items():
        assert f"{name} {p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]" in text
    assert f"dspark {train['dspark']['tau_sim']:.3f}" in text
    for mode, row in bench["overall"].items():
        if mode != "none":
            assert f"{mode} {row['speedup_c1']:.2f}x" in text
    assert f"{docs['run']['total_wall_s']:.0f} s in all" in text
    assert "MLflow: mlflow server --backend-store-uri sqlite:///mlflow.db" in text
    assert f"{folder}/eval_report.md" in text


def test_a_summary_without_metrics_still_says_where_to_look():
    text = summary({}, "http://127.0.0.1:5000", "smoke")
    assert text.splitlines()[0] == "dspark smoke run"
    assert "tau" not in text and "MLflow: http://127.0.0.1:5000" in text


def test_cpu_time_is_a_headline_when_the_run_recorded_it():
    docs = read_docs(ROOT / "metrics")
    docs["run"] = {**docs["run"], "total_cpu_s": 1834.5}
    assert headline(docs)[0]["total_cpu_s"] == 1834.5
    assert f"{docs['run']['total_wall_s']:.0f} s in all (1,834 CPU-seconds):" in summary(
        docs, "http://127.0.0.1:5000", "default"
    )
    docs["run"]["total_cpu_s"] = None  # a stage's file from before cpu_s: no total, no claim
    assert "total_cpu_s" not in headline(docs)[0]
    assert "CPU-seconds" not in summary(docs, "http://127.0.0.1:5000", "default")


def test_greedy_held_out_tau_is_a_headline_when_the_run_measured_it():
    docs = read_docs(ROOT / "metrics")
    dspark = {k: v for k, v in docs["train"]["dspark"].items() if k != "tau_greedy"}
    docs["train"] = {**docs["train"], "dspark": dspark}
    assert "tau_greedy.dspark" not in headline(docs)[0]  # a run from before it: no claim
    docs["train"]["dspark"] = {**dspark, "tau_greedy": 1.0421}
    assert headline(docs)[0]["tau_greedy.dspark"] == 1.0421
    text = summary(docs, "http://127.0.0.1:5000", "default")
    assert "held-out greedy tau after training: dspark 1.042" in text
