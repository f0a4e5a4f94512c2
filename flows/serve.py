"""`dspark serve`: bootstrap the work pool and the deployment `dspark/full`, then run a worker.

The pool is a `process` pool with a concurrency limit of 1: one pipeline at a time, since every
run shares this checkout's params.yaml, DVC workspace and artifacts. Stop it with Ctrl-C or
SIGTERM; the worker is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound

from flows.full import ROOT, dspark

POOL = os.environ.get("DSPARK_POOL", "dspark")
BIN = Path(sys.executable).parent


def ensure_pool(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=1))
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=1))


def deploy(pool: str) -> str:
    deployment = dspark.from_source(source=str(ROOT), entrypoint="flows/full.py:dspark")
    return str(
        deployment.deploy(
            name="full",
            work_pool_name=pool,
            print_next_steps=False,
            parameters={"profile": "default", "root": str(ROOT)},
            concurrency_limit=1,
        )
    )


def main() -> int:
    ensure_pool(POOL)
    deployment_id = deploy(POOL)
    print(
        f"deployment dspark/full ({deployment_id}) on work pool {POOL!r}; starting a worker",
        flush=True,
    )
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    worker = subprocess.Popen(
        [
            str(BIN / "prefect"),
            "worker",
            "start",
            "--pool",
            POOL,
            "--type",
            "process",
            "--limit",
            "1",
        ],
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )

    def stop(signum, _frame):
        # The worker ignores SIGTERM for a while; SIGINT makes it shut down cleanly.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return worker.wait()
    finally:
        # Flow runs the worker left behind. The leader is reaped, but while any member lives
        # the group's id cannot be given to a new process, so this reaches only them.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
