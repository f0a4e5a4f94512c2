"""Placement and memory: which node runs what, and whether it fits, before anything starts.

GPU clusters: one target instance is tensor parallel inside a node (NVLink) and pipeline
parallel across nodes, with the fewest stages whose per-GPU share (weights / (TP x PP), plus
its KV cache for the longest sample) fits vLLM's share of a GPU. The Mooncake segments
hold the hidden states of the samples in flight; every trainer rank holds the whole draft and
its optimizer state (DDP, as `dspark/train/distributed.py` trains).

CPU kinds (local, netns): each producer loads the whole target; producers go round-robin over
the inference nodes; the provision stage checks memory and disk against this machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.config import Params
from dspark.errors import ResourceError
from dspark.infra.spec import GB, ClusterSpec, Node, resolve
from dspark.schema import WIRE_DTYPES


@dataclass(frozen=True)
class Producer:
    """Where one extraction worker runs."""

    index: int
    node: str
    address: str | None  # None: this machine's loopback (kind local)
    netns: str | None

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as launched on this producer's node."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv


def producers(spec: ClusterSpec, workers: int) -> list[Producer]:
    nodes = spec.inference_nodes
    return [
        Producer(i, n.name, n.address, n.netns)
        for i, n in ((i, nodes[i % len(nodes)]) for i in range(workers))
    ]


def trainer_node(spec: ClusterSpec) -> Node:
    return spec.training_nodes[0]


def consumer_host(params: Params) -> str:
    """Where the training plane's coordinators and the stream's master bind: the training
    node's address, or `extract.host` on this machine."""
    return trainer_node(resolve(params.provision.spec)).address or params.extract.host


def sample_bytes(tokens: int, num_aux: int, hidden: int, wire_dtype: str) -> int:
    """One sample's hidden states on the wire: the tapped layers plus the last one."""
    return tokens * (num_aux + 1) * hidden * WIRE_DTYPES[wire_dtype].itemsize


def plan_gpu(spec: ClusterSpec, params: Params) -> dict:
    """The plan of a GPU cluster from the spec's target figures. Raises ResourceError when the
    spec cannot be placed at all (too few GPUs); a memory shortfall is a failed check."""
    if spec.target is None:
        raise ResourceError(f"spec {spec.name}: target: a GPU plan needs the target's figures")
    t, x = spec.target, params.extract
    tokens = spec.inference.max_sample_tokens or (
        params.prepare.max_prompt_tokens + params.prepare.max_new_tokens
    )
    inference, inference_check = _place_inference(spec, tokens)
    one = sample_bytes(tokens, len(t.aux_layers), t.hidden_size, x.wire_dtype)
    nodes = spec.inference_nodes
    segment = x.max_in_flight * one / len(nodes)
    host = min(n.host_memory_gb for n in nodes) * GB
    training, training_check = _place_training(spec, one)
    return {
        "spec": spec.name,
        "kind": spec.kind,
        "target": t.model_dump(),
        "longest_sample_tokens": tokens,
        "inference": inference,
        "stream": {
            "protocol": spec.network.protocol,
            "rdma_devices": spec.network.rdma_devices,
            "sample_bytes": one,
            "max_in_flight": x.max_in_flight,
            "segment_bytes_per_inference_node": round(segment),
        },
        "training": training,
        "checks": [
            inference_check,
            _check("inference.host_memory (Mooncake segment)", segment, host),
            training_check,
        ],
    }


def _place_inference(spec: ClusterSpec, tokens: int) -> tuple[dict, dict]:
    """The inference instances: tensor parallel inside a node, and the fewest pipeline stages
    whose per-GPU weights and KV cache of one longest sample fit; with their memory check."""
    t, inf, nodes = spec.target, spec.inference, spec.inference_nodes
    per_node = min(n.gpus for n in nodes)
    tp = inf.tensor_parallel or per_node
    if tp > per_node:
        raise ResourceError(
            f"spec {spec.name}: inference.tensor_parallel: {tp} exceeds the {per_node} GPUs of "
            "an inference node (tensor parallelism stays inside a node)"
        )
    usable = min(n.gpu_memory_gb for n in nodes) * GB * inf.gpu_memory_utilization
    kv_instance = t.kv_bytes_per_token * tokens + t.state_bytes_per_request

    def per_gpu(pp: int) -> dict:
        kv = kv_instance / pp / (1 if t.kv_replicated_across_tp else tp)
        weights = t.weight_bytes / (tp * pp)
        return {"weights_bytes": weights, "kv_bytes": kv, "total_bytes": weights + kv}

    tried = []
    candidates = [inf.pipeline_parallel] if inf.pipeline_parallel else range(1, len(nodes) + 1)
    pp = None
    for p in candidates:
        if p > len(nodes):
            raise ResourceError(
                f"spec {spec.name}: inference.pipeline_parallel: {p} stages but {len(nodes)} "
                "inference nodes"
            )
        need = per_gpu(p)
        tried.append({"tensor_parallel": tp, "pipeline_parallel": p, **_round(need)})
        if need["total_bytes"] <= usable:
            pp = p
            break
    chosen = pp or tried[-1]["pipeline_parallel"]
    replicas = len(nodes) // chosen
    layers = _split(t.num_layers, chosen)
    instances = [
        {
            "instance": r,
            "tensor_parallel": tp,
            "pipeline_parallel": chosen,
            "stages": [
                {"node": nodes[r * chosen + s].name, "gpus": list(range(tp)), "layers": layers[s]}
                for s in range(chosen)
            ],
        }
        for r in range(replicas)
    ]
    plan = {
        "instances": instances,
        "replicas": replicas,
        "per_gpu": _round(per_gpu(chosen)),
        "usable_per_gpu_bytes": round(usable),
        "tried": tried,
        "why": _why(tried, usable, pp),
    }
    return plan, _check("inference.gpu_memory", per_gpu(chosen)["total_bytes"], usable)


def _place_training(spec: ClusterSpec, sample: int) -> tuple[dict, dict]:
    """The trainer ranks and what one GPU holds (the draft's state, a sample of `sample`
    bytes, the frozen LM head); with their memory check."""
    t, tr, trainers = spec.target, spec.training, spec.training_nodes
    train_gpus = sum(n.gpus for n in trainers)
    if tr.world_size > train_gpus:
        raise ResourceError(
            f"spec {spec.name}: training.world_size: {tr.world_size} ranks but {train_gpus} "
            "training GPUs"
        )
    draft = (tr.draft_params or 0) * tr.bytes_per_param  # DDP: a full replica on every rank
    lm_head = t.vocab_size * t.hidden_size * 2  # frozen bf16 copy: rebuilds target distributions
    need = draft + sample + lm_head
    usable = min(n.gpu_memory_gb for n in trainers) * GB * spec.inference.gpu_memory_utilization
    check = _check("training.gpu_memory", need, usable)
    if tr.draft_params is None:
        check["note"] = "training.draft_params unset: the draft's own memory is not counted"
    plan = {
        "nodes": [n.name for n in trainers],
        "world_size": tr.world_size,
        "backend": "nccl",
        "per_gpu": {
            "draft_state_bytes": round(draft),
            "sample_bytes": sample,
            "lm_head_bytes": lm_head,
            "total_bytes": round(need),
        },
    }
    return plan, check


def plan_cpu(spec: ClusterSpec, params: Params) -> dict:
    """Placement on this machine (local, netns); the provision stage adds the resource checks."""
    p = producers(spec, params.extract.workers)
    trainer = trainer_node(spec)
    return {
        "spec": spec.name,
        "kind": spec.kind,
        "inference_plane": [
            {"node": q.node, "address": q.address, "netns": q.netns, "role": "extract"} for q in p
        ],
        "training_plane": [
            {
                "node": trainer.name,
                "address": trainer.address,
                "netns": trainer.netns,
                "role": "train",
                "processes": params.train.world_size,
            }
        ],
        "mooncake_master": {
            "node": trainer.name,
            "address": trainer.address or params.extract.host,
        },
    }


def _split(num_layers: int, stages: int) -> list[list[int]]:
    """Contiguous layer ranges [first, last], as even as they go."""
    size = math.ceil(num_layers / stages)
    return [[s * size, min(num_layers, (s + 1) * size) - 1] for s in range(stages)]


def _check(name: str, need: float, have: float) -> dict:
    return {"name": name, "need_bytes": round(need), "have_bytes": round(have), "ok": need <= have}


def _round(d: dict) -> dict:
    return {k: round(v) for k, v in d.items()}


def _why(tried: list[dict], usable: float, chosen: int | None) -> str:
    parts = [
        f"TP{t['tensor_parallel']} x PP{t['pipeline_parallel']}: "
        f"{t['total_bytes'] / GB:.1f} GB per GPU"
        for t in tried
    ]
    verdict = (
        f"PP{chosen} is the fewest stages that fit"
        if chosen
        else "no placement fits: more or larger GPUs, or a smaller target"
    )
    return f"{'; '.join(parts)} (usable {usable / GB:.1f} GB): {verdict}"
