import json
import subprocess

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
