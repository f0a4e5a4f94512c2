"""The run's standing services, started and stopped by PID: a Mooncake master, an MLflow
tracking server and the Prefect work pool's worker (`dspark serve`), as the spec asks.

State lives in one JSON file (name -> pid, argv, port, log), written atomically, so `down` and
`status` work from any later process. A service counts as up when its PID is alive and its port
accepts connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.errors import ResourceError
from dspark.infra.plan import trainer_node
from dspark.infra.spec import ClusterSpec
from dspark.io import write_json
from dspark.net import free_port
from dspark.transport.master import listening, master_binary


@dataclass
class Service:
    name: str
    argv: list[str]
    host: str
    port: int | None  # None: no port to wait for (a worker)
    env: dict[str, str] = field(default_factory=dict)


def wanted(spec: ClusterSpec, *, tracking_uri: str) -> list[Service]:
    """The services `spec` asks for, bound where they belong (the training node)."""
    trainer = trainer_node(spec)
    host = trainer.address or "127.0.0.1"
    prefix = ["ip", "netns", "exec", trainer.netns] if trainer.netns else []
    out = []
    s = spec.services
    if s.mooncake_master:
        port = free_port()
        out.append(
            Service(
                "mooncake-master",
                [
                    *prefix,
                    str(master_binary()),
                    f"--rpc_address={host}",
                    f"--rpc_port={port}",
                    f"--metrics_host={host}",  # its default is every interface
                    f"--metrics_port={free_port()}",
                    "--enable_http_metadata_server=false",
                    "--logtostderr=1",
                ],
                host,
                port,
            )
        )
    if s.mlflow_port is not None:
        port = s.mlflow_port or free_port()
        mlflow = Path(sys.executable).parent / "mlflow"
        out.append(
            Service(
                "mlflow",
                [
                    str(mlflow),
                    "server",
                    "--backend-store-uri",
                    tracking_uri,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--workers",
                    "1",
                ],
                "127.0.0.1",
                port,
            )
        )
    if s.prefect_pool:
        out.append(
            Service(
                "prefect-worker",
                [sys.executable, "-m", "dspark", "serve", "--pool", s.prefect_pool],
                "127.0.0.1",
                None,
            )
        )
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still has a PID; reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def read_state(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ResourceError(f"{path}: unreadable services state ({e})") from None


def up(services: list[Service], state_path: Path, logs: Path, timeout: float = 60.0) -> dict:
    """Start what is not running; wait for each port; on a failure stop what this call started."""
    state = read_state(state_path)
    logs.mkdir(parents=True, exist_ok=True)
    started = []
    for svc in services:
        have = state.get(svc.name)
        if have and _alive(have["pid"]):
            continue
        log = logs / f"{svc.name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                svc.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **svc.env},
                start_new_session=True,  # its own group: `down` stops it and its children
            )
        state[svc.name] = {**asdict(svc), "pid": proc.pid, "log": str(log)}
        started.append(svc.name)
        write_json(state_path, state)
        deadline = time.monotonic() + timeout
        while svc.port and not listening(svc.host, svc.port):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                down(state_path, only=started)
                raise ResourceError(
                    f"services: {svc.name} did not come up on {svc.host}:{svc.port}: {tail[0]}"
                )
            time.sleep(0.1)
    return state


def down(state_path: Path, only: list[str] | None = None) -> list[str]:
    """SIGTERM each service's process group, then SIGKILL what is left; forget them."""
    state = read_state(state_path)
    stopped = []
    for name in list(state):
        if only is not None and name not in only:
            continue
        pid = state[name]["pid"]
        if _alive(pid):
            _stop_group(pid)
        stopped.append(name)
        del state[name]
    write_json(state_path, state)
    return stopped


def _stop_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def status(state_path: Path) -> dict[str, dict]:
    state = read_state(state_path)
    for entry in state.values():
        entry["alive"] = _alive(entry["pid"])
        port = entry.get("port")
        entry["listening"] = bool(port) and listening(entry["host"], port)
    return state
