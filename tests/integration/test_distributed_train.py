"""Data-parallel training: two gloo ranks train what one process trains on the same global
batches, resume from rank 0's checkpoint, and mismatched configs are rejected.

Tolerance: the ranks pad and reduce in other shapes and orders than one process, so the
weights agree to float32 rounding, not bit for bit: we require |a - b| <= 1e-5 + 1e-4 |b| on
every tensor. Measured: 1.5e-7. Without the global loss normalization or the replayed anchor
draws the drafts differ by 2e-3 to 4e-3 after these 6 steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from dspark.config import Params, check_ranks, load_params
from dspark.data.shards import TokenSample, write_manifest, write_shard
from dspark.errors import ConfigError, DataError, ResourceError
from dspark.extract.capture import HiddenStateCapture, resolve_aux_layers
from dspark.models.target import load_target
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.train.batch import TargetHead
from dspark.train.distributed import Ranks, backend, rank_device
from dspark.train.sources import HiddenShards, Source, epoch_plan
from dspark.train.stage import TrainPaths, build_runs, train_stage
from dspark.train.trainer import Trainer
from dspark.transport.files import HiddenShardWriter

from ..conftest import ROOT, skip_or_fail

RTOL, ATOL = 1e-4, 1e-5
NUM = 11  # 2 held out, 9 to train: batches of 4, 4 and 1, so rank 1 sits out the last one


def smoke(*sets: str) -> Params:
    return load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            "prepare.engine=hf",  # the online tests stream answered shards
            "extract.mode=offline",
            "train.draft_vocab_size=256",
            "train.batch_size=4",
            "train.epochs=2",
            "train.eval_samples=2",
            "train.eval_points=3",
            "train.checkpoint_every=3",
            "train.dspark.block_size=4",
            "train.dspark.markov_rank=16",
            "train.dspark.max_anchors=6",  # fewer than most rows have: the draws are replayed
            *sets,
        ],
    )


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """Token shards and the hidden-state shards an offline extract would write."""
    folder = tmp_path_factory.mktemp("dp-data")
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(NUM):
        s = 20 + 4 * i
        ids = torch.randint(10, 2000, (s,), generator=gen, dtype=torch.int32)
        mask = torch.zeros(s, dtype=torch.bool)
        mask[6:] = True
        samples.append(TokenSample(i, f"p{i}", ids, mask))
    shards = folder / "shards"
    shards.mkdir()
    entry = write_shard(shards / "shard-00000.safetensors", samples, regenerated=0, fingerprint="")
    write_manifest(shards, [entry], {})
    aux = resolve_aux_layers(smoke().extract.aux_layers, tiny_target.num_layers)
    # with the target's top-k the producers send, so online and offline train on one thing
    capture = HiddenStateCapture(tiny_target, aux, "float32", smoke().extract.target_topk)
    writer = HiddenShardWriter(folder / "hidden", shard_size=4, keep_payload=True)
    for s in samples:
        writer.add(capture(s))
    capture.close()
    writer.close({"aux_layers": aux})
    return shards, folder / "hidden"


def stage_paths(tiny_target_dir: Path, data: tuple[Path, Path], out: Path) -> TrainPaths:
    return TrainPaths(
        target=tiny_target_dir,
        shards=data[0],
        hidden=data[1],
        drafts=out / "drafts",
        checkpoint=out / "checkpoint",
        curves_csv=out / "curves.csv",
        curves_png=out / "curves.png",
        events=out / "events.jsonl",
    )


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=f"{what}: {k}")


def drafts(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {d.name: load_file(d / "model.safetensors") for d in sorted(folder.iterdir())}


@pytest.mark.slow
def test_two_ranks_train_every_draft_as_one_process_does(tiny_target_dir, data, tmp_path):
    """The whole stage, rank 1 spawned by it: the DSpark draft, its Markov ablations, DFlash and
    EAGLE-3 (its chains sampled, so rank 1 replays rank 0's draws) come out as one process
    trains them, and only rank 0 writes."""
    one = train_stage(
        smoke("train.markov_ablation=true", "train.eagle3.max_anchors=6"),
        stage_paths(tiny_target_dir, data, tmp_path / "1"),
        progress=False,
    )
    paths = stage_paths(tiny_target_dir, data, tmp_path / "2")
    two = train_stage(
        smoke("train.markov_ablation=true", "train.eagle3.max_anchors=6", "train.world_size=2"),
        paths,
        progress=False,
    )

    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 6
    assert two["tokens"] == one["tokens"]
    got, want = drafts(paths.drafts), drafts(tmp_path / "1" / "drafts")
    assert set(got) == {"dspark", "dspark_gated", "dspark_rnn", "dspark_rank0", "dflash", "eagle3"}
    for name in want:
        assert_close(got[name], want[name], name)
    for name in ("dspark", "eagle3"):
        a, b = two[name]["curve"], one[name]["curve"]
        assert [p[1] for p in a] == [p[1] for p in b]  # evaluated at the same tokens
        assert [p[2] for p in a] == pytest.approx([p[2] for p in b], rel=1e-3)
    events = [json.loads(line) for line in paths.events.read_text().splitlines()]
    losses = [e["metrics"]["dspark/loss"] for e in events if "dspark/loss" in e["metrics"]]
    assert len(losses) == 6  # one line per step, from rank 0 only


def _rank(rank: int, world: int, job: dict) -> None:
    """One rank of the resume test: train until step 4 (rank 0 checkpoints at 3), then train
    again from the checkpoint; rank 0 keeps the final weights."""
    dist.init_process_group("gloo", init_method=job["init"], rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)  # two ranks share the cores
        ranks = Ranks(rank, world)
        trainer, source = trainer_on_shards(job, ranks, stop_at=4)
        with pytest.raises(KeyboardInterrupt):
            trainer.fit(source, job["train"], job["eval"])
        trainer, source = trainer_on_shards(job, ranks)
        trainer.fit(source, job["train"], job["eval"])
        assert trainer.resumed_from == 3 and trainer.step == 6
        if ranks.leader:
            for run in trainer.runs:
                tensors = {k: v.contiguous() for k, v in run.model.state_dict().items()}
                save_file(tensors, Path(job["out"]) / f"{run.name}.safetensors")
    finally:
        dist.destroy_process_group()


def trainer_on_shards(job: dict, ranks: Ranks | None, stop_at: int | None = None):
    """A trainer of the smoke drafts on the hidden shards, interrupted before step `stop_at`,
    and its source factory."""
    params = Params.model_validate(job["params"])
    target = load_target(Path(job["target"]))
    shards = HiddenShards(Path(job["hidden"]))
    counts = count_tokens(shards.read(job["train"]), target.vocab_size)
    draft_ids = build_draft_ids(counts, params.train.draft_vocab_size)
    aux = resolve_aux_layers(params.extract.aux_layers, target.num_layers)
    trainer = Trainer(
        cfg=params.train,
        runs=build_runs(params, target, draft_ids, aux, mask_id=3),
        head=TargetHead(target.norm, target.lm_head, draft_ids),
        checkpoint_dir=Path(job["checkpoint"]),
        fingerprint="test",
        progress=False,
        ranks=ranks,
    )
    step = trainer._train_step

    def interrupted(samples, total):
        if trainer.step == stop_at:  # the same step on every rank, before its collectives
            raise KeyboardInterrupt("simulated interruption")
        step(samples, total)

    trainer._train_step = interrupted
    return trainer, lambda ids: nullcontext(Source(shards.read(sorted(ids))))


@pytest.mark.slow
def test_two_ranks_resume_from_the_checkpoint_rank_0_wrote(tiny_target_dir, data, tmp_path):
    params = smoke()
    job = {
        "init": f"file://{tmp_path / 'rendezvous'}",
        "params": params.model_dump(mode="json"),
        "target": str(tiny_target_dir),
        "hidden": str(data[1]),
        "checkpoint": str(tmp_path / "checkpoint"),
        "out": str(tmp_path),
        "train": list(range(2, NUM)),
        "eval": [0, 1],
    }
    whole, source = trainer_on_shards({**job, "checkpoint": str(tmp_path / "whole")}, None)
    whole.fit(source, job["train"], job["eval"])
    mp.spawn(_rank, args=(2, job), nprocs=2)
    for run in whole.runs:
        got = load_file(tmp_path / f"{run.name}.safetensors")
        assert_close(got, run.model.state_dict(), run.name)


def test_online_world_size_must_match_the_stream_consumers(tmp_path):
    """Rejected before anything loads; offline, the ranks read shards and any count does."""
    params = smoke("extract.mode=online", "train.world_size=2")
    with pytest.raises(ConfigError, match=r"^train\.world_size: 2 ranks, but extract\.consumers"):
        train_stage(params, stage_paths(tmp_path, (tmp_path, tmp_path), tmp_path))
    check_ranks(smoke("train.world_size=2").train, smoke().extract)  # offline: any consumers
    with pytest.raises(ConfigError, match=r"train\.world_size: .*a rank would never get a sample"):
        smoke("train.world_size=8")


def test_cuda_without_a_gpu_is_refused_before_any_rank_starts(tiny_target_dir, data, tmp_path):
    """NCCL between GPU ranks is the cuda path (infra/gpu/check.sh runs it); on a machine
    without one, the stage says so in one line, with no rank started and nothing written."""
    if torch.cuda.is_available():
        skip_or_fail("a GPU is here: this checks the refusal without one")
    assert (backend("cpu"), backend("cuda")) == ("gloo", "nccl")
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ResourceError, match=r"^train\.device: cuda, but torch sees no GPU"):
        rank_device("cuda")
    for world in (1, 2):
        paths = stage_paths(tiny_target_dir, data, tmp_path / str(world))
        with pytest.raises(ResourceError, match=r"^train\.device: cuda"):
            train_stage(smoke("train.device=cuda", f"train.world_size={world}"), paths)
        assert not paths.drafts.exists() and not paths.checkpoint.exists()
    with pytest.raises(ConfigError, match=r"train\.device"):
        smoke("train.device=tpu")


@pytest.mark.slow
def test_two_ranks_each_consume_their_share_of_the_stream(tiny_target_dir, data, tmp_path):
    """Online: each rank is one consumer of one stream (its own coordinator, the same
    producers), and trains what one process trains offline on the same hidden states."""
    offline = tmp_path / "offline"
    train_stage(
        smoke("train.epochs=1"), stage_paths(tiny_target_dir, data, offline), progress=False
    )
    paths = stage_paths(tiny_target_dir, data, tmp_path / "online")
    online = smoke(
        "train.epochs=1",  # the stream is set up once per epoch
        "extract.mode=online",
        "extract.wire_dtype=float32",
        "extract.consumers=2",
        "train.world_size=2",
    )
    out = train_stage(online, paths, progress=False)
    assert out["source"] == "stream" and out["steps"] == 3
    got, want = drafts(paths.drafts), drafts(offline / "drafts")
    for name in want:
        assert_close(got[name], want[name], name)


@pytest.mark.slow
def test_an_error_on_another_rank_fails_the_stage_with_that_error(tiny_target_dir, data, tmp_path):
    """Rank 1 lacks a sample of its first share: rank 0 reports rank 1's own error, and
    the stage leaves no rank behind."""
    params = smoke("train.world_size=2")
    first = epoch_plan(list(range(2, NUM)), 0, params.train.seed, 4, params.train.shuffle_window)
    lost = Ranks(1, 2).share(first[0])[0]
    hidden = tmp_path / "hidden"
    shutil.copytree(data[1], hidden)
    doc = json.loads((hidden / "manifest.json").read_text())
    doc["samples"] = [e for e in doc["samples"] if e["sample_id"] != lost]
    (hidden / "manifest.json").write_text(json.dumps(doc))
    before = children()
    with pytest.raises(DataError, match=rf"^train rank 1: .*no sample {lost}$"):
        train_stage(
            params, stage_paths(tiny_target_dir, (data[0], hidden), tmp_path), progress=False
        )
    assert children() <= before


def children() -> set[int]:
    """This process's live child processes (Linux)."""
    tasks = Path(f"/proc/{os.getpid()}/task").iterdir()
    return {int(pid) for t in tasks for pid in (t / "children").read_text().split()}


TORCHRUN_RANK = """
import json, sys
from pathlib import Path
from dspark.config import Params
from dspark.train.stage import TrainPaths, train_stage
job = json.loads(Path(sys.argv[1]).read_text())
paths = TrainPaths(**{k: Path(v) for k, v in job["paths"].items()})
metrics = train_stage(Params.model_validate(job["params"]), paths, progress=False)
print("METRICS", json.dumps(metrics))
"""


@pytest.mark.slow
def test_torchrun_ranks_train_as_one_process_does(tiny_target_dir, data, tmp_path):
    """`torchrun --nproc-per-node 2` around the stage (what the trainer's Kubernetes Job runs):
    each rank joins the launcher's group and only rank 0 writes."""
    import subprocess
    import sys

    one = train_stage(smoke(), stage_paths(tiny_target_dir, data, tmp_path / "1"), progress=False)
    paths = stage_paths(tiny_target_dir, data, tmp_path / "2")
    job = tmp_path / "job.json"
    doc = {
        "params": smoke("train.world_size=2").model_dump(mode="json"),
        "paths": {k: str(v) for k, v in paths.__dict__.items()},
    }
    job.write_text(json.dumps(doc))
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(job),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [
        json.loads(line.split(" ", 1)[1])
        for line in out.stdout.splitlines()
        if line.startswith("METRICS ")
    ]
    assert sorted(len(r) > 0 for r in reports) == [False, True]  # rank 1 returns nothing
    two = next(r for r in reports if r)
    assert two["world_size"] == 2 and two["steps"] == one["steps"]
    got, want = drafts(paths.drafts), drafts(tmp_path / "1" / "drafts")
    for name in want:
        assert_close(got[name], want[name], name)


STOPPABLE = """
import json, sys
from pathlib import Path
from dspark.config import Params
from dspark.stopping import Stopped
from dspark.train.stage import TrainPaths, train_stage
job = json.loads(Path(sys.argv[1]).read_text())
paths = TrainPaths(**{k: Path(v) for k, v in job["paths"].items()})
try:
    train_stage(Params.model_validate(job["params"]), paths, progress=False)
except Stopped as e:
    print(e, file=sys.stderr)
    sys.exit(e.code)
"""


@pytest.mark.slow
def test_sigterm_to_the_whole_group_checkpoints_the_step_and_resumes(
    tiny_target_dir, data, tmp_path
):
    """What a cancelled flow run or Ctrl-C does to two ranks on a stream: every process in
    the group gets the signal; the ranks agree on one step, rank 0 checkpoints it, the stream
    (producers in sessions of their own) stays up until then, and nothing is left running."""
    import signal
    import subprocess
    import sys
    import time

    from dspark.metrics import read_events
    from dspark.train.checkpoint import read_state

    params = smoke(
        "train.epochs=3",  # 9 steps
        "train.checkpoint_every=100",  # only the stop writes one
        "extract.mode=online",
        "extract.wire_dtype=float32",
        "extract.consumers=2",
        "train.world_size=2",
    )
    paths = stage_paths(tiny_target_dir, data, tmp_path)
    job = tmp_path / "job.json"
    paths_doc = {k: str(v) for k, v in paths.__dict__.items()}
    job.write_text(json.dumps({"params": params.model_dump(mode="json"), "paths": paths_doc}))
    script = tmp_path / "stoppable.py"
    script.write_text(STOPPABLE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(job)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not any("dspark/loss" in e["metrics"] for e in read_events(paths.events)[0]):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.05)
        started = _descendants(proc.pid)  # ranks, producers, the Mooncake master
        assert len(started) >= 4
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("train: stopped at step ") and last.endswith("(run the stage again)")
    step = read_state(paths.checkpoint)["step"]
    assert f"step {step} of 9;" in last and 1 <= step < 9
    assert not paths.drafts.exists()  # the stage did not finish: no drafts
    assert not [p for p in started if _running(p)]

    out = train_stage(params, paths, progress=False)
    assert out["resumed_from_step"] == step and out["steps"] == 9


def _descendants(pid: int) -> list[int]:
    """`pid`'s children, their children and so on (Linux)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
