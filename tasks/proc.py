"""Child processes that die with their flow run.

Each child gets its own process group; whatever ends the caller (an exception, Prefect's
cancellation, SIGTERM) ends the whole group, so no stage process outlives its flow run or keeps
its ports.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from dspark.procs import stop_processes

GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the flow process is killed outright (SIGKILL runs no
    cleanup of ours). Linux only; elsewhere the group kill below is all there is."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def run(
    cmd: list[str],
    *,
    cwd: Path,
    env: dict | None = None,
    on_line: Callable[[str], None] | None = None,
    every: Callable[[], None] | None = None,
    every_s: float = 2.0,
    grace: float = GRACE_S,
) -> tuple[int, str]:
    """Run `cmd`, streaming its merged output to `on_line`; call `every` periodically.
    Stopping it (an error here, a cancellation) gives it `grace` seconds after SIGTERM.

    Returns (exit code, full output).
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        bufsize=1,
        preexec_fn=_die_with_parent,
    )
    lines: list[str] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            every()

    ticker = threading.Thread(target=tick, daemon=True) if every else None
    try:
        if ticker:
            ticker.start()
        for line in proc.stdout:
            lines.append(line)
            if on_line:
                on_line(line.rstrip("\n"))
        proc.wait()
    finally:
        stop.set()
        stop_processes([proc], grace=grace, group=True)
        if ticker:
            ticker.join(timeout=every_s + 1)
    if every:
        every()
    return proc.returncode, "".join(lines)
