"""`VllmServer`'s lifecycle and one-line errors against a stand-in server (no vLLM needed): a
missing venv names `make vllm-venv`, a taken port names the port, a server that dies shows its
last log lines, one that ignores SIGTERM is killed; and the load client reads vLLM's stream
shape (a last usage chunk with no choices)."""

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from dspark.serve.client import one_request
from dspark.servers import process, vllm_server
from dspark.servers.vllm_server import VllmError, VllmServer

FAKE = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture
def fake_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    python.chmod(0o755)
    return venv


@pytest.fixture
def target_dir(tmp_path) -> Path:
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "target.json").write_text(json.dumps({"kind": "gguf-package", "source": "x"}))
    return folder


def test_missing_venv_names_the_make_target(target_dir, tmp_path):
    with pytest.raises(VllmError, match=r"venv/bin/python: missing; run `make vllm-venv`"):
        VllmServer(target_dir, venv=tmp_path / "venv").start()


def test_a_taken_port_is_named(target_dir, fake_venv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(VllmError, match=rf"port {port} on 127.0.0.1 is in use"):
            VllmServer(target_dir, venv=fake_venv, port=port).start()


def test_a_dying_server_shows_its_log_tail(target_dir, fake_venv, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM", "die")
    log = tmp_path / "vllm.log"
    with pytest.raises(VllmError) as e:
        VllmServer(target_dir, venv=fake_venv, log=log).__enter__()
    msg = str(e.value)
    assert "\n" not in msg and "exited (3) while starting" in msg and str(log) in msg
    assert "ValueError: the model folder has no config.json" in msg


def test_not_ready_in_time_is_a_timeout_and_stop_ends_it(target_dir, fake_venv, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "hang")
    server = VllmServer(target_dir, venv=fake_venv).start()
    try:
        with pytest.raises(VllmError, match=r"no /health after 1 s; see .*vllm-.*\.log"):
            server.wait_ready(timeout=1.0)
        pid = server.proc.pid
    finally:
        server.stop()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_generate_round_trip_and_sigkill_on_stop(target_dir, fake_venv, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM", "ignore_term")
    record = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setattr(process, "STOP_TIMEOUT_S", 1.0)
    with VllmServer(target_dir, venv=fake_venv, max_model_len=256, max_num_seqs=4) as server:
        assert server.startup_s is not None
        out = server.generate([[1, 2, 3], [4, 5]], max_new_tokens=2, temperature=0.7, seed=9)
        assert out == [[3, 2], [5, 4]]  # in prompt order
        with pytest.raises(VllmError, match=r"HTTP 400: max_tokens is too large"):
            server.generate([[1]], max_new_tokens=500)
        pid = server.proc.pid
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    sent = json.loads(record.read_text().splitlines()[0])
    assert sent["return_token_ids"] is True and sent["model"] == "target"
    assert (sent["temperature"], sent["seed"], sent["max_tokens"]) == (0.7, 9, 2)


def test_argv_and_env(target_dir, fake_venv, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    server = VllmServer(target_dir, venv=fake_venv, port=1234, threads=2, kv_cache_gib=2)
    argv = server.argv("/models/t")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", "/models/t"), ("--dtype", "float32"), ("--port", "1234")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enforce-eager" in argv
    env = server.env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "PYTHONPATH" not in env


def test_a_draft_goes_to_vllm_as_its_speculative_config(target_dir, fake_venv):
    spec = {"method": "dflash", "model": "/exports/dflash", "num_speculative_tokens": 7}
    argv = VllmServer(target_dir, venv=fake_venv, speculative=spec).argv("/models/t")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    assert "--speculative-config" not in VllmServer(target_dir, venv=fake_venv).argv("/m")


# vLLM 0.32's /metrics page as prometheus_client writes its spec-decode counters (HELP and TYPE
# lines, a `_created` gauge beside each counter), with a second engine's positions to sum.
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7966690775104392e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",position="0"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_spec_decode_counters_are_read_from_vllms_metrics_page():
    c = vllm_server.parse_spec_decode(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (10, 30, 12)
    assert c.accepted_per_pos == (5, 4, 3)  # position 1 summed over both engines
    assert c.per_position == [0.5, 0.4, 0.3] and c.mean_acceptance_length == 2.2
    without = "\n".join(line for line in METRICS.splitlines() if "num_drafts" not in line)
    with pytest.raises(VllmError, match=r"no vllm:spec_decode_num_drafts \(is a draft"):
        vllm_server.parse_spec_decode(without)


def test_model_source_follows_the_manifest(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "target.json").write_text(json.dumps({"kind": "folder", "path": "/models/x"}))
    assert vllm_server.model_source(folder) == "/models/x"
    (folder / "target.json").write_text(json.dumps({"kind": "tiny-random"}))
    assert vllm_server.model_source(folder) == str(folder.resolve())


def test_default_venv_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPARK_VLLM_VENV", raising=False)
    assert vllm_server.default_venv(tmp_path) == tmp_path / ".venv-vllm"
    monkeypatch.setenv("DSPARK_VLLM_VENV", "/opt/v")
    assert vllm_server.default_venv(tmp_path) == Path("/opt/v")


def test_client_reads_vllms_stream_with_its_usage_chunk():
    """vLLM's completion stream: token ids per chunk (return_token_ids), then a usage chunk with
    `choices: []` (stream_options.include_usage), then [DONE]."""
    chunks = [
        {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "token_ids": [8, 9], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    ]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = {"id": "p", "prompt": [1, 2, 3]}
            return await one_request(client, "http://x", req, 3, "target", {"temperature": 0.0})

    rec = asyncio.run(go())
    assert "error" not in rec and rec["tokens"] == [7, 8, 9]
    assert [n for _, n in rec["chunks"]] == [1, 2]
    assert rec["finish"] == "length" and rec["completion_tokens"] == 3
    assert seen["return_token_ids"] and seen["stream_options"] == {"include_usage": True}
    assert seen["temperature"] == 0.0 and seen["model"] == "target"


def test_the_main_venv_never_imports_vllm():
    assert "vllm" not in sys.modules  # everything above ran without it
