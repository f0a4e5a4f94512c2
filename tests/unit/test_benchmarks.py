"""benchmarks/target_pass.py on the tiny target: every k gets the engine's pass, its multiplies
and a floor, the table's ratios are what its columns say, and the 1- and 2-token passes carry an
operator profile that accounts for the whole pass."""

import json

import pytest

from benchmarks import target_pass


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    from tests.unit.test_spec_decode import save_trained_drafts

    return save_trained_drafts(tiny_target, tmp_path_factory.mktemp("drafts"))


def test_the_pass_is_set_against_its_multiplies_and_its_floor(tiny_target_dir, drafts, tmp_path):
    out = tmp_path / "pass.json"
    target_pass.main(
        ["--tokens", "1", "2", "5", "--context", "24", "--repeats", "3", "--threads", "1",
         "--bandwidth-gib", "0.02", "--target", str(tiny_target_dir), "--drafts", str(drafts),
         "--out", str(out)]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert [r["tokens"] for r in doc["passes"]] == [1, 2, 5]
    for r in doc["passes"]:
        assert r["engine_ms"] > 0 and r["multiplies_ms"] > 0 and r["floor_ms"] > 0
        ratio = r["engine_ms"] / r["multiplies_ms"]  # of the rounded ms: close, not equal
        assert r["engine_over_multiplies"] == pytest.approx(ratio, rel=0.02)
    assert doc["passes"][0]["engine_over_one"] == 1.0
    assert doc["threads"] == 1 and "model" in doc["cpu"] and doc["read_bytes_per_s"] > 0
    for k in ("1", "2"):
        ops = doc["profile_ms"][k]
        assert ops[-1]["op"] == "(the rest)" and any("mm" in o["op"] for o in ops)
        assert sum(o["ms"] for o in ops) > 0
    assert "5" not in doc["profile_ms"]
    timed = {d["draft"]: d for d in doc["drafts"]}
    assert set(timed) == {p.name for p in drafts.iterdir()}
    for d in timed.values():
        assert d["ms"] > 0 and d["floor_ms"] > 0 and d["drafts_per_proposal"] >= 1


def test_the_bytes_a_pass_reads_are_its_weights_and_its_context(tiny_target):
    import torch

    from dspark.decode.llama import Llama

    model = Llama.from_hf(tiny_target.model)
    p = target_pass.Pass(model, 10, 3, torch.Generator().manual_seed(0))
    s = model.s
    weights = sum(w.numel() for w in target_pass.weights(model)) * 4
    kv = 2 * len(model.layers) * s.num_kv_heads * s.head_dim * 13 * 4
    assert p.bytes_read() == weights + kv
    assert p.multiply_adds() == 3 * weights // 4
    assert any(w is model.lm_head.weight for w in target_pass.weights(model))
