"""Data-parallel training over torch.distributed: N ranks share every global batch.

    rank 0     the train stage's own process; it alone writes outputs (drafts, checkpoint,
               curves, metrics) and evaluates
    rank 1..   `python -m dspark.train.rank JOB.json`, started by rank 0 with torchrun's
               environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) on this machine
    torchrun   or every rank is `dspark train` under `torchrun --nproc-per-node N` (several
               nodes too): each joins the launcher's group; rank 0 still writes alone

Each rank takes a contiguous slice of each planned batch (sizes differ by at most one), reads
or streams only those samples, and wraps every draft in DDP. Results do not depend on the world
size: the losses are normalized by the global batch (`slot_losses`' `total`), so the gradients
DDP reduces add up to one process's, and a rank replays the anchor draws of the rows lower
ranks hold. The backend follows `train.device`: gloo between CPU ranks, NCCL between GPU ranks
(one GPU each, cuda:LOCAL_RANK).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dspark import errors
from dspark.procs import stop_processes
from dspark.stopping import SIGNALS, Stopped
from dspark.train.losses import AcceptanceStats

if TYPE_CHECKING:
    from dspark.config import Params

RANK_MODULE = "dspark.train.rank"  # what a spawned rank runs (`python -m`): it imports the stage
CPU = torch.device("cpu")
HOST = "127.0.0.1"  # every rank runs on this machine
START_TIMEOUT = timedelta(seconds=180)  # a rank's imports on a loaded 2-core machine
# How long a rank waits in a collective while rank 0 works alone (evaluating, checkpointing,
# starting the stream): NCCL's own default is 10 minutes.
GROUP_TIMEOUT = START_TIMEOUT * 10
# torch 2.13 renamed DDP's broadcast_buffers (deprecated there) to forward_sync_buffers; a GPU
# image may carry an older torch.
_DDP_PARAMS = inspect.signature(DistributedDataParallel.__init__).parameters
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in _DDP_PARAMS
    else {"broadcast_buffers": False}
)


def backend(device: str) -> str:
    """The collectives' library for `train.device`: gloo moves CPU tensors, NCCL CUDA ones."""
    return "nccl" if device == "cuda" else "gloo"


def check_gpus(device: str, local_ranks: int) -> None:
    """`local_ranks` ranks on this node can each have a GPU of their own (when on cuda)."""
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise errors.ResourceError("train.device: cuda, but torch sees no GPU on this machine")
    if local_ranks > torch.cuda.device_count():
        raise errors.ResourceError(
            f"train.device: cuda: {local_ranks} ranks on this node need a GPU each, and it has "
            f"{torch.cuda.device_count()}"
        )


def rank_device(device: str, local_rank: int = 0) -> torch.device:
    """Where this rank trains: the CPU, or its own GPU (cuda:LOCAL_RANK), made current so that
    NCCL's object collectives run there."""
    if device == "cpu":
        return CPU
    check_gpus(device, local_rank + 1)
    here = torch.device("cuda", local_rank)
    torch.cuda.set_device(here)
    return here


@dataclass(frozen=True)
class Ranks:
    """This process's place in the process group, and the collectives the trainer uses."""

    rank: int
    world: int
    device: torch.device = CPU  # where the collectives' tensors must live

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, ids: list[int]) -> list[int]:
        """This rank's contiguous slice of a global batch (empty when it is shorter than the
        world: a short last batch)."""
        n = len(ids)
        return ids[self.rank * n // self.world : (self.rank + 1) * n // self.world]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, on `t`'s device (reduced on the backend's)."""
        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


@dataclass(frozen=True)
class Part:
    """What a rank's training step needs to know of the rest of the global batch."""

    ranks: Ranks
    rows_before: list[int]  # anchor candidates of each row the lower ranks hold, in order
    tokens: int  # tokens of the whole global batch

    @classmethod
    def gather(cls, ranks: Ranks, candidates: list[int], tokens: int) -> Part:
        everyone = ranks.gather((candidates, tokens))
        before = [n for rows, _ in everyone[: ranks.rank] for n in rows]
        return cls(ranks, before, sum(t for _, t in everyone))

    def reduce(
        self, losses: dict[str, torch.Tensor], stats: AcceptanceStats
    ) -> dict[str, torch.Tensor]:
        """The global batch's losses (each rank holds its share) and acceptance sums, in one
        all-reduce; `stats` is updated in place."""
        names = sorted(losses)
        m, k = len(names), stats.k
        flat = torch.cat(
            (
                torch.stack([losses[n].double().cpu() for n in names]),
                stats.accept_sum,
                stats.slot_count,
                torch.tensor([stats.tau_sum, stats.blocks], dtype=torch.float64),
            )
        )
        flat = self.ranks.sum(flat)
        stats.accept_sum, stats.slot_count = flat[m : m + k], flat[m + k : m + 2 * k]
        stats.tau_sum, stats.blocks = float(flat[-2]), int(flat[-1])
        return dict(zip(names, flat[:m], strict=True))


class _Objective(nn.Module):
    """A draft and its objective as one module: DDP arms its gradient all-reduce in `forward`,
    and the drafts train through `forward_train`/`forward_ttt`, called by the objective."""

    def __init__(self, model: nn.Module, objective: Callable):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch, gen: torch.Generator | None) -> dict:
        return self.objective(self.model, batch, gen)


def data_parallel(model: nn.Module, objective: Callable, device: torch.device) -> nn.Module:
    """(batch, generator) -> the objective's dict, with the gradients averaged over the ranks
    on backward. Buffers are constants (identical on every rank): no broadcast per forward."""
    return DistributedDataParallel(
        _Objective(model, objective),
        device_ids=[device.index] if device.type == "cuda" else None,
        **NO_BUFFER_SYNC,
    )


# --- launch --------------------------------------------------------------------------------------


def under_launcher() -> bool:
    """Started by torchrun (or a launcher like it): every rank runs the stage itself."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@contextmanager
def join_launcher(params: Params) -> Iterator[Ranks]:
    """This process's place in a group torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT), for as long as the stage runs."""
    world = int(os.environ["WORLD_SIZE"])
    if world != params.train.world_size:
        raise errors.ConfigError(
            f"train.world_size: {params.train.world_size}, but the launcher started {world} ranks"
        )
    device = rank_device(params.train.device, int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(
        backend(params.train.device), init_method="env://", timeout=GROUP_TIMEOUT
    )
    try:
        yield Ranks(int(os.environ["RANK"]), world, device)
    finally:
        dist.destroy_process_group()


class RankFailed(RuntimeError):
    """Another rank exited with an error that is not a dspark error (its log's last line)."""


@contextmanager
def spawn_ranks(params: Params, paths: Any) -> Iterator[Ranks]:
    """Start ranks 1..N-1 as processes on this machine and join them as rank 0; on exit, wait
    for them (or stop them, on an error) and leave the process group. `paths` is the stage's
    `TrainPaths` (a dataclass), sent to the ranks as JSON.

    A rank's dspark error comes back as its own type, naming the rank."""
    world = params.train.world_size
    check_gpus(params.train.device, world)  # before any rank starts, not in a hung collective
    store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="dspark-ranks-") as tmp:
        job = Path(tmp) / "job.json"
        doc = {"params": params.model_dump(mode="json"), "paths": asdict(paths)}
        job.write_text(json.dumps(doc, default=str))
        procs = {r: _start(r, world, store.port, job) for r in range(1, world)}
        try:
            _wait_ready(store, procs, job)
            device = rank_device(params.train.device, 0)
            dist.init_process_group(
                backend(params.train.device),
                store=store,
                rank=0,
                world_size=world,
                timeout=GROUP_TIMEOUT,
            )
            yield Ranks(0, world, device)
            for r, proc in procs.items():
                if proc.wait(120) != 0:
                    raise _failure(r, proc, job)
        except BaseException as e:
            # Stop the others while the group is up: one that saw it close would report that.
            stop_processes(procs.values())
            failed = failed_ranks(procs, job)
            # A rank's own error is the cause of a collective that broke under rank 0.
            if failed and not isinstance(e, errors.DsparkError | RankFailed | Stopped):
                raise failed[0] from e
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def failed_ranks(procs: dict[int, subprocess.Popen], job: Path) -> list[Exception]:
    """The errors of the ranks that failed on their own, after rank 0 stopped them all.

    A rank that left its error file failed whatever its exit status: it leaves the group
    after writing the file, so rank 0 can see the collective break and stop it while it is
    still exiting (its status then reads as stopped; CI saw this)."""
    # None: stuck in the kernel. 128 + signal: stopped on request, like rank 0.
    stopped = (0, -signal.SIGTERM, -signal.SIGKILL, None, *(128 + s for s in SIGNALS))
    return [
        _failure(r, p, job)
        for r, p in procs.items()
        if error_file(job, r).is_file() or p.returncode not in stopped
    ]


def _start(rank: int, world: int, port: int, job: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
    }
    log = open(job.with_name(f"rank-{rank}.log"), "w")  # noqa: SIM115 - the child owns it
    cmd = [sys.executable, "-m", RANK_MODULE, str(job)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_ready(store: dist.TCPStore, procs: dict[int, subprocess.Popen], job: Path) -> None:
    """Every rank has connected; a rank that dies first fails here, not after the
    process group's 30-minute timeout."""
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    for r, proc in procs.items():
        while not store.check([f"ready/{r}"]):
            if proc.poll() is not None:
                raise _failure(r, proc, job)
            if time.monotonic() > deadline:
                raise RankFailed(f"train rank {r} did not start within {START_TIMEOUT}")
            time.sleep(0.1)


def _failure(rank: int, proc: subprocess.Popen, job: Path) -> Exception:
    """A rank's error file (a dspark error, re-raised as its type) or its log's last line."""
    error = error_file(job, rank)
    if error.is_file():
        doc = json.loads(error.read_text())
        kind = getattr(errors, doc["kind"], None)
        if isinstance(kind, type) and issubclass(kind, errors.DsparkError):
            return kind(f"train rank {rank}: {doc['message']}")
    lines = job.with_name(f"rank-{rank}.log").read_text().strip().splitlines()
    tail = lines[-1] if lines else "no output"
    return RankFailed(f"train rank {rank} exited with status {proc.returncode}: {tail}")


def error_file(job: Path, rank: int) -> Path:
    """Where a spawned rank leaves its dspark error (`rank.main`) for rank 0 to raise."""
    return job.with_name(f"rank-{rank}.error")
