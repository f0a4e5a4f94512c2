"""`dspark endpoint` on the tiny target, over real HTTP: OpenAI-shaped answers (plain and
streamed, the same tokens as transformers' greedy generate), a 4xx naming the field for every
malformed request, a client that hangs up mid-stream costs the server nothing; and the
benchmark stage end to end, stopping its server (and freeing the port) when it is terminated."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from dspark.config import load_params
from dspark.serve.bench import BenchPaths, benchmark_stage
from tests.conftest import ROOT, write_jsonl
from tests.unit.test_spec_decode import save_trained_drafts

PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]


@pytest.fixture(scope="module")
def workdir(tiny_target, tiny_target_dir, tmp_path_factory):
    """A folder laid out like the repo's: artifacts/target and artifacts/drafts."""
    root = tmp_path_factory.mktemp("serve")
    (root / "artifacts").mkdir()
    (root / "artifacts" / "target").symlink_to(tiny_target_dir)
    save_trained_drafts(tiny_target, root / "artifacts" / "drafts")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def endpoint_argv(mode: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "dspark", "endpoint", "--params", str(ROOT / "params.yaml"),
        "--profile", "smoke", "--mode", mode, "--port", str(port),
    ]  # fmt: skip


def start_endpoint(workdir, mode: str) -> tuple[subprocess.Popen, str, int]:
    """`dspark endpoint --mode MODE` on a free port, once healthy -> (process, url, port)."""
    port = free_port()
    proc = subprocess.Popen(
        endpoint_argv(mode, port),
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the endpoint did not become healthy"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url, port
        except httpx.HTTPError:
            time.sleep(0.3)


@pytest.fixture(scope="module")
def server(workdir):
    proc, url, port = start_endpoint(workdir, "dspark_adaptive")
    yield url
    proc.terminate()
    proc.wait(30)
    assert port_is_free(port)


def greedy(tiny_target, ids, n):
    with torch.no_grad():
        out = tiny_target.model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tiny_target.eos_token_id,
            pad_token_id=tiny_target.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def stream_chunks(url, body):
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    return chunks


def test_completion_is_openai_shaped_and_the_targets_greedy_output(server, tiny_target):
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["object"] == "model"
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
    choice = doc["choices"][0]
    assert choice["token_ids"] == greedy(tiny_target, PROMPT, 12)
    assert choice["finish_reason"] in ("stop", "length")
    assert doc["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(choice["token_ids"]),
        "total_tokens": len(PROMPT) + len(choice["token_ids"]),
    }
    assert doc["dspark"]["steps"] >= 1
    text = httpx.post(f"{server}/v1/completions", json={"prompt": "Hello there", "max_tokens": 4})
    assert text.status_code == 200 and isinstance(text.json()["choices"][0]["text"], str)


def test_streaming_gives_the_same_tokens_then_done(server):
    body = {"prompt": PROMPT, "max_tokens": 12}
    whole = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
    chunks = stream_chunks(server, body)
    assert chunks[-1] == "[DONE]"
    docs = [json.loads(c) for c in chunks[:-1]]
    assert [t for d in docs for t in d["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(d["choices"][0]["text"] for d in docs) == whole["text"]
    assert docs[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert all(d["choices"][0]["finish_reason"] is None for d in docs[:-1])


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": [], "max_tokens": 4}, 400, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": PROMPT, "n": 2}, 400, "n"),
        ({"prompt": PROMPT, "stop": ["\n"]}, 400, "stop"),
        ({"prompt": PROMPT, "temperature": 0.7}, 400, "temperature"),
        ({"prompt": [1, 10**9], "max_tokens": 4}, 400, "token id"),
        ({"prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
        ({"prompt": [7] * 5000, "max_tokens": 1}, 400, "longer than this server's window"),
    ],
)
def test_malformed_requests_get_a_4xx_naming_the_field(server, body, status, names):
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert names in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_fields_are_accepted_and_named(server, tiny_target):
    """As vLLM does, a field this server does not know does not fail the request; unlike a
    silent accept, the response names it (`dspark.ignored`), streamed or not."""
    body = {"prompt": PROMPT, "max_tokens": 4, "user": "u1", "presence_penalty": 0.5}
    doc = httpx.post(f"{server}/v1/completions", json=body).json()
    assert doc["choices"][0]["token_ids"] == greedy(tiny_target, PROMPT, 4)
    assert doc["dspark"]["ignored"] == ["presence_penalty", "user"]
    last = json.loads(stream_chunks(server, body)[-2])
    assert last["dspark"]["ignored"] == ["presence_penalty", "user"]
    plain = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert plain.json()["dspark"]["ignored"] == []


def test_invalid_json_is_a_400(server):
    r = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_client_hanging_up_mid_stream_frees_its_row(server):
    body = {"prompt": PROMPT, "max_tokens": 900, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        next(r.iter_lines())  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/v1/dspark/stats").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server}/v1/dspark/stats").json()["busy"] == 0
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert ok.status_code == 200 and httpx.get(f"{server}/health").status_code == 200


def test_port_in_use_is_a_one_line_error(workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run(
            endpoint_argv("none", port), cwd=workdir, capture_output=True, text=True
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"dspark: error: serve.port: 127.0.0.1:{port} is not available (in use)"
    ]


class _IdleEngine:
    """Stands in for the serving engine: runs until stopped."""

    def __init__(self):
        self.stopped = threading.Event()

    def run(self):
        self.stopped.wait(30)

    def stop(self):
        self.stopped.set()


def _serve_without_a_model(monkeypatch, port, on_build=None, http_run=None):
    import uvicorn

    from dspark.serve import app, server

    def build(*_args):
        if on_build:
            on_build()
        return server.Served(_IdleEngine(), None, "idle", "none", None)

    monkeypatch.setattr(server, "build", build)
    monkeypatch.setattr(app, "create_app", lambda *_args: None)
    monkeypatch.setattr(server.signal, "signal", lambda *_args: None)  # the test's own handlers
    if http_run:
        monkeypatch.setattr(uvicorn.Server, "run", http_run)
    params = load_params(ROOT / "params.yaml", profile="smoke")
    server.serve(params, ROOT, ROOT, "none", "127.0.0.1", port)


def test_the_port_is_held_while_the_model_loads(monkeypatch):
    port = free_port()
    seen = []

    def on_build():
        seen.append(port_is_free(port))
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        _serve_without_a_model(monkeypatch, port, on_build=on_build)
    assert seen == [False]
    assert port_is_free(port)  # released when the endpoint fails


def test_the_endpoint_fails_when_its_http_server_dies(monkeypatch):
    from dspark.errors import ResourceError

    def dies(self, sockets=None):
        return  # as uvicorn's thread ends when it cannot start (there by sys.exit)

    with pytest.raises(ResourceError, match=r"HTTP server on 127\.0\.0\.1:\d+ stopped on its own"):
        _serve_without_a_model(monkeypatch, free_port(), http_run=dies)


def bench_prompts(path):
    words = "Tom has {} apples and buys {} more, then gives away {}. How many apples are left?"
    rows = [
        {"id": f"m{i}", "category": "math_reasoning", "prompt": words.format(i, i + 3, i + 1)}
        for i in range(4)
    ] + [{"id": "w", "category": "writing", "prompt": "Write two lines about the sea and rain."}]
    return write_jsonl(path, rows)


def bench_params(*extra):
    return load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            "benchmark.modes=[none, dspark_fixed, dspark_adaptive]",
            "benchmark.concurrency=[1, 2]",
            "benchmark.max_tokens=8",
            "benchmark.prompt_tokens=[16, 512]",
            *extra,
        ],
    )


class _Stop(Exception):
    pass


def _stop_at(marker: str, lines: list[str]):
    """A log that keeps the lines and stops the stage at the first one containing `marker`."""

    def log(line: str) -> None:
        lines.append(line)
        if marker in line:
            raise _Stop

    return log


def test_benchmark_stage(workdir, tmp_path):
    paths = BenchPaths(
        target=workdir / "artifacts" / "target",
        drafts=workdir / "artifacts" / "drafts",
        prompts=bench_prompts(tmp_path / "p.jsonl"),
        plots=tmp_path / "plots",
        report=tmp_path / "report.md",
        logs=tmp_path / "logs",
        records=tmp_path / "records",
    )
    # Two rounds, each on freshly started endpoints and starting from the next mode. Stopped
    # while measuring round 1's last cell (c=2 mix), then after measuring everything: each
    # rerun measures only what was not recorded, and the last one starts no endpoint at all.
    params = bench_params("benchmark.rounds=2")
    first, second, lines = [], [], []
    with pytest.raises(_Stop):
        benchmark_stage(params, paths, workdir, log=_stop_at("mix ", first))
    with pytest.raises(_Stop):
        benchmark_stage(params, paths, workdir, log=_stop_at("predicted single-stream", second))
    assert sum("recorded by an earlier run" in line for line in second) == 2
    measured = [tuple(line.split()[1:5]) for line in second if " tok/s, TTFT p50 " in line]
    one, two = (
        ["none", "dspark_fixed", "dspark_adaptive"],
        ["dspark_fixed", "dspark_adaptive", "none"],
    )
    cells = [("c=1", "math_reasoning"), ("c=2", "math_reasoning"), ("c=2", "mix")]
    assert measured == [  # round 1's mix cell, then all of round 2, in each round's order
        *(("1/2:", mode, "c=2", "mix") for mode in one),
        *(("2/2:", mode, *cell) for cell in cells for mode in two),
    ]
    # Three starts of every endpoint: round 1 in each of the first two runs, then round 2.
    assert sum(line.startswith("benchmark: starting none") for line in first + second) == 3
    for turn in (1, 2):
        log = (tmp_path / "logs" / f"dspark_adaptive.round{turn}.log").read_text()
        assert "dspark endpoint: dspark_adaptive on http://" in log
    result = benchmark_stage(params, paths, workdir, log=lines.append)
    assert lines[0] == "all 3 cells recorded by an earlier run: nothing to measure"
    assert not any(" tok/s, TTFT p50 " in line for line in lines)
    assert not any(line.startswith("benchmark: starting") for line in lines)
    # A round's runs: none_hf and 3 modes at c=1, 3 at c=2, 3 mixed.
    assert result["resumed_cells"] == 2 * 10
    assert not list((tmp_path / "records").glob("*.jsonl"))  # finished: nothing to resume

    cells = result["cells"]
    modes = {"none_hf", "none", "dspark_fixed", "dspark_adaptive"}
    assert {c["mode"] for c in cells} == modes
    sweep = [c for c in cells if c["mode"] != "none_hf"]
    assert sorted((c["concurrency"], c["workload"]) for c in sweep if c["mode"] == "none") == [
        (1, "math_reasoning"), (2, "math_reasoning"), (2, "mix"),
    ]  # fmt: skip
    assert all(len(c["tok_s_rounds"]) == 2 for c in cells)
    for c in sweep:
        assert c["errors"] == 0 and c["requests"] >= 4 and c["tokens"] > 0
        for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tau"):
            assert c[key] is not None and c[key] > 0, (c["mode"], key)
        assert c["tau"] >= 1.0 and 0 <= c["draft_share"] < 1
        # A step's parts add up to it (each rounded to 0.01 ms); prefill and the rest beside.
        parts = sum(c[f"{p}_ms"] for p in ("draft", "verify", "accept", "schedule"))
        assert parts == pytest.approx(c["step_ms"], rel=0.01, abs=0.05), c["mode"]
        assert c["prefill_ms"] > 0 and c["other_ms"] > -0.05
        assert c["cost_model"] is (c["mode"] == "dspark_adaptive")
    assert all(c["tau"] == 1.0 for c in sweep if c["mode"] == "none")
    assert result["predicted_speedup_c1"] > 0
    crossover = result["crossover_concurrency"]
    assert crossover is None or crossover in (1, 2)
    assert set(result["overall"]) == {"none", "dspark_fixed", "dspark_adaptive"}
    # Profiled at each start: the second start's table, and the first's for the cells it ran.
    table = result["verify_cost"]["dspark_adaptive"]
    assert table["tokens"][0] == 1 and len(table["ms"]) == len(table["tokens"]) >= 2
    assert [set(t) for t in result["verify_cost_earlier"]] == [{"dspark_adaptive"}] * 2
    assert {"single_stream", "adaptive_loses_nowhere", "ttft_overhead"} <= set(result["goals"])
    assert (tmp_path / "plots" / "bench.png").stat().st_size > 0
    assert "tok/s" in (tmp_path / "report.md").read_text()
    assert "ms per engine step" in (tmp_path / "report.md").read_text()
    assert any("dspark_adaptive" in line for line in first)


def test_terminating_the_benchmark_stops_its_server(workdir, tmp_path):
    """What a cancelled flow does to the stage (SIGTERM): the endpoint exits, its port frees."""
    prompts = bench_prompts(tmp_path / "p.jsonl")
    logs = workdir / "logs" / "bench"
    for f in logs.glob("*.log"):
        f.unlink()
    argv = [
        sys.executable, "-m", "dspark", "benchmark", "--params", str(ROOT / "params.yaml"),
        "--profile", "smoke", "--prompts", str(prompts), "--no-progress",
        "--set", "benchmark.modes=[none]", "--set", "benchmark.max_tokens=900",
        "--set", "benchmark.prompt_tokens=[16, 512]", "--set", "benchmark.hf_baseline=false",
    ]  # fmt: skip
    bench = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = logs / "none.log"
    deadline = time.monotonic() + 180
    port = None
    while port is None and time.monotonic() < deadline:
        assert bench.poll() is None, bench.stdout.read().decode()
        text = log.read_text() if log.exists() else ""
        if "http://127.0.0.1:" in text:
            port = int(text.split("http://127.0.0.1:")[1].split()[0])
        time.sleep(0.2)
    assert port is not None

    def busy():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/dspark/stats").json()["busy"]
        except httpx.HTTPError:
            return 0

    while not busy() and time.monotonic() < deadline:
        time.sleep(0.1)  # wait for the cell to be running
    assert busy()
    os.kill(bench.pid, signal.SIGTERM)
    assert bench.wait(60) != 0
    deadline = time.monotonic() + 30
    while not port_is_free(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert port_is_free(port)
    assert not (workdir / "metrics" / "bench.json").exists()
