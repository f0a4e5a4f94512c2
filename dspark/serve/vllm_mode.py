"""The benchmark's `none_vllm` mode: vLLM's own server on the target alone (no draft), driven by
the same load client as our endpoints, as a reference for our `none`.

Opt-in (it needs `make vllm-venv` and a minute or more to start on 2 cores):

    make vllm-venv
    dspark benchmark --set 'benchmark.modes=[none,none_vllm]'    # or add it in params.yaml

It serves with our endpoint's limits (serve.max_batch rows, serve.max_len positions) and the
client sends serve.temperature and serve.top_p in every request, since vLLM samples per request.
vLLM has no step counters: its cells show no tau and no step costs.
"""

from __future__ import annotations

from pathlib import Path

from dspark.config import Params
from dspark.servers.process import READY_TIMEOUT_S
from dspark.servers.vllm_server import SERVED_NAME, VllmServer, default_venv

MODE = "none_vllm"


class VllmEndpoint:
    """Shaped like endpoints.EndpointProcess: started on construction, then `wait_ready`, `stats`,
    `stop`; a context manager."""

    mode = MODE

    def __init__(self, params: Params, target_dir: Path, root: Path, host: str, log: Path):
        s = params.serve
        self.server = VllmServer(
            target_dir,
            venv=default_venv(root),
            host=host,
            dtype=params.target.dtype,
            max_model_len=s.max_len,
            max_num_seqs=s.max_batch,
            # provision.threads pins vLLM's compute threads too; unset, vLLM keeps a core for its
            # HTTP server (1 compute thread on 2 cores) as our endpoint takes every core.
            threads=params.provision.threads,
            seed=s.seed,
            log=log,
        ).start()
        self.url = self.server.url
        self.log = log
        self.client_args = ["--model", SERVED_NAME, "--temperature", str(s.temperature)]
        self.client_args += ["--top-p", str(s.top_p)]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        self.server.wait_ready(timeout)

    def stats(self) -> dict:
        return {"steps": 0, "draft_s": 0.0, "verify_s": 0.0}

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> VllmEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
