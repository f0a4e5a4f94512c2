"""Real services on loopback: a Prefect server, a serving worker, DVC in a copied repo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dspark.procs import stop_processes

from ..conftest import BIN, copy_repo, tool_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(repo: Path, env: dict, log) -> subprocess.Popen:
    """`dspark serve` in the repo copy, in a session of its own, its output in `log`."""
    return subprocess.Popen(
        [str(BIN / "dspark"), "serve"],
        cwd=repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen, wait: float = 20) -> None:
    """Stop a service started in its own session, with everything it started."""
    stop_processes([proc], grace=wait, group=True)


def wait_for(check, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout} s")


@pytest.fixture
def repo(tmp_path) -> Path:
    return copy_repo(tmp_path / "repo")


@pytest.fixture
def prefect_server(tmp_path):
    """A real Prefect server on 127.0.0.1 with its own PREFECT_HOME; yields the env to use it."""
    port = free_port()
    env = tool_env(
        PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false"
    )
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"

    def healthy():
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 120, "prefect server health")
        yield {
            **env,
            "PREFECT_API_URL": api,
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
        }
    finally:
        stop(proc)
        log.close()


def processes_in(folder: Path) -> list[str]:
    """Command lines of live processes whose working directory is inside `folder`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cwd.startswith(str(folder)) and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


__all__ = ["BIN", "free_port", "processes_in", "run", "stop", "sys", "wait_for"]
