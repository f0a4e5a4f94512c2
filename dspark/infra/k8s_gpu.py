"""The GPU planes as Kubernetes objects: the vLLM target instances and the trainer."""

from __future__ import annotations

import json

from dspark.infra.k8s_parts import (
    CONFIG_DIR,
    CONFIG_MAP,
    GIB,
    HOST_BYTES_PER_PROCESS,
    MODELS_CLAIM,
    MODELS_DIR,
    RAY_PORT,
    SHM_BYTES,
    VLLM_PORT,
    Ctx,
    claim,
    claim_volume,
    env,
    field_env,
    gib,
    gpu_pod,
    mooncake_env,
    on_nodes,
    service,
)

RAY_OBJECT_STORE_BYTES = 8 * GIB  # inside SHM_BYTES; vLLM moves tensors over NCCL, not Ray

# Pod 0 leads: a Ray head, then `vllm serve` (the container's args, "$@"), which waits up to
# 30 minutes for the other stages' GPUs to join. The other pods join the head and block; one
# that starts before the head's name resolves exits and is restarted.
STAGE_SCRIPT = f"""\
ray_args="--node-ip-address=${{POD_IP}} --num-gpus=${{STAGE_GPUS}} \
--object-store-memory={RAY_OBJECT_STORE_BYTES}"
if [ "${{POD_INDEX}}" = "0" ]; then
  ray start --head --port={RAY_PORT} ${{ray_args}}
  exec "$@"
fi
exec ray start --address="${{LEADER}}:{RAY_PORT}" ${{ray_args}} --block
"""


def vllm_args(c: Ctx, inst: dict) -> list[str]:
    """`vllm serve` for one instance, capturing the draft's layers into Mooncake.

    The speculative and KV-transfer configs are the ones infra/gpu/check.py runs on a GPU
    (vLLM 0.33, hs-connectors 0.9.0). Capture ids are vLLM's (id k: the output of layer k-1),
    the indexing the spec's aux_layers use, plus id L: the last layer."""
    t, net = c.spec.target, c.spec.network
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": sorted({*t.aux_layers, t.num_layers})}
        },
    }
    store = {  # hs-connectors' MooncakeStoreConfig
        "local_hostname": "$(POD_IP)",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": c.master,
        "global_segment_size": c.plan["stream"]["segment_bytes_per_inference_node"],
        "local_buffer_size": c.buffer_bytes,
        "protocol": net.protocol,
        "device_name": ",".join(net.rdma_devices),
        "num_writer_threads": 4,
    }
    kv_transfer = {
        "kv_connector": "MooncakeHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hs_connectors.mooncake_hidden_states_connector",
        "kv_connector_extra_config": {"mooncake": store},
    }
    tp, pp = inst["tensor_parallel"], inst["pipeline_parallel"]
    return [
        "vllm", "serve", f"{MODELS_DIR}/{t.name}",
        "--served-model-name", t.name,
        "--host", "0.0.0.0", "--port", str(VLLM_PORT),
        "--tensor-parallel-size", str(tp),
        "--pipeline-parallel-size", str(pp),
        # across nodes vLLM runs over a Ray cluster; inside one node, over processes
        "--distributed-executor-backend", "ray" if pp > 1 else "mp",
        "--gpu-memory-utilization", str(c.spec.inference.gpu_memory_utilization),
        "--max-model-len", str(c.plan["longest_sample_tokens"]),
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(kv_transfer),
        "--no-enable-prefix-caching",  # a cached prefix would skip its tokens' hidden states
    ]  # fmt: skip


def vllm_instance(c: Ctx, inst: dict) -> list[dict]:
    """One target instance: a StatefulSet with a pod per pipeline stage, its headless Service
    (the stages find each other by name) and a Service for the leader's OpenAI API."""
    name = f"vllm-{inst['instance']}"
    stages, tp = inst["stages"], inst["tensor_parallel"]
    multi = len(stages) > 1
    segment = c.plan["stream"]["segment_bytes_per_inference_node"]
    # the plan's layer split, which vLLM would otherwise choose itself
    partition = ",".join(str(s["layers"][1] - s["layers"][0] + 1) for s in stages)
    container = {
        "name": "vllm",
        "image": c.image,
        # with stages on other nodes, the script runs the args on the leader ("stage": its $0)
        **({"command": ["/bin/bash", "-ec", STAGE_SCRIPT, "stage"]} if multi else {}),
        "args": vllm_args(c, inst),
        "env": [
            *mooncake_env(c, segment),
            field_env("POD_INDEX", "metadata.labels['apps.kubernetes.io/pod-index']"),
            *env(
                LEADER=f"{name}-0.{c.dns(name)}",
                STAGE_GPUS=tp,
                VLLM_HOST_IP="$(POD_IP)",
                VLLM_PP_LAYER_PARTITION=partition,
                NCCL_DEBUG="WARN",
            ),
        ],
        "ports": [{"name": "http", "containerPort": VLLM_PORT}]
        + ([{"name": "ray", "containerPort": RAY_PORT}] if multi else []),
        # the planned Mooncake segment and buffer, the workers' own memory, shared memory
        "resources": {
            "requests": {
                "memory": gib(segment + c.buffer_bytes + tp * HOST_BYTES_PER_PROCESS + SHM_BYTES)
            }
        },
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
    }
    if c.rdma:  # the stages pass activations over the RDMA NICs
        container["env"] += env(NCCL_IB_HCA=",".join(c.spec.network.rdma_devices))
    pod = gpu_pod(c, container, tp, [claim_volume("models", MODELS_CLAIM)])
    one_per_node = {
        "labelSelector": {"matchLabels": c.labels(name)},
        "topologyKey": "kubernetes.io/hostname",
    }
    pod["affinity"] = {
        # the instance's nodes, a stage on each; identical nodes make any order equivalent
        "nodeAffinity": on_nodes([s["node"] for s in stages]),
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [one_per_node]},
    }
    annotations = {
        "dspark.io/plan-gpu-bytes": str(c.plan["inference"]["per_gpu"]["total_bytes"]),
        "dspark.io/plan-layers-per-stage": partition,
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": c.meta(name, name),
        "spec": {
            "serviceName": name,
            "replicas": len(stages),  # the stages of ONE instance, not replicas of it
            # the stages start together: the leader is not ready before the others join
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": c.labels(name)},
            "template": {
                "metadata": {"labels": c.labels(name), "annotations": annotations},
                "spec": pod,
            },
        },
    }
    ports = {"http": VLLM_PORT, **({"ray": RAY_PORT} if multi else {})}
    # not-ready pods get names too: the stages resolve each other while starting
    headless = service(c, name, name, ports, clusterIP="None", publishNotReadyAddresses=True)
    api = service(c, f"{name}-api", name, {"http": VLLM_PORT})
    api["spec"]["selector"]["apps.kubernetes.io/pod-index"] = "0"
    return [headless, api, stateful]


def trainer(c: Ctx) -> list[dict]:
    """The trainer Job: every rank on the training node, under torchrun (NCCL)."""
    world, node = c.spec.training.world_size, c.spec.training_nodes[0]
    tr, sample = c.plan["training"], c.plan["stream"]["sample_bytes"]
    command = [
        "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(world),
        "-m", "dspark", "train", "--params", f"{CONFIG_DIR}/params.yaml", "--no-progress",
    ]  # fmt: skip
    container = {
        "name": "trainer",
        "image": c.image,
        "command": command,
        "workingDir": "/work",  # outputs (drafts, checkpoints) land on the claim
        # a consumer contributes no segment to the store
        "env": mooncake_env(c, 0) + env(NCCL_DEBUG="WARN"),
        # per rank: its Mooncake buffer, the sample it holds, its own process
        "resources": {
            "requests": {
                "memory": gib(
                    world * (c.buffer_bytes + sample + HOST_BYTES_PER_PROCESS) + SHM_BYTES
                )
            }
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "work", "mountPath": "/work"},
        ],
    }
    if c.mlflow_uri:
        container["env"] += env(MLFLOW_TRACKING_URI=c.mlflow_uri)
    volumes = [
        {"name": "config", "configMap": {"name": CONFIG_MAP}},
        claim_volume("work", "trainer-work"),
    ]
    pod = gpu_pod(c, container, world, volumes)
    pod.update(restartPolicy="Never", nodeSelector={"kubernetes.io/hostname": node.name})
    annotations = {"dspark.io/plan-gpu-bytes": str(tr["per_gpu"]["total_bytes"])}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": c.meta("trainer", "trainer"),
        "spec": {
            "backoffLimit": 0,  # a failed run is looked at, not rerun blind
            "template": {
                "metadata": {"labels": c.labels("trainer"), "annotations": annotations},
                "spec": pod,
            },
        },
    }
    # two checkpoints of the whole draft state (the last and the one being written)
    checkpoint = tr["per_gpu"]["draft_state_bytes"]  # DDP: each rank holds it all; rank 0 writes
    return [claim(c, "trainer-work", "trainer", gib(max(100 * GIB, 2 * checkpoint))), job]
