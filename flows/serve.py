"""`dspark serve`: bootstrap the work pool and the deployment `dspark/full`, then run a worker.

The pool is a `process` pool with a concurrency limit of 1: one pipeline at a time, since every
run shares this checkout's params.yaml, DVC workspace and artifacts.

Stop it with Ctrl-C or SIGTERM (what systemd, supervisord or a container runtime sends): the
worker takes no new run, each flow run it is running stops as a cancelled one does (its stage
saves what resumes it, within the stage's own grace), and whatever is left after
`STOP_GRACE_S` is killed, in whatever session or process group it runs (`procs.supervise`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound

from dspark.pipeline import STAGES
from dspark.procs import supervise
from flows.full import ROOT, dspark

POOL = os.environ.get("DSPARK_POOL", "dspark")
BIN = Path(sys.executable).parent
# The longest a stage takes to stop when asked (train: a step and its checkpoint), and time for
# its flow run to report; the worker then has procs.SETTLE_S to follow.
STOP_GRACE_S = max(s.stop_grace_s for s in STAGES) + 20.0


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
    argv = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"]
    # SIGINT: the worker's own graceful stop (on SIGTERM it sends itself SIGINT, and on a
    # second signal SIGKILL).
    return supervise(
        [*argv, "--limit", "1"],
        cwd=ROOT,
        env=env,
        grace=STOP_GRACE_S,
        ask=signal.SIGINT,
        say=lambda line: print(f"dspark serve: {line}", flush=True),
    )


if __name__ == "__main__":
    sys.exit(main())
