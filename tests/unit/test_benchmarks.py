"""The speed benchmarks (benchmarks/), one smoke test each: the script runs on the tiny target
with its smallest arguments, writes its JSON where `--out` says, and its figures are what its
columns say. The figures themselves are never checked against a goal here (benchmarks/README.md).
"""

import json

import pytest
import torch

from benchmarks import (
    adaptive,
    cli,
    decode_step,
    onpolicy,
    prefill,
    row_invariant,
    stream,
    target_pass,
    train_step,
)
from dspark.data.shards import TokenSample, write_manifest, write_shard
from tests.conftest import write_jsonl

PROMPTS = 8  # token samples in the shards


def run(main, tmp_path, *args) -> dict:
    """The script's JSON after `main([*args, --out FILE])`, checked for the CPU it ran on."""
    out = tmp_path / "out.json"
    main([*map(str, args), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["cpu"]["cores"] > 0 and isinstance(doc["cpu"]["flags"], list)
    return doc


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    from tests.unit.test_spec_decode import save_trained_drafts

    return save_trained_drafts(tiny_target, tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Token shards as the prepare stage writes them: a prompt of 10 to 17 tokens, then its
    answer of 6."""
    folder = tmp_path_factory.mktemp("shards")
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(PROMPTS):
        ids = torch.randint(10, 2000, (16 + i,), generator=gen, dtype=torch.int32)
        samples.append(TokenSample(i, f"p{i}", ids, torch.arange(16 + i) >= 10 + i))
    entry = write_shard(folder / "shard-00000.safetensors", samples, regenerated=0, fingerprint="")
    write_manifest(folder, [entry], {})
    return folder


@pytest.fixture(scope="module")
def hidden(tiny_target, shards, smoke_params, tmp_path_factory):
    """The hidden-state shards the extract stage writes from `shards` (the smoke profile's taps,
    no top-k: the benchmark computes it)."""
    from dspark.data.shards import iter_samples
    from dspark.extract.capture import HiddenStateCapture, resolve_aux_layers
    from dspark.transport.files import HiddenShardWriter

    folder = tmp_path_factory.mktemp("hidden")
    aux = resolve_aux_layers(smoke_params.extract.aux_layers, tiny_target.num_layers)
    capture = HiddenStateCapture(tiny_target, aux, "float32")
    writer = HiddenShardWriter(folder, shard_size=4, keep_payload=True)
    for s in iter_samples(shards):
        writer.add(capture(s))
    capture.close()
    writer.close({"aux_layers": aux})
    return folder


def test_target_pass_is_set_against_its_multiplies_and_its_floor(tiny_target_dir, drafts, tmp_path):
    """Every k gets our forward, its multiplies and a floor, the table's ratios are what
    its columns say, and the 1- and 2-token passes carry an operator profile that accounts for
    the whole pass."""
    doc = run(
        target_pass.main, tmp_path,
        "--tokens", 1, 2, 5, "--context", 24, "--repeats", 3, "--threads", 1,
        "--bandwidth-gib", 0.02, "--target", tiny_target_dir, "--drafts", drafts,
    )  # fmt: skip
    assert [r["tokens"] for r in doc["passes"]] == [1, 2, 5]
    for r in doc["passes"]:
        assert r["forward_ms"] > 0 and r["multiplies_ms"] > 0 and r["floor_ms"] > 0
        ratio = r["forward_ms"] / r["multiplies_ms"]  # of the rounded ms: close, not equal
        assert r["forward_over_multiplies"] == pytest.approx(ratio, rel=0.02)
    assert doc["passes"][0]["forward_over_one"] == 1.0
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
    from dspark.decode.llama import Llama

    model = Llama.from_hf(tiny_target.model)
    p = target_pass.Pass(model, 10, 3, torch.Generator().manual_seed(0))
    s = model.s
    weights = sum(w.numel() for w in target_pass.weights(model)) * 4
    kv = 2 * len(model.layers) * s.num_kv_heads * s.head_dim * 13 * 4
    assert p.bytes_read() == weights + kv
    assert p.multiply_adds() == 3 * weights // 4
    assert any(w is model.lm_head.weight for w in target_pass.weights(model))


def test_cli_times_help_beside_a_bare_interpreter(tmp_path):
    doc = run(cli.main, tmp_path, "--runs", 1, "--warmup", 0)
    assert doc["runs"] == 1 and doc["command"].endswith("--help")
    for name in ("help", "interpreter"):
        s = doc[name]
        assert 0 < s["min_s"] == s["median_s"] == s["max_s"]  # one run: one figure
    gap = doc["help"]["median_s"] - doc["interpreter"]["median_s"]  # of figures rounded to 1e-4
    assert doc["help_over_interpreter_s"] == pytest.approx(gap, abs=2e-4)
    assert doc["slowest_imports"] and all(r["self_ms"] >= 0 for r in doc["slowest_imports"])


@pytest.mark.slow  # two fresh processes, each loading the target
def test_decode_step_times_each_row_count_in_fresh_processes(tiny_target_dir, tmp_path):
    doc = run(
        decode_step.main, tmp_path,
        "--processes", 1, "--rows", 1, 2, "--context", 8, "--steps", 4,
        "--target", tiny_target_dir,
    )  # fmt: skip
    assert [r["rows"] for r in doc["rows"]] == [1, 2]
    assert {name: len(runs) for name, runs in doc["runs"].items()} == {
        name: 1 for name in decode_step.SETTINGS
    }
    for row in doc["rows"]:
        off, on = (row[name] for name in decode_step.SETTINGS)
        for s in (off, on):
            assert 0 < s["min_ms"] <= s["median_ms"] <= s["max_ms"]
        assert row["speedup"] == pytest.approx(off["median_ms"] / on["median_ms"], abs=1e-3)


def test_onpolicy_sets_the_recorded_paths_against_todays(tiny_target_dir, shards, tmp_path):
    doc = run(
        onpolicy.main, tmp_path,
        "--prompts", 4, "--max-new", 4, "--batches", "2,4",
        "--shards", shards, "--target", tiny_target_dir,
    )  # fmt: skip
    assert doc["prompts"] == 4 and doc["max_new_tokens"] == 4
    runs = doc["runs"]
    assert [r["path"] for r in runs] == [
        "transformers+capture",
        "dspark-recorded@2",
        "dspark-recorded@4",
    ]
    prompt_tokens = sum(range(10, 14))  # the first four prompts
    for r in runs:
        assert 0 < r["response_tokens"] <= 4 * 4
        assert r["tokens"] == prompt_tokens + r["response_tokens"]
        assert r["onpolicy_tok_s"] > 0
    assert runs[0]["ratio_to_today"] == 1.0
    # states captured step by step are the full forward's
    assert all(r["max_abs_diff_vs_full_forward"] < 1e-4 for r in runs[1:])


def test_row_invariant_decodes_both_ways_each_round(tiny_target_dir, shards, tmp_path):
    doc = run(
        row_invariant.main, tmp_path,
        "--prompts", 4, "--max-new", 4, "--rows", 2, "--rounds", 2,
        "--shards", shards, "--target", tiny_target_dir,
    )  # fmt: skip
    assert doc["prompts"] == 4 and doc["rows"] == 2 and doc["threads"] == 1
    plain, invariant = doc["runs"]
    assert (plain["decoding"], invariant["decoding"]) == ("plain", "row-invariant")
    for r in (plain, invariant):
        assert len(r["wall_s"]) == 2 and r["tok_s_best"] > 0
        assert sum(range(10, 14)) < r["tokens"] <= sum(range(10, 14)) + 4 * 4
    assert doc["ratio_invariant_to_plain"] == round(
        invariant["tok_s_best"] / plain["tok_s_best"], 3
    )
    assert 0 <= doc["answers_identical"] <= 4


def test_prefill_runs_causal_and_masked_side_by_side(tiny_target_dir, tmp_path):
    doc = run(
        prefill.main, tmp_path,
        "--profile", "smoke", "--lengths", 16, 40, "--repeats", 2, "--target", tiny_target_dir,
    )  # fmt: skip
    assert doc["repeats"] == 2 and doc["eval_batches"] == []
    assert [r["tokens"] for r in doc["rows"]] == [16, 40]
    for r in doc["rows"]:
        assert {k: len(v) for k, v in r["runs_s"].items()} == {"causal": 2, "mask": 2}
        assert r["speedup"] > 0
        assert r["max_logit_diff"] < 1e-4  # the two paths compute the same logits


def test_train_step_sets_topk_against_the_lm_head(tiny_target_dir, hidden, smoke_params, tmp_path):
    doc = run(
        train_step.main, tmp_path,
        "--profile", "smoke", "--batches", 2, "--k", 8, "--hidden", hidden,
        "--target", tiny_target_dir,
    )  # fmt: skip
    drafts = smoke_params.train.drafts
    assert doc["k"] == 8 and not doc["topk_from_shards"] and doc["timed_batches"] == 1
    assert doc["batch_size"] == smoke_params.train.batch_size
    for mode in ("topk", "lm_head"):
        assert set(doc["seconds_per_batch"][mode]) == {"collate", *drafts}
        assert set(doc["draft_tokens_per_s"][mode]) == set(drafts)
        rates = doc["draft_tokens_per_s"][mode].values()
        # the loop runs every draft's step: slower than any one of them
        assert 0 < doc["loop_tokens_per_s"][mode] <= min(rates)
    f = doc["fidelity"]
    assert f["positions"] > 0 and 0 <= f["tv_mean"] <= f["tv_max"] <= 1
    assert 0 <= f["tail_mass_mean"] <= 1 and 0 <= f["label_differs"] <= 1


@pytest.mark.slow
def test_stream_measures_each_transport_and_a_live_stream(tiny_target_dir, shards, tmp_path):
    doc = run(
        stream.main, tmp_path,
        "--profile", "smoke", "--repeats", 1, "--samples", 2, "--engine-seconds", 1,
        "--target", tiny_target_dir, "--shards", shards,
    )  # fmt: skip
    assert doc["payload_samples"] == 2 and doc["repeats"] == 1 and doc["payload_mb"] > 0
    bpt = doc["bytes_per_token"]
    assert 0 < bpt["hidden"] < bpt["topk_logits"] < bpt["full_logits"]
    for t in ("mooncake", "socket"):
        lo, hi = doc[f"{t}_gbps_range"]
        assert 0 <= lo <= doc[f"{t}_gbps"] <= hi
    assert doc["engine_bench_gbps"] is None or doc["engine_bench_gbps"] > 0  # None: no binary
    cpu = doc["cpu_s_per_gb"]
    assert set(cpu) == {"mooncake", "files", "socket"} and all(v > 0 for v in cpu.values())
    ratio = cpu["mooncake"] / cpu["socket"]  # of the rounded figures, against one rounded to 0.01
    assert doc["mooncake_cpu_over_socket"] == pytest.approx(ratio, rel=0.01, abs=0.01)
    # the live stream: every sample of the shards, once
    assert doc["samples_sent"] == doc["samples_received"] == PROMPTS
    assert doc["lost"] == doc["duplicated"] == 0 and 0 <= doc["consumer_stall_fraction"] <= 1


@pytest.mark.slow
def test_adaptive_serves_the_same_cells_seasoned_and_fresh(tiny_target_dir, drafts, tmp_path):
    question = "Tom has {} apples and buys {} more, then gives away {}. How many apples are left?"
    rows = [
        {"id": f"m{i}", "category": "math_reasoning", "prompt": question.format(i, i + 3, i + 1)}
        for i in range(4)
    ]
    doc = run(
        adaptive.main, tmp_path,
        "--profile", "smoke", "--concurrency", 1, "--rounds", 1, "--history", 1, "--requests", 1,
        "--target", tiny_target_dir, "--drafts", drafts,
        "--prompts", write_jsonl(tmp_path / "prompts.jsonl", rows),
    )  # fmt: skip
    assert doc["concurrency"] == 1 and doc["history"] == [1]
    cells = [(c["phase"], c["server"], c.get("round")) for c in doc["cells"]]
    assert cells[:2] == [("history", "none", None), ("history", "seasoned", None)]
    assert sorted(cells[2:]) == [("measured", s, 1) for s in ("fresh", "none", "seasoned")]
    for c in doc["cells"]:
        assert c["tok_s"] > 0 and 0 <= c["draft_steps"] <= c["steps"]
    s = doc["summary"]
    assert list(s) == ["none", "seasoned", "fresh"] and s["none"]["x_none"] == 1.0
    for row in s.values():  # one round: its ratio is the median's
        assert row["x_none_rounds"] == [row["x_none"]]
        assert row["x_none"] == pytest.approx(row["tok_s"] / s["none"]["tok_s"], rel=0.01)
