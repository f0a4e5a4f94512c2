"""Cluster specs: where a run's planes go, validated like params.yaml (unknown keys rejected).

    local     every process on this machine (the default)
    netns     network namespaces on this machine joined by a bridge: each node has its own
              interface and address, so the stream crosses real (virtual) links
    cluster   real nodes with GPUs (planned here, deployed by Kubernetes manifests)

A spec names its nodes and their roles; for a target that is not on this machine it also
carries the target's architecture with the source of every figure.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dspark.config import read_yaml
from dspark.errors import ConfigError

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0.0)]
GB = 10**9  # vendors quote memory in GB

# Kubernetes object names and Linux interface-friendly: lowercase, digits, '-'.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(Strict):
    name: str = Field(description="node name (lowercase letters, digits, '-')")
    role: Literal["inference", "training", "both"] = Field(description="the plane it hosts")
    gpus: NonNegInt = Field(0, description="accelerators on the node (0: CPU only)")
    gpu_model: str | None = Field(None, description="e.g. GB300")
    gpu_memory_gb: PosFloat | None = Field(None, description="memory of each accelerator, GB")
    host_memory_gb: PosFloat | None = Field(
        None, description="host memory, GB (default: this machine's, for local and netns)"
    )
    cpus: PosInt | None = Field(None, description="CPU cores (default: this machine's)")
    address: str | None = Field(None, description="the node's IPv4 address on the run's network")
    netns: str | None = Field(None, description="network namespace (kind netns)")

    @model_validator(mode="after")
    def _check(self) -> Node:
        if not NAME.match(self.name):
            raise ValueError(f"name: {self.name!r} is not lowercase letters, digits and '-'")
        if self.address is not None:
            try:
                ipaddress.IPv4Address(self.address)
            except ValueError:
                raise ValueError(f"address: {self.address!r} is not an IPv4 address") from None
        if self.gpus and self.gpu_memory_gb is None:
            raise ValueError("gpu_memory_gb: required when gpus > 0")
        return self

    @property
    def inference(self) -> bool:
        return self.role in ("inference", "both")

    @property
    def training(self) -> bool:
        return self.role in ("training", "both")


class Network(Strict):
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake's transport")
    rdma_devices: list[str] = Field([], description="RDMA NICs Mooncake uses (protocol rdma)")
    bridge: str = Field("dspark-br0", description="the bridge joining the namespaces (netns)")
    prefix_len: Annotated[int, Field(ge=8, le=30)] = Field(24, description="subnet prefix (netns)")

    @model_validator(mode="after")
    def _check(self) -> Network:
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ValueError("rdma_devices: name the NICs when protocol is rdma")
        if len(self.bridge) > 15:  # IFNAMSIZ
            raise ValueError(f"bridge: {self.bridge!r} is longer than 15 characters")
        return self


class TargetArch(Strict):
    """A target's figures for planning, when its weights are not on this machine."""

    name: str
    num_layers: PosInt
    hidden_size: PosInt
    vocab_size: PosInt
    aux_layers: list[NonNegInt] = Field(description="the layers the draft taps")
    weight_bytes: PosFloat = Field(description="the weights as served (quantized), bytes")
    kv_bytes_per_token: PosFloat = Field(description="KV cache per token, all layers, bytes")
    state_bytes_per_request: Annotated[float, Field(ge=0)] = Field(
        0, description="fixed per-request state (linear-attention layers), bytes"
    )
    kv_replicated_across_tp: bool = Field(
        False, description="each tensor-parallel rank holds the whole KV (latent attention)"
    )
    sources: dict[str, str] = Field(description="where each figure comes from")

    @model_validator(mode="after")
    def _check(self) -> TargetArch:
        bad = [a for a in self.aux_layers if a >= self.num_layers]
        if bad:
            raise ValueError(f"aux_layers: {bad} beyond the {self.num_layers} layers")
        figures = ("num_layers", "hidden_size", "vocab_size", "weight_bytes", "kv_bytes_per_token")
        missing = [f for f in figures if f not in self.sources]
        if missing:
            raise ValueError(f"sources: no source for {', '.join(missing)}")
        return self


class Inference(Strict):
    tensor_parallel: PosInt | None = Field(None, description="GPUs per stage (default: a node's)")
    pipeline_parallel: PosInt | None = Field(
        None, description="stages, one node each (default: the fewest that fit)"
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        0.9, description="share of each GPU vLLM may use (its --gpu-memory-utilization)"
    )
    max_sample_tokens: PosInt | None = Field(
        None, description="the longest sample (default: the run's prompt + response cap)"
    )
    sources: dict[str, str] = Field({}, description="where the figures come from")


class Training(Strict):
    world_size: PosInt = Field(1, description="trainer processes (one per GPU on GPU nodes)")
    draft_params: PosFloat | None = Field(None, description="draft parameters (for GPU plans)")
    bytes_per_param: PosFloat = Field(
        16, description="bf16 weights + fp32 master + Adam moments + bf16 grads"
    )
    sources: dict[str, str] = Field({}, description="where the figures come from")


class Services(Strict):
    mooncake_master: bool = Field(True, description="a standing Mooncake master for the run")
    mlflow_port: NonNegInt | None = Field(None, description="start an MLflow server (0: any port)")
    prefect_pool: str | None = Field(None, description="a Prefect process work pool and worker")


class ClusterSpec(Strict):
    name: str
    kind: Literal["local", "netns", "cluster"]
    description: str = ""
    nodes: list[Node] = Field(min_length=1)
    network: Network = Network()
    target: TargetArch | None = Field(None, description="default: the run's target")
    inference: Inference = Inference()
    training: Training = Training()
    services: Services = Services()

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"nodes: duplicate name {sorted(dup)[0]!r}")
        if not any(n.inference for n in self.nodes):
            raise ValueError("nodes: no node has role inference")
        if not any(n.training for n in self.nodes):
            raise ValueError("nodes: no node has role training")
        if self.kind == "netns":
            for i, n in enumerate(self.nodes):
                if not (n.netns and n.address):
                    raise ValueError(f"nodes.{i}: kind netns needs netns and address")
            addrs = [n.address for n in self.nodes]
            if len(set(addrs)) != len(addrs):
                raise ValueError("nodes: two nodes share an address")
            nets = {
                ipaddress.IPv4Interface(f"{a}/{self.network.prefix_len}").network for a in addrs
            }
            if len(nets) != 1:
                raise ValueError("nodes: the addresses are not on one subnet")
            gateway = str(next(next(iter(nets)).hosts()))
            if gateway in addrs:
                raise ValueError(f"nodes: {gateway} is the host's address on the subnet")
        if self.kind == "cluster":
            for i, n in enumerate(self.nodes):
                if not n.gpus:
                    raise ValueError(f"nodes.{i}.gpus: kind cluster plans GPU nodes")
                if n.host_memory_gb is None:
                    raise ValueError(f"nodes.{i}.host_memory_gb: required for kind cluster")
        return self

    @property
    def inference_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.inference]

    @property
    def training_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.training]


def load_spec(path: Path | str) -> ClusterSpec:
    """Read and validate a spec; every error is one line naming the file and the key."""
    path = Path(path)
    raw = read_yaml(path)
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe(e)}") from None


def describe(err: ValidationError) -> str:
    """The first error as `dotted.key: message`."""
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    if e["type"] == "value_error":  # our validators start their message with the field
        msg = e["msg"].removeprefix("Value error, ")
        return f"{key}.{msg}" if key else msg
    msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
    if e["type"] != "extra_forbidden" and "input" in e and not isinstance(e["input"], dict | list):
        msg = f"{msg} (got {e['input']!r})"
    return f"{key}: {msg}"


# What `provision.spec: null` means; infra/local.yaml spells out the same.
LOCAL = ClusterSpec(
    name="local",
    kind="local",
    description="producers, Mooncake master and trainer as processes on this machine, over "
    "loopback",
    nodes=[Node(name="local", role="both")],
)


def resolve(path: str | Path | None) -> ClusterSpec:
    return LOCAL if path is None else load_spec(path)
