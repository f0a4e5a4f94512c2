"""The benchmark's endpoints: `dspark endpoint` for one mode, as a subprocess on loopback,
with its health check and step counters. (`vllm_mode.VllmEndpoint` is the same for vLLM's own
server.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dspark.procs import stop_processes

READY_TIMEOUT_S = 900.0  # loading plus the adaptive mode's verify-cost profile


def server_env() -> dict[str, str]:
    """The environment a server process starts with: ours, plus huge pages for torch's CPU
    allocations unless THP_MEM_ALLOC_ENABLE is set already (0 turns them off). A decode step
    reads every weight once, so it is bound by memory: one-token steps of SmolLM2 took a median
    46.5 against 57.8 ms at one row and 73.9 against 83.1 at eight, each figure over 3 fresh
    processes (benchmarks/decode_step.py). torch reads the variable at its first allocation,
    which is why it goes in before the process starts. Training keeps 4 KB pages: measured side
    by side it gained nothing from huge pages (README, Serving: Huge pages)."""
    return {"THP_MEM_ALLOC_ENABLE": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


class EndpointProcess:
    """An endpoint (`dspark.serve.server`) for one mode, in this process group (a group kill
    reaches it), with its log in `log`. A context manager: the server is stopped, and its port
    freed, on exit."""

    client_args: tuple[str, ...] = ()  # what the load client adds for this server

    def __init__(
        self,
        mode: str,
        host: str,
        port: int,
        root: Path,
        log: Path,
        resolved: Path,
        target: Path,
        drafts: Path,
    ):
        self.mode, self.url = mode, f"http://{host}:{port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        env = server_env()
        argv = [sys.executable, "-m", "dspark.serve.server", str(resolved), mode, host, str(port)]
        argv += [str(target), str(drafts)]
        self.proc = subprocess.Popen(
            argv, cwd=root, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = " | ".join(self.log.read_text().strip().splitlines()[-3:])
                raise RuntimeError(f"endpoint {self.mode} exited ({self.proc.returncode}): {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"endpoint {self.mode}: not ready after {timeout:.0f} s ({self.log})")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/dspark/stats", timeout=10.0).json()

    def stop(self) -> None:
        stop_processes([self.proc], grace=30)
        self._log.close()

    def __enter__(self) -> EndpointProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
