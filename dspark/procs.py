"""Stopping child processes: the one way the stages end what they started.

A stop asks first and forces second: SIGCONT (a stopped process cannot run a SIGTERM handler,
such as our endpoint servers' shutdown), SIGTERM, one grace period shared by all of them, then
SIGKILL for whatever is left. With `group=True` the signals go to each child's process group
(children started with `start_new_session=True`), so helpers the child started end with it; the
group is signalled only while its leader runs, since a reaped leader's id may already name
someone else's group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable

KILL_WAIT_S = 5.0


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)  # a no-op once the process is reaped


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))


def stop_processes(
    procs: Iterable[subprocess.Popen], *, grace: float = 10.0, group: bool = False
) -> list[subprocess.Popen]:
    """End and reap every process in `procs`, in at most grace + KILL_WAIT_S seconds however
    many there are. Processes that already exited are only reaped.

    Returns the ones still running after SIGKILL (a process stuck in the kernel: rare, and
    nothing more can be done from here); normally empty.
    """
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGCONT, group)
        _signal(p, signal.SIGTERM, group)
    _wait_all(running, grace)
    stubborn = [p for p in running if p.poll() is None]
    for p in stubborn:
        _signal(p, signal.SIGKILL, group)
    _wait_all(stubborn, KILL_WAIT_S)
    return [p for p in stubborn if p.poll() is None]
