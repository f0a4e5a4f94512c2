"""The llama.cpp peer modes without llama.cpp: they validate in config (and need a packaged GGUF
target), the load client's token count for a stream that names no tokens, and bench.json's
`vs_llamacpp` ratios with the report's lines."""

import pytest

from dspark.config import benchmark_modes, load_params
from dspark.errors import ConfigError
from dspark.serve.bench import speculative
from dspark.serve.client import untokenized_count
from dspark.serve.llamacpp_mode import MODES, ratios
from dspark.serve.report import peer_lines
from tests.conftest import ROOT


def test_the_modes_validate_and_need_a_packaged_gguf_target():
    assert set(MODES) <= set(benchmark_modes())
    full = load_params(ROOT / "params.yaml", profile="full")
    assert set(MODES) <= set(full.benchmark.modes)  # the committed benchmark carries the peer
    assert "llamacpp" in load_params(ROOT / "params.yaml", profile="default").benchmark.modes
    with pytest.raises(ConfigError, match=r"modes\.0: .* 'llamacpp_lookup' \(got 'llamacpp_pl"):
        load_params(ROOT / "params.yaml", overrides=["benchmark.modes=[llamacpp_plain]"])
    with pytest.raises(ConfigError, match=r"benchmark\.llamacpp_lookup_k: .*greater than 0"):
        load_params(ROOT / "params.yaml", overrides=["benchmark.llamacpp_lookup_k=0"])
    with pytest.raises(
        ConfigError,
        match=r"^--set: benchmark\.modes: llamacpp_lookup needs a target made from a packaged "
        r"GGUF \(target\.model: pkg:<package>\), not 'tiny-random'$",
    ):
        load_params(
            ROOT / "params.yaml", profile="smoke", overrides=["benchmark.modes=[llamacpp_lookup]"]
        )


def test_a_stream_without_token_ids_is_counted_as_llamacpp_generates():
    assert untokenized_count(None, 0, 64) == 1  # a chunk: one token (or one character's)
    assert untokenized_count("stop", 12, 64) == 1  # the EOS, generated and not streamed
    assert untokenized_count("length", 40, 64) == 24  # a character's tokens sent as one chunk
    assert untokenized_count("length", 64, 64) == 0
    assert untokenized_count("length", 66, 64) == 0  # a character finished past the cap
    assert untokenized_count("content_filter", 3, 64) == 0


def cell(mode: str, c: int, tok_s_rounds: list[float], workload: str = "math_reasoning"):
    tok_s = sorted(tok_s_rounds)[len(tok_s_rounds) // 2]
    return {"mode": mode, "concurrency": c, "workload": workload, "tok_s": tok_s,
            "tok_s_rounds": tok_s_rounds}  # fmt: skip


def test_ours_over_llamacpp_per_cell_are_same_round_ratios():
    cells = [
        cell("none", 1, [10.0, 20.0, 15.0]),
        cell("ngram", 1, [12.0, 18.0, 18.0]),
        cell("llamacpp", 1, [20.0, 40.0, 25.0]),
        cell("llamacpp_lookup", 1, [30.0, 40.0, 30.0]),
        cell("none", 16, [100.0, 100.0, 100.0]),
        cell("none_hf", 1, [99.0, 99.0, 99.0]),  # not a served mode of ours
        cell("llamacpp", 16, [25.0, 20.0, 25.0]),
        cell("none", 4, [50.0, 50.0, 50.0], "mix"),  # no llama.cpp cell: no row
    ]
    rows = ratios(cells, ("none", *speculative()))
    assert rows == [
        {
            "concurrency": 1, "workload": "math_reasoning", "llamacpp_tok_s": 25.0,
            # medians of 0.5, 0.5, 0.6 and of 0.6, 0.45, 0.72 (ratios of medians: 0.6, 0.72)
            "none_over_llamacpp": 0.5, "best_mode": "ngram", "best_over_llamacpp": 0.6,
            "lookup_over_plain": 1.2,
        },
        {
            "concurrency": 16, "workload": "math_reasoning", "llamacpp_tok_s": 25.0,
            "none_over_llamacpp": 4.0, "best_mode": "none", "best_over_llamacpp": 4.0,
            "lookup_over_plain": None,
        },
    ]  # fmt: skip
    lines = peer_lines(rows)
    assert lines[1].startswith("over llama.cpp plain, same weights")
    assert lines[3].split() == ["1", "math_reasoning", "25", "0.5", "ngram", "0.6", "1.2"]
    assert lines[4].split() == ["16", "math_reasoning", "25", "4", "none", "4", "-"]
    assert peer_lines([]) == [] and ratios(cells[:2], ("none", "ngram")) == []
