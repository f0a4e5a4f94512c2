"""dspark.procs.stop_processes: ask, then force; stopped processes resumed; one grace period
for all; groups ended whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.procs import alive, stop_processes
from tasks import proc
from tests.conftest import ROOT, skip_or_fail

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# Ignores SIGTERM, then says it is ready (so the test does not race its handler's install).
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('ready', flush=True); time.sleep(60)",
]
# Cleans up on SIGTERM (exits 3), as our endpoint servers do.
CLEANS_UP = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3));"
    " print('ready', flush=True); time.sleep(60)",
]


def _ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_running_process_ends_on_sigterm():
    p = subprocess.Popen(SLEEP)
    stop_processes([p], grace=5)
    assert p.returncode == -signal.SIGTERM


def test_a_stopped_process_is_resumed_so_its_sigterm_handler_runs():
    # A fatal SIGTERM ends even a stopped process; a handled one waits for SIGCONT.
    p = _ready(subprocess.Popen(CLEANS_UP, stdout=subprocess.PIPE, text=True))
    os.kill(p.pid, signal.SIGSTOP)
    stop_processes([p], grace=5)
    assert p.returncode == 3  # its handler ran: not killed after the grace period


def test_one_that_ignores_sigterm_is_killed_and_the_others_end_politely():
    stubborn = _ready(subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True))
    polite = subprocess.Popen(SLEEP)
    assert stop_processes([stubborn, polite], grace=2) == []
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode == -signal.SIGTERM


def test_the_grace_period_is_shared_not_one_each():
    stubborn = [
        _ready(subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True)) for _ in range(3)
    ]
    t0 = time.monotonic()
    stop_processes(stubborn, grace=2)
    # One shared period: about 2 s. One each would take 6 s or more.
    assert time.monotonic() - t0 < 5
    assert all(p.returncode == -signal.SIGKILL for p in stubborn)


def test_exited_processes_are_only_reaped():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while p.poll() is None:
        time.sleep(0.01)
    stop_processes([p])
    assert p.returncode == 0


def _leader(child: list[str], ignore_term: bool) -> tuple[subprocess.Popen, int]:
    """A group leader (SIGTERM ignored or not) that starts `child` in its group and waits for its
    "ready"; returns the leader and the child's pid."""
    code = (
        "import signal, subprocess, time;"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN);" if ignore_term else "")
        + f"g = subprocess.Popen({child!r}, stdout=subprocess.PIPE, text=True);"
        + "g.stdout.readline(); print(g.pid, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    return p, int(p.stdout.readline())


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5  # the grandchild is init's to reap now
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_group_stop_ends_what_the_child_started():
    p, grandchild = _leader(CLEANS_UP, ignore_term=False)
    stop_processes([p], grace=5, group=True)
    assert p.returncode == -signal.SIGTERM
    assert _gone(grandchild)


def test_group_stop_kills_a_group_that_ignores_sigterm():
    p, grandchild = _leader(STUBBORN, ignore_term=True)
    assert stop_processes([p], grace=1, group=True) == []
    assert p.returncode == -signal.SIGKILL
    assert _gone(grandchild)


# Checkpoints for a while after SIGTERM (as the trainer does), talking a lot (more than a
# pipe holds), then exits 143.
CHECKPOINTS = """
import signal, sys, time
from pathlib import Path
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
print("ready", flush=True)
while not asked:
    time.sleep(0.01)
for i in range(3000):
    print("saving", "x" * 100, flush=True)
time.sleep(1.0)
Path(sys.argv[1]).write_text("saved")
sys.exit(143)
"""
# Runs it and dies of SIGTERM at once, as `dvc repro` does.
WRAPPER = "import subprocess, sys; subprocess.call(sys.argv[1:])"


def test_a_stage_run_is_given_its_grace_to_finish_when_the_caller_stops(tmp_path):
    """tasks.proc.run: whatever stops the caller (here `on_line` raising, as Prefect's
    cancellation does) signals the child's group and waits `grace` for all of it, not just
    the wrapper at its head, reading its output meanwhile; then kills what is left."""

    class Cancelled(Exception):
        pass

    def cancel(_line: str) -> None:
        raise Cancelled

    for grace, saved in ((20.0, True), (0.3, False)):
        out = tmp_path / f"saved-{grace}"
        stage = [sys.executable, "-c", CHECKPOINTS, str(out)]
        t0 = time.monotonic()
        with pytest.raises(Cancelled):
            proc.run(
                [sys.executable, "-c", WRAPPER, *stage], cwd=tmp_path, on_line=cancel, grace=grace
            )
        assert out.exists() == saved, f"grace {grace}"
        assert time.monotonic() - t0 < grace + 10


def test_a_session_leader_gives_its_autogroup_its_niceness():
    """A child in a session of its own (as the producers and flow-run stages are) carries its
    niceness into the session's autogroup, which is what the scheduler shares CPU by; in the
    caller's session it leaves the caller's autogroup alone. (A session inside a cgroup with its
    own CPU controller, as in CI, reads an empty autogroup file: only autogroups are shown.)"""
    if not Path("/proc/self/autogroup").exists():
        skip_or_fail("no autogroup scheduling (/proc/self/autogroup)")
    code = (
        "from dspark.procs import adopt_niceness; adopt_niceness(); "
        "print(open('/proc/self/autogroup').read().strip())"
    )
    argv = ["nice", "-n", "7", sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    alone = subprocess.run(argv, capture_output=True, text=True, env=env, start_new_session=True)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.strip().endswith("nice 7"), alone.stdout
    before = Path("/proc/self/autogroup").read_text()
    inside = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == before.strip()  # the child shares ours...
    assert Path("/proc/self/autogroup").read_text() == before  # ...and left it untouched
