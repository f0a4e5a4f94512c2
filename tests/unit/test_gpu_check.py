"""infra/gpu/check.py builds what vLLM and hs-connectors read: checked here on the CPU, without
vLLM. Field names are pinned to the sources they were read from (vllm 0.33.0's wheel,
hs-connectors 0.9.0); each set below cites its file and lines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.export import speculators_config
from dspark.models.dspark import DSparkConfig
from dspark.models.layers import LayerShape
from tests.conftest import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]

# vllm 0.33.0 vllm/config/speculative.py:413, :416, :419 (and the other SpeculativeConfig fields
# this script may pass): the keys a --speculative-config may hold.
SPECULATIVE_KEYS = {"num_speculative_tokens", "model", "method", "draft_model_config"}
# vllm 0.33.0 vllm/config/speculative.py:70-82: the method names (those this script uses).
SPECULATIVE_METHODS = {"dspark", "extract_hidden_states"}
# vllm 0.33.0 vllm/config/kv_transfer.py:60, :71, :78, :81 (KVTransferConfig fields).
KV_TRANSFER_KEYS = {
    "kv_connector",
    "kv_role",
    "kv_connector_extra_config",
    "kv_connector_module_path",
}
KV_ROLES = {"kv_producer", "kv_consumer", "kv_both"}  # kv_transfer.py KVRole


def _load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "infra/gpu/check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check = _load_check()

SMOLLM2 = {  # the default target's config.json, the fields the export and the check read
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


@pytest.fixture()
def folders(tmp_path):
    """A target folder and an export written by our own export code (default-profile shape)."""
    target, export = tmp_path / "target", tmp_path / "export"
    target.mkdir()
    export.mkdir()
    (target / "config.json").write_text(json.dumps(SMOLLM2))
    cfg = DSparkConfig(
        layer=LayerShape.from_hf(SMOLLM2),
        num_layers=1,
        block_size=8,
        aux_layers=(2, 15, 27),
        vocab_size=49152,
        draft_vocab_size=8192,
        mask_token_id=0,
    )
    doc = speculators_config(cfg, SMOLLM2, str(target))
    (export / "config.json").write_text(json.dumps(doc))
    return target, export, doc


def _flag(argv: list[str], flag: str) -> dict:
    return json.loads(argv[argv.index(flag) + 1])


def test_extract_configs(folders):
    target, _export, doc = folders
    ids = check.extract_layer_ids(doc, SMOLLM2)
    # our aux ids (outputs of layers 2, 15, 27) and the last layer: vLLM capture ids
    # (vllm 0.33.0 vllm/model_executor/models/llama.py:440 appends id idx+1 after layer idx)
    assert ids == [3, 16, 28, 30]
    spec = check.extract_speculative_config(ids)
    assert set(spec) <= SPECULATIVE_KEYS and spec["method"] in SPECULATIVE_METHODS
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    # vllm 0.33.0 vllm/config/speculative.py:1360-1364 reads draft_model_config["hf_config"]
    assert spec["draft_model_config"]["hf_config"] == {"eagle_aux_hidden_state_layer_ids": ids}
    assert check.expected_hidden_shape(17, ids, 576) == (17, 4, 576)

    kv = check.kv_transfer_config(check.mooncake_store_config("127.0.0.1:50051"))
    assert set(kv) <= KV_TRANSFER_KEYS and kv["kv_role"] in KV_ROLES
    # hs-connectors 0.9.0 transfer.py:454-460: connector, module, extra_config["mooncake"]
    assert kv["kv_connector"] == "MooncakeHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "hs_connectors.mooncake_hidden_states_connector"
    store = kv["kv_connector_extra_config"]["mooncake"]
    assert tuple(store) == check.MOONCAKE_STORE_FIELDS  # mooncake_store.py:115-125
    assert store["metadata_server"] == "P2PHANDSHAKE" and store["protocol"] == "tcp"

    argv = check.serve_argv("python3", target, 8123, spec, kv, eager=True)
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(target)]
    # vllm 0.33.0 vllm/engine/arg_utils.py:1864-1866 and :1881: both flags take JSON
    assert _flag(argv, "--speculative-config") == spec
    assert _flag(argv, "--kv-transfer-config") == kv
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv


def test_dspark_config(folders):
    target, export, doc = folders
    spec = check.dspark_speculative_config(export, doc)
    assert set(spec) <= SPECULATIVE_KEYS and spec["method"] in SPECULATIVE_METHODS
    # vllm 0.33.0 vllm/config/speculative.py:70 (method), :416 (model), :413 (tokens > 0);
    # with sample_from_anchor every slot drafts (v1/worker/gpu/spec_decode/dspark/speculator.py
    # :49-55), so the default K is the trained block
    assert spec == {"method": "dspark", "model": str(export), "num_speculative_tokens": 8}
    assert doc["sample_from_anchor"] is True
    # vllm 0.33.0 transformers_utils/configs/speculators/algos.py:192-209 reads these
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size", "markov_rank"):
        assert key in doc
    # vllm 0.33.0 transformers_utils/configs/speculators/base.py:83 requires a verifier path
    assert doc["speculators_config"]["verifier"]["name_or_path"]
    assert check.dspark_speculative_config(export, doc, 4)["num_speculative_tokens"] == 4
    with pytest.raises(check.CheckError, match=r"outside 1\.\.8"):
        check.dspark_speculative_config(export, doc, 9)

    argv = check.serve_argv("python3", target, 8124, spec)
    assert _flag(argv, "--speculative-config") == spec
    assert "--kv-transfer-config" not in argv and "--enforce-eager" not in argv
    assert _flag(argv, "--override-generation-config") == {"temperature": 0.0}


def test_acceptance_from_metrics():
    # vllm 0.33.0 vllm/v1/spec_decode/metrics.py:229-231 and loggers.py:799 (`_total` on export)
    before = check.parse_prometheus(
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 80.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 20.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 8.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="target"} 40.0\n'
    )
    after = check.parse_prometheus(
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 30.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 240.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 80.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 26.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 12.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="target"} 120.0\n'
    )
    acc = check.acceptance(before, after)
    assert acc["acceptance_length"] == 4.0  # 1 + 60 accepted / 20 drafts
    assert acc["draft_acceptance_rate"] == 0.375
    assert acc["per_position"] == {0: 0.9, 1: 0.6}
    assert check.generated_tokens(before, after) == 80.0
    assert check.acceptance(before, before) is None


def test_script_says_up_front_when_vllm_is_missing(tmp_path):
    if importlib.util.find_spec("vllm") is not None:  # the project's venv has none
        skip_or_fail("vllm is importable here: the script would not be missing it")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "GPU_CHECK_WHEELHOUSE": str(tmp_path / "none"),
    }
    r = subprocess.run(
        ["bash", str(ROOT / "infra/gpu/check.sh")], env=env, capture_output=True, text=True
    )
    assert r.returncode == 3
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("gpu-check: FAIL vLLM is not importable")
    # The trainer's check still runs, and says in one line that there is no GPU here.
    assert lines[1:] == ["gpu-check: FAIL train: torch sees no CUDA device"]


@pytest.mark.slow
def test_train_check_runs_on_the_cpu(tmp_path):
    """The trainer check's plumbing, with the CPU in the GPU's place and gloo ranks for NCCL's:
    every check runs and passes, and the steps did move the weights."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "infra/gpu/train_check.py"), "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "train_check.json").read_text())
    assert set(report["checks"]) == {"steps", "device", "resume", "ranks"} and report["ok"]
    assert report["checks"]["steps"]["figure"] > 1e-3  # the norm of what training changed
    assert report["checks"]["device"]["figure"] == 0.0  # the CPU against itself
    assert report["checks"]["resume"]["figure"] == 0.0  # bit-exact on the CPU
    assert report["checks"]["ranks"]["figure"] < 1e-4  # float rounding, not a lost gradient


@pytest.mark.slow
def test_train_bench_runs_on_the_cpu(tmp_path):
    """The throughput bench at SmolLM2's shapes, cut to two timed steps: every draft is timed on
    the same batches, and the warm-up steps are left out of the count."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "infra/gpu/train_bench.py"), "--device", "cpu",
         "--batch-sizes", "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "train_bench.json").read_text())["by_batch"]["2"]
    assert set(rows) == {"dspark", "dflash", "eagle3"}
    assert {(v["steps"], v["tokens"]) for v in rows.values()} == {(2, rows["dspark"]["tokens"])}
    assert 2 * 2 * 150 <= rows["dspark"]["tokens"] <= 2 * 2 * 440  # two batches of two samples
    assert all(v["tokens_per_s"] > 0 for v in rows.values())


def test_train_bench_names_a_bad_batch_list(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "infra/gpu/train_bench.py"), "--device", "cpu",
         "--batch-sizes", "8,x", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--batch-sizes" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "train_bench.json").exists()
