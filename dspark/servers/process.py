"""A server run as a subprocess of its own venv: vLLM's and llama.cpp's OpenAI servers share how
they start (a free port, a log file), wait until ready (or say why they died), and stop.

A subclass names itself (`label`, `error`, `log_prefix`), where readiness is asked
(`ready_path`), builds its command in `command()` (checking what it needs first) and may add the
processes `stop` must also reach (`descendants`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from dspark.errors import DsparkError
from dspark.net import free_port
from dspark.procs import stop_processes

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


class ServerProcess:
    label = "server"  # in messages: "<label> exited ..."
    error: type[DsparkError] = DsparkError
    log_prefix = "server-"
    ready_path = "/health"
    not_ready = "no /health"  # "<label>: <not_ready> after N s"

    host: str
    port: int | None
    log: Path | None
    _own_log: bool
    proc: subprocess.Popen | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def descendants(self) -> list[int]:
        """Processes of the server's own that stopping it might leave behind."""
        return []

    def start(self):
        if self.proc is not None:
            return self
        argv = self.command()  # its checks first: nothing is made for a server that cannot run
        if self.log is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log = Path(name)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        with self.log.open("w") as out:
            # Same process group as ours: a group kill of a stage (dvc, Prefect) reaches it too.
            self.proc = subprocess.Popen(argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT)
        return self

    def take_port(self) -> None:
        if self.port is None:
            self.port = free_port(self.host)

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(errors="replace") if self.log else ""
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S):
        if self.proc is None:
            self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.error(
                    f"{self.label} exited ({self.proc.returncode}) while starting; {self.log}: "
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2.0).status_code == 200:
                    self.startup_s = round(time.monotonic() - self._t0, 1)
                    return self
            time.sleep(0.5)
        raise self.error(f"{self.label}: {self.not_ready} after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM, SIGKILL for whatever is left (and for `descendants` it could not stop)."""
        if self.proc is None:
            return
        kids = self.descendants()
        stop_processes([self.proc], grace=STOP_TIMEOUT_S)
        for pid in kids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
        self.proc = None
        if self._own_log and self.log is not None:
            self.log.unlink(missing_ok=True)

    def __enter__(self):
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
