import json
import subprocess
import sys
import time
from dataclasses import replace

from dspark import pipeline
from dspark.codedeps import ROOT
from dspark.config import load_params
from dspark.metrics import EventLog, git_commit, read_events, write_metrics


def git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def test_dirty_means_code_or_config_not_pipeline_outputs(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "a.json").write_text("{}")
    (tmp_path / "params.yaml").write_text("a: 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "x")
    clean = git_commit(tmp_path)
    assert len(clean) == 40
    (tmp_path / "metrics" / "a.json").write_text('{"b": 2}')
    assert git_commit(tmp_path) == clean
    (tmp_path / "params.yaml").write_text("a: 2\n")
    assert git_commit(tmp_path) == clean + "-dirty"
    assert git_commit(tmp_path / "metrics").startswith(clean)  # any folder of the checkout
    assert git_commit(tmp_path / "no-such-folder") == "unknown"


def test_metrics_convention_and_event_log(tmp_path):
    doc = write_metrics(tmp_path / "m.json", "smoke", {"x": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == doc
    assert {"profile", "git_commit", "created_at", "x"} <= doc.keys()
    log = EventLog(tmp_path / "e.jsonl")
    log.log(0, loss=1.5)
    events, offset = read_events(tmp_path / "e.jsonl")
    log.log(1, loss=1.0)
    more, _ = read_events(tmp_path / "e.jsonl", offset)
    assert [e["metrics"]["loss"] for e in events + more] == [1.5, 1.0]


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_stage_records_its_cpu_time_and_its_childrens(tmp_path):
    """run_stage's cpu_s counts the stage's own CPU and that of the processes it waited for
    (producers, servers, ranks), which its wall time cannot tell apart from waiting."""
    child = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"

    def work(ctx):
        burn(0.2)
        subprocess.run([sys.executable, "-c", child], check=True)
        time.sleep(0.3)  # waiting: wall time, not CPU time
        return {}

    stage = replace(pipeline.get("export"), run=work)
    params = load_params(ROOT / "params.yaml", profile="smoke")
    doc = pipeline.run_stage(stage, pipeline.StageContext(params=params, root=tmp_path))
    assert 0.6 <= doc["cpu_s"] < doc["wall_s"] + 0.4  # the child's 0.4 s ran while we waited
    assert json.loads((tmp_path / stage.metrics).read_text())["cpu_s"] == doc["cpu_s"]


def test_the_run_summary_totals_cpu_only_when_every_stage_has_it(tmp_path):
    (tmp_path / "metrics").mkdir()
    for name, cpu in (("provision", 10.0), ("train", 300.5)):
        doc = {"profile": "full", "wall_s": 100.0, "cpu_s": cpu}
        (tmp_path / pipeline.get(name).metrics).write_text(json.dumps(doc))
    run = pipeline.write_run_summary(tmp_path, "full")
    assert run["total_cpu_s"] == 310.5 and run["stages"]["train"]["cpu_s"] == 300.5
    (tmp_path / pipeline.get("export").metrics).write_text('{"profile": "full", "wall_s": 1.0}')
    run = pipeline.write_run_summary(tmp_path, "full")  # a file from before cpu_s was recorded
    assert run["total_cpu_s"] is None and run["total_wall_s"] == 201.0


def test_the_run_summary_writes_the_headline_table_beside_it(tmp_path):
    (tmp_path / "metrics").mkdir()
    ev = {"profile": "full", "wall_s": 1.0, "mean": {"dspark": 1.5, "none": 1.0}}
    (tmp_path / pipeline.get("evaluate").metrics).write_text(json.dumps(ev))
    other = {"profile": "default", "wall_s": 1.0, "tok_s": 300.0}  # another profile's run
    (tmp_path / pipeline.get("extract").metrics).write_text(json.dumps(other))
    pipeline.write_run_summary(tmp_path, "full")
    folder = tmp_path / "metrics" / "headline"
    assert [p.name for p in folder.iterdir()] == ["tau.json"]
    assert json.loads((folder / "tau.json").read_text()) == {"dspark": 1.5}
