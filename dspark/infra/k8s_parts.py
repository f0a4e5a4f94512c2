"""The pieces dspark's Kubernetes objects share: names, labels, env, volumes, GPU pods."""

from __future__ import annotations

import math

from dspark.config import Params
from dspark.infra.spec import ClusterSpec

CONFIG_MAP, CONFIG_DIR = "dspark-config", "/etc/dspark"
MODELS_DIR, MODELS_CLAIM = "/models", "dspark-models"
MASTER_RPC, MASTER_METRICS, MASTER_HTTP_METADATA = 50051, 9003, 8080  # mooncake_master defaults
VLLM_PORT, RAY_PORT, PREFECT_PORT, MLFLOW_PORT = 8000, 6379, 4200, 5000
# The resource the RDMA device plugin advertises (k8s-rdma-shared-dev-plugin's sample name);
# a cluster that names it otherwise edits this one line.
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GIB = 1024**3
# Assumptions, not planned figures: a CUDA torch process's own host memory, and the shared
# memory NCCL, vLLM's workers and Ray's object store use (/dev/shm is 64 MiB by default).
HOST_BYTES_PER_PROCESS = 8 * GIB
SHM_BYTES = 16 * GIB


class Ctx:
    """What every object needs: the inputs plus the addresses the planes meet at."""

    def __init__(self, spec: ClusterSpec, plan: dict, params: Params, image: str, ns: str):
        self.spec, self.plan, self.params, self.image, self.ns = spec, plan, params, image, ns
        self.master = f"{self.dns('mooncake-master')}:{MASTER_RPC}"
        self.rdma = spec.network.protocol == "rdma"
        self.buffer_bytes = params.extract.buffer_mb * 2**20
        self.mlflow_port = spec.services.mlflow_port or MLFLOW_PORT  # 0 ("any") means nothing here
        self.mlflow_uri = (
            f"http://{self.dns('mlflow')}:{self.mlflow_port}"
            if spec.services.mlflow_port is not None
            else None
        )

    def dns(self, service: str) -> str:
        return f"{service}.{self.ns}.svc.cluster.local"

    def meta(self, name: str, component: str) -> dict:
        return {"name": name, "namespace": self.ns, "labels": self.labels(component)}

    def labels(self, component: str) -> dict:
        return {
            "app.kubernetes.io/name": "dspark",
            "app.kubernetes.io/instance": self.spec.name,
            "app.kubernetes.io/component": component,
        }


def gib(nbytes: float) -> str:
    """A quantity in whole GiB, rounded up."""
    return f"{max(1, math.ceil(nbytes / GIB))}Gi"


def env(**values) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def service(c: Ctx, name: str, component: str, ports: dict[str, int], **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": c.meta(name, component),
        "spec": {
            "selector": c.labels(component),
            "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()],
            **spec,
        },
    }


def claim(c: Ctx, name: str, component: str, size: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": c.meta(name, component),
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def claim_volume(name: str, claim_name: str) -> dict:
    return {"name": name, "persistentVolumeClaim": {"claimName": claim_name}}


def deployment(c: Ctx, name: str, component: str, pod: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": c.meta(name, component),
        "spec": {
            "replicas": 1,
            # a single writer of its volume: the old pod goes before the new one comes
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": c.labels(component)},
            "template": {"metadata": {"labels": c.labels(component)}, "spec": pod},
        },
    }


def small_container(c: Ctx, name: str, command: list[str], **fields) -> dict:
    """A service's container: a core and 2 GiB are plenty for a master, MLflow or Prefect."""
    return {
        "name": name,
        "image": c.image,
        "command": command,
        **fields,
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
    }


def gpu_pod(c: Ctx, container: dict, gpus: int, volumes: list[dict]) -> dict:
    """A pod given GPUs and, for protocol rdma, the RDMA NICs on the host's network."""
    limits = {"nvidia.com/gpu": gpus, **({RDMA_RESOURCE: 1} if c.rdma else {})}
    container["resources"]["limits"] = limits  # no memory limit: the node is the pod's
    container["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
    shm = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": gib(SHM_BYTES)}}
    pod = {"containers": [container], "volumes": [*volumes, shm], "tolerations": [GPU_TOLERATION]}
    if c.rdma:
        # RDMA traffic leaves through the host's NICs; registering memory with them needs
        # IPC_LOCK. On the host network, cluster DNS needs ClusterFirstWithHostNet.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    return pod


def mooncake_env(c: Ctx, segment_bytes: int) -> list[dict]:
    """Mooncake's client settings, as mooncake/mooncake_config.py reads them. POD_IP comes
    first: Kubernetes expands $(POD_IP) only from variables defined before it."""
    net = c.spec.network
    return [
        field_env("POD_IP", "status.podIP"),
        *env(
            MOONCAKE_MASTER=c.master,
            MOONCAKE_PROTOCOL=net.protocol,
            MOONCAKE_DEVICE=",".join(net.rdma_devices),
            MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
            MOONCAKE_LOCAL_HOSTNAME="$(POD_IP)",
            MOONCAKE_GLOBAL_SEGMENT_SIZE=segment_bytes,
            MOONCAKE_LOCAL_BUFFER_SIZE=c.buffer_bytes,
            MC_LOG_LEVEL="WARNING",
        ),
    ]


def on_nodes(nodes: list[str]) -> dict:
    """Node affinity: any of these nodes (by their hostname label)."""
    match = {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}
    terms = [{"matchExpressions": [match]}]
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
