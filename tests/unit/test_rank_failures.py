"""Which spawned ranks rank 0 reports as failed after it stopped them all."""

import json
import signal
import subprocess
import sys

from dspark import errors
from dspark.train.distributed import RankFailed, error_file, failed_ranks


def exited(code_or_signal: int, tmp_path, rank: int) -> subprocess.Popen:
    """A finished process: its status is `code_or_signal` (negative: killed by that signal)."""
    (tmp_path / f"rank-{rank}.log").write_text("last words\n")
    if code_or_signal < 0:
        cmd = f"import os, signal; os.kill(os.getpid(), {-code_or_signal})"
    else:
        cmd = f"raise SystemExit({code_or_signal})"
    proc = subprocess.Popen([sys.executable, "-c", cmd])
    proc.wait()
    return proc


def test_a_rank_stopped_while_exiting_with_its_error_file_still_failed(tmp_path):
    job = tmp_path / "job.json"
    error = {"kind": "DataError", "message": "no sample 7"}
    error_file(job, 1).write_text(json.dumps(error))
    procs = {1: exited(-signal.SIGTERM, tmp_path, 1), 2: exited(-signal.SIGTERM, tmp_path, 2)}
    [failure] = failed_ranks(procs, job)
    assert isinstance(failure, errors.DataError)
    assert str(failure) == "train rank 1: no sample 7"


def test_a_rank_that_crashed_without_an_error_file_fails_with_its_last_line(tmp_path):
    job = tmp_path / "job.json"
    procs = {1: exited(0, tmp_path, 1), 2: exited(3, tmp_path, 2)}
    [failure] = failed_ranks(procs, job)
    assert isinstance(failure, RankFailed)
    assert str(failure) == "train rank 2 exited with status 3: last words"
