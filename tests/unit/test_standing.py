"""`dspark standing`: each stage of a checkout finished, part-way or not started, for a profile."""

import json

from dspark.cli import main
from dspark.codedeps import ROOT
from dspark.standing import standing


def put(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)


def checkout(root):
    """A long run stopped in extract: provision and prepare done, shards 2 of 3 on disk, an
    older extract's metrics and another profile's evaluation metrics left over."""
    put(root / "metrics/provision.json", {"profile": "full", "wall_s": 30.0, "git_commit": "c"})
    put(root / "metrics/prepare.json", {"profile": "full", "wall_s": 20.0, "cpu_s": 31.5})
    put(root / "artifacts/shards/manifest.json", {"num_samples": 3})
    samples = [
        {"sample_id": i, "tokens": 10, "response_tokens": 6, "shard": "hidden-00000.safetensors"}
        for i in range(2)
    ]
    attempts = [{"wall_s": 100.0, "samples": 1}, {"wall_s": 50.5, "samples": 1}]
    put(root / "artifacts/hidden/resume.json", {"samples": samples, "attempts": attempts})
    put(root / "metrics/extract.json", {"profile": "full", "wall_s": 5.0})  # a finished rerun's
    put(root / "metrics/eval.json", {"profile": "default", "wall_s": 9.0})


def test_a_run_stopped_in_extract(tmp_path):
    checkout(tmp_path)
    got = standing(tmp_path, "full")
    assert got["provision"] == {"state": "finished", "wall_s": 30.0, "git_commit": "c"}
    assert got["prepare"]["cpu_s"] == 31.5  # shown where the stage recorded it
    assert got["extract"] == {
        "state": "part-way",
        "samples": 2,
        "of": 3,
        "tokens": 20,
        "response_tokens": 12,
        "attempts": 2,
        "wall_s": 150.5,
    }
    assert {got[s]["state"] for s in ("train", "export", "evaluate", "benchmark")} == {
        "not started"
    }


def test_a_checkpoint_at_the_reported_step_is_a_finished_stage(tmp_path):
    state = {"step": 40, "epoch": 2, "tokens": 900, "loop_s": 12.34,
             "runs": {"dspark": {"last_eval": {"tau_sim": 1.5}}}}  # fmt: skip
    put(tmp_path / "artifacts/checkpoints/train/state.json", state)
    put(tmp_path / "metrics/train.json", {"profile": "full", "wall_s": 99.0, "steps": 40})
    assert standing(tmp_path, "full")["train"]["state"] == "finished"
    assert standing(tmp_path, "default")["train"]["state"] == "part-way"  # not this profile's
    put(tmp_path / "metrics/train.json", {"profile": "full", "wall_s": 99.0, "steps": 80})
    got = standing(tmp_path, "full")["train"]  # a longer rerun, stopped at its step 40
    assert got == {"state": "part-way", "step": 40, "epoch": 2, "tokens": 900, "wall_s": 12.3,
                   "tau_sim": {"dspark": 1.5}}  # fmt: skip


def test_the_command_prints_and_writes_json(tmp_path, capsys):
    checkout(tmp_path)
    params = (ROOT / "params.yaml").read_text().replace("profile: default", "profile: full", 1)
    put(tmp_path / "params.yaml", params)
    assert main(["standing", "--root", str(tmp_path), "--out", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "(profile full)" in out and "extract    part-way: samples 2, of 3" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["profile"] == "full" and doc["stages"]["prepare"]["state"] == "finished"


def test_a_finished_stage_shows_its_headline_figures(tmp_path):
    train = {"profile": "full", "wall_s": 99.0, "steps": 40, "tokens": 900,
             "dspark": {"tau_sim": 1.31, "curve": []}, "eagle3": {"tau_sim": 1.47},
             "goal": {"met": False}}  # fmt: skip
    put(tmp_path / "metrics/train.json", train)
    put(tmp_path / "metrics/eval.json", {"profile": "full", "mean": {"dspark": 1.4, "none": 1.0}})
    bench = {"profile": "full", "overall": {"none": {"speedup_c1": 1.0, "tok_s_c1": 20.0},
                                            "dspark_adaptive": {"speedup_c1": 1.2}}}  # fmt: skip
    put(tmp_path / "metrics/bench.json", bench)
    put(tmp_path / "artifacts/hidden/manifest.json", {})
    extract = {"profile": "full", "samples_received": 7, "tokens": 1500, "onpolicy_tok_s": 210.0}
    put(tmp_path / "metrics/extract.json", extract)  # 7: the last of a resumed run's attempts
    got = standing(tmp_path, "full")
    assert got["extract"] == {"state": "finished", "wall_s": None, "git_commit": None,
                              "tokens": 1500, "onpolicy_tok_s": 210.0}  # fmt: skip
    assert got["train"] == {"state": "finished", "wall_s": 99.0, "git_commit": None, "steps": 40,
                            "tokens": 900, "tau_sim": {"dspark": 1.31, "eagle3": 1.47}}  # fmt: skip
    assert got["evaluate"]["mean_tau"] == {"dspark": 1.4, "none": 1.0}
    assert got["benchmark"]["speedup_c1"] == {"none": 1.0, "dspark_adaptive": 1.2}


def test_greedy_and_decoded_tau_are_shown_where_the_run_measured_them(tmp_path):
    state = {"step": 40, "epoch": 2, "tokens": 900, "loop_s": 1.0,
             "runs": {"dspark": {"last_eval": {"tau_sim": 1.5, "tau_greedy": 1.4,
                                               "tau_decode": 1.3}},
                      "eagle3": {"last_eval": {"tau_sim": 1.6}}}}  # fmt: skip
    put(tmp_path / "artifacts/checkpoints/train/state.json", state)
    got = standing(tmp_path, "full")["train"]
    assert got["tau_greedy"] == {"dspark": 1.4} and got["tau_decode"] == {"dspark": 1.3}
    train = {"profile": "full", "steps": 80, "dspark": {"tau_sim": 1.31, "tau_greedy": 1.25}}
    put(tmp_path / "metrics/train.json", train)
    put(tmp_path / "artifacts/checkpoints/train/state.json", {**state, "step": 80})
    got = standing(tmp_path, "full")["train"]
    assert got["tau_greedy"] == {"dspark": 1.25} and "tau_decode" not in got  # older code
