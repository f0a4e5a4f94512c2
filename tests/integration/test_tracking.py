"""MLflow at the edge (tasks/tracking.py) against a sqlite store in tmp: the experiment opens as a
model-training experiment, and a pipeline's parent run carries the headline figures."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dspark.headline import headline, read_docs
from tasks.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    HEADLINE_VIEW,
    SHARED_VIEW_TAG,
    UI_QUERY,
    Tracker,
)


def metrics_folder(folder: Path, profile: str, tau: float, wall_s: float) -> Path:
    """A pipeline's metrics files as its stages write them (the fields dspark.headline reads),
    stamped for `profile` by a run at commit `<profile>-commit`."""
    stamp = {"profile": profile, "git_commit": f"{profile}-commit"}
    docs = {
        "eval.json": {
            "mean": {"dspark": tau, "eagle3": 1.9, "none": 1.0},
            "lossless": {"mismatches": 0},
        },
        "bench.json": {
            "overall": {"none": {"speedup_c1": 1.0}, "dspark_adaptive": {"speedup_c1": 0.97}}
        },
        "train.json": {"dspark": {"tau_sim": round(tau + 0.1, 3), "tau_greedy": tau}},
        "run.json": {
            "stages": {"train": {"wall_s": wall_s, "cached": False}},
            "total_wall_s": wall_s,
        },
    }
    folder.mkdir(parents=True)
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps({**stamp, **doc}))
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module: creating one costs ~7 s of migrations."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


def test_the_experiment_is_a_model_training_one_new_or_old(store, smoke_params, tmp_path):
    tracker = Tracker(smoke_params, tmp_path)
    client = MlflowClient(store)
    exp = client.get_experiment(tracker.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"

    client.delete_experiment_tag(tracker.experiment_id, EXPERIMENT_KIND_TAG)  # made before
    assert Tracker(smoke_params, tmp_path).experiment_id == tracker.experiment_id
    exp = client.get_experiment(tracker.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_two_parent_runs_compare_on_their_headline_figures(store, smoke_params, tmp_path):
    tracker = Tracker(smoke_params, tmp_path)
    folders = {
        "metrics": metrics_folder(tmp_path / "metrics", "default", 1.03, 547.0),
        "metrics/full": metrics_folder(tmp_path / "metrics/full", "full", 1.36, 19803.0),
    }
    ids = {}
    for name, folder in folders.items():
        run_id = tracker.start(f"dspark-{name}", tags={"pipeline": "full"})
        tracker.start("train", tags={"stage": "train"}, parent=run_id)
        logged = tracker.headline(run_id, folder)
        tracker.finish(run_id, True)
        ids[name] = run_id
        assert logged == headline(read_docs(folder))[0]

    client = MlflowClient(store)
    parents = client.search_runs(
        [tracker.experiment_id], filter_string="tags.pipeline = 'full'", order_by=["start_time"]
    )
    assert [r.info.run_id for r in parents] == [ids["metrics"], ids["metrics/full"]]
    default, full = (r.data for r in parents)
    assert default.metrics == {
        "tau_mean.dspark": 1.03, "tau_mean.eagle3": 1.9, "lossless_mismatches": 0.0,
        "speedup_c1.dspark_adaptive": 0.97, "tau_sim.dspark": 1.13, "tau_greedy.dspark": 1.03,
        "total_wall_s": 547.0,
    }  # fmt: skip
    assert full.metrics["tau_mean.dspark"] == 1.36 and full.metrics["total_wall_s"] == 19803.0
    assert (default.tags["profile"], full.tags["profile"]) == ("default", "full")
    # the commit the run summary names (run.json), not the one checked out now
    assert default.tags["git_commit"] == "default-commit"
    assert default.tags["cached_stages"] == "-"


def test_a_profile_skips_another_profiles_files(store, smoke_params, tmp_path):
    tracker = Tracker(smoke_params, tmp_path)
    run_id = tracker.start("dspark-smoke", tags={})
    folder = metrics_folder(tmp_path / "metrics", "default", 1.03, 547.0)
    assert tracker.headline(run_id, folder, profile="smoke") == {}
    assert MlflowClient(store).get_run(run_id).data.metrics == {}


def test_links_land_on_the_runs_table_with_the_headline_columns(
    store, smoke_params, tmp_path, monkeypatch
):
    tracker = Tracker(smoke_params, tmp_path)
    assert tracker.ui_url() is None  # a local store: no server to link to
    run_id = tracker.start("dspark-default", tags={})
    logged = tracker.headline(run_id, metrics_folder(tmp_path / "metrics", "default", 1.03, 547.0))
    assert logged
    view = MlflowClient(store).get_experiment(tracker.experiment_id).tags
    columns = json.loads(view[SHARED_VIEW_TAG + HEADLINE_VIEW])["selectedColumns"]
    assert columns == ["tags.`profile`", "tags.`git_commit`", *(f"metrics.`{k}`" for k in logged)]

    monkeypatch.setattr(
        type(tracker.client), "tracking_uri", property(lambda self: "http://127.0.0.1:5000/")
    )
    page = f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs"
    assert tracker.ui_url() == f"{page}{UI_QUERY}&viewStateShareKey={HEADLINE_VIEW}"
    assert tracker.ui_url(run_id) == f"{page}/{run_id}?workflowType=machine_learning"
