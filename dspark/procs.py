"""Stopping child processes: the one way the stages end what they started.

A stop asks first and forces second: SIGCONT (a stopped process cannot run a SIGTERM handler,
such as our endpoint servers' shutdown), SIGTERM, one grace period shared by all of them, then
SIGKILL for whatever is left. With `group=True` the signals go to each child's process group
(children started with `start_new_session=True`), so helpers the child started end with it, and
the stop waits for every member, not just the child: a wrapper such as `dvc repro` dies on
SIGTERM at once while the stage it ran is still saving its work. A group is signalled only while
it has live members (Linux keeps its id from being reused until then).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

KILL_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec (`preexec_fn`): get SIGTERM if the parent dies, even of SIGKILL,
    which runs no cleanup of ours. Linux only; elsewhere group stops are all there is."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        proc.send_signal(sig)  # a no-op once the process is reaped


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if state != "Z" and int(pgrp) == pgid:
            members.append(int(stat.parent.name))
    return members


def _stop_groups(leaders: list[subprocess.Popen], grace: float) -> list[subprocess.Popen]:
    for p in leaders:
        p.poll()
    live = [p.pid for p in leaders if group_members(p.pid)]
    for pgid, sig in ((g, s) for g in live for s in (signal.SIGCONT, signal.SIGTERM)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for seconds, then in ((grace, signal.SIGKILL), (KILL_WAIT_S, None)):
        deadline = time.monotonic() + seconds
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            for p in leaders:
                p.poll()  # a leader is a member until reaped
            live = [g for g in live if group_members(g)]
        for pgid in live if then else ():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, then)
    _wait_all(leaders, 0.0)
    return [p for p in leaders if p.pid in live]


def stop_processes(
    procs: Iterable[subprocess.Popen], *, grace: float = 10.0, group: bool = False
) -> list[subprocess.Popen]:
    """End and reap every process in `procs` (with `group`, every member of their groups), in
    at most grace + KILL_WAIT_S seconds however many there are. Processes that already exited
    are only reaped.

    Returns the ones still running after SIGKILL (a process stuck in the kernel: rare, and
    nothing more can be done from here); normally empty.
    """
    if group:
        return _stop_groups(list(procs), grace)
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGCONT)
        _signal(p, signal.SIGTERM)
    _wait_all(running, grace)
    stubborn = [p for p in running if p.poll() is None]
    for p in stubborn:
        _signal(p, signal.SIGKILL)
    _wait_all(stubborn, KILL_WAIT_S)
    return [p for p in stubborn if p.poll() is None]
