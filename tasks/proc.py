"""Child processes that die with their flow run.

Each child gets its own process group; whatever ends the caller (an exception, Prefect's
cancellation, SIGTERM) ends the whole group, so no stage process outlives its flow run or keeps
its ports. The group gets SIGTERM first and `grace` seconds to finish (the train stage uses
them to checkpoint its step); whatever is left then is killed.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from dspark.procs import die_with_parent, stop_processes

GRACE_S = 10.0


def _drain(proc: subprocess.Popen, on_line: Callable[[str], None] | None) -> None:
    for line in proc.stdout:
        if on_line:
            try:
                on_line(line.rstrip("\n"))
            except Exception:
                on_line = None  # the caller is going away: read on, say nothing
    proc.stdout.close()


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
        preexec_fn=die_with_parent,
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
        # Keep reading while the group stops: a stage saving its work must not block on (or
        # die of) a full pipe. What it says then goes to `on_line` as long as that works.
        drain = threading.Thread(target=_drain, args=(proc, on_line), daemon=True)
        drain.start()
        stop_processes([proc], grace=grace, group=True)
        drain.join(timeout=1.0)
        if ticker:
            ticker.join(timeout=every_s + 1)
    if every:
        every()
    return proc.returncode, "".join(lines)
