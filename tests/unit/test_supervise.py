"""dspark.procs.supervise, as `dspark serve` runs the Prefect worker: SIGTERM to the supervisor
stops the whole tree (the worker, its jobs, what they started in sessions of their own, even
orphaned), politely first and within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.procs import KILL_WAIT_S, TREE_ENV, alive, marked, with_mark

# A worker like Prefect's: each job in a session of its own; on SIGINT it takes no new job and
# waits for the ones it runs.
WORKER = """
import os, signal, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
job = subprocess.Popen([sys.executable, f"{out}/job.py", out, mode], start_new_session=True)
while not stop:
    time.sleep(0.05)
job.wait()
"""
# A flow run: runs its stage in a session of its own and stops it on SIGTERM; a careless one
# leaves it behind, orphaned.
JOB = """
import os, signal, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
stage = subprocess.Popen([sys.executable, f"{out}/stage.py", out, mode], start_new_session=True)
def on_term(*_):
    if mode == "polite":
        stage.terminate()
        stage.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(0.05)
"""
# The stage: says where it is once the tree is up; a stubborn one ignores SIGTERM.
STAGE = """
import os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(f"{out}/tree.tmp", "w") as f:
    f.write(f"{os.getppid()} {os.getpid()}")
os.rename(f"{out}/tree.tmp", f"{out}/tree")
while True:
    time.sleep(0.05)
"""
SUPERVISOR = """
import signal, sys
from dspark.procs import supervise
out, mode, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
argv = [sys.executable, f"{out}/worker.py", out, mode]
sys.exit(supervise(argv, grace=grace, settle=1.0, ask=signal.SIGINT))
"""


def _tree(out: Path, mode: str, grace: float) -> tuple[subprocess.Popen, list[int]]:
    for name, text in (("worker", WORKER), ("job", JOB), ("stage", STAGE)):
        (out / f"{name}.py").write_text(text)
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(out), mode, str(grace)],
        start_new_session=True,  # as systemd starts it: its own group, signalled alone
    )
    deadline = time.monotonic() + 60
    while not (out / "tree").exists():
        assert sup.poll() is None and time.monotonic() < deadline, "the tree did not come up"
        time.sleep(0.1)
    job, stage = map(int, (out / "tree").read_text().split())
    worker = int(Path(f"/proc/{job}/stat").read_text().rsplit(")", 1)[1].split()[1])
    # Each in a session of its own: no group signal reaches them all.
    assert len({os.getsid(p) for p in (sup.pid, worker, job, stage)}) == 4
    return sup, [worker, job, stage]


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_sigterm_stops_the_whole_tree(tmp_path, mode):
    # Polite: everything stops when asked, well inside a grace period long enough that a loaded
    # machine cannot cross it. Stubborn: the grace period is waited out, so it is kept short.
    grace = 20.0 if mode == "polite" else 3.0
    sup, pids = _tree(tmp_path, mode, grace)
    t0 = time.monotonic()
    os.kill(sup.pid, signal.SIGTERM)  # the supervisor alone, as systemd or `docker stop` does
    try:
        rc = sup.wait(timeout=grace + 1.0 + KILL_WAIT_S + 10)
    finally:
        for pid in pids:  # whatever happens, leave nothing behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert rc == 0
    assert [p for p in pids if alive(p)] == []
    if mode == "polite":  # every part stopped when asked: no waiting out the grace period
        assert took < grace
    else:  # the orphaned stage ignored SIGTERM: killed once the grace period was over
        assert grace <= took < grace + 1.0 + KILL_WAIT_S + 30


def test_a_mark_is_inherited_and_nested_marks_add_up():
    env, outer = with_mark()
    env, inner = with_mark(env)
    assert env[TREE_ENV].split()[-2:] == [outer, inner]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in marked(outer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in marked(outer) and child.pid in marked(inner)
        assert marked(f"{outer}x") == []
    finally:
        child.kill()
        child.wait()
    assert child.pid not in marked(outer)
