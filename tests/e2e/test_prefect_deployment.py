"""The used-by path: `prefect deployment run dspark/full` against a real local server.

Serves the deployment with `dspark serve`, triggers it, and checks that the run completed, that
every stage wrote what its consumers read, that DVC agrees (`dvc status` clean, `dvc repro` has
nothing to do), that MLflow holds one parent run with a child per stage (and `cached` children on
a rerun), and that cancelling a run stops its processes.

The chain runs once in the suite, here: each stage is `dvc repro --single-item`, so this is also
the `dvc repro` check. Where network namespaces can be made (root, iproute2) it runs on the
three-node topology of infra/netns-3node.yaml: producers in two inference namespaces stream to
the trainer in a third.
"""

import json
import os
import re
import time

import pytest
from mlflow.tracking import MlflowClient

from dspark.pipeline import STAGES
from dspark.procs import KILL_WAIT_S, SETTLE_S
from flows.serve import STOP_GRACE_S

from ..conftest import under_ci
from .conftest import BIN, processes_in, run, start_serve, stop, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def served(repo, prefect_server, tmp_path):
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = start_serve(repo, prefect_server, log)

    def ready():
        if proc.poll() is not None:
            raise RuntimeError(f"dspark serve exited: {(tmp_path / 'serve.log').read_text()}")
        return "started!" in (tmp_path / "serve.log").read_text()

    try:
        wait_for(ready, 120, "deployment dspark/full served", every=2)
        yield prefect_server
    finally:
        # SIGTERM, as a service manager sends it: flows.serve stops all it started in time.
        stop(proc, wait=STOP_GRACE_S + SETTLE_S + KILL_WAIT_S)
        log.close()
    assert processes_in(repo) == []


def trigger(repo, env, *args, timeout: float = 600):
    cmd = [str(BIN / "prefect"), "deployment", "run", "dspark/full", *args]
    return run(cmd, repo, env, timeout=timeout)


def runs(repo):
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dspark")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


# The copy's namespaces are its own: a user's live netns-3node (dspark-*, 10.77.0.0/24) must
# outlive the suite's teardown, and so must another suite's on this machine.
NETNS_TAG = f"dse{os.getpid() % 10000}"
NETNS_SUBNET = f"10.79.{os.getpid() % 250}"


def on_netns_spec(repo) -> str | None:
    """Point the copy's params at its netns spec, under names of its own; why not, when
    namespaces cannot be made (a failure under CI, which must be able to make them)."""
    from dspark.infra import netns

    why = netns.missing()
    if why:
        if under_ci():
            pytest.fail(f"network namespaces unavailable under CI: {why}", pytrace=False)
        print(f"the chain on the local spec: network namespaces unavailable ({why})")
        return why
    spec = repo / "infra" / "netns-3node.yaml"
    text = spec.read_text()
    for old, new, count in [
        ("netns: dspark-", f"netns: {NETNS_TAG}-", 3),
        ("bridge: dspark-br0", f"bridge: {NETNS_TAG}-br0", 1),
        ("address: 10.77.0.", f"address: {NETNS_SUBNET}.", 3),
    ]:
        assert text.count(old) == count, f"{spec.name}: expected {count} of {old!r}"
        text = text.replace(old, new)
    spec.write_text(text)
    params = repo / "params.yaml"
    text, n = re.subn(
        r"^  spec: null", "  spec: infra/netns-3node.yaml", params.read_text(), count=1, flags=re.M
    )
    assert n == 1, "params.yaml: provision.spec: null not found"
    params.write_text(text)
    return None


def check_stage_outputs(repo, on_netns: bool) -> None:
    """What each smoke stage wrote, as the next stage and the user read it."""
    from dspark.infra import netns

    if on_netns:
        plan = json.loads((repo / "artifacts" / "plan.json").read_text())["placement"]
        names = [p["netns"] for p in plan["inference_plane"]]
        assert names == [f"{NETNS_TAG}-infer-0", f"{NETNS_TAG}-infer-1"]
        assert plan["training_plane"][0]["address"] == f"{NETNS_SUBNET}.20"
        assert f"{NETNS_TAG}-train-0" not in netns.existing()
    metrics = json.loads((repo / "metrics" / "prepare.json").read_text())
    assert metrics["profile"] == "smoke" and metrics["num_samples"] == 8
    assert {"git_commit", "created_at"} <= metrics.keys()
    extract = json.loads((repo / "metrics" / "extract.json").read_text())
    assert extract["answered_here"] and extract["samples_received"] == 8  # one on-policy pass
    assert extract["response_tokens"] > 0 and extract["onpolicy_tok_s"] > 0
    train = json.loads((repo / "metrics" / "train.json").read_text())
    assert train["source"] == "shards" and train["steps"] > 0
    assert train["draft_vocab_coverage"] > 0.9  # counted on the answers the producers made
    assert {"dspark", "eagle3", "dflash", "goal"} <= train.keys()
    assert len(train["dspark"]["pos_accept"]) == 8 and train["dspark"]["curve"]
    export = json.loads((repo / "metrics" / "export.json").read_text())
    assert export["roundtrip_max_abs_diff"] == 0.0 and export["roundtrip_vocab_equal"]
    assert (repo / "artifacts" / "export" / "dspark" / "config.json").is_file()
    assert export["dflash"]["roundtrip_max_abs_diff"] == 0.0  # speculators' DFlash format
    assert (repo / "artifacts" / "export" / "dflash" / "config.json").is_file()
    ev = json.loads((repo / "metrics" / "eval.json").read_text())
    assert ev["lossless_mismatches"] == 0 and ev["lossless"]["checked"] > 0
    assert set(ev["mean"]) == {"dspark", "eagle3", "dflash", "ngram", "none"}
    assert ev["mean"]["none"] == 1.0
    assert ev["quality"]["identical_scores"] and "sampling" in ev
    assert (repo / "metrics" / "eval_report.md").is_file()
    assert (repo / "plots" / "eval.png").is_file()
    bench = json.loads((repo / "metrics" / "bench.json").read_text())
    cells = {(c["mode"], c["concurrency"], c["workload"]) for c in bench["cells"]}
    for mode in ("none", "ngram", "eagle3", "dspark_fixed", "dspark_adaptive"):
        assert {(mode, 1, "math_reasoning"), (mode, 2, "math_reasoning"), (mode, 2, "mix")} <= cells
    assert all(c["tok_s"] > 0 and c.get("errors", 0) == 0 for c in bench["cells"])
    assert {"predicted_speedup_c1", "crossover_concurrency", "goals"} <= bench.keys()
    # The served tau beside the evaluation's, per mode, for the workload and the mixed cell.
    served = {(r["mode"], r["category"]) for r in bench["served_vs_offline"]}
    assert {("dspark_fixed", "math_reasoning"), ("eagle3", "mix")} <= served
    assert (repo / "plots" / "bench.png").is_file()


def test_deployment_runs_the_chain_and_everything_agrees(repo, served, tmp_path):
    why = on_netns_spec(repo)
    try:
        # The whole smoke chain: 8-11 min on a loaded 2-core machine.
        res = trigger(repo, served, "--param", "profile=smoke", "--watch", timeout=1800)
    finally:
        if not why:
            run([str(BIN / "dspark"), "provision", "--teardown"], repo, served)
    assert res.returncode == 0 and "Completed" in res.stdout + res.stderr, res.stdout + res.stderr
    check_stage_outputs(repo, on_netns=not why)

    status = run([str(BIN / "dvc"), "status"], repo, served)
    assert "Data and pipelines are up to date" in status.stdout
    again = run([str(BIN / "dvc"), "repro"], repo, served)  # nothing runs: no namespaces needed
    assert again.returncode == 0 and "Running stage" not in again.stdout, again.stdout
    shown = run([str(BIN / "dvc"), "metrics", "show", "--json"], repo, served)
    assert shown.returncode == 0 and "num_samples" in shown.stdout
    # The held-out split decoded through the evaluation's decoder, on the stages' own outputs.
    out = tmp_path / "heldout_decode.json"
    cmd = [str(BIN / "python"), "-m", "evals.heldout_decode", "--profile", "smoke", "--out"]
    held = run([*cmd, str(out)], repo, served)
    assert held.returncode == 0, held.stdout + held.stderr
    decoded = json.loads(out.read_text())["drafts"]
    assert set(decoded) == {"dspark", "eagle3", "dflash"}
    assert all(d["all"]["trainer_tau_greedy"] is not None for d in decoded.values())
    # ... and from the stage's last checkpoint, rebuilt as the stage builds its drafts: the
    # finished run's checkpoint holds the weights its drafts folder does.
    held = run([*cmd, str(tmp_path / "ckpt.json"), "--checkpoint"], repo, served)
    assert held.returncode == 0, held.stdout + held.stderr
    assert json.loads((tmp_path / "ckpt.json").read_text())["drafts"] == decoded
    summary = json.loads((repo / "metrics" / "run.json").read_text())
    assert summary["profile"] == "smoke" and set(summary["stages"]) == {s.name for s in STAGES}
    assert summary["total_cpu_s"] > 0  # every stage ran here, so every one recorded its CPU

    client, all_runs = runs(repo)
    parents = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [c.data.tags["stage"] for c in children] == [s.name for s in STAGES]
    for child in children:
        tags = child.data.tags
        assert child.info.status == "FINISHED"
        assert tags["profile"] == "smoke" and tags["cached"] == "false"
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", tags["git_commit"])
        assert tags["prefect.flow_run_id"]
        assert any(k.startswith("dvc.dep.") for k in tags)
    prepare = next(c for c in children if c.data.tags["stage"] == "prepare")
    assert prepare.data.metrics["num_samples"] == 8
    assert prepare.data.params["prepare.num_samples"] == "8"
    # The drafts: one child run each under the train stage's run, side by side, and the
    # DSpark draft in the model registry.
    train = next(c for c in children if c.data.tags["stage"] == "train")
    drafts = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == train.info.run_id]
    assert {r.data.tags["draft"] for r in drafts} == {"dspark", "eagle3", "dflash"}
    for r in drafts:
        assert r.data.tags["stage"] == "train"
        assert {"tau_sim", "eval_tau_sim", "final.tau_sim", "final.wall_s"} <= r.data.metrics.keys()
        # held-out tau_sim per evaluation point, charted against tokens and training seconds
        history = client.get_metric_history(r.info.run_id, "eval_tau_sim")
        tokens = client.get_metric_history(r.info.run_id, "eval_tokens")
        assert len(history) >= 2 and [m.step for m in history] == [m.step for m in tokens]
        assert "eval_wall_s" in r.data.metrics
    # The evaluation: one child run per method under the evaluate stage's run.
    evaluate = next(c for c in children if c.data.tags["stage"] == "evaluate")
    methods = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == evaluate.info.run_id]
    assert {r.data.tags["draft"] for r in methods} == {
        "dspark",
        "eagle3",
        "dflash",
        "ngram",
        "none",
    }
    for r in methods:
        assert "final.tau" in r.data.metrics and "tau_math_reasoning" in r.data.metrics
    # The benchmark: one child run per serving mode, its figures per concurrency.
    bench = next(c for c in children if c.data.tags["stage"] == "benchmark")
    modes = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == bench.info.run_id]
    assert {r.data.tags["draft"] for r in modes} == {
        "none", "ngram", "eagle3", "dspark_fixed", "dspark_adaptive",
    }  # fmt: skip
    for r in modes:
        assert {"final.tok_s_c1", "final.tok_s_c2", "final.ttft_p50_ms_c1"} <= r.data.metrics.keys()
    # ... and the evaluate and benchmark reports, in Prefect's UI as markdown artifacts.
    artifacts = run([str(BIN / "prefect"), "artifact", "ls", "-o", "json"], repo, served)
    for key in ("evaluate-report", "benchmark-report"):
        assert key in artifacts.stdout, artifacts.stdout + artifacts.stderr
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    versions = client.search_model_versions("name='dspark-draft'")
    assert len(versions) == 1 and versions[0].tags["profile"] == "smoke"

    # A second run: DVC skips both stages, and MLflow still shows them, tagged cached.
    res = trigger(repo, served, "--param", "profile=smoke", "--watch")
    assert res.returncode == 0, res.stdout + res.stderr
    _, all_runs = runs(repo)
    parent2 = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags][-1]
    cached = [
        r.data.tags["cached"]
        for r in all_runs
        if r.data.tags.get("mlflow.parentRunId") == parent2.info.run_id
    ]
    assert cached == ["true"] * len(STAGES)
    # A skipped stage keeps the events of the run that made its metrics.
    assert (repo / "logs" / "events" / "train.jsonl").stat().st_size > 0


def test_cancelling_a_run_stops_its_processes(repo, served):
    # Enough work that the prepare stage is still running when we cancel.
    params = repo / "params.yaml"
    params.write_text(
        params.read_text().replace("      num_samples: 8\n", "      num_samples: 400\n", 1)
    )
    res = trigger(repo, served, "--param", "profile=smoke")
    assert res.returncode == 0, res.stdout + res.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", res.stdout + res.stderr).group(1)
    wait_for(
        lambda: any("dspark prepare" in p for p in processes_in(repo)),
        240,
        "the prepare stage to start",
        every=1,
    )
    cancel = run([str(BIN / "prefect"), "flow-run", "cancel", flow_run_id], repo, served)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    wait_for(
        lambda: not any("dspark prepare" in p or "dvc" in p for p in processes_in(repo)),
        90,
        "stage processes to exit",
        every=1,
    )

    def state():
        out = run([str(BIN / "prefect"), "flow-run", "inspect", flow_run_id], repo, served).stdout
        return "CANCELLED" in out.upper().replace("'", "") and "cancelled"

    assert wait_for(state, 60, "flow run state Cancelled")
    time.sleep(1)
