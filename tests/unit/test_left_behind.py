"""The suite's session-end check (tests/conftest.py): a process a test leaves running, even in
a session of its own, is reported, killed, and fails the run, with or without xdist workers
(which are not themselves reported)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.procs import alive
from tests.conftest import ROOT

CONFTEST = (
    "from tests.conftest import pytest_configure, pytest_sessionfinish, pytest_testnodedown\n"
)
LEAKS = """
import os, subprocess, sys

def test_leaks():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
    with open(os.environ["LEAKED"], "w") as f:
        f.write(str(p.pid))
"""
CLEAN = """
import subprocess, sys
from multiprocessing import resource_tracker

def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    # multiprocessing's own helper for this process (torch starts it): it ends with pytest.
    resource_tracker.ensure_running()
"""


def _pytest(folder: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_it.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LEAKED": str(folder / "leaked")}
    env["DSPARK_TEST_LEFT_WAIT_S"] = "1"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    return subprocess.run(
        [*argv, "--rootdir", str(folder), "--basetemp", str(folder / "base"), *args, "test_it.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("workers", [["-p", "no:xdist"], ["-n", "1"]], ids=["plain", "xdist"])
def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path, workers):
    res = _pytest(tmp_path, LEAKS, *workers)
    out = res.stdout + res.stderr
    pid = int((tmp_path / "leaked").read_text())
    try:
        # (Once, beside a loaded CI run, both cases passed with nothing reported: whether the
        # leaked process was still there says if the check missed it or something else ended it.)
        assert res.returncode == 1, f"{out}\nleaked process {pid} alive after the run: {alive(pid)}"
        assert "processes the tests left running (now killed)" in out, out
        assert f"{pid}: " in out and "time.sleep(120)" in out, out
        assert out.count("time.sleep(120)") == 1  # and nothing else: not the xdist worker
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid)
    finally:
        if alive(pid):
            os.kill(pid, 9)


def test_a_clean_run_passes(tmp_path):
    res = _pytest(tmp_path, CLEAN, "-n", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "left running" not in res.stdout
