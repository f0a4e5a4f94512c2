"""`dspark manifests`: every rendered object is valid against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: no unknown fields), and says what the plan says: ONE K3 instance
over both inference nodes (TP4 x PP2), 4 GPUs a pod, 4 trainer ranks, Mooncake over RDMA."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dspark.cli import main
from dspark.config import Params, load_params
from dspark.errors import ConfigError, ResourceError
from dspark.infra import k8s
from dspark.infra.k8s_parts import RDMA_RESOURCE
from dspark.infra.plan import plan_gpu
from dspark.infra.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
K3 = ROOT / "infra/k3-gb300.yaml"
# The oldest version with the StatefulSet pod-index label on by default (1.28 made it beta)
# that the package still ships a 1.3x schema for, and the newest it ships.
K8S_VERSIONS = ("1.30", "1.37")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "infra/gpu/check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def params() -> Params:
    return Params(profile="test")  # the schema's defaults: independent of params.yaml


@pytest.fixture(scope="module")
def spec() -> ClusterSpec:
    return load_spec(K3)


@pytest.fixture(scope="module")
def objs(spec, params) -> list[dict]:
    return k8s.manifests(spec, params)


def _one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _with(spec: ClusterSpec, **changes) -> ClusterSpec:
    """The spec with some sections replaced, validated again."""
    return ClusterSpec.model_validate({**spec.model_dump(), **changes})


# --- schema validity -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(objs, version):
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any error


def test_the_validator_is_strict(objs):
    """A negative control: an unknown field in a pod spec fails (so passing means something)."""
    bad = json.loads(json.dumps(_one(objs, "StatefulSet", "vllm-0")))
    bad["spec"]["template"]["spec"]["gpus"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_names_labels_and_ports_are_valid(objs):
    """What the schemas leave to the API server: DNS-1123 names, label values, port names."""
    for obj in objs:
        name, kind = obj["metadata"]["name"], obj["kind"]
        pattern = DNS_LABEL if kind in ("Namespace", "Service") else DNS_SUBDOMAIN
        assert pattern.match(name) and len(name) <= 63, f"{kind}/{name}"
        if kind != "Namespace":
            assert obj["metadata"]["namespace"] == "dspark"
        for value in obj["metadata"].get("labels", {}).values():
            assert LABEL_VALUE.match(value) and len(value) <= 63, value
        for port in obj["spec"].get("ports", []) if kind == "Service" else []:
            assert DNS_LABEL.match(port["name"]) and len(port["name"]) <= 15


def test_dollar_references_name_variables_defined_before(objs):
    """Kubernetes expands $(VAR) in command, args and env only from variables defined earlier
    in the container; anything else stays literal text, a silent bug."""
    for obj in objs:
        if "template" not in obj.get("spec", {}):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            defined: list[str] = []
            for e in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                    assert ref in defined, f"{c['name']}: env {e['name']} uses $({ref})"
                defined.append(e["name"])
            for text in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                    assert ref in defined, f"{c['name']}: $({ref}) is not defined"


# --- what the plan says --------------------------------------------------------------------------


def test_one_k3_instance_over_both_inference_nodes(objs):
    (vllm,) = [o for o in objs if o["kind"] == "StatefulSet"]  # ONE instance, not two
    assert vllm["spec"]["replicas"] == 2  # its two pipeline stages, a pod each
    assert vllm["spec"]["podManagementPolicy"] == "Parallel"
    pod = vllm["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["infer-0", "infer-1"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"  # a stage per node
    c = _container(vllm)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    args = c["args"]
    assert args[:3] == ["vllm", "serve", "/models/Kimi-K3"]
    assert _flag(args, "--tensor-parallel-size") == "4"
    assert _flag(args, "--pipeline-parallel-size") == "2"
    assert _flag(args, "--distributed-executor-backend") == "ray"
    assert _flag(args, "--max-model-len") == "66048"
    assert _env(c)["VLLM_PP_LAYER_PARTITION"] == "47,46"  # the plan's layer split
    script = c["command"][2]
    assert "ray start --head" in script and 'exec "$@"' in script and "--block" in script
    headless = _one(objs, "Service", "vllm-0")
    assert headless["spec"]["clusterIP"] == "None" and vllm["spec"]["serviceName"] == "vllm-0"
    api = _one(objs, "Service", "vllm-0-api")
    assert api["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"  # the leader only


def test_capture_configs_are_the_gpu_checked_ones(objs, spec):
    """The speculative and KV-transfer JSON are what infra/gpu/check.py runs on a GPU."""
    check = _load_check()
    args = _container(_one(objs, "StatefulSet", "vllm-0"))["args"]
    speculative = json.loads(_flag(args, "--speculative-config"))
    ids = [*spec.target.aux_layers, spec.target.num_layers]
    assert speculative == check.extract_speculative_config(ids)
    kv = json.loads(_flag(args, "--kv-transfer-config"))
    store = kv["kv_connector_extra_config"]["mooncake"]
    assert tuple(store) == check.MOONCAKE_STORE_FIELDS
    assert kv == check.kv_transfer_config(store)
    assert store["protocol"] == "rdma" and store["device_name"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    master = _one(objs, "Service", "mooncake-master")
    rpc = next(p["port"] for p in master["spec"]["ports"] if p["name"] == "rpc")
    assert store["master_server_address"] == f"mooncake-master.dspark.svc.cluster.local:{rpc}"
    assert "--no-enable-prefix-caching" in args


def test_trainer_runs_four_ranks_on_the_training_node(objs):
    job = _one(objs, "Job", "trainer")
    c = _container(job)
    cmd = c["command"]
    assert cmd[0] == "torchrun" and _flag(cmd, "--nproc-per-node") == "4"
    assert cmd[cmd.index("-m") + 1 : cmd.index("-m") + 3] == ["dspark", "train"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "train-0"}
    assert pod["restartPolicy"] == "Never"
    assert _env(c)["MLFLOW_TRACKING_URI"] == "http://mlflow.dspark.svc.cluster.local:5000"


def test_mooncake_over_rdma(objs):
    for kind, name in (("StatefulSet", "vllm-0"), ("Job", "trainer")):
        obj = _one(objs, kind, name)
        c, pod = _container(obj), obj["spec"]["template"]["spec"]
        env = _env(c)
        assert env["MOONCAKE_PROTOCOL"] == "rdma", name
        assert env["MOONCAKE_DEVICE"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
        assert env["MOONCAKE_MASTER"] == "mooncake-master.dspark.svc.cluster.local:50051"
        assert env["MOONCAKE_LOCAL_HOSTNAME"] == "$(POD_IP)"
        assert c["resources"]["limits"][RDMA_RESOURCE] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_memory_requests_come_from_the_plan(objs, spec, params):
    plan = plan_gpu(spec, params)
    segment = plan["stream"]["segment_bytes_per_inference_node"]
    vllm = _container(_one(objs, "StatefulSet", "vllm-0"))
    assert _env(vllm)["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == str(segment)
    gib = int(vllm["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert gib * 2**30 >= segment + params.extract.buffer_mb * 2**20
    trainer = _container(_one(objs, "Job", "trainer"))
    gib = int(trainer["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert gib * 2**30 >= 4 * plan["stream"]["sample_bytes"]
    master = _one(objs, "Deployment", "mooncake-master")
    ports = {p["name"]: p["containerPort"] for p in _container(master)["ports"]}
    assert ports == {"rpc": 50051, "metrics": 9003, "http-metadata": 8080}


def test_config_map_holds_loadable_params_and_spec(objs, spec, tmp_path):
    data = _one(objs, "ConfigMap", "dspark-config")["data"]
    (tmp_path / "params.yaml").write_text(data["params.yaml"])
    pod = load_params(tmp_path / "params.yaml")
    assert pod.train.world_size == pod.extract.consumers == 4
    assert pod.train.device == "cuda"  # the trainer node has GPUs: NCCL between its ranks
    assert pod.provision.spec == "/etc/dspark/spec.yaml"
    assert pod.target.model == "/models/Kimi-K3"
    (tmp_path / "spec.yaml").write_text(data["spec.yaml"])
    assert load_spec(tmp_path / "spec.yaml") == spec
    assert json.loads(data["plan.json"])["inference"]["replicas"] == 1


def test_services_follow_the_spec(objs, spec, params):
    worker = _container(_one(objs, "Deployment", "prefect-worker"))
    assert worker["command"] == ["dspark", "serve", "--pool", "dspark-k3"]
    assert _env(worker)["PREFECT_API_URL"].startswith("http://prefect-server.dspark.svc")
    mlflow = _container(_one(objs, "Deployment", "mlflow"))
    assert _flag(mlflow["command"], "--port") == "5000"
    bare = _with(spec, services={"mooncake_master": True})  # no MLflow, no Prefect
    kinds = {(o["kind"], o["metadata"]["name"]) for o in k8s.manifests(bare, params)}
    assert not any(n.startswith(("mlflow", "prefect")) for _, n in kinds)


def test_tcp_cluster_stays_on_the_pod_network(spec, params):
    objs = k8s.manifests(_with(spec, network={"protocol": "tcp"}), params)
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
    vllm = _one(objs, "StatefulSet", "vllm-0")
    assert "hostNetwork" not in vllm["spec"]["template"]["spec"]
    c = _container(vllm)
    assert RDMA_RESOURCE not in c["resources"]["limits"]
    assert _env(c)["MOONCAKE_PROTOCOL"] == "tcp" and "NCCL_IB_HCA" not in _env(c)


def test_replicas_when_one_node_holds_the_target(spec, params):
    """A target that fits one node: two instances (PP1 each), a StatefulSet per node."""
    small = _with(spec, target={**spec.target.model_dump(), "weight_bytes": 4e11})
    objs = k8s.manifests(small, params)
    sets = [o for o in objs if o["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sets] == ["vllm-0", "vllm-1"]
    for s, node in zip(sets, ("infer-0", "infer-1"), strict=True):
        assert s["spec"]["replicas"] == 1
        c = _container(s)
        assert "command" not in c and _flag(c["args"], "--distributed-executor-backend") == "mp"
        aff = s["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        terms = aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][0]["values"] == [node]
        kubernetes_validate.validate(s, K8S_VERSIONS[-1], strict=True)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["local", "netns-3node"])
def test_local_and_netns_have_no_manifests(name, params):
    with pytest.raises(ConfigError, match=r"kind: (local|netns) .* kind cluster"):
        k8s.manifests(load_spec(ROOT / f"infra/{name}.yaml"), params)


def test_a_plan_that_does_not_fit_is_refused(spec, params):
    one_stage = _with(spec, inference={**spec.inference.model_dump(), "pipeline_parallel": 1})
    with pytest.raises(ResourceError, match=r"inference\.gpu_memory: needs 357\.1 GB"):
        k8s.manifests(one_stage, params)


def test_more_ranks_than_the_batch_is_refused(spec):
    with pytest.raises(ConfigError, match=r"train\.world_size"):
        k8s.manifests(spec, Params(profile="test", train={"batch_size": 2}))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spec", "missing.yaml"], "missing.yaml: no such file"),
        (["--spec", str(ROOT / "infra/local.yaml")], "kind: local"),
        (["--spec", str(K3), "--namespace", "Bad_NS"], "--namespace: 'Bad_NS'"),
        (["--spec", str(K3), "--image", "a b"], "--image"),
        (["--spec", str(K3), "--check"], "--check"),
        (["--spec", "BAD"], "nodes.0.gpus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    raw = yaml.safe_load(K3.read_text())
    raw["nodes"][0]["gpus"] = 0
    bad.write_text(yaml.safe_dump(raw))
    argv = [str(bad) if a == "BAD" else a for a in argv]
    monkeypatch.chdir(ROOT)  # the default --params params.yaml
    assert main(["manifests", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dspark: error:") and message in err


# --- the CLI and the committed file --------------------------------------------------------------


def test_stdout_and_out_write_the_same_documents(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["manifests", "--spec", str(K3), "--namespace", "k3"]) == 0
    printed = capsys.readouterr().out
    assert main(["manifests", "--spec", str(K3), "--namespace", "k3", "--out", str(tmp_path)]) == 0
    written = (tmp_path / "k3-gb300.yaml").read_text()
    assert printed == written and written.startswith("# Generated by `dspark manifests`")
    docs = list(yaml.safe_load_all(written))
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "k3"}}
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary behind


def test_committed_k3_manifests_are_up_to_date(monkeypatch, capsys):
    """infra/k8s/k3-gb300.yaml is what the renderer makes of params.yaml now; regenerate it
    with `dspark manifests --spec infra/k3-gb300.yaml --out infra/k8s`."""
    monkeypatch.chdir(ROOT)
    code = main(["manifests", "--spec", "infra/k3-gb300.yaml", "--out", "infra/k8s", "--check"])
    assert code == 0, capsys.readouterr().err
