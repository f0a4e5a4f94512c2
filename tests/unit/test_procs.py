"""dspark.procs.stop: ask, then force; stopped processes resumed; groups ended whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dspark import procs

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# Ignores SIGTERM, then says it is ready (so the test does not race its handler's install).
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('ready', flush=True); time.sleep(60)",
]
# Cleans up on SIGTERM (exits 3), as the producers and ranks do.
CLEANS_UP = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3));"
    " print('ready', flush=True); time.sleep(60)",
]


def _ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _alive(pid: int) -> bool:
    """Running, not a zombie (this container's init may be slow to reap, or never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_running_process_ends_on_sigterm():
    p = subprocess.Popen(SLEEP)
    procs.stop([p], grace=5)
    assert p.returncode == -signal.SIGTERM


def test_a_stopped_process_is_resumed_so_its_sigterm_handler_runs():
    # A fatal SIGTERM ends even a stopped process; a handled one waits for SIGCONT.
    p = _ready(subprocess.Popen(CLEANS_UP, stdout=subprocess.PIPE, text=True))
    os.kill(p.pid, signal.SIGSTOP)
    procs.stop([p], grace=5)
    assert p.returncode == 3  # its handler ran: not killed after the grace period


def test_one_that_ignores_sigterm_is_killed_and_the_others_end_politely():
    stubborn = _ready(subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True))
    polite = subprocess.Popen(SLEEP)
    procs.stop([stubborn, polite], grace=0.5)
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode == -signal.SIGTERM


def test_exited_processes_are_only_reaped():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while p.poll() is None:
        time.sleep(0.01)
    procs.stop([p])
    assert p.returncode == 0


def test_group_stop_ends_what_the_child_started():
    # The child starts a grandchild in its own group and prints its pid.
    code = (
        "import subprocess, sys, time;"
        f"g = subprocess.Popen({SLEEP!r}); print(g.pid, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = int(p.stdout.readline())
    procs.stop([p], grace=5, group=True)
    assert p.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5  # the grandchild is init's to reap now
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
