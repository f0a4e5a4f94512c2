"""GPU check of the trainer (`train.device: cuda`): no vLLM, no model download, seconds.

Trains the smoke profile's two drafts for six steps on synthetic hidden states, the way the
train stage builds them (`build_runs`, `Trainer`), and checks:

  steps     the six steps moved the weights (else every comparison below is void)
  device    the drafts trained on the GPU match the same run on the CPU
  resume    a GPU run stopped at step 3 and resumed from its checkpoint (it must say it resumed
            there) matches one that never stopped (moments back on the GPU, `step` on the host)
  ranks     with two or more GPUs, two NCCL ranks (one GPU each) match one process

Runs are compared by what training changed: |a - b| / |b - init| over all weights (L2), at most
1e-2. Max-abs tolerances cannot tell devices apart here: Adam moves every weight by about lr a
step whatever its gradient, so one tiny gradient of flipped sign differs by 2 lr, as much as a
real bug. Every check prints one line (`gpu-check: PASS|FAIL|SKIP ...`); OUT/train_check.json
holds the figures. `--device cpu` runs the same on the CPU (gloo ranks): its plumbing is what
tests/unit/test_gpu_check.py runs here. Exit 0 pass, 1 a check failed, 2 no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext, suppress
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dspark.config import Params, load_params  # noqa: E402
from dspark.models.layers import RMSNorm  # noqa: E402
from dspark.models.vocab import build_draft_ids, count_tokens  # noqa: E402
from dspark.schema import Sample  # noqa: E402
from dspark.train.batch import TargetHead  # noqa: E402
from dspark.train.checkpoint import host_tensors  # noqa: E402
from dspark.train.distributed import Ranks, backend  # noqa: E402
from dspark.train.sources import Source  # noqa: E402
from dspark.train.stage import build_runs  # noqa: E402
from dspark.train.trainer import Trainer  # noqa: E402

PREFIX = "gpu-check:"
MAX_REL = 1e-2  # |a - b| / |b - init|: what training changed, not the weights themselves
NUM, EVAL = 11, 2  # samples; the first EVAL are held out
TARGET = {  # a small Llama-shaped target, random: the check is about devices, not quality
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "vocab_size": 2048,
    "num_hidden_layers": 4,
}


def params(device: str) -> Params:
    return load_params(
        ROOT / "params.yaml",
        profile="smoke",
        overrides=[
            f"train.device={device}",
            f"train.eval_samples={EVAL}",
            "train.epochs=2",  # 9 samples in batches of 4: six steps, the last one short
            "train.batch_size=4",
            "train.checkpoint_every=3",
            "train.dspark.max_anchors=6",  # fewer than a row has: ranks replay the draws
            "train.draft_vocab_size=256",
        ],
    )


def synthetic_target(config: dict = TARGET) -> SimpleNamespace:
    """What build_runs reads of a loaded target (random, of `config`'s shape): config,
    embeddings, final norm, lm_head."""
    torch.manual_seed(1)
    h, v = config["hidden_size"], config["vocab_size"]
    return SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(to_dict=lambda: dict(config))),
        embed=nn.Embedding(v, h),
        norm=RMSNorm(h, 1e-5),
        lm_head=nn.Linear(h, v, bias=False),
        vocab_size=v,
    )


def synthetic_samples(
    shapes: Sequence[tuple[int, int]], aux_layers: int, hidden: int, vocab: int, seed: int = 0
) -> list[Sample]:
    """One sample per (length, prompt length): random ids, aux and last hidden states, with the
    tokens after the prompt in the loss."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (s, prompt) in enumerate(shapes):
        mask = torch.zeros(s, dtype=torch.bool)
        mask[prompt:] = True
        ids = torch.randint(10, vocab, (s,), generator=gen, dtype=torch.int32)
        aux = torch.randn(aux_layers, s, hidden, generator=gen)
        out.append(Sample(i, ids, mask, aux, torch.randn(s, hidden, generator=gen)))
    return out


def train(
    device: str, checkpoint: Path, ranks: Ranks | None = None, stop_at: int | None = None
) -> tuple[torch.Tensor, int | None]:
    """Train both drafts; -> every weight flattened into one host vector (rank 0's, with
    ranks), and the step the run resumed from."""
    p = params(device)
    target = synthetic_target()
    aux = [1, 2, 3]
    shapes = [(20 + 4 * i, 6) for i in range(NUM)]
    samples = synthetic_samples(shapes, len(aux), TARGET["hidden_size"], TARGET["vocab_size"])
    draft_ids = build_draft_ids(count_tokens(samples[EVAL:], TARGET["vocab_size"]), 256)
    where = ranks.device if ranks else torch.device(device)
    trainer = Trainer(
        cfg=p.train,
        runs=build_runs(p, target, draft_ids, aux, 3, where),
        head=TargetHead(target.norm, target.lm_head, draft_ids).to(where),
        checkpoint_dir=checkpoint,
        fingerprint="gpu-check",
        progress=False,
        ranks=ranks,
    )
    step = trainer._train_step

    def until(batch, total):
        if trainer.step == stop_at:  # the same step on every rank, before its collectives
            raise KeyboardInterrupt
        step(batch, total)

    trainer._train_step = until
    with suppress(KeyboardInterrupt):
        trainer.fit(
            lambda ids: nullcontext(Source(iter([samples[i] for i in sorted(ids)]))),
            list(range(EVAL, NUM)),
            list(range(EVAL)),
        )
    tensors = [
        v.float().flatten()
        for r in trainer.runs
        for _, v in sorted(host_tensors(r.model.state_dict()).items())
    ]
    return torch.cat(tensors), trainer.resumed_from


def relative(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor) -> float:
    """|a - b| / |b - init|: how far a is from b, in units of what training moved b."""
    return float((a - b).norm() / (b - init).norm().clamp_min(1e-12))


def _rank(rank: int, world: int, device: str, rendezvous: str, out: str) -> None:
    where = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(where)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend(device), init_method=rendezvous, rank=rank, world_size=world)
    try:
        weights, _ = train(device, Path(out) / "ckpt", Ranks(rank, world, where))
        if rank == 0:
            save_file({"weights": weights}, Path(out) / "rank0.safetensors")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.gettempdir())))
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print(f"{PREFIX} FAIL train: torch sees no CUDA device", flush=True)
        return 2
    if dev == "cuda":  # full float32 matmuls, as on the CPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report: dict = {"device": dev, "checks": {}}
    try:
        checks = run_checks(dev)
    except Exception as e:  # one line, and the report still written
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"{PREFIX} FAIL train: {report['error']}", flush=True)
        checks = {}
    for name, (figure, ok) in checks.items():
        report["checks"][name] = {"figure": figure, "ok": ok}
        verdict = "PASS" if ok else "FAIL"
        print(f"{PREFIX} {verdict} train {name} on {dev} ({figure:.2e})", flush=True)
    report["ok"] = bool(checks) and all(ok for _, ok in checks.values())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_check.json").write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def run_checks(dev: str) -> dict[str, tuple[float, bool]]:
    """name -> (figure, passed): the update's norm for `steps`, else the relative difference."""
    with tempfile.TemporaryDirectory(prefix="dspark-train-check-") as tmp:
        tmp = Path(tmp)
        init, _ = train("cpu", tmp / "init", stop_at=0)  # seeded on the host, then moved
        cpu, _ = train("cpu", tmp / "cpu")
        here, _ = train(dev, tmp / "dev")
        moved = float((cpu - init).norm())
        checks = {"steps": (moved, moved > 1e-3)}
        rel = relative(here, cpu, init)
        checks["device"] = (rel, rel <= MAX_REL)
        train(dev, tmp / "resume", stop_at=3)
        resumed, at = train(dev, tmp / "resume")
        rel = relative(resumed, here, init)
        checks["resume"] = (rel, at == 3 and rel <= MAX_REL)
        world = min(2, torch.cuda.device_count()) if dev == "cuda" else 2
        if world >= 2:
            rendezvous = f"file://{tmp / 'rendezvous'}"
            mp.spawn(_rank, args=(world, dev, rendezvous, str(tmp)), nprocs=world)
            rel = relative(load_file(tmp / "rank0.safetensors")["weights"], here, init)
            checks["ranks"] = (rel, rel <= MAX_REL)
        else:
            print(f"{PREFIX} SKIP train ranks: one GPU (NCCL ranks need a GPU each)", flush=True)
    return checks


if __name__ == "__main__":
    sys.exit(main())
