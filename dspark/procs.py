"""Stopping child processes: the one way every stage ends what it started.

A stop asks first and forces second: SIGCONT (a stopped process cannot run its SIGTERM handler;
the producers and ranks clean up in theirs), SIGTERM, one grace period shared by all of them,
then SIGKILL for whatever is left. With `group=True` the signals go to each child's process group
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
            os.kill(proc.pid, sig)


def stop(procs: Iterable[subprocess.Popen], *, grace: float = 10.0, group: bool = False) -> None:
    """End every process in `procs` and reap it; returns once all have exited.

    Processes that already exited are only reaped. `grace` seconds is the wait after SIGTERM,
    shared by all of them, so stopping n processes takes at most grace + KILL_WAIT_S, not n times.
    """
    procs = list(procs)
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGCONT, group)
        _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + grace
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in running:
        if p.poll() is None:
            _signal(p, signal.SIGKILL, group)
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(KILL_WAIT_S)
