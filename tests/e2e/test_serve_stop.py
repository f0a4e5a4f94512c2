"""`dspark serve` stopped the way systemd, supervisord or a container runtime stops it: SIGTERM
to its PID alone. Everything it started goes with it, within a bounded time: the worker and a
flow run it is running, with that run's stage, each in a process group or session of its own.
"""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from dspark.procs import KILL_WAIT_S, SETTLE_S, alive
from flows.serve import STOP_GRACE_S

from .conftest import BIN, processes_in, run, start_serve, stop, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def tree(pid: int) -> dict[int, str]:
    """The live descendants of `pid` and their command lines, from /proc."""
    parent, cmd = {}, {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z":
            parent[int(d.name)], cmd[int(d.name)] = int(ppid), line
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child in (c for c, pp in parent.items() if pp == p):
            found[child] = cmd[child]
            frontier.append(child)
    return found


def test_sigterm_stops_dspark_serve_and_everything_it_started(repo, prefect_server, tmp_path):
    # Enough work that the prepare stage is still running when the service is stopped.
    params = repo / "params.yaml"
    params.write_text(
        params.read_text().replace("      num_samples: 8\n", "      num_samples: 400\n", 1)
    )
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = start_serve(repo, prefect_server, log)
    try:

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"dspark serve exited: {log_path.read_text()}")
            return "started!" in log_path.read_text()

        wait_for(ready, 120, "deployment dspark/full served", every=2)
        cmd = [str(BIN / "prefect"), "deployment", "run", "dspark/full"]
        res = run([*cmd, "--param", "profile=smoke"], repo, prefect_server)
        assert res.returncode == 0, res.stdout + res.stderr
        assert re.search(r"UUID: ([0-9a-f-]{36})", res.stdout + res.stderr)
        wait_for(
            lambda: any("dspark prepare" in p for p in processes_in(repo)),
            240,
            "the prepare stage to start",
            every=1,
        )
        # `dspark serve` is flows.serve itself (one PID to signal), and what it started sits
        # in sessions of its own: no group signal reaches it all.
        own = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "flows.serve" in own, own
        started = tree(proc.pid)
        assert any("prefect worker start" in c for c in started.values()), started
        assert any("dspark prepare" in c for c in started.values()), started
        assert len({os.getsid(p) for p in started if alive(p)}) >= 3, started

        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        bound = STOP_GRACE_S + SETTLE_S + KILL_WAIT_S
        proc.wait(timeout=bound + 10)
        took = time.monotonic() - t0
        print(f"dspark serve stopped in {took:.1f} s (bound {bound:.0f} s); its log ends:")
        print(*log_path.read_text().splitlines()[-15:], sep="\n")
        left = {p: c for p, c in started.items() if alive(p)}
        assert left == {} and processes_in(repo) == [], (left, processes_in(repo))
        assert proc.returncode == 0, log_path.read_text()[-2000:]
        # Nothing was waiting out the grace period: every part stopped when asked.
        assert took < 60, log_path.read_text()[-2000:]
    finally:
        stop(proc)
        log.close()
