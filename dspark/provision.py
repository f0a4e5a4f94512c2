"""The provision stage on one machine: resolve the target, check resources, write the plan.

The plan says where each plane runs and what the run needs (weights, KV cache, shard and
hidden-state bytes) against what the machine has; a shortfall fails up front, not hours in.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from dspark.config import Params
from dspark.errors import ResourceError
from dspark.infra import netns
from dspark.infra.plan import plan_cpu, plan_gpu
from dspark.infra.spec import ClusterSpec
from dspark.infra.spec import resolve as resolve_spec
from dspark.io import ensure_writable_dir, write_json
from dspark.models import target as target_mod
from dspark.schema import WIRE_DTYPES, bytes_per_token

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def machine() -> dict:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = pages
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpus": os.cpu_count() or 1, "memory_bytes": pages, "memory_available_bytes": available}


def ensure_target(params: Params, target_dir: Path) -> dict:
    """Materialize the target folder unless it already holds exactly this target."""
    wanted = target_mod.describe(params.target)
    manifest_path = Path(target_dir) / target_mod.MANIFEST
    if manifest_path.is_file():
        have = json.loads(manifest_path.read_text())
        have.pop("config_sha256", None)
        if have == wanted:
            return target_mod.read_manifest(target_dir)
    return target_mod.materialize(params.target, target_dir)


def _architecture(target_dir: Path, manifest: dict) -> dict:
    folder = Path(manifest["path"]) if manifest["kind"] == "folder" else Path(target_dir)
    config_path = folder / "config.json"
    if not config_path.is_file():
        return {}
    c = json.loads(config_path.read_text())
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {
        "num_layers": c.get("num_hidden_layers"),
        "hidden_size": c.get("hidden_size"),
        "vocab_size": c.get("vocab_size"),
        "num_kv_heads": c.get("num_key_value_heads", c.get("num_attention_heads")),
        "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        "max_context": c.get("max_position_embeddings"),
        "weight_bytes": weights,
    }


def estimate(params: Params, arch: dict) -> dict:
    """Bytes the run needs: memory at its peak, disk for what it keeps."""
    p, x = params.prepare, params.extract
    seq = p.max_prompt_tokens + p.max_new_tokens
    kv_per_token = (
        2
        * arch["num_layers"]
        * arch["num_kv_heads"]
        * arch["head_dim"]
        * DTYPE_BYTES[params.target.dtype]
    )
    num_aux = len(x.aux_layers) if x.aux_layers else 3
    wire = bytes_per_token(
        num_aux=num_aux, hidden=arch["hidden_size"], wire_dtype=x.wire_dtype, topk=x.target_topk
    )
    samples = p.num_samples or max(1, (p.token_budget or 0) // seq)
    tokens = samples * seq
    weight_bytes = arch["weight_bytes"] or 0
    if p.engine == "extract":
        # Each producer answers decode_rows rows at once: their KV cache, and the tapped
        # layers' states (fp32) kept for every position until the sample leaves.
        decoding = (
            x.workers
            * x.decode_rows
            * (seq + 1)
            * (kv_per_token + (num_aux + 1) * arch["hidden_size"] * 4)
        )
    else:
        decoding = kv_per_token * seq * p.batch_size  # the prepare stage's generate batch
    # Each extraction worker holds its own copy of the target; generation holds one more. The
    # stream's credits bound the samples whose states wait in a producer's store.
    credits, _ = params.stream_credits(samples)
    peak_memory = weight_bytes * (x.workers + 1) + decoding + credits * seq * wire
    disk = tokens * 5 + (tokens * wire if x.mode in ("offline", "hybrid") else 0) + weight_bytes
    return {
        "tokens": tokens,
        "kv_bytes_per_token": kv_per_token,
        "wire_bytes_per_token": wire,
        "peak_memory_bytes": int(peak_memory),
        "disk_bytes": int(disk),
        "wire_dtype_bytes": WIRE_DTYPES[x.wire_dtype].itemsize,
    }


def plan_only(params: Params, spec: ClusterSpec) -> dict:
    """The plan of `spec` without starting anything; for CPU kinds, the placement alone (the
    resource checks need the target, which the stage materializes)."""
    return plan_gpu(spec, params) if spec.kind == "cluster" else plan_cpu(spec, params)


def provision_stage(
    params: Params, target_dir: Path, plan_path: Path, workdir: Path = Path(".")
) -> dict:
    """Run the stage; write the plan; return its metrics. Raises ResourceError on a shortfall."""
    t0 = time.perf_counter()
    spec = resolve_spec(params.provision.spec)
    if spec.kind == "cluster":
        raise ResourceError(
            f"provision.spec: {spec.name} is a GPU cluster: this machine can only plan it "
            "(`dspark provision --spec FILE --plan-only`) and render its manifests "
            "(`dspark manifests --spec FILE`)"
        )
    if netns.current() is None:  # inside a node the namespaces exist already
        netns.up(spec)
    ensure_writable_dir(Path(plan_path).parent)
    threads = target_mod.set_threads(params.provision.threads)
    manifest = ensure_target(params, target_dir)
    arch = _architecture(target_dir, manifest)
    have = machine()
    have["disk_free_bytes"] = shutil.disk_usage(workdir).free
    checks = []
    if arch:
        need = estimate(params, arch)
        headroom = params.provision.memory_headroom
        checks = [
            {
                "name": "memory",
                "need_bytes": int(need["peak_memory_bytes"] * headroom),
                "have_bytes": have["memory_available_bytes"],
            },
            {
                "name": "disk",
                "need_bytes": need["disk_bytes"],
                "have_bytes": have["disk_free_bytes"],
            },
            {"name": "cpus", "need": params.extract.workers, "have": have["cpus"]},
        ]
        for c in checks:
            c["ok"] = c.get("have_bytes", c.get("have", 0)) >= c.get("need_bytes", c.get("need", 0))
    else:
        need = {}
    plan = {
        "spec": spec.model_dump(),
        "target": manifest,
        "architecture": arch,
        "machine": have,
        "threads": threads,
        "estimate": need,
        "checks": checks,
        "placement": plan_cpu(spec, params),
    }
    write_json(plan_path, plan)
    failed = [c for c in checks if not c["ok"]]
    if failed and params.provision.on_shortfall == "fail":
        c = failed[0]
        need_s = _fmt(c.get("need_bytes"), c.get("need"))
        have_s = _fmt(c.get("have_bytes"), c.get("have"))
        raise ResourceError(
            f"provision: {c['name']}: the profile needs {need_s}, the machine has "
            f"{have_s} (see {plan_path}; provision.on_shortfall: warn to proceed)"
        )
    return {
        "spec": spec.name,
        "target_kind": manifest["kind"],
        "num_layers": arch.get("num_layers"),
        "hidden_size": arch.get("hidden_size"),
        "weight_bytes": arch.get("weight_bytes"),
        "checks_failed": len(failed),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _fmt(nbytes: int | None, count: int | None) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes is not None else str(count)
