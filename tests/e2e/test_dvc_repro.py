"""`dvc repro` reproduces the smoke profile in a clean copy of the repo, then has nothing to do.

Where network namespaces can be made (root, iproute2) it runs on the three-node topology of
infra/netns-3node.yaml: producers in two inference namespaces stream to the trainer in a third.
"""

import json
import re

import pytest

from ..conftest import copy_repo, tool_env
from .conftest import BIN, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_dvc_repro_smoke(tmp_path):
    from dspark.infra import netns

    repo = copy_repo(tmp_path / "repo", profile="smoke")
    env = tool_env()
    why = netns.missing()
    if why:
        print(f"dvc repro on the local spec: network namespaces unavailable ({why})")
    else:
        params = repo / "params.yaml"
        text = re.sub(
            r"^  spec: null",
            "  spec: infra/netns-3node.yaml",
            params.read_text(),
            count=1,
            flags=re.M,
        )
        params.write_text(text)
    try:
        first = run([str(BIN / "dvc"), "repro"], repo, env, timeout=1200)
    finally:
        if not why:
            run([str(BIN / "dspark"), "provision", "--teardown"], repo, env)
    assert first.returncode == 0, first.stdout + first.stderr
    if not why:
        plan = json.loads((repo / "artifacts" / "plan.json").read_text())["placement"]
        assert [p["netns"] for p in plan["inference_plane"]] == ["dspark-infer-0", "dspark-infer-1"]
        assert plan["training_plane"][0]["address"] == "10.77.0.20"
        assert "dspark-train-0" not in netns.existing()
    assert "Running stage 'provision'" in first.stdout and "Running stage 'prepare'" in first.stdout
    status = run([str(BIN / "dvc"), "status"], repo, env)
    assert "Data and pipelines are up to date" in status.stdout
    again = run([str(BIN / "dvc"), "repro"], repo, env)  # nothing runs: no namespaces needed
    assert again.returncode == 0 and "Running stage" not in again.stdout
    metrics = json.loads((repo / "metrics" / "prepare.json").read_text())
    assert metrics["profile"] == "smoke" and metrics["num_samples"] == 8
    assert {"git_commit", "created_at"} <= metrics.keys()
    train = json.loads((repo / "metrics" / "train.json").read_text())
    assert train["source"] == "stream" and train["steps"] > 0
    assert {"dspark", "eagle3", "goal"} <= train.keys()
    assert len(train["dspark"]["pos_accept"]) == 8 and train["dspark"]["curve"]
    export = json.loads((repo / "metrics" / "export.json").read_text())
    assert export["roundtrip_max_abs_diff"] == 0.0 and export["roundtrip_vocab_equal"]
    assert (repo / "artifacts" / "export" / "dspark" / "config.json").is_file()
    ev = json.loads((repo / "metrics" / "eval.json").read_text())
    assert ev["lossless_mismatches"] == 0 and ev["lossless"]["checked"] > 0
    assert set(ev["mean"]) == {"dspark", "eagle3", "ngram", "none"} and ev["mean"]["none"] == 1.0
    assert ev["quality"]["identical_scores"] and "sampling" in ev
    assert (repo / "metrics" / "eval_report.md").is_file()
    assert (repo / "plots" / "eval.png").is_file()
    bench = json.loads((repo / "metrics" / "bench.json").read_text())
    cells = {(c["mode"], c["concurrency"], c["workload"]) for c in bench["cells"]}
    for mode in ("none", "ngram", "eagle3", "dspark_fixed", "dspark_adaptive"):
        assert {(mode, 1, "math_reasoning"), (mode, 2, "math_reasoning"), (mode, 2, "mix")} <= cells
    assert all(c["tok_s"] > 0 and c.get("errors", 0) == 0 for c in bench["cells"])
    assert {"predicted_speedup_c1", "crossover_concurrency", "goals"} <= bench.keys()
    assert (repo / "plots" / "bench.png").is_file()
    shown = run([str(BIN / "dvc"), "metrics", "show", "--json"], repo, env)
    assert shown.returncode == 0 and "num_samples" in shown.stdout
