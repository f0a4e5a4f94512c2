"""llama.cpp (llama-cpp-python 0.3.36, from .venv-llamacpp) on the real target's weights, the
benchmark's peer: the F32 GGUF llama.cpp makes of the package's Q4_1 GGUF decodes greedily as our
decoder does on the fp32 weights transformers made of the same file, tokenizes our prompts' text
back to our ids, its prompt lookup changes no output, the load client counts its stream's tokens
as our endpoint's (a CJK answer included, whose characters come as several tokens in one chunk),
and the benchmark serves it in the same cells as ours with `vs_llamacpp` ratios.

The slow tier: `make test` deselects these (marker `llamacpp`: the venv compiles llama.cpp, longer
than CI can spare) and `make test-llamacpp` builds the venv and runs them; without the venv they
skip, and fail under CI. About three minutes on the shared 2 cores, the small benchmark the
longest part.
"""

import asyncio

import pytest

from dspark.config import load_params
from dspark.decode.decoder import SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import NoProposer
from dspark.serve.bench import BenchPaths, benchmark_stage
from dspark.serve.client import closed_loop
from dspark.servers.llamacpp import OWN_DEFAULTS_OFF, LlamacppServer, f32_gguf
from tests.conftest import ROOT, skip_or_fail
from tests.integration.test_serve import bench_prompts

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]

VENV = ROOT / ".venv-llamacpp"
QUESTIONS = (
    "What is the capital of France?",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Translate to Chinese: The weather is nice today, and I want to go to the park.",
    "Name three prime numbers.",
)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def venv():  # conftest's smollm2_dir and smollm2 then skip with it
    if not (VENV / "bin" / "python").is_file():
        skip_or_fail(f"no {VENV.name}: run make llamacpp-venv (`make test-llamacpp` does)")
    return VENV


@pytest.fixture(scope="module")
def servers(venv, smollm2_dir, tmp_path_factory):
    """llama.cpp plain and with prompt lookup (k=2) on the F32 GGUF, side by side. One thread
    each: llama.cpp's threads spin at every barrier, so two of them on a core that other work
    shares crawl (seen here beside a benchmark at full tilt), and these tests time nothing."""
    gguf = f32_gguf(smollm2_dir, venv)
    logs = tmp_path_factory.mktemp("llamacpp")
    one = {"venv": venv, "n_ctx": 1024, "threads": 1}
    plain = LlamacppServer(gguf, **one, log=logs / "plain.log")
    lookup = LlamacppServer(gguf, **one, lookup_k=2, log=logs / "lookup.log")
    with plain, lookup:
        yield plain, lookup


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[dict]:
    out = []
    for i, q in enumerate(QUESTIONS):
        ids = smollm2.chat_ids([{"role": "user", "content": q}])
        text = smollm2.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        out.append({"id": f"q{i}", "prompt": ids, "text": text})
    return out


@pytest.fixture(scope="module")
def ours(smollm2, prompts) -> list[list[int]]:
    """Our decoder's greedy answers (fp32), EOS included where reached."""
    dec = SpecDecoder(
        Llama.from_hf(smollm2.model), NoProposer(), smollm2.eos_token_id, smollm2.max_context
    )
    return [t.tokens for t in dec.generate([p["prompt"] for p in prompts], NEW_TOKENS)[0]]


def test_the_f32_gguf_is_made_once(venv, smollm2_dir, servers):
    gguf = servers[0].gguf
    made = gguf.stat().st_mtime_ns
    assert f32_gguf(smollm2_dir, venv) == gguf and gguf.stat().st_mtime_ns == made
    assert gguf.read_bytes()[:4] == b"GGUF" and gguf.stat().st_size > 500e6  # 135M x 4 bytes


def test_llamacpp_tokenizes_our_prompt_text_to_our_ids(servers, prompts):
    for p in prompts:
        assert servers[0].tokenize(p["text"]) == p["prompt"]


def test_greedy_matches_our_decoder_and_lookup_changes_nothing(servers, smollm2, prompts, ours):
    eos = smollm2.eos_token_id
    want = [smollm2.tokenizer.decode([t for t in o if t != eos]) for o in ours]
    plain, lookup = (
        [s.complete(p["text"], max_new_tokens=NEW_TOKENS)[0] for p in prompts] for s in servers
    )
    # fp32 on both sides, other kernels (ggml's AVX2 against torch's): identical as a rule (6
    # of 6 prompts of 48 tokens when measured, a CJK answer among them), but an accumulation
    # order apart, a near-tie may flip one late token, as the vLLM test allows.
    assert sum(a == b for a, b in zip(want, plain, strict=True)) >= len(prompts) - 1
    for o, text in zip(ours, plain, strict=True):
        assert text.startswith(smollm2.tokenizer.decode([t for t in o[:8] if t != eos]))
    assert lookup == plain  # the draft is verified greedily: the same answers
    assert "Paris" in plain[0]


@pytest.mark.parametrize("which", ["plain", "lookup"])
def test_the_load_client_counts_llamacpps_tokens(servers, prompts, ours, which):
    """No token ids, no usage and no EOS in llama.cpp's stream, and several byte tokens in one
    chunk for a CJK character: each request still counts what our endpoint would count (its own
    count plus the EOS, or max_tokens)."""
    server = servers[["plain", "lookup"].index(which)]
    sampling = {"temperature": 0.0, "top_p": 1.0, **OWN_DEFAULTS_OFF}
    cell = asyncio.run(
        closed_loop(server.url, prompts, 2, len(prompts), 300.0, NEW_TOKENS, "target", sampling,
                    prompt_text=True)
    )  # fmt: skip
    grouped = 0
    for rec in cell["records"]:
        assert "error" not in rec, rec["error"]
        p = prompts[int(rec["id"][1:])]
        _, usage, finish = server.complete(p["text"], max_new_tokens=NEW_TOKENS)
        assert rec["finish"] == finish
        counted = sum(n for _, n in rec["chunks"])
        if finish == "stop":
            assert counted == usage["completion_tokens"] + 1  # the EOS, which ours counts
        else:  # what was asked; llama.cpp may finish a character begun at the cap past it
            assert counted == NEW_TOKENS <= usage["completion_tokens"] <= NEW_TOKENS + 3
        grouped += len(rec["chunks"]) < counted - (finish == "stop")
        if rec["id"] != "q2":  # ASCII answers: one chunk a token, as our endpoint streams
            assert counted == len(ours[int(rec["id"][1:])])
    assert grouped >= 1  # the CJK answer's characters came several tokens to a chunk


def test_the_benchmark_serves_llamacpp_beside_ours(venv, smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_LLAMACPP_VENV", str(venv))
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "target").symlink_to(smollm2_dir)
    paths = BenchPaths(
        target=tmp_path / "artifacts" / "target",
        drafts=tmp_path / "artifacts" / "drafts",
        prompts=bench_prompts(tmp_path / "p.jsonl"),
        plots=tmp_path / "plots",
        report=tmp_path / "report.md",
        logs=tmp_path / "logs",
        records=tmp_path / "records",
    )
    params = load_params(
        ROOT / "params.yaml",
        profile="default",
        overrides=[
            "benchmark.modes=[none, llamacpp, llamacpp_lookup]", "benchmark.concurrency=[1, 2]",
            "benchmark.mixed_concurrency=null", "benchmark.max_tokens=16",
            "benchmark.hf_baseline=false", "benchmark.warmup_requests=1",
            "benchmark.prompt_tokens=[16, 512]", "benchmark.rounds=2",
            "provision.threads=1",  # as the servers above: nothing here is timed
        ],
    )  # fmt: skip
    result = benchmark_stage(params, paths, tmp_path, log=lambda line: None, progress=False)
    cells = {(c["mode"], c["concurrency"]): c for c in result["cells"]}
    assert set(cells) == {(m, c) for m in ("none", "llamacpp", "llamacpp_lookup") for c in (1, 2)}
    for (mode, c), x in cells.items():
        assert x["errors"] == 0 and x["tok_s"] > 0 and len(x["tok_s_rounds"]) == 2
        assert (x["tau"] is None) == mode.startswith("llamacpp")
        # Greedy on the same prompts and weights: the same tokens, counted alike.
        assert x["tokens"] == cells[("none", c)]["tokens"], (mode, c)
    rows = result["vs_llamacpp"]
    assert [(r["concurrency"], r["workload"]) for r in rows] == [
        (1, "math_reasoning"),
        (2, "math_reasoning"),
    ]
    for r in rows:
        assert r["none_over_llamacpp"] > 0 and r["lookup_over_plain"] > 0
        assert r["best_mode"] == "none" and r["best_over_llamacpp"] == r["none_over_llamacpp"]
    assert "over llama.cpp plain, same weights" in paths.report.read_text()
    assert {"llamacpp", "llamacpp_lookup"} <= set(result["overall"])
    assert (paths.logs / "llamacpp_lookup.round2.log").is_file()
