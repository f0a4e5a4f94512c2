"""The Prefect stage task's bookkeeping (tasks/repro.py), with DVC and MLflow replaced by
recorders: what the stage's events and metrics become in its run and its drafts' child runs,
and which events file survives a run that ran, one DVC found unchanged, and one that failed."""

import json
import logging

import pytest

import tasks.repro as repro_task
from dspark import pipeline
from tasks.repro import StageRecord, repro


class Recorder:
    """A Tracker that keeps what it is told."""

    def __init__(self):
        self.runs: dict[str, dict] = {}

    def start(self, name, tags, parent=None):
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = {"name": name, "parent": parent, "metrics": [], "status": None}
        return run_id

    def params(self, run_id, values):
        self.runs[run_id]["params"] = values

    def metrics(self, run_id, values, step=None, timestamp_ms=None):
        self.runs[run_id]["metrics"].append((step, values))

    def tags(self, run_id, values):
        self.runs[run_id]["tags"] = values

    def artifact(self, run_id, path, folder=None):
        pass

    def finish(self, run_id, ok):
        self.runs[run_id]["status"] = ok

    def named(self, name):
        return next(r for r in self.runs.values() if r["name"] == name)


def write_events(path, *events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_events_reach_the_stage_run_and_each_drafts_child(tmp_path):
    stage = pipeline.get("train")
    tracker = Recorder()
    record = StageRecord(tracker, stage, "smoke", tmp_path, parent="flow")
    events = tmp_path / stage.events
    write_events(events, {"time": 1.0, "step": 3, "metrics": {"dspark/loss": 2.5, "tokens": 9}})
    record.follow()
    write_events(events, {"time": 2.0, "step": 4, "metrics": {"eagle3/loss": 1.5}})
    record.follow()
    record.follow()  # nothing new: nothing logged twice
    record.outcome({"dspark": {"tau_sim": 1.3, "curve": [[0, 1]]}, "wall_s": 5.0}, cached=False)
    record.finish(ok=True)

    own = tracker.named("train")
    assert own["parent"] == "flow" and own["status"] is True
    assert own["metrics"][0] == (3, {"tokens": 9})
    dspark, eagle3 = tracker.named("dspark"), tracker.named("eagle3")
    assert dspark["parent"] == eagle3["parent"] == "run0"
    assert dspark["metrics"] == [(3, {"loss": 2.5}), (None, {"final": {"tau_sim": 1.3}})]
    assert eagle3["metrics"] == [(4, {"loss": 1.5})] and eagle3["status"] is True
    assert own["tags"]["cached"] == "false"


@pytest.mark.parametrize(
    "outcome, kept",
    [("ran", "this run's"), ("unchanged", "last run's"), ("never started", "last run's")],
)
def test_the_events_file_is_the_runs_own(tmp_path, monkeypatch, outcome, kept):
    stage = pipeline.get("train")
    events = tmp_path / stage.events
    write_events(events, {"step": 0, "who": "last run's"})

    def fake_dvc(args, root, **kwargs):
        assert args == ["repro", "--single-item", "train"] and not events.exists()  # set aside
        if outcome == "ran":
            write_events(events, {"step": 0, "who": "this run's"})
            kwargs["every"]()
        return (0 if outcome != "never started" else 1), ""

    monkeypatch.setattr(repro_task, "dvc", fake_dvc)
    seen = []
    follow = lambda: seen.append(events.read_text())  # noqa: E731
    repro(stage, tmp_path, logging.getLogger("test"), follow)
    assert json.loads(events.read_text())["who"] == kept
    assert not events.with_name(events.name + ".last").exists()
    assert len(seen) == (outcome == "ran")
