import json

import pytest

from dspark.config import load_params
from dspark.errors import ResourceError
from dspark.provision import estimate, provision_stage

from ..conftest import ROOT


def test_plan_is_written_and_target_reused(tmp_path, monkeypatch):
    params = load_params(ROOT / "params.yaml", profile="smoke")
    metrics = provision_stage(params, tmp_path / "target", tmp_path / "plan.json", tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["architecture"]["num_layers"] == 2 and plan["target"]["kind"] == "tiny-random"
    assert {c["name"] for c in plan["checks"]} == {"memory", "disk", "cpus"}
    assert all(c["ok"] for c in plan["checks"]) and metrics["checks_failed"] == 0
    stamp = (tmp_path / "target" / "model.safetensors").stat().st_mtime_ns
    provision_stage(params, tmp_path / "target", tmp_path / "plan.json", tmp_path)
    assert (tmp_path / "target" / "model.safetensors").stat().st_mtime_ns == stamp


def test_shortfall_fails_up_front_or_warns(tmp_path):
    params = load_params(
        ROOT / "params.yaml", profile="smoke", overrides=["provision.memory_headroom=1e9"]
    )
    with pytest.raises(ResourceError, match="provision: memory: the profile needs"):
        provision_stage(params, tmp_path / "target", tmp_path / "plan.json", tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["checks"][0]["ok"] is False
    warn = load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=["provision.memory_headroom=1e9", "provision.on_shortfall=warn"],
    )
    assert (
        provision_stage(warn, tmp_path / "target", tmp_path / "plan.json", tmp_path)[
            "checks_failed"
        ]
        == 1
    )


def test_estimate_by_hand():
    params = load_params(ROOT / "params.yaml", profile="default")
    arch = {
        "num_layers": 30,
        "hidden_size": 576,
        "num_kv_heads": 3,
        "head_dim": 64,
        "weight_bytes": 538_000_000,
    }
    e = estimate(params, arch)
    assert e["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    # 3 aux + last layer in bf16, and the target's top-64 (fp32 log-prob + int32 id)
    assert e["wire_bytes_per_token"] == 4 + 1 + 4 * 576 * 2 + 64 * (4 + 4)
    seq = 384 + 128
    assert e["tokens"] == 192 * seq
    # The default answers in the producers: 2 x 64 rows of KV cache and tapped states (fp32),
    # and the credits raised to 2 x 2 x 64 samples waiting in the producers' stores
    kv, wire, x = e["kv_bytes_per_token"], e["wire_bytes_per_token"], params.extract
    decoding = 2 * 64 * (seq + 1) * (kv + 4 * 576 * 4)
    assert e["peak_memory_bytes"] == 538_000_000 * 3 + decoding + 256 * seq * wire
    hf = load_params(ROOT / "params.yaml", profile="default", overrides=["prepare.engine=hf"])
    generate = kv * seq * hf.prepare.batch_size  # the prepare stage's generate batch instead
    assert estimate(hf, arch)["peak_memory_bytes"] == 538_000_000 * 3 + generate + (
        x.max_in_flight * seq * wire
    )
