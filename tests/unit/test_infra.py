"""Cluster specs (validation, one-line errors) and the GPU plan against hand computations."""

import pytest
import yaml

from dspark.config import load_params
from dspark.errors import ConfigError, ResourceError
from dspark.infra.plan import plan_cpu, plan_gpu, producers, sample_bytes
from dspark.infra.spec import GB, LOCAL, load_spec

from ..conftest import ROOT

INFRA = ROOT / "infra"


@pytest.fixture(scope="module")
def params():
    return load_params(ROOT / "params.yaml", profile="default")


@pytest.mark.parametrize("name", ["local", "netns-3node", "k3-gb300"])
def test_committed_specs_load(name):
    spec = load_spec(INFRA / f"{name}.yaml")
    assert spec.name == name


def test_local_yaml_is_the_default():
    assert load_spec(INFRA / "local.yaml") == LOCAL


def _write(tmp_path, doc):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _netns():
    return yaml.safe_load((INFRA / "netns-3node.yaml").read_text())


def _k3():
    return yaml.safe_load((INFRA / "k3-gb300.yaml").read_text())


def _set(doc, dotted, value):
    *head, last = dotted.split(".")
    node = doc
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()


@pytest.mark.parametrize(
    ("base", "key", "value", "message"),
    [
        (_netns, "nodes.1.name", "infer-0", "nodes: duplicate name 'infer-0'"),
        (_netns, "nodes.0.address", None, "nodes.0: kind netns needs netns and address"),
        (_netns, "nodes.0.address", "10.77.0.300", "nodes.0.address: '10.77.0.300' is not an"),
        (_netns, "nodes.1.address", "10.99.0.11", "nodes: the addresses are not on one subnet"),
        (_netns, "nodes.0.address", "10.77.0.1", "10.77.0.1 is the host's address"),
        (_netns, "nodes.2.role", "inference", "nodes: no node has role training"),
        (_netns, "nodes.0.name", "Infer_0", "nodes.0.name: 'Infer_0' is not lowercase"),
        (_netns, "nodes.0.colour", "red", "nodes.0.colour: unknown key"),
        (_netns, "network.bridge", "a-very-long-bridge", "network.bridge: 'a-very-long-bridge'"),
        (_k3, "network.rdma_devices", [], "network.rdma_devices: name the NICs"),
        (_k3, "target.aux_layers", [7, 93], "target.aux_layers: [93] beyond the 93 layers"),
        (_k3, "target.sources.weight_bytes", DELETE, "target.sources: no source for weight_b"),
        (_k3, "nodes.0.gpus", 0, "nodes.0.gpus: kind cluster plans GPU nodes"),
        (_k3, "nodes.0.gpu_memory_gb", None, "nodes.0.gpu_memory_gb: required when gpus > 0"),
        (_k3, "inference.gpu_memory_utilization", 1.5, "inference.gpu_memory_utilization: Inp"),
        (_k3, "kind", "slurm", "kind: Input should be 'local', 'netns' or 'cluster'"),
    ],
)
def test_bad_specs_fail_with_one_line_naming_file_and_key(tmp_path, base, key, value, message):
    path = _write(tmp_path, _set(base(), key, value))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text, text
    assert "\n" not in text


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:.*malformed YAML"):
        load_spec(bad)


def test_k3_plan_matches_hand_computation(params):
    plan = plan_gpu(load_spec(INFRA / "k3-gb300.yaml"), params)
    inf = plan["inference"]
    # 1.4 TB of 4-bit weights over 4 GPUs is 350 GB a GPU: more than 288 GB x 0.9 = 259.2 GB,
    # so one node cannot hold an instance; two pipeline stages of TP4 hold 175 GB a GPU.
    assert inf["usable_per_gpu_bytes"] == 259.2e9
    assert inf["tried"][0]["pipeline_parallel"] == 1
    assert inf["tried"][0]["weights_bytes"] == 350e9
    assert inf["replicas"] == 1 and len(inf["instances"]) == 1
    (inst,) = inf["instances"]
    assert (inst["tensor_parallel"], inst["pipeline_parallel"]) == (4, 2)
    assert [s["node"] for s in inst["stages"]] == ["infer-0", "infer-1"]
    assert [s["layers"] for s in inst["stages"]] == [[0, 46], [47, 92]]
    # KV: 66,048 tokens x 93 layers x 576 values x 2 bytes, split over 2 stages, whole on
    # every TP rank (MLA's latent is shared by the heads).
    kv = 66048 * 93 * 576 * 2 / 2
    assert inf["per_gpu"]["kv_bytes"] == round(kv)
    assert inf["per_gpu"]["weights_bytes"] == 175e9
    # One 64K sample of 5 tapped layers + the last, hidden 7168, bf16: SpecForge's K3 recipe
    # quotes "roughly 5.25 GiB"; ours is the 66,048-token capture context.
    assert sample_bytes(65536, 5, 7168, "bfloat16") == 5.25 * 2**30
    one = 66048 * 6 * 7168 * 2
    assert plan["stream"]["sample_bytes"] == one
    assert plan["stream"]["segment_bytes_per_inference_node"] == round(8 * one / 2)
    # Trainer: 4.6e9 params x 16 bytes on every DDP rank + one sample + the bf16 lm_head.
    train = plan["training"]["per_gpu"]
    assert train["draft_state_bytes"] == 73.6e9
    assert train["total_bytes"] == round(73.6e9 + one + 163840 * 7168 * 2)
    assert all(c["ok"] for c in plan["checks"])


def test_draft_params_formula_in_the_k3_spec():
    layer = 7168 * 4096 + 2 * 7168 * 1024 + 4096 * 7168 + 3 * 7168 * 14336
    total = 5 * layer + 5 * 7168 * 7168 + 2 * 163840 * 7168 + 2 * 163840 * 256
    assert abs(total - load_spec(INFRA / "k3-gb300.yaml").training.draft_params) / total < 0.01


def test_smaller_gpus_need_more_stages_than_nodes_fail_the_check(tmp_path, params):
    doc = _k3()
    for node in doc["nodes"]:
        node["gpu_memory_gb"] = 80
    plan = plan_gpu(load_spec(_write(tmp_path, doc)), params)
    gpu = plan["checks"][0]
    assert gpu["name"] == "inference.gpu_memory" and not gpu["ok"]
    assert "no placement fits" in plan["inference"]["why"]


def test_impossible_parallelism_is_an_error(tmp_path, params):
    doc = _set(_k3(), "inference.tensor_parallel", 8)
    with pytest.raises(ResourceError, match="tensor_parallel: 8 exceeds the 4 GPUs"):
        plan_gpu(load_spec(_write(tmp_path, doc)), params)
    doc = _set(_k3(), "training.world_size", 8)
    with pytest.raises(ResourceError, match="world_size: 8 ranks but 4 training GPUs"):
        plan_gpu(load_spec(_write(tmp_path, doc)), params)


def test_cpu_placement_round_robins_producers_over_inference_nodes(params):
    spec = load_spec(INFRA / "netns-3node.yaml")
    slots = producers(spec, 3)
    assert [s.node for s in slots] == ["infer-0", "infer-1", "infer-0"]
    assert slots[1].command(["python"]) == ["ip", "netns", "exec", "dspark-infer-1", "python"]
    assert producers(LOCAL, 2)[0].command(["python"]) == ["python"]
    plan = plan_cpu(spec, params)
    assert plan["mooncake_master"] == {"node": "train-0", "address": "10.77.0.20"}


def test_gb_is_decimal():
    assert GB == 10**9


def test_plan_only_prints_the_k3_plan(capsys, monkeypatch):
    import json

    from dspark.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["provision", "--spec", "infra/k3-gb300.yaml", "--plan-only"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["inference"]["instances"][0]["pipeline_parallel"] == 2
    assert "TP4 x PP2: infer-0 GPUs 0-3 layers 0-46, infer-1 GPUs 0-3 layers 47-92" in out.err


def test_plan_only_exits_1_when_it_cannot_fit(tmp_path, capsys, monkeypatch):
    from dspark.cli import main

    doc = _k3()
    for node in doc["nodes"]:
        node["gpu_memory_gb"] = 80
    path = _write(tmp_path, doc)
    monkeypatch.chdir(ROOT)
    assert main(["provision", "--spec", str(path), "--plan-only"]) == 1
    assert "FAIL     inference.gpu_memory" in capsys.readouterr().err


def test_provisioning_a_gpu_cluster_here_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from dspark.cli import main

    monkeypatch.chdir(tmp_path)  # the stage writes logs/resolved/ first: not into the checkout
    argv = ["--params", str(ROOT / "params.yaml"), "--spec", str(INFRA / "k3-gb300.yaml")]
    assert main(["provision", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dspark: error: provision.spec: k3-gb300 is a GPU cluster")
    assert "\n" not in err
    assert (tmp_path / "logs" / "resolved" / "provision.json").is_file()
