"""A spawned training rank (1..N-1 of `distributed.spawn_ranks`), its own process:

    python -m dspark.train.rank JOB.json

It joins rank 0's group from torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), trains its share of every batch, and leaves a dspark error where rank
0 reads it (`rank-R.error` beside the job file). The entry lives here, not in distributed.py,
so that distributed.py need not import the stage that imports it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from dspark import errors
from dspark.config import Params
from dspark.stopping import Stopped
from dspark.train.distributed import (
    GROUP_TIMEOUT,
    START_TIMEOUT,
    Ranks,
    backend,
    error_file,
    rank_device,
)
from dspark.train.stage import TrainPaths, train_rank


def main(argv: list[str] | None = None) -> int:
    job = Path((sys.argv[1:] if argv is None else argv)[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    doc = json.loads(job.read_text())
    params = Params.model_validate(doc["params"])
    paths = TrainPaths(**{k: None if v is None else Path(v) for k, v in doc["paths"].items()})
    store = dist.TCPStore(host, port, world, is_master=False, timeout=START_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    try:
        device = rank_device(params.train.device, int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            backend(params.train.device),
            store=store,
            rank=rank,
            world_size=world,
            timeout=GROUP_TIMEOUT,
        )
        train_rank(params, paths, progress=False, ranks=Ranks(rank, world, device))
    except errors.DsparkError as e:
        error = {"kind": type(e).__name__, "message": str(e)}
        # Whole before it appears: rank 0 may read it the moment this rank leaves the group.
        path = error_file(job, rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(error))
        tmp.replace(path)
        return 2
    except Stopped as e:  # rank 0 says so, and wrote the checkpoint
        return e.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
