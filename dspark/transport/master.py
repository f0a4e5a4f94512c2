"""Start and stop a local `mooncake_master` (shipped in the Mooncake wheel) by PID."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.net import free_port
from dspark.procs import stop_processes
from dspark.transport.control import warn_if_exposed
from dspark.transport.stores import TransportError


def master_binary() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise TransportError("mooncake: package mooncake-transfer-engine-non-cuda is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file():
        raise TransportError(f"mooncake: {path} is missing")
    return path


def listening(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def listens_on(pid: int, port: int) -> bool:
    """True when process `pid` itself holds a socket listening on TCP `port`, in its own
    network namespace. A connection is no proof: between choosing a free port and the child
    binding it, another process may have taken it (Linux's /proc)."""
    wanted = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue  # tcp6 is absent where IPv6 is off
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                wanted.add(f"socket:[{inode}]")
    if not wanted:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):  # an fd closed while we look
            if os.readlink(fd) in wanted:
                return True
    return False


@dataclass
class MooncakeMaster:
    """A running master; `address` is what stores pass as `master_server_address`."""

    host: str
    port: int
    metrics_port: int
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def start(
        cls,
        host: str = "127.0.0.1",
        port: int = 0,
        log: Path | None = None,
        ready_timeout: float = 15.0,
    ) -> MooncakeMaster:
        warn_if_exposed(host, "mooncake_master")
        port = port or free_port(host)
        metrics_port = free_port(host)
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [
                str(master_binary()),
                f"--rpc_address={host}",
                f"--rpc_port={port}",
                f"--metrics_host={host}",
                f"--metrics_port={metrics_port}",
                "--enable_http_metadata_server=false",
                "--logtostderr=1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        master = cls(host, port, metrics_port, proc)
        deadline = time.monotonic() + ready_timeout
        while not listens_on(proc.pid, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                master.stop()
                raise TransportError(f"mooncake_master did not start on {host}:{port}")
            time.sleep(0.05)
        return master

    def stop(self) -> None:
        stop_processes([self.process], group=True)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
