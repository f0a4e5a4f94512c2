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

ROOT = Path(__file__).resolve().parents[2]


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
    ids = {}
    for folder in ("metrics", "metrics/full"):
        run_id = tracker.start(f"dspark-{folder}", tags={"pipeline": "full"})
        tracker.start("train", tags={"stage": "train"}, parent=run_id)
        logged = tracker.headline(run_id, ROOT / folder)
        tracker.finish(run_id, True)
        ids[folder] = run_id
        assert logged == headline(read_docs(ROOT / folder))[0]

    client = MlflowClient(store)
    parents = client.search_runs(
        [tracker.experiment_id], filter_string="tags.pipeline = 'full'", order_by=["start_time"]
    )
    assert [r.info.run_id for r in parents] == [ids["metrics"], ids["metrics/full"]]
    default, full = (r.data for r in parents)
    for key in ("tau_mean.dspark", "tau_sim.dspark", "speedup_c1.dspark_adaptive", "total_wall_s"):
        assert key in default.metrics and key in full.metrics
    assert default.metrics["lossless_mismatches"] == 0.0
    assert full.metrics["total_wall_s"] != default.metrics["total_wall_s"]
    assert (default.tags["profile"], full.tags["profile"]) == ("default", "full")
    # the commit the run summary names (metrics/run.json), not the one checked out now
    run = json.loads((ROOT / "metrics/run.json").read_text())
    assert default.tags["git_commit"] == run["git_commit"]


def test_a_profile_skips_another_profiles_files(store, smoke_params, tmp_path):
    tracker = Tracker(smoke_params, tmp_path)
    run_id = tracker.start("dspark-smoke", tags={})
    assert tracker.headline(run_id, ROOT / "metrics", profile="smoke") == {}
    assert MlflowClient(store).get_run(run_id).data.metrics == {}


def test_links_land_on_the_runs_table_with_the_headline_columns(
    store, smoke_params, tmp_path, monkeypatch
):
    tracker = Tracker(smoke_params, tmp_path)
    assert tracker.ui_url() is None  # a local store: no server to link to
    run_id = tracker.start("dspark-default", tags={})
    logged = tracker.headline(run_id, ROOT / "metrics")
    view = MlflowClient(store).get_experiment(tracker.experiment_id).tags
    columns = json.loads(view[SHARED_VIEW_TAG + HEADLINE_VIEW])["selectedColumns"]
    assert columns == ["tags.`profile`", "tags.`git_commit`", *(f"metrics.`{k}`" for k in logged)]

    monkeypatch.setattr(
        type(tracker.client), "tracking_uri", property(lambda self: "http://127.0.0.1:5000/")
    )
    page = f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs"
    assert tracker.ui_url() == f"{page}{UI_QUERY}&viewStateShareKey={HEADLINE_VIEW}"
    assert tracker.ui_url(run_id) == f"{page}/{run_id}?workflowType=machine_learning"
